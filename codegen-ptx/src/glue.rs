//! The runtime's glue kernels, emitted like the sampling kernels (typed parameter tables in
//! `params.rs`, LLVM IR through NVPTX): they keep a launch on the device (no host copy, so it
//! can be captured into a CUDA graph) where it would otherwise need a host round trip.
//!
//! - `flashsample_store_words`: copies 32 words passed by value to a device buffer (the TMA
//!   tensor maps, encoded on the host per launch: they hold the operands' addresses).
//! - `flashsample_greedy_flags`: `out[r] = all_greedy | (temperatures[r] == 0)`, what stage
//!   three reads, from the caller's device temperatures.
//! - `flashsample_finalize`: a sample of a row whose status is not ok becomes
//!   `abi::INDEX_NONE` (a sample is never a token the kernels could not vouch for), and, when
//!   asked, `logprob = logit − logsumexp[row]` (NaN for such rows).
//!
//! One module of sm_80 PTX serves every device (the driver JIT-compiles it).

use crate::ir::{self, f32c_u, Func};
use crate::params::{StoreWordsArgs, FINALIZE, GREEDY_FLAGS, STORE_WORDS};
use crate::{ir_to_ptx, PtxError};
use flashsample_abi::INDEX_NONE;

/// Threads per block of the elementwise glue kernels (one thread per element).
pub const GLUE_THREADS: u32 = 256;

/// Words `flashsample_store_words` copies.
pub const STORE_WORDS_COUNT: usize = 32;

impl StoreWordsArgs {
    /// The arguments that copy `words` to `dst`.
    pub fn from_words(dst: u64, w: &[u64; STORE_WORDS_COUNT]) -> StoreWordsArgs {
        StoreWordsArgs {
            dst,
            w0: w[0], w1: w[1], w2: w[2], w3: w[3], w4: w[4], w5: w[5], w6: w[6], w7: w[7],
            w8: w[8], w9: w[9], w10: w[10], w11: w[11], w12: w[12], w13: w[13], w14: w[14], w15: w[15],
            w16: w[16], w17: w[17], w18: w[18], w19: w[19], w20: w[20], w21: w[21], w22: w[22], w23: w[23],
            w24: w[24], w25: w[25], w26: w[26], w27: w[27], w28: w[28], w29: w[29], w30: w[30], w31: w[31],
        }
    }
}

/// The thread's element (`ctaid.x · GLUE_THREADS + tid.x`) and whether it is below `%n`.
fn element(f: &mut Func) -> (String, String) {
    let cta = f.sreg_u("ctaid.x");
    let tid = f.sreg_u("tid.x");
    let i = f.mul_u(&cta, &GLUE_THREADS.to_string());
    let i = f.add_u(&i, &tid);
    let live = f.ult_u(&i, "%n");
    (i, live)
}

fn attrs() -> String {
    format!("\"nvvm.maxntid\"=\"{GLUE_THREADS}\"")
}

fn greedy_flags() -> String {
    let mut f = Func::new();
    let (i, live) = element(&mut f);
    f.if_then_u(&live, |f| {
        let i64 = f.zext64_u(&i);
        let a = f.gaddr_u("%temperatures", &i64, 4);
        let t = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
        let zero = f.v(format!("fcmp oeq float {t}, {}", f32c_u(0.0)));
        let zero = f.v(format!("zext i1 {zero} to i32"));
        let flag = f.v(format!("or i32 {zero}, %all_greedy"));
        let o = f.gaddr_u("%out", &i64, 4);
        f.s(format!("store i32 {flag}, ptr addrspace(1) {o}, align 4"));
    });
    f.s("ret void");
    f.finish(&GREEDY_FLAGS.llvm_header(GREEDY_FLAGS.kernel, &attrs()))
}

fn finalize() -> String {
    let mut f = Func::new();
    let (i, live) = element(&mut f);
    f.if_then_u(&live, |f| {
        let row = f.v(format!("udiv i32 {i}, %samples"));
        let r64 = f.zext64_u(&row);
        let i64 = f.zext64_u(&i);
        let sa = f.gaddr_u("%status", &r64, 4);
        let st = f.v(format!("load i32, ptr addrspace(1) {sa}, align 4"));
        let bad = f.v(format!("icmp ne i32 {st}, 0"));
        let want_lp = f.v("icmp ne ptr addrspace(1) %logprobs, null");
        f.if_else_u(
            &bad,
            |f| {
                let ta = f.gaddr_u("%tokens", &i64, 4);
                f.s(format!("store i32 {}, ptr addrspace(1) {ta}, align 4", INDEX_NONE as i32));
                f.if_then_u(&want_lp, |f| {
                    let la = f.gaddr_u("%logprobs", &i64, 4);
                    f.s(format!("store float 0x7FF8000000000000, ptr addrspace(1) {la}, align 4"));
                });
            },
            |f| {
                f.if_then_u(&want_lp, |f| {
                    let xa = f.gaddr_u("%logits", &i64, 4);
                    let x = f.v(format!("load float, ptr addrspace(1) {xa}, align 4"));
                    let la = f.gaddr_u("%lse", &r64, 4);
                    let l = f.v(format!("load float, ptr addrspace(1) {la}, align 4"));
                    let lp = f.fsub_u(&x, &l);
                    let oa = f.gaddr_u("%logprobs", &i64, 4);
                    f.s(format!("store float {lp}, ptr addrspace(1) {oa}, align 4"));
                });
            },
        );
    });
    f.s("ret void");
    f.finish(&FINALIZE.llvm_header(FINALIZE.kernel, &attrs()))
}

fn store_words() -> String {
    let mut f = Func::new();
    for w in 0..STORE_WORDS_COUNT {
        let a = f.v(format!("getelementptr i8, ptr addrspace(1) %dst, i64 {}", 8 * w));
        f.s(format!("store i64 %w{w}, ptr addrspace(1) {a}, align 8"));
    }
    f.s("ret void");
    f.finish(&STORE_WORDS.llvm_header(STORE_WORDS.kernel, "\"nvvm.maxntid\"=\"1\""))
}

/// The glue module's LLVM IR text, before optimisation.
pub fn glue_llvm_ir() -> String {
    let mut m = String::from(ir::PRELUDE);
    for kernel in [store_words(), greedy_flags(), finalize()] {
        m.push('\n');
        m.push_str(&kernel);
    }
    m
}

/// The glue module as sm_80 PTX.
pub fn compile_glue() -> Result<String, PtxError> {
    ir_to_ptx(&glue_llvm_ir(), "sm_80")
}
