//! f32 `ln`, `exp` and `tanh`: the exact operation sequences every backend emits.
//!
//! Cranelift has no transcendental instructions and PTX's are approximations, so the
//! backends implement these sequences themselves. Each step is an IEEE-754 operation
//! with round-to-nearest (multiply-adds are explicit `fma`), so a backend that emits
//! the same steps computes bit-identical results. The constants are public so codegen
//! reads them from here instead of restating them.

/// Bits of ~√½: `ln_f32` shifts the exponent so the mantissa lands in [√½, √2).
pub const LN_REDUCE_BITS: i32 = 0x3f35_04f3;
/// `ln 2` split so that `e · LN2_HI` is exact for |e| < 2^9.
pub const LN2_HI: f32 = 0.693_145_75;
/// The rest of `ln 2`.
pub const LN2_LO: f32 = 1.428_606_8e-6;
/// atanh series coefficients of `ln((1+s)/(1-s)) = 2s(1 + s²/3 + s⁴/5 + s⁶/7 + s⁸/9)`.
pub const LN_C3: f32 = 1.0 / 3.0;
/// See [`LN_C3`].
pub const LN_C5: f32 = 1.0 / 5.0;
/// See [`LN_C3`].
pub const LN_C7: f32 = 1.0 / 7.0;
/// See [`LN_C3`].
pub const LN_C9: f32 = 1.0 / 9.0;

/// Natural log of a positive, normal, finite `x`.
#[inline]
pub fn ln_f32(x: f32) -> f32 {
    let t = (x.to_bits() as i32).wrapping_sub(LN_REDUCE_BITS);
    let e = (t >> 23) as f32;
    let m = f32::from_bits(((t & 0x007f_ffff) + LN_REDUCE_BITS) as u32);
    let f = m - 1.0;
    let s = f / (2.0 + f);
    let z = s * s;
    let p = z.mul_add(LN_C9, LN_C7);
    let p = z.mul_add(p, LN_C5);
    let p = z.mul_add(p, LN_C3);
    let s2 = s + s;
    let ln_m = (s2 * z).mul_add(p, s2);
    e.mul_add(LN2_HI, e.mul_add(LN2_LO, ln_m))
}

/// `log2(e)`, the exponent's scale in `exp_f32`.
pub const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// Below this `exp_f32` returns exactly 0 (the true value is < 2⁻¹²⁵).
pub const EXP_MIN_INPUT: f32 = -87.0;
/// Taylor coefficients 1/k! for k = 2..=7 of `exp` on |r| ≤ ln2/2.
pub const EXP_C: [f32; 6] = [1.0 / 2.0, 1.0 / 6.0, 1.0 / 24.0, 1.0 / 120.0, 1.0 / 720.0, 1.0 / 5040.0];

/// `exp(x)` for `x ≤ 88`; `-inf` and anything below [`EXP_MIN_INPUT`] give 0.
#[inline]
pub fn exp_f32(x: f32) -> f32 {
    let xc = x.max(EXP_MIN_INPUT);
    let n = (xc * LOG2_E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, xc);
    let r = (-n).mul_add(LN2_LO, r);
    let p = r.mul_add(EXP_C[5], EXP_C[4]);
    let p = r.mul_add(p, EXP_C[3]);
    let p = r.mul_add(p, EXP_C[2]);
    let p = r.mul_add(p, EXP_C[1]);
    let p = r.mul_add(p, EXP_C[0]);
    let p = r.mul_add(p, 1.0);
    let p = r.mul_add(p, 1.0);
    let scale = f32::from_bits((((n as i32) + 127) as u32) << 23);
    let y = p * scale;
    if x < EXP_MIN_INPUT {
        0.0
    } else {
        y
    }
}

/// |y| above which `tanh` is 1 in f32.
pub const TANH_SATURATE: f32 = 9.0;

/// `tanh(y)` as `1 − 2/(exp(2|y|) + 1)` with the sign of `y`: absolute error ~1e-7.
pub fn tanh_f32(y: f32) -> f32 {
    let a = y.abs().min(TANH_SATURATE);
    let e = exp_f32(a + a);
    let t = 1.0 - 2.0 / (e + 1.0);
    t.copysign(y)
}

/// `cap · tanh(x / cap)`: the softcap transform as backends compute it.
pub fn softcap_f32(x: f32, cap: f32) -> f32 {
    cap * tanh_f32(x / cap)
}

/// `ln 2`'s high part for [`ln_f64`] and [`exp_f64`] (fdlibm's `ln2_hi`: 32 significant bits,
/// so `k · LN2_HI_F64` is exact for |k| < 2^21).
pub const LN2_HI_F64: f64 = 6.931_471_803_691_238e-1;
/// The rest of `ln 2` (fdlibm's `ln2_lo`).
pub const LN2_LO_F64: f64 = 1.908_214_929_270_587_7e-10;
/// fdlibm `e_log.c`'s minimax coefficients `Lg1..Lg7` of `(ln(1+f) − 2s)/s` in `z = s²`,
/// `s = f/(2+f)`, on `|s| ≤ 0.1716` (error below 2⁻⁵⁸·⁴⁵).
pub const LN_LG: [f64; 7] = [
    6.666_666_666_666_735e-1,
    3.999_999_999_940_942e-1,
    2.857_142_874_366_239e-1,
    2.222_219_843_214_978_4e-1,
    1.818_357_216_161_805e-1,
    1.531_383_769_920_937_3e-1,
    1.479_819_860_511_658_6e-1,
];

/// Natural log of a positive, normal, finite `x` in f64, under 1 ulp: fdlibm's `e_log.c`
/// (Sun Microsystems, 1993; the algorithm of musl's and FreeBSD's `log`) without its special
/// cases. `x = 2^k·(1 + f)` with `1 + f ∈ [√½, √2)`, `ln(1 + f) = f − f²/2 + s(f²/2 + R(s²))`.
/// Only IEEE `+ − × ÷` and bit operations, each rounded to nearest, so the host and the
/// device (`codegen-ptx`'s `fs_ln_f64`, op for op) compute the same bits.
pub fn ln_f64(x: f64) -> f64 {
    let bits = x.to_bits();
    let hx = (bits >> 32) as u32;
    // The exponent moves by one where the mantissa is at least √2 (high word 0x6a09e).
    let mant_hi = hx & 0x000f_ffff;
    let i = mant_hi.wrapping_add(0x95f64) & 0x0010_0000;
    let k = ((hx >> 20) as i32 - 1023) + (i >> 20) as i32;
    let m = f64::from_bits((u64::from(mant_hi | (i ^ 0x3ff0_0000)) << 32) | (bits & 0xffff_ffff));
    let f = m - 1.0;
    let s = f / (2.0 + f);
    let dk = f64::from(k);
    let z = s * s;
    let w = z * z;
    let t1 = w * (LN_LG[1] + w * (LN_LG[3] + w * LN_LG[5]));
    let t2 = z * (LN_LG[0] + w * (LN_LG[2] + w * (LN_LG[4] + w * LN_LG[6])));
    let r = t2 + t1;
    // fdlibm's branch: where f is far from 0, subtract f²/2 separately for accuracy.
    let far = (mant_hi as i32 - 0x6147a) | (0x6b851 - mant_hi as i32);
    if far > 0 {
        let hfsq = 0.5 * f * f;
        dk * LN2_HI_F64 - ((hfsq - (s * (hfsq + r) + dk * LN2_LO_F64)) - f)
    } else {
        dk * LN2_HI_F64 - ((s * (f - r) - dk * LN2_LO_F64) - f)
    }
}

/// fdlibm `e_exp.c`'s coefficients `P1..P5` of `R(r²) ≈ r·(e^r + 1)/(e^r − 1) − 2` on
/// `|r| ≤ ln2/2` (error below 2⁻⁵⁹).
pub const EXP_P: [f64; 5] = [
    1.666_666_666_666_660_2e-1,
    -2.777_777_777_701_559_3e-3,
    6.613_756_321_437_934e-5,
    -1.653_390_220_546_525_2e-6,
    4.138_136_797_057_238_5e-8,
];
/// Below this [`exp_f64`] returns 0 (the true value is below 2⁻¹⁰²¹: no probability the
/// decision compares is that small but for a token it could never pick).
pub const EXP_F64_MIN_INPUT: f64 = -708.0;
/// `1 / ln 2`.
pub const INV_LN2_F64: f64 = std::f64::consts::LOG2_E;

/// `exp(x)` in f64 for `x ≤ 709`, under 1 ulp: fdlibm's `e_exp.c` (Sun Microsystems, 1993)
/// with the reduction `k = round_ties_even(x / ln 2)`, `r = x − k·ln2` in two parts,
/// `e^r = 1 + r + r·c/(2 − c)` with `c = r − r²·R(r²)`. Anything below [`EXP_F64_MIN_INPUT`],
/// `-inf` and NaN give 0. Only IEEE `+ − × ÷`, `round_ties_even` and bit operations, so the
/// device (`fs_exp_f64`) computes the same bits.
pub fn exp_f64(x: f64) -> f64 {
    // NaN compares false, so it returns 0 with everything below the domain.
    if x.is_nan() || x < EXP_F64_MIN_INPUT {
        return 0.0;
    }
    let kf = (x * INV_LN2_F64).round_ties_even();
    let hi = x - kf * LN2_HI_F64;
    let lo = kf * LN2_LO_F64;
    let r = hi - lo;
    let t = r * r;
    let c = r - t * (EXP_P[0] + t * (EXP_P[1] + t * (EXP_P[2] + t * (EXP_P[3] + t * EXP_P[4]))));
    let y = 1.0 - ((lo - (r * c) / (2.0 - c)) - hi);
    // k ∈ [-1021, 1023] on the domain: 2^k is a normal number.
    let scale = f64::from_bits(((kf as i64 + 1023) as u64) << 52);
    y * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f64) -> f64 {
        ((f64::from(a) - b) / (b.abs() * f64::from(f32::EPSILON))).abs()
    }

    fn ulps_f64(a: f64, b: f64) -> f64 {
        // Against the correctly rounded value's neighbourhood: std's ln/exp are within 1 ulp.
        ((a - b) / (b.abs() * f64::EPSILON)).abs()
    }

    #[test]
    fn f64_constants_are_fdlibms() {
        // The hexadecimal forms in fdlibm's e_log.c and e_exp.c.
        assert_eq!((LN2_HI_F64.to_bits(), LN2_LO_F64.to_bits()), (0x3fe6_2e42_fee0_0000, 0x3dea_39ef_3579_3c76));
        let lg = [0x3fe5_5555_5555_5593, 0x3fd9_9999_9997_fa04, 0x3fd2_4924_9422_9359, 0x3fcc_71c5_1d8e_78af, 0x3fc7_4664_96cb_03de, 0x3fc3_9a09_d078_c69f, 0x3fc2_f112_df3e_5244];
        assert_eq!(LN_LG.map(f64::to_bits), lg);
        let p = [0x3fc5_5555_5555_553e, 0xbf66_c16c_16be_bd93, 0x3f11_566a_af25_de2c, 0xbebb_bd41_c5d2_6bf1, 0x3e66_3769_72be_a4d0];
        assert_eq!(EXP_P.map(f64::to_bits), p);
    }

    #[test]
    fn ln_f64_is_within_one_ulp() {
        let mut worst: f64 = 0.0;
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2_000_000 {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            // Normal positive doubles over the whole exponent range.
            let bits = (state >> 2) % (0x7fe0_0000_0000_0000 - 0x0010_0000_0000_0000) + 0x0010_0000_0000_0000;
            let x = f64::from_bits(bits);
            if (x - 1.0).abs() > 1e-3 {
                worst = worst.max(ulps_f64(ln_f64(x), x.ln()));
            }
        }
        // Near 1, the error relative to the tiny result.
        for i in 1..200_000 {
            let x = 1.0 + (f64::from(i) - 100_000.0) * 1e-8;
            if x != 1.0 {
                worst = worst.max(ulps_f64(ln_f64(x), x.ln()));
            }
        }
        assert!(worst <= 1.0, "worst ln_f64 error {worst} ulp");
        assert_eq!(ln_f64(1.0), 0.0);
        assert_eq!(ln_f64(std::f64::consts::E), 1.0);
    }

    #[test]
    fn exp_f64_is_within_one_ulp() {
        let mut worst: f64 = 0.0;
        let mut x = -707.9f64;
        while x < 709.0 {
            worst = worst.max(ulps_f64(exp_f64(x), x.exp()));
            x += 0.000_713;
        }
        assert!(worst <= 1.0, "worst exp_f64 error {worst} ulp");
        assert_eq!(exp_f64(0.0), 1.0);
        assert_eq!(exp_f64(f64::NEG_INFINITY), 0.0);
        assert_eq!(exp_f64(f64::NAN), 0.0);
        assert_eq!(exp_f64(-709.0), 0.0);
    }

    #[test]
    fn ln_is_within_two_ulp() {
        let mut worst: f64 = 0.0;
        let mut bits = 0x0080_0000u32; // smallest normal
        while bits < 0x7f80_0000 {
            let x = f32::from_bits(bits);
            if x != 1.0 {
                worst = worst.max(ulps(ln_f32(x), f64::from(x).ln()));
            }
            bits += 97;
        }
        assert!(worst <= 2.0, "worst ln error {worst} ulp");
        assert_eq!(ln_f32(1.0), 0.0);
    }

    #[test]
    fn exp_is_within_two_ulp() {
        let mut worst: f64 = 0.0;
        let mut x = -86.9f32;
        while x < 88.0 {
            worst = worst.max(ulps(exp_f32(x), f64::from(x).exp()));
            x += 0.001_3;
        }
        assert!(worst <= 2.0, "worst exp error {worst} ulp");
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(0.0), 1.0);
    }

    #[test]
    fn tanh_absolute_error() {
        let mut x = -20.0f32;
        while x < 20.0 {
            let err = (f64::from(tanh_f32(x)) - f64::from(x).tanh()).abs();
            assert!(err <= 2.5e-7, "tanh({x}) off by {err}");
            x += 0.000_7;
        }
    }
}
