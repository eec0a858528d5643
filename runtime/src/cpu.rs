//! The CPU device: Cranelift-JIT'd stage one, `abi::StageTwo` on the host.

use crate::{
    launch::{row_scratch_bytes, Shape, CHUNK_SCRATCH_BYTES},
    stage_three::{self, Captured, ListLength, ShortListGate, WholeRows},
    tensor::widen_to_f32,
    tuning::{self, DeviceIdentity, ShapeKey},
    Error, Result, Samples, Tensor,
};
use std::collections::HashMap;
use flashsample_abi::{Candidate, LsePartial, RowResult, RowStatus, RowSubset, SamplingParams, Scored, StageTwo, TopLists};
use flashsample_abi::rng::NoiseStream;
use flashsample_abi::speculative::RESIDUAL_EMPTY;
use flashsample_codegen_cpu::{CpuConfig, CpuEngine, CpuKernel, CpuLaunch, CpuRawOutputs, RankCounts, ResidualLists};
use flashsample_ir::Pipeline;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// A compiled kernel's config and whether it writes logsumexp partials.
type KernelKey = (CpuConfig, bool);

/// Compiled kernels a sampler keeps; the least recently used one is dropped past this. A
/// serving loop uses one or two per shape bucket (with and without the logsumexp).
pub(crate) const KERNEL_CACHE: usize = 8;

/// Entries of a launch's per-(row, tile) top lists, where the pipeline's capacity is larger.
/// A row inserts about `n·(1 + ln(T / n))` times into an `n`-entry list over a `T`-token tile
/// (~286 times at n = 64, T = 2048; ~94 at 16), and a list overflows only when 16 of the row's
/// top `capacity` tokens share one tile (capacity 50 over 75 tiles, tokens placed at random:
/// below 1e-14 a row); the overflowed rows then run again with lists of the capacity
/// (`ListError::Overflow`), and where overflows recur the next launches run longer lists
/// ([`ShortListGate`]).
pub(crate) const LIST_PER_TILE: usize = 16;

/// Shapes whose config a sampler remembers; past this the memo starts over (a lookup is cheap).
const CONFIG_MEMO: usize = 1024;

/// Forces the CPU engine for every pipeline it can run (`cranelift`, `avx512bf16`, `amx`); other
/// pipelines keep the Cranelift engine. For tests of the fallback path and A/B measurements.
pub(crate) const ENGINE_ENV: &str = "FLASHSAMPLE_CPU_ENGINE";

pub(crate) struct CpuBackend {
    pub(crate) pipeline: Arc<Pipeline>,
    threads: usize,
    /// Compiled kernels, most recently used first, at most [`KERNEL_CACHE`]. (A linear scan of
    /// eight keys; kernels share the process's thread pool, so dropping one frees only its code.)
    kernels: Mutex<Vec<(KernelKey, Arc<CpuKernel>)>>,
    /// Config per shape, so tuning files are read once per shape, not once per launch.
    configs: Mutex<HashMap<Shape, CpuConfig>>,
    /// Whether a launch starts on [`LIST_PER_TILE`]-entry lists or on lists of the capacity.
    short_lists: ShortListGate,
}

/// The engine [`ENGINE_ENV`] asks for, if set and valid (an invalid value warns once).
fn forced_engine() -> Option<CpuEngine> {
    let value = std::env::var(ENGINE_ENV).ok()?;
    match value.parse::<CpuEngine>() {
        Ok(engine) => Some(engine),
        Err(e) => {
            tuning::warn_once(&[format!("{ENGINE_ENV} ignored: {e}")]);
            None
        }
    }
}

impl CpuBackend {
    pub fn new(pipeline: Arc<Pipeline>, threads: usize) -> Self {
        CpuBackend { pipeline, threads, kernels: Mutex::new(Vec::new()), configs: Mutex::new(HashMap::new()), short_lists: ShortListGate::default() }
    }

    /// The engine for this pipeline: [`ENGINE_ENV`]'s if it can run it here, else the fastest
    /// one that can; Cranelift runs everything.
    pub fn engine(&self) -> CpuEngine {
        match forced_engine() {
            Some(e) if e.check(&self.pipeline).is_ok() => e,
            Some(_) => CpuEngine::Cranelift,
            None => CpuEngine::best_for(&self.pipeline),
        }
    }

    pub fn identity(&self) -> DeviceIdentity {
        DeviceIdentity::this_cpu(self.threads)
    }

    pub fn heuristic(&self, shape: Shape) -> CpuConfig {
        CpuConfig { threads: self.threads, ..CpuConfig::heuristic_for_engine(self.engine(), shape.batch, shape.dim, shape.vocab) }
    }

    pub fn config_for(&self, shape: Shape) -> CpuConfig {
        let mut configs = self.configs.lock().unwrap_or_else(|e| e.into_inner());
        if configs.len() >= CONFIG_MEMO && !configs.contains_key(&shape) {
            configs.clear();
        }
        configs
            .entry(shape)
            .or_insert_with(|| {
                let key = ShapeKey { dtype: self.pipeline.weights.dtype, vocab: shape.vocab, dim: shape.dim, batch: shape.batch };
                let found = tuning::lookup::<CpuConfig>(&self.identity(), &key);
                tuning::warn_once(&found.warnings);
                // A tuned entry runs on its own engine, unless the environment forces one, or
                // the entry's engine cannot run here (another CPU's file, another dtype).
                let forced = forced_engine().is_some();
                match found.config.filter(|c| c.validate().is_ok() && c.engine.check(&self.pipeline).is_ok() && !forced) {
                    Some(c) => CpuConfig { threads: self.threads, ..c },
                    None => self.heuristic(shape),
                }
            })
            .clone()
    }

    /// The kernel for `config`, with or without logsumexp partials (`logsumexp`).
    fn kernel(&self, config: &CpuConfig, logsumexp: bool) -> Result<Arc<CpuKernel>> {
        // A poisoned lock only means another thread panicked mid-insert; the Vec is still valid.
        let mut kernels = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
        let key = (config.clone(), logsumexp);
        if let Some(at) = kernels.iter().position(|(c, _)| *c == key) {
            let hit = kernels.remove(at);
            let k = hit.1.clone();
            kernels.insert(0, hit);
            return Ok(k);
        }
        let k = Arc::new(CpuKernel::compile_with(&self.pipeline, config, logsumexp)?);
        kernels.insert(0, (key, k.clone()));
        kernels.truncate(KERNEL_CACHE);
        Ok(k)
    }

    /// How many compiled kernels this backend holds (at most [`KERNEL_CACHE`]).
    #[cfg(test)]
    pub fn cached_kernels(&self) -> usize {
        self.kernels.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Stage one of one launch over `weights` (global vocabulary offset `offset`, which only
    /// shifts the returned token ids): the candidates, their layout and the lse partials.
    pub fn stage_one(
        &self,
        hidden_f32: &[f32],
        weights: &Tensor<'_>,
        params: &SamplingParams<'_>,
        allowed: Option<&[u32]>,
        shape: Shape,
        config: &CpuConfig,
    ) -> Result<StageOne> {
        self.stage_one_with_lists(hidden_f32, weights, params, allowed, shape, config, self.pipeline.list_capacity() as usize, Pass::Sample { ranks: None })
    }

    /// [`Self::stage_one`] with top lists of `per_tile` entries (at least the pipeline's
    /// capacity; whole tiles for the exact nucleus path), as `pass` asks.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn stage_one_with_lists(
        &self,
        hidden_f32: &[f32],
        weights: &Tensor<'_>,
        params: &SamplingParams<'_>,
        allowed: Option<&[u32]>,
        shape: Shape,
        config: &CpuConfig,
        per_tile: usize,
        pass: Pass<'_>,
    ) -> Result<StageOne> {
        let (residual, rank_thresholds, vocab_tiles) = match pass {
            Pass::Sample { ranks } => (None, ranks, None),
            Pass::Exact => (None, None, None),
            Pass::Verify(r) => (Some(r), None, None),
            Pass::TargetTile(t) => (None, None, Some(t..t + 1)),
        };
        let weight_bytes =
            weights.host_bytes().ok_or_else(|| Error::WrongDevice { tensor: weights.location(), sampler: "the CPU".into() })?;
        config.validate()?;
        // Filter pipelines need the row logsumexp only for some launches (lone top-p rows).
        let logsumexp = params.needs_logsumexp(&self.pipeline, shape.batch);
        let kernel = self.kernel(config, logsumexp)?;
        let p = &self.pipeline;
        let layout = StageTwo { batch: shape.batch, samples: p.samples_per_row() as usize, tiles: kernel.tiles(shape.vocab) };
        let temperatures = params.row_temperatures(p, shape.batch);
        // Poisoned, so a slot the kernel failed to write cannot pass for a sample.
        let mut candidates = vec![Candidate { score: f32::NAN, index: flashsample_abi::INDEX_NONFINITE, logit: f32::NAN }; layout.candidate_count()];
        let mut lse = logsumexp.then(|| vec![LsePartial { sums: [u64::MAX; 3], window: i32::MAX, pad: 0 }; shape.batch * layout.tiles]);
        let lists_layout = TopLists { batch: shape.batch, tiles: layout.tiles, per_tile };
        // The kernel inserts into the lists, so they start empty rather than poisoned.
        let mut lists = (lists_layout.per_tile > 0).then(|| vec![Scored::EMPTY; lists_layout.len()]);
        let penalties = params.penalty_table(shape.batch, shape.vocab);
        let logit_bias = params.logit_bias_table(shape.batch, shape.vocab);
        // A verifying kernel reads targets (the draft tokens) and keeps residual lists; a launch
        // that does not verify (the exact nucleus path's) gives them their neutral values.
        let verifying = p.verify.is_some();
        let no_targets = vec![0u32; shape.batch];
        let targets = match params.targets {
            Some(t) => Some(t),
            None => verifying.then_some(&no_targets[..]),
        };
        let token_streams = vec![NoiseStream::Token; shape.batch];
        let residual = verifying.then(|| residual.unwrap_or(ResidualPlan { streams: &token_streams, per_tile: 1 }));
        let mut residual_lists = residual.map(|r| vec![RESIDUAL_EMPTY; shape.batch * layout.tiles * r.per_tile]);
        // Poisoned, like the candidates: every row's target lies in exactly one tile.
        let mut target_logits = targets.map(|_| vec![f32::NAN; shape.batch]);
        let mut rank_counts = rank_thresholds.map(|_| vec![0u32; shape.batch * layout.tiles]);
        let mut raw = p.needs_raw_logsumexp().then(|| RawStageOne::buffers(p, lists_layout));
        let mut captured = match pass {
            Pass::Sample { .. } if p.list_capacity() > 0 => Captured::buffers(p, params, shape.batch, shape.vocab),
            _ => None,
        };
        kernel.launch(CpuLaunch {
            hidden: hidden_f32,
            weights: weight_bytes,
            batch: shape.batch,
            dim: shape.dim,
            vocab: shape.vocab,
            temperatures: &temperatures,
            filters: params.filter,
            bias: params.bias,
            allowed,
            seed: params.seed,
            row_seeds: params.row_seeds,
            row_steps: params.row_steps,
            vocab_offset: params.vocab_offset,
            row_offset: params.row_offset,
            penalties: penalties.as_ref(),
            logit_bias: logit_bias.as_ref(),
            targets: targets.zip(target_logits.as_deref_mut()),
            ranks: rank_thresholds.zip(rank_counts.as_deref_mut()).map(|(thresholds, counts)| RankCounts { thresholds, counts }),
            vocab_tiles,
            residual: residual.zip(residual_lists.as_deref_mut()).map(|(r, lists)| ResidualLists { streams: r.streams, lists }),
            lists: lists.as_deref_mut(),
            candidates: &mut candidates,
            lse: lse.as_deref_mut(),
            raw: raw.as_mut().map(|r| CpuRawOutputs {
                lse: &mut r.lse,
                lists: r.lists.as_mut().map(|(_, l)| &mut l[..]),
                list_raws: r.list_raws.as_deref_mut(),
            }),
            capture: captured.as_mut().map(Captured::launch),
        })?;
        let residual_lists = residual.zip(residual_lists).map(|(r, l)| (TopLists { per_tile: r.per_tile, ..lists_layout }, l));
        Ok(StageOne { layout, candidates, lse, lists: lists.map(|l| (lists_layout, l)), target_logits, rank_counts, residual_lists, raw, captured })
    }

    /// Samples every row; a row that cannot be sampled gets its error in
    /// [`Samples::row_errors`] and does not fail the others.
    ///
    /// A batch past [`chunk_rows`] runs as launches of consecutive row ranges, so its scratch
    /// (a candidate, partials and lists per (row, tile)) is one chunk's: scoring thousands of
    /// prompt positions needs O(rows) memory. Every output is batch invariant (DESIGN.md
    /// "Batch invariance") and a range keeps its rows' noise streams (its `row_offset`), so
    /// the rows' results are those of one launch.
    pub fn sample(
        &self,
        hidden: &Tensor<'_>,
        weights: &Tensor<'_>,
        params: &SamplingParams<'_>,
        shape: Shape,
        config: &CpuConfig,
    ) -> Result<Samples> {
        let hidden_f32 = host_f32(hidden)?;
        let p = &*self.pipeline;
        let chunk = chunk_rows(shape, config, p);
        let out = if shape.batch <= chunk {
            self.sample_rows(&hidden_f32, weights, params, shape, config, Thresholds::TargetTiles)?
        } else {
            let mut out: Option<RowsOut> = None;
            for first in (0..shape.batch).step_by(chunk) {
                let (h, subset, part_shape) = row_range(&hidden_f32, params, shape, first..(first + chunk).min(shape.batch));
                let part = self.sample_rows(h, weights, &subset.params(), part_shape, config, Thresholds::TargetTiles)?;
                match &mut out {
                    None => out = Some(part),
                    Some(o) => o.append(part),
                }
            }
            out.ok_or(Error::EmptyBatch)?
        };
        let capacity = p.list_capacity() as usize;
        let mut samples = Samples::from_reduced(p, shape.batch, out.reduced, &out.status, capacity, out.target_logprobs, out.target_ranks);
        samples.top_logprobs = out.top_logprobs;
        samples.list_reruns = out.list_reruns;
        Ok(samples)
    }

    /// [`CpuBackend::sample`] of one launch: everything `Samples` is assembled from. A ranking
    /// pipeline counts against `thresholds` (only tests give others than the launch's own).
    /// Short lists first (longer ones in a recurring overflow's holdoff, [`ShortListGate`]); the
    /// rows where one overflowed run again as a launch of their own with lists of the capacity,
    /// which cannot overflow (stage three merges at most `capacity` entries a row,
    /// `abi::filter::row_need`).
    fn sample_rows(
        &self,
        hidden_f32: &[f32],
        weights: &Tensor<'_>,
        params: &SamplingParams<'_>,
        shape: Shape,
        config: &CpuConfig,
        thresholds: Thresholds,
    ) -> Result<RowsOut> {
        let capacity = self.pipeline.list_capacity() as usize;
        let lists = if capacity > LIST_PER_TILE { self.short_lists.take() } else { ListLength::Exact };
        let per_tile = lists.per_tile(LIST_PER_TILE, capacity);
        let rerun_thresholds = thresholds.clone();
        let mut out = self.launch_rows(hidden_f32, weights, params, shape, config, thresholds, per_tile)?;
        if let (Some(rows), true) = (stage_three::overflowed_rows(&out.status), per_tile < capacity) {
            self.short_lists.overflowed(lists);
            let (h, subset, sub_shape) = row_range(hidden_f32, params, shape, rows.clone());
            let part = self.launch_rows(h, weights, &subset.params(), sub_shape, config, rerun_thresholds.rows(rows.clone()), capacity)?;
            out.overwrite(rows.start, self.pipeline.samples_per_row() as usize, part);
            out.list_reruns += rows.len();
        }
        Ok(out)
    }

    /// One launch of stage one with `per_tile` entries a list, and what follows it.
    #[allow(clippy::too_many_arguments)]
    fn launch_rows(
        &self,
        hidden_f32: &[f32],
        weights: &Tensor<'_>,
        params: &SamplingParams<'_>,
        shape: Shape,
        config: &CpuConfig,
        thresholds: Thresholds,
        per_tile: usize,
    ) -> Result<RowsOut> {
        // Step 7c: each row's target logit before the pass, so that the pass counts against it.
        let thresholds = match (self.pipeline.ranks_targets(), thresholds) {
            (false, _) => None,
            (true, Thresholds::TargetTiles) => Some(self.target_tile_logits(hidden_f32, weights, params, shape, config)?),
            #[cfg(test)]
            (true, Thresholds::Given(t)) => Some(t),
        };
        let allowed = params.allowed_bitset(shape.batch, shape.vocab);
        let ranks = thresholds.as_deref();
        let one = self.stage_one_with_lists(hidden_f32, weights, params, allowed.as_deref(), shape, config, per_tile, Pass::Sample { ranks })?;
        let (mut reduced, mut status) = one.layout.reduce_rows(&one.candidates, one.lse.as_deref());
        let raws = one.raw.as_ref().and_then(RawStageOne::list_raws);
        let mut top_logprobs = match &one.lists {
            Some((layout, lists)) => stage_three::finish(&self.pipeline, params, *layout, lists, raws, &mut reduced, &mut status),
            None => None,
        };
        let rows = stage_three::nucleus_rows(&status);
        if !rows.is_empty() {
            self.serve_exact(hidden_f32, weights, params, shape, &rows, one.captured.as_ref(), &mut reduced, &mut status)?;
        }
        if let Some(raw) = &one.raw {
            // Step 10: the filter is done with the processed logsumexp; every output now
            // reports the raw one (and the candidates already carry raw logits).
            let raw_lse: Vec<f32> = (0..shape.batch).map(|r| one.layout.logsumexp(&raw.lse, r)).collect();
            if let Some((layout, lists)) = &raw.lists {
                let n = self.pipeline.outputs.top_logprobs as usize;
                top_logprobs = Some(stage_three::raw_top_logprobs(*layout, lists, n, &raw_lse, &status));
            }
            reduced.logsumexp = Some(raw_lse);
        }
        // Step 7b: x − lse (`-inf − lse = -inf` for an excluded target).
        let target_logprobs = match (&one.target_logits, &reduced.logsumexp) {
            (Some(t), Some(lse)) => Some(t.iter().zip(lse).map(|(x, l)| x - l).collect()),
            _ => None,
        };
        // Step 7c: the pass counted each row's tokens at least as likely as its threshold. A
        // threshold is the row's target logit iff it has the pass's bits (batch invariance
        // says it always does); where one does not, a second pass counts against the pass's.
        let target_ranks = match (&one.target_logits, &thresholds) {
            (Some(t), Some(th)) => {
                let same = t.iter().zip(th).all(|(a, b)| a.to_bits() == b.to_bits());
                let counts = match same {
                    true => one.rank_counts,
                    false => {
                        let again = Pass::Sample { ranks: Some(t) };
                        self.stage_one_with_lists(hidden_f32, weights, params, allowed.as_deref(), shape, config, per_tile, again)?.rank_counts
                    }
                };
                let counts = counts.ok_or_else(|| Error::Unsupported("a ranking launch keeps counts".into()))?;
                Some(counts.chunks(one.layout.tiles.max(1)).map(|c| c.iter().sum()).collect())
            }
            _ => None,
        };
        Ok(RowsOut { reduced, status, top_logprobs, target_logprobs, target_ranks, list_reruns: 0 })
    }

    /// Serves `rows` (their top-p / min-p nucleus outgrew the lists) exactly
    /// ([`stage_three::finish_exact`]): from the launch's capture of their logits where it holds
    /// them, else by stage one again for those rows alone with lists that hold whole tiles (one
    /// more pass over the weights at that many rows).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn serve_exact(
        &self,
        hidden_f32: &[f32],
        weights: &Tensor<'_>,
        params: &SamplingParams<'_>,
        shape: Shape,
        rows: &[usize],
        captured: Option<&Captured>,
        reduced: &mut RowResult,
        status: &mut [RowStatus],
    ) -> Result<()> {
        // On the kernels' pool: the sort and the draw over a large nucleus run in parallel.
        let pool = flashsample_codegen_cpu::thread_pool(self.heuristic(shape).threads)?;
        let (held, rows): (Vec<usize>, Vec<usize>) = rows.iter().partition(|&&r| captured.is_some_and(|c| c.holds(r)));
        if let (Some(c), false) = (captured, held.is_empty()) {
            pool.install(|| stage_three::finish_exact(&self.pipeline, params, &held, WholeRows::Captured(c), reduced, status));
        }
        if rows.is_empty() {
            return Ok(());
        }
        let subset = params.select_rows(&rows, shape.vocab);
        let sub = subset.params();
        let hidden: Vec<f32> = rows.iter().flat_map(|&r| hidden_f32[r * shape.dim..][..shape.dim].iter().copied()).collect();
        let sub_shape = Shape { batch: rows.len(), ..shape };
        let config = self.whole_tile_config(sub_shape);
        let allowed = sub.allowed_bitset(sub_shape.batch, shape.vocab);
        let per_tile = config.vocab_tile as usize;
        let one = self.stage_one_with_lists(&hidden, weights, &sub, allowed.as_deref(), sub_shape, &config, per_tile, Pass::Exact)?;
        // Only pipelines with lists reach NucleusTooLarge; without lists the rows keep it.
        if let Some((layout, lists)) = &one.lists {
            let whole = WholeRows::Lists { layout: *layout, lists, raws: one.raw.as_ref().and_then(RawStageOne::list_raws) };
            pool.install(|| stage_three::finish_exact(&self.pipeline, params, &rows, whole, reduced, status));
        }
        Ok(())
    }

    /// Step 7c's thresholds: each row's target logit (raw in the raw mode), from stage one of
    /// the rows whose targets share a [`TARGET_TILE`]-token vocabulary tile over that tile
    /// alone. Batch invariance (DESIGN.md: the rows, the tile and the row block do not change
    /// a token's bits) makes them the bits of `config`'s launch of every row and tile;
    /// `sample_rows` checks that. Costs `TARGET_TILE` weight rows per distinct target tile.
    fn target_tile_logits(&self, hidden_f32: &[f32], weights: &Tensor<'_>, params: &SamplingParams<'_>, shape: Shape, config: &CpuConfig) -> Result<Vec<f32>> {
        let targets = params.targets.ok_or(flashsample_abi::ParamError::Missing("targets"))?;
        let targets = targets.get(..shape.batch).ok_or(flashsample_abi::ParamError::Length { what: "targets", expected: shape.batch, got: targets.len() })?;
        let config = CpuConfig { vocab_tile: TARGET_TILE as u32, ..config.clone() };
        let mut by_tile: std::collections::BTreeMap<usize, Vec<usize>> = std::collections::BTreeMap::new();
        for (row, &t) in targets.iter().enumerate() {
            by_tile.entry(t as usize / TARGET_TILE).or_default().push(row);
        }
        let per_tile = (self.pipeline.list_capacity() as usize).min(LIST_PER_TILE);
        let mut logits = vec![f32::NAN; shape.batch];
        for (tile, rows) in by_tile {
            let subset = params.select_rows(&rows, shape.vocab);
            let sub = subset.params();
            let hidden: Vec<f32> = rows.iter().flat_map(|&r| hidden_f32[r * shape.dim..][..shape.dim].iter().copied()).collect();
            let sub_shape = Shape { batch: rows.len(), ..shape };
            let allowed = sub.allowed_bitset(sub_shape.batch, shape.vocab);
            let one = self.stage_one_with_lists(&hidden, weights, &sub, allowed.as_deref(), sub_shape, &config, per_tile, Pass::TargetTile(tile))?;
            let tile_logits = one.target_logits.ok_or_else(|| Error::Unsupported("a scoring launch keeps its targets' logits".into()))?;
            for (&row, x) in rows.iter().zip(tile_logits) {
                logits[row] = x;
            }
        }
        Ok(logits)
    }

    /// The heuristic config for `shape` with a vocabulary tile that a list of
    /// `vocab_tile` entries holds whole (at least the pipeline's capacity, which the kernel
    /// requires of every list). Small: each token enters a sorted list, which costs its length.
    pub(crate) fn whole_tile_config(&self, shape: Shape) -> CpuConfig {
        let capacity = (self.pipeline.list_capacity() as usize).next_multiple_of(4);
        CpuConfig { vocab_tile: capacity.max(WHOLE_TILE) as u32, ..self.heuristic(shape) }
    }
}

/// What [`CpuBackend::sample`] assembles `Samples` from, for the rows of one launch.
struct RowsOut {
    reduced: RowResult,
    status: Vec<RowStatus>,
    top_logprobs: Option<Vec<Vec<(u32, f32)>>>,
    target_logprobs: Option<Vec<f32>>,
    target_ranks: Option<Vec<u32>>,
    /// Rows run again on longer lists (`Samples::list_reruns`).
    list_reruns: usize,
}

impl RowsOut {
    /// Writes `part`, the results of consecutive rows from `first` on (`samples` a row), over
    /// these rows' (the rows run again on longer lists).
    fn overwrite(&mut self, first: usize, samples: usize, part: RowsOut) {
        let rows = first..first + part.status.len();
        self.reduced.overwrite_rows(first, samples, part.reduced);
        self.status[rows.clone()].copy_from_slice(&part.status);
        if let (Some(a), Some(b)) = (&mut self.top_logprobs, part.top_logprobs) {
            a.splice(rows.clone(), b);
        }
        if let (Some(a), Some(b)) = (&mut self.target_logprobs, part.target_logprobs) {
            a[rows.clone()].copy_from_slice(&b);
        }
        if let (Some(a), Some(b)) = (&mut self.target_ranks, part.target_ranks) {
            a[rows].copy_from_slice(&b);
        }
    }

    /// Appends the next rows' results.
    fn append(&mut self, next: RowsOut) {
        let r = &mut self.reduced;
        r.tokens.extend(next.reduced.tokens);
        r.scores.extend(next.reduced.scores);
        r.logits.extend(next.reduced.logits);
        if let (Some(a), Some(b)) = (&mut r.logsumexp, next.reduced.logsumexp) {
            a.extend(b);
        }
        self.status.extend(next.status);
        if let (Some(a), Some(b)) = (&mut self.top_logprobs, next.top_logprobs) {
            a.extend(b);
        }
        if let (Some(a), Some(b)) = (&mut self.target_logprobs, next.target_logprobs) {
            a.extend(b);
        }
        if let (Some(a), Some(b)) = (&mut self.target_ranks, next.target_ranks) {
            a.extend(b);
        }
        self.list_reruns += next.list_reruns;
    }
}

/// Consecutive `rows` of a launch as a launch of their own: their hidden states, their
/// parameters ([`SamplingParams::select_rows`], which keeps a range's noise streams) and shape.
fn row_range<'h, 'p>(hidden_f32: &'h [f32], params: &SamplingParams<'p>, shape: Shape, rows: Range<usize>) -> (&'h [f32], RowSubset<'p>, Shape) {
    let picked: Vec<usize> = rows.clone().collect();
    let hidden = &hidden_f32[rows.start * shape.dim..][..rows.len() * shape.dim];
    (hidden, params.select_rows(&picked, shape.vocab), Shape { batch: rows.len(), ..shape })
}

/// Launches of up to this many rows run whole.
const CHUNK_MIN_ROWS: usize = 64;

/// Rows per launch of [`CpuBackend::sample`]'s row ranges: as many as [`CHUNK_SCRATCH_BYTES`]
/// of stage one's per-(row, tile) scratch ([`row_scratch_bytes`], with the logsumexp partials
/// and the pipeline's lists) hold, at least [`CHUNK_MIN_ROWS`].
fn chunk_rows(shape: Shape, config: &CpuConfig, p: &Pipeline) -> usize {
    let tiles = shape.vocab.div_ceil(config.vocab_tile.max(1) as usize);
    let row = row_scratch_bytes(p, tiles, p.list_capacity() as usize, true);
    (CHUNK_SCRATCH_BYTES / row.max(1)).max(CHUNK_MIN_ROWS)
}

/// Vocabulary tile of the launches that find step 7c's thresholds: each reads this many
/// weight rows per distinct target tile.
const TARGET_TILE: usize = 16;

/// Vocabulary tile of the exact nucleus path's stage one (unless the capacity is larger): the
/// whole-tile lists cost `vocab_tile` list moves per token.
const WHOLE_TILE: usize = 64;

/// What stage one left for stage two.
pub(crate) struct StageOne {
    pub layout: StageTwo,
    pub candidates: Vec<Candidate>,
    pub lse: Option<Vec<LsePartial>>,
    /// The per-tile top lists, iff the pipeline has a filter or top logprobs.
    pub lists: Option<(TopLists, Vec<Scored>)>,
    /// `[B]` the scored targets' transformed logits (raw in the raw mode), iff the pipeline
    /// has `target_logprob` (or verifies drafts: the draft tokens' logits).
    pub target_logits: Option<Vec<f32>>,
    /// `[B * tiles]` the per (row, tile) rank counts (DESIGN.md step 7c), iff the launch ranked.
    pub rank_counts: Option<Vec<u32>>,
    /// The residual lists (`Candidate`s in the `TopLists` layout), iff the pipeline verifies.
    pub residual_lists: Option<(TopLists, Vec<Candidate>)>,
    /// The raw logprob mode's partials and lists, iff `pipeline.needs_raw_logsumexp()`.
    pub raw: Option<RawStageOne>,
    /// The exact nucleus's capture, iff a sampling pass had rows whose nucleus may outgrow
    /// the lists.
    pub captured: Option<Captured>,
}

/// Where a ranking launch's thresholds (DESIGN.md step 7c) come from.
#[derive(Clone)]
pub(crate) enum Thresholds {
    /// [`CpuBackend::target_tile_logits`]: the launch's own bits.
    TargetTiles,
    /// Given: a test's thresholds that are not the launch's, which make it count again.
    #[cfg(test)]
    Given(Vec<f32>),
}

impl Thresholds {
    /// Those of consecutive `rows` of the launch, for those rows run as a launch of their own.
    #[cfg_attr(not(test), allow(unused_variables))]
    fn rows(self, rows: Range<usize>) -> Thresholds {
        match self {
            // The range's own bits, which batch invariance makes the whole launch's.
            Thresholds::TargetTiles => Thresholds::TargetTiles,
            #[cfg(test)]
            Thresholds::Given(t) => Thresholds::Given(t[rows].to_vec()),
        }
    }
}

/// What a stage-one launch is for.
#[derive(Clone, Copy)]
pub(crate) enum Pass<'a> {
    /// Sampling (and scoring): the pipeline's outputs, the capture of the rows whose nucleus
    /// may outgrow the lists ([`Captured`]), and with `ranks` (`[B]` each row's target logit)
    /// the counts of DESIGN.md step 7c.
    Sample { ranks: Option<&'a [f32]> },
    /// Sampling rows again with lists of whole tiles (the exact nucleus of rows the first
    /// pass did not capture): the outputs alone.
    Exact,
    /// Verifying drafts: also the residual lists.
    Verify(ResidualPlan<'a>),
    /// The targets' logits alone, by this one vocabulary tile (every row's target lies in it):
    /// the thresholds of step 7c.
    TargetTile(usize),
}

/// What a verifying launch asks of stage one: each row's noise stream and the entries of its
/// (row, tile) residual lists.
#[derive(Clone, Copy)]
pub(crate) struct ResidualPlan<'a> {
    pub streams: &'a [NoiseStream],
    pub per_tile: usize,
}

/// What stage one wrote for the raw logprob mode (DESIGN.md step 10).
pub(crate) struct RawStageOne {
    /// `[B * tiles]` partials of the raw logits.
    pub lse: Vec<LsePartial>,
    /// The top lists by raw logit, iff the top logprobs are raw.
    pub lists: Option<(TopLists, Vec<Scored>)>,
    /// Beside each processed list entry its raw logit, iff `Pipeline::lists_carry_raw`.
    pub list_raws: Option<Vec<f32>>,
}

impl RawStageOne {
    /// Fresh buffers for a launch whose processed lists have the layout `lists`.
    fn buffers(p: &Pipeline, lists: TopLists) -> RawStageOne {
        let raw_lists = TopLists { per_tile: p.raw_list_capacity() as usize, ..lists };
        RawStageOne {
            // Poisoned like the processed partials: every (row, tile) is written.
            lse: vec![LsePartial { sums: [u64::MAX; 3], window: i32::MAX, pad: 0 }; lists.batch * lists.tiles],
            lists: (raw_lists.per_tile > 0).then(|| (raw_lists, vec![Scored::EMPTY; raw_lists.len()])),
            list_raws: p.lists_carry_raw().then(|| vec![f32::NAN; lists.len()]),
        }
    }

    fn list_raws(&self) -> Option<stage_three::ListRaws<'_>> {
        self.list_raws.as_deref().map(stage_three::ListRaws)
    }
}

/// A host tensor's elements widened to f32 (the CPU kernel's hidden-state format).
pub(crate) fn host_f32(t: &Tensor<'_>) -> Result<Vec<f32>> {
    let bytes = t.host_bytes().ok_or_else(|| Error::WrongDevice { tensor: t.location(), sampler: "the CPU".into() })?;
    Ok(widen_to_f32(t.dtype, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashsample_ir::{DType, PipelineBuilder};

    #[test]
    fn the_kernel_cache_is_bounded_and_keeps_the_most_recently_used() {
        let pipeline = Arc::new(PipelineBuilder::new("P", DType::F32, DType::F32).build().unwrap());
        let backend = CpuBackend::new(pipeline, 1);
        let config = |tile: u32| CpuConfig { vocab_tile: tile, row_block: 1, threads: 1, engine: CpuEngine::Cranelift, noise_skip: Default::default() };
        let first = backend.kernel(&config(4), false).unwrap();
        let second = Arc::downgrade(&backend.kernel(&config(8), false).unwrap());
        for tile in 3..=KERNEL_CACHE as u32 + 1 {
            backend.kernel(&config(4 * tile), false).unwrap();
            // Touching the first keeps it the most recently used.
            assert!(Arc::ptr_eq(&first, &backend.kernel(&config(4), false).unwrap()));
            assert!(backend.cached_kernels() <= KERNEL_CACHE);
        }
        assert_eq!(backend.cached_kernels(), KERNEL_CACHE);
        assert!(second.upgrade().is_none(), "the least recently used kernel was dropped");
        assert!(Arc::ptr_eq(&first, &backend.kernel(&config(4), false).unwrap()));
    }

    /// Step 7c's thresholds are each row's target logit from a launch of its target's tile
    /// alone: they must be the bits the whole launch computes (batch invariance), on every
    /// engine the host runs, or the launch pays a second pass. Rows share tiles, a target
    /// sits in the last (partial) tile, one is masked (its logit `-inf`), and the transforms
    /// read per-token and per-row tables.
    #[test]
    fn target_tile_logits_are_the_bits_of_the_whole_launch() {
        use flashsample_ir::LogprobMode;
        let (batch, dim, vocab) = (9usize, 96usize, 1000usize);
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let hidden: Vec<half::bf16> = (0..batch * dim).map(|_| half::bf16::from_f32(next() * 4.0)).collect();
        let weights: Vec<half::bf16> = (0..vocab * dim).map(|_| half::bf16::from_f32(next())).collect();
        let hidden_f32: Vec<f32> = hidden.iter().map(|h| h.to_f32()).collect();
        let w = Tensor::host(&weights, vocab, dim).unwrap();
        let targets: Vec<u32> = vec![3, 5, 130, 999, 998, 640, 64, 65, 500];
        let temperatures: Vec<f32> = (0..batch).map(|r| 0.5 + r as f32 * 0.25).collect();
        let logit_bias: Vec<Vec<(u32, f32)>> = (0..batch).map(|r| vec![(targets[r], 1.5), (7, -2.0)]).collect();
        let mut mask = vec![u32::MAX; batch * vocab.div_ceil(32)];
        mask[2 * vocab.div_ceil(32) + 130 / 32] &= !(1 << (130 % 32));
        for mode in [LogprobMode::Processed, LogprobMode::Raw] {
            let pipeline = PipelineBuilder::new("Ranker", DType::BF16, DType::BF16)
                .logit_bias("logit_bias")
                .temperature_per_row("t")
                .mask("allowed")
                .softcap(25.0)
                .argmax()
                .target_logprob_and_rank("targets")
                .logprob_mode(mode)
                .build()
                .unwrap();
            let params = SamplingParams {
                temperature: flashsample_abi::TemperatureArg::PerRow(&temperatures),
                logit_bias: Some(&logit_bias),
                mask: Some(&mask),
                targets: Some(&targets),
                ..Default::default()
            };
            params.validate(&pipeline, batch, vocab).unwrap();
            let shape = Shape { batch, dim, vocab };
            let allowed = params.allowed_bitset(batch, vocab);
            for engine in CpuEngine::ALL {
                if let Some(missing) = engine.missing_host_feature() {
                    eprintln!("{engine:?} skipped: no {missing}");
                    continue;
                }
                engine.check(&pipeline).unwrap();
                let backend = CpuBackend::new(Arc::new(pipeline.clone()), 2);
                for (vocab_tile, row_block) in [(64, 2), (260, 3)] {
                    let config = CpuConfig { vocab_tile, row_block, threads: 2, engine, noise_skip: Default::default() };
                    let whole = backend.stage_one(&hidden_f32, &w, &params, allowed.as_deref(), shape, &config).unwrap();
                    let whole = whole.target_logits.unwrap();
                    let alone = backend.target_tile_logits(&hidden_f32, &w, &params, shape, &config).unwrap();
                    assert!(whole.iter().all(|x| !x.is_nan()));
                    // Raw logprobs are the model's: the mask does not reach them.
                    assert_eq!(whole[2] == f32::NEG_INFINITY, mode == LogprobMode::Processed, "{engine:?} {mode:?}: the masked target");
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&alone), bits(&whole), "{engine:?} {mode:?} tile {vocab_tile}");
                    // Thresholds that are not the launch's target logits make it count again
                    // against the launch's own: the same ranks.
                    let ranks = backend.sample_rows(&hidden_f32, &w, &params, shape, &config, Thresholds::TargetTiles).unwrap().target_ranks.unwrap();
                    let off: Vec<f32> = whole.iter().map(|&x| if x.is_finite() { x + 0.5 } else { 0.0 }).collect();
                    let again = backend.sample_rows(&hidden_f32, &w, &params, shape, &config, Thresholds::Given(off)).unwrap();
                    assert_eq!(again.target_ranks.unwrap(), ranks, "{engine:?} {mode:?} tile {vocab_tile}");
                    assert!(ranks.iter().all(|&k| (1..=vocab as u32).contains(&k)), "{ranks:?}");
                }
            }
        }
    }
}
