//! The noise and transcendental functions as LLVM IR, op for op as `flashsample_abi`
//! writes them: every multiply-add is an explicit `fma.rn`, every other f32 operation an
//! explicit `.rn` instruction, constants come from the abi crate. CPU and GPU noise are
//! therefore bit-identical.

use crate::ir::{f32c_u, Func, Var, NEG_INF};
use flashsample_abi::math::{
    EXP_C, EXP_MIN_INPUT, LN2_HI, LN2_LO, LN_C3, LN_C5, LN_C7, LN_C9, LN_REDUCE_BITS, LOG2_E,
    TANH_SATURATE,
};
use flashsample_abi::rng::{
    NoiseStream, GUMBEL_BUCKET_SLACK, PHILOX_M0, PHILOX_M1, PHILOX_ROUNDS, PHILOX_W0, PHILOX_W1,
    TWO_POW_M25,
};

/// `abi::math::ln_f32`.
fn ln_f32() -> String {
    let mut f = Func::new();
    let bits = f.v("bitcast float %x to i32");
    let t = f.v(format!("sub i32 {bits}, {LN_REDUCE_BITS}"));
    let ti = f.v(format!("ashr i32 {t}, 23"));
    let e = f.v(format!("sitofp i32 {ti} to float"));
    let mant = f.v(format!("and i32 {t}, 8388607"));
    let mb = f.v(format!("add i32 {mant}, {LN_REDUCE_BITS}"));
    let m = f.v(format!("bitcast i32 {mb} to float"));
    let fm1 = f.fadd_u(&m, &f32c_u(-1.0));
    let den = f.fadd_u(&f32c_u(2.0), &fm1);
    let s = f.fdiv_u(&fm1, &den);
    let z = f.fmul_u(&s, &s);
    let p = f.fma_u(&z, &f32c_u(LN_C9), &f32c_u(LN_C7));
    let p = f.fma_u(&z, &p, &f32c_u(LN_C5));
    let p = f.fma_u(&z, &p, &f32c_u(LN_C3));
    let s2 = f.fadd_u(&s, &s);
    let s2z = f.fmul_u(&s2, &z);
    let ln_m = f.fma_u(&s2z, &p, &s2);
    let lo = f.fma_u(&e, &f32c_u(LN2_LO), &ln_m);
    let r = f.fma_u(&e, &f32c_u(LN2_HI), &lo);
    f.s(format!("ret float {r}"));
    f.finish("define internal float @fs_ln_f32(float %x) #0")
}

/// `abi::math::exp_f32`.
fn exp_f32(attr: &str) -> String {
    let mut f = Func::new();
    let xc = f.v(format!(
        "call float @llvm.maxnum.f32(float %x, float {})",
        f32c_u(EXP_MIN_INPUT)
    ));
    let xl = f.fmul_u(&xc, &f32c_u(LOG2_E));
    let n = f.v(format!("call float @llvm.roundeven.f32(float {xl})"));
    let nn = f.v(format!("fneg float {n}"));
    let r = f.fma_u(&nn, &f32c_u(LN2_HI), &xc);
    let r = f.fma_u(&nn, &f32c_u(LN2_LO), &r);
    let p = f.fma_u(&r, &f32c_u(EXP_C[5]), &f32c_u(EXP_C[4]));
    let p = f.fma_u(&r, &p, &f32c_u(EXP_C[3]));
    let p = f.fma_u(&r, &p, &f32c_u(EXP_C[2]));
    let p = f.fma_u(&r, &p, &f32c_u(EXP_C[1]));
    let p = f.fma_u(&r, &p, &f32c_u(EXP_C[0]));
    let p = f.fma_u(&r, &p, &f32c_u(1.0));
    let p = f.fma_u(&r, &p, &f32c_u(1.0));
    // `n as i32` saturates in Rust; n is within [-126, 128] for every input this is used on.
    let ni = f.v(format!("call i32 @llvm.fptosi.sat.i32.f32(float {n})"));
    let nb = f.v(format!("add i32 {ni}, 127"));
    let sb = f.v(format!("shl i32 {nb}, 23"));
    let scale = f.v(format!("bitcast i32 {sb} to float"));
    let y = f.fmul_u(&p, &scale);
    let under = f.v(format!("fcmp olt float %x, {}", f32c_u(EXP_MIN_INPUT)));
    let r = f.v(format!("select i1 {under}, float 0.0, float {y}"));
    f.s(format!("ret float {r}"));
    f.finish(&format!(
        "define internal float @fs_exp_f32(float %x) {attr}"
    ))
}

/// `abi::math::softcap_f32` (with `tanh_f32` inlined).
fn softcap_f32(attr: &str) -> String {
    let mut f = Func::new();
    let y = f.fdiv_u("%x", "%cap");
    let ay = f.v(format!("call float @llvm.fabs.f32(float {y})"));
    let a = f.v(format!(
        "call float @llvm.minnum.f32(float {ay}, float {})",
        f32c_u(TANH_SATURATE)
    ));
    let a2 = f.fadd_u(&a, &a);
    let e = f.v(format!("call float @fs_exp_f32(float {a2})"));
    let e1 = f.fadd_u(&e, &f32c_u(1.0));
    let q = f.fdiv_u(&f32c_u(2.0), &e1);
    let nq = f.v(format!("fneg float {q}"));
    let t = f.fadd_u(&f32c_u(1.0), &nq);
    let th = f.v(format!(
        "call float @llvm.copysign.f32(float {t}, float {y})"
    ));
    let r = f.fmul_u("%cap", &th);
    f.s(format!("ret float {r}"));
    f.finish(&format!(
        "define internal float @fs_softcap_f32(float %x, float %cap) {attr}"
    ))
}

/// `abi::rng::gumbel_f32`.
fn gumbel_f32(attr: &str) -> String {
    let mut f = Func::new();
    let k = f.v("lshr i32 %bits, 8");
    let k2 = f.v(format!("shl i32 {k}, 1"));
    let n = f.v(format!("or i32 {k2}, 1"));
    let nf = f.v(format!("uitofp i32 {n} to float"));
    let nu = f.v(format!("fptoui float {nf} to i32"));
    let residual = f.v(format!("sub i32 {n}, {nu}"));
    let uh = f.fmul_u(&nf, &f32c_u(TWO_POW_M25));
    let rf = f.v(format!("sitofp i32 {residual} to float"));
    let ul = f.fmul_u(&rf, &f32c_u(TWO_POW_M25));
    let lnu = f.v(format!("call float @fs_ln_f32(float {uh})"));
    // `ul` is 0 for every n below 2^24 (half the draws). div.rn sends a zero dividend down
    // its out-of-line slow path, so a warp took it on nearly every call (a visible share of
    // stage one's stall samples in a profile). The quotient of a nonzero stand-in is
    // discarded there: q = +0.0, the bits 0 / uh gives, as abi::rng::gumbel_f32 computes.
    let zero = f.v(format!("icmp eq i32 {residual}, 0"));
    let ul_safe = f.sel_u("float", &zero, &f32c_u(TWO_POW_M25), &ul);
    let q_nz = f.fdiv_u(&ul_safe, &uh);
    let q = f.sel_u("float", &zero, "0.0", &q_nz);
    let sum = f.fadd_u(&lnu, &q);
    let e = f.v(format!("fneg float {sum}"));
    let le = f.v(format!("call float @fs_ln_f32(float {e})"));
    let r = f.v(format!("fneg float {le}"));
    f.s(format!("ret float {r}"));
    f.finish(&format!(
        "define internal float @fs_gumbel_f32(i32 %bits) {attr}"
    ))
}

/// `abi::rng::philox4x32_10`, returning the four output words.
fn philox(attr: &str) -> String {
    let mut f = Func::new();
    let mut c = [
        "%c0".to_string(),
        "%c1".to_string(),
        "%c2".to_string(),
        "%c3".to_string(),
    ];
    let mut k = ["%k0".to_string(), "%k1".to_string()];
    for round in 0..PHILOX_ROUNDS {
        if round > 0 {
            k[0] = f.add_u(&k[0], &(PHILOX_W0 as i32).to_string());
            k[1] = f.add_u(&k[1], &(PHILOX_W1 as i32).to_string());
        }
        let mul = |f: &mut Func, m: u32, x: &str| {
            let xw = f.v(format!("zext i32 {x} to i64"));
            let p = f.v(format!("mul i64 {xw}, {m}"));
            let hi = f.v(format!("lshr i64 {p}, 32"));
            let hi = f.v(format!("trunc i64 {hi} to i32"));
            let lo = f.v(format!("trunc i64 {p} to i32"));
            (hi, lo)
        };
        let (hi0, lo0) = mul(&mut f, PHILOX_M0, &c[0]);
        let (hi1, lo1) = mul(&mut f, PHILOX_M1, &c[2]);
        let x0 = f.v(format!("xor i32 {hi1}, {}", c[1]));
        let x0 = f.v(format!("xor i32 {x0}, {}", k[0]));
        let x2 = f.v(format!("xor i32 {hi0}, {}", c[3]));
        let x2 = f.v(format!("xor i32 {x2}, {}", k[1]));
        c = [x0, lo1, x2, lo0];
    }
    let ty = "{ i32, i32, i32, i32 }";
    let mut agg = "undef".to_string();
    for (i, w) in c.iter().enumerate() {
        agg = f.v(format!("insertvalue {ty} {agg}, i32 {w}, {i}"));
    }
    f.s(format!("ret {ty} {agg}"));
    f.finish(&format!(
        "define internal {ty} @fs_philox(i32 %c0, i32 %c1, i32 %c2, i32 %c3, i32 %k0, i32 %k1) {attr}"
    ))
}

/// Row `row`'s Philox key halves and counter row (`SamplingParams::row_stream`): its own seed
/// and counter row 0 when the launch has `%row_seeds` (`has_rs`), else `%seed` and the launch
/// row `row_base + row`. `row64`: the row as i64, inside the batch (the seed's load).
pub(crate) fn row_stream(f: &mut Func, has_rs: &str, row: &str, row64: &str) -> (String, String, String) {
    let key = f.var_u("i64", "%seed");
    f.if_then_u(has_rs, |f| {
        let a = f.gaddr_u("%row_seeds", row64, 8);
        let k = f.v(format!("load i64, ptr addrspace(1) {a}, align 8"));
        f.set_u(&key, &k);
    });
    let k = f.get_u(&key);
    let lo = f.v(format!("trunc i64 {k} to i32"));
    let hi = f.v(format!("lshr i64 {k}, 32"));
    let hi = f.v(format!("trunc i64 {hi} to i32"));
    let launch_row = f.add_u(row, "%row_base");
    let ctr_row = f.sel_u("i32", has_rs, "0", &launch_row);
    (lo, hi, ctr_row)
}

/// The 32 noise bits of global token `g` (any alignment): word `g mod 4` of the Philox block
/// `[g >> 2, ctr_row, s, word3]` under key `(key_lo, key_hi)` (`abi::rng::noise_bits`' layout).
pub(crate) fn token_bits(f: &mut Func, g: &str, ctr_row: &str, s: &str, word3: &str, key: (&str, &str)) -> String {
    let ctr = f.v(format!("lshr i32 {g}, 2"));
    let ty = "{ i32, i32, i32, i32 }";
    let r = f.v(format!("call {ty} @fs_philox(i32 {ctr}, i32 {ctr_row}, i32 {s}, i32 {word3}, i32 {}, i32 {})", key.0, key.1));
    let w = f.v(format!("and i32 {g}, 3"));
    let mut bits = f.v(format!("extractvalue {ty} {r}, 0"));
    for j in 1..4 {
        let wj = f.v(format!("extractvalue {ty} {r}, {j}"));
        let is = f.v(format!("icmp eq i32 {w}, {j}"));
        bits = f.sel_u("i32", &is, &wj, &bits);
    }
    bits
}

/// Counter word 3 of row `row64`'s token noise (`abi::rng::counter_word3(step, Token)`):
/// `row_steps[row] · 4 + NoiseStream::Token`, or the stream alone (step 0) when the kernel's
/// `%row_steps` is 0.
pub(crate) fn token_word3(f: &mut Func, row64: &str) -> String {
    stream_word3(f, row64, NoiseStream::Token)
}

/// Counter word 3 of row `row64`'s noise of `stream` (`abi::rng::counter_word3(step, stream)`),
/// as [`token_word3`].
pub(crate) fn stream_word3(f: &mut Func, row64: &str, stream: NoiseStream) -> String {
    let stream = stream as u32;
    let word = f.var_u("i32", &stream.to_string());
    let has_steps = f.v("icmp ne ptr addrspace(1) %row_steps, null");
    f.if_then_u(&has_steps, |f| {
        let a = f.gaddr_u("%row_steps", row64, 4);
        let step = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
        // A step counts modulo 2^30: the shift drops its top two bits.
        let w = f.v(format!("shl i32 {step}, 2"));
        let w = f.v(format!("or i32 {w}, {stream}"));
        f.set_u(&word, &w);
    });
    f.get_u(&word)
}

/// The Gumbel noise of one quad (4 consecutive tokens, one Philox block) for two batch
/// rows at once: `fs_philox(ctr, row, s, word3, key)` per row, then `fs_gumbel_f32` of each
/// word; rows a then b. Both are inlined here, so out of line the call still carries eight
/// independent noise chains (the epilogue's latency is these chains, not their op count).
///
/// The second noise skip (DESIGN.md): `%xmax_*` is the row's largest transformed logit of the
/// quad and `%thr_*` a score the row's winner is known to reach. Once the Philox words are
/// known, a row whose `xmax + abi::rng::gumbel_bucket_bound(L)` (L: the leading ones of its
/// largest uniform) is below `thr` cannot place a token of this quad above the winner: its
/// four noises are `-inf` and the Gumbel transform (two logarithms, a division) is not run.
/// `thr` NaN (no bound yet) never skips.
fn noise_pair(attr: &str) -> String {
    let mut f = Func::new();
    let ty = "{ i32, i32, i32, i32 }";
    let mut gumbels = Vec::new();
    for (row, k0, k1, w3, xmax, thr) in [
        ("%row_a", "%ka0", "%ka1", "%w3_a", "%xmax_a", "%thr_a"),
        ("%row_b", "%kb0", "%kb1", "%w3_b", "%xmax_b", "%thr_b"),
    ] {
        let r = f.v(format!(
            "call {ty} @fs_philox(i32 %ctr, i32 {row}, i32 %s, i32 {w3}, i32 {k0}, i32 {k1})"
        ));
        let bits: Vec<String> = (0..4).map(|w| f.v(format!("extractvalue {ty} {r}, {w}"))).collect();
        let hi01 = f.umax_u(&bits[0], &bits[1]);
        let hi23 = f.umax_u(&bits[2], &bits[3]);
        let bits_max = f.umax_u(&hi01, &hi23);
        let bound = gumbel_bucket_bound(&mut f, &bits_max);
        let reach = f.fadd_u(xmax, &bound);
        let beaten = f.v(format!("fcmp olt float {reach}, {thr}"));
        let noise: Vec<Var> = (0..4).map(|_| f.var_u("float", NEG_INF)).collect();
        let draw = f.v(format!("xor i1 {beaten}, true"));
        f.if_then_u(&draw, |f| {
            for (b, slot) in bits.iter().zip(&noise) {
                let g = f.v(format!("call float @fs_gumbel_f32(i32 {b})"));
                f.set_u(slot, &g);
            }
        });
        gumbels.extend(noise.iter().map(|n| f.get_u(n)));
    }
    let out = NOISE_PAIR_TY;
    let mut agg = "undef".to_string();
    for (i, g) in gumbels.iter().enumerate() {
        agg = f.v(format!("insertvalue {out} {agg}, float {g}, {i}"));
    }
    f.s(format!("ret {out} {agg}"));
    f.finish(&format!(
        "define internal {out} @fs_noise_pair(i32 %ctr, i32 %s, i32 %row_a, i32 %ka0, i32 %ka1, \
         i32 %w3_a, i32 %row_b, i32 %kb0, i32 %kb1, i32 %w3_b, float %xmax_a, float %thr_a, \
         float %xmax_b, float %thr_b) {attr}"
    ))
}

/// `abi::rng::gumbel_bucket_bound(abi::rng::uniform_leading_ones(bits))`, op for op.
fn gumbel_bucket_bound(f: &mut Func, bits: &str) -> String {
    let inv = f.v(format!("xor i32 {bits}, -1"));
    let inv = f.v(format!("or i32 {inv}, 255"));
    let leading_ones = f.v(format!("call i32 @llvm.ctlz.i32(i32 {inv}, i1 false)"));
    let l = f.v(format!("uitofp i32 {leading_ones} to float"));
    let l1 = f.fadd_u(&l, &f32c_u(1.0));
    let b = f.fmul_u(&l1, &f32c_u(std::f32::consts::LN_2));
    f.fadd_u(&b, &f32c_u(GUMBEL_BUCKET_SLACK))
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
        exp_f32(attr),
        softcap_f32(attr),
        gumbel_f32("#0"),
        philox("#0"),
        noise_pair(attr),
    ] {
        out.push_str(&f);
        out.push('\n');
    }
    out
}
