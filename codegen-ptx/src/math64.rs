//! The f64 functions of speculative verification's decision as LLVM IR, op for op as
//! `flashsample_abi` writes them (`math::ln_f64`, `math::exp_f64`, `rng::gumbel_f64`): NVPTX
//! has no libm, and every f64 operation here is an explicit `.rn` intrinsic (never contracted
//! into an fma the host does not run), so the device's decision and the host's agree bit for
//! bit.

use crate::ir::Func;
use flashsample_abi::math::{EXP_F64_MIN_INPUT, EXP_P, INV_LN2_F64, LN2_HI_F64, LN2_LO_F64, LN_LG};

/// A double constant in LLVM's exact hexadecimal form.
pub(crate) fn f64c(v: f64) -> String {
    format!("0x{:016X}", v.to_bits())
}

/// `a + b` (f64, round to nearest).
pub(crate) fn dadd(f: &mut Func, a: &str, b: &str) -> String {
    f.v(format!("call double @llvm.nvvm.add.rn.d(double {a}, double {b})"))
}

/// `a − b` as `a + (−b)`: bit-identical to IEEE subtraction.
pub(crate) fn dsub(f: &mut Func, a: &str, b: &str) -> String {
    let nb = f.v(format!("fneg double {b}"));
    dadd(f, a, &nb)
}

/// `a · b` (f64, round to nearest).
pub(crate) fn dmul(f: &mut Func, a: &str, b: &str) -> String {
    f.v(format!("call double @llvm.nvvm.mul.rn.d(double {a}, double {b})"))
}

/// `a / b` (f64, IEEE round to nearest).
pub(crate) fn ddiv(f: &mut Func, a: &str, b: &str) -> String {
    f.v(format!("call double @llvm.nvvm.div.rn.d(double {a}, double {b})"))
}

/// Declarations the f64 helpers use beyond `lse::DECLS` (every module has `add.rn.d` and
/// `mul.rn.d` from there).
pub(crate) const DECLS: &str = "declare double @llvm.nvvm.div.rn.d(double, double)
declare double @llvm.roundeven.f64(double)
declare i64 @llvm.fptosi.sat.i64.f64(double)
";

/// `w · (c[a] + w · (c[b] + …))`: a Horner chain over `coeffs` (outermost first), each step
/// `c + w · acc` as the abi writes it.
fn horner(f: &mut Func, w: &str, coeffs: &[f64]) -> String {
    let (last, rest) = coeffs.split_last().expect("at least one coefficient");
    let mut acc = dmul(f, w, &f64c(*last));
    for c in rest.iter().rev() {
        let sum = dadd(f, &f64c(*c), &acc);
        acc = dmul(f, w, &sum);
    }
    acc
}

/// `abi::math::ln_f64`.
fn ln_f64() -> String {
    let mut f = Func::new();
    let bits = f.v("bitcast double %x to i64");
    let hx = f.v(format!("lshr i64 {bits}, 32"));
    let hx = f.v(format!("trunc i64 {hx} to i32"));
    let mant_hi = f.v(format!("and i32 {hx}, 1048575"));
    let i = f.v(format!("add i32 {mant_hi}, {}", 0x95f64));
    let i = f.v(format!("and i32 {i}, {}", 0x0010_0000));
    let e = f.v(format!("lshr i32 {hx}, 20"));
    let e = f.v(format!("sub i32 {e}, 1023"));
    let ik = f.v(format!("lshr i32 {i}, 20"));
    let k = f.v(format!("add i32 {e}, {ik}"));
    let top = f.v(format!("xor i32 {i}, {}", 0x3ff0_0000));
    let top = f.v(format!("or i32 {mant_hi}, {top}"));
    let top = f.v(format!("zext i32 {top} to i64"));
    let top = f.v(format!("shl i64 {top}, 32"));
    let low = f.v(format!("and i64 {bits}, 4294967295"));
    let mb = f.v(format!("or i64 {top}, {low}"));
    let m = f.v(format!("bitcast i64 {mb} to double"));
    let fm = dsub(&mut f, &m, &f64c(1.0));
    let den = dadd(&mut f, &f64c(2.0), &fm);
    let s = ddiv(&mut f, &fm, &den);
    let dk = f.v(format!("sitofp i32 {k} to double"));
    let z = dmul(&mut f, &s, &s);
    let w = dmul(&mut f, &z, &z);
    let t1 = horner(&mut f, &w, &[LN_LG[1], LN_LG[3], LN_LG[5]]);
    let inner = horner(&mut f, &w, &[LN_LG[2], LN_LG[4], LN_LG[6]]);
    let inner = dadd(&mut f, &f64c(LN_LG[0]), &inner);
    let t2 = dmul(&mut f, &z, &inner);
    let r = dadd(&mut f, &t2, &t1);
    let a = f.v(format!("sub i32 {mant_hi}, {}", 0x6147a));
    let b = f.v(format!("sub i32 {}, {mant_hi}", 0x6b851));
    let far = f.v(format!("or i32 {a}, {b}"));
    let far = f.v(format!("icmp sgt i32 {far}, 0"));
    let hi = dmul(&mut f, &dk, &f64c(LN2_HI_F64));
    let lo = dmul(&mut f, &dk, &f64c(LN2_LO_F64));
    // fdlibm's two branches, both computed, one selected.
    let half_f = dmul(&mut f, &f64c(0.5), &fm);
    let hfsq = dmul(&mut f, &half_f, &fm);
    let t = dadd(&mut f, &hfsq, &r);
    let t = dmul(&mut f, &s, &t);
    let t = dadd(&mut f, &t, &lo);
    let t = dsub(&mut f, &hfsq, &t);
    let t = dsub(&mut f, &t, &fm);
    let near_far = dsub(&mut f, &hi, &t);
    let u = dsub(&mut f, &fm, &r);
    let u = dmul(&mut f, &s, &u);
    let u = dsub(&mut f, &u, &lo);
    let u = dsub(&mut f, &u, &fm);
    let near = dsub(&mut f, &hi, &u);
    let res = f.sel_u("double", &far, &near_far, &near);
    f.s(format!("ret double {res}"));
    f.finish("define internal double @fs_ln_f64(double %x) #0")
}

/// `abi::math::exp_f64`.
fn exp_f64() -> String {
    let mut f = Func::new();
    let live = f.v(format!("fcmp oge double %x, {}", f64c(EXP_F64_MIN_INPUT)));
    let xl = dmul(&mut f, "%x", &f64c(INV_LN2_F64));
    let kf = f.v(format!("call double @llvm.roundeven.f64(double {xl})"));
    let khi = dmul(&mut f, &kf, &f64c(LN2_HI_F64));
    let hi = dsub(&mut f, "%x", &khi);
    let lo = dmul(&mut f, &kf, &f64c(LN2_LO_F64));
    let r = dsub(&mut f, &hi, &lo);
    let t = dmul(&mut f, &r, &r);
    let poly = horner(&mut f, &t, &EXP_P);
    let c = dsub(&mut f, &r, &poly);
    let rc = dmul(&mut f, &r, &c);
    let den = dsub(&mut f, &f64c(2.0), &c);
    let q = ddiv(&mut f, &rc, &den);
    let e = dsub(&mut f, &lo, &q);
    let e = dsub(&mut f, &e, &hi);
    let y = dsub(&mut f, &f64c(1.0), &e);
    let ki = f.v(format!("call i64 @llvm.fptosi.sat.i64.f64(double {kf})"));
    let kb = f.v(format!("add i64 {ki}, 1023"));
    let sb = f.v(format!("shl i64 {kb}, 52"));
    let scale = f.v(format!("bitcast i64 {sb} to double"));
    let out = dmul(&mut f, &y, &scale);
    let res = f.sel_u("double", &live, &out, &f64c(0.0));
    f.s(format!("ret double {res}"));
    f.finish("define internal double @fs_exp_f64(double %x) #0")
}

/// `abi::rng::gumbel_f64`: `−ln(−ln u)` with `u = uniform_f64(bits)` (exact).
fn gumbel_f64() -> String {
    let mut f = Func::new();
    let u = uniform_f64(&mut f, "%bits");
    let e = f.v(format!("call double @fs_ln_f64(double {u})"));
    let ne = f.v(format!("fneg double {e}"));
    let l = f.v(format!("call double @fs_ln_f64(double {ne})"));
    let g = f.v(format!("fneg double {l}"));
    f.s(format!("ret double {g}"));
    f.finish("define internal double @fs_gumbel_f64(i32 %bits) #0")
}

/// `abi::rng::uniform_f64(bits)`: `((bits >> 8) + ½) · 2⁻²⁴`, exact.
pub(crate) fn uniform_f64(f: &mut Func, bits: &str) -> String {
    let k = f.v(format!("lshr i32 {bits}, 8"));
    let kf = f.v(format!("uitofp i32 {k} to double"));
    let h = dadd(f, &kf, &f64c(0.5));
    dmul(f, &h, &f64c(1.0 / 16_777_216.0))
}

/// The f64 helpers' IR (`@fs_ln_f64`, `@fs_exp_f64`, `@fs_gumbel_f64`) and their declarations.
pub(crate) fn helpers() -> String {
    let mut out = String::from(DECLS);
    for f in [ln_f64(), exp_f64(), gumbel_f64()] {
        out.push('\n');
        out.push_str(&f);
    }
    out
}
