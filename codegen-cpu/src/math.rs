//! Emission of `flashsample_abi`'s f32 algorithms (ln, exp, tanh, softcap, Gumbel, Philox)
//! and of the f16 widening, for a scalar `f32`/`i32` or lane-wise for `f32x4`/`i32x4`.
//!
//! Each function mirrors its `abi` counterpart step for step (same constants, explicit
//! `fma`, IEEE `fdiv`), so the emitted code is bit-identical to the Rust it copies.
//! Rust's `f32::max`/`min` return the non-NaN operand; Cranelift's `fmax`/`fmin` propagate
//! NaN, so those two are emitted as compare-and-select instead.

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{types, ConstantData, Endianness, InstBuilder, InstructionData, MemFlagsData, Opcode, Type, Value};
use cranelift_frontend::FunctionBuilder;
use flashsample_abi::math::{
    EXP_C, EXP_MIN_INPUT, LN2_HI, LN2_LO, LN_C3, LN_C5, LN_C7, LN_C9, LN_REDUCE_BITS, LOG2_E, TANH_SATURATE,
};
use flashsample_abi::lse::{INV_WINDOW, TERM_SCALE, WINDOW, WINDOW_LIMIT};
use flashsample_abi::rng::{PHILOX_M0, PHILOX_M1, PHILOX_ROUNDS, PHILOX_W0, PHILOX_W1, TWO_POW_M25};

/// Vector bitcasts between lane shapes need an explicit byte order.
pub(crate) fn le() -> MemFlagsData {
    MemFlagsData::new().with_endianness(Endianness::Little)
}

pub(crate) fn int_of(ty: Type) -> Type {
    if ty.is_vector() {
        types::I32X4
    } else {
        types::I32
    }
}

pub(crate) fn float_of(ty: Type) -> Type {
    if ty.is_vector() {
        types::F32X4
    } else {
        types::F32
    }
}

pub(crate) fn fconst(b: &mut FunctionBuilder, ty: Type, x: f32) -> Value {
    let s = b.ins().f32const(x);
    if ty.is_vector() {
        b.ins().splat(float_of(ty), s)
    } else {
        s
    }
}

pub(crate) fn iconst(b: &mut FunctionBuilder, ty: Type, x: u32) -> Value {
    let s = b.ins().iconst(types::I32, i64::from(x));
    if ty.is_vector() {
        b.ins().splat(int_of(ty), s)
    } else {
        s
    }
}

/// An `i32x4` constant with distinct lanes.
pub(crate) fn i32x4_lanes(b: &mut FunctionBuilder, lanes: [u32; 4]) -> Value {
    let bytes: Vec<u8> = lanes.iter().flat_map(|l| l.to_le_bytes()).collect();
    let c = b.func.dfg.constants.insert(ConstantData::from(bytes));
    b.ins().vconst(types::I32X4, c)
}

pub(crate) fn to_bits(b: &mut FunctionBuilder, x: Value) -> Value {
    let ty = b.func.dfg.value_type(x);
    b.ins().bitcast(int_of(ty), le(), x)
}

pub(crate) fn from_bits(b: &mut FunctionBuilder, x: Value) -> Value {
    let ty = b.func.dfg.value_type(x);
    b.ins().bitcast(float_of(ty), le(), x)
}

/// `cond ? a : b` for a condition from `fcmp`/`icmp` on the operands' shape
/// (an `i8` for scalars, an all-ones/zero lane mask for vectors).
pub(crate) fn select(b: &mut FunctionBuilder, cond: Value, a: Value, c: Value) -> Value {
    let ty = b.func.dfg.value_type(a);
    if ty.is_vector() {
        let mask = b.ins().bitcast(ty, le(), cond);
        b.ins().bitselect(mask, a, c)
    } else {
        b.ins().select(cond, a, c)
    }
}

/// `x.max(c)` for a non-NaN constant `c`, with Rust's NaN rule (NaN gives `c`).
pub(crate) fn max_const(b: &mut FunctionBuilder, x: Value, c: f32) -> Value {
    let ty = b.func.dfg.value_type(x);
    let cv = fconst(b, ty, c);
    let gt = b.ins().fcmp(FloatCC::GreaterThan, x, cv);
    select(b, gt, x, cv)
}

/// `x.min(c)` for a non-NaN constant `c`, with Rust's NaN rule (NaN gives `c`).
pub(crate) fn min_const(b: &mut FunctionBuilder, x: Value, c: f32) -> Value {
    let ty = b.func.dfg.value_type(x);
    let cv = fconst(b, ty, c);
    let lt = b.ins().fcmp(FloatCC::LessThan, x, cv);
    select(b, lt, x, cv)
}

fn fma_c(b: &mut FunctionBuilder, x: Value, y: f32, z: f32) -> Value {
    let ty = b.func.dfg.value_type(x);
    let (y, z) = (fconst(b, ty, y), fconst(b, ty, z));
    b.ins().fma(x, y, z)
}

fn fma_cv(b: &mut FunctionBuilder, x: Value, y: Value, z: f32) -> Value {
    let ty = b.func.dfg.value_type(x);
    let z = fconst(b, ty, z);
    b.ins().fma(x, y, z)
}

/// `abi::math::ln_f32`.
pub(crate) fn ln_f32(b: &mut FunctionBuilder, x: Value) -> Value {
    let ty = b.func.dfg.value_type(x);
    let xi = to_bits(b, x);
    let reduce = iconst(b, ty, LN_REDUCE_BITS as u32);
    let t = b.ins().isub(xi, reduce);
    let t_exp = b.ins().sshr_imm_u(t, 23);
    let e = b.ins().fcvt_from_sint(float_of(ty), t_exp);
    let mant_mask = iconst(b, ty, 0x007f_ffff);
    let mant = b.ins().band(t, mant_mask);
    let mi = b.ins().iadd(mant, reduce);
    let m = from_bits(b, mi);
    let one = fconst(b, ty, 1.0);
    let f = b.ins().fsub(m, one);
    let two = fconst(b, ty, 2.0);
    let denom = b.ins().fadd(two, f);
    let s = b.ins().fdiv(f, denom);
    let z = b.ins().fmul(s, s);
    let p = fma_c(b, z, LN_C9, LN_C7);
    let p = fma_cv(b, z, p, LN_C5);
    let p = fma_cv(b, z, p, LN_C3);
    let s2 = b.ins().fadd(s, s);
    let s2z = b.ins().fmul(s2, z);
    let ln_m = b.ins().fma(s2z, p, s2);
    let lo = fconst(b, ty, LN2_LO);
    let inner = b.ins().fma(e, lo, ln_m);
    let hi = fconst(b, ty, LN2_HI);
    b.ins().fma(e, hi, inner)
}

/// `abi::math::exp_f32`.
pub(crate) fn exp_f32(b: &mut FunctionBuilder, x: Value) -> Value {
    let ty = b.func.dfg.value_type(x);
    let xc = max_const(b, x, EXP_MIN_INPUT);
    let y = exp_reduced(b, xc, |b, n| b.ins().fcvt_to_sint_sat(int_of(ty), n));
    let min_input = fconst(b, ty, EXP_MIN_INPUT);
    let below = b.ins().fcmp(FloatCC::LessThan, x, min_input);
    let zero = fconst(b, ty, 0.0);
    select(b, below, zero, y)
}

/// `abi::math::exp_f32` between its input clamp and its final select: `p(r) · 2ⁿ` with
/// `n = round(x · log₂e)`, `convert` turning `n` into an integer. Equal to `exp_f32(x)` for
/// every `x ≥ EXP_MIN_INPUT` whose `n` `convert` takes exactly.
fn exp_reduced(b: &mut FunctionBuilder, xc: Value, convert: impl FnOnce(&mut FunctionBuilder, Value) -> Value) -> Value {
    let ty = b.func.dfg.value_type(xc);
    let log2e = fconst(b, ty, LOG2_E);
    let scaled = b.ins().fmul(xc, log2e);
    let n = b.ins().nearest(scaled);
    let neg_n = b.ins().fneg(n);
    let hi = fconst(b, ty, LN2_HI);
    let r = b.ins().fma(neg_n, hi, xc);
    let lo = fconst(b, ty, LN2_LO);
    let r = b.ins().fma(neg_n, lo, r);
    let p = fma_c(b, r, EXP_C[5], EXP_C[4]);
    let p = fma_cv(b, r, p, EXP_C[3]);
    let p = fma_cv(b, r, p, EXP_C[2]);
    let p = fma_cv(b, r, p, EXP_C[1]);
    let p = fma_cv(b, r, p, EXP_C[0]);
    let p = fma_cv(b, r, p, 1.0);
    let p = fma_cv(b, r, p, 1.0);
    let ni = convert(b, n);
    let bias = iconst(b, ty, 127);
    let biased = b.ins().iadd(ni, bias);
    let scale_bits = b.ins().ishl_imm_u(biased, 23);
    let scale = from_bits(b, scale_bits);
    b.ins().fmul(p, scale)
}

/// `f32x4` lanes to `i32x4` by truncation, for lanes that are finite and inside the i32 range
/// (any other lane is garbage the caller masks off). On x86 one `cvttps2dq`, where
/// `fcvt_to_sint_sat` adds five instructions for NaN and overflow lanes.
fn cvt_in_range(b: &mut FunctionBuilder, x: Value) -> Value {
    #[cfg(target_arch = "x86_64")]
    {
        b.ins().x86_cvtt2dq(types::I32X4, x)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        b.ins().fcvt_to_sint_sat(types::I32X4, x)
    }
}

/// `abi::math::tanh_f32`.
pub(crate) fn tanh_f32(b: &mut FunctionBuilder, y: Value) -> Value {
    let ty = b.func.dfg.value_type(y);
    let yi = to_bits(b, y);
    let magnitude = iconst(b, ty, 0x7fff_ffff);
    let abs_bits = b.ins().band(yi, magnitude);
    let abs = from_bits(b, abs_bits);
    let a = min_const(b, abs, TANH_SATURATE);
    let a2 = b.ins().fadd(a, a);
    let e = exp_f32(b, a2);
    let one = fconst(b, ty, 1.0);
    let ep1 = b.ins().fadd(e, one);
    let two = fconst(b, ty, 2.0);
    let q = b.ins().fdiv(two, ep1);
    let t = b.ins().fsub(one, q);
    let ti = to_bits(b, t);
    let t_mag = b.ins().band(ti, magnitude);
    let sign = iconst(b, ty, 0x8000_0000);
    let y_sign = b.ins().band(yi, sign);
    let out = b.ins().bor(t_mag, y_sign);
    from_bits(b, out)
}

/// `abi::math::softcap_f32`.
pub(crate) fn softcap_f32(b: &mut FunctionBuilder, x: Value, cap: f32) -> Value {
    let ty = b.func.dfg.value_type(x);
    let c = fconst(b, ty, cap);
    let q = b.ins().fdiv(x, c);
    let t = tanh_f32(b, q);
    b.ins().fmul(c, t)
}

/// `abi::rng::gumbel_f32` of 32 noise bits (`i32` or `i32x4`).
pub(crate) fn gumbel_f32(b: &mut FunctionBuilder, bits: Value) -> Value {
    let ity = b.func.dfg.value_type(bits);
    let fty = float_of(ity);
    let k = b.ins().ushr_imm_u(bits, 8);
    let k2 = b.ins().ishl_imm_u(k, 1);
    let one_i = iconst(b, ity, 1);
    let n = b.ins().bor(k2, one_i);
    // n < 2^25, so the signed conversions are the unsigned ones of the Rust code.
    let nf = b.ins().fcvt_from_sint(fty, n);
    let nf_int = b.ins().fcvt_to_sint_sat(ity, nf);
    let residual = b.ins().isub(n, nf_int);
    let scale = fconst(b, fty, TWO_POW_M25);
    let uh = b.ins().fmul(nf, scale);
    let residual_f = b.ins().fcvt_from_sint(fty, residual);
    let ul = b.ins().fmul(residual_f, scale);
    let ln_uh = ln_f32(b, uh);
    let q = b.ins().fdiv(ul, uh);
    let sum = b.ins().fadd(ln_uh, q);
    let e = b.ins().fneg(sum);
    let ln_e = ln_f32(b, e);
    b.ins().fneg(ln_e)
}

/// `hi:lo = a * m` for an `i32` (or each lane of an `i32x4`) `a` and a 32-bit constant `m`.
fn mul_hi_lo(b: &mut FunctionBuilder, a: Value, m: u32) -> (Value, Value) {
    if let Some(x) = splat_source(b, a) {
        // A lane-uniform word (the quad and sample counters in Philox's first round): one
        // scalar multiply, its halves splat. Cranelift folds `uwiden(splat x)` into a splat of
        // the widened scalar, which its `pmuludq` rule does not match, so the vector form
        // took the generic 64-bit multiply (three `pmuludq`, shifts and adds per half).
        let (hi, lo) = mul_hi_lo(b, x, m);
        return (b.ins().splat(types::I32X4, hi), b.ins().splat(types::I32X4, lo));
    }
    if b.func.dfg.value_type(a) == types::I32X4 {
        // Lanes 0–1 and 2–3 widened to u64 and multiplied (one `pmuludq` each where the ISA has
        // no AVX-512 DQ, `CpuKernel::compile_with`); the low and high words
        // of the four products are lanes 0, 2 and 1, 3 of each (two shuffles instead of a
        // `pmulld` for the low words).
        // A `vconst`, not a splat: Cranelift folds the widening of a splat into a constant,
        // and its `pmuludq` rule matches only a widening of both operands.
        let mv = i32x4_lanes(b, [m; 4]);
        let halves = [(b.ins().uwiden_low(a), b.ins().uwiden_low(mv)), (b.ins().uwiden_high(a), b.ins().uwiden_high(mv))];
        let [p01, p23] = halves.map(|(x, y)| {
            let p = b.ins().imul(x, y);
            b.ins().bitcast(types::I32X4, le(), p)
        });
        let hi = shuffle32(b, p01, p23, [1, 3, 5, 7]);
        let lo = shuffle32(b, p01, p23, [0, 2, 4, 6]);
        return (hi, lo);
    }
    let wide = b.ins().uextend(types::I64, a);
    let p = b.ins().imul_imm_u(wide, i64::from(m));
    let hi64 = b.ins().ushr_imm_u(p, 32);
    let hi = b.ins().ireduce(types::I32, hi64);
    let lo = b.ins().ireduce(types::I32, p);
    (hi, lo)
}

/// The scalar `x` when `v` is `splat x`.
fn splat_source(b: &FunctionBuilder, v: Value) -> Option<Value> {
    let dfg = &b.func.dfg;
    let inst = dfg.value_def(v).inst()?;
    match dfg.insts[inst] {
        InstructionData::Unary { opcode: Opcode::Splat, arg } => Some(arg),
        _ => None,
    }
}

/// `abi::rng::philox4x32_10` on `i32` counter words and key words, or on `i32x4`s: four
/// independent generators, one per lane.
pub(crate) fn philox4x32_10(b: &mut FunctionBuilder, ctr: [Value; 4], key: [Value; 2]) -> [Value; 4] {
    let mut c = ctr;
    let mut k = key;
    let ty = b.func.dfg.value_type(key[0]);
    for round in 0..PHILOX_ROUNDS {
        if round > 0 {
            if ty.is_vector() {
                let w = [PHILOX_W0, PHILOX_W1].map(|w| iconst(b, ty, w));
                k = [b.ins().iadd(k[0], w[0]), b.ins().iadd(k[1], w[1])];
            } else {
                k[0] = b.ins().iadd_imm_u(k[0], i64::from(PHILOX_W0));
                k[1] = b.ins().iadd_imm_u(k[1], i64::from(PHILOX_W1));
            }
        }
        let (hi0, lo0) = mul_hi_lo(b, c[0], PHILOX_M0);
        let (hi1, lo1) = mul_hi_lo(b, c[2], PHILOX_M1);
        let x0 = b.ins().bxor(hi1, c[1]);
        let x0 = b.ins().bxor(x0, k[0]);
        let x2 = b.ins().bxor(hi0, c[3]);
        let x2 = b.ins().bxor(x2, k[1]);
        c = [x0, lo1, x2, lo0];
    }
    c
}

/// `mask ? c : 0` as an integer of `mask`'s shape (vector masks are all-ones lanes).
fn masked_const(b: &mut FunctionBuilder, ty: Type, mask: Value, c: u32) -> Value {
    let cv = iconst(b, ty, c);
    if ty.is_vector() {
        b.ins().band(mask, cv)
    } else {
        let zero = iconst(b, ty, 0);
        b.ins().select(mask, cv, zero)
    }
}

/// IEEE binary16 bits (in the low 16 bits of each `i32` lane, upper bits zero) to f32, exactly,
/// including subnormals, ±inf and NaN. Subnormals are rebuilt by subtracting 2⁻¹⁴ from a normal
/// f32 instead of multiplying a denormal, so no denormal operand ever reaches the FPU.
pub(crate) fn f16_to_f32(b: &mut FunctionBuilder, raw: Value) -> Value {
    let ty = b.func.dfg.value_type(raw);
    let magnitude = iconst(b, ty, 0x7fff);
    let mag = b.ins().band(raw, magnitude);
    let t = b.ins().ishl_imm_u(mag, 13);
    let exp_mask = iconst(b, ty, 0x0f80_0000);
    let e = b.ins().band(t, exp_mask);
    let rebias = iconst(b, ty, 0x3800_0000); // (127 - 15) << 23
    let t = b.ins().iadd(t, rebias);
    let is_inf_nan = b.ins().icmp(IntCC::Equal, e, exp_mask);
    let inf_fix = masked_const(b, ty, is_inf_nan, 0x3800_0000);
    let t = b.ins().iadd(t, inf_fix);
    let zero = iconst(b, ty, 0);
    let is_sub = b.ins().icmp(IntCC::Equal, e, zero);
    let sub_fix = masked_const(b, ty, is_sub, 0x0080_0000);
    let t = b.ins().iadd(t, sub_fix);
    let magic_bits = masked_const(b, ty, is_sub, 0x3880_0000); // 2^-14 for subnormals, else +0
    let tf = from_bits(b, t);
    let magic = from_bits(b, magic_bits);
    let f = b.ins().fsub(tf, magic);
    let fi = to_bits(b, f);
    let sign_mask = iconst(b, ty, 0x8000);
    let sign16 = b.ins().band(raw, sign_mask);
    let sign = b.ins().ishl_imm_u(sign16, 16);
    let out = b.ins().bor(fi, sign);
    from_bits(b, out)
}

/// A two-input 32-bit-lane shuffle of `f32x4`s or `i32x4`s (the result has `a`'s type):
/// lanes 0–3 pick from `a`, 4–7 from `c`.
pub(crate) fn shuffle32(b: &mut FunctionBuilder, a: Value, c: Value, lanes: [u8; 4]) -> Value {
    let ty = b.func.dfg.value_type(a);
    let bytes: Vec<u8> = lanes.iter().flat_map(|&l| (0..4).map(move |i| l * 4 + i)).collect();
    let imm = b.func.dfg.immediates.push(ConstantData::from(bytes));
    let a8 = b.ins().bitcast(types::I8X16, le(), a);
    let c8 = b.ins().bitcast(types::I8X16, le(), c);
    let s = b.ins().shuffle(a8, c8, imm);
    b.ins().bitcast(ty, le(), s)
}

/// `a > c ? a : c` lane-wise, for operands known not to be NaN.
fn max_no_nan(b: &mut FunctionBuilder, a: Value, c: Value) -> Value {
    let gt = b.ins().fcmp(FloatCC::GreaterThan, a, c);
    select(b, gt, a, c)
}

/// The largest lane of an `f32x4` without NaN lanes (it is always one of the lanes, bit for bit).
pub(crate) fn hmax(b: &mut FunctionBuilder, v: Value) -> Value {
    let swapped = shuffle32(b, v, v, [2, 3, 0, 1]);
    let m = max_no_nan(b, v, swapped);
    let swapped = shuffle32(b, m, m, [1, 0, 3, 2]);
    let m = max_no_nan(b, m, swapped);
    b.ins().extractlane(m, 0)
}

/// `abi::lse::LseTerm::of` lane-wise (`f32x4`): the window `floor(x / 16)` clamped to
/// `±WINDOW_LIMIT` (`i32x4`), and the term `exp_f32(x − 16·floor(x / 16)) · 2²³` (`f32x4`,
/// an integer below 2^46.1; [`term_halves`] splits it). For finite `x` the remainder lies in
/// `[0, 16)`, where `exp_f32`'s clamp and select change nothing and its `n` is 0..=23, and the
/// clamped window is inside the i32 range, so both conversions are plain truncations. Lanes
/// with non-finite `x` are garbage: mask them.
pub(crate) fn lse_term(b: &mut FunctionBuilder, x: Value) -> (Value, Value) {
    let ty = b.func.dfg.value_type(x);
    debug_assert_eq!(ty, types::F32X4, "lse_term is lane-wise");
    let inv = fconst(b, ty, INV_WINDOW);
    let scaled = b.ins().fmul(x, inv);
    let k = b.ins().floor(scaled);
    let w = fconst(b, ty, WINDOW);
    let kw = b.ins().fmul(k, w);
    let f = b.ins().fsub(x, kw);
    let t = exp_reduced(b, f, cvt_in_range);
    let scale = fconst(b, ty, TERM_SCALE);
    let term = b.ins().fmul(t, scale);
    let lim = WINDOW_LIMIT as f32;
    let kc = max_const(b, k, -lim);
    let kc = min_const(b, kc, lim);
    let window = cvt_in_range(b, kc);
    (window, term)
}

/// A counted term (an integer `T ∈ [2²³, 2^46.1)` in f32, from [`lse_term`]) as two `i32x4`
/// halves, `T = hi · 2²³ + lo` with `hi < 2^23.1` and `lo < 2²³`. Exact: `T · 2⁻²³` and its
/// floor are exact, `hi · 2²³` is a multiple of `T`'s ulp (at most 2²³), so `T − hi · 2²³` is
/// too and fits 24 bits. Garbage lanes give garbage halves.
pub(crate) fn term_halves(b: &mut FunctionBuilder, term: Value) -> (Value, Value) {
    let ty = b.func.dfg.value_type(term);
    let down = fconst(b, ty, 1.0 / TERM_SCALE);
    let scaled = b.ins().fmul(term, down);
    let hi = b.ins().floor(scaled);
    let up = fconst(b, ty, TERM_SCALE);
    let hi_part = b.ins().fmul(hi, up);
    let lo = b.ins().fsub(term, hi_part);
    (cvt_in_range(b, hi), cvt_in_range(b, lo))
}

/// `[Σ a0, Σ a1, Σ a2, Σ a3]` from four `f32x4` partial-sum accumulators.
pub(crate) fn transpose_sum(b: &mut FunctionBuilder, a: [Value; 4]) -> Value {
    let lo01 = shuffle32(b, a[0], a[1], [0, 4, 1, 5]);
    let hi01 = shuffle32(b, a[0], a[1], [2, 6, 3, 7]);
    let s01 = b.ins().fadd(lo01, hi01);
    let lo23 = shuffle32(b, a[2], a[3], [0, 4, 1, 5]);
    let hi23 = shuffle32(b, a[2], a[3], [2, 6, 3, 7]);
    let s23 = b.ins().fadd(lo23, hi23);
    let u0 = shuffle32(b, s01, s23, [0, 1, 4, 5]);
    let u1 = shuffle32(b, s01, s23, [2, 3, 6, 7]);
    b.ins().fadd(u0, u1)
}
