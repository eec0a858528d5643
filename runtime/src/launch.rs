//! What every backend's launch shares, in a leaf module: the checked shape of a launch
//! ([`Shape`]), its result with per-row outcomes ([`Samples`]), the operand checks, and the
//! tile config a backend runs ([`KernelConfig`]). Nothing here imports a backend, so the
//! sampler, the CPU and CUDA backends, the sharded and tensor-parallel samplers all point here
//! and never at each other.

use crate::{Error, Result, Tensor};
use flashsample_abi::{Candidate, LsePartial, RowResult, RowStatus, RowStatusError, Scored, INDEX_NONE};
use flashsample_codegen_cpu::CpuConfig;
use flashsample_ir::Pipeline;

/// Bytes of per-(row, tile) scratch one row of a launch needs: candidates, the logsumexp
/// partials (`lse`), the processed lists and, in the raw logprob mode, the raw partials, the
/// raw lists and the raw logits beside the processed lists. The row chunks of both backends
/// (`cuda::plan` and `cpu` `chunk_rows`) are sized by it.
pub(crate) fn row_scratch_bytes(p: &Pipeline, tiles: usize, per_tile: usize, lse: bool) -> usize {
    let list = per_tile * std::mem::size_of::<Scored>();
    let partial = std::mem::size_of::<LsePartial>();
    tiles
        * (p.samples_per_row() as usize * std::mem::size_of::<Candidate>()
            + if lse { partial } else { 0 }
            + if p.list_capacity() > 0 { list } else { 0 }
            + if p.needs_raw_logsumexp() { partial } else { 0 }
            + if p.raw_list_capacity() > 0 { list } else { 0 }
            + if p.lists_carry_raw() { per_tile * 4 } else { 0 })
}

/// The per-(row, tile) scratch ([`row_scratch_bytes`]) a launch past its backend's minimum
/// chunk holds at most: larger batches run in row chunks.
pub(crate) const CHUNK_SCRATCH_BYTES: usize = 64 << 20;

/// Shapes of one launch, checked against each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Rows of the hidden states (`B`).
    pub batch: usize,
    /// Hidden dimension (`D`).
    pub dim: usize,
    /// Rows of the weights (`V`).
    pub vocab: usize,
}

/// Sampled tokens of one launch, row-major `[batch, samples_per_row]`, with each row's outcome.
///
/// A row the kernels could not sample (every token masked, a non-finite logit) does not fail
/// its batch: its error is in
/// [`Samples::row_errors`], its tokens are `abi::INDEX_NONE` (never a vocabulary index) and its
/// scores, logprobs and logsumexp are NaN. Read a row through [`Samples::row_outcome`], or
/// demand that every row was sampled with [`Samples::into_complete`].
#[derive(Clone, Debug, PartialEq)]
pub struct Samples {
    /// Rows of the launch.
    pub batch: usize,
    /// Samples drawn per row (`pipeline.samples_per_row()`).
    pub samples_per_row: usize,
    /// `[batch * samples_per_row]`; `abi::INDEX_NONE` for the samples of a failed row.
    pub tokens: Vec<u32>,
    /// Winning perturbed score of each sample, if the pipeline declares `outputs(score)`.
    pub scores: Option<Vec<f32>>,
    /// Per-row logsumexp of the transformed logits, if declared.
    pub logsumexp: Option<Vec<f32>>,
    /// Log-probability of each sampled token under the full (unfiltered) distribution, if declared.
    pub logprobs: Option<Vec<f32>>,
    /// Per row, the `top_logprobs` most likely tokens and their log-probabilities (most likely
    /// first; shorter for a row with fewer eligible tokens, empty for a failed row), if declared.
    pub top_logprobs: Option<Vec<Vec<(u32, f32)>>>,
    /// Per row, the log-probability of its scored token (`SamplingParams::targets`) under the
    /// transformed, unfiltered distribution, if the pipeline declares `target_logprob`: `-inf`
    /// for a target the pipeline excludes, NaN for a failed row.
    pub target_logprobs: Option<Vec<f32>>,
    /// Per row, the rank of its scored token (DESIGN.md step 7c), if the pipeline declares
    /// `target_logprob(logits, targets, rank)`: the number of tokens at least as likely as it
    /// under the distribution `target_logprobs` describes (1 = the most likely, ties share the
    /// larger rank; `V` for an excluded target), 0 for a failed row.
    pub target_ranks: Option<Vec<u32>>,
    /// Per row: `None` when the row was sampled, else why it was not.
    pub row_errors: Vec<Option<RowStatusError>>,
    /// Rows the host API ran a second time because short tile lists overflowed (the range
    /// from the first such row to the last, DESIGN.md step 6b): what short lists cost this
    /// launch, 0 where they held (and on pipelines without lists).
    pub list_reruns: usize,
}

impl Samples {
    /// The tokens of one row (`abi::INDEX_NONE` for a failed row's).
    pub fn row(&self, row: usize) -> &[u32] {
        &self.tokens[row * self.samples_per_row..][..self.samples_per_row]
    }

    /// The samples of one row, or the row's error.
    pub fn row_outcome(&self, row: usize) -> Result<&[u32], RowStatusError> {
        match &self.row_errors[row] {
            Some(e) => Err(e.clone()),
            None => Ok(self.row(row)),
        }
    }

    /// Whether every row was sampled.
    pub fn is_complete(&self) -> bool {
        self.row_errors.iter().all(Option::is_none)
    }

    /// The samples if every row was sampled, else the first failed row's error (the behaviour
    /// of a caller that cannot use a partial batch).
    pub fn into_complete(self) -> Result<Samples> {
        match self.row_errors.iter().flatten().next() {
            Some(e) => Err(Error::from(e.clone())),
            None => Ok(self),
        }
    }

    /// Samples from a reduced launch whose rows have the given statuses (`RowStatus::Ok` for a
    /// sampled row); `capacity` is the list capacity a `NucleusTooLarge` row outgrew;
    /// `target_logprobs` the rows' target logprobs (DESIGN.md step 7b), if the pipeline scores
    /// targets, and `target_ranks` their ranks (step 7c), if it ranks them. Every output of a
    /// failed row becomes `INDEX_NONE` / NaN (rank 0) here.
    pub(crate) fn from_reduced(
        pipeline: &Pipeline,
        batch: usize,
        mut r: RowResult,
        status: &[RowStatus],
        capacity: usize,
        mut target_logprobs: Option<Vec<f32>>,
        mut target_ranks: Option<Vec<u32>>,
    ) -> Samples {
        let s = pipeline.samples_per_row() as usize;
        let row_errors: Vec<Option<RowStatusError>> =
            status.iter().enumerate().map(|(row, st)| st.error(row, capacity)).collect();
        for (row, e) in row_errors.iter().enumerate() {
            if e.is_some() {
                r.tokens[row * s..][..s].fill(INDEX_NONE);
                r.scores[row * s..][..s].fill(f32::NAN);
                r.logits[row * s..][..s].fill(f32::NAN);
                if let Some(l) = r.logsumexp.as_mut() {
                    l[row] = f32::NAN;
                }
                if let Some(t) = target_logprobs.as_mut() {
                    t[row] = f32::NAN;
                }
                if let Some(t) = target_ranks.as_mut() {
                    t[row] = 0;
                }
            }
        }
        let logprobs = match (&r.logsumexp, pipeline.outputs.logprob) {
            (Some(lse), true) => Some(r.logits.iter().enumerate().map(|(i, l)| l - lse[i / s]).collect()),
            _ => None,
        };
        Samples {
            batch,
            samples_per_row: s,
            tokens: r.tokens,
            scores: pipeline.outputs.score.then_some(r.scores),
            logsumexp: if pipeline.outputs.logsumexp { r.logsumexp } else { None },
            logprobs,
            top_logprobs: None,
            target_logprobs,
            target_ranks,
            row_errors,
            list_reruns: 0,
        }
    }
}

impl From<RowStatusError> for Error {
    fn from(e: RowStatusError) -> Error {
        match e {
            RowStatusError::Row(e) => Error::Row(e),
            RowStatusError::List(e) => Error::List(e),
        }
    }
}

/// A backend's tile config: what the autotuner searches and the tuning file stores.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "backend", rename_all = "lowercase")]
pub enum KernelConfig {
    /// The Cranelift kernel's tiling and threads.
    Cpu(CpuConfig),
    /// The PTX kernels' tiles and schedule.
    #[cfg(feature = "cuda")]
    Cuda(flashsample_codegen_ptx::GpuConfig),
}

/// Checks the two matmul operands against the pipeline and each other.
pub(crate) fn check_operands(p: &Pipeline, hidden: &Tensor<'_>, weights: &Tensor<'_>) -> Result<Shape> {
    for (t, op, name) in [(hidden, &p.hidden, "hidden"), (weights, &p.weights, "weights")] {
        if t.dtype != op.dtype {
            return Err(Error::DType { operand: name, expected: op.dtype, got: t.dtype });
        }
    }
    check_shape(hidden.rows, hidden.cols, weights.rows, weights.cols)
}

/// Checks `hidden [rows, cols]` against `weights [rows, cols]`: non-empty, contracting, and a
/// vocabulary whose indices stay below the candidate sentinels.
pub(crate) fn check_shape(batch: usize, dim: usize, vocab: usize, weight_cols: usize) -> Result<Shape> {
    if batch == 0 {
        return Err(Error::EmptyBatch);
    }
    if dim == 0 {
        return Err(Error::EmptyOperand("hidden dimension"));
    }
    if vocab == 0 {
        return Err(Error::EmptyOperand("vocabulary"));
    }
    if dim != weight_cols {
        return Err(Error::Shape(format!(
            "matmul contracts hidden [{batch}, {dim}] with weights [{vocab}, {weight_cols}]: {dim} != {weight_cols}"
        )));
    }
    if vocab >= INDEX_LIMIT {
        return Err(Error::Shape(format!("vocabulary of {vocab} tokens exceeds the supported {INDEX_LIMIT}")));
    }
    Ok(Shape { batch, dim, vocab })
}

/// Token ids must stay below the candidate sentinels (`abi::INDEX_NONFINITE`).
const INDEX_LIMIT: usize = (u32::MAX - 1) as usize;
