//! The finishing step of a launch, written once: [`finish_sample`] (a failed row's samples
//! become `INDEX_NONE`, logprobs `logit − lse`), which stage two or stage three applies when it
//! is the launch's last stage, and the glue kernel `flashsample_finalize` applies after the
//! exact nucleus or before the decision, emitted like the sampling kernels (typed parameter
//! table in `params.rs`, LLVM IR through NVPTX) so the launch stays on the device.
//!
//! One module of sm_80 PTX serves every device (the driver JIT-compiles it).

use crate::ir::{self, i32c, Func, Global, Icmp, Ptr, F32, I1, I32, I64};
use crate::params::arg;
use crate::params::FINALIZE;
use crate::{ir_to_ptx, PtxError};
use flashsample_abi::INDEX_NONE;

/// Threads per block of the elementwise glue kernels (one thread per element).
pub const GLUE_THREADS: u32 = 256;

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

/// Where a launch's finishing step writes and reads: `flashsample_finalize`'s parameters, or
/// the outputs of the row kernel that is the launch's last stage ([`finish_row`]).
struct FinishOutputs<'a> {
    /// `u32 [n]` the samples.
    tokens: &'a Ptr<Global>,
    /// `f32 [n]` the samples' logits.
    logits: &'a Ptr<Global>,
    /// `f32 [n]` the logprobs, or null for none.
    logprobs: &'a Ptr<Global>,
}

/// The finishing rule for sample `i` of a row, written once for every place that applies it:
/// a sample of a failed row becomes `abi::INDEX_NONE` (a sample is never a token the kernels
/// could not vouch for) with a NaN logprob, and otherwise, with logprobs, `logit − lse` in f32.
/// `row_lse` loads the row's logsumexp; it is called only when logprobs are written.
fn finish_sample(f: &mut Func, i: &I64, failed: &I1, out: &FinishOutputs<'_>, row_lse: impl FnOnce(&mut Func) -> F32) {
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

/// [`finish_sample`] for each of the row's `%samples` samples in a row kernel (stage two,
/// stage three) that is the launch's last stage: its `%out_tokens`, `%out_logits` and
/// `%out_logprobs`, the row's logsumexp read from `reported_lse`.
pub(crate) fn finish_row(f: &mut Func, row: &I32, failed: &I1, reported_lse: &Ptr<Global>) {
    let out = FinishOutputs { tokens: &arg::OUT_TOKENS, logits: &arg::OUT_LOGITS, logprobs: &arg::OUT_LOGPROBS };
    let first = f.mul(row, &arg::SAMPLES);
    f.for_loop(&i32c(0), &arg::SAMPLES, &i32c(1), |f, s| {
        let i = f.add(&first, s);
        let i64 = f.zext(&i);
        finish_sample(f, &i64, failed, &out, |f| {
            let r64 = f.zext(row);
            let a = f.gaddr(reported_lse, &r64, 4);
            f.load(&a, 4)
        });
    });
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

/// The glue module's LLVM IR text, before optimisation.
pub fn glue_llvm_ir() -> String {
    format!("{}\n{}", ir::PRELUDE, finalize())
}

/// The glue module as sm_80 PTX.
pub fn compile_glue() -> Result<String, PtxError> {
    ir_to_ptx(&glue_llvm_ir(), "sm_80")
}
