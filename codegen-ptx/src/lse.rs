//! `flashsample_abi::lse` (the exact, order-independent logsumexp sum) as LLVM IR functions,
//! op for op as the abi writes them, so a row's logsumexp on the GPU is the same bits in
//! every schedule and tile config, and equal to the CPU's for equal logits:
//!
//! - `@fs_lse_term(float x) -> {i32 window, i64 value}`: `LseTerm::of` (non-finite `x`:
//!   `EMPTY_WINDOW`, 0). Columns whose top window is within ±2²² compute the same terms
//!   without conversions instead ([`fast_term`]).
//! - `@fs_lse_finish(i32 w, i128 s0, i128 s1, i128 s2) -> float`: `LseSum::logsumexp`.
//!
//! Merges (`LsePartial::merge`, `LseSum::merge`) are emitted inline by [`merge_all`] and
//! [`warp_merge`]: the joint top window first, then each partial realigned once and added.

use crate::ir::{f32c, f64c, i32c, Agg, Fcmp, Func, Global, Icmp, Int, Operand, Ptr, Value, Var, F32, F64, I1, I128, I32, I64, SCATTER_ITEMS};
use crate::math;
use crate::ptx;
use flashsample_abi::LsePartial;
use std::mem::{offset_of, size_of};
use flashsample_abi::lse::{
    EMPTY_WINDOW, INV_WINDOW, KEPT_WINDOWS, TERM_SCALE, TERM_SCALE_LOG2, WINDOW, WINDOW_LIMIT, WINDOW_WEIGHTS,
};
use flashsample_abi::math::LOG2_E;

/// The struct `@fs_lse_term` returns: the term's window and value.
const TERM_TY: &str = "{ i32, i64 }";

/// Declarations the helpers use beyond the module prelude.
pub(crate) const DECLS: &str = "declare float @llvm.floor.f32(float)
declare double @llvm.nvvm.add.rn.d(double, double)
declare double @llvm.nvvm.mul.rn.d(double, double)
";

/// The word of a partial's sums: `i64` (`abi::LsePartial`, one thread's or one tile's) or
/// `i128` (`abi::LseSum`, a row's).
pub(crate) trait SumWord: Int {
    /// 32-bit words per sum (one shuffle each).
    const WORDS: u32;
}

impl SumWord for I64 {
    const WORDS: u32 = 2;
}

impl SumWord for I128 {
    const WORDS: u32 = 4;
}

/// A logsumexp partial: its top window and the sums of the `KEPT_WINDOWS` windows at and
/// below it.
#[derive(Clone, Debug)]
pub(crate) struct Partial<S> {
    pub(crate) window: I32,
    pub(crate) sums: [S; KEPT_WINDOWS],
}

impl<S: SumWord> Partial<S> {
    /// The empty partial (`LsePartial::EMPTY`, `LseSum::EMPTY`).
    pub(crate) fn empty() -> Self {
        Partial { window: i32c(EMPTY_WINDOW), sums: std::array::from_fn(|_| S::c(0)) }
    }

    /// The window, then the sums: how the helper functions take a partial.
    fn operands(&self) -> Vec<&dyn Operand> {
        std::iter::once(&self.window as &dyn Operand).chain(self.sums.iter().map(|s| s as &dyn Operand)).collect()
    }
}

/// `abi::LsePartial`'s size and its window's offset (the three u64 sums come first).
const PARTIAL_BYTES: u32 = size_of::<LsePartial>() as u32;
const PARTIAL_WINDOW: u32 = offset_of!(LsePartial, window) as u32;

/// Stores partial `p` as `abi::LsePartial` number `index64` of `buffer`.
pub(crate) fn store_partial(f: &mut Func, buffer: &Ptr<Global>, index64: &I64, p: &Partial<I64>) {
    let a = f.gaddr(buffer, index64, PARTIAL_BYTES);
    for (k, v) in p.sums.iter().enumerate() {
        let at = f.offset(&a, 8 * k as u32);
        f.store(v, &at, 8);
    }
    let at = f.offset(&a, PARTIAL_WINDOW);
    f.store(&p.window, &at, 4);
    let at = f.offset(&a, PARTIAL_WINDOW + 4);
    f.store(&i32c(0), &at, 4);
}

/// Loads `abi::LsePartial` number `index64` of `buffer`, its sums widened to u128.
pub(crate) fn load_partial_wide(f: &mut Func, buffer: &Ptr<Global>, index64: &I64) -> Partial<I128> {
    let a = f.gaddr(buffer, index64, PARTIAL_BYTES);
    let sums = std::array::from_fn(|k| {
        let at = f.offset(&a, 8 * k as u32);
        let v: I64 = f.load(&at, 8);
        f.zext(&v)
    });
    let at = f.offset(&a, PARTIAL_WINDOW);
    Partial { window: f.load(&at, 4), sums }
}

/// The window part of `LseTerm::of(x)`: whether `x` counts (finite), `floor(x / 16)` (the
/// remainder's base) and the clamped window (`EMPTY_WINDOW` when `x` does not count).
struct Window {
    finite: I1,
    floor: F32,
    window: I32,
}

fn window_of(f: &mut Func, x: &F32) -> Window {
    let ax = f.fabs(x);
    let finite = f.fcmp(Fcmp::Olt, &ax, &F32::POS_INF);
    let scaled = f.fmul(x, &f32c(INV_WINDOW));
    let floor = f.call("@llvm.floor.f32", &[&scaled]);
    let lim = WINDOW_LIMIT as f32;
    let kc = f.maxnum(&floor, &f32c(-lim));
    let kc = f.minnum(&kc, &f32c(lim));
    // `kc` is an integer in ±WINDOW_LIMIT (NaN became -WINDOW_LIMIT in the max): the plain
    // conversion is exact, with none of the saturating one's range checks.
    let w = f.fptosi(&kc);
    let window = f.sel(&finite, &w, &i32c(EMPTY_WINDOW));
    Window { finite, floor, window }
}

/// `abi::lse::LseTerm::of`.
fn term(attr: &str) -> String {
    let mut f = Func::new();
    let x = F32::named("%x");
    let w = window_of(&mut f, &x);
    let kw = f.fmul(&w.floor, &f32c(WINDOW));
    let rem = f.fsub(&x, &kw);
    let t = math::exp_inline(&mut f, &rem);
    let tt = f.fmul(&t, &f32c(TERM_SCALE));
    // A finite `x` has `tt` in [2^23, 2^47): the plain conversion is exact; a non-finite one's
    // (poison) is never selected.
    let value: I64 = f.fptoui(&tt);
    let value = f.sel(&w.finite, &value, &I64::c(0));
    let r = f.insert(&Agg::undef(TERM_TY), &w.window, 0);
    let r = f.insert(&r, &value, 1);
    f.ret_agg(&r);
    f.finish(&format!("define internal {{ i32, i64 }} @fs_lse_term(float %x) {attr}"))
}

/// The window of `LseTerm::of(x)` alone (`EMPTY_WINDOW` for non-finite `x`): monotone in `x`,
/// so a thread's top window is the window of its largest finite logit.
fn window(attr: &str) -> String {
    let mut f = Func::new();
    let w = window_of(&mut f, &F32::named("%x"));
    f.ret(&w.window);
    f.finish(&format!("define internal i32 @fs_lse_window(float %x) {attr}"))
}

/// Entry `i` of `sums` (of window `from`) realigned to the top window `to`: `sums[i − (to −
/// from)]` or 0, given `shift = to − from ≥ 0`.
fn realigned<S: SumWord>(f: &mut Func, sums: &[S], shift: &I32, i: usize) -> S {
    let mut r = S::c(0);
    for (j, s) in sums.iter().enumerate().take(i + 1) {
        let hit = f.icmp(Icmp::Eq, shift, &i32c((i - j) as u32));
        r = f.sel(&hit, s, &r);
    }
    r
}

/// `abi::lse::u128_to_f64`.
fn u128_to_f64(f: &mut Func, v: &I128) -> F64 {
    let hi = f.lshr(v, &I128::c(64));
    let hi: I64 = f.trunc(&hi);
    let lo: I64 = f.trunc(v);
    let hi: F64 = f.uitofp(&hi);
    let lo: F64 = f.uitofp(&lo);
    let hi = f.fmul(&hi, &f64c(18_446_744_073_709_551_616.0));
    f.fadd(&hi, &lo)
}

/// `abi::lse::LseSum::logsumexp`.
fn finish() -> String {
    let mut f = Func::new();
    let w = I32::named("%w");
    let mut acc = f64c(0.0);
    for (i, wt) in WINDOW_WEIGHTS.iter().enumerate() {
        let v = u128_to_f64(&mut f, &I128::raw(format!("%s{i}")));
        let t = f.fmul(&v, &f64c(*wt));
        acc = f.fadd(&acc, &t);
    }
    let bits: I64 = f.bitcast(&acc);
    let eb = f.lshr(&bits, &I64::c(52));
    let eb = f.and(&eb, &I64::c(2047));
    let eb: I32 = f.trunc(&eb);
    let e = f.sub(&eb, &i32c(1023 + TERM_SCALE_LOG2));
    let mb = f.and(&bits, &I64::c(0x000f_ffff_ffff_ffffu64));
    let mb = f.or(&mb, &I64::c(1023u64 << 52));
    let m: F64 = f.bitcast(&mb);
    let m32: F32 = f.fptrunc(&m);
    let ln_m = math::ln(&mut f, &m32);
    let ln_m: F64 = f.fpext(&ln_m);
    let wd: F64 = f.sitofp(&w);
    let ed: F64 = f.sitofp(&e);
    let a = f.fmul(&wd, &f64c(f64::from(WINDOW)));
    let b = f.fmul(&ed, &f64c(std::f64::consts::LN_2));
    let ab = f.fadd(&a, &b);
    let lse = f.fadd(&ab, &ln_m);
    let lse: F32 = f.fptrunc(&lse);
    // No token: -inf; a saturated top window: ±inf.
    let empty = f.icmp(Icmp::Eq, &I128::named("%s0"), &I128::c(0));
    let high = f.icmp(Icmp::Sge, &w, &i32c(WINDOW_LIMIT));
    let low = f.icmp(Icmp::Sle, &w, &i32c(-WINDOW_LIMIT));
    let r = f.sel(&high, &F32::POS_INF, &lse);
    let low = f.or(&low, &empty);
    let r = f.sel(&low, &F32::NEG_INF, &r);
    f.ret(&r);
    f.finish("define internal float @fs_lse_finish(i32 %w, i128 %s0, i128 %s1, i128 %s2) #0")
}

/// `@fs_lse_finish`: the logsumexp of row sum `sum`.
pub(crate) fn finish_call(f: &mut Func, sum: &Partial<I128>) -> F32 {
    f.call("@fs_lse_finish", &sum.operands())
}

/// The accumulator's helpers; `attr` as for the other per-token math (`#0` inline, `#2`
/// outlined). `column_logits` is a thread's logits per batch column in stage one (4 per quad:
/// `GpuConfig::quads_per_thread`), the arity of its [`column_partial`] function.
pub(crate) fn helpers(attr: &str, column_logits: usize) -> String {
    // The column functions hold shuffles: convergent, inlined or not as the per-token math is.
    let column_attr = if attr == "#0" { "#4" } else { "#3" };
    // The terms are inlined into the column functions (themselves out of line in large
    // tiles): a call per term serialized a column's independent exps (BENCHMARKS.md, GPU
    // 2026-12-06 twelfth session).
    [term("#0"), window("#0"), finish(), column(column_logits, column_attr), scatter(column_logits, column_attr)].join("\n")
}

/// The struct `@fs_lse_scatter{n}` returns, as [`COLUMN_TY`].
const SCATTER_TY: &str = COLUMN_TY;

/// `@fs_lse_scatter{n}(i32 %lane, float %x0, ..)`: [`sum_columns`] of 8 columns (a
/// thread's `n` logits of each, column after column), then [`Func::reduce_scatter`] of the
/// partials over the 8 lanes that share them, pairs merged by `LsePartial::merge`
/// ([`merge_all`] of two), so lane `g = lane >> 2` returns column `g`'s partial over the 8
/// lanes. 49 shuffles for 8 columns where a butterfly per column ([`column`]) takes 168. The
/// same bits as the butterflies: the merge is associative and commutative.
fn scatter(n: usize, attr: &str) -> String {
    let mut f = Func::new();
    let lane = I32::named("%lane");
    let xs: Vec<F32> = (0..SCATTER_ITEMS * n).map(|i| F32::raw(format!("%x{i}"))).collect();
    let columns: Vec<Vec<F32>> = xs.chunks(n).map(<[F32]>::to_vec).collect();
    let parts = sum_columns(&mut f, &columns);
    let p = f.reduce_scatter(
        &lane,
        parts,
        select_partial,
        |f, p, mask| Partial { window: f.shfl_xor(&p.window, mask), sums: p.sums.each_ref().map(|s| shfl_sum(f, s, mask)) },
        |f, keep, got| merge_all(f, &[keep, got]),
    );
    let mut r = f.insert(&Agg::undef(SCATTER_TY), &p.window, 0);
    for (i, s) in p.sums.iter().enumerate() {
        r = f.insert(&r, s, 1 + i);
    }
    f.ret_agg(&r);
    let params = (0..xs.len()).map(|i| format!("float %x{i}")).collect::<Vec<_>>().join(", ");
    f.finish(&format!("define internal {SCATTER_TY} @fs_lse_scatter{n}(i32 %lane, {params}) {attr}"))
}

/// `a` where `c`, else `b`, field by field.
fn select_partial<S: SumWord>(f: &mut Func, c: &I1, a: &Partial<S>, b: &Partial<S>) -> Partial<S> {
    Partial { window: f.sel(c, &a.window, &b.window), sums: std::array::from_fn(|i| f.sel(c, &a.sums[i], &b.sums[i])) }
}

/// The partial of column `lane >> 2` of `columns` (8 of them, a thread's logits of each, all
/// of the module's arity), merged over the 8 lanes sharing it ([`scatter`]). Every lane of the
/// warp must call it (shuffles).
pub(crate) fn scatter_partial(f: &mut Func, lane: &I32, columns: &[Vec<F32>]) -> Partial<I64> {
    assert_eq!(columns.len(), SCATTER_ITEMS, "the reduce-scatter takes one column per lane group");
    let n = columns[0].len();
    let args: Vec<&dyn Operand> = std::iter::once(lane as &dyn Operand).chain(columns.iter().flatten().map(|x| x as &dyn Operand)).collect();
    let r = f.call_agg(SCATTER_TY, &format!("@fs_lse_scatter{n}"), &args);
    Partial { window: f.extract(&r, 0), sums: std::array::from_fn(|i| f.extract(&r, 1 + i)) }
}

/// The struct a column function returns: the merged partial's window and its sums.
const COLUMN_TY: &str = "{ i32, i64, i64, i64 }";

/// `@fs_lse_column{n}(float %x0, ..)`: [`sum_columns`] of a thread's `n` logits of one column,
/// then [`warp_merge`] over the 8 lanes that share it (xor 4, 8, 16). Outlined with the
/// per-token math (large tiles): the merge unrolled once per column made the 256 × 128
/// scorer's stage one ~19k straight-line instructions (8.2k with the function), and its warps
/// waited on instruction fetch for half of their epilogue samples (BENCHMARKS.md, GPU
/// 2026-12-06 ninth session).
fn column(n: usize, attr: &str) -> String {
    let mut f = Func::new();
    let xs: Vec<F32> = (0..n).map(|i| F32::raw(format!("%x{i}"))).collect();
    let own = sum_columns(&mut f, std::slice::from_ref(&xs)).remove(0);
    let p = warp_merge(&mut f, own, &[4, 8, 16]);
    let mut r = f.insert(&Agg::undef(COLUMN_TY), &p.window, 0);
    for (i, s) in p.sums.iter().enumerate() {
        r = f.insert(&r, s, 1 + i);
    }
    f.ret_agg(&r);
    let params = (0..n).map(|i| format!("float %x{i}")).collect::<Vec<_>>().join(", ");
    f.finish(&format!("define internal {COLUMN_TY} @fs_lse_column{n}({params}) {attr}"))
}

/// A column's partial merged over the 8 lanes sharing it: the column function of the module's
/// arity (`xs.len()`, [`helpers`]). Every lane of the warp must call it (shuffles).
pub(crate) fn column_partial(f: &mut Func, xs: &[&F32]) -> Partial<I64> {
    let args: Vec<&dyn Operand> = xs.iter().map(|x| *x as &dyn Operand).collect();
    let r = f.call_agg(COLUMN_TY, &format!("@fs_lse_column{}", xs.len()), &args);
    Partial { window: f.extract(&r, 0), sums: std::array::from_fn(|i| f.extract(&r, 1 + i)) }
}

/// A thread's logits of each of `columns` summed ([`column_top`], then [`column_sums`]), with
/// one branch: the fast terms when every column's top window allows them. The fast path's top
/// window is that of the column's plain `maxnum` (NaN ignored), which is the largest finite
/// logit's unless it is `+inf`, a case that takes the exact path ([`column_top`] filters the
/// non-finite logits): three instructions a logit fewer where the logits are finite.
fn sum_columns(f: &mut Func, columns: &[Vec<F32>]) -> Vec<Partial<I64>> {
    let mut fast = I1::TRUE;
    let mut fast_tops = Vec::new();
    for c in columns {
        let mut m = F32::NEG_INF;
        for x in c {
            m = f.maxnum(&m, x);
        }
        let below_inf = f.fcmp(Fcmp::Olt, &m, &F32::POS_INF);
        let top: I32 = f.call("@fs_lse_window", &[&m]);
        let ok = fast_windows(f, &top);
        let ok = f.and(&ok, &below_inf);
        fast = f.and(&fast, &ok);
        fast_tops.push(top);
    }
    let tops: Vec<Var<I32>> = fast_tops.iter().map(|t| f.var(t)).collect();
    let sums: Vec<[Var<I64>; KEPT_WINDOWS]> = columns.iter().map(|_| std::array::from_fn(|_| f.var(&I64::c(0)))).collect();
    f.if_else(
        &fast,
        |f| {
            for ((c, top), vars) in columns.iter().zip(&fast_tops).zip(&sums) {
                let s = column_sums(f, c, top, Terms::Fast);
                set_all(f, vars, s);
            }
        },
        |f| {
            for ((c, top_var), vars) in columns.iter().zip(&tops).zip(&sums) {
                let top = column_top(f, c);
                f.set(top_var, &top);
                let s = column_sums(f, c, &top, Terms::Exact);
                set_all(f, vars, s);
            }
        },
    );
    tops.iter().zip(&sums).map(|(top, vars)| Partial { window: f.get(top), sums: vars.each_ref().map(|v| f.get(v)) }).collect()
}

fn set_all(f: &mut Func, vars: &[Var<I64>; KEPT_WINDOWS], values: [I64; KEPT_WINDOWS]) {
    for (v, x) in vars.iter().zip(&values) {
        f.set(v, x);
    }
}

/// A column's top window: the window of its largest finite logit (windows are monotone in
/// `x`), `EMPTY_WINDOW` when none is finite.
fn column_top(f: &mut Func, xs: &[F32]) -> I32 {
    let mut xmax = F32::NEG_INF;
    for x in xs {
        let ax = f.fabs(x);
        let finite = f.fcmp(Fcmp::Olt, &ax, &F32::POS_INF);
        let xc = f.sel(&finite, x, &F32::NEG_INF);
        xmax = f.maxnum(&xmax, &xc);
    }
    f.call("@fs_lse_window", &[&xmax])
}

/// How a column's terms are computed: both give `LseTerm::of`'s bits.
#[derive(Clone, Copy)]
enum Terms {
    /// `@fs_lse_term` per logit, for any top window.
    Exact,
    /// [`fast_term`]: only where [`fast_windows`] holds.
    Fast,
}

/// The sums of the windows `top`, `top − 1`, `top − 2` of a column's logits, each term added
/// to its window's sum as soon as it is computed (only the running sums stay live). Equal to
/// merging the terms one by one: terms below `top − 2` are dropped, as a merge drops them.
fn column_sums(f: &mut Func, xs: &[F32], top: &I32, terms: Terms) -> [I64; KEPT_WINDOWS] {
    let mut sums: [I64; KEPT_WINDOWS] = std::array::from_fn(|_| I64::c(0));
    let bases = matches!(terms, Terms::Fast).then(|| WindowBases::of(f, top));
    for x in xs {
        let (hits, v) = match &bases {
            Some(b) => fast_term(f, x, b),
            None => {
                let t = f.call_agg(TERM_TY, "@fs_lse_term", &[x]);
                let w: I32 = f.extract(&t, 0);
                let v: I64 = f.extract(&t, 1);
                let below = f.sub(top, &w);
                (std::array::from_fn(|j| f.icmp(Icmp::Eq, &below, &i32c(j as u32))), v)
            }
        };
        for (s, hit) in sums.iter_mut().zip(&hits) {
            *s = ptx::add_if(f, hit, s, &v);
        }
    }
    sums
}

/// Largest |top window| of [`Terms::Fast`]: the kept windows `top − j` and their bases
/// `16·(top − j)` are exact in f32 (2²⁴ would do).
const FAST_WINDOW_LIMIT: i32 = 1 << 22;

/// Whether [`Terms::Fast`] applies to a column of top window `top`: |top| below
/// [`FAST_WINDOW_LIMIT`], or no finite logit (`EMPTY_WINDOW`: every fast term is then
/// dropped, as every exact one is).
fn fast_windows(f: &mut Func, top: &I32) -> I1 {
    let shifted = f.add(top, &i32c(FAST_WINDOW_LIMIT as u32));
    let inside = f.icmp(Icmp::Ult, &shifted, &i32c(2 * FAST_WINDOW_LIMIT as u32));
    let empty = f.icmp(Icmp::Eq, top, &i32c(EMPTY_WINDOW as u32));
    f.or(&inside, &empty)
}

/// A column's kept windows as f32 (`top − j`, bounds on `x / 16`) and their bases `16·(top − j)`.
struct WindowBases {
    window: [F32; KEPT_WINDOWS],
    base: [F32; KEPT_WINDOWS],
}

impl WindowBases {
    fn of(f: &mut Func, top: &I32) -> WindowBases {
        let wf: F32 = f.sitofp(top);
        let window = std::array::from_fn(|j| f.fsub(&wf, &f32c(j as f32)));
        let base = std::array::from_fn(|j| f.fmul(&window[j], &f32c(WINDOW)));
        WindowBases { window, base }
    }
}

/// `2²³ + 2²²`: `v + ROUND_MAGIC − ROUND_MAGIC` is `round_ties_even(v)` for |v| < 2²² (the
/// sum's ulp is 1), and the sum's bits minus the constant's are that integer.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `LseTerm::of(x)` for a column whose windows are `b` (its top window passes
/// [`fast_windows`]) without a conversion instruction: which kept window `x` falls in (three
/// exclusive flags, none for a dropped or non-finite `x`) and the term's value. The same bits:
/// `floor(x / 16) = top − j` iff `x / 16 ≥ top − j` and not `≥ top − j + 1` (both exact
/// f32), so the remainder `x − 16·(top − j)` is `LseTerm::of`'s `f ∈ [0, 16)`; `exp_f32(f)`'s
/// `n = round_ties_even(f · log₂e) ∈ [0, 23]` comes from [`ROUND_MAGIC`] and its `p` from
/// [`math::exp_reduced`]; `t = p · 2ⁿ` is exact (its bits are `p`'s plus `n` in the exponent
/// field), and so is `T = trunc(t · 2²³)`: `t ∈ [1, e¹⁶)` has exponent `e ∈ [0, 23]`, and
/// `T` is its 24-bit significand shifted left by `e`. A dropped or non-finite `x` computes
/// garbage (its shift masked to 63) that no flag selects.
fn fast_term(f: &mut Func, x: &F32, b: &WindowBases) -> ([I1; KEPT_WINDOWS], I64) {
    let y = f.fmul(x, &f32c(INV_WINDOW));
    let ge: [I1; KEPT_WINDOWS] = std::array::from_fn(|j| f.fcmp(Fcmp::Oge, &y, &b.window[j]));
    let ax = f.fabs(x);
    let finite = f.fcmp(Fcmp::Olt, &ax, &F32::POS_INF);
    let hits = std::array::from_fn(|j| {
        if j == 0 {
            f.and(&ge[0], &finite)
        } else {
            let not_above = f.not(&ge[j - 1]);
            f.and(&ge[j], &not_above)
        }
    });
    let mut base = b.base[KEPT_WINDOWS - 1].clone();
    for j in (0..KEPT_WINDOWS - 1).rev() {
        base = f.sel(&ge[j], &b.base[j], &base);
    }
    let rem = f.fsub(x, &base);
    let xl = f.fmul(&rem, &f32c(LOG2_E));
    let rounded = f.fadd(&xl, &f32c(ROUND_MAGIC));
    let n = f.fsub(&rounded, &f32c(ROUND_MAGIC));
    let p = math::exp_reduced(f, &rem, &n);
    let rounded_bits: I32 = f.bitcast(&rounded);
    let ni = f.sub(&rounded_bits, &i32c(ROUND_MAGIC.to_bits()));
    let p_bits: I32 = f.bitcast(&p);
    let n_field = f.shl(&ni, &i32c(23));
    let t_bits = f.add(&p_bits, &n_field);
    let e = f.lshr(&t_bits, &i32c(23));
    let e = f.sub(&e, &i32c(127));
    let e = f.and(&e, &i32c(63));
    let m = f.and(&t_bits, &i32c(0x7f_ffff));
    let m = f.or(&m, &i32c(0x80_0000));
    let m: I64 = f.zext(&m);
    let e: I64 = f.zext(&e);
    (hits, f.shl(&m, &e))
}

/// Sum `v` exchanged with lane `lane ^ mask`, one 32-bit shuffle per word.
fn shfl_sum<S: SumWord>(f: &mut Func, v: &S, mask: u32) -> S {
    let mut out = S::c(0);
    for word in 0..S::WORDS {
        let part = f.lshr(v, &S::c(32 * word));
        let part: I32 = f.trunc(&part);
        let got = f.shfl_xor(&part, mask);
        let got: S = f.zext(&got);
        let got = f.shl(&got, &S::c(32 * word));
        out = f.or(&out, &got);
    }
    out
}

/// The merge of `parts`, as [`warp_merge`] does it for lanes: the top window (their max),
/// each partial's sums realigned to it once, then added. Equal to merging them pairwise.
pub(crate) fn merge_all<S: SumWord>(f: &mut Func, parts: &[Partial<S>]) -> Partial<S> {
    let mut top = i32c(EMPTY_WINDOW);
    for p in parts {
        let higher = f.icmp(Icmp::Sgt, &p.window, &top);
        top = f.sel(&higher, &p.window, &top);
    }
    let mut sums: [S; KEPT_WINDOWS] = std::array::from_fn(|_| S::c(0));
    for p in parts {
        let shift = f.sub(&top, &p.window);
        for (i, s) in sums.iter_mut().enumerate() {
            let r = realigned(f, &p.sums, &shift, i);
            *s = f.add(s, &r);
        }
    }
    Partial { window: top, sums }
}

/// Merges the partials of the lanes that `masks` (butterfly steps) join; every lane gets
/// their sum. Equal to merging them pairwise (`LsePartial::merge` at each butterfly step), but
/// the top window comes first (a max over the lanes), then each lane realigns its sums to it
/// once, and the realigned sums add up with no further realignment. Exact: a window kept at the joint top
/// (`top − 2 ≤ w ≤ top`) was kept by every lane's own partial (its top is at most the joint
/// one), so each lane contributes exactly its sum of that window, as the pairwise merges do.
pub(crate) fn warp_merge<S: SumWord>(f: &mut Func, p: Partial<S>, masks: &[u32]) -> Partial<S> {
    let mut top = p.window.clone();
    for &m in masks {
        let o = f.shfl_xor(&top, m);
        let higher = f.icmp(Icmp::Sgt, &o, &top);
        top = f.sel(&higher, &o, &top);
    }
    // `EMPTY_WINDOW` is far below every window (|w| ≤ WINDOW_LIMIT): no overflow.
    let shift = f.sub(&top, &p.window);
    let mut sums: [S; KEPT_WINDOWS] = std::array::from_fn(|i| realigned(f, &p.sums, &shift, i));
    for &m in masks {
        for s in sums.iter_mut() {
            let o = shfl_sum(f, s, m);
            *s = f.add(s, &o);
        }
    }
    Partial { window: top, sums }
}

