//! `flashsample_math_probe`: the kernels' f32 noise and logarithm on every input they can
//! take, for the exhaustive test that GPU and CPU noise are the same bits (`math.rs` emits
//! `abi::rng::gumbel_f32` and `abi::math::ln_f32` op for op, with `div.rn`'s fast path where
//! their divisions' operand ranges allow it; only a GPU can check that path).
//!
//! Thread `i` of the launch writes `gumbel[i] = gumbel_f32(i << 8)` for `i < 2^24` (the
//! function reads only the top 24 bits) and `ln[i] = ln_f32(from_bits(0x3f80_0000 + i))` for
//! `i < 2^23`: one binade, whose `2^23` reduced mantissas are every division `ln_f32` can do.
//! The threads then stride over every `t` in `[RECIP_FAST_MIN, RECIP_FAST_END)` (the
//! temperatures whose `1 / t` the epilogue takes by the fast path, `math::reciprocals`) and
//! compare that path with `div.rn`: `recip[0]` counts the mismatches, `recip[1]` holds the
//! largest mismatching input's bits.

use crate::ir::{self, f32c, i32c, Atomic, Func, Global, Icmp, Ptr, F32, I32};
use crate::{ir_to_ptx, math, PtxError};

/// The probe kernel's entry name.
pub const MATH_PROBE_KERNEL: &str = "flashsample_math_probe";
/// Threads per block of the probe.
pub const MATH_PROBE_THREADS: u32 = 256;
/// Inputs of `gumbel` (every 24-bit uniform index); the launch has one thread each.
pub const MATH_PROBE_GUMBEL_INPUTS: u32 = 1 << 24;
/// Inputs of `ln` (every mantissa of one binade).
pub const MATH_PROBE_LN_INPUTS: u32 = 1 << 23;
/// The first input of `ln`'s binade (1.0).
pub const MATH_PROBE_LN_FIRST_BITS: u32 = 0x3f80_0000;
/// Words of the probe's `recip` output: the mismatch count and the largest mismatching input.
pub const MATH_PROBE_RECIP_WORDS: usize = 2;

fn probe() -> String {
    let mut f = Func::new();
    let cta = f.sreg("ctaid.x");
    let tid = f.sreg("tid.x");
    let i = f.mul(&cta, &i32c(MATH_PROBE_THREADS));
    let i: I32 = f.add(&i, &tid);
    let i64 = f.zext(&i);
    let gumbel_out: Ptr<Global> = Ptr::named("%gumbel");
    let ln_out: Ptr<Global> = Ptr::named("%ln");
    let live = f.icmp(Icmp::Ult, &i, &i32c(MATH_PROBE_GUMBEL_INPUTS));
    f.if_then(&live, |f| {
        let bits = f.shl(&i, &i32c(8));
        let g = math::gumbel(f, &bits);
        let gb: I32 = f.bitcast(&g);
        let a = f.gaddr(&gumbel_out, &i64, 4);
        f.store(&gb, &a, 4);
    });
    let live = f.icmp(Icmp::Ult, &i, &i32c(MATH_PROBE_LN_INPUTS));
    f.if_then(&live, |f| {
        let xb = f.add(&i, &i32c(MATH_PROBE_LN_FIRST_BITS));
        let x: F32 = f.bitcast(&xb);
        let l = math::ln(f, &x);
        let lb: I32 = f.bitcast(&l);
        let a = f.gaddr(&ln_out, &i64, 4);
        f.store(&lb, &a, 4);
    });
    let recip_out: Ptr<Global> = Ptr::named("%recip");
    let first = math::RECIP_FAST_MIN.to_bits();
    let count = math::RECIP_FAST_END.to_bits() - first;
    f.for_loop(&i, &i32c(count), &i32c(MATH_PROBE_GUMBEL_INPUTS), |f, k| {
        let tb = f.add(k, &i32c(first));
        let t: F32 = f.bitcast(&tb);
        let one = f32c(1.0);
        let fast = f.fdiv_fast_path(&one, &t);
        let ieee = f.fdiv(&one, &t);
        let fb: I32 = f.bitcast(&fast);
        let ib: I32 = f.bitcast(&ieee);
        let differ = f.icmp(Icmp::Ne, &fb, &ib);
        f.if_then(&differ, |f| {
            f.atomic_update(Atomic::Add, &recip_out, &i32c(1), None);
            let at = f.offset(&recip_out, 4);
            f.atomic_update(Atomic::Umax, &at, &tb, None);
        });
    });
    f.ret_void();
    f.finish(&format!(
        "define ptx_kernel void @{MATH_PROBE_KERNEL}(ptr addrspace(1) %gumbel, ptr addrspace(1) %ln, ptr addrspace(1) %recip) \"nvvm.maxntid\"=\"{MATH_PROBE_THREADS}\""
    ))
}

/// The probe module's LLVM IR text, before optimisation.
pub fn math_probe_llvm_ir() -> String {
    format!("{}\n{}\n{}", ir::PRELUDE, math::helpers(false), probe())
}

/// The probe module as sm_80 PTX (`flashsample_math_probe(u32 *gumbel, u32 *ln, u32 *recip)`, launched
/// with [`MATH_PROBE_GUMBEL_INPUTS`] threads in blocks of [`MATH_PROBE_THREADS`]).
pub fn compile_math_probe() -> Result<String, PtxError> {
    ir_to_ptx(&math_probe_llvm_ir(), "sm_80")
}

#[cfg(test)]
mod tests {
    #[test]
    fn math_probe_compiles() {
        let ptx = super::compile_math_probe().expect("probe compiles");
        assert!(ptx.contains(".entry flashsample_math_probe"));
        // The fast-path division: no div.rn left in the noise or the logarithm; the one left
        // is the reciprocal check's IEEE reference.
        assert_eq!(ptx.matches("div.rn.f32").count(), 1, "a div.rn.f32 is left:\n{ptx}");
        assert!(ptx.contains("rcp.approx.ftz.f32"));
    }
}
