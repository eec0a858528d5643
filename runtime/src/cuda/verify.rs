//! Speculative verification on CUDA (`Sampler::verify`, DESIGN.md "Speculative verification"):
//! stages one to three of the `S·(k+1)` target rows on the GPU (draft rows keep residual lists
//! and their draft logit), read back; then the per-sequence decisions on the host
//! ([`crate::verify::decide`], the CPU backend's), recomputing a row the lists cannot serve by
//! stage one of that row alone with whole-tile residual lists.

use super::backend::CudaSampler;
use crate::launch::Shape;
use crate::tensor::Storage;
use crate::verify::{decide, draft_targets, DraftProbs, whole_row_entries, Verified, VerifyRun};
use crate::{stage_three, Error, Result, Tensor};
use flashsample_abi::{RowStatus, SamplingParams, Scored};
use flashsample_codegen_ptx::GpuConfig;

impl CudaSampler {
    /// Verifies `params.drafts` against the rows of `hidden` (`Sampler::verify` checked the
    /// operands and parameters). A launch must run whole (not in row chunks: the residual lists
    /// are read back), else `Error::Shape`.
    pub(crate) fn verify(&self, hidden: &Tensor<'_>, weights: &Tensor<'_>, params: &SamplingParams<'_>, shape: Shape, config: &GpuConfig) -> Result<Verified> {
        let pipeline = self.pipeline();
        let (k, targets) = draft_targets(params, shape.batch)?;
        let inner = SamplingParams { targets: Some(&targets), drafts: None, draft_probs: None, ..*params };
        let lse = self.launch_lse(&inner, shape.batch);
        let mut config = config.for_shape(shape.dim, shape.vocab);
        let need = pipeline.list_capacity();
        let period = Some((k + 1) as u32);
        let mut r = self.sample_once(hidden, weights, &inner, shape, &config, need, lse, need > 0, period)?;
        if r.status.contains(&RowStatus::ListOverflow) {
            let exact = config.exact_lists(need);
            // As `sample`: whole-tile lists never overflow, so this reruns at most once.
            if exact.list_per_tile > config.list_per_tile {
                config = exact;
                r = self.sample_once(hidden, weights, &inner, shape, &config, need, lse, true, period)?;
            }
        }
        // Bonus rows are ordinary samples: a nucleus past the lists is served as `sample` does.
        let bonus: Vec<usize> = stage_three::nucleus_rows(&r.status).into_iter().filter(|&row| row % (k + 1) == k).collect();
        if !bonus.is_empty() {
            self.serve_exact(hidden, weights, &inner, shape, &config, &bonus, &mut r)?;
        }
        let missing = |what: &str| Error::Cuda(format!("a verifying launch read back no {what}"));
        let (res_layout, res_lists) = r.residual.as_ref().ok_or_else(|| missing("residual lists"))?;
        let target_logits = r.target_logprobs.as_deref().ok_or_else(|| missing("draft logits"))?;
        let run = VerifyRun {
            status: &r.status,
            reduced: &r.reduced,
            lists: r.lists.as_ref().map(|(l, lists)| (*l, lists.as_slice())),
            target_logits,
            residual: (*res_layout, res_lists),
        };
        let whole = config.whole_tile_residuals();
        let mut whole_row_of = |row: usize| -> Result<Vec<Scored>> {
            let bytes = super::backend::hidden_rows(hidden, &[row], shape.dim)?;
            let sub_hidden = Tensor { dtype: hidden.dtype, rows: 1, cols: shape.dim, storage: Storage::Host(&bytes) };
            let subset = inner.select_rows(&[row], shape.vocab);
            let sub = subset.params();
            let sub_shape = Shape { batch: 1, ..shape };
            let one = self.sample_once(&sub_hidden, weights, &sub, sub_shape, &whole, need, lse, false, Some(0))?;
            let (_, lists) = one.residual.ok_or_else(|| missing("whole-tile residual lists"))?;
            Ok(whole_row_entries(&lists))
        };
        decide(pipeline, &inner, &DraftProbs::of(params, shape.vocab), k, &run, &mut whole_row_of)
    }
}
