//! The device API's speculative verification ([`SamplingPlan::launch_verify`], DESIGN.md
//! "Speculative verification"): `flashsample_spec_targets` spreads the caller's drafts over
//! the rows as stage one's targets, the plan's stages run the `S·(k+1)` rows, and
//! `flashsample_decide` writes each sequence's outcome; nothing is read back, so a decode loop
//! can capture it into a CUDA graph.

use super::{push_args, DecideLaunch, SamplingPlan};
use crate::cuda::device::drv;
use crate::cuda::{DeviceIn, DeviceInputs, DeviceOut, DeviceOutputs};
use crate::launch::check_shape;
use crate::{Error, Result};
use cudarc::driver::{sys, CudaStream, LaunchConfig};
use flashsample_abi::speculative::{drafts_per_sequence, SequenceError, SpecStatus};
use flashsample_abi::{ParamError, RowStatus};
use flashsample_codegen_ptx::{SpecTargetsArgs, DECIDE_THREADS};

/// A verifying launch's drafts in device memory.
pub struct DeviceDrafts<'a> {
    /// `[S·k]` draft tokens, each `< V`; its length gives `k`. The decision checks them on
    /// the device: a token past `V` is the sequence's `SpecStatus::DraftToken`.
    pub tokens: DeviceIn<'a, u32>,
    /// `[S·k, V]` the draft distributions (finite, ≥ 0, > 0 at the draft token), iff the
    /// pipeline's drafts are sampled. The decision checks each draft token's entry and every
    /// entry it reads (`SpecStatus::DraftProbability`); not the whole rows, as the host API's
    /// `abi::speculative::check_drafts` does.
    pub probs: Option<DeviceIn<'a, f32>>,
}

/// Where a verifying device launch writes (`S` sequences of `k + 1` rows).
pub struct VerifyOutputs<'a> {
    /// `[S]` drafts accepted.
    pub accepted: DeviceOut<'a, u32>,
    /// `[S, k + 1]` each sequence's accepted drafts, then its next token; `abi::INDEX_NONE`
    /// after them and for a sequence whose status is not ok.
    pub tokens: DeviceOut<'a, u32>,
    /// `[S, k + 1]` their logprobs (NaN where no token), iff the pipeline outputs logprobs.
    pub logprobs: Option<DeviceOut<'a, f32>>,
    /// `[S]` `abi::speculative::SpecStatus` codes; [`SamplingPlan::sequence_errors`] types them.
    pub status: DeviceOut<'a, u32>,
    /// `[S·(k + 1)]` the rows' `abi::RowStatus` codes.
    pub row_status: DeviceOut<'a, u32>,
}

impl SamplingPlan {
    /// Enqueues one speculative verification on `stream`: the rows of `inputs.hidden` are
    /// `S` sequences of `k + 1` target positions, `drafts` their `S·k` drafts. Writes
    /// `outputs`; no allocation, host copy or synchronization (graph-capturable). Errors are
    /// host-side checks (lengths, a pipeline without `verify`, a launch past one row chunk)
    /// and driver failures; what only the kernels know lands in `outputs.status`.
    pub fn launch_verify(&self, stream: &CudaStream, inputs: DeviceInputs<'_>, drafts: DeviceDrafts<'_>, outputs: VerifyOutputs<'_>) -> Result<()> {
        let (args, targets) = self.resolve_verify(&inputs, &drafts, outputs)?;
        let batch = args.shape.batch as u32;
        let d = args.decide.ok_or_else(|| Error::Cuda("a verifying launch has a decision".into()))?;
        let kernels = self.kernel_for(args.shape.batch)?.kernel.decide.as_ref().ok_or_else(|| Error::Cuda("a verifying pipeline's module has no flashsample_spec_targets".into()))?;
        let spread = SpecTargetsArgs { drafts: d.drafts, k: d.k, batch, targets }.args();
        let cfg = LaunchConfig { grid_dim: (batch.div_ceil(DECIDE_THREADS), 1, 1), block_dim: (DECIDE_THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut b = stream.launch_builder(&kernels.targets);
        push_args(&mut b, &spread);
        // SAFETY: `SpecTargetsArgs` in its table's order; `drafts` holds `S·k` tokens and
        // `targets` is the plan's `[max_batch]` buffer (resolve_verify).
        unsafe { b.launch(cfg) }.map_err(drv("cuLaunchKernel(flashsample_spec_targets)"))?;
        self.enqueue(stream, &args, &mut |_| Ok(()))
        // `inputs`, `drafts` and the outputs' borrows end here, after the kernels are queued.
    }

    /// [`SamplingPlan::launch_verify`] on a raw `CUstream` (engines not on cudarc).
    ///
    /// # Safety
    /// As [`SamplingPlan::launch_on_raw_stream`].
    pub unsafe fn launch_verify_on_raw_stream(&self, stream: sys::CUstream, inputs: DeviceInputs<'_>, drafts: DeviceDrafts<'_>, outputs: VerifyOutputs<'_>) -> Result<()> {
        // SAFETY: the caller's contract above.
        let stream = unsafe { self.device.context().wrap_borrowed_stream(stream) };
        self.launch_verify(&stream, inputs, drafts, outputs)
    }

    /// The typed outcome of each sequence from host copies of a verifying launch's
    /// `status [S]`, `accepted [S]` (a draft fault's position) and `row_status [S·(k+1)]`:
    /// `None` for a decided sequence. An unknown code or lengths that do not split into
    /// sequences are errors.
    pub fn sequence_errors(&self, status: &[u32], accepted: &[u32], row_status: &[u32]) -> Result<Vec<Option<SequenceError>>> {
        sequence_errors(status, accepted, row_status, self.list_capacity())
    }

    /// Checks a verifying launch against the plan and the pipeline: its launch arguments
    /// (stage one's targets and draft logits in the plan's scratch) and the address of the
    /// targets buffer `flashsample_spec_targets` fills.
    fn resolve_verify(&self, i: &DeviceInputs<'_>, drafts: &DeviceDrafts<'_>, o: VerifyOutputs<'_>) -> Result<(super::Args, u64)> {
        let p = &*self.pipeline;
        let Some(verify) = &p.verify else {
            return Err(Error::Unsupported(format!("pipeline `{}` does not verify drafts: launch it with `launch`", p.name)));
        };
        let spec = self.scratch.spec.as_ref().ok_or_else(|| Error::Cuda("a verifying plan keeps its speculative scratch".into()))?;
        if i.targets.is_some() {
            return Err(ParamError::Unexpected("targets (a verifying launch's targets are its drafts)").into());
        }
        let shape = check_shape(i.hidden.rows, i.hidden.cols, i.weights.rows, i.weights.cols)?;
        self.whole_launch(shape.batch)?;
        let b = shape.batch;
        let k = drafts_per_sequence(b, drafts.tokens.len()).map_err(ParamError::from)?;
        let seqs = b - drafts.tokens.len();
        let draft_probs = match (verify.draft_probs.is_some(), &drafts.probs) {
            (true, Some(q)) => {
                super::expect_len("draft distributions", q.len(), seqs * k * shape.vocab)?;
                q.address()
            }
            (true, None) => return Err(ParamError::Missing("draft distributions").into()),
            (false, Some(_)) => return Err(ParamError::Unexpected("draft distributions (the pipeline's drafts are greedy)").into()),
            (false, None) => 0,
        };
        let logprobs = match (p.outputs.logprob, &o.logprobs) {
            (true, Some(l)) => {
                super::expect_len("verify logprobs", l.len(), seqs * (k + 1))?;
                l.address()
            }
            (true, None) => return Err(ParamError::Missing("verify logprobs output").into()),
            (false, Some(_)) => return Err(ParamError::Unexpected("verify logprobs output (the pipeline declares no logprob)").into()),
            (false, None) => 0,
        };
        super::expect_len("accepted", o.accepted.len(), seqs)?;
        super::expect_len("verify tokens", o.tokens.len(), seqs * (k + 1))?;
        super::expect_len("sequence status", o.status.len(), seqs)?;
        let (accepted, tokens, status) = (o.accepted.address(), o.tokens.address(), o.status.address());
        // The rows' tokens stay in the plan; their status is the caller's.
        // SAFETY: the plan's own `[max_batch]` buffer, written only by this plan's launches.
        let row_tokens = unsafe { DeviceOut::from_raw(self.device_address(&spec.row_tokens), self.max_batch) };
        let rows = DeviceOutputs::new(row_tokens, o.row_status);
        let mut a = self.resolve(i, &rows)?;
        let targets = self.device_address(&spec.targets);
        a.targets = targets;
        a.target_logprobs = self.device_address(&spec.draft_logits);
        a.spec_period = (k + 1) as u32;
        a.decide = Some(DecideLaunch { k: k as u32, drafts: drafts.tokens.address(), draft_probs, accepted, tokens, logprobs, status });
        Ok((a, targets))
    }
}

/// [`SamplingPlan::sequence_errors`] for a plan whose lists hold `capacity` entries (a row
/// error names it).
fn sequence_errors(status: &[u32], accepted: &[u32], row_status: &[u32], capacity: usize) -> Result<Vec<Option<SequenceError>>> {
    let seqs = status.len();
    if seqs == 0 || !row_status.len().is_multiple_of(seqs) || row_status.len() < seqs {
        return Err(Error::Shape(format!("{} row statuses do not split into {seqs} sequences", row_status.len())));
    }
    super::expect_len("accepted", accepted.len(), seqs)?;
    let k = row_status.len() / seqs - 1;
    let rows = row_status
        .iter()
        .enumerate()
        .map(|(row, &code)| RowStatus::from_code(code).ok_or_else(|| Error::Cuda(format!("the kernels wrote unknown status {code} for row {row}"))))
        .collect::<Result<Vec<_>>>()?;
    // A draft fault's position, which the decision writes below k.
    let position = |sequence: usize| -> Result<usize> {
        let p = accepted[sequence] as usize;
        if p < k {
            Ok(p)
        } else {
            Err(Error::Cuda(format!("the decision faulted sequence {sequence} at draft {p} of {k}")))
        }
    };
    status
        .iter()
        .enumerate()
        .map(|(sequence, &code)| match SpecStatus::from_code(code) {
            Some(SpecStatus::Ok) => Ok(None),
            Some(SpecStatus::RowFailed) => crate::verify::sequence_failure(&rows, sequence * (k + 1)..(sequence + 1) * (k + 1), k, capacity)
                .map(|error| Some(SequenceError::Row { sequence, error }))
                .ok_or_else(|| Error::Cuda(format!("sequence {sequence} failed with no failed row"))),
            Some(SpecStatus::Recompute) => Ok(Some(SequenceError::Recompute { sequence })),
            Some(SpecStatus::DraftToken) => Ok(Some(SequenceError::DraftToken { sequence, position: position(sequence)? })),
            Some(SpecStatus::DraftProbability) => Ok(Some(SequenceError::DraftProbability { sequence, position: position(sequence)? })),
            None => Err(Error::Cuda(format!("the decision wrote unknown status {code} for sequence {sequence}"))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::sequence_errors;
    use crate::Error;
    use flashsample_abi::speculative::{SequenceError, SpecStatus};
    use flashsample_abi::{RowError, RowStatus, RowStatusError};

    /// The device outputs of three sequences of k = 2 drafts (9 rows) type as the decision
    /// meant them: decided, a failed row named by its status, a recompute, draft faults at
    /// their positions; malformed outputs are errors, never a wrong outcome.
    #[test]
    fn device_outcomes_type_per_sequence() {
        let ok = RowStatus::Ok.code();
        let mut rows = vec![ok; 9];
        rows[4] = RowStatus::NonFinite.code();
        let status = [SpecStatus::Ok, SpecStatus::RowFailed, SpecStatus::DraftProbability].map(|s| s.code());
        let got = sequence_errors(&status, &[2, 0, 1], &rows, 8).unwrap();
        assert_eq!(got[0], None);
        assert_eq!(got[1], Some(SequenceError::Row { sequence: 1, error: RowStatusError::Row(RowError::NonFinite { row: 4 }) }));
        assert_eq!(got[2], Some(SequenceError::DraftProbability { sequence: 2, position: 1 }));
        let status = [SpecStatus::Recompute, SpecStatus::DraftToken, SpecStatus::Ok].map(|s| s.code());
        let got = sequence_errors(&status, &[0, 0, 1], &[ok; 9], 8).unwrap();
        assert_eq!(got, [Some(SequenceError::Recompute { sequence: 0 }), Some(SequenceError::DraftToken { sequence: 1, position: 0 }), None]);
        // Malformed: a fault past the drafts, a failed sequence without a failed row, unknown
        // codes, lengths that do not split.
        assert!(matches!(sequence_errors(&[SpecStatus::DraftToken.code(); 3], &[2; 3], &[ok; 9], 8), Err(Error::Cuda(_))));
        assert!(matches!(sequence_errors(&[SpecStatus::RowFailed.code(); 3], &[0; 3], &[ok; 9], 8), Err(Error::Cuda(_))));
        assert!(matches!(sequence_errors(&[9; 3], &[0; 3], &[ok; 9], 8), Err(Error::Cuda(_))));
        assert!(matches!(sequence_errors(&[0; 3], &[0; 3], &[99; 9], 8), Err(Error::Cuda(_))));
        assert!(matches!(sequence_errors(&[0; 3], &[0; 3], &[ok; 8], 8), Err(Error::Shape(_))));
        assert!(sequence_errors(&[0; 3], &[0; 2], &[ok; 9], 8).is_err());
    }
}
