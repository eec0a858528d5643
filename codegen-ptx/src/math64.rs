//! The f64 functions of speculative verification's decision as LLVM IR, op for op as
//! `flashsample_abi` writes them (`math::ln_f64`, `math::exp_f64`, `rng::gumbel_f64`): NVPTX
//! has no libm, and every f64 operation here is an explicit `.rn` intrinsic (never contracted
//! into an fma the host does not run), so the device's decision and the host's agree bit for
//! bit.

use crate::ir::{f64c, i32c, Fcmp, Func, Icmp, Int, F64, I32, I64};
use flashsample_abi::math::{EXP_F64_MIN_INPUT, EXP_P, INV_LN2_F64, LN2_HI_F64, LN2_LO_F64, LN_LG};

/// `@fs_ln_f64(x)`: `abi::math::ln_f64`.
pub(crate) fn ln(f: &mut Func, x: &F64) -> F64 {
    f.call("@fs_ln_f64", &[x])
}

/// `@fs_exp_f64(x)`: `abi::math::exp_f64`.
pub(crate) fn exp(f: &mut Func, x: &F64) -> F64 {
    f.call("@fs_exp_f64", &[x])
}

/// `@fs_gumbel_f64(bits)`: `abi::rng::gumbel_f64`.
pub(crate) fn gumbel(f: &mut Func, bits: &I32) -> F64 {
    f.call("@fs_gumbel_f64", &[bits])
}

/// Declarations the f64 helpers use beyond `lse::DECLS` (every module has `add.rn.d` and
/// `mul.rn.d` from there).
pub(crate) const DECLS: &str = "declare double @llvm.nvvm.div.rn.d(double, double)
declare double @llvm.roundeven.f64(double)
declare i64 @llvm.fptosi.sat.i64.f64(double)
";

/// `w · (c[a] + w · (c[b] + …))`: a Horner chain over `coeffs` (outermost first), each step
/// `c + w · acc` as the abi writes it.
fn horner(f: &mut Func, w: &F64, coeffs: &[f64]) -> F64 {
    let (last, rest) = coeffs.split_last().expect("at least one coefficient");
    let mut acc = f.fmul(w, &f64c(*last));
    for c in rest.iter().rev() {
        let sum = f.fadd(&f64c(*c), &acc);
        acc = f.fmul(w, &sum);
    }
    acc
}

/// `abi::math::ln_f64`.
fn ln_f64() -> String {
    let mut f = Func::new();
    let x = F64::named("%x");
    let bits: I64 = f.bitcast(&x);
    let hx = f.lshr(&bits, &I64::c(32));
    let hx: I32 = f.trunc(&hx);
    let mant_hi = f.and(&hx, &i32c(1048575));
    let i = f.add(&mant_hi, &i32c(0x95f64));
    let i = f.and(&i, &i32c(0x0010_0000));
    let e = f.lshr(&hx, &i32c(20));
    let e = f.sub(&e, &i32c(1023));
    let ik = f.lshr(&i, &i32c(20));
    let k = f.add(&e, &ik);
    let top = f.xor(&i, &i32c(0x3ff0_0000));
    let top = f.or(&mant_hi, &top);
    let top: I64 = f.zext(&top);
    let top = f.shl(&top, &I64::c(32));
    let low = f.and(&bits, &I64::c(4294967295u32));
    let mb = f.or(&top, &low);
    let m: F64 = f.bitcast(&mb);
    let fm = f.fsub(&m, &f64c(1.0));
    let den = f.fadd(&f64c(2.0), &fm);
    let s = f.fdiv(&fm, &den);
    let dk: F64 = f.sitofp(&k);
    let z = f.fmul(&s, &s);
    let w = f.fmul(&z, &z);
    let t1 = horner(&mut f, &w, &[LN_LG[1], LN_LG[3], LN_LG[5]]);
    let inner = horner(&mut f, &w, &[LN_LG[2], LN_LG[4], LN_LG[6]]);
    let inner = f.fadd(&f64c(LN_LG[0]), &inner);
    let t2 = f.fmul(&z, &inner);
    let r = f.fadd(&t2, &t1);
    let a = f.sub(&mant_hi, &i32c(0x6147a));
    let b = f.sub(&i32c(0x6b851), &mant_hi);
    let far = f.or(&a, &b);
    let far = f.icmp(Icmp::Sgt, &far, &i32c(0));
    let hi = f.fmul(&dk, &f64c(LN2_HI_F64));
    let lo = f.fmul(&dk, &f64c(LN2_LO_F64));
    // fdlibm's two branches, both computed, one selected.
    let half_f = f.fmul(&f64c(0.5), &fm);
    let hfsq = f.fmul(&half_f, &fm);
    let t = f.fadd(&hfsq, &r);
    let t = f.fmul(&s, &t);
    let t = f.fadd(&t, &lo);
    let t = f.fsub(&hfsq, &t);
    let t = f.fsub(&t, &fm);
    let near_far = f.fsub(&hi, &t);
    let u = f.fsub(&fm, &r);
    let u = f.fmul(&s, &u);
    let u = f.fsub(&u, &lo);
    let u = f.fsub(&u, &fm);
    let near = f.fsub(&hi, &u);
    let res = f.sel(&far, &near_far, &near);
    f.ret(&res);
    f.finish("define internal double @fs_ln_f64(double %x) #0")
}

/// `abi::math::exp_f64`.
fn exp_f64() -> String {
    let mut f = Func::new();
    let x = F64::named("%x");
    let live = f.fcmp(Fcmp::Oge, &x, &f64c(EXP_F64_MIN_INPUT));
    let xl = f.fmul(&x, &f64c(INV_LN2_F64));
    let kf: F64 = f.call("@llvm.roundeven.f64", &[&xl]);
    let khi = f.fmul(&kf, &f64c(LN2_HI_F64));
    let hi = f.fsub(&x, &khi);
    let lo = f.fmul(&kf, &f64c(LN2_LO_F64));
    let r = f.fsub(&hi, &lo);
    let t = f.fmul(&r, &r);
    let poly = horner(&mut f, &t, &EXP_P);
    let c = f.fsub(&r, &poly);
    let rc = f.fmul(&r, &c);
    let den = f.fsub(&f64c(2.0), &c);
    let q = f.fdiv(&rc, &den);
    let e = f.fsub(&lo, &q);
    let e = f.fsub(&e, &hi);
    let y = f.fsub(&f64c(1.0), &e);
    let ki: I64 = f.call("@llvm.fptosi.sat.i64.f64", &[&kf]);
    let kb = f.add(&ki, &I64::c(1023));
    let sb = f.shl(&kb, &I64::c(52));
    let scale: F64 = f.bitcast(&sb);
    let out = f.fmul(&y, &scale);
    let res = f.sel(&live, &out, &f64c(0.0));
    f.ret(&res);
    f.finish("define internal double @fs_exp_f64(double %x) #0")
}

/// `abi::rng::gumbel_f64`: `−ln(−ln u)` with `u = uniform_f64(bits)` (exact).
fn gumbel_f64() -> String {
    let mut f = Func::new();
    let u = uniform_f64(&mut f, &I32::named("%bits"));
    let e = ln(&mut f, &u);
    let ne = f.fneg(&e);
    let l = ln(&mut f, &ne);
    let g = f.fneg(&l);
    f.ret(&g);
    f.finish("define internal double @fs_gumbel_f64(i32 %bits) #0")
}

/// `abi::rng::uniform_f64(bits)`: `((bits >> 8) + ½) · 2⁻²⁴`, exact.
pub(crate) fn uniform_f64(f: &mut Func, bits: &I32) -> F64 {
    let k = f.lshr(bits, &i32c(8));
    let kf: F64 = f.uitofp(&k);
    let h = f.fadd(&kf, &f64c(0.5));
    f.fmul(&h, &f64c(1.0 / 16_777_216.0))
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
