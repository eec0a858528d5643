//! Speculative verification on CUDA (`Sampler::verify`, DESIGN.md "Speculative verification").
//! A launch runs stages one to three and the decision (`flashsample_decide`) on the GPU and
//! reads back only the rows' status and each sequence's outcome. A sequence the device leaves
//! undecided (a residual bound that failed, a filtered draft row without survivors in the
//! lists) or a row whose lists overflowed or whose nucleus outgrew them sends the launch down
//! the host path:
//! stages one to three again (on exact lists where the device launch's overflowed: the same
//! config would keep the same lists), their lists and residual lists read back, and the decisions on
//! the host ([`crate::verify::decide`], the CPU backend's), recomputing a row the lists cannot
//! serve by stage one of that row alone with whole-tile residual lists.

use super::backend::{CudaSampler, SpecRun};
use crate::launch::Shape;
use crate::verify::{decide, draft_targets, sequence_failure, whole_row_entries, DraftProbs, Verified, VerifyRun};
use crate::{stage_three, Error, Result, Tensor};
use flashsample_abi::speculative::{draft_of_row, SpecStatus};
use flashsample_abi::{RowStatus, SamplingParams, Scored};
use flashsample_codegen_ptx::GpuConfig;

/// What the device made of a verifying launch.
enum OnDevice {
    /// Every sequence decided.
    Decided(Verified),
    /// The host path decides, starting on these lists.
    ToHost(HostLists),
}

/// The lists the host path's launch starts on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum HostLists {
    /// The config's (short) lists.
    Short,
    /// Lists that cannot overflow ([`GpuConfig::exact_lists`]): the device launch's overflowed.
    Exact,
}

impl CudaSampler {
    /// Verifies `params.drafts` against the rows of `hidden` (`Sampler::verify` checked the
    /// operands and parameters). A launch must run whole (not in row chunks: the decision
    /// reads every row's residual lists), else `Error::Shape`.
    pub(crate) fn verify(&self, hidden: &Tensor<'_>, weights: &Tensor<'_>, params: &SamplingParams<'_>, shape: Shape, config: &GpuConfig) -> Result<Verified> {
        let (k, targets) = draft_targets(params, shape.batch)?;
        let inner = SamplingParams { targets: Some(&targets), drafts: None, draft_probs: None, ..*params };
        let drafts = params.drafts.unwrap_or(&[]);
        match self.verify_on_device(hidden, weights, &inner, shape, config, k, SpecRun::Decide { k, drafts, probs: params.draft_probs })? {
            OnDevice::Decided(v) => Ok(v),
            OnDevice::ToHost(start) => self.verify_on_host(hidden, weights, params, &inner, shape, config, k, start),
        }
    }

    /// The decision on the device, or which lists the host path starts on.
    #[allow(clippy::too_many_arguments)]
    fn verify_on_device(&self, hidden: &Tensor<'_>, weights: &Tensor<'_>, inner: &SamplingParams<'_>, shape: Shape, config: &GpuConfig, k: usize, spec: SpecRun<'_>) -> Result<OnDevice> {
        let pipeline = self.pipeline();
        let lse = self.launch_lse(inner, shape.batch);
        let config = config.for_shape(shape.dim, shape.vocab);
        let need = pipeline.list_capacity();
        let r = self.sample_once(hidden, weights, inner, shape, &config, need, lse, false, Some(spec))?;
        // Overflowing lists and nuclei past them are served by the host path's reruns. The
        // host path's stage one on the same config would keep the same lists, so after an
        // overflow it starts on lists that cannot overflow.
        if r.status.contains(&RowStatus::ListOverflow) {
            return Ok(OnDevice::ToHost(HostLists::Exact));
        }
        if r.status.contains(&RowStatus::NucleusTooLarge) {
            return Ok(OnDevice::ToHost(HostLists::Short));
        }
        let d = r.decision.ok_or_else(|| Error::Cuda("a verifying launch read back no decision".into()))?;
        let capacity = need as usize;
        let mut errors = vec![None; d.status.len()];
        for (i, &code) in d.status.iter().enumerate() {
            match SpecStatus::from_code(code) {
                Some(SpecStatus::Ok) => {}
                Some(SpecStatus::RowFailed) => {
                    let rows = i * (k + 1)..(i + 1) * (k + 1);
                    let e = sequence_failure(&r.status, rows, k, capacity).ok_or_else(|| Error::Cuda(format!("sequence {i} failed with no failed row")))?;
                    errors[i] = Some(e);
                }
                Some(SpecStatus::Recompute) => return Ok(OnDevice::ToHost(HostLists::Short)),
                // `Sampler::verify` checked the drafts (`check_drafts`) before the launch.
                Some(SpecStatus::DraftToken | SpecStatus::DraftProbability) => {
                    return Err(Error::Cuda(format!("the decision faulted sequence {i}'s draft {}, which the host checked", d.accepted[i])));
                }
                None => return Err(Error::Cuda(format!("the decision wrote unknown status {code} for sequence {i}"))),
            }
        }
        Ok(OnDevice::Decided(Verified {
            k,
            accepted: d.accepted.iter().map(|&a| a as usize).collect(),
            tokens: d.tokens,
            logprobs: d.logprobs,
            errors,
            recomputed_rows: 0,
        }))
    }

    /// The decisions on the host from read-back lists (see the module docs), starting on the
    /// config's short lists or on exact ones.
    #[allow(clippy::too_many_arguments)]
    fn verify_on_host(&self, hidden: &Tensor<'_>, weights: &Tensor<'_>, params: &SamplingParams<'_>, inner: &SamplingParams<'_>, shape: Shape, config: &GpuConfig, k: usize, start: HostLists) -> Result<Verified> {
        let pipeline = self.pipeline();
        let lse = self.launch_lse(inner, shape.batch);
        let mut config = config.for_shape(shape.dim, shape.vocab);
        let need = pipeline.list_capacity();
        let exact = config.exact_lists(need);
        if start == HostLists::Exact && exact.list_per_tile > config.list_per_tile {
            config = exact.clone();
        }
        let spec = Some(SpecRun::Lists { period: (k + 1) as u32 });
        let mut r = self.sample_once(hidden, weights, inner, shape, &config, need, lse, need > 0, spec)?;
        // As `sample`: exact lists never overflow, so a launch reruns at most once.
        if r.status.contains(&RowStatus::ListOverflow) && exact.list_per_tile > config.list_per_tile {
            config = exact;
            r = self.sample_once(hidden, weights, inner, shape, &config, need, lse, true, spec)?;
        }
        // Bonus rows are ordinary samples: a nucleus past the lists is served as `sample` does.
        let bonus: Vec<usize> = stage_three::nucleus_rows(&r.status).into_iter().filter(|&row| draft_of_row(row, k).is_none()).collect();
        if !bonus.is_empty() {
            self.serve_exact(hidden, weights, inner, shape, &config, &bonus, &mut r)?;
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
            // A verifying pipeline's launches all compute the logsumexp, as this one did.
            let one = self.launch_rows(hidden, weights, inner, shape, &[row], &whole, need, false, Some(SpecRun::Lists { period: 0 }))?;
            let (_, lists) = one.residual.ok_or_else(|| missing("whole-tile residual lists"))?;
            Ok(whole_row_entries(&lists))
        };
        decide(pipeline, inner, &DraftProbs::of(params, shape.vocab), k, &run, &mut whole_row_of)
    }
}
