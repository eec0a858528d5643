//! `flashsample_target_logits` (DESIGN.md step 7c): each row's target logit before stage one,
//! so a pipeline that ranks its targets counts the rank in stage one's own pass.
//!
//! Per row, the target token's logit `y_t` as step 7b defines it (`x`, or the raw logit in the
//! raw logprob mode; `-inf` when excluded or not `> -inf`) to `target_logprobs[row]`: the
//! multiply in stage one's f32 order and the transforms through the tile epilogue's emitters
//! ([`mma_over_k`] or [`fma_over_k`], [`token_x`]), so the value has the bits the tile holding the target would
//! store, and stage one then compares every token against the threshold it will see itself.
//! Tensor cores: each warp takes 8 rows, A row `g` the target's W row of row `r0 + g` and B
//! column `g` its hidden row; the diagonal `D[g][g]` is row `r0 + g`'s logit (lane `4g + g/2`,
//! accumulator `g % 2`). SIMT (f32 and mixed operands): one row a thread. `B·D` multiply-adds (`16·B·D` on the tensor path)
//! instead of the second `B·V·D` pass the rank took before. Stage one's parameter table:
//! the runtime launches it with stage one's arguments.

use crate::config::GpuConfig;
use crate::ir::{i32c, Fcmp, Func, Icmp, F32, I1, I32, I64};
use crate::nucleus::{fma_over_k, mma_over_k};
use crate::params::{arg, STAGE1};
use crate::ptx;
use crate::stage1::{model_logit, token_x};
use flashsample_ir::Pipeline;

/// The kernel's entry name.
pub const TARGET_LOGITS_KERNEL: &str = "flashsample_target_logits";

/// Threads of a CTA.
pub const TARGET_LOGITS_THREADS: u32 = 128;

/// Rows one CTA takes: 8 a warp on tensor cores, one a thread on SIMT.
pub fn target_logits_rows_per_cta(config: &GpuConfig) -> u32 {
    if config.is_tensor() {
        TARGET_LOGITS_THREADS / 4
    } else {
        TARGET_LOGITS_THREADS
    }
}

pub(crate) fn emit(p: &Pipeline, c: &GpuConfig) -> String {
    let mut f = Func::new();
    let tid = f.sreg("tid.x");
    let cta = f.sreg("ctaid.x");
    let first = f.mul(&cta, &i32c(target_logits_rows_per_cta(c)));
    if c.is_tensor() {
        tensor(&mut f, p, c.k_step(), &tid, &first);
    } else {
        let row = f.add(&first, &tid);
        let (has, rs, target, t_ok) = row_target(&mut f, &row);
        let dim64: I64 = f.zext(&arg::DIM);
        let t64: I64 = f.zext(&target);
        let wrow = f.mul(&t64, &dim64);
        let r64: I64 = f.zext(&rs);
        let hrow = f.mul(&r64, &dim64);
        let raw = fma_over_k(&mut f, p, &wrow, &hrow);
        let store = f.and(&has, &t_ok);
        f.if_then(&store, |f| store_target(f, p, &row, &target, &raw));
    }
    f.ret_void();
    f.finish(&STAGE1.llvm_header(TARGET_LOGITS_KERNEL, &format!("\"nvvm.maxntid\"=\"{TARGET_LOGITS_THREADS}\"")))
}

/// Row `row`'s place: whether it is inside the batch, the row clamped into it, its target
/// (clamped below V) and whether the target is below V. A target at or past V writes nothing,
/// as no tile of stage one holds it.
fn row_target(f: &mut Func, row: &I32) -> (I1, I32, I32, I1) {
    let has = f.icmp(Icmp::Ult, row, &arg::BATCH);
    let rs = f.sel(&has, row, &i32c(0));
    let r64: I64 = f.zext(&rs);
    let a = f.gaddr(&arg::TARGETS, &r64, 4);
    let target: I32 = f.load(&a, 4);
    let t_ok = f.icmp(Icmp::Ult, &target, &arg::VOCAB);
    let ts = f.sel(&t_ok, &target, &i32c(0));
    (has, rs, ts, t_ok)
}

/// The tensor-core multiply: lane `4g + t` of warp `w` loads row `r0 + g`'s target W row (as
/// A rows `g` and `g + 8`) and hidden row (B column `g`), `r0 = first + 8w`.
fn tensor(f: &mut Func, p: &Pipeline, k_step: u32, tid: &I32, first: &I32) {
    let ptx::MmaLane { warp, g, t, .. } = ptx::MmaLane::of(f, tid);
    let w8 = f.shl(&warp, &i32c(3));
    let r0 = f.add(first, &w8);
    let row = f.add(&r0, &g);
    let (has, rs, target, t_ok) = row_target(f, &row);
    let dim64: I64 = f.zext(&arg::DIM);
    let t64: I64 = f.zext(&target);
    let wa = f.mul(&t64, &dim64);
    let r64: I64 = f.zext(&rs);
    let hb = f.mul(&r64, &dim64);
    let acc = mma_over_k(f, p, k_step, &t, &wa, &wa, &hb);
    // D[g][g]: the lane whose columns 2t, 2t + 1 include g.
    let g_half = f.lshr(&g, &i32c(1));
    let diagonal = f.icmp(Icmp::Eq, &g_half, &t);
    let odd = f.and(&g, &i32c(1));
    let odd = f.icmp(Icmp::Ne, &odd, &i32c(0));
    let raw = f.sel(&odd, &acc[1], &acc[0]);
    let store = f.and(&has, &t_ok);
    let store = f.and(&store, &diagonal);
    f.if_then(&store, |f| store_target(f, p, &row, &target, &raw));
}

/// Step 7b's value of row `row`'s target `v < V` from its matmul value `raw`, to
/// `target_logprobs[row]`.
fn store_target(f: &mut Func, p: &Pipeline, row: &I32, v: &I32, raw: &F32) {
    let (x, bias) = token_x(f, p, row, v, raw);
    let y = if p.needs_raw_logsumexp() { model_logit(f, &p.transforms, raw, bias.as_ref(), &I1::TRUE) } else { x };
    let live = f.fcmp(Fcmp::Ogt, &y, &F32::NEG_INF);
    let y = f.sel(&live, &y, &F32::NEG_INF);
    let r64: I64 = f.zext(row);
    let a = f.gaddr(&arg::TARGET_LOGPROBS, &r64, 4);
    f.store(&y, &a, 4);
}
