//! [`CudaSampler`]: the CUDA half of a [`crate::Sampler`]. It chooses tile configs, makes
//! device-API plans ([`CudaSampler::plan`]), and serves the host API on the same plans: upload
//! the host parameters, [`SamplingPlan::enqueue`] on the device's stream, read back, and map
//! each row's status to its outcome.
//!
//! Pipelines with lists launch stage three (`flashsample_filter`). The host API runs the tuned
//! short lists and retries their two list statuses, each at most once, never returning one
//! while a retry can still give the exact answer:
//! - Overflow (3): some tile's `list_per_tile` entries may have dropped a top token; rerun
//!   the rows from the first such row to the last as a launch of their own with
//!   [`GpuConfig::exact_lists`] (`min(need, vocab_tile)` per tile: a list holding its whole
//!   tile cannot have dropped anything, so this rerun cannot overflow), and where overflows
//!   recur start the next launches on longer lists (`stage_three::ShortListGate`: twice as
//!   long, then exact). Where the launch ran the exact nucleus kernels, they served the first
//!   `R` such rows already.
//! - NucleusTooLarge (4): a row without top-k whose top-p / min-p nucleus outgrew `need =
//!   list_capacity`; those rows alone run stage one again with whole-tile lists, which are
//!   read back and cut exactly on the host (`stage_three::finish_exact`, DESIGN.md step 9
//!   "Exact nucleus"). A row keeps the status only if the config's vocabulary tile is longer
//!   than the longest list (`MAX_LIST_CAPACITY`).
//!
//! Launches that do not need the rows' logsumexp (`SamplingParams::needs_logsumexp` false)
//! use the stage-one variant without it (`CodegenOptions::skip_logsumexp`).

use super::cache;
use super::device::drv;
use super::plan::{from_bytes, runs_nucleus, Args, Boundary, DecideLaunch, NucleusPass, SamplingPlan, DEFAULT_NUCLEUS_ROWS};
use super::{CudaDevice, DeviceTensor};
use crate::launch::{check_operands, check_shape, KernelConfig, Samples, Shape};
use crate::stage_three::{self, ListLength};
use crate::tensor::Storage;
use crate::tuning::{self, DeviceIdentity, ShapeKey};
use crate::{Error, Result, Tensor};
use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr};
use flashsample_abi::{Candidate, LsePartial, RowFilter, RowResult, RowStatus, SamplingParams, Scored, StageTwo, TopLists, INDEX_NONE};
use flashsample_codegen_ptx::GpuConfig;
use flashsample_ir::{Pipeline, Temperature, MAX_LIST_CAPACITY};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The tile lists of a device-API plan, which cannot rerun a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DeviceLists {
    /// The tuned short lists: the plan's nucleus kernels serve a row whose top-k overflows
    /// them as exactly as longer lists would (its first `R` per chunk).
    Short,
    /// Lists that cannot overflow ([`GpuConfig::exact_lists`]).
    Exact,
}

impl DeviceLists {
    /// Short where the plan runs the nucleus kernels ([`runs_nucleus`]) and they serve an
    /// overflowed row whole: they sample it and report its logprobs, but keep no top-n logprob
    /// lists, and a verifying pipeline's decision reads its draft rows' lists itself.
    pub(crate) fn of(pipeline: &Pipeline, vocab: usize, nucleus_rows: usize) -> DeviceLists {
        if runs_nucleus(pipeline, vocab, nucleus_rows) && pipeline.outputs.top_logprobs == 0 && pipeline.verify.is_none() {
            DeviceLists::Short
        } else {
            DeviceLists::Exact
        }
    }
}

/// Host-path plans kept per sampler (each owns its scratch); the oldest is dropped beyond this.
const HOST_PLANS: usize = 4;

/// The CUDA half of a sampler (see the module docs). Reach it with [`crate::Sampler::cuda`].
pub struct CudaSampler {
    pipeline: Arc<Pipeline>,
    device: Arc<CudaDevice>,
    /// Config per shape, so the tuning files are read once per shape.
    configs: Mutex<HashMap<Shape, GpuConfig>>,
    /// The host API's plans and parameter buffers.
    host: Mutex<HostState>,
    /// Whether a host-API launch starts on the config's short lists or on exact ones.
    short_lists: stage_three::ShortListGate,
}

/// What identifies a host-path plan.
#[derive(Clone, Debug, PartialEq)]
struct PlanKey {
    dim: usize,
    vocab: usize,
    config: GpuConfig,
    need: u32,
    lse: bool,
}

#[derive(Default)]
struct HostState {
    plans: Vec<(PlanKey, SamplingPlan)>,
    bufs: HostBufs,
}

/// A growable device buffer for the host path's uploads and outputs.
#[derive(Default)]
struct Buf(Option<CudaSlice<u8>>);

impl Buf {
    /// Address of a buffer of at least `bytes` bytes.
    fn ensure(&mut self, dev: &CudaDevice, bytes: usize) -> Result<u64> {
        if self.0.as_ref().is_none_or(|b| b.len() < bytes) {
            self.0 = None; // free first: the old one may be large
            self.0 = Some(dev.alloc_bytes(bytes.next_power_of_two())?);
        }
        let b = self.0.as_ref().ok_or_else(|| Error::Cuda("scratch buffer missing".into()))?;
        Ok(b.device_ptr(dev.stream()).0)
    }
    /// Queues a copy of `bytes` (kept alive by the caller until the stream is synchronized).
    fn upload(&mut self, dev: &CudaDevice, bytes: &[u8]) -> Result<u64> {
        let ptr = self.ensure(dev, bytes.len().max(1))?;
        if let (Some(b), false) = (self.0.as_mut(), bytes.is_empty()) {
            let mut view = b.slice_mut(0..bytes.len());
            dev.stream().memcpy_htod(bytes, &mut view).map_err(drv("cuMemcpyHtoDAsync"))?;
        }
        Ok(ptr)
    }
    /// Queues a copy of the first `bytes` bytes to the host (read after synchronizing).
    fn download(&self, dev: &CudaDevice, bytes: usize) -> Result<Vec<u8>> {
        let b = self.0.as_ref().ok_or_else(|| Error::Cuda("scratch buffer missing".into()))?;
        dev.stream().clone_dtoh(&b.slice(0..bytes)).map_err(drv("cuMemcpyDtoHAsync"))
    }
}

#[derive(Default)]
struct HostBufs {
    temperatures: Buf,
    bias: Buf,
    allowed: Buf,
    row_seeds: Buf,
    row_steps: Buf,
    filters: Buf,
    penalties: [Buf; 5],
    logit_bias: [Buf; 4],
    targets: Buf,
    target_logprobs: Buf,
    target_ranks: Buf,
    tokens: Buf,
    status: Buf,
    scores: Buf,
    logits: Buf,
    logsumexp: Buf,
    top: Buf,
    /// A verifying launch's drafts and decision outputs (`SpecRun::Decide`).
    spec: SpecBufs,
}

/// The host API's buffers of a decision on the device.
#[derive(Default)]
struct SpecBufs {
    drafts: Buf,
    draft_probs: Buf,
    accepted: Buf,
    tokens: Buf,
    logprobs: Buf,
    status: Buf,
}

/// What a verifying host launch adds to [`CudaSampler::sample_once`].
#[derive(Clone, Copy, Debug)]
pub(super) enum SpecRun<'a> {
    /// Stage one keeps residual lists (its `spec_period`); they are read back.
    Lists { period: u32 },
    /// The decision runs on the device too (`flashsample_decide`); only it is read back.
    Decide { k: usize, drafts: &'a [u32], probs: Option<&'a [f32]> },
}

/// Which launch a timing call enqueues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TimedPass {
    /// What the host API enqueues for a batch without a row of status 4 (nearly every one):
    /// the exact nucleus kernels deferred, so not run.
    HostDeferred,
    /// The exact nucleus kernels inside the launch, as the device API runs them.
    Inline,
    /// A verifying launch with the decision on the device (the params' drafts).
    Verify,
}

/// A decision on the device, read back: per sequence `accepted [S]`, `tokens [S, k+1]`,
/// `logprobs [S, k+1]` (pipelines with `logprob`) and `SpecStatus` codes `[S]`.
pub(super) struct Decision {
    pub(super) accepted: Vec<u32>,
    pub(super) tokens: Vec<u32>,
    pub(super) logprobs: Option<Vec<f32>>,
    pub(super) status: Vec<u32>,
}

/// A host launch's arguments on the device, and the host memory its queued copies read.
struct Uploaded {
    args: Args,
    weights: Vec<u64>,
    _host: Vec<Vec<u8>>,
    _operands: Vec<DeviceTensor>,
}

/// What one host launch read back.
pub(super) struct Readback {
    pub(super) status: Vec<RowStatus>,
    pub(super) reduced: RowResult,
    top: Option<Vec<Scored>>,
    /// Stage two's target logprobs (a verifying launch: stage one's draft logits).
    pub(super) target_logprobs: Option<Vec<f32>>,
    /// The targets' ranks (DESIGN.md step 7c), for a pipeline that ranks them.
    pub(super) target_ranks: Option<Vec<u32>>,
    /// Stage one's lists, when asked for (the exact nucleus path, verification).
    pub(super) lists: Option<(TopLists, Vec<Scored>)>,
    /// Stage one's residual lists, for a verifying launch.
    pub(super) residual: Option<(TopLists, Vec<Candidate>)>,
    /// Beside each list entry its raw logit, with `lists` when the lists carry them.
    pub(super) list_raws: Option<Vec<f32>>,
    /// The device's decision (`SpecRun::Decide`).
    pub(super) decision: Option<Decision>,
}

impl Readback {
    /// Writes `part`, a launch of consecutive rows from `first` on, over those rows' results.
    fn overwrite_rows(&mut self, first: usize, part: Readback, pipeline: &Pipeline) {
        let top_n = pipeline.outputs.top_logprobs as usize;
        self.reduced.overwrite_rows(first, pipeline.samples_per_row() as usize, part.reduced);
        self.status[first..][..part.status.len()].copy_from_slice(&part.status);
        if let (Some(all), Some(some)) = (&mut self.target_logprobs, part.target_logprobs) {
            all[first..][..some.len()].copy_from_slice(&some);
        }
        if let (Some(all), Some(some)) = (&mut self.target_ranks, part.target_ranks) {
            all[first..][..some.len()].copy_from_slice(&some);
        }
        if let (Some(all), Some(some)) = (&mut self.top, part.top) {
            all[first * top_n..][..some.len()].copy_from_slice(&some);
        }
    }
}

impl CudaSampler {
    pub(crate) fn new(pipeline: Arc<Pipeline>, device: Arc<CudaDevice>) -> Self {
        CudaSampler { pipeline, device, configs: Mutex::new(HashMap::new()), host: Mutex::new(HostState::default()), short_lists: Default::default() }
    }

    /// The pipeline this sampler runs.
    pub(crate) fn pipeline(&self) -> &Pipeline {
        &self.pipeline
    }

    /// The device this sampler runs on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// The identity tuning files key this device by.
    pub fn identity(&self) -> DeviceIdentity {
        DeviceIdentity::Cuda {
            name: self.device.name().to_string(),
            compute_capability: self.device.compute_capability(),
            sm_count: self.device.sm_count(),
        }
    }

    /// `GpuConfig::heuristic` for this device and shape.
    pub(crate) fn heuristic(&self, shape: Shape) -> GpuConfig {
        GpuConfig::heuristic(&self.pipeline, shape.batch, shape.dim, shape.vocab, self.device.limits())
    }

    /// The tuning file's nearest valid entry for this device, else the heuristic.
    pub(crate) fn config_for(&self, shape: Shape) -> GpuConfig {
        let mut configs = self.configs.lock().unwrap_or_else(|e| e.into_inner());
        configs
            .entry(shape)
            .or_insert_with(|| {
                let key = ShapeKey { dtype: self.pipeline.weights.dtype, vocab: shape.vocab, dim: shape.dim, batch: shape.batch };
                let found = tuning::lookup::<GpuConfig>(&self.identity(), &key);
                tuning::warn_once(&found.warnings);
                // Tuning files from before list_per_tile existed read it as 0: fill it in.
                let fitted = found.config.map(|mut c| {
                    c.fit_lists(&self.pipeline);
                    c
                });
                let limits = self.device.limits();
                let valid = |c: &GpuConfig| c.validate(&self.pipeline, limits).is_ok();
                // A persistent tile keeps its epilogue scratch (and lists) beside the ring; where
                // that does not fit, the same tile with one CTA per item aliases them. A ping-pong
                // tile keeps its grid (its consumer sets need it) and gives up ring stages.
                let fitted = fitted.and_then(|c| match c.validate(&self.pipeline, limits) {
                    Ok(()) => Some(c),
                    Err(_) if !c.is_warp_specialized() && valid(&c.one_cta_per_item()) => Some(c.one_cta_per_item()),
                    Err(e) => c.shallower_ring_that_fits(&self.pipeline, limits).or_else(|| {
                        tuning::warn_once(&[format!("tuning entry {c:?} does not fit this pipeline and GPU ({e}); using the heuristic")]);
                        None
                    }),
                });
                fitted.unwrap_or_else(|| self.heuristic(shape))
            })
            .clone()
    }

    /// A device-API plan for launches of up to `max_batch` rows against `[vocab, dim]` weights:
    /// each batch's tuned (or heuristic) tile with lists that cannot overflow, every kernel
    /// compiled and loaded, every scratch buffer allocated (see [`SamplingPlan`]). A verifying
    /// pipeline's plan runs [`SamplingPlan::launch_verify`]. Its rows of status 4 (a top-p / min-p nucleus past the lists) are sampled exactly on
    /// the device, [`DEFAULT_NUCLEUS_ROWS`] per chunk ([`CudaSampler::plan_with_nucleus_rows`]).
    pub fn plan(&self, max_batch: usize, dim: usize, vocab: usize) -> Result<SamplingPlan> {
        self.plan_with_nucleus_rows(max_batch, dim, vocab, DEFAULT_NUCLEUS_ROWS)
    }

    /// [`CudaSampler::plan`] whose exact nucleus kernels serve `nucleus_rows` rows of status 3
    /// or 4 per chunk (`R`; 0: none, such rows keep their status), with `R × V × 20` bytes of
    /// scratch.
    ///
    /// A device launch cannot rerun, so its lists must serve every row: where the nucleus
    /// kernels serve a row whose top-k overflowed its tile lists, the plan keeps the tuned
    /// short lists (`default_list_per_tile`: 4 to 8 entries a tile; `backend::DeviceLists`), and a chunk
    /// with more than `R` such rows reports the rest as status 3 (with more of a row's top-k
    /// tokens than that in one tile, rare unless a mask clusters them); otherwise it takes
    /// [`GpuConfig::exact_lists`], which never overflow.
    pub fn plan_with_nucleus_rows(&self, max_batch: usize, dim: usize, vocab: usize, nucleus_rows: usize) -> Result<SamplingPlan> {
        let shape = check_shape(max_batch, dim, vocab, dim)?;
        let capacity = flashsample_codegen_ptx::list_capacity(&self.pipeline);
        let lists = DeviceLists::of(&self.pipeline, vocab, nucleus_rows);
        let mut configs: Vec<(usize, GpuConfig)> = Vec::new();
        for batch in 1..=max_batch {
            let mut c = self.config_for(Shape { batch, ..shape }).for_shape(dim, vocab);
            if capacity > 0 && lists == DeviceLists::Exact {
                c = c.exact_lists(capacity);
            }
            match configs.last_mut() {
                Some((up_to, last)) if *last == c => *up_to = batch,
                _ => configs.push((batch, c)),
            }
        }
        SamplingPlan::build(self.pipeline.clone(), self.device.clone(), shape, configs, true, capacity, nucleus_rows)
    }

    /// Whether this launch computes the logsumexp: the pipeline has it and the launch needs
    /// it. The same for the reruns of a launch (it depends on the parameters only).
    pub(super) fn launch_lse(&self, params: &SamplingParams<'_>, batch: usize) -> bool {
        self.pipeline.needs_logsumexp() && params.needs_logsumexp(&self.pipeline, batch)
    }

    /// The host path's plan for this launch, built (and cached) on first use.
    fn host_plan<'h>(plans: &'h mut Vec<(PlanKey, SamplingPlan)>, this: &CudaSampler, key: PlanKey, batch: usize) -> Result<&'h mut SamplingPlan> {
        let found = plans.iter().position(|(k, p)| *k == key && p.max_batch() >= batch);
        let at = match found {
            Some(at) => at,
            None => {
                let max_batch = batch.next_power_of_two();
                let shape = Shape { batch: max_batch, dim: key.dim, vocab: key.vocab };
                let plan =
                    SamplingPlan::build(this.pipeline.clone(), this.device.clone(), shape, vec![(max_batch, key.config.clone())], key.lse, key.need, DEFAULT_NUCLEUS_ROWS)?;
                plans.retain(|(k, _)| *k != key);
                if plans.len() >= HOST_PLANS {
                    plans.remove(0);
                }
                plans.push((key, plan));
                plans.len() - 1
            }
        };
        Ok(&mut plans[at].1)
    }

    /// Device address of a matmul operand; host operands are uploaded (kept in `uploads`).
    fn operand(&self, t: &Tensor<'_>, uploads: &mut Vec<DeviceTensor>) -> Result<u64> {
        match t.storage {
            Storage::Device(d) => {
                if d.device().ordinal() != self.device.ordinal() {
                    return Err(Error::WrongDevice { tensor: d.location(), sampler: self.device.describe() });
                }
                Ok(d.device_address())
            }
            Storage::Host(bytes) => {
                let up = self.device.upload_bytes(t.dtype, bytes, t.rows, t.cols)?;
                let a = up.device_address();
                uploads.push(up);
                Ok(a)
            }
        }
    }

    /// Queues the uploads of a host launch's operands and parameters into `bufs`.
    fn upload(&self, bufs: &mut HostBufs, hidden: &Tensor<'_>, weights: &[Tensor<'_>], params: &SamplingParams<'_>, shape: Shape, lse: bool) -> Result<Uploaded> {
        let p = &*self.pipeline;
        let dev = &*self.device;
        let mut operands = Vec::new();
        let hidden_ptr = self.operand(hidden, &mut operands)?;
        let weight_ptrs = weights.iter().map(|w| self.operand(w, &mut operands)).collect::<Result<Vec<_>>>()?;
        let mut host: Vec<Vec<u8>> = Vec::new();
        let mut up = |buf: &mut Buf, bytes: Vec<u8>| -> Result<u64> {
            let ptr = buf.upload(dev, &bytes)?;
            // The copy is queued on the stream: the host bytes must outlive it.
            host.push(bytes);
            Ok(ptr)
        };
        let run_time_t = matches!(p.temperature(), Some(Temperature::Scalar { .. } | Temperature::PerRow { .. }));
        let temperatures = if run_time_t { up(&mut bufs.temperatures, bytes_of(&params.row_temperatures(p, shape.batch)))? } else { 0 };
        let bias = match params.bias {
            Some(b) => up(&mut bufs.bias, bytes_of(b))?,
            None => 0,
        };
        let allowed = match params.allowed_bitset(shape.batch, shape.vocab) {
            Some(a) => up(&mut bufs.allowed, bytes_of(&a))?,
            None => 0,
        };
        let row_seeds = match params.row_seeds {
            Some(s) => up(&mut bufs.row_seeds, bytes_of(s))?,
            None => 0,
        };
        let row_steps = match params.row_steps {
            Some(s) => up(&mut bufs.row_steps, bytes_of(s))?,
            None => 0,
        };
        let filters = match params.filter {
            Some(f) => up(&mut bufs.filters, bytes_of(f))?,
            None => 0,
        };
        let penalties = match params.penalty_table(shape.batch, shape.vocab) {
            Some(t) => {
                let [b0, b1, b2, b3, b4] = &mut bufs.penalties;
                [
                    up(b0, bytes_of(&t.listed.bits))?,
                    up(b1, bytes_of(&t.listed.offsets))?,
                    up(b2, bytes_of(&t.listed.tokens))?,
                    up(b3, bytes_of(&t.subtract))?,
                    up(b4, bytes_of(&t.repetition))?,
                ]
            }
            None => [0; 5],
        };
        let logit_bias = match params.logit_bias_table(shape.batch, shape.vocab) {
            Some(t) => {
                let [b0, b1, b2, b3] = &mut bufs.logit_bias;
                [
                    up(b0, bytes_of(&t.listed.bits))?,
                    up(b1, bytes_of(&t.listed.offsets))?,
                    up(b2, bytes_of(&t.listed.tokens))?,
                    up(b3, bytes_of(&t.values))?,
                ]
            }
            None => [0; 4],
        };
        let targets = match params.targets {
            Some(t) => up(&mut bufs.targets, bytes_of(t))?,
            None => 0,
        };
        let target_logprobs = if targets != 0 { bufs.target_logprobs.ensure(dev, shape.batch * 4)? } else { 0 };
        let target_ranks = if targets != 0 && p.ranks_targets() { bufs.target_ranks.ensure(dev, shape.batch * 4)? } else { 0 };
        let n = shape.batch * p.samples_per_row() as usize;
        let top_n = p.outputs.top_logprobs as usize;
        let args = Args {
            shape,
            hidden: hidden_ptr,
            weights: weight_ptrs[0],
            seed: params.seed,
            vocab_offset: params.vocab_offset,
            row_offset: params.row_offset,
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
            tokens: bufs.tokens.ensure(dev, n * 4)?,
            status: bufs.status.ensure(dev, shape.batch * 4)?,
            scores: bufs.scores.ensure(dev, n * 4)?,
            logits: bufs.logits.ensure(dev, n * 4)?,
            // The raw mode always reports its raw logsumexp (DESIGN.md step 10).
            logsumexp: if lse || p.needs_raw_logsumexp() { bufs.logsumexp.ensure(dev, shape.batch * 4)? } else { 0 },
            logprobs: 0,
            top: if top_n > 0 { bufs.top.ensure(dev, shape.batch * top_n * std::mem::size_of::<Scored>())? } else { 0 },
            spec_period: 0,
            // Only a row with a top-p / min-p and no top-k can be status 4.
            nucleus_pass: if params.filter.is_some_and(|f| f.iter().any(RowFilter::may_outgrow_lists)) { NucleusPass::Inline } else { NucleusPass::Skip },
            decide: None,
        };
        Ok(Uploaded { args, weights: weight_ptrs, _host: host, _operands: operands })
    }

    /// Samples every row on the host API; a row the kernels cannot sample gets its error in
    /// [`Samples::row_errors`].
    pub(crate) fn sample(&self, hidden: &Tensor<'_>, weights: &Tensor<'_>, params: &SamplingParams<'_>, shape: Shape, config: &GpuConfig) -> Result<Samples> {
        let lse = self.launch_lse(params, shape.batch);
        let mut config = config.for_shape(shape.dim, shape.vocab);
        let need = flashsample_codegen_ptx::list_capacity(&self.pipeline);
        let exact = config.exact_lists(need);
        let short = need > 0 && exact.list_per_tile > config.list_per_tile;
        let lists = if short { self.short_lists.take() } else { ListLength::Exact };
        if short {
            config.list_per_tile = lists.per_tile(config.list_per_tile as usize, exact.list_per_tile as usize) as u32;
        }
        let mut r = self.sample_once(hidden, weights, params, shape, &config, need, lse, false, None)?;
        // Exact lists never overflow: a second overflow is reported, never rerun.
        let mut list_reruns = 0;
        if let (Some(range), true) = (stage_three::overflowed_rows(&r.status), exact.list_per_tile > config.list_per_tile) {
            self.short_lists.overflowed(lists);
            list_reruns = range.len();
            config = exact;
            if range.len() == shape.batch {
                r = self.sample_once(hidden, weights, params, shape, &config, need, lse, false, None)?;
            } else {
                // A range keeps its rows' noise streams, and every output is batch invariant
                // (DESIGN.md "Batch invariance").
                let rows: Vec<usize> = range.collect();
                let part = self.launch_rows(hidden, weights, params, shape, &rows, &config, need, false, None)?;
                r.overwrite_rows(rows[0], part, &self.pipeline);
            }
        }
        let rows = stage_three::nucleus_rows(&r.status);
        if !rows.is_empty() {
            self.serve_exact(hidden, weights, params, shape, &config, &rows, &mut r)?;
        }
        let top_n = self.pipeline.outputs.top_logprobs as usize;
        // Stage two turned the targets' logits into logprobs.
        let mut samples = Samples::from_reduced(&self.pipeline, shape.batch, r.reduced, &r.status, need as usize, r.target_logprobs, r.target_ranks);
        samples.list_reruns = list_reruns;
        samples.top_logprobs = r.top.map(|top| {
            top.chunks(top_n.max(1))
                .take(shape.batch)
                .zip(&r.status)
                .map(|(row, st)| match st {
                    RowStatus::Ok => row.iter().take_while(|s| s.index != INDEX_NONE).map(|s| (s.index, s.logit)).collect(),
                    _ => Vec::new(),
                })
                .collect()
        });
        Ok(samples)
    }

    /// Serves `rows` (their nucleus outgrew the lists) exactly: stage one of those rows alone
    /// with whole-tile lists, read back and cut on the host ([`stage_three::finish_exact`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn serve_exact(
        &self,
        hidden: &Tensor<'_>,
        weights: &Tensor<'_>,
        params: &SamplingParams<'_>,
        shape: Shape,
        config: &GpuConfig,
        rows: &[usize],
        r: &mut Readback,
    ) -> Result<()> {
        let whole = config.exact_lists(MAX_LIST_CAPACITY);
        if whole.list_per_tile < whole.vocab_tile {
            // No list holds a whole tile of this config: the rows keep their status.
            return Ok(());
        }
        let one = self.launch_rows(hidden, weights, params, shape, rows, &whole, MAX_LIST_CAPACITY, true, None)?;
        if let Some((layout, lists)) = &one.lists {
            // The draw over a large nucleus runs on rayon's global pool (one per process).
            let raws = one.list_raws.as_deref().map(stage_three::ListRaws);
            let whole = stage_three::WholeRows::Lists { layout: *layout, lists, raws };
            stage_three::finish_exact(&self.pipeline, params, rows, whole, &mut r.reduced, &mut r.status);
        }
        Ok(())
    }

    /// [`CudaSampler::sample_once`] of some `rows` of a launch as a launch of their own
    /// ([`SamplingParams::select_rows`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_rows(
        &self,
        hidden: &Tensor<'_>,
        weights: &Tensor<'_>,
        params: &SamplingParams<'_>,
        shape: Shape,
        rows: &[usize],
        config: &GpuConfig,
        need: u32,
        lists: bool,
        spec: Option<SpecRun<'_>>,
    ) -> Result<Readback> {
        let bytes = hidden_rows(hidden, rows, shape.dim)?;
        let sub_hidden = Tensor { dtype: hidden.dtype, rows: rows.len(), cols: shape.dim, storage: Storage::Host(&bytes) };
        let subset = params.select_rows(rows, shape.vocab);
        let sub = subset.params();
        let sub_shape = Shape { batch: rows.len(), ..shape };
        let lse = self.launch_lse(&sub, sub_shape.batch);
        self.sample_once(&sub_hidden, weights, &sub, sub_shape, config, need, lse, lists, spec)
    }

    /// One host launch of every stage with `config` and stage three merging `need` per row;
    /// `lists`: also read back stage one's lists; `spec`: what a verifying launch adds.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn sample_once(
        &self,
        hidden: &Tensor<'_>,
        weights: &Tensor<'_>,
        params: &SamplingParams<'_>,
        shape: Shape,
        config: &GpuConfig,
        need: u32,
        lse: bool,
        lists: bool,
        spec: Option<SpecRun<'_>>,
    ) -> Result<Readback> {
        let _guard = self.device.launch_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut host = self.host.lock().unwrap_or_else(|e| e.into_inner());
        let HostState { plans, bufs } = &mut *host;
        let key = PlanKey { dim: shape.dim, vocab: shape.vocab, config: config.clone(), need, lse };
        let plan = Self::host_plan(plans, self, key, shape.batch)?;
        let mut up = self.upload(bufs, hidden, std::slice::from_ref(weights), params, shape, lse)?;
        let dev = &*self.device;
        // The caller's slices outlive the queued copies: the call synchronizes below.
        let seqs = self.attach_spec(bufs, &mut up.args, spec, shape.batch)?;
        if spec.is_none() && !lists {
            up.args.nucleus_pass = plan.host_nucleus_pass(&up.args);
        }
        plan.enqueue(dev.stream(), &up.args, &mut |_| Ok(()))?;
        let spec_lists = matches!(spec, Some(SpecRun::Lists { .. }));
        let r = self.read_back(bufs, plan, &up.args, lists, spec_lists, seqs)?;
        if up.args.nucleus_pass != NucleusPass::Deferred || !r.status.contains(&RowStatus::NucleusTooLarge) {
            return Ok(r);
        }
        // A row outgrew the lists: its exact nucleus on the device, then the outputs again.
        if !plan.enqueue_deferred_nucleus(dev.stream(), &up.args)? {
            return Ok(r);
        }
        self.read_back(bufs, plan, &up.args, lists, spec_lists, seqs)
    }

    /// What a verifying launch adds to `args`: stage one's `spec_period` and, for
    /// `SpecRun::Decide`, the drafts (and distributions) queued for upload and the decision's
    /// sequence buffers. The `(sequences, k)` the decision covers, if it runs. The queued
    /// copies read `spec`'s slices: the caller keeps them alive until the stream has run them.
    fn attach_spec(&self, bufs: &mut HostBufs, args: &mut Args, spec: Option<SpecRun<'_>>, batch: usize) -> Result<Option<(usize, usize)>> {
        let dev = &*self.device;
        args.spec_period = match spec {
            None => 0,
            Some(SpecRun::Lists { period }) => period,
            Some(SpecRun::Decide { k, .. }) => (k + 1) as u32,
        };
        let Some(SpecRun::Decide { k, drafts, probs }) = spec else { return Ok(None) };
        let seqs = batch / (k + 1);
        let b = &mut bufs.spec;
        let drafts = b.drafts.upload(dev, bytemuck::cast_slice(drafts))?;
        let draft_probs = match probs {
            Some(q) => b.draft_probs.upload(dev, bytemuck::cast_slice(q))?,
            None => 0,
        };
        let n = seqs * (k + 1);
        args.decide = Some(DecideLaunch {
            k: k as u32,
            drafts,
            draft_probs,
            accepted: b.accepted.ensure(dev, seqs.max(1) * 4)?,
            tokens: b.tokens.ensure(dev, n.max(1) * 4)?,
            logprobs: if self.pipeline.outputs.logprob { b.logprobs.ensure(dev, n.max(1) * 4)? } else { 0 },
            status: b.status.ensure(dev, seqs.max(1) * 4)?,
        });
        Ok(Some((seqs, k)))
    }

    /// Queues the copies of a launch's outputs (with stage one's lists when `lists`, its
    /// residual lists when `spec_lists`, the decision of `seqs` sequences of `k` drafts),
    /// waits for them, and reads them.
    fn read_back(&self, bufs: &mut HostBufs, plan: &SamplingPlan, args: &Args, lists: bool, spec_lists: bool, seqs: Option<(usize, usize)>) -> Result<Readback> {
        let dev = &*self.device;
        let shape = args.shape;
        let n = shape.batch * self.pipeline.samples_per_row() as usize;
        let status: Vec<u32> = from_bytes(&bufs.status.download(dev, shape.batch * 4)?);
        let tokens: Vec<u32> = from_bytes(&bufs.tokens.download(dev, n * 4)?);
        let scores: Vec<f32> = from_bytes(&bufs.scores.download(dev, n * 4)?);
        let logits: Vec<f32> = from_bytes(&bufs.logits.download(dev, n * 4)?);
        let logsumexp = if args.logsumexp != 0 { Some(from_bytes::<f32>(&bufs.logsumexp.download(dev, shape.batch * 4)?)) } else { None };
        let top_n = self.pipeline.outputs.top_logprobs as usize;
        let top = if args.top != 0 { Some(from_bytes(&bufs.top.download(dev, shape.batch * top_n * std::mem::size_of::<Scored>())?)) } else { None };
        let target_logprobs =
            if args.target_logprobs != 0 { Some(from_bytes::<f32>(&bufs.target_logprobs.download(dev, shape.batch * 4)?)) } else { None };
        let target_ranks = if args.target_ranks != 0 { Some(from_bytes::<u32>(&bufs.target_ranks.download(dev, shape.batch * 4)?)) } else { None };
        let (lists, list_raws) = if lists { (plan.download_lists(shape.batch)?, plan.download_list_raws(shape.batch)?) } else { (None, None) };
        let residual = if spec_lists { plan.download_residual_lists(shape.batch)? } else { None };
        let decision = match seqs {
            Some((seqs, k)) => {
                let b = &bufs.spec;
                let n = seqs * (k + 1);
                let logprobs = if self.pipeline.outputs.logprob { Some(b.logprobs.download(dev, n * 4)?) } else { None };
                Some((b.accepted.download(dev, seqs * 4)?, b.tokens.download(dev, n * 4)?, logprobs, b.status.download(dev, seqs * 4)?))
            }
            None => None,
        };
        self.sync("flashsample_stage1 + flashsample_stage2 + flashsample_filter")?;
        let lists = lists.map(|(layout, bytes)| (layout, from_bytes(&bytes)));
        let list_raws = list_raws.map(|bytes| from_bytes(&bytes));
        let residual = residual.map(|(layout, bytes)| (layout, from_bytes(&bytes)));
        let decision = decision.map(|(accepted, tokens, logprobs, status)| Decision {
            accepted: from_bytes(&accepted),
            tokens: from_bytes(&tokens),
            logprobs: logprobs.map(|l| from_bytes(&l)),
            status: from_bytes(&status),
        });
        let status = status
            .iter()
            .enumerate()
            .map(|(row, &code)| RowStatus::from_code(code).ok_or_else(|| Error::Cuda(format!("the kernels wrote unknown status {code} for row {row}"))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Readback { status, reduced: RowResult { tokens, scores, logits, logsumexp }, top, target_logprobs, target_ranks, lists, list_raws, residual, decision })
    }

    /// Waits for the stream, naming what was queued if it faulted.
    fn sync(&self, after: &'static str) -> Result<()> {
        self.device.stream().synchronize().map_err(|e| Error::Cuda(format!("cuStreamSynchronize after {after}: {}", super::device::driver_error_text(&e))))
    }

    /// Checks a timing or debug launch and picks its config (`None`: what `sample` would use).
    fn check(&self, hidden: &Tensor<'_>, weights: &[Tensor<'_>], params: &SamplingParams<'_>, config: Option<&KernelConfig>) -> Result<(Shape, GpuConfig)> {
        let first = weights.first().ok_or(Error::EmptyOperand("weights list"))?;
        let shape = check_operands(&self.pipeline, hidden, first)?;
        for w in weights {
            if (w.rows(), w.cols(), w.dtype()) != (first.rows(), first.cols(), first.dtype()) {
                return Err(Error::Shape("every weight buffer of a timed launch must have the same shape and dtype".into()));
            }
        }
        params.validate(&self.pipeline, shape.batch, shape.vocab)?;
        let config = match config {
            Some(KernelConfig::Cuda(c)) => c.clone(),
            None => self.config_for(shape),
            #[allow(unreachable_patterns)]
            Some(_) => return Err(Error::ConfigBackend { sampler: self.device.describe() }),
        };
        Ok((shape, config.for_shape(shape.dim, shape.vocab)))
    }

    /// Uploads a launch once per weight buffer, runs `warmup` launches cycling through them
    /// (rotating buffers keep the L2 cache from holding the weights between launches), then
    /// hands the plan and the launches to `run`. `pass` says which launch (see [`TimedPass`]).
    #[allow(clippy::too_many_arguments)]
    fn timed<T>(
        &self,
        hidden: Tensor<'_>,
        weights: &[Tensor<'_>],
        params: &SamplingParams<'_>,
        config: Option<&KernelConfig>,
        warmup: usize,
        pass: TimedPass,
        run: impl FnOnce(&SamplingPlan, &CudaStream, &[Args]) -> Result<T>,
    ) -> Result<T> {
        let (shape, config) = self.check(&hidden, weights, params, config)?;
        // A verifying launch samples its rows with the drafts as targets, as `verify` does.
        let verify = match pass {
            TimedPass::Verify => Some(crate::verify::draft_targets(params, shape.batch)?),
            TimedPass::HostDeferred | TimedPass::Inline => None,
        };
        let inner = verify.as_ref().map(|(_, targets)| SamplingParams { targets: Some(targets), drafts: None, draft_probs: None, ..*params });
        let rows = inner.as_ref().unwrap_or(params);
        let lse = self.launch_lse(rows, shape.batch);
        let _guard = self.device.launch_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut host = self.host.lock().unwrap_or_else(|e| e.into_inner());
        let HostState { plans, bufs } = &mut *host;
        let key = PlanKey { dim: shape.dim, vocab: shape.vocab, config, need: flashsample_codegen_ptx::list_capacity(&self.pipeline), lse };
        let plan = Self::host_plan(plans, self, key, shape.batch)?;
        let mut up = self.upload(bufs, &hidden, weights, rows, shape, lse)?;
        let spec = verify.map(|(k, _)| SpecRun::Decide { k, drafts: params.drafts.unwrap_or(&[]), probs: params.draft_probs });
        self.attach_spec(bufs, &mut up.args, spec, shape.batch)?;
        let nucleus_pass = match pass {
            TimedPass::HostDeferred => plan.host_nucleus_pass(&up.args),
            TimedPass::Inline | TimedPass::Verify => up.args.nucleus_pass,
        };
        let launches: Vec<Args> = up.weights.iter().map(|&w| Args { weights: w, nucleus_pass, ..up.args }).collect();
        let stream = self.device.stream().clone();
        for i in 0..warmup {
            plan.enqueue(&stream, &launches[i % launches.len()], &mut |_| Ok(()))?;
        }
        self.sync("warm-up launches")?;
        let out = run(plan, &stream, &launches)?;
        drop(up);
        Ok(out)
    }

    /// Device time (seconds) of each of `reps` complete launches (every stage, CUDA events)
    /// after `warmup`, cycling through `weights` (all of one shape) so no launch finds the
    /// previous one's weights in L2. `config` defaults to what `Sampler::sample` would use.
    /// The launches are what `Sampler::sample` enqueues when no row's nucleus outgrows the
    /// lists (the exact nucleus kernels deferred, so not run).
    pub fn time_fused(
        &self,
        hidden: Tensor<'_>,
        weights: &[Tensor<'_>],
        params: &SamplingParams<'_>,
        config: Option<&KernelConfig>,
        warmup: usize,
        reps: usize,
    ) -> Result<Vec<f64>> {
        self.timed(hidden, weights, params, config, warmup, TimedPass::HostDeferred, |plan, stream, launches| {
            let ctx = self.device.context();
            let new_event = || ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("cuEventCreate"));
            let mut events = Vec::with_capacity(reps + 1);
            let first = new_event()?;
            first.record(stream).map_err(drv("cuEventRecord"))?;
            events.push(first);
            for i in 0..reps {
                plan.enqueue(stream, &launches[i % launches.len()], &mut |_| Ok(()))?;
                let e = new_event()?;
                e.record(stream).map_err(drv("cuEventRecord"))?;
                events.push(e);
            }
            self.sync("timed launches")?;
            events
                .windows(2)
                .map(|w| w[0].elapsed_ms(&w[1]).map(|ms| f64::from(ms) * 1e-3).map_err(drv("cuEventElapsedTime")))
                .collect()
        })
    }

    /// Per-stage device time (seconds: stage one, stage two, stage three and the finishing
    /// kernel) of each of `reps` launches, as [`CudaSampler::time_fused`] otherwise (events
    /// between the kernels, which add a little to the total).
    pub fn time_fused_stages(
        &self,
        hidden: Tensor<'_>,
        weights: &[Tensor<'_>],
        params: &SamplingParams<'_>,
        config: Option<&KernelConfig>,
        warmup: usize,
        reps: usize,
    ) -> Result<Vec<[f64; 3]>> {
        const MARKS: [Boundary; 4] = [Boundary::Start, Boundary::AfterStageOne, Boundary::AfterStageTwo, Boundary::End];
        self.time_between(hidden, weights, params, config, warmup, reps, &MARKS, TimedPass::HostDeferred)
    }

    /// Per-stage device time of `reps` launches that run the exact nucleus kernels inside the
    /// launch (as the device API does): stage one, stage two, stage three, the nucleus pick and
    /// logits, its radix sort, and the cut, draw and finishing kernel (seconds).
    pub fn time_nucleus_stages(
        &self,
        hidden: Tensor<'_>,
        weights: &[Tensor<'_>],
        params: &SamplingParams<'_>,
        warmup: usize,
        reps: usize,
    ) -> Result<Vec<[f64; 6]>> {
        use Boundary::*;
        const MARKS: [Boundary; 7] = [Start, AfterStageOne, AfterStageTwo, AfterStageThree, AfterNucleusLogits, AfterNucleusSort, End];
        self.time_between(hidden, weights, params, None, warmup, reps, &MARKS, TimedPass::Inline)
    }

    /// Per-stage device time (seconds: stage one, stage two, stage three, and the decision
    /// with its finishing kernel) of each of `reps` verifying launches of `params` (drafts and
    /// draft distributions as `Sampler::verify` takes them, uploaded once), the launch
    /// `Sampler::verify` runs first (the decision on the device), with `config` instead of the
    /// tuned or heuristic one where given. Events between the kernels add a little to the total.
    pub fn time_verify_stages(
        &self,
        hidden: Tensor<'_>,
        weights: &[Tensor<'_>],
        params: &SamplingParams<'_>,
        config: Option<&KernelConfig>,
        warmup: usize,
        reps: usize,
    ) -> Result<Vec<[f64; 4]>> {
        use Boundary::*;
        const MARKS: [Boundary; 5] = [Start, AfterStageOne, AfterStageTwo, AfterStageThree, End];
        if self.pipeline.verify.is_none() {
            return Err(Error::Unsupported("time_verify_stages needs a verifying pipeline".into()));
        }
        self.time_between(hidden, weights, params, config, warmup, reps, &MARKS, TimedPass::Verify)
    }

    /// Device time between consecutive `marks` of each of `reps` launches (CUDA events at the
    /// boundaries; a mark a launch skips reads as the next one it reaches): `N = M − 1`
    /// intervals a launch, in seconds.
    #[allow(clippy::too_many_arguments)]
    fn time_between<const M: usize, const N: usize>(
        &self,
        hidden: Tensor<'_>,
        weights: &[Tensor<'_>],
        params: &SamplingParams<'_>,
        config: Option<&KernelConfig>,
        warmup: usize,
        reps: usize,
        marks: &[Boundary; M],
        pass: TimedPass,
    ) -> Result<Vec<[f64; N]>> {
        const { assert!(M == N + 1, "N intervals lie between M = N + 1 marks") };
        self.timed(hidden, weights, params, config, warmup, pass, |plan, stream, launches| {
            let ctx = self.device.context();
            let new_event = || ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("cuEventCreate"));
            let mut events = Vec::with_capacity(reps);
            for i in 0..reps {
                let e: Vec<_> = marks.iter().map(|_| new_event()).collect::<Result<_>>()?;
                // Marks a launch skips (no nucleus kernels) are recorded with the next one it
                // reaches: their intervals read 0.
                let mut next = 0;
                plan.enqueue(stream, &launches[i % launches.len()], &mut |at| {
                    let Some(k) = marks.iter().position(|&m| m == at) else { return Ok(()) };
                    for ev in &e[next.min(k)..=k] {
                        ev.record(stream).map_err(drv("cuEventRecord"))?;
                    }
                    next = k + 1;
                    Ok(())
                })?;
                for ev in &e[next.min(marks.len())..] {
                    ev.record(stream).map_err(drv("cuEventRecord"))?;
                }
                events.push(e);
            }
            self.sync("timed launches")?;
            events
                .iter()
                .map(|e| {
                    let mut t = [0.0; N];
                    for (k, t) in t.iter_mut().enumerate() {
                        *t = f64::from(e[k].elapsed_ms(&e[k + 1]).map_err(drv("cuEventElapsedTime"))?) * 1e-3;
                    }
                    Ok(t)
                })
                .collect()
        })
    }

    /// Test hook: one launch into a candidate buffer pre-filled with `poison` (and partials of
    /// NaN); the candidates and partials as stage one left them. Always the kernel variant with
    /// the logsumexp (the pipeline's full contract), so tests see every partial.
    #[doc(hidden)]
    pub fn debug_stage1_candidates(
        &self,
        hidden: Tensor<'_>,
        weights: Tensor<'_>,
        params: &SamplingParams<'_>,
        config: Option<&KernelConfig>,
        poison: Candidate,
    ) -> Result<(StageTwo, Vec<Candidate>, Option<Vec<LsePartial>>)> {
        self.debug_launch(hidden, weights, params, config, poison, |plan, args| plan.debug_stage_one(args))
    }

    /// Test hook: one launch of a raw logprob pipeline (DESIGN.md step 10) over poisoned
    /// partials; returns the layout, the raw logsumexp partials stage one wrote and the raw row
    /// logsumexps stage two reduced from them. `Unsupported` for a processed pipeline.
    #[doc(hidden)]
    pub fn debug_raw_partials(
        &self,
        hidden: Tensor<'_>,
        weights: Tensor<'_>,
        params: &SamplingParams<'_>,
        config: Option<&KernelConfig>,
    ) -> Result<super::plan::RawPartials> {
        let poison = Candidate { score: f32::NAN, index: 0, logit: f32::NAN };
        let out = self.debug_launch(hidden, weights, params, config, poison, |plan, args| plan.debug_raw_partials(args))?;
        out.ok_or_else(|| Error::Unsupported(format!("pipeline `{}` reports processed logprobs: no raw partials", self.pipeline.name)))
    }

    /// The test hooks' launch: a fresh plan of the kernel variant with the logsumexp, its
    /// scratch poisoned (`poison` candidates, partials of NaN), the parameters uploaded, then
    /// `run`.
    fn debug_launch<T>(
        &self,
        hidden: Tensor<'_>,
        weights: Tensor<'_>,
        params: &SamplingParams<'_>,
        config: Option<&KernelConfig>,
        poison: Candidate,
        run: impl FnOnce(&SamplingPlan, &Args) -> Result<T>,
    ) -> Result<T> {
        let (shape, config) = self.check(&hidden, std::slice::from_ref(&weights), params, config)?;
        let lse = self.pipeline.needs_logsumexp();
        let _guard = self.device.launch_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut host = self.host.lock().unwrap_or_else(|e| e.into_inner());
        let need = flashsample_codegen_ptx::list_capacity(&self.pipeline);
        let mut plan = SamplingPlan::build(self.pipeline.clone(), self.device.clone(), shape, vec![(shape.batch, config)], lse, need, 0)?;
        plan.poison_scratch(poison)?;
        let up = self.upload(&mut host.bufs, &hidden, std::slice::from_ref(&weights), params, shape, lse)?;
        let out = run(&plan, &up.args);
        drop(up);
        out
    }

    /// Test hook: whether the kernel for `config` is loaded from the on-disk PTX cache
    /// (compiling or loading it now if needed).
    #[doc(hidden)]
    pub fn debug_kernel_from_disk(&self, config: &KernelConfig) -> Result<bool> {
        match config {
            KernelConfig::Cuda(c) => {
                c.validate(&self.pipeline, self.device.limits())?;
                Ok(cache::kernel(&self.device, &self.pipeline, c, !self.pipeline.needs_logsumexp())?.from_disk)
            }
            #[allow(unreachable_patterns)]
            _ => Err(Error::ConfigBackend { sampler: self.device.describe() }),
        }
    }
}

/// The bytes of `rows` of a hidden-state tensor `[B, dim]` (a device tensor is copied to the
/// host first: the exact nucleus path uploads these rows as a launch of their own).
fn hidden_rows(hidden: &Tensor<'_>, rows: &[usize], dim: usize) -> Result<Vec<u8>> {
    let copied;
    let bytes = match hidden.storage {
        Storage::Host(b) => b,
        Storage::Device(d) => {
            copied = d.to_host_bytes()?;
            &copied[..]
        }
    };
    let row_bytes = dim * hidden.dtype.size_bytes();
    Ok(rows.iter().flat_map(|&r| bytes[r * row_bytes..][..row_bytes].iter().copied()).collect())
}

/// Bytes of a slice, at least one element's worth (a zero-length upload is still a valid
/// buffer the kernel may be handed).
fn bytes_of<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
    if v.is_empty() {
        bytemuck::cast_slice(&[T::zeroed()]).to_vec()
    } else {
        bytemuck::cast_slice(v).to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::DeviceLists;
    use flashsample_codegen_ptx::NUCLEUS_MAX_VOCAB;
    use flashsample_ir::{DType, Outputs, PipelineBuilder};

    /// Short lists only where the nucleus kernels run and can serve an overflowed row whole.
    #[test]
    fn device_plans_keep_short_lists_only_where_the_nucleus_kernels_serve_an_overflow() {
        let topk = |top_logprobs| {
            PipelineBuilder::new("K", DType::BF16, DType::BF16)
                .temperature_per_row("t")
                .filter("f", 50)
                .gumbel("seed", 1)
                .outputs(Outputs { logprob: true, top_logprobs, ..Default::default() })
                .build()
                .unwrap()
        };
        let v = 151_936;
        assert_eq!(DeviceLists::of(&topk(0), v, 2), DeviceLists::Short);
        assert_eq!(DeviceLists::of(&topk(0), v, 0), DeviceLists::Exact, "no nucleus kernels");
        assert_eq!(DeviceLists::of(&topk(0), NUCLEUS_MAX_VOCAB + 32, 2), DeviceLists::Exact, "a vocabulary past the cut");
        assert_eq!(DeviceLists::of(&topk(5), v, 2), DeviceLists::Exact, "top-n logprob lists");
    }
}
