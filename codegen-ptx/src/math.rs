//! The noise and transcendental functions as LLVM IR, op for op as `flashsample_abi`
//! writes them: every multiply-add is an explicit `fma.rn`, every other f32 operation an
//! explicit `.rn` instruction, constants come from the abi crate. CPU and GPU noise are
//! therefore bit-identical.

use crate::config::NoiseSkip;
use crate::ir::{f32c, i32c, Agg, Fcmp, Func, Icmp, Int, Var, F32, I1, I32, I64};
use crate::params::arg;
use flashsample_abi::math::{
    EXP_C, EXP_MIN_INPUT, LN2_HI, LN2_LO, LN_C3, LN_C5, LN_C7, LN_C9, LN_REDUCE_BITS, LOG2_E,
    TANH_SATURATE,
};
use flashsample_abi::rng::{
    NoiseStream, GUMBEL_BUCKET_SLACK, PHILOX_M0, PHILOX_M1, PHILOX_ROUNDS, PHILOX_W0, PHILOX_W1,
    TWO_POW_M25,
};

/// `@fs_ln_f32(x)`: `abi::math::ln_f32`.
pub(crate) fn ln(f: &mut Func, x: &F32) -> F32 {
    f.call("@fs_ln_f32", &[x])
}

/// `@fs_exp_f32(x)`: `abi::math::exp_f32` (out of line where the module outlines its math).
pub(crate) fn exp(f: &mut Func, x: &F32) -> F32 {
    f.call("@fs_exp_f32", &[x])
}

/// `@fs_exp_f32_inline(x)`: the same function, always inlined: for callers that are
/// themselves out of line and run many independent exps (the logsumexp terms), where a call
/// per exp would serialize chains the scheduler can otherwise interleave.
pub(crate) fn exp_inline(f: &mut Func, x: &F32) -> F32 {
    f.call("@fs_exp_f32_inline", &[x])
}

/// `@fs_softcap_f32(x, cap)`: `abi::math::softcap_f32`.
pub(crate) fn softcap(f: &mut Func, x: &F32, cap: f32) -> F32 {
    f.call("@fs_softcap_f32", &[x, &f32c(cap)])
}

/// `@fs_gumbel_f32(bits)`: `abi::rng::gumbel_f32`.
pub(crate) fn gumbel(f: &mut Func, bits: &I32) -> F32 {
    f.call("@fs_gumbel_f32", &[bits])
}

/// A Philox key (`abi::rng::philox4x32_10`'s two words).
#[derive(Clone, Debug)]
pub(crate) struct PhiloxKey {
    pub(crate) lo: I32,
    pub(crate) hi: I32,
}

/// The return type of `@fs_philox`: the block's four words.
pub(crate) const PHILOX_TY: &str = "{ i32, i32, i32, i32 }";

/// `@fs_philox`: the Philox block of counter `[c0, c1, c2, c3]` under `key` (its words by
/// [`Func::extract`]).
pub(crate) fn philox_block(f: &mut Func, counter: [&I32; 4], key: &PhiloxKey) -> Agg {
    let [c0, c1, c2, c3] = counter;
    f.call_agg(PHILOX_TY, "@fs_philox", &[c0, c1, c2, c3, &key.lo, &key.hi])
}

/// `abi::math::ln_f32`.
fn ln_f32() -> String {
    let mut f = Func::new();
    let x = F32::named("%x");
    let bits: I32 = f.bitcast(&x);
    let t = f.sub(&bits, &I32::c(LN_REDUCE_BITS));
    let ti = f.ashr(&t, &i32c(23));
    let e: F32 = f.sitofp(&ti);
    let mant = f.and(&t, &i32c(8388607));
    let mb = f.add(&mant, &I32::c(LN_REDUCE_BITS));
    let m: F32 = f.bitcast(&mb);
    let fm1 = f.fadd(&m, &f32c(-1.0));
    let den = f.fadd(&f32c(2.0), &fm1);
    // `den` is in [1.7, 2.5) and `fm1` in [-0.3, 0.5) for every input: div.rn's fast path.
    let s = f.fdiv_fast_path(&fm1, &den);
    let z = f.fmul(&s, &s);
    let p = f.fma(&z, &f32c(LN_C9), &f32c(LN_C7));
    let p = f.fma(&z, &p, &f32c(LN_C5));
    let p = f.fma(&z, &p, &f32c(LN_C3));
    let s2 = f.fadd(&s, &s);
    let s2z = f.fmul(&s2, &z);
    let ln_m = f.fma(&s2z, &p, &s2);
    let lo = f.fma(&e, &f32c(LN2_LO), &ln_m);
    let r = f.fma(&e, &f32c(LN2_HI), &lo);
    f.ret(&r);
    f.finish("define internal float @fs_ln_f32(float %x) #0")
}

/// Smallest `T` whose `1 / T` [`reciprocals`] takes by `div.rn`'s fast path (2⁻¹⁷, below
/// `abi::params::MIN_TEMPERATURE`).
pub const RECIP_FAST_MIN: f32 = 7.629_394_5e-6;
/// Bound above the `T`s whose `1 / T` [`reciprocals`] takes by the fast path (2⁶⁴).
pub const RECIP_FAST_END: f32 = 18_446_744_073_709_551_616.0;

/// `1 / t` (IEEE, round to nearest) of each of `ts`, in one straight line by `div.rn`'s fast
/// path ([`Func::fdiv_fast_path`]) when every `t` is 0 or in `[RECIP_FAST_MIN,
/// RECIP_FAST_END)` (one branch for all; the exhaustive GPU test `math_probe` checks that
/// range), else by `div.rn` each. The fast path's `1 / 0` is not `inf` (NaN): callers only
/// read `1 / T` where `T ≠ 0` (the temperature transform). `div.rn` per column put 32 `FCHK`
/// branches and convergence regions into every item of a thread's epilogue.
pub(crate) fn reciprocals(f: &mut Func, ts: &[F32]) -> Vec<F32> {
    let mut fast = I1::TRUE;
    for t in ts {
        let zero = f.fcmp(Fcmp::Oeq, t, &F32::ZERO);
        let lo = f.fcmp(Fcmp::Oge, t, &f32c(RECIP_FAST_MIN));
        let hi = f.fcmp(Fcmp::Olt, t, &f32c(RECIP_FAST_END));
        let inside = f.and(&lo, &hi);
        let ok = f.or(&zero, &inside);
        fast = f.and(&fast, &ok);
    }
    let vars: Vec<Var<F32>> = ts.iter().map(|_| f.var(&F32::ZERO)).collect();
    let one = f32c(1.0);
    f.if_else(
        &fast,
        |f| {
            for (v, t) in vars.iter().zip(ts) {
                let r = f.fdiv_fast_path(&one, t);
                f.set(v, &r);
            }
        },
        |f| {
            for (v, t) in vars.iter().zip(ts) {
                let r = f.fdiv(&one, t);
                f.set(v, &r);
            }
        },
    );
    vars.iter().map(|v| f.get(v)).collect()
}

/// `abi::math::exp_f32`'s `p`, with `exp(xc) = p · 2ⁿ`: `xc` reduced by `n · ln 2` (two
/// fmas, `ln 2` split), then the degree-7 polynomial. `n` is `round_ties_even(xc · log₂e)`,
/// however the caller rounded it.
pub(crate) fn exp_reduced(f: &mut Func, xc: &F32, n: &F32) -> F32 {
    let nn = f.fneg(n);
    let r = f.fma(&nn, &f32c(LN2_HI), xc);
    let r = f.fma(&nn, &f32c(LN2_LO), &r);
    let p = f.fma(&r, &f32c(EXP_C[5]), &f32c(EXP_C[4]));
    let p = f.fma(&r, &p, &f32c(EXP_C[3]));
    let p = f.fma(&r, &p, &f32c(EXP_C[2]));
    let p = f.fma(&r, &p, &f32c(EXP_C[1]));
    let p = f.fma(&r, &p, &f32c(EXP_C[0]));
    let p = f.fma(&r, &p, &f32c(1.0));
    f.fma(&r, &p, &f32c(1.0))
}

/// `abi::math::exp_f32` as function `name`.
fn exp_f32(name: &str, attr: &str) -> String {
    let mut f = Func::new();
    let x = F32::named("%x");
    let xc = f.maxnum(&x, &f32c(EXP_MIN_INPUT));
    let xl = f.fmul(&xc, &f32c(LOG2_E));
    let n: F32 = f.call("@llvm.roundeven.f32", &[&xl]);
    let p = exp_reduced(&mut f, &xc, &n);
    // `n as i32` saturates in Rust; n is within [-126, 128] for every input this is used on.
    let ni: I32 = f.call("@llvm.fptosi.sat.i32.f32", &[&n]);
    let nb = f.add(&ni, &i32c(127));
    let sb = f.shl(&nb, &i32c(23));
    let scale: F32 = f.bitcast(&sb);
    let y = f.fmul(&p, &scale);
    let under = f.fcmp(Fcmp::Olt, &x, &f32c(EXP_MIN_INPUT));
    let r = f.sel(&under, &F32::ZERO, &y);
    f.ret(&r);
    f.finish(&format!(
        "define internal float {name}(float %x) {attr}"
    ))
}

/// `abi::math::softcap_f32` (with `tanh_f32` inlined).
fn softcap_f32(attr: &str) -> String {
    let mut f = Func::new();
    let (x, cap) = (F32::named("%x"), F32::named("%cap"));
    let y = f.fdiv(&x, &cap);
    let ay = f.fabs(&y);
    let a = f.minnum(&ay, &f32c(TANH_SATURATE));
    let a2 = f.fadd(&a, &a);
    let e = exp(&mut f, &a2);
    let e1 = f.fadd(&e, &f32c(1.0));
    let q = f.fdiv(&f32c(2.0), &e1);
    let nq = f.fneg(&q);
    let t = f.fadd(&f32c(1.0), &nq);
    let th: F32 = f.call("@llvm.copysign.f32", &[&t, &y]);
    let r = f.fmul(&cap, &th);
    f.ret(&r);
    f.finish(&format!(
        "define internal float @fs_softcap_f32(float %x, float %cap) {attr}"
    ))
}

/// `abi::rng::gumbel_f32`.
fn gumbel_f32(attr: &str) -> String {
    let mut f = Func::new();
    let k = f.lshr(&I32::named("%bits"), &i32c(8));
    let k2 = f.shl(&k, &i32c(1));
    let n = f.or(&k2, &i32c(1));
    let nf: F32 = f.uitofp(&n);
    let nu: I32 = f.fptoui(&nf);
    let residual = f.sub(&n, &nu);
    let uh = f.fmul(&nf, &f32c(TWO_POW_M25));
    let rf: F32 = f.sitofp(&residual);
    let ul = f.fmul(&rf, &f32c(TWO_POW_M25));
    let lnu = ln(&mut f, &uh);
    // `ul` is 0 for every n below 2^24 (half the draws): the division takes a nonzero
    // stand-in (|ul_safe| = 2^-25 always, the range the exhaustive test checks the fast path
    // on) and its quotient is discarded: q = +0.0, the bits 0 / uh gives, as
    // abi::rng::gumbel_f32 computes. (With `div.rn` a zero dividend went down its out-of-line
    // slow path on nearly every call.)
    let zero = f.icmp(Icmp::Eq, &residual, &i32c(0));
    let ul_safe = f.sel(&zero, &f32c(TWO_POW_M25), &ul);
    // |ul_safe| = 2^-25 and uh in [2^-25, 1): div.rn's fast path.
    let q_nz = f.fdiv_fast_path(&ul_safe, &uh);
    let q = f.sel(&zero, &F32::ZERO, &q_nz);
    let sum = f.fadd(&lnu, &q);
    let e = f.fneg(&sum);
    let le = ln(&mut f, &e);
    let r = f.fneg(&le);
    f.ret(&r);
    f.finish(&format!(
        "define internal float @fs_gumbel_f32(i32 %bits) {attr}"
    ))
}

/// `abi::rng::philox4x32_10`, returning the four output words.
fn philox(attr: &str) -> String {
    let mut f = Func::new();
    let mut c = ["%c0", "%c1", "%c2", "%c3"].map(I32::named);
    let mut k = ["%k0", "%k1"].map(I32::named);
    for round in 0..PHILOX_ROUNDS {
        if round > 0 {
            k[0] = f.add(&k[0], &i32c(PHILOX_W0 as i32));
            k[1] = f.add(&k[1], &i32c(PHILOX_W1 as i32));
        }
        let mul = |f: &mut Func, m: u32, x: &I32| {
            let xw: I64 = f.zext(x);
            let p = f.mul(&xw, &I64::c(m));
            let hi = f.lshr(&p, &I64::c(32));
            let hi: I32 = f.trunc(&hi);
            let lo: I32 = f.trunc(&p);
            (hi, lo)
        };
        let (hi0, lo0) = mul(&mut f, PHILOX_M0, &c[0]);
        let (hi1, lo1) = mul(&mut f, PHILOX_M1, &c[2]);
        let x0 = f.xor(&hi1, &c[1]);
        let x0 = f.xor(&x0, &k[0]);
        let x2 = f.xor(&hi0, &c[3]);
        let x2 = f.xor(&x2, &k[1]);
        c = [x0, lo1, x2, lo0];
    }
    let mut agg = Agg::undef(PHILOX_TY);
    for (i, w) in c.iter().enumerate() {
        agg = f.insert(&agg, w, i);
    }
    f.ret_agg(&agg);
    f.finish(&format!(
        "define internal {PHILOX_TY} @fs_philox(i32 %c0, i32 %c1, i32 %c2, i32 %c3, i32 %k0, i32 %k1) {attr}"
    ))
}

/// A row's noise stream (`SamplingParams::row_stream`): its Philox key and counter row.
#[derive(Clone, Debug)]
pub(crate) struct RowStream {
    pub(crate) key: PhiloxKey,
    pub(crate) ctr_row: I32,
}

/// Row `row`'s Philox key halves and counter row (`SamplingParams::row_stream`): its own seed
/// and counter row 0 when the launch has `%row_seeds` (`has_rs`), else `%seed` and the launch
/// row `row_base + row`. `row64`: the row as i64, inside the batch (the seed's load).
pub(crate) fn row_stream(f: &mut Func, has_rs: &I1, row: &I32, row64: &I64) -> RowStream {
    let key = f.var(&arg::SEED);
    f.if_then(has_rs, |f| {
        let a = f.gaddr(&arg::ROW_SEEDS, row64, 8);
        let k = f.load(&a, 8);
        f.set(&key, &k);
    });
    let k = f.get(&key);
    let lo = f.trunc(&k);
    let hi = f.lshr(&k, &I64::c(32));
    let hi = f.trunc(&hi);
    let launch_row = f.add(row, &arg::ROW_BASE);
    let ctr_row = f.sel(has_rs, &i32c(0), &launch_row);
    RowStream { key: PhiloxKey { lo, hi }, ctr_row }
}

/// The 32 noise bits of global token `g` (any alignment): word `g mod 4` of the Philox block
/// `[g >> 2, ctr_row, s, word3]` under the stream's key (`abi::rng::noise_bits`' layout).
pub(crate) fn token_bits(f: &mut Func, g: &I32, stream: &RowStream, s: &I32, word3: &I32) -> I32 {
    let ctr = f.lshr(g, &i32c(2));
    let r = philox_block(f, [&ctr, &stream.ctr_row, s, word3], &stream.key);
    let w = f.and(g, &i32c(3));
    let mut bits = f.extract(&r, 0);
    for j in 1..4 {
        let wj = f.extract(&r, j);
        let is = f.icmp(Icmp::Eq, &w, &i32c(j as u32));
        bits = f.sel(&is, &wj, &bits);
    }
    bits
}

/// Counter word 3 of row `row64`'s token noise (`abi::rng::counter_word3(step, Token)`):
/// `row_steps[row] · 4 + NoiseStream::Token`, or the stream alone (step 0) when the kernel's
/// `%row_steps` is 0.
pub(crate) fn token_word3(f: &mut Func, row64: &I64) -> I32 {
    stream_word3(f, row64, NoiseStream::Token)
}

/// Counter word 3 of row `row64`'s noise of `stream` (`abi::rng::counter_word3(step, stream)`),
/// as [`token_word3`].
pub(crate) fn stream_word3(f: &mut Func, row64: &I64, stream: NoiseStream) -> I32 {
    let stream = i32c(stream as u32);
    let word = f.var(&stream);
    let has_steps = f.non_null(&arg::ROW_STEPS);
    f.if_then(&has_steps, |f| {
        let a = f.gaddr(&arg::ROW_STEPS, row64, 4);
        let step: I32 = f.load(&a, 4);
        // A step counts modulo 2^30: the shift drops its top two bits.
        let w = f.shl(&step, &i32c(2));
        let w = f.or(&w, &stream);
        f.set(&word, &w);
    });
    f.get(&word)
}

/// The Gumbel noise of one quad (4 consecutive tokens, one Philox block) for two batch
/// rows at once: `fs_philox(ctr, row, s, word3, key)` per row, then `fs_gumbel_f32` of each
/// word; rows a then b. Both are inlined here, so out of line the call still carries eight
/// independent noise chains (the epilogue's latency is these chains, not their op count).
/// `@fs_noise_pair_all` draws every noise ([`NoiseSkip::Never`]).
///
/// `@fs_noise_pair` adds the second noise skip (DESIGN.md): `%xmax_*` is the row's largest
/// transformed logit of the quad and `%thr_*` a score the row's winner is known to reach.
/// Once the Philox words are known, a row whose `xmax + abi::rng::gumbel_bucket_bound(L)` (L:
/// the leading ones of its largest uniform) is below `thr` cannot place a token of this quad
/// above the winner: its four noises are `%miss_*` (`-inf`; `-0` for a greedy row, whose score
/// is then its logit) and the Gumbel transform (two logarithms, a division) is not run. `thr`
/// NaN (no bound yet) never skips.
fn noise_pair(attr: &str, skip: NoiseSkip) -> String {
    let mut f = Func::new();
    let mut gumbels = Vec::new();
    let (ctr, s) = (I32::named("%ctr"), I32::named("%s"));
    for (row, k0, k1, w3, xmax, thr, miss) in [
        ("%row_a", "%ka0", "%ka1", "%w3_a", "%xmax_a", "%thr_a", "%miss_a"),
        ("%row_b", "%kb0", "%kb1", "%w3_b", "%xmax_b", "%thr_b", "%miss_b"),
    ] {
        let key = PhiloxKey { lo: I32::named(k0), hi: I32::named(k1) };
        let r = philox_block(&mut f, [&ctr, &I32::named(row), &s, &I32::named(w3)], &key);
        let bits: Vec<I32> = (0..4).map(|w| f.extract(&r, w)).collect();
        if !skip.tests_bounds() {
            gumbels.extend(bits.iter().map(|b| gumbel(&mut f, b)));
            continue;
        }
        let hi01 = f.umax(&bits[0], &bits[1]);
        let hi23 = f.umax(&bits[2], &bits[3]);
        let bits_max = f.umax(&hi01, &hi23);
        let bound = gumbel_bucket_bound(&mut f, &bits_max);
        let reach = f.fadd(&F32::named(xmax), &bound);
        let beaten = f.fcmp(Fcmp::Olt, &reach, &F32::named(thr));
        let noise: Vec<_> = (0..4).map(|_| f.var(&F32::named(miss))).collect();
        let draw = f.not(&beaten);
        f.if_then(&draw, |f| {
            for (b, slot) in bits.iter().zip(&noise) {
                let g = gumbel(f, b);
                f.set(slot, &g);
            }
        });
        gumbels.extend(noise.iter().map(|n| f.get(n)));
    }
    let mut agg = Agg::undef(NOISE_PAIR_TY);
    for (i, g) in gumbels.iter().enumerate() {
        agg = f.insert(&agg, g, i);
    }
    f.ret_agg(&agg);
    let rows = "i32 %ctr, i32 %s, i32 %row_a, i32 %ka0, i32 %ka1, i32 %w3_a, i32 %row_b, i32 %kb0, i32 %kb1, i32 %w3_b";
    f.finish(&if skip.tests_bounds() {
        format!(
            "define internal {NOISE_PAIR_TY} @fs_noise_pair({rows}, float %xmax_a, float %thr_a, \
             float %miss_a, float %xmax_b, float %thr_b, float %miss_b) {attr}"
        )
    } else {
        format!("define internal {NOISE_PAIR_TY} @fs_noise_pair_all({rows}) {attr}")
    })
}

/// `abi::rng::gumbel_bucket_bound(abi::rng::uniform_leading_ones(bits))`, op for op.
fn gumbel_bucket_bound(f: &mut Func, bits: &I32) -> F32 {
    let inv = f.not(bits);
    let inv = f.or(&inv, &i32c(255));
    let leading_ones: I32 = f.call("@llvm.ctlz.i32", &[&inv, &I1::FALSE]);
    let l: F32 = f.uitofp(&leading_ones);
    let l1 = f.fadd(&l, &f32c(1.0));
    let b = f.fmul(&l1, &f32c(std::f32::consts::LN_2));
    f.fadd(&b, &f32c(GUMBEL_BUCKET_SLACK))
}

/// The return type of `@fs_noise_pair`: row a's four noises, then row b's.
pub(crate) const NOISE_PAIR_TY: &str = "{ float, float, float, float, float, float, float, float }";

/// All math helpers of a module. `outline` keeps the per-token functions (noise pairs, exp,
/// softcap) out of line (`#2`, noinline), so the unrolled epilogue stays small enough for
/// the instruction cache; otherwise everything is inlined (`#0`). Philox and the Gumbel
/// transform are always inlined into their callers (the noise pair, stage three).
pub(crate) fn helpers(outline: bool) -> String {
    let attr = if outline { "#2" } else { "#0" };
    let mut out = String::from("declare i32 @llvm.fptosi.sat.i32.f32(float)\n\n");
    for f in [
        ln_f32(),
        exp_f32("@fs_exp_f32", attr),
        exp_f32("@fs_exp_f32_inline", "#0"),
        softcap_f32(attr),
        gumbel_f32("#0"),
        philox("#0"),
        noise_pair(attr, NoiseSkip::InTile),
        noise_pair(attr, NoiseSkip::Never),
    ] {
        out.push_str(&f);
        out.push('\n');
    }
    out
}

