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

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f64) -> f64 {
        ((f64::from(a) - b) / (b.abs() * f64::from(f32::EPSILON))).abs()
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
