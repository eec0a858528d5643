//! The CUDA backend of one sampler: config choice, kernel lookup, launch of the stages on
//! the device's stream, read-back and the mapping of the kernels' statuses to row errors.
//!
//! Pipelines with lists (filter / top logprobs) launch stage three (`flashsample_filter`)
//! after stage two. Its two list statuses are retried, each at most once, never returned
//! while a retry can still give the exact answer:
//! - Overflow (3): some tile's `list_per_tile` entries may have dropped a top token; rerun
//!   with [`GpuConfig::exact_lists`] (`min(need, vocab_tile)` per tile: a list holding its
//!   whole tile cannot have dropped anything, so this rerun cannot overflow).
//! - NucleusTooLarge (4): a row without top-k whose top-p / min-p nucleus outgrew `need =
//!   list_capacity`; rerun with `need = MAX_LIST_CAPACITY` and exact lists for it (DESIGN.md
//!   step 9 "Fallback"). Only a nucleus past 1024 tokens reaches the caller.
//!
//! Launches that do not need the rows' logsumexp (`SamplingParams::needs_logsumexp` false:
//! no logsumexp / logprob / top-logprob output and no sampled row with a lone top-p) use the
//! stage-one variant without it (`CodegenOptions::skip_logsumexp`) and pass lse = 0 to all
//! three stages; stage three reads the row logsumexp only for those rows and outputs.

use super::tma;
use super::{
    cache::{self, LoadedKernel},
    device::drv,
    ptx::{self, Geometry},
    CudaDevice, DeviceTensor,
};
use crate::{
    sampler::Shape,
    tensor::Storage,
    tuning::{self, DeviceIdentity, ShapeKey},
    Error, Result, Samples, Tensor,
};
use cudarc::driver::{sys, CudaSlice, DevicePtr, LaunchArgs, LaunchConfig, PushKernelArg};
use flashsample_abi::{Candidate, ListError, LsePartial, RowError, RowResult, RowStatus, SamplingParams, Scored, StageTwo, INDEX_NONE};
use flashsample_codegen_ptx::{FilterArgs, GpuConfig, KernelArg, Stage1Args, Stage2Args};
use flashsample_ir::{Pipeline, MAX_LIST_CAPACITY};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Pushes a kernel's arguments in their parameter table's order.
fn push_args<'a>(b: &mut LaunchArgs<'a>, args: &'a [KernelArg]) {
    for a in args {
        match a {
            KernelArg::U64(v) => b.arg(v),
            KernelArg::U32(v) => b.arg(v),
        };
    }
}

/// Host copies of device buffers arrive as bytes; reinterpret them (alignment-agnostic).
fn from_bytes<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    bytes.chunks_exact(std::mem::size_of::<T>()).map(bytemuck::pod_read_unaligned).collect()
}

pub(crate) struct CudaBackend {
    pipeline: Arc<Pipeline>,
    device: Arc<CudaDevice>,
    /// Config per shape, so the tuning files are read once per shape.
    configs: Mutex<HashMap<Shape, GpuConfig>>,
    /// Device buffers reused across launches (they only grow).
    scratch: Mutex<Scratch>,
}

/// A growable device buffer.
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
    fn upload(&mut self, dev: &CudaDevice, bytes: &[u8]) -> Result<u64> {
        let ptr = self.ensure(dev, bytes.len())?;
        if let Some(b) = self.0.as_mut() {
            let mut view = b.slice_mut(0..bytes.len());
            dev.stream().memcpy_htod(bytes, &mut view).map_err(drv("cuMemcpyHtoDAsync"))?;
        }
        Ok(ptr)
    }
    fn download(&self, dev: &CudaDevice, bytes: usize) -> Result<Vec<u8>> {
        let b = self.0.as_ref().ok_or_else(|| Error::Cuda("scratch buffer missing".into()))?;
        dev.stream().clone_dtoh(&b.slice(0..bytes)).map_err(drv("cuMemcpyDtoHAsync"))
    }
}

#[derive(Default)]
struct Scratch {
    temperatures: Buf,
    bias: Buf,
    allowed: Buf,
    candidates: Buf,
    lse: Buf,
    tokens: Buf,
    scores: Buf,
    logits: Buf,
    out_lse: Buf,
    status: Buf,
    row_seeds: Buf,
    pen_bits: Buf,
    pen_offsets: Buf,
    pen_tokens: Buf,
    pen_subtract: Buf,
    pen_repetition: Buf,
    lists: Buf,
    tmaps: Buf,
    filters: Buf,
    greedy: Buf,
    out_top: Buf,
}

/// Bytes of a slice, at least one element's worth (a zero-length upload is still a valid
/// buffer the kernel may be handed).
fn bytes_of<T: bytemuck::Pod + Default>(v: &[T]) -> Vec<u8> {
    if v.is_empty() {
        bytemuck::cast_slice(&[T::default()]).to_vec()
    } else {
        bytemuck::cast_slice(v).to_vec()
    }
}

/// Everything one launch passes to the kernels, plus the host data that must outlive the
/// queued copies and the temporary uploads of host operands.
struct Launch {
    hidden: u64,
    weights: Vec<u64>,
    /// Per weight buffer, its W and H tensor maps (TMA configs; 0 otherwise).
    tmaps: Vec<u64>,
    temperatures: u64,
    bias: u64,
    allowed: u64,
    candidates: u64,
    lse: u64,
    tokens: u64,
    scores: u64,
    logits: u64,
    out_lse: u64,
    status: u64,
    seed: u64,
    vocab_offset: u32,
    row_seeds: u64,
    /// pen_bits, pen_offsets, pen_tokens, pen_subtract, pen_repetition (0 without penalties).
    pen: [u64; 5],
    lists: u64,
    filters: u64,
    greedy: u64,
    out_top: u64,
    per_tile: u32,
    /// Rows stage three merges to (the capacity, or MAX_LIST_CAPACITY in the fallback).
    need: u32,
    top_n: u32,
    shape: Shape,
    samples: usize,
    geometry: Geometry,
    _host: Vec<Vec<u8>>,
    _uploads: Vec<DeviceTensor>,
}

/// What one launch of all stages gave.
enum Attempt {
    Done(Samples),
    Overflow { row: usize },
    Nucleus { row: usize },
}

impl CudaBackend {
    pub fn new(pipeline: Arc<Pipeline>, device: Arc<CudaDevice>) -> Self {
        CudaBackend { pipeline, device, configs: Mutex::new(HashMap::new()), scratch: Mutex::new(Scratch::default()) }
    }

    pub fn identity(&self) -> DeviceIdentity {
        DeviceIdentity::Cuda {
            name: self.device.name().to_string(),
            compute_capability: self.device.compute_capability(),
            sm_count: self.device.sm_count(),
        }
    }

    pub fn heuristic(&self, shape: Shape) -> GpuConfig {
        GpuConfig::heuristic(&self.pipeline, shape.batch, shape.dim, shape.vocab, self.device.limits())
    }

    /// The tuning file's nearest valid entry for this device, else the heuristic.
    pub fn config_for(&self, shape: Shape) -> GpuConfig {
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
                // that does not fit, the same tile with one CTA per item aliases them.
                // (A ping-pong tile is not retried: its consumer sets need the persistent grid.)
                let fitted = fitted.and_then(|c| {
                    if valid(&c) {
                        Some(c)
                    } else if c.is_pingpong() {
                        None
                    } else {
                        Some(c.one_cta_per_item()).filter(valid)
                    }
                });
                fitted.unwrap_or_else(|| self.heuristic(shape))
            })
            .clone()
    }

    /// The kernels for `config`; `lse`: with stage one's logsumexp partials (see
    /// [`CudaBackend::launch_lse`]).
    fn kernel(&self, config: &GpuConfig, lse: bool) -> Result<Arc<LoadedKernel>> {
        config.validate(&self.pipeline, self.device.limits())?;
        cache::kernel(&self.device, &self.pipeline, config, !lse)
    }

    /// [`CudaBackend::kernel`] for the config a launch of `shape` runs: shapes the TMA maps
    /// cannot describe run the same tile on the cp.async ring ([`GpuConfig::for_shape`]).
    fn kernel_for_shape(&self, config: &GpuConfig, shape: Shape, lse: bool) -> Result<(GpuConfig, Arc<LoadedKernel>)> {
        let config = config.for_shape(shape.dim, shape.vocab);
        let kernel = self.kernel(&config, lse)?;
        Ok((config, kernel))
    }

    /// Whether this launch computes the logsumexp: the pipeline has it and the launch needs
    /// it. The same for the reruns of a launch (it depends on the parameters only).
    fn launch_lse(&self, params: &SamplingParams<'_>, batch: usize) -> bool {
        self.pipeline.needs_logsumexp() && params.needs_logsumexp(&self.pipeline, batch)
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

    /// Uploads the launch's arguments and sizes the output buffers.
    #[allow(clippy::too_many_arguments)]
    fn prepare(
        &self,
        kernel: &LoadedKernel,
        scratch: &mut Scratch,
        hidden: &Tensor<'_>,
        weights: &[Tensor<'_>],
        params: &SamplingParams<'_>,
        shape: Shape,
        config: &GpuConfig,
        need: u32,
        lse: bool,
    ) -> Result<Launch> {
        let p = &self.pipeline;
        let dev = &*self.device;
        let samples = p.samples_per_row() as usize;
        let geometry = ptx::geometry(config, shape.batch, shape.vocab, kernel.stage1_per_sm * self.device.sm_count());
        let layout = StageTwo { batch: shape.batch, samples, tiles: geometry.tiles };
        let mut uploads = Vec::new();
        let hidden_ptr = self.operand(hidden, &mut uploads)?;
        let weight_ptrs = weights.iter().map(|w| self.operand(w, &mut uploads)).collect::<Result<Vec<_>>>()?;
        // The TMA stage one reads its operands through tensor maps encoded here (one pair per
        // weight buffer); the bytes stay alive until the queued copy ran (Launch::_host).
        let (tmaps, tmap_bytes) = if config.uses_tma() {
            let mut maps = Vec::with_capacity(weight_ptrs.len() * 2 * tma::MAP_BYTES);
            for &w in &weight_ptrs {
                maps.extend_from_slice(&tma::encode_operands(w, hidden_ptr, shape.vocab, shape.dim, shape.batch, config.batch_tile)?);
            }
            let base = scratch.tmaps.upload(dev, &maps)?;
            ((0..weight_ptrs.len()).map(|i| base + (i * 2 * tma::MAP_BYTES) as u64).collect(), Some(maps))
        } else {
            (vec![0; weight_ptrs.len()], None)
        };
        let temperatures: Vec<u8> = bytemuck::cast_slice(&params.row_temperatures(p, shape.batch)).to_vec();
        let bias: Option<Vec<u8>> = params.bias.map(|b| bytemuck::cast_slice(b).to_vec());
        let allowed: Option<Vec<u8>> = params.allowed_bitset(shape.batch, shape.vocab).map(|a| bytemuck::cast_slice(&a).to_vec());
        let temperatures_ptr = scratch.temperatures.upload(dev, &temperatures)?;
        let bias_ptr = match &bias {
            Some(b) => scratch.bias.upload(dev, b)?,
            None => 0,
        };
        let allowed_ptr = match &allowed {
            Some(a) => scratch.allowed.upload(dev, a)?,
            None => 0,
        };
        let n = shape.batch * samples;
        let lse_ptr = if lse {
            scratch.lse.ensure(dev, shape.batch * layout.tiles * std::mem::size_of::<LsePartial>())?
        } else {
            0
        };
        let out_lse = if lse { scratch.out_lse.ensure(dev, shape.batch * 4)? } else { 0 };
        let mut host: Vec<Vec<u8>> = Vec::new();
        let mut up = |buf: &mut Buf, bytes: Vec<u8>| -> Result<u64> {
            let ptr = buf.upload(dev, &bytes)?;
            // The copy is queued on the stream: the host bytes must outlive it.
            host.push(bytes);
            Ok(ptr)
        };
        let row_seeds = match params.row_seeds {
            Some(seeds) => up(&mut scratch.row_seeds, bytes_of(seeds))?,
            None => 0,
        };
        let pen = match params.penalty_table(shape.batch, shape.vocab) {
            Some(t) => [
                up(&mut scratch.pen_bits, bytes_of(&t.bits))?,
                up(&mut scratch.pen_offsets, bytes_of(&t.offsets))?,
                up(&mut scratch.pen_tokens, bytes_of(&t.tokens))?,
                up(&mut scratch.pen_subtract, bytes_of(&t.subtract))?,
                up(&mut scratch.pen_repetition, bytes_of(&t.repetition))?,
            ],
            None => [0; 5],
        };
        let has_lists = p.list_capacity() > 0;
        let (lists, filters, greedy, out_top) = if has_lists {
            let lists = scratch.lists.ensure(dev, shape.batch * geometry.tiles * config.list_per_tile as usize * std::mem::size_of::<Scored>())?;
            let filters = match params.filter {
                Some(f) => up(&mut scratch.filters, bytes_of(f))?,
                None => 0,
            };
            let greedy: Vec<u32> = (0..shape.batch)
                .map(|r| u32::from(p.is_greedy() || params.row_temperature(p, r) == 0.0))
                .collect();
            let greedy = up(&mut scratch.greedy, bytes_of(&greedy))?;
            let top_n = p.outputs.top_logprobs as usize;
            let out_top = if top_n > 0 { scratch.out_top.ensure(dev, shape.batch * top_n * std::mem::size_of::<Scored>())? } else { 0 };
            (lists, filters, greedy, out_top)
        } else {
            (0, 0, 0, 0)
        };
        let launch = Launch {
            hidden: hidden_ptr,
            weights: weight_ptrs,
            tmaps,
            temperatures: temperatures_ptr,
            bias: bias_ptr,
            allowed: allowed_ptr,
            candidates: scratch.candidates.ensure(dev, layout.candidate_count() * std::mem::size_of::<Candidate>())?,
            lse: lse_ptr,
            tokens: scratch.tokens.ensure(dev, n * 4)?,
            scores: scratch.scores.ensure(dev, n * 4)?,
            logits: scratch.logits.ensure(dev, n * 4)?,
            out_lse,
            status: scratch.status.ensure(dev, shape.batch * 4)?,
            seed: params.seed,
            vocab_offset: params.vocab_offset,
            row_seeds,
            pen,
            lists,
            filters,
            greedy,
            out_top,
            per_tile: config.list_per_tile,
            need,
            top_n: p.outputs.top_logprobs,
            shape,
            samples,
            geometry,
            _host: [Some(temperatures), bias, allowed, tmap_bytes].into_iter().flatten().chain(host).collect(),
            _uploads: uploads,
        };
        Ok(launch)
    }

    /// Stage one on weight buffer `w` of the launch.
    fn launch_stage1(&self, k: &LoadedKernel, l: &Launch, w: usize) -> Result<()> {
        let (weights, tmaps) = (l.weights[w], l.tmaps[w]);
        // The kernel opted into `stage1_smem` when it was loaded (cache::load).
        let g = &l.geometry;
        let (batch, dim, vocab) = (l.shape.batch as u32, l.shape.dim as u32, l.shape.vocab as u32);
        let cfg = LaunchConfig { grid_dim: g.stage1_grid, block_dim: (g.stage1_block, 1, 1), shared_mem_bytes: g.stage1_smem };
        let args = Stage1Args {
            hidden: l.hidden,
            weights,
            temperatures: l.temperatures,
            bias: l.bias,
            allowed: l.allowed,
            candidates: l.candidates,
            lse: l.lse,
            seed: l.seed,
            batch,
            dim,
            vocab,
            vocab_offset: l.vocab_offset,
            row_seeds: l.row_seeds,
            pen_bits: l.pen[0],
            pen_offsets: l.pen[1],
            pen_tokens: l.pen[2],
            pen_subtract: l.pen[3],
            pen_repetition: l.pen[4],
            lists: l.lists,
            tmaps,
            // Every row at step 0 until the device API passes per-row steps.
            row_steps: 0,
        }
        .args();
        let stream = self.device.stream();
        let mut b = stream.launch_builder(&k.stage1);
        push_args(&mut b, &args);
        // SAFETY: the arguments are codegen's stage-one parameter table in its order
        // (`Stage1Args`); every buffer is sized from the same geometry the kernel was
        // generated for.
        unsafe { b.launch(cfg) }.map_err(drv("cuLaunchKernel(flashsample_stage1)"))?;
        Ok(())
    }

    fn launch_stage2(&self, k: &LoadedKernel, l: &Launch) -> Result<()> {
        let g = &l.geometry;
        let (batch, samples, tiles) = (l.shape.batch as u32, l.samples as u32, g.tiles as u32);
        let cfg = LaunchConfig { grid_dim: g.stage2_grid, block_dim: (g.stage2_block, 1, 1), shared_mem_bytes: 0 };
        let args = Stage2Args {
            candidates: l.candidates,
            lse: l.lse,
            batch,
            samples,
            tiles,
            out_tokens: l.tokens,
            out_scores: l.scores,
            out_logits: l.logits,
            out_lse: l.out_lse,
            out_status: l.status,
        }
        .args();
        let stream = self.device.stream();
        let mut b = stream.launch_builder(&k.stage2);
        push_args(&mut b, &args);
        // SAFETY: as for stage one, with the stage-two table (`Stage2Args`).
        unsafe { b.launch(cfg) }.map_err(drv("cuLaunchKernel(flashsample_stage2)"))?;
        Ok(())
    }

    /// Stage three, for pipelines with lists (a no-op otherwise).
    fn launch_filter(&self, k: &LoadedKernel, l: &Launch) -> Result<()> {
        let Some(func) = &k.filter else {
            if self.pipeline.list_capacity() > 0 {
                return Err(Error::Cuda("the module of a pipeline with lists has no flashsample_filter".into()));
            }
            return Ok(());
        };
        let g = &l.geometry;
        let (tiles, batch, samples) = (g.tiles as u32, l.shape.batch as u32, l.samples as u32);
        let cfg = LaunchConfig { grid_dim: g.filter_grid, block_dim: (g.filter_block, 1, 1), shared_mem_bytes: 0 };
        let args = FilterArgs {
            lists: l.lists,
            tiles,
            per_tile: l.per_tile,
            need: l.need,
            batch,
            samples,
            filters: l.filters,
            lse: l.out_lse,
            greedy: l.greedy,
            seed: l.seed,
            row_seeds: l.row_seeds,
            vocab_offset: l.vocab_offset,
            top_n: l.top_n,
            out_tokens: l.tokens,
            out_scores: l.scores,
            out_logits: l.logits,
            out_top: l.out_top,
            out_status: l.status,
            row_steps: 0,
        }
        .args();
        let stream = self.device.stream();
        let mut b = stream.launch_builder(func);
        push_args(&mut b, &args);
        // SAFETY: as for stage one, with the stage-three table (`FilterArgs`); lists, filters,
        // greedy flags and out_top are sized for this launch's batch, tiles and per_tile.
        unsafe { b.launch(cfg) }.map_err(drv("cuLaunchKernel(flashsample_filter)"))?;
        Ok(())
    }

    /// Waits for the stream, naming what was queued if it faulted.
    fn sync(&self, after: &'static str) -> Result<()> {
        self.device.stream().synchronize().map_err(|e| Error::Cuda(format!("cuStreamSynchronize after {after}: {}", super::device::driver_error_text(&e))))
    }

    pub fn sample(&self, hidden: &Tensor<'_>, weights: &Tensor<'_>, params: &SamplingParams<'_>, shape: Shape, config: &GpuConfig) -> Result<Samples> {
        let mut config = config.clone();
        let mut need = self.pipeline.list_capacity();
        loop {
            match self.sample_once(hidden, weights, params, shape, &config, need)? {
                Attempt::Done(s) => return Ok(s),
                Attempt::Overflow { row } => {
                    let exact = config.exact_lists(need);
                    if exact.list_per_tile <= config.list_per_tile {
                        // Cannot happen (whole-tile lists never overflow); never loop.
                        return Err(ListError::Overflow { row }.into());
                    }
                    config = exact;
                }
                Attempt::Nucleus { row } => {
                    if need >= MAX_LIST_CAPACITY {
                        return Err(ListError::NucleusTooLarge { row, capacity: need as usize }.into());
                    }
                    need = MAX_LIST_CAPACITY;
                    config = config.exact_lists(need);
                }
            }
        }
    }

    /// One launch of every stage with `config` and stage three merging `need` per row.
    fn sample_once(
        &self,
        hidden: &Tensor<'_>,
        weights: &Tensor<'_>,
        params: &SamplingParams<'_>,
        shape: Shape,
        config: &GpuConfig,
        need: u32,
    ) -> Result<Attempt> {
        let lse = self.launch_lse(params, shape.batch);
        let (config, kernel) = self.kernel_for_shape(config, shape, lse)?;
        let config = &config;
        let _guard = self.device.launch_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let l = self.prepare(&kernel, &mut scratch, hidden, std::slice::from_ref(weights), params, shape, config, need, lse)?;
        self.launch_stage1(&kernel, &l, 0)?;
        self.launch_stage2(&kernel, &l)?;
        self.launch_filter(&kernel, &l)?;
        let n = shape.batch * l.samples;
        let dev = &*self.device;
        let status: Vec<u32> = from_bytes(&scratch.status.download(dev, shape.batch * 4)?);
        let tokens: Vec<u32> = from_bytes(&scratch.tokens.download(dev, n * 4)?);
        let scores: Vec<f32> = from_bytes(&scratch.scores.download(dev, n * 4)?);
        let logits: Vec<f32> = from_bytes(&scratch.logits.download(dev, n * 4)?);
        let logsumexp = if l.out_lse != 0 {
            Some(from_bytes::<f32>(&scratch.out_lse.download(dev, shape.batch * 4)?))
        } else {
            None
        };
        let top_n = l.top_n as usize;
        let top: Option<Vec<Scored>> = if l.out_top != 0 {
            Some(from_bytes(&scratch.out_top.download(dev, shape.batch * top_n * std::mem::size_of::<Scored>())?))
        } else {
            None
        };
        self.sync("flashsample_stage1 + flashsample_stage2 + flashsample_filter")?;
        drop(l);
        // Stage-two errors of any row first (as the CPU's reduce), then the list statuses.
        let status = status
            .iter()
            .enumerate()
            .map(|(row, &code)| {
                RowStatus::from_code(code).ok_or_else(|| Error::Cuda(format!("the kernels wrote unknown status {code} for row {row}")))
            })
            .collect::<Result<Vec<RowStatus>>>()?;
        for (row, &s) in status.iter().enumerate() {
            match s {
                RowStatus::Ok | RowStatus::ListOverflow | RowStatus::NucleusTooLarge => {}
                RowStatus::AllMasked => return Err(RowError::AllMasked { row }.into()),
                RowStatus::NonFinite => return Err(RowError::NonFinite { row }.into()),
            }
        }
        if let Some(row) = status.iter().position(|&s| s == RowStatus::ListOverflow) {
            return Ok(Attempt::Overflow { row });
        }
        if let Some(row) = status.iter().position(|&s| s == RowStatus::NucleusTooLarge) {
            return Ok(Attempt::Nucleus { row });
        }
        let reduced = RowResult { tokens, scores, logits, logsumexp };
        let mut samples = Samples::from_reduced(&self.pipeline, shape.batch, reduced);
        samples.top_logprobs = top.map(|top| {
            top.chunks(top_n.max(1))
                .take(shape.batch)
                .map(|row| row.iter().take_while(|s| s.index != INDEX_NONE).map(|s| (s.index, s.logit)).collect())
                .collect()
        });
        Ok(Attempt::Done(samples))
    }

    /// Device time in seconds of stage one + stage two (+ stage three with lists), per launch, for `reps` launches after
    /// `warmup`, cycling through `weights` (rotating buffers keep the L2 cache from holding
    /// the weights between launches). Launches are queued back to back and bracketed by
    /// events, so host launch overhead is not part of the numbers.
    #[allow(clippy::too_many_arguments)]
    pub fn time(
        &self,
        hidden: &Tensor<'_>,
        weights: &[Tensor<'_>],
        params: &SamplingParams<'_>,
        shape: Shape,
        config: &GpuConfig,
        warmup: usize,
        reps: usize,
    ) -> Result<Vec<f64>> {
        self.warmed_up(hidden, weights, params, shape, config, warmup, |kernel, l| {
            let ctx = self.device.context();
            let stream = self.device.stream();
            let mut events = Vec::with_capacity(reps + 1);
            let new_event = || ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("cuEventCreate"));
            let first = new_event()?;
            first.record(stream).map_err(drv("cuEventRecord"))?;
            events.push(first);
            for i in 0..reps {
                self.launch_all(kernel, l, i)?;
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

    /// Compiles (or fetches) the launch's kernel, uploads its inputs under the launch lock, runs
    /// `warmup` complete launches and hands the prepared launch to `timed`.
    #[allow(clippy::too_many_arguments)]
    fn warmed_up<T>(
        &self,
        hidden: &Tensor<'_>,
        weights: &[Tensor<'_>],
        params: &SamplingParams<'_>,
        shape: Shape,
        config: &GpuConfig,
        warmup: usize,
        timed: impl FnOnce(&LoadedKernel, &Launch) -> Result<T>,
    ) -> Result<T> {
        if weights.is_empty() {
            return Err(Error::EmptyOperand("weights list"));
        }
        let lse = self.launch_lse(params, shape.batch);
        let (config, kernel) = self.kernel_for_shape(config, shape, lse)?;
        let config = &config;
        let _guard = self.device.launch_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let l = self.prepare(&kernel, &mut scratch, hidden, weights, params, shape, config, self.pipeline.list_capacity(), lse)?;
        for i in 0..warmup {
            self.launch_all(&kernel, &l, i)?;
        }
        self.sync("warm-up launches")?;
        timed(&kernel, &l)
    }

    /// Stages one, two and three of launch `i` (weights rotate through the prepared buffers).
    fn launch_all(&self, kernel: &LoadedKernel, l: &Launch, i: usize) -> Result<()> {
        self.launch_stage1(kernel, l, i % l.weights.len())?;
        self.launch_stage2(kernel, l)?;
        self.launch_filter(kernel, l)
    }

    /// Per-stage device time (seconds: stage one, stage two, stage three or 0) of each of
    /// `reps` launches after `warmup`, from events recorded between the kernels; as
    /// [`CudaBackend::time`] otherwise. The events add a little to the total.
    #[allow(clippy::too_many_arguments)]
    pub fn time_stages(
        &self,
        hidden: &Tensor<'_>,
        weights: &[Tensor<'_>],
        params: &SamplingParams<'_>,
        shape: Shape,
        config: &GpuConfig,
        warmup: usize,
        reps: usize,
    ) -> Result<Vec<[f64; 3]>> {
        self.warmed_up(hidden, weights, params, shape, config, warmup, |kernel, l| {
            let ctx = self.device.context();
            let stream = self.device.stream();
            let new_event = || ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("cuEventCreate"));
            let mut events = Vec::with_capacity(reps);
            for i in 0..reps {
                let e: Vec<_> = (0..4).map(|_| new_event()).collect::<Result<_>>()?;
                e[0].record(stream).map_err(drv("cuEventRecord"))?;
                self.launch_stage1(kernel, l, i % l.weights.len())?;
                e[1].record(stream).map_err(drv("cuEventRecord"))?;
                self.launch_stage2(kernel, l)?;
                e[2].record(stream).map_err(drv("cuEventRecord"))?;
                self.launch_filter(kernel, l)?;
                e[3].record(stream).map_err(drv("cuEventRecord"))?;
                events.push(e);
            }
            self.sync("timed launches")?;
            events
                .iter()
                .map(|e| {
                    let mut out = [0.0; 3];
                    for (k, o) in out.iter_mut().enumerate() {
                        *o = f64::from(e[k].elapsed_ms(&e[k + 1]).map_err(drv("cuEventElapsedTime"))?) * 1e-3;
                    }
                    Ok(out)
                })
                .collect()
        })
    }

    /// Runs stage one alone into a candidate buffer pre-filled with `poison` (and an LSE
    /// buffer of NaNs), and returns both buffers as written, for tests that check every slot.
    pub fn debug_stage1(
        &self,
        hidden: &Tensor<'_>,
        weights: &Tensor<'_>,
        params: &SamplingParams<'_>,
        shape: Shape,
        config: &GpuConfig,
        poison: Candidate,
    ) -> Result<(StageTwo, Vec<Candidate>, Option<Vec<LsePartial>>)> {
        // Always the variant with the logsumexp (the pipeline's full contract), so tests see
        // every partial.
        let lse = self.pipeline.needs_logsumexp();
        let (config, kernel) = self.kernel_for_shape(config, shape, lse)?;
        let config = &config;
        let _guard = self.device.launch_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let l = self.prepare(&kernel, &mut scratch, hidden, std::slice::from_ref(weights), params, shape, config, self.pipeline.list_capacity(), lse)?;
        let layout = StageTwo { batch: shape.batch, samples: l.samples, tiles: l.geometry.tiles };
        let dev = &*self.device;
        let cand_poison = vec![poison; layout.candidate_count()];
        scratch.candidates.upload(dev, bytemuck::cast_slice(&cand_poison))?;
        let lse_poison = vec![LsePartial { max: f32::NAN, sum: f32::NAN }; shape.batch * layout.tiles];
        if self.pipeline.needs_logsumexp() {
            scratch.lse.upload(dev, bytemuck::cast_slice(&lse_poison))?;
        }
        self.launch_stage1(&kernel, &l, 0)?;
        let cands: Vec<Candidate> =
            from_bytes(&scratch.candidates.download(dev, layout.candidate_count() * std::mem::size_of::<Candidate>())?);
        let lse = if self.pipeline.needs_logsumexp() {
            Some(from_bytes(&scratch.lse.download(dev, lse_poison.len() * std::mem::size_of::<LsePartial>())?))
        } else {
            None
        };
        self.sync("flashsample_stage1")?;
        Ok((layout, cands, lse))
    }

    /// Whether the kernel for `config` is loaded from the on-disk PTX cache (compiling or
    /// loading it now if needed).
    pub fn kernel_from_disk(&self, config: &GpuConfig) -> Result<bool> {
        Ok(self.kernel(config, self.pipeline.needs_logsumexp())?.from_disk)
    }
}
