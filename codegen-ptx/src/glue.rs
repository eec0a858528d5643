//! The runtime's glue kernels, emitted like the sampling kernels (typed parameter tables in
//! `params.rs`, LLVM IR through NVPTX): they keep a launch on the device (no host copy, so it
//! can be captured into a CUDA graph) where it would otherwise need a host round trip.
//!
//! - `flashsample_store_words`: copies 32 words passed by value to a device buffer (the TMA
//!   tensor maps, encoded on the host per launch: they hold the operands' addresses).
//! - `flashsample_greedy_flags`: `out[r] = all_greedy | (temperatures[r] == 0)`, what stage
//!   three reads, from the caller's device temperatures.
//! - `flashsample_finalize`: [`finish_sample`] for every sample, after stage three, the exact
//!   nucleus or the decision (a launch whose last stage is stage two has stage two finish it).
//!
//! One module of sm_80 PTX serves every device (the driver JIT-compiles it).

use crate::ir::{self, f32c, i32c, Fcmp, Func, Global, Icmp, Ptr, Value, F32, I1, I32, I64};
use crate::params::arg;
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
fn element(f: &mut Func) -> (I32, I1) {
    let cta = f.sreg("ctaid.x");
    let tid = f.sreg("tid.x");
    let i = f.mul(&cta, &i32c(GLUE_THREADS));
    let i = f.add(&i, &tid);
    let live = f.icmp(Icmp::Ult, &i, &arg::N);
    (i, live)
}

fn attrs() -> String {
    format!("\"nvvm.maxntid\"=\"{GLUE_THREADS}\"")
}

fn greedy_flags() -> String {
    let mut f = Func::new();
    let (i, live) = element(&mut f);
    f.if_then(&live, |f| {
        let i64 = f.zext(&i);
        let a = f.gaddr(&arg::TEMPERATURES, &i64, 4);
        let t = f.load(&a, 4);
        let zero = f.fcmp(Fcmp::Oeq, &t, &f32c(0.0));
        let zero: I32 = f.zext(&zero);
        let flag = f.or(&zero, &arg::ALL_GREEDY);
        let o = f.gaddr(&arg::OUT, &i64, 4);
        f.store(&flag, &o, 4);
    });
    f.ret_void();
    f.finish(&GREEDY_FLAGS.llvm_header(GREEDY_FLAGS.kernel, &attrs()))
}

/// Where a launch's finishing step writes and reads: `flashsample_finalize`'s parameters, or
/// stage two's own outputs when it is the launch's last stage (`Stage2Args::finish`).
pub(crate) struct FinishOutputs<'a> {
    /// `u32 [n]` the samples.
    pub tokens: &'a Ptr<Global>,
    /// `f32 [n]` the samples' logits.
    pub logits: &'a Ptr<Global>,
    /// `f32 [n]` the logprobs, or null for none.
    pub logprobs: &'a Ptr<Global>,
}

/// The finishing rule for sample `i` of a row, written once for both places that apply it:
/// a sample of a failed row becomes `abi::INDEX_NONE` (a sample is never a token the kernels
/// could not vouch for) with a NaN logprob, and otherwise, with logprobs, `logit − lse` in f32.
/// `row_lse` loads the row's logsumexp; it is called only when logprobs are written.
pub(crate) fn finish_sample(f: &mut Func, i: &I64, failed: &I1, out: &FinishOutputs<'_>, row_lse: impl FnOnce(&mut Func) -> F32) {
    let want_lp = f.non_null(out.logprobs);
    f.if_else(
        failed,
        |f| {
            let ta = f.gaddr(out.tokens, i, 4);
            f.store(&i32c(INDEX_NONE as i32), &ta, 4);
            f.if_then(&want_lp, |f| {
                let la = f.gaddr(out.logprobs, i, 4);
                f.store(&F32::NAN, &la, 4);
            });
        },
        |f| {
            f.if_then(&want_lp, |f| {
                let xa = f.gaddr(out.logits, i, 4);
                let x: F32 = f.load(&xa, 4);
                let l = row_lse(f);
                let lp = f.fsub(&x, &l);
                let oa = f.gaddr(out.logprobs, i, 4);
                f.store(&lp, &oa, 4);
            });
        },
    );
}

fn finalize() -> String {
    let mut f = Func::new();
    let (i, live) = element(&mut f);
    f.if_then(&live, |f| {
        let row = f.udiv(&i, &arg::SAMPLES);
        let r64 = f.zext(&row);
        let i64 = f.zext(&i);
        let sa = f.gaddr(&arg::STATUS, &r64, 4);
        let st: I32 = f.load(&sa, 4);
        let failed = f.icmp(Icmp::Ne, &st, &i32c(0));
        let out = FinishOutputs { tokens: &arg::TOKENS, logits: &arg::LOGITS, logprobs: &arg::LOGPROBS };
        finish_sample(f, &i64, &failed, &out, |f| {
            let la = f.gaddr(&arg::LSE, &r64, 4);
            f.load(&la, 4)
        });
    });
    f.ret_void();
    f.finish(&FINALIZE.llvm_header(FINALIZE.kernel, &attrs()))
}

fn store_words() -> String {
    let mut f = Func::new();
    for w in 0..STORE_WORDS_COUNT {
        let a = f.offset(&arg::DST, 8 * w as u32);
        f.store(&I64::raw(format!("%w{w}")), &a, 8);
    }
    f.ret_void();
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
