//! [`SamplingPlan`]: the device API. A plan is made once for (pipeline, device, max batch,
//! D, V): it chooses the tile config of every batch up to the maximum, compiles and loads their
//! kernels and allocates every scratch buffer. A launch then only enqueues kernels on the
//! caller's stream, reading the caller's device buffers and writing the caller's outputs: it
//! never allocates, never copies from the host and never synchronizes, so it can be captured
//! into a CUDA graph.
//!
//! Exactness without a host round trip: a row whose top-p / min-p nucleus outgrows the tile
//! lists, or whose top-k overflowed them, is sampled over its whole vocabulary by the plan's
//! nucleus kernels after stage three (DESIGN.md "Exact nucleus on the device"), up to the
//! plan's `R` rows per chunk; a row past them keeps its status (the host API then serves it
//! exactly, DESIGN.md step 9; the device API reports it). Plans whose nucleus kernels cannot
//! serve an overflow (`backend::DeviceLists`) keep lists that cannot overflow instead
//! (`GpuConfig::exact_lists`: each list holds `min(capacity, vocab_tile)` entries).
//!
//! Launches of one plan share its scratch: order them on one stream (or order the streams).
//! The host [`crate::Sampler::sample`] runs through the same [`SamplingPlan::enqueue`].

use super::runtime_kernels::AuxKernels;
use super::cache::{self, LoadedKernel, NucleusKernels};
use super::device::drv;
use super::ptx::{self, Geometry};
use super::tma;
use super::{CudaDevice, DeviceInputs, DeviceOutputs};
use crate::launch::{check_shape, row_scratch_bytes, Shape, CHUNK_SCRATCH_BYTES};
use crate::{Error, Result};
use cudarc::driver::{sys, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use flashsample_abi::{Candidate, LsePartial, ParamError, RowStatus, RowStatusError, Scored, StageTwo, TopLists};
use flashsample_codegen_ptx::{
    DecideArgs, FilterArgs, GpuConfig, KernelArg, NucleusCutArgs, NucleusDrawArgs, NucleusHistArgs, NucleusLayout, NucleusLogitsArgs,
    NucleusPickArgs, NucleusScatterArgs, Stage1Args, Stage2Args, TensorMapWords, DECIDE_THREADS, NUCLEUS_CUT_THREADS, NUCLEUS_MAX_VOCAB, NUCLEUS_RADIX_PASSES,
    NUCLEUS_THREADS, TARGET_LOGITS_THREADS, target_logits_rows_per_cta,
};
use flashsample_ir::{Pipeline, Temperature, Transform};
use std::sync::Arc;

mod device_verify;
pub use device_verify::{DeviceDrafts, VerifyOutputs};

/// A launch's raw logsumexp partials as tests read them back: the candidate layout, the
/// `[B, tiles]` partials and the `[B]` raw row logsumexps stage two reduced from them.
pub type RawPartials = (StageTwo, Vec<LsePartial>, Vec<f32>);

/// Pushes a kernel's arguments in their parameter table's order.
pub(super) fn push_args<'a>(b: &mut cudarc::driver::LaunchArgs<'a>, args: &'a [KernelArg]) {
    for a in args {
        match a {
            KernelArg::U64(v) => b.arg(v),
            KernelArg::U32(v) => b.arg(v),
            KernelArg::TensorMaps(m) => b.arg(m.as_ref()),
        };
    }
}

/// The kernels a plan runs for batches up to `up_to`.
struct PlanKernel {
    up_to: usize,
    config: GpuConfig,
    kernel: Arc<LoadedKernel>,
}

/// Device buffers a plan owns.
struct Scratch {
    candidates: CudaSlice<u8>,
    /// Stage one's per-tile logsumexp partials (plans with the logsumexp).
    lse_partials: Option<CudaSlice<u8>>,
    /// Stage one's per-tile lists (pipelines with lists).
    lists: Option<CudaSlice<u8>>,
    /// Scores and logits of launches whose caller does not ask for them.
    scores: CudaSlice<u8>,
    logits: CudaSlice<u8>,
    /// Row logsumexps of launches whose caller does not ask for them (plans with the logsumexp).
    row_lse: Option<CudaSlice<u8>>,
    /// `[max_batch]` temperatures of pipelines without a run-time temperature (the constant, or 1).
    temperatures: CudaSlice<u8>,
    /// Stage one's `u32 [B, S]` row bounds (the cross-tile noise skip), zeroed before each
    /// stage one; pipelines that draw noise.
    row_bounds: Option<CudaSlice<u8>>,
    /// Stage one's list bounds, `u32 [chunk, G]` (`flashsample_codegen_ptx::list_bound_groups`,
    /// the largest `G` of the plan's kernels), zeroed before each stage one that reads them.
    list_bounds: Option<CudaSlice<u8>>,
    /// Stage one's `Candidate [B, tiles, residual_per_tile]` residual lists (verifying pipelines).
    residual_lists: Option<CudaSlice<u8>>,
    /// The raw logprob mode's buffers (`Pipeline::needs_raw_logsumexp`).
    raw: Option<RawScratch>,
    /// A verifying pipeline's device-API buffers.
    spec: Option<SpecScratch>,
}

/// What a verifying pipeline's device launch keeps per row (`[max_batch]` each): the drafts
/// spread over the rows as stage one's targets, the draft logits stage one captures there,
/// and each row's token (a draft row's argmax, a bonus row's sample).
struct SpecScratch {
    targets: CudaSlice<u8>,
    draft_logits: CudaSlice<u8>,
    row_tokens: CudaSlice<u8>,
    /// Stage three's survivors of each filtered row for the decision (`FilterArgs::kept`,
    /// `Scored [chunk, need]`), for pipelines with a filter.
    kept: Option<CudaSlice<u8>>,
}

/// What the raw logprob mode adds to a plan's scratch (DESIGN.md step 10), per chunk like the
/// processed buffers.
struct RawScratch {
    /// Stage one's per-tile logsumexp partials of the raw logits.
    partials: CudaSlice<u8>,
    /// Stage one's per-tile top lists by raw logit (raw `top_logprobs`).
    lists: Option<CudaSlice<u8>>,
    /// The raw logit beside each processed list entry (`Pipeline::lists_carry_raw`).
    list_raws: Option<CudaSlice<u8>>,
    /// `[max_batch]` raw row logsumexps of launches whose caller does not take the logsumexp.
    row_lse: CudaSlice<u8>,
}

/// Which step of a launch finishes its samples (`glue::finish_sample`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LastStage {
    /// Stage two: no lists, no nucleus, no decision.
    StageTwo,
    /// Stage three: lists, and no nucleus or decision in the launch.
    Filter,
    /// The finishing kernel, after the exact nucleus or before the decision.
    Finalize,
}

/// Where one launch's row outputs go (device addresses, 0 = none).
struct RowOutputs {
    scores: u64,
    logits: u64,
    /// The processed row logsumexp (0 when the plan keeps none).
    row_lse: u64,
    /// The raw row logsumexp (raw logprob mode), else 0.
    raw_row_lse: u64,
    /// The one the outputs report: `raw_row_lse` in the raw mode, else `row_lse`.
    reported_lse: u64,
    /// The caller's logprobs, when there is a logsumexp to report them against.
    logprobs: u64,
}

/// A launch resolved to device addresses (0 = absent), what [`SamplingPlan::enqueue`] runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Args {
    pub shape: Shape,
    pub hidden: u64,
    pub weights: u64,
    pub seed: u64,
    pub vocab_offset: u32,
    /// Launch row of row 0 (`SamplingParams::row_offset`); a chunk adds its first row.
    pub row_offset: u32,
    pub temperatures: u64,
    pub bias: u64,
    pub allowed: u64,
    pub row_seeds: u64,
    /// The stage-one and stage-three `row_steps` argument (`[B]` u32 or 0).
    pub row_steps: u64,
    pub filters: u64,
    /// pen_bits, pen_offsets, pen_tokens, pen_subtract, pen_repetition (0 without penalties).
    pub penalties: [u64; 5],
    /// lb_bits, lb_offsets, lb_tokens, lb_values (0 without a logit bias).
    pub logit_bias: [u64; 4],
    /// `[B]` scored tokens and `[B]` their logprobs (stage one writes the logits there, stage
    /// two turns them into logprobs), 0 without `target_logprob`.
    pub targets: u64,
    pub target_logprobs: u64,
    /// `[B]` the targets' ranks (DESIGN.md step 7c), 0 unless the pipeline ranks them.
    pub target_ranks: u64,
    pub tokens: u64,
    pub status: u64,
    pub scores: u64,
    pub logits: u64,
    pub logsumexp: u64,
    pub logprobs: u64,
    pub top: u64,
    /// Stage one's `spec_period` (`k + 1` of a verifying launch; 0: every row keeps residual
    /// lists), unread without `verify`.
    pub spec_period: u32,
    /// Whether and where the exact nucleus kernels run (when the plan has them).
    pub nucleus_pass: NucleusPass,
    /// The decision on the device, enqueued after stage three (a verifying launch).
    pub decide: Option<DecideLaunch>,
}

/// Whether and where a launch runs the exact nucleus kernels (DESIGN.md "Exact nucleus on the
/// device"; plans that have them). With no row of status 4 every one of them exits at once,
/// but each is still a launch: a few µs of a memory-bound step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NucleusPass {
    /// Not at all: no row can outgrow the lists (the host API knows its rows' filters,
    /// `RowFilter::may_outgrow_lists`).
    Skip,
    /// After stage three, in the launch: the device API (its filters are device memory) and
    /// the host launches a plan runs in chunks (a chunk's scratch is gone after the next one).
    Inline,
    /// Left to the caller, which reads the statuses back and, only if a row has status 4,
    /// enqueues [`SamplingPlan::enqueue_deferred_nucleus`]: a one-chunk host launch, so a batch
    /// without such a row (nearly every one) pays none of the idle launches.
    Deferred,
}

/// A verifying launch's decision kernel (`flashsample_decide`): the drafts and where each
/// sequence's outcome goes (device addresses; 0 = absent where optional). The rows are the
/// launch's: `status`, `tokens` and the target capture (`target_logprobs`, the draft logits).
#[derive(Clone, Copy, Debug)]
pub(crate) struct DecideLaunch {
    /// Drafts per sequence.
    pub k: u32,
    /// `u32 [S·k]`.
    pub drafts: u64,
    /// `f32 [S·k, V]` or 0 (greedy drafts).
    pub draft_probs: u64,
    /// `u32 [S]`.
    pub accepted: u64,
    /// `u32 [S, k + 1]`.
    pub tokens: u64,
    /// `f32 [S, k + 1]` or 0.
    pub logprobs: u64,
    /// `u32 [S]` `SpecStatus` codes.
    pub status: u64,
}

/// Points between a launch's kernels, for the benchmarks' events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Boundary {
    Start,
    AfterStageOne,
    AfterStageTwo,
    /// After stage three, before the exact nucleus kernels.
    AfterStageThree,
    /// After the nucleus pick and logits kernels.
    AfterNucleusLogits,
    /// After the nucleus radix sort.
    AfterNucleusSort,
    End,
}

/// A compiled, allocated sampling launch for one pipeline, device and shape bound (see the
/// module docs). Make it with [`crate::cuda::CudaSampler::plan`].
pub struct SamplingPlan {
    pipeline: Arc<Pipeline>,
    device: Arc<CudaDevice>,
    max_batch: usize,
    dim: usize,
    vocab: usize,
    /// Stage one computes the logsumexp partials.
    lse: bool,
    /// Rows stage three merges each row's lists to.
    need: u32,
    kernels: Vec<PlanKernel>,
    aux: Arc<AuxKernels>,
    scratch: Scratch,
    /// Rows one chunk of a launch runs at most ([`chunk_rows`]); the per-(row, tile) scratch
    /// holds this many rows.
    chunk_rows: usize,
    /// The exact nucleus's scratch, for pipelines with its kernels and `R > 0`.
    nucleus: Option<NucleusScratch>,
}

/// Rows per chunk the exact nucleus kernels serve by default (`R`, DESIGN.md "Exact nucleus on
/// the device"): scratch `R × V × 20` bytes (6 MB at V = 151936).
pub const DEFAULT_NUCLEUS_ROWS: usize = 2;

/// The stage-one capture arguments of a launch: its filters, the slots `R`, the buffer.
#[derive(Clone, Copy)]
struct Capture {
    filters: u64,
    rows: u32,
    logits: u64,
}

/// A plan's exact nucleus scratch: its layout and the one buffer it describes.
struct NucleusScratch {
    layout: NucleusLayout,
    buffer: CudaSlice<u8>,
    /// Stage one's capture of the rows `nucleus::capture_slot` picks
    /// (`codegen_ptx::captures_logits`): their logits, `f32 [R, V]`.
    capture: Option<CudaSlice<u8>>,
}

impl std::fmt::Debug for SamplingPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SamplingPlan")
            .field("pipeline", &self.pipeline.name)
            .field("device", &self.device.describe())
            .field("max_batch", &self.max_batch)
            .field("dim", &self.dim)
            .field("vocab", &self.vocab)
            .field("configs", &self.kernels.iter().map(|k| (k.up_to, &k.config)).collect::<Vec<_>>())
            .finish()
    }
}

impl SamplingPlan {
    /// A plan running `configs[i].1` for batches up to `configs[i].0` (ascending, the last one
    /// `max_batch`); `lse`: stage one computes the logsumexp partials; `need`: stage three's
    /// merge length; `nucleus_rows`: the status-4 rows per chunk the exact nucleus kernels
    /// serve (`R`; 0: none, they keep status 4).
    pub(crate) fn build(
        pipeline: Arc<Pipeline>,
        device: Arc<CudaDevice>,
        shape: Shape,
        configs: Vec<(usize, GpuConfig)>,
        lse: bool,
        need: u32,
        nucleus_rows: usize,
    ) -> Result<SamplingPlan> {
        let Shape { batch: max_batch, dim, vocab } = check_shape(shape.batch, shape.dim, shape.vocab, shape.dim)?;
        if configs.last().map(|c| c.0) != Some(max_batch) {
            return Err(Error::Cuda("a plan's configs must cover its max batch".into()));
        }
        let lse = lse && pipeline.needs_logsumexp();
        let mut kernels = Vec::with_capacity(configs.len());
        for (up_to, config) in configs {
            config.validate(&pipeline, device.limits())?;
            let kernel = cache::kernel(&device, &pipeline, &config, !lse)?;
            kernels.push(PlanKernel { up_to, config, kernel });
        }
        let samples = pipeline.samples_per_row() as usize;
        let tiles = kernels.iter().map(|k| k.config.tiles(vocab)).max().unwrap_or(1);
        let per_tile = kernels.iter().map(|k| k.config.list_per_tile as usize).max().unwrap_or(0);
        let has_lists = pipeline.list_capacity() > 0;
        let raw = pipeline.needs_raw_logsumexp();
        let raw_lists = pipeline.raw_list_capacity() > 0;
        let list_raws = pipeline.lists_carry_raw();
        let residual_per_tile = kernels.iter().map(|k| k.config.residual_per_tile as usize).max().unwrap_or(0);
        let residual_row = tiles * residual_per_tile * std::mem::size_of::<Candidate>();
        let chunk = chunk_rows(max_batch, row_scratch_bytes(&pipeline, tiles, per_tile, lse) + residual_row);
        let n = max_batch * samples;
        let alloc = |bytes: usize| device.alloc_bytes(bytes);
        let constant_t = match pipeline.temperature() {
            Some(Temperature::Const(t)) => Some(t.get()),
            Some(_) => None,
            None => Some(1.0),
        };
        let mut temperatures = alloc(max_batch * 4)?;
        if let Some(t) = constant_t {
            let ts = vec![t; max_batch];
            device.stream().memcpy_htod(bytemuck::cast_slice::<f32, u8>(&ts), &mut temperatures).map_err(drv("cuMemcpyHtoDAsync"))?;
            // `ts` is pageable host memory the copy reads: wait before it is dropped.
            device.synchronize()?;
        }
        let scratch = Scratch {
            candidates: alloc(chunk * samples * tiles * std::mem::size_of::<Candidate>())?,
            lse_partials: if lse { Some(alloc(chunk * tiles * std::mem::size_of::<LsePartial>())?) } else { None },
            lists: if has_lists { Some(alloc(chunk * tiles * per_tile * std::mem::size_of::<Scored>())?) } else { None },
            scores: alloc(n * 4)?,
            logits: alloc(n * 4)?,
            row_lse: if lse { Some(alloc(max_batch * 4)?) } else { None },
            temperatures,
            row_bounds: if pipeline.is_greedy() { None } else { Some(alloc(chunk * samples * 4)?) },
            list_bounds: match kernels.iter().filter_map(|k| flashsample_codegen_ptx::list_bound_groups(&pipeline, &k.config)).max() {
                Some(groups) => Some(alloc(chunk * groups as usize * 4)?),
                None => None,
            },
            raw: if raw {
                Some(RawScratch {
                    partials: alloc(chunk * tiles * std::mem::size_of::<LsePartial>())?,
                    lists: if raw_lists { Some(alloc(chunk * tiles * per_tile * std::mem::size_of::<Scored>())?) } else { None },
                    list_raws: if list_raws { Some(alloc(chunk * tiles * per_tile * 4)?) } else { None },
                    row_lse: alloc(max_batch * 4)?,
                })
            } else {
                None
            },
            residual_lists: if residual_per_tile > 0 { Some(alloc(chunk * tiles * residual_per_tile * std::mem::size_of::<Candidate>())?) } else { None },
            spec: if pipeline.verify.is_some() {
                Some(SpecScratch {
                    targets: alloc(max_batch * 4)?,
                    draft_logits: alloc(max_batch * 4)?,
                    row_tokens: alloc(max_batch * 4)?,
                    kept: if pipeline.filter_max_k().is_some() { Some(alloc(chunk * need as usize * std::mem::size_of::<Scored>())?) } else { None },
                })
            } else {
                None
            },
        };
        let nucleus = if runs_nucleus(&pipeline, vocab, nucleus_rows) {
            let layout = NucleusLayout { rows: nucleus_rows.min(chunk), vocab, samples, raw: pipeline.lists_carry_raw() };
            let capture = if flashsample_codegen_ptx::captures_logits(&pipeline) {
                Some(alloc(layout.rows * vocab * 4)?)
            } else {
                None
            };
            Some(NucleusScratch { layout, buffer: alloc(layout.offsets().bytes)?, capture })
        } else {
            None
        };
        let aux = device.aux_kernels()?;
        Ok(SamplingPlan { pipeline, device, max_batch, dim, vocab, lse, need, kernels, aux, scratch, chunk_rows: chunk, nucleus })
    }

    /// The largest batch a launch may have.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }
    /// The hidden dimension every launch has.
    pub fn dim(&self) -> usize {
        self.dim
    }
    /// The vocabulary every launch has.
    pub fn vocab(&self) -> usize {
        self.vocab
    }
    /// The pipeline the plan runs.
    pub fn pipeline(&self) -> &Pipeline {
        &self.pipeline
    }
    /// The device the plan's kernels and scratch live on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }
    /// The tile configs the plan runs, each with the largest batch it serves.
    pub fn configs(&self) -> impl Iterator<Item = (usize, &GpuConfig)> {
        self.kernels.iter().map(|k| (k.up_to, &k.config))
    }
    /// Bytes of device scratch the plan holds (candidates, logsumexp partials, lists, row
    /// bounds of one chunk; the per-row defaults of outputs the caller does not ask for).
    pub fn scratch_bytes(&self) -> usize {
        let sc = &self.scratch;
        let optional = [&sc.lse_partials, &sc.lists, &sc.row_lse, &sc.row_bounds, &sc.list_bounds, &sc.residual_lists];
        let spec = sc.spec.as_ref().map_or(0, |s| s.targets.len() + s.draft_logits.len() + s.row_tokens.len() + s.kept.as_ref().map_or(0, |k| k.len()));
        let raw = sc.raw.as_ref().map_or(0, |r| {
            r.partials.len() + r.row_lse.len() + [&r.lists, &r.list_raws].iter().filter_map(|b| b.as_ref()).map(|b| b.len()).sum::<usize>()
        });
        [&sc.candidates, &sc.scores, &sc.logits, &sc.temperatures].iter().map(|b| b.len()).sum::<usize>()
            + optional.iter().filter_map(|b| b.as_ref()).map(|b| b.len()).sum::<usize>()
            + raw
            + spec
            + self.nucleus.as_ref().map_or(0, |n| n.buffer.len())
    }

    /// Rows of status 4 per chunk of a launch that the exact nucleus kernels sample on the
    /// device (`R`; DESIGN.md "Exact nucleus on the device"); later ones keep status 4. 0 for
    /// pipelines without a filter, plans made with 0, or vocabularies past `NUCLEUS_MAX_VOCAB`.
    pub fn nucleus_rows(&self) -> usize {
        self.nucleus.as_ref().map_or(0, |n| n.layout.rows)
    }

    /// The list capacity a `NucleusTooLarge` row outgrew.
    pub fn list_capacity(&self) -> usize {
        self.need as usize
    }

    /// The typed error of each row from a status buffer the launch wrote (copied to the host when
    /// the caller chooses): `None` for a sampled row. An unknown code is an error.
    pub fn row_errors(&self, status: &[u32]) -> Result<Vec<Option<RowStatusError>>> {
        status
            .iter()
            .enumerate()
            .map(|(row, &code)| match RowStatus::from_code(code) {
                Some(s) => Ok(s.error(row, self.list_capacity())),
                None => Err(Error::Cuda(format!("the kernels wrote unknown status {code} for row {row}"))),
            })
            .collect()
    }

    /// Enqueues one sampling launch on `stream` (the device's primary context). Reads
    /// `inputs`, writes `outputs`; no allocation, host copy or synchronization. Errors here are
    /// host-side checks (shapes, dtypes, missing buffers) and driver launch failures; what
    /// only the kernels know lands in `outputs.status`.
    pub fn launch(&self, stream: &CudaStream, inputs: DeviceInputs<'_>, outputs: DeviceOutputs<'_>) -> Result<()> {
        if self.pipeline.verify.is_some() {
            // Its stage one would take every row for a draft row: it only verifies.
            return Err(Error::Unsupported(format!("pipeline `{}` verifies drafts: launch it with `launch_verify`", self.pipeline.name)));
        }
        let args = self.resolve(&inputs, &outputs)?;
        self.enqueue(stream, &args, &mut |_| Ok(()))
        // `inputs` and `outputs` drop here, after the kernels are queued: their cudarc events
        // (when the buffers' context tracks them) record this launch's reads and writes.
    }

    /// [`SamplingPlan::launch`] on a raw `CUstream` (engines not on cudarc).
    ///
    /// # Safety
    /// `stream` must be a live stream of the plan device's primary context, kept alive until
    /// the launch has run.
    pub unsafe fn launch_on_raw_stream(&self, stream: sys::CUstream, inputs: DeviceInputs<'_>, outputs: DeviceOutputs<'_>) -> Result<()> {
        // SAFETY: the caller's contract above.
        let stream = unsafe { self.device.context().wrap_borrowed_stream(stream) };
        self.launch(&stream, inputs, outputs)
    }

    /// Checks a device launch's arguments against the plan and the pipeline.
    fn resolve(&self, i: &DeviceInputs<'_>, o: &DeviceOutputs<'_>) -> Result<Args> {
        let p = &*self.pipeline;
        for (m, op, name) in [(&i.hidden, &p.hidden, "hidden"), (&i.weights, &p.weights, "weights")] {
            if m.dtype != op.dtype {
                return Err(Error::DType { operand: name, expected: op.dtype, got: m.dtype });
            }
        }
        let shape = check_shape(i.hidden.rows, i.hidden.cols, i.weights.rows, i.weights.cols)?;
        if shape.batch > self.max_batch || shape.dim != self.dim || shape.vocab != self.vocab {
            return Err(Error::Shape(format!(
                "a launch of hidden [{}, {}] and weights [{}, {}] on a plan for batch <= {}, D = {}, V = {}",
                shape.batch, shape.dim, shape.vocab, shape.dim, self.max_batch, self.dim, self.vocab
            )));
        }
        let (b, s) = (shape.batch, p.samples_per_row() as usize);
        let words = flashsample_abi::params::mask_words_per_row(shape.vocab);
        let has = |f: fn(&Transform) -> bool| p.transforms.iter().any(f);
        let run_time_t = matches!(p.temperature(), Some(Temperature::Scalar { .. } | Temperature::PerRow { .. }));
        let temperatures = expect_in("temperatures", run_time_t, i.temperatures.as_ref().map(|t| (t.address(), t.len())), b)?;
        let bias = expect_in("bias", has(|t| matches!(t, Transform::Bias { .. })), i.bias.as_ref().map(|t| (t.address(), t.len())), shape.vocab)?;
        let masked = has(|t| matches!(t, Transform::Mask { .. } | Transform::Ban { .. }));
        let allowed = expect_in("allowed bitset (mask and bans)", masked, i.allowed.as_ref().map(|t| (t.address(), t.len())), b * words)?;
        let filters = expect_in("filter", p.filter_max_k().is_some(), i.filters.as_ref().map(|t| (t.address(), t.len())), b)?;
        let row_seeds = optional_in("row seeds", i.row_seeds.as_ref().map(|t| (t.address(), t.len())), b)?;
        let row_steps = optional_in("row steps", i.row_steps.as_ref().map(|t| (t.address(), t.len())), b)?;
        if u64::from(i.vocab_offset) + shape.vocab as u64 > 1 << 32 || !i.vocab_offset.is_multiple_of(4) {
            return Err(ParamError::VocabOffset { offset: i.vocab_offset, vocab: shape.vocab }.into());
        }
        let penalties = match (p.has_penalties(), &i.penalties) {
            (true, Some(t)) => {
                let [bits, offsets, tokens] = t.listed.resolve(["penalty bitset", "penalty offsets", "penalty values"], b, words, t.subtract.len())?;
                expect_len("repetition penalties", t.repetition.len(), b)?;
                [bits, offsets, tokens, t.subtract.address(), t.repetition.address()]
            }
            (true, None) => return Err(ParamError::Missing("penalties").into()),
            (false, Some(_)) => return Err(ParamError::Unexpected("penalties").into()),
            (false, None) => [0; 5],
        };
        let logit_bias = match (p.has_logit_bias(), &i.logit_bias) {
            (true, Some(t)) => {
                let [bits, offsets, tokens] = t.listed.resolve(["logit bias bitset", "logit bias offsets", "logit bias values"], b, words, t.values.len())?;
                [bits, offsets, tokens, t.values.address()]
            }
            (true, None) => return Err(ParamError::Missing("logit_bias").into()),
            (false, Some(_)) => return Err(ParamError::Unexpected("logit_bias").into()),
            (false, None) => [0; 4],
        };
        let out = |what, buf: Option<(u64, usize)>, want: usize| -> Result<u64> {
            match buf {
                Some((ptr, len)) if len >= want => Ok(ptr),
                Some((_, len)) => Err(ParamError::Length { what, expected: want, got: len }.into()),
                None => Ok(0),
            }
        };
        let tokens = out("tokens", Some((o.tokens.address(), o.tokens.len())), b * s)?;
        let status = out("status", Some((o.status.address(), o.status.len())), b)?;
        let scores = out("scores", o.scores.as_ref().map(|t| (t.address(), t.len())), b * s)?;
        let logits = out("logits", o.logits.as_ref().map(|t| (t.address(), t.len())), b * s)?;
        let logsumexp = out("logsumexp", o.logsumexp.as_ref().map(|t| (t.address(), t.len())), b)?;
        let logprobs = out("logprobs", o.logprobs.as_ref().map(|t| (t.address(), t.len())), b * s)?;
        let top_n = p.outputs.top_logprobs as usize;
        let top = out("top logprobs", o.top_logprobs.as_ref().map(|t| (t.address(), t.len())), b * top_n)?;
        // The raw mode always has its (raw) logsumexp; the processed one only with `lse`.
        if (logsumexp != 0 || logprobs != 0) && !self.lse && self.scratch.raw.is_none() {
            return Err(ParamError::Unexpected("logsumexp / logprobs output (the pipeline computes no logsumexp)").into());
        }
        if top != 0 && top_n == 0 {
            return Err(ParamError::Unexpected("top logprobs output (the pipeline declares none)").into());
        }
        let scored = p.targets.is_some();
        let targets = expect_in("targets", scored, i.targets.as_ref().map(|t| (t.address(), t.len())), b)?;
        let target_logprobs = match (scored, o.target_logprobs.as_ref().map(|t| (t.address(), t.len()))) {
            (true, None) => return Err(ParamError::Missing("target_logprobs output").into()),
            (false, Some(_)) => return Err(ParamError::Unexpected("target_logprobs output (the pipeline scores no targets)").into()),
            (_, buf) => out("target logprobs", buf, b)?,
        };
        let target_ranks = match (p.ranks_targets(), o.target_ranks.as_ref().map(|t| (t.address(), t.len()))) {
            (true, None) => return Err(ParamError::Missing("target_ranks output").into()),
            (false, Some(_)) => return Err(ParamError::Unexpected("target_ranks output (the pipeline ranks no targets)").into()),
            (_, buf) => out("target ranks", buf, b)?,
        };
        Ok(Args {
            shape,
            hidden: i.hidden.ptr,
            weights: i.weights.ptr,
            seed: i.seed,
            vocab_offset: i.vocab_offset,
            row_offset: i.row_offset,
            temperatures,
            bias,
            allowed,
            row_seeds,
            row_steps,
            filters,
            penalties,
            logit_bias,
            targets,
            target_logprobs,
            target_ranks,
            tokens,
            status,
            scores,
            logits,
            logsumexp,
            logprobs,
            top,
            spec_period: 0,
            nucleus_pass: NucleusPass::Inline,
            decide: None,
        })
    }

    /// The scratch holds a launch of `batch` rows whole (not in chunks): what reading it back
    /// needs.
    fn whole_launch(&self, batch: usize) -> Result<()> {
        if batch > self.chunk_rows {
            return Err(Error::Shape(format!("reading back the scratch of {batch} rows: a launch of more than {} rows runs in chunks", self.chunk_rows)));
        }
        Ok(())
    }

    /// The kernels and config for `batch` rows.
    fn kernel_for(&self, batch: usize) -> Result<&PlanKernel> {
        self.kernels
            .iter()
            .find(|k| k.up_to >= batch)
            .ok_or_else(|| Error::Shape(format!("batch {batch} exceeds the plan's max batch {}", self.max_batch)))
    }

    /// The launch geometry of `batch` rows.
    fn geometry(&self, k: &PlanKernel, batch: usize) -> Geometry {
        ptx::geometry(&k.config, batch, self.vocab, k.kernel.stage1_per_sm * self.device.sm_count())
    }

    /// Stage two's candidate layout for `batch` rows (tests read the candidates).
    pub(crate) fn layout(&self, batch: usize) -> Result<StageTwo> {
        let k = self.kernel_for(batch)?;
        Ok(StageTwo { batch, samples: self.pipeline.samples_per_row() as usize, tiles: self.geometry(k, batch).tiles })
    }

    /// A scratch buffer's address outside a launch (the device API's checks).
    fn device_address(&self, s: &CudaSlice<u8>) -> u64 {
        self.addr(s, self.device.stream())
    }

    fn addr(&self, s: &CudaSlice<u8>, stream: &CudaStream) -> u64 {
        // The device's context does not track events (CudaDevice::open): the guard records nothing.
        s.device_ptr(stream).0
    }

    /// The address of a stage-one bound buffer (row or list bounds) with its first `words`
    /// u32 zeroed on `stream`: a bound starts each launch at 0 (none reached yet). The caller
    /// passes at most the words the plan sized `buf` for.
    fn zeroed_bounds(&self, buf: &CudaSlice<u8>, words: usize, stream: &CudaStream, call: &'static str) -> Result<u64> {
        let dst = self.addr(buf, stream);
        // SAFETY: `dst` is a plan buffer of at least `words` u32 (the caller's contract), and
        // the memset is ordered on `stream` before the stage one that reads it.
        unsafe { cudarc::driver::result::memset_d8_async(dst, 0, words * 4, stream.cu_stream()) }.map_err(drv(call))?;
        Ok(dst)
    }

    /// Queues every kernel of one launch on `stream`; `at` runs at each [`Boundary`] (the
    /// benchmarks record events there). A batch larger than the plan's chunk runs as
    /// consecutive launches of at most `chunk_rows` rows each (the same kernels on row
    /// ranges of every buffer, the noise counter rows kept as the whole launch's), so its
    /// scratch stays that of one chunk; `at` then sees `Start` before the first chunk and the
    /// last chunk's other boundaries (its stage one's span includes the earlier chunks). Each
    /// row's results are those of the one launch: every output is batch invariant (DESIGN.md
    /// "Batch invariance").
    pub(crate) fn enqueue(&self, stream: &CudaStream, a: &Args, at: &mut dyn FnMut(Boundary) -> Result<()>) -> Result<()> {
        if a.shape.batch <= self.chunk_rows {
            return self.enqueue_rows(stream, a, a.row_offset, at);
        }
        if a.decide.is_some() {
            // The decision reads every row's residual lists from the scratch of one chunk.
            return Err(Error::Shape(format!(
                "a verifying launch of {} rows: the plan runs more than {} rows in chunks, and the decision reads the residual lists of the whole launch",
                a.shape.batch, self.chunk_rows
            )));
        }
        at(Boundary::Start)?;
        let mut first = 0;
        while first < a.shape.batch {
            let rows = (a.shape.batch - first).min(self.chunk_rows);
            let last = first + rows == a.shape.batch;
            let chunk = chunk_args(&self.pipeline, self.dim, self.vocab, a, first, rows);
            self.enqueue_rows(stream, &chunk, a.row_offset.wrapping_add(first as u32), &mut |b| if last && b != Boundary::Start { at(b) } else { Ok(()) })?;
            first += rows;
        }
        Ok(())
    }

    /// [`SamplingPlan::enqueue`] of at most one chunk of rows, the first being launch row
    /// `row_base`.
    fn enqueue_rows(&self, stream: &CudaStream, a: &Args, row_base: u32, at: &mut dyn FnMut(Boundary) -> Result<()>) -> Result<()> {
        let k = self.kernel_for(a.shape.batch)?;
        let g = self.geometry(k, a.shape.batch);
        let sc = &self.scratch;
        at(Boundary::Start)?;
        // Encoded per launch on the host (they hold the operands' addresses) and passed by value.
        let tmaps = if k.config.uses_tma() {
            tma::encode_operands(a.weights, a.hidden, self.vocab, self.dim, a.shape.batch, k.config.batch_tile)?
        } else {
            TensorMapWords::default()
        };
        let temperatures = self.temperatures(a, stream);
        let lse_partials = sc.lse_partials.as_ref().map_or(0, |b| self.addr(b, stream));
        let lists = sc.lists.as_ref().map_or(0, |b| self.addr(b, stream));
        let opt = |b: &Option<CudaSlice<u8>>| b.as_ref().map_or(0, |b| self.addr(b, stream));
        let raw_partials = sc.raw.as_ref().map_or(0, |r| self.addr(&r.partials, stream));
        let raw_lists = sc.raw.as_ref().map_or(0, |r| opt(&r.lists));
        let list_raws = sc.raw.as_ref().map_or(0, |r| opt(&r.list_raws));
        let candidates = self.addr(&sc.candidates, stream);
        let (batch, dim, vocab) = (a.shape.batch as u32, self.dim as u32, self.vocab as u32);
        // The first rows whose nucleus may outgrow the lists keep their logits for the nucleus
        // kernels (DESIGN.md "Exact nucleus on the device", step 0).
        let capture = self.capture(a, stream);
        // The row bounds' buffer holds max_batch · S words, the list bounds' max_batch · G of
        // the plan's largest G.
        let row_bounds = match &sc.row_bounds {
            Some(buf) if k.config.noise_skip.uses_row_bounds() => {
                self.zeroed_bounds(buf, a.shape.batch * self.pipeline.samples_per_row() as usize, stream, "cuMemsetD8Async(row bounds)")?
            }
            _ => 0,
        };
        let list_bounds = match (&sc.list_bounds, flashsample_codegen_ptx::list_bound_groups(&self.pipeline, &k.config)) {
            (Some(buf), Some(groups)) => self.zeroed_bounds(buf, a.shape.batch * groups as usize, stream, "cuMemsetD8Async(list bounds)")?,
            _ => 0,
        };

        // Stage one (DESIGN.md's parameter table).
        let cfg = LaunchConfig { grid_dim: g.stage1_grid, block_dim: (g.stage1_block, 1, 1), shared_mem_bytes: g.stage1_smem };
        let stage1 = Stage1Args {
            hidden: a.hidden,
            weights: a.weights,
            temperatures,
            bias: a.bias,
            allowed: a.allowed,
            candidates,
            lse: lse_partials,
            seed: a.seed,
            batch,
            dim,
            vocab,
            vocab_offset: a.vocab_offset,
            row_seeds: a.row_seeds,
            pen_bits: a.penalties[0],
            pen_offsets: a.penalties[1],
            pen_tokens: a.penalties[2],
            pen_subtract: a.penalties[3],
            pen_repetition: a.penalties[4],
            lists,
            tmaps,
            row_steps: a.row_steps,
            lb_bits: a.logit_bias[0],
            lb_offsets: a.logit_bias[1],
            lb_tokens: a.logit_bias[2],
            lb_values: a.logit_bias[3],
            targets: a.targets,
            target_logprobs: a.target_logprobs,
            row_bounds,
            row_base,
            raw_lse: raw_partials,
            raw_lists,
            list_raws,
            residual_lists: sc.residual_lists.as_ref().map_or(0, |b| self.addr(b, stream)),
            spec_period: a.spec_period,
            // Every launch of a filtering pipeline: a row stage three draws takes its argmax.
            filters: a.filters,
            capture_rows: capture.map_or(0, |c| c.rows),
            capture: capture.map_or(0, |c| c.logits),
            target_ranks: 0,
            list_bounds,
        };
        // Stage one and the targets' logits take the same parameter table.
        let launch_stage1 = |kernel: &CudaFunction, cfg: LaunchConfig, args: &Stage1Args, call: &'static str| -> Result<()> {
            let args = args.args();
            let mut b = stream.launch_builder(kernel);
            push_args(&mut b, &args);
            // SAFETY: the arguments are codegen's stage-one parameter table in its order
            // (`Stage1Args`); every buffer is sized for the plan's max batch and the largest
            // tiles of its configs (build), and the caller's were checked against this
            // launch's shape (resolve).
            unsafe { b.launch(cfg) }.map_err(drv(call))?;
            Ok(())
        };
        let stage1 = match (&k.kernel.target_logits, a.target_ranks != 0) {
            (Some(targets), true) => {
                // Step 7c: the targets' logits first, then stage one counts each row's rank
                // against them into the zeroed ranks.
                // SAFETY: `target_ranks` holds `batch` words (resolve), and the memset is
                // ordered on `stream` before stage one.
                unsafe { cudarc::driver::result::memset_d8_async(a.target_ranks, 0, a.shape.batch * 4, stream.cu_stream()) }
                    .map_err(drv("cuMemsetD8Async(target ranks)"))?;
                let rows = target_logits_rows_per_cta(&k.config) as usize;
                let grid = (a.shape.batch.div_ceil(rows) as u32, 1, 1);
                let targets_cfg = LaunchConfig { grid_dim: grid, block_dim: (TARGET_LOGITS_THREADS, 1, 1), shared_mem_bytes: 0 };
                launch_stage1(targets, targets_cfg, &stage1, "cuLaunchKernel(flashsample_target_logits)")?;
                Stage1Args { target_ranks: a.target_ranks, ..stage1 }
            }
            _ => stage1,
        };
        launch_stage1(&k.kernel.stage1, cfg, &stage1, "cuLaunchKernel(flashsample_stage1)")?;
        at(Boundary::AfterStageOne)?;

        // Stage two.
        let RowOutputs { scores, logits, row_lse, raw_row_lse, reported_lse, logprobs } = self.row_outputs(a, stream);
        let nucleus = match (a.nucleus_pass, &self.nucleus, &k.kernel.nucleus) {
            (NucleusPass::Inline, Some(ns), Some(kn)) => Some((ns, kn)),
            _ => None,
        };
        // The last stage that writes samples finishes them (one kernel fewer); after the exact
        // nucleus, or before the decision (which reads the finished rows), the finishing
        // kernel does.
        let last_stage = match (&k.kernel.filter, nucleus.is_some() || a.decide.is_some()) {
            (_, true) => LastStage::Finalize,
            (Some(_), false) => LastStage::Filter,
            (None, false) => LastStage::StageTwo,
        };
        let (samples, tiles) = (self.pipeline.samples_per_row(), g.tiles as u32);
        let cfg = LaunchConfig { grid_dim: g.stage2_grid, block_dim: (g.stage2_block, 1, 1), shared_mem_bytes: 0 };
        let args = Stage2Args {
            candidates,
            lse: lse_partials,
            batch,
            samples,
            tiles,
            out_tokens: a.tokens,
            out_scores: scores,
            out_logits: logits,
            out_lse: row_lse,
            out_status: a.status,
            // A verifying launch's decision reads each draft row's logit itself (`x_d`, not
            // `x_d − L`), so stage two leaves it as stage one wrote it.
            target_logprobs: if self.pipeline.verify.is_some() { 0 } else { a.target_logprobs },
            target_ranks: a.target_ranks,
            raw_lse: raw_partials,
            out_raw_lse: raw_row_lse,
            finish: u32::from(last_stage == LastStage::StageTwo),
            out_logprobs: if last_stage == LastStage::StageTwo { logprobs } else { 0 },
        }
        .args();
        let mut b = stream.launch_builder(&k.kernel.stage2);
        push_args(&mut b, &args);
        // SAFETY: as for stage one, with the stage-two table (`Stage2Args`).
        unsafe { b.launch(cfg) }.map_err(drv("cuLaunchKernel(flashsample_stage2)"))?;
        at(Boundary::AfterStageTwo)?;

        // A verifying launch's filtered rows leave their survivors to the decision.
        let kept = match (&a.decide, self.scratch.spec.as_ref().and_then(|s| s.kept.as_ref())) {
            (Some(_), Some(b)) => self.addr(b, stream),
            _ => 0,
        };
        // Stage three, for pipelines with lists.
        if let Some(filter) = &k.kernel.filter {
            let (per_tile, top_n) = (k.config.list_per_tile, self.pipeline.outputs.top_logprobs);
            let cfg = LaunchConfig { grid_dim: g.filter_grid, block_dim: (g.filter_block, 1, 1), shared_mem_bytes: 0 };
            let args = FilterArgs {
                lists,
                tiles,
                per_tile,
                need: self.need,
                batch,
                samples,
                filters: a.filters,
                lse: row_lse,
                temperatures,
                all_greedy: u32::from(self.pipeline.is_greedy()),
                seed: a.seed,
                row_seeds: a.row_seeds,
                vocab_offset: a.vocab_offset,
                top_n,
                out_tokens: a.tokens,
                out_scores: scores,
                out_logits: logits,
                out_top: a.top,
                out_status: a.status,
                row_steps: a.row_steps,
                row_base,
                raw_lists,
                raw_lse: raw_row_lse,
                list_raws,
                finish: u32::from(last_stage == LastStage::Filter),
                out_logprobs: if last_stage == LastStage::Filter { logprobs } else { 0 },
                kept,
            }
            .args();
            let mut b = stream.launch_builder(filter);
            push_args(&mut b, &args);
            // SAFETY: as for stage one, with the stage-three table (`FilterArgs`).
            unsafe { b.launch(cfg) }.map_err(drv("cuLaunchKernel(flashsample_filter)"))?;
        } else if flashsample_codegen_ptx::list_capacity(&self.pipeline) > 0 {
            return Err(Error::Cuda("the module of a pipeline with lists has no flashsample_filter".into()));
        }
        at(Boundary::AfterStageThree)?;
        if let Some((ns, kn)) = nucleus {
            self.enqueue_nucleus(stream, ns, kn, a, row_base, [temperatures, scores, logits], at)?;
        }
        if last_stage == LastStage::Finalize {
            self.aux.finalize(stream, a.tokens, a.status, logits, reported_lse, logprobs, batch * samples, samples)?;
        }
        if let Some(d) = &a.decide {
            let kernels = k.kernel.decide.as_ref().ok_or_else(|| Error::Cuda("a verifying pipeline's module has no flashsample_decide".into()))?;
            let sequences = batch / (d.k + 1);
            let args = DecideArgs {
                status: a.status,
                row_tokens: a.tokens,
                row_logits: logits,
                lse: row_lse,
                draft_logits: a.target_logprobs,
                residual_lists: sc.residual_lists.as_ref().map_or(0, |b| self.addr(b, stream)),
                tiles,
                per_tile: k.config.residual_per_tile,
                drafts: d.drafts,
                draft_probs: d.draft_probs,
                vocab,
                k: d.k,
                sequences,
                temperatures,
                all_greedy: u32::from(self.pipeline.is_greedy()),
                filters: a.filters,
                kept,
                kept_width: self.need,
                seed: a.seed,
                row_seeds: a.row_seeds,
                row_steps: a.row_steps,
                row_base,
                vocab_offset: a.vocab_offset,
                out_accepted: d.accepted,
                out_tokens: d.tokens,
                out_logprobs: d.logprobs,
                out_status: d.status,
            }
            .args();
            if sequences > 0 {
                let cfg = LaunchConfig { grid_dim: (sequences, 1, 1), block_dim: (DECIDE_THREADS, 1, 1), shared_mem_bytes: 0 };
                let mut b = stream.launch_builder(&kernels.decide);
                push_args(&mut b, &args);
                // SAFETY: the arguments are codegen's decision table in its order (`DecideArgs`);
                // the row buffers are this launch's, the sequence buffers hold `S` and
                // `S·(k + 1)` entries (the host API's own, or checked by `launch_verify`).
                unsafe { b.launch(cfg) }.map_err(drv("cuLaunchKernel(flashsample_decide)"))?;
            }
        }
        at(Boundary::End)
    }

    /// The capture a launch's stage one and nucleus logits kernel use: where the plan has one,
    /// the launch may run its nucleus kernels (not [`NucleusPass::Skip`]) and carries filters.
    fn capture(&self, a: &Args, stream: &CudaStream) -> Option<Capture> {
        let ns = self.nucleus.as_ref()?;
        let logits = ns.capture.as_ref()?;
        (a.nucleus_pass != NucleusPass::Skip && a.filters != 0 && a.decide.is_none())
            .then(|| Capture { filters: a.filters, rows: ns.layout.rows as u32, logits: self.addr(logits, stream) })
    }

    /// The host API's choice for a launch whose rows may outgrow the lists: [`NucleusPass::Deferred`]
    /// where the plan runs it as one chunk without a decision, else what `a` asks.
    pub(crate) fn host_nucleus_pass(&self, a: &Args) -> NucleusPass {
        match a.nucleus_pass {
            NucleusPass::Inline if self.can_defer_nucleus(a) => NucleusPass::Deferred,
            other => other,
        }
    }

    /// Whether launch `a` may leave its exact nucleus to a later enqueue: it runs as one chunk
    /// (the scratch the nucleus reads is still the launch's) and has no decision (which reads
    /// the nucleus rows' samples).
    fn can_defer_nucleus(&self, a: &Args) -> bool {
        a.shape.batch <= self.chunk_rows && a.decide.is_none()
    }

    /// The temperatures a launch's kernels read: the caller's, else the plan's constant ones.
    fn temperatures(&self, a: &Args, stream: &CudaStream) -> u64 {
        if a.temperatures != 0 {
            a.temperatures
        } else {
            self.addr(&self.scratch.temperatures, stream)
        }
    }

    /// Where a launch's row outputs go: the caller's buffers, else the plan's scratch.
    fn row_outputs(&self, a: &Args, stream: &CudaStream) -> RowOutputs {
        let sc = &self.scratch;
        let opt = |b: &Option<CudaSlice<u8>>| b.as_ref().map_or(0, |b| self.addr(b, stream));
        let scores = if a.scores != 0 { a.scores } else { self.addr(&sc.scores, stream) };
        let logits = if a.logits != 0 { a.logits } else { self.addr(&sc.logits, stream) };
        // The logsumexp the outputs report: the processed one, or the raw one in the raw mode
        // (DESIGN.md step 10), whose processed one then stays in the scratch for the filter.
        let (row_lse, raw_row_lse) = match (&sc.row_lse, &sc.raw, a.logsumexp) {
            (None, None, _) => (0, 0),
            (Some(_), None, l) if l != 0 => (l, 0),
            (Some(buf), None, _) => (self.addr(buf, stream), 0),
            (buf, Some(_), l) if l != 0 => (opt(buf), l),
            (buf, Some(r), _) => (opt(buf), self.addr(&r.row_lse, stream)),
        };
        let reported_lse = if sc.raw.is_some() { raw_row_lse } else { row_lse };
        let logprobs = if reported_lse != 0 { a.logprobs } else { 0 };
        RowOutputs { scores, logits, row_lse, raw_row_lse, reported_lse, logprobs }
    }

    /// The exact nucleus of launch `a`, enqueued with [`NucleusPass::Deferred`] and complete on
    /// `stream`, after its caller read back a row of status 4: the nucleus kernels over the
    /// scratch the launch left, then the finishing kernel again (on the rows the nucleus does
    /// not touch it rewrites what it wrote). The outputs are those of the same launch with
    /// [`NucleusPass::Inline`]. `Ok(false)`: the plan has no nucleus kernels.
    pub(crate) fn enqueue_deferred_nucleus(&self, stream: &CudaStream, a: &Args) -> Result<bool> {
        if a.nucleus_pass != NucleusPass::Deferred || !self.can_defer_nucleus(a) {
            return Err(Error::Cuda(format!("a deferred nucleus needs a one-chunk launch without a decision enqueued as deferred ({:?}, {} rows)", a.nucleus_pass, a.shape.batch)));
        }
        let k = self.kernel_for(a.shape.batch)?;
        let (Some(ns), Some(kn)) = (&self.nucleus, &k.kernel.nucleus) else { return Ok(false) };
        let o = self.row_outputs(a, stream);
        self.enqueue_nucleus(stream, ns, kn, a, a.row_offset, [self.temperatures(a, stream), o.scores, o.logits], &mut |_| Ok(()))?;
        let samples = self.pipeline.samples_per_row();
        self.aux.finalize(stream, a.tokens, a.status, o.logits, o.reported_lse, o.logprobs, a.shape.batch as u32 * samples, samples)?;
        Ok(true)
    }

    /// The exact nucleus after stage three (DESIGN.md "Exact nucleus on the device"): the
    /// chunk's first `R` rows of status 4 sampled over their whole vocabulary on the device
    /// (pick, logits, four radix passes, cut, draw), before the finishing kernel turns their
    /// logits into logprobs. Every kernel exits at once when no row was picked.
    /// `[temperatures, scores, logits]`: the addresses stage one and three used; `mark` runs
    /// after the logits and after the sort.
    #[allow(clippy::too_many_arguments)]
    fn enqueue_nucleus(
        &self,
        stream: &CudaStream,
        ns: &NucleusScratch,
        kn: &NucleusKernels,
        a: &Args,
        row_base: u32,
        [temperatures, scores, logits]: [u64; 3],
        mark: &mut dyn FnMut(Boundary) -> Result<()>,
    ) -> Result<()> {
        let l = ns.layout;
        let o = l.offsets();
        let base = self.addr(&ns.buffer, stream);
        let at = |off: usize| base + off as u64;
        let (batch, dim, vocab, rows) = (a.shape.batch as u32, self.dim as u32, self.vocab as u32, l.rows as u32);
        let samples = self.pipeline.samples_per_row();
        let picks = at(o.picks);
        let capture = self.capture(a, stream);
        let launch = |f: &CudaFunction, grid: (u32, u32, u32), block: u32, args: Vec<KernelArg>, what: &'static str| -> Result<()> {
            let mut b = stream.launch_builder(f);
            push_args(&mut b, &args);
            // SAFETY: `args` follow the kernel's parameter table (`NUCLEUS_*`); the nucleus
            // buffers are the plan's, laid out by `l` for this vocabulary, and the launch's
            // buffers were checked by `resolve` (chunk offsets as for stage one).
            unsafe { b.launch(LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: 0 }) }.map_err(drv(what))?;
            Ok(())
        };
        let pick = NucleusPickArgs { status: a.status, batch, rows, samples, picks, best: at(o.best), done: at(o.done), row_base, spec_period: a.spec_period };
        launch(&kn.pick, (1, 1, 1), 32, pick.args(), "cuLaunchKernel(flashsample_nucleus_pick)")?;
        let [pen_bits, pen_offsets, pen_tokens, pen_subtract, pen_repetition] = a.penalties;
        let [lb_bits, lb_offsets, lb_tokens, lb_values] = a.logit_bias;
        let logits_args = NucleusLogitsArgs {
            picks,
            rows,
            hidden: a.hidden,
            weights: a.weights,
            temperatures,
            bias: a.bias,
            allowed: a.allowed,
            dim,
            vocab,
            pen_bits,
            pen_offsets,
            pen_tokens,
            pen_subtract,
            pen_repetition,
            lb_bits,
            lb_offsets,
            lb_tokens,
            lb_values,
            x: at(o.x),
            raw: o.raw.map_or(0, at),
            keys: at(o.keys[0]),
            vals: at(o.vals[0]),
            filters: capture.map_or(0, |c| c.filters),
            capture_rows: capture.map_or(0, |c| c.rows),
            capture: capture.map_or(0, |c| c.logits),
        };
        launch(&kn.logits, l.logits_grid(), NUCLEUS_THREADS, logits_args.args(), "cuLaunchKernel(flashsample_nucleus_logits)")?;
        mark(Boundary::AfterNucleusLogits)?;
        for pass in 0..NUCLEUS_RADIX_PASSES as usize {
            let (src, dst) = (pass % 2, 1 - pass % 2);
            let shift = 8 * pass as u32;
            let hist = NucleusHistArgs { picks, rows, keys: at(o.keys[src]), vocab, shift, hist: at(o.hist) };
            launch(&kn.hist, l.sort_grid(), NUCLEUS_THREADS, hist.args(), "cuLaunchKernel(flashsample_nucleus_hist)")?;
            let scatter = NucleusScatterArgs {
                picks,
                rows,
                keys: at(o.keys[src]),
                vals: at(o.vals[src]),
                hist: at(o.hist),
                vocab,
                shift,
                keys_out: at(o.keys[dst]),
                vals_out: at(o.vals[dst]),
            };
            launch(&kn.scatter, l.sort_grid(), NUCLEUS_THREADS, scatter.args(), "cuLaunchKernel(flashsample_nucleus_scatter)")?;
        }
        mark(Boundary::AfterNucleusSort)?;
        // An even number of passes: the sorted keys and tokens are back in buffer 0, and
        // buffer 1's keys hold the cut's masses.
        let cut = NucleusCutArgs { picks, rows, keys: at(o.keys[0]), filters: a.filters, vocab, masses: at(o.keys[1]), kept: at(o.kept) };
        launch(&kn.cut, l.cut_grid(), NUCLEUS_CUT_THREADS, cut.args(), "cuLaunchKernel(flashsample_nucleus_cut)")?;
        let draw = NucleusDrawArgs {
            picks,
            rows,
            vals: at(o.vals[0]),
            x: at(o.x),
            raw: o.raw.map_or(0, at),
            kept: at(o.kept),
            vocab,
            samples,
            seed: a.seed,
            row_seeds: a.row_seeds,
            row_steps: a.row_steps,
            row_base,
            vocab_offset: a.vocab_offset,
            best: at(o.best),
            done: at(o.done),
            out_tokens: a.tokens,
            out_scores: scores,
            out_logits: logits,
            out_status: a.status,
        };
        launch(&kn.draw, l.draw_grid(), NUCLEUS_THREADS, draw.args(), "cuLaunchKernel(flashsample_nucleus_draw)")
    }

    /// Queues a host copy of the per-tile lists a launch of `batch` rows left in the plan's
    /// scratch (bytes, valid once the stream is synchronized), with their layout; `None`
    /// for pipelines without lists. The host API's exact nucleus path reads whole-tile lists.
    pub(crate) fn download_lists(&self, batch: usize) -> Result<Option<(TopLists, Vec<u8>)>> {
        // Stage one and three index the lists with the kernel's own tiles and list length.
        self.download_per_tile::<Scored>(self.scratch.lists.as_ref(), batch, |c| c.list_per_tile)
    }

    /// Queues a host copy of the residual lists a verifying launch of `batch` rows left in the
    /// plan's scratch (valid once the stream is synchronized), with their layout; `None` for
    /// pipelines without `verify`.
    pub(crate) fn download_residual_lists(&self, batch: usize) -> Result<Option<(TopLists, Vec<u8>)>> {
        self.download_per_tile::<Candidate>(self.scratch.residual_lists.as_ref(), batch, |c| c.residual_per_tile)
    }

    /// Queues a host copy of a per-(row, tile) scratch buffer of `T` entries, `per_tile(config)`
    /// per tile, as a launch of `batch` rows left it; `None` when the plan has no such buffer.
    fn download_per_tile<T>(&self, buf: Option<&CudaSlice<u8>>, batch: usize, per_tile: fn(&GpuConfig) -> u32) -> Result<Option<(TopLists, Vec<u8>)>> {
        let Some(buf) = buf else { return Ok(None) };
        self.whole_launch(batch)?;
        let k = self.kernel_for(batch)?;
        let layout = TopLists { batch, tiles: self.geometry(k, batch).tiles, per_tile: per_tile(&k.config) as usize };
        let bytes = self.device.stream().clone_dtoh(&buf.slice(0..layout.len() * std::mem::size_of::<T>())).map_err(drv("cuMemcpyDtoHAsync"))?;
        Ok(Some((layout, bytes)))
    }

    /// Queues a host copy of the raw logit beside each entry of the processed lists a launch
    /// of `batch` rows left (f32 bytes in [`SamplingPlan::download_lists`]'s layout); `None`
    /// unless the pipeline's lists carry them (`Pipeline::lists_carry_raw`).
    pub(crate) fn download_list_raws(&self, batch: usize) -> Result<Option<Vec<u8>>> {
        let Some(buf) = self.scratch.raw.as_ref().and_then(|r| r.list_raws.as_ref()) else { return Ok(None) };
        self.whole_launch(batch)?;
        let k = self.kernel_for(batch)?;
        let len = batch * self.geometry(k, batch).tiles * k.config.list_per_tile as usize;
        let bytes = self.device.stream().clone_dtoh(&buf.slice(0..len * 4)).map_err(drv("cuMemcpyDtoHAsync"))?;
        Ok(Some(bytes))
    }

    /// Overwrites the candidate and logsumexp-partial scratch with `poison` / all ones (tests check
    /// that stage one writes every slot). Synchronizes the device's stream.
    pub(crate) fn poison_scratch(&mut self, poison: Candidate) -> Result<()> {
        let dev = self.device.clone();
        let cands = vec![poison; self.scratch.candidates.len() / std::mem::size_of::<Candidate>()];
        dev.stream().memcpy_htod(bytemuck::cast_slice::<Candidate, u8>(&cands), &mut self.scratch.candidates).map_err(drv("cuMemcpyHtoDAsync"))?;
        let raw = self.scratch.raw.as_mut().map(|r| &mut r.partials);
        for buf in self.scratch.lse_partials.as_mut().into_iter().chain(raw) {
            let nan = vec![LsePartial { sums: [u64::MAX; 3], window: i32::MAX, pad: u32::MAX }; buf.len() / std::mem::size_of::<LsePartial>()];
            dev.stream().memcpy_htod(bytemuck::cast_slice::<LsePartial, u8>(&nan), buf).map_err(drv("cuMemcpyHtoDAsync"))?;
        }
        dev.synchronize()
    }

    /// The raw logprob mode's partials a whole launch of `a` left (tests; `None` in the
    /// processed mode), and the raw row logsumexps stage two reduced from them. Synchronizes.
    pub(crate) fn debug_raw_partials(&self, a: &Args) -> Result<Option<RawPartials>> {
        let Some(raw) = &self.scratch.raw else { return Ok(None) };
        self.whole_launch(a.shape.batch)?;
        let layout = self.layout(a.shape.batch)?;
        let stream = self.device.stream().clone();
        // Stage two writes the raw row logsumexps to the plan's own buffer without a caller's.
        let a = Args { logsumexp: 0, logprobs: 0, ..*a };
        self.enqueue(&stream, &a, &mut |_| Ok(()))?;
        let parts = stream
            .clone_dtoh(&raw.partials.slice(0..a.shape.batch * layout.tiles * std::mem::size_of::<LsePartial>()))
            .map_err(drv("cuMemcpyDtoHAsync"))?;
        let lse = stream.clone_dtoh(&raw.row_lse.slice(0..a.shape.batch * 4)).map_err(drv("cuMemcpyDtoHAsync"))?;
        self.device.synchronize()?;
        Ok(Some((layout, from_bytes(&parts), from_bytes(&lse))))
    }

    /// Stage one alone of `a`, and the candidates and partials it left (tests). Synchronizes.
    pub(crate) fn debug_stage_one(&self, a: &Args) -> Result<(StageTwo, Vec<Candidate>, Option<Vec<LsePartial>>)> {
        self.whole_launch(a.shape.batch)?;
        let layout = self.layout(a.shape.batch)?;
        let stream = self.device.stream().clone();
        // Run the whole launch: stage one's output is not touched by the later stages.
        self.enqueue(&stream, a, &mut |_| Ok(()))?;
        let cands: Vec<u8> = stream
            .clone_dtoh(&self.scratch.candidates.slice(0..layout.candidate_count() * std::mem::size_of::<Candidate>()))
            .map_err(drv("cuMemcpyDtoHAsync"))?;
        let lse = match &self.scratch.lse_partials {
            Some(buf) => Some(
                stream
                    .clone_dtoh(&buf.slice(0..a.shape.batch * layout.tiles * std::mem::size_of::<LsePartial>()))
                    .map_err(drv("cuMemcpyDtoHAsync"))?,
            ),
            None => None,
        };
        self.device.synchronize()?;
        Ok((layout, from_bytes(&cands), lse.map(|l| from_bytes(&l))))
    }
}

/// Rows `first .. first + rows` of launch `a`, as a launch of their own: every per-row
/// buffer offset to row `first` (CSR offsets stay absolute into their token arrays).
fn chunk_args(p: &Pipeline, dim: usize, vocab: usize, a: &Args, first: usize, rows: usize) -> Args {
    let samples = p.samples_per_row() as usize;
    let words = flashsample_abi::params::mask_words_per_row(vocab);
    let at = |ptr: u64, bytes_per_row: usize| if ptr == 0 { 0 } else { ptr + (first * bytes_per_row) as u64 };
    let [pen_bits, pen_offsets, pen_tokens, pen_subtract, pen_repetition] = a.penalties;
    let [lb_bits, lb_offsets, lb_tokens, lb_values] = a.logit_bias;
    Args {
        shape: Shape { batch: rows, ..a.shape },
        hidden: at(a.hidden, dim * p.hidden.dtype.size_bytes()),
        temperatures: at(a.temperatures, 4),
        allowed: at(a.allowed, words * 4),
        row_seeds: at(a.row_seeds, 8),
        row_steps: at(a.row_steps, 4),
        filters: at(a.filters, std::mem::size_of::<flashsample_abi::RowFilter>()),
        penalties: [at(pen_bits, words * 4), at(pen_offsets, 4), pen_tokens, pen_subtract, at(pen_repetition, 4)],
        logit_bias: [at(lb_bits, words * 4), at(lb_offsets, 4), lb_tokens, lb_values],
        targets: at(a.targets, 4),
        target_logprobs: at(a.target_logprobs, 4),
        target_ranks: at(a.target_ranks, 4),
        tokens: at(a.tokens, samples * 4),
        status: at(a.status, 4),
        scores: at(a.scores, samples * 4),
        logits: at(a.logits, samples * 4),
        logsumexp: at(a.logsumexp, 4),
        logprobs: at(a.logprobs, samples * 4),
        top: at(a.top, p.outputs.top_logprobs as usize * std::mem::size_of::<Scored>()),
        ..*a
    }
}

/// Launches of up to this many rows always run whole.
const CHUNK_MIN_ROWS: usize = 1024;

/// Rows one chunk of a plan's launches runs: the whole batch up to [`CHUNK_MIN_ROWS`];
/// beyond it, as many rows (a multiple of 128, every batch tile's divisor) as
/// [`CHUNK_SCRATCH_BYTES`] of `row_scratch` bytes per row hold, at least `CHUNK_MIN_ROWS`.
/// From ~1k rows a chunk keeps the GPU as busy as the whole batch would (one row costs the
/// same from B = 256 on, BENCHMARKS.md), and prompt scoring of thousands of rows then needs
/// O(rows) memory beyond its inputs and outputs instead of O(rows × tiles).
fn chunk_rows(max_batch: usize, row_scratch: usize) -> usize {
    if max_batch <= CHUNK_MIN_ROWS {
        return max_batch;
    }
    let fit = (CHUNK_SCRATCH_BYTES / row_scratch.max(1)) / 128 * 128;
    fit.clamp(CHUNK_MIN_ROWS, max_batch)
}

/// Host copies of device buffers arrive as bytes; reinterpret them (alignment-agnostic).
/// Whether a plan of `nucleus_rows` nucleus rows for `pipeline` at `vocab` runs the exact
/// nucleus kernels: a sampling pipeline with a filter, `R > 0`, and a vocabulary the cut's
/// shared block sums hold (`NUCLEUS_MAX_VOCAB`; past it rows keep status 3 or 4).
pub(crate) fn runs_nucleus(pipeline: &Pipeline, vocab: usize, nucleus_rows: usize) -> bool {
    nucleus_rows > 0 && flashsample_codegen_ptx::has_nucleus_kernels(pipeline) && vocab <= NUCLEUS_MAX_VOCAB
}

pub(crate) fn from_bytes<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    bytes.chunks_exact(std::mem::size_of::<T>()).map(bytemuck::pod_read_unaligned).collect()
}

/// The address of a buffer the pipeline requires (`wanted`) or forbids, at least `len` long.
fn expect_in(what: &'static str, wanted: bool, buf: Option<(u64, usize)>, len: usize) -> Result<u64> {
    match (wanted, buf) {
        (true, None) => Err(ParamError::Missing(what).into()),
        (false, Some(_)) => Err(ParamError::Unexpected(what).into()),
        (false, None) => Ok(0),
        (true, Some((ptr, got))) => expect_len(what, got, len).map(|()| ptr),
    }
}

/// The address of an optional buffer, at least `len` long.
fn optional_in(what: &'static str, buf: Option<(u64, usize)>, len: usize) -> Result<u64> {
    match buf {
        None => Ok(0),
        Some((ptr, got)) => expect_len(what, got, len).map(|()| ptr),
    }
}

/// Whether a buffer of `got` elements holds the `want` a launch reads.
fn expect_len(what: &'static str, got: usize, want: usize) -> Result<()> {
    if got < want {
        return Err(ParamError::Length { what, expected: want, got }.into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{chunk_args, chunk_rows, Args, NucleusPass, CHUNK_MIN_ROWS};
    use crate::launch::row_scratch_bytes;
    use crate::launch::Shape;
    use flashsample_abi::{params::mask_words_per_row, RowFilter, Scored};
    use flashsample_ir::{DType, LogprobMode, Outputs, PipelineBuilder};

    #[test]
    fn chunks_bound_the_scratch_and_never_split_small_batches() {
        for b in [1, 64, 512, CHUNK_MIN_ROWS] {
            assert_eq!(chunk_rows(b, 1 << 20), b);
        }
        // Scoring at V = 151936, tile 128: 1187 tiles × 44 bytes per row.
        let per_row = 1187 * 44;
        let c = chunk_rows(8192, per_row);
        assert!(c >= CHUNK_MIN_ROWS && c.is_multiple_of(128) && c * per_row <= 64 << 20, "{c}");
        assert_eq!(chunk_rows(8192, 1), 8192, "a chunk never exceeds the plan's batch");
        assert_eq!(chunk_rows(4096, 1 << 30), CHUNK_MIN_ROWS, "at least the minimum");
    }

    #[test]
    fn raw_pipelines_count_their_raw_scratch_per_row() {
        // DESIGN.md step 10: a raw pipeline's chunk also holds the raw partials (32 bytes per
        // tile), the raw lists and the raw logits beside the processed lists.
        let build = |mode| {
            PipelineBuilder::new("R", DType::BF16, DType::BF16)
                .temperature_per_row("t")
                .filter("f", 8)
                .gumbel("seed", 2)
                .outputs(Outputs { score: false, logsumexp: true, logprob: true, top_logprobs: 3 })
                .logprob_mode(mode)
                .build()
                .unwrap()
        };
        let (tiles, per_tile) = (1187, 8);
        let processed = row_scratch_bytes(&build(LogprobMode::Processed), tiles, per_tile, true);
        assert_eq!(processed, tiles * (2 * 12 + 32 + 8 * 8));
        let raw = row_scratch_bytes(&build(LogprobMode::Raw), tiles, per_tile, true);
        assert_eq!(raw, processed + tiles * (32 + 8 * 8 + 8 * 4));
        assert!(chunk_rows(8192, raw) <= chunk_rows(8192, processed));
    }

    #[test]
    fn a_chunk_offsets_every_per_row_buffer_to_its_first_row() {
        let p = PipelineBuilder::new("C", DType::BF16, DType::BF16)
            .logit_bias("lb")
            .penalties("pen")
            .temperature_per_row("t")
            .mask("m")
            .filter("f", 8)
            .gumbel("seed", 2)
            .target_logprob("targets")
            .outputs(Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 3 })
            .build()
            .unwrap();
        let (dim, vocab, first) = (4096, 151_936, 1024);
        let words = mask_words_per_row(vocab);
        let base = |i: u64| i << 40;
        let a = Args {
            shape: Shape { batch: 3000, dim, vocab },
            hidden: base(1),
            weights: base(2),
            seed: 7,
            vocab_offset: 0,
            row_offset: 0,
            temperatures: base(3),
            bias: base(4),
            allowed: base(5),
            row_seeds: base(6),
            row_steps: base(7),
            filters: base(8),
            penalties: [base(9), base(10), base(11), base(12), base(13)],
            logit_bias: [base(14), base(15), base(16), base(17)],
            targets: base(18),
            target_logprobs: base(19),
            target_ranks: base(26),
            tokens: base(20),
            status: base(21),
            scores: base(22),
            logits: 0,
            logsumexp: base(23),
            logprobs: base(24),
            top: base(25),
            spec_period: 4,
            nucleus_pass: NucleusPass::Inline,
            decide: None,
        };
        let c = chunk_args(&p, dim, vocab, &a, first, 1000);
        let off = |ptr: u64, per_row: usize| ptr + (first * per_row) as u64;
        assert_eq!(c.shape, Shape { batch: 1000, dim, vocab });
        assert_eq!(c.hidden, off(a.hidden, dim * 2));
        assert_eq!((c.weights, c.seed, c.vocab_offset, c.bias), (a.weights, a.seed, a.vocab_offset, a.bias), "shared by every row");
        assert_eq!(c.temperatures, off(a.temperatures, 4));
        assert_eq!(c.allowed, off(a.allowed, words * 4));
        assert_eq!(c.row_seeds, off(a.row_seeds, 8));
        assert_eq!(c.row_steps, off(a.row_steps, 4));
        assert_eq!(c.filters, off(a.filters, std::mem::size_of::<RowFilter>()));
        // CSR offsets are absolute into the token and value arrays, which stay whole.
        assert_eq!(c.penalties, [off(a.penalties[0], words * 4), off(a.penalties[1], 4), a.penalties[2], a.penalties[3], off(a.penalties[4], 4)]);
        assert_eq!(c.logit_bias, [off(a.logit_bias[0], words * 4), off(a.logit_bias[1], 4), a.logit_bias[2], a.logit_bias[3]]);
        assert_eq!((c.targets, c.target_logprobs, c.target_ranks), (off(a.targets, 4), off(a.target_logprobs, 4), off(a.target_ranks, 4)));
        assert_eq!((c.tokens, c.scores, c.logprobs), (off(a.tokens, 8), off(a.scores, 8), off(a.logprobs, 8)), "two samples per row");
        assert_eq!(c.logits, 0, "an absent buffer stays absent");
        assert_eq!((c.status, c.logsumexp), (off(a.status, 4), off(a.logsumexp, 4)));
        assert_eq!(c.top, off(a.top, 3 * std::mem::size_of::<Scored>()));
    }
}
