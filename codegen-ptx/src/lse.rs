//! `flashsample_abi::lse` (the exact, order-independent logsumexp sum) as LLVM IR functions,
//! op for op as the abi writes them, so a row's logsumexp on the GPU is the same bits in
//! every schedule and tile config, and equal to the CPU's for equal logits:
//!
//! - `@fs_lse_term(float x) -> {i32 window, i64 value}`: `LseTerm::of` (non-finite `x`:
//!   `EMPTY_WINDOW`, 0).
//! - `@fs_lse_merge` (u64 sums, `LsePartial::merge`) and `@fs_lse_merge128` (u128 sums,
//!   `LseSum::merge`): `(w, s0, s1, s2) ⊕ (w', s0', s1', s2')`.
//! - `@fs_lse_finish(i32 w, i128 s0, i128 s1, i128 s2) -> float`: `LseSum::logsumexp`.

use crate::ir::{f32c_u, Func, NEG_INF};
use flashsample_abi::LsePartial;
use std::mem::{offset_of, size_of};
use flashsample_abi::lse::{
    EMPTY_WINDOW, INV_WINDOW, KEPT_WINDOWS, TERM_SCALE, TERM_SCALE_LOG2, WINDOW, WINDOW_LIMIT, WINDOW_WEIGHTS,
};

/// The struct `@fs_lse_merge` returns: top window, then the three u64 sums.
pub(crate) const PARTIAL_TY: &str = "{ i32, i64, i64, i64 }";
/// The struct `@fs_lse_merge128` returns.
pub(crate) const SUM_TY: &str = "{ i32, i128, i128, i128 }";

/// Declarations the helpers use beyond the module prelude.
pub(crate) const DECLS: &str = "declare float @llvm.floor.f32(float)
declare i64 @llvm.fptoui.sat.i64.f32(float)
declare double @llvm.nvvm.add.rn.d(double, double)
declare double @llvm.nvvm.mul.rn.d(double, double)
";

/// `abi::LsePartial`'s size and its window's offset (the three u64 sums come first).
const PARTIAL_BYTES: u32 = size_of::<LsePartial>() as u32;
const PARTIAL_WINDOW: u32 = offset_of!(LsePartial, window) as u32;

/// Stores partial `(w, sums)` (u64 sums) as `abi::LsePartial` number `index64` of `buffer`.
pub(crate) fn store_partial(f: &mut Func, buffer: &str, index64: &str, w: &str, sums: &[String; KEPT_WINDOWS]) {
    let a = f.gaddr_u(buffer, index64, PARTIAL_BYTES);
    for (k, v) in sums.iter().enumerate() {
        let p = f.offset(&a, 8 * k as u32);
        f.s(format!("store i64 {v}, ptr addrspace(1) {p}, align 8"));
    }
    let p = f.offset(&a, PARTIAL_WINDOW);
    f.s(format!("store i32 {w}, ptr addrspace(1) {p}, align 4"));
    let p = f.offset(&a, PARTIAL_WINDOW + 4);
    f.s(format!("store i32 0, ptr addrspace(1) {p}, align 4"));
}

/// Loads `abi::LsePartial` number `index64` of `buffer`, its sums widened to u128.
pub(crate) fn load_partial_wide(f: &mut Func, buffer: &str, index64: &str) -> (String, [String; KEPT_WINDOWS]) {
    let a = f.gaddr_u(buffer, index64, PARTIAL_BYTES);
    let sums = std::array::from_fn(|k| {
        let p = f.offset(&a, 8 * k as u32);
        let v = f.v(format!("load i64, ptr addrspace(1) {p}, align 8"));
        f.v(format!("zext i64 {v} to i128"))
    });
    let p = f.offset(&a, PARTIAL_WINDOW);
    (f.v(format!("load i32, ptr addrspace(1) {p}, align 4")), sums)
}

/// An f64 constant in LLVM's exact hexadecimal form.
fn f64c(v: f64) -> String {
    format!("0x{:016X}", v.to_bits())
}

/// The window part of `LseTerm::of(x)`: whether `x` counts (finite), `floor(x / 16)` (the
/// remainder's base) and the clamped window (`EMPTY_WINDOW` when `x` does not count).
struct Window {
    finite: String,
    floor: String,
    window: String,
}

fn window_of(f: &mut Func, x: &str) -> Window {
    let ax = f.v(format!("call float @llvm.fabs.f32(float {x})"));
    let finite = f.v(format!("fcmp olt float {ax}, 0x7FF0000000000000"));
    let scaled = f.fmul_u(x, &f32c_u(INV_WINDOW));
    let floor = f.v(format!("call float @llvm.floor.f32(float {scaled})"));
    let lim = WINDOW_LIMIT as f32;
    let kc = f.v(format!("call float @llvm.maxnum.f32(float {floor}, float {})", f32c_u(-lim)));
    let kc = f.v(format!("call float @llvm.minnum.f32(float {kc}, float {})", f32c_u(lim)));
    let w = f.v(format!("call i32 @llvm.fptosi.sat.i32.f32(float {kc})"));
    let window = f.sel_u("i32", &finite, &w, &EMPTY_WINDOW.to_string());
    Window { finite, floor, window }
}

/// `abi::lse::LseTerm::of`.
fn term(attr: &str) -> String {
    let mut f = Func::new();
    let w = window_of(&mut f, "%x");
    let kw = f.fmul_u(&w.floor, &f32c_u(WINDOW));
    let rem = f.fsub_u("%x", &kw);
    let t = f.v(format!("call float @fs_exp_f32(float {rem})"));
    let tt = f.fmul_u(&t, &f32c_u(TERM_SCALE));
    let value = f.v(format!("call i64 @llvm.fptoui.sat.i64.f32(float {tt})"));
    let window = w.window;
    let value = f.sel_u("i64", &w.finite, &value, "0");
    let r = f.v(format!("insertvalue {{ i32, i64 }} undef, i32 {window}, 0"));
    let r = f.v(format!("insertvalue {{ i32, i64 }} {r}, i64 {value}, 1"));
    f.s(format!("ret {{ i32, i64 }} {r}"));
    f.finish(&format!("define internal {{ i32, i64 }} @fs_lse_term(float %x) {attr}"))
}

/// The window of `LseTerm::of(x)` alone (`EMPTY_WINDOW` for non-finite `x`): monotone in `x`,
/// so a thread's top window is the window of its largest finite logit.
fn window(attr: &str) -> String {
    let mut f = Func::new();
    let w = window_of(&mut f, "%x");
    f.s(format!("ret i32 {}", w.window));
    f.finish(&format!("define internal i32 @fs_lse_window(float %x) {attr}"))
}

/// Entry `i` of `sums` (of window `from`) realigned to the top window `to`: `sums[i − (to −
/// from)]` or 0, given `shift = to − from ≥ 0`.
fn realigned(f: &mut Func, ty: &str, sums: &[String], shift: &str, i: usize) -> String {
    let mut r = "0".to_string();
    for (j, s) in sums.iter().enumerate().take(i + 1) {
        let hit = f.v(format!("icmp eq i32 {shift}, {}", i - j));
        r = f.sel_u(ty, &hit, s, &r);
    }
    r
}

/// `(wa, a) ⊕ (wb, b)` with sums of type `ty` (`LsePartial::merge` / `LseSum::merge`).
fn merge(name: &str, ty: &str, ret: &str, attr: &str) -> String {
    let mut f = Func::new();
    let a: Vec<String> = (0..KEPT_WINDOWS).map(|i| format!("%a{i}")).collect();
    let b: Vec<String> = (0..KEPT_WINDOWS).map(|i| format!("%b{i}")).collect();
    let a_higher = f.v("icmp sgt i32 %wa, %wb");
    let top = f.sel_u("i32", &a_higher, "%wa", "%wb");
    let da = f.v(format!("sub i32 {top}, %wa"));
    let db = f.v(format!("sub i32 {top}, %wb"));
    let mut r = f.v(format!("insertvalue {ret} undef, i32 {top}, 0"));
    for i in 0..KEPT_WINDOWS {
        let x = realigned(&mut f, ty, &a, &da, i);
        let y = realigned(&mut f, ty, &b, &db, i);
        let s = f.v(format!("add {ty} {x}, {y}"));
        r = f.v(format!("insertvalue {ret} {r}, {ty} {s}, {}", i + 1));
    }
    f.s(format!("ret {ret} {r}"));
    let params = |p: &str| (0..KEPT_WINDOWS).map(|i| format!("{ty} %{p}{i}")).collect::<Vec<_>>().join(", ");
    f.finish(&format!("define internal {ret} @{name}(i32 %wa, {}, i32 %wb, {}) {attr}", params("a"), params("b")))
}

/// `abi::lse::u128_to_f64`.
fn u128_to_f64(f: &mut Func, v: &str) -> String {
    let hi = f.v(format!("lshr i128 {v}, 64"));
    let hi = f.v(format!("trunc i128 {hi} to i64"));
    let lo = f.v(format!("trunc i128 {v} to i64"));
    let hi = f.v(format!("uitofp i64 {hi} to double"));
    let lo = f.v(format!("uitofp i64 {lo} to double"));
    let hi = f.v(format!("call double @llvm.nvvm.mul.rn.d(double {hi}, double {})", f64c(18_446_744_073_709_551_616.0)));
    f.v(format!("call double @llvm.nvvm.add.rn.d(double {hi}, double {lo})"))
}

/// `abi::lse::LseSum::logsumexp`.
fn finish() -> String {
    let mut f = Func::new();
    let mut acc = f64c(0.0);
    for (i, w) in WINDOW_WEIGHTS.iter().enumerate() {
        let v = u128_to_f64(&mut f, &format!("%s{i}"));
        let t = f.v(format!("call double @llvm.nvvm.mul.rn.d(double {v}, double {})", f64c(*w)));
        acc = f.v(format!("call double @llvm.nvvm.add.rn.d(double {acc}, double {t})"));
    }
    let bits = f.v(format!("bitcast double {acc} to i64"));
    let eb = f.v(format!("lshr i64 {bits}, 52"));
    let eb = f.v(format!("and i64 {eb}, 2047"));
    let eb = f.v(format!("trunc i64 {eb} to i32"));
    let e = f.v(format!("sub i32 {eb}, {}", 1023 + TERM_SCALE_LOG2));
    let mb = f.v(format!("and i64 {bits}, {}", 0x000f_ffff_ffff_ffffu64));
    let mb = f.v(format!("or i64 {mb}, {}", 1023u64 << 52));
    let m = f.v(format!("bitcast i64 {mb} to double"));
    let m32 = f.v(format!("fptrunc double {m} to float"));
    let ln_m = f.v(format!("call float @fs_ln_f32(float {m32})"));
    let ln_m = f.v(format!("fpext float {ln_m} to double"));
    let wd = f.v("sitofp i32 %w to double");
    let ed = f.v(format!("sitofp i32 {e} to double"));
    let a = f.v(format!("call double @llvm.nvvm.mul.rn.d(double {wd}, double {})", f64c(f64::from(WINDOW))));
    let b = f.v(format!("call double @llvm.nvvm.mul.rn.d(double {ed}, double {})", f64c(std::f64::consts::LN_2)));
    let ab = f.v(format!("call double @llvm.nvvm.add.rn.d(double {a}, double {b})"));
    let lse = f.v(format!("call double @llvm.nvvm.add.rn.d(double {ab}, double {ln_m})"));
    let lse = f.v(format!("fptrunc double {lse} to float"));
    // No token: -inf; a saturated top window: ±inf.
    let empty = f.v("icmp eq i128 %s0, 0");
    let high = f.v(format!("icmp sge i32 %w, {WINDOW_LIMIT}"));
    let low = f.v(format!("icmp sle i32 %w, {}", -WINDOW_LIMIT));
    let r = f.sel_u("float", &high, "0x7FF0000000000000", &lse);
    let low = f.v(format!("or i1 {low}, {empty}"));
    let r = f.sel_u("float", &low, "0xFFF0000000000000", &r);
    f.s(format!("ret float {r}"));
    f.finish("define internal float @fs_lse_finish(i32 %w, i128 %s0, i128 %s1, i128 %s2) #0")
}

/// The accumulator's helpers; `attr` as for the other per-token math (`#0` inline, `#2` outlined).
pub(crate) fn helpers(attr: &str) -> String {
    [term(attr), window("#0"), merge("fs_lse_merge", "i64", PARTIAL_TY, "#0"), merge("fs_lse_merge128", "i128", SUM_TY, "#0"), finish()].join("\n")
}

/// A thread's logits of one column summed: the top window is the window of the largest
/// finite logit (windows are monotone), then each logit's term goes into the sum of its window
/// as soon as it is computed, so only the running sums stay live. Equal to merging the terms
/// one by one.
pub(crate) fn sum_logits(f: &mut Func, xs: &[&String]) -> (String, [String; KEPT_WINDOWS]) {
    let mut xmax = NEG_INF.to_string();
    for x in xs {
        let ax = f.v(format!("call float @llvm.fabs.f32(float {x})"));
        let finite = f.v(format!("fcmp olt float {ax}, 0x7FF0000000000000"));
        let xc = f.sel_u("float", &finite, x, NEG_INF);
        xmax = f.v(format!("call float @llvm.maxnum.f32(float {xmax}, float {xc})"));
    }
    let top = f.v(format!("call i32 @fs_lse_window(float {xmax})"));
    let mut sums: [String; KEPT_WINDOWS] = std::array::from_fn(|_| "0".to_string());
    for x in xs {
        let t = f.v(format!("call {{ i32, i64 }} @fs_lse_term(float {x})"));
        let w = f.v(format!("extractvalue {{ i32, i64 }} {t}, 0"));
        let v = f.v(format!("extractvalue {{ i32, i64 }} {t}, 1"));
        let below = f.v(format!("sub i32 {top}, {w}"));
        for (j, s) in sums.iter_mut().enumerate() {
            let hit = f.v(format!("icmp eq i32 {below}, {j}"));
            let add = f.sel_u("i64", &hit, &v, "0");
            *s = f.v(format!("add i64 {s}, {add}"));
        }
    }
    (top, sums)
}

/// Calls `@fs_lse_merge` (`wide`: `@fs_lse_merge128`) and unpacks the result.
pub(crate) fn merge_call(f: &mut Func, wide: bool, a: &(String, [String; KEPT_WINDOWS]), b: &(String, [String; KEPT_WINDOWS])) -> (String, [String; KEPT_WINDOWS]) {
    let (name, ty, ret) = if wide { ("fs_lse_merge128", "i128", SUM_TY) } else { ("fs_lse_merge", "i64", PARTIAL_TY) };
    let args = |(w, s): &(String, [String; KEPT_WINDOWS])| {
        std::iter::once(format!("i32 {w}")).chain(s.iter().map(|v| format!("{ty} {v}"))).collect::<Vec<_>>().join(", ")
    };
    let r = f.v(format!("call {ret} @{name}({}, {})", args(a), args(b)));
    let w = f.v(format!("extractvalue {ret} {r}, 0"));
    let sums = std::array::from_fn(|i| f.v(format!("extractvalue {ret} {r}, {}", i + 1)));
    (w, sums)
}

/// The partial `(w, sums)` of u64 (`wide`: u128) sums exchanged with lane `lane ^ mask`.
pub(crate) fn shfl_xor(f: &mut Func, wide: bool, p: &(String, [String; KEPT_WINDOWS]), mask: u32) -> (String, [String; KEPT_WINDOWS]) {
    let (ty, words) = if wide { ("i128", 4) } else { ("i64", 2) };
    let w = f.shfl_xor_i32_u(&p.0, mask);
    let sums = std::array::from_fn(|i| {
        let mut out = "0".to_string();
        for word in 0..words {
            let part = f.v(format!("lshr {ty} {}, {}", p.1[i], 32 * word));
            let part = f.v(format!("trunc {ty} {part} to i32"));
            let got = f.shfl_xor_i32_u(&part, mask);
            let got = f.v(format!("zext i32 {got} to {ty}"));
            let got = f.v(format!("shl {ty} {got}, {}", 32 * word));
            out = f.v(format!("or {ty} {out}, {got}"));
        }
        out
    });
    (w, sums)
}

/// Merges the partials of the 32 lanes of a warp (every lane gets the warp's sum).
pub(crate) fn warp_merge(f: &mut Func, wide: bool, mut p: (String, [String; KEPT_WINDOWS]), masks: &[u32]) -> (String, [String; KEPT_WINDOWS]) {
    for &m in masks {
        let o = shfl_xor(f, wide, &p, m);
        p = merge_call(f, wide, &p, &o);
    }
    p
}
