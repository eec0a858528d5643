use crate::config::{CpuConfig, CpuEngine, MAX_SCRATCH_BYTES};
use crate::lower::{self, LogitSource, LseSums, Plan};
use crate::tiles;
use crate::CpuCodegenError;
use cranelift_codegen::ir::{types, AbiParam, UserFuncName};
use cranelift_codegen::settings::{self, Configurable};
use cranelift_frontend::FunctionBuilderContext;
use cranelift_jit::{JITBuilder, JITModule};
use cranelift_module::{default_libcall_names, Linkage, Module};
use flashsample_abi::rng::{counter_word3, NoiseStream};
use flashsample_abi::RowFilter;
use flashsample_abi::speculative;
use flashsample_abi::{Candidate, LogitBiasTable, LsePartial, PenaltyTable, RowTokens, Scored, StageTwo};
use flashsample_ir::{DType, Pipeline};
use rayon::prelude::*;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

/// What the JIT'd function reads; every field is 8 bytes so the lowering's offsets are plain.
/// Pointers of inputs the pipeline does not declare are null and never read.
#[repr(C)]
pub(crate) struct KernelArgs {
    /// `[B, D]` f32 in the kernel's blocked layout (`hidden_blocks`).
    pub hidden: *const f32,
    pub weights: *const u8,
    /// `[B]`: `1 / T`, or 1 for greedy rows (so the multiply is the identity).
    pub row_scale: *const f32,
    /// `[B]`: 1 where the row takes its argmax (no noise): `T == 0`, or a filter that stage
    /// three draws from (`RowFilter::is_drawn_in_stage_three`).
    pub row_argmax: *const u32,
    pub bias: *const f32,
    pub allowed: *const u32,
    pub candidates: *mut Candidate,
    pub lse: *mut LsePartial,
    pub batch: u64,
    pub dim: u64,
    pub vocab: u64,
    pub tiles: u64,
    /// `[B]` Philox key and counter-row word of each row (`SamplingParams::row_stream`),
    /// padded with zeros to a multiple of 4 rows (like `row_word3`).
    pub row_keys: *const u64,
    pub row_counters: *const u32,
    /// `[B]` Philox counter word 3 of each row's token noise:
    /// `abi::rng::counter_word3(row_steps[r], NoiseStream::Token)`.
    pub row_word3: *const u32,
    /// `vocab_offset / 4`: the global quad index of local token 0.
    pub quad_offset: u64,
    /// Penalized-token bitset `[B, ceil(V/32)]`, the fast test; null without penalties.
    pub pen_bits: *const u32,
    /// What `penalize` reads; null without penalties.
    pub pen_table: *const PenaltyTable,
    pub penalize: ListedQuadFn<PenaltyTable>,
    /// `[B, tiles, per_tile]` top lists (heaps while the launch runs, sorted when it returns: `lists.rs`); null without lists.
    pub lists: *mut Scored,
    pub per_tile: u64,
    pub insert: InsertFn,
    /// Logit-biased-token bitset `[B, ceil(V/32)]`, the fast test; null without a logit bias.
    pub lb_bits: *const u32,
    /// What `add_logit_bias` reads; null without a logit bias.
    pub lb_table: *const LogitBiasTable,
    pub add_logit_bias: ListedQuadFn<LogitBiasTable>,
    /// `[B]` the token each row scores and `[B]` its transformed logit, written by the tile
    /// holding it (`-inf` when excluded); null without `target_logprob`.
    pub targets: *const u32,
    pub target_logits: *mut f32,
    /// DESIGN.md step 7c: `[B]` each row's threshold (its target's logit, known before the
    /// launch) and `[B * tiles]` per (row, tile) counts of the tokens whose logit is at least
    /// it, both null unless the launch ranks (`target_logprob(.., rank)`).
    pub rank_thresholds: *const f32,
    pub rank_counts: *mut u32,
    /// `[B, S]` per (row, sample) the best score a finished tile of this launch reached (f32
    /// bits, `-inf` at the start; `publish_row_bounds` raises it): the noise skips' cross-tile
    /// bound. Null unless the plan reads it (`Plan::row_bounds`). The JIT'd code reads this
    /// and the list bounds with plain aligned 32-bit loads, single-copy atomic on the 64-bit
    /// hosts Cranelift targets; any value it sees is a valid (possibly older) bound.
    pub row_bounds: *const AtomicU32,
    pub samples: u64,
    /// The processed lists' list bound (`Plan::list_bounds`), and the raw lists'
    /// (`Plan::raw_list_bounds`): [`ListBoundArgs`].
    pub list_bound: ListBoundArgs,
    pub raw_list_bound: ListBoundArgs,
    /// `[B, tiles, residual_per_tile]` residual lists sorted by score; null unless verifying.
    pub residual_lists: *mut Candidate,
    pub residual_per_tile: u64,
    pub insert_residual: InsertFn<Candidate>,
    /// The raw logprob mode (DESIGN.md step 10); null / 0 without it. `[B * tiles]` partials
    /// of the raw logits over every token.
    pub raw_lse: *mut LsePartial,
    /// `[B, tiles, raw_per_tile]` top lists by raw logit; null without raw top logprobs.
    pub raw_lists: *mut Scored,
    pub raw_per_tile: u64,
    /// Parallel to `lists`: each entry's raw logit; null unless `Pipeline::lists_carry_raw`.
    pub list_raws: *mut f32,
    pub insert_paired: InsertPairedFn,
    /// The exact nucleus's capture (`CpuLaunch::capture`): `[B]` each row's slot
    /// (`CAPTURE_NONE` for none), `[slots, capture_stride]` the captured rows' eligible
    /// logits and, in the raw mode, their raw logits; null without a capture.
    pub capture_slots: *const u32,
    pub capture_logits: *mut f32,
    pub capture_raws: *mut f32,
    pub capture_stride: u64,
}

/// One list kind's cross-tile bound in a launch (DESIGN.md step 6b's CPU paragraph).
#[repr(C)]
pub(crate) struct ListBoundArgs {
    /// `[B]` per row a value no token of the row's top `need` lies below (f32 bits, `-inf` at
    /// the start): the `need`-th best logit of the entries the finished tiles' lists of this
    /// kind hold (`tops`, raised by `publish_list_bounds`). The kind's gate skips quads below
    /// it. Null unless the plan reads it; all `-inf` where the launch's lists hold whole tiles
    /// (the exact rerun needs every token).
    pub bounds: *const AtomicU32,
    /// `[B]` the `need` best logits of the finished tiles' lists so far, descending; null when
    /// nothing publishes.
    pub tops: *const Mutex<Vec<f32>>,
    /// Entries stage three merges per row: at least `max(per_tile, the kind's capacity)`.
    pub need: u64,
}

/// What a launch holds for one list kind's [`ListBoundArgs`].
struct ListBound {
    bounds: Vec<AtomicU32>,
    tops: Vec<Mutex<Vec<f32>>>,
    need: usize,
}

impl ListBound {
    /// The state for `batch` rows of lists `per_tile` long (0: none) over `vocab_tile`-token
    /// tiles, `reads` when the kernel's gate reads the bound: it starts at `-inf` and rises
    /// only where the lists are shorter than a tile.
    fn new(reads: bool, batch: usize, per_tile: usize, vocab_tile: usize, capacity: usize) -> ListBound {
        let need = per_tile.max(capacity);
        let publishes = reads && per_tile > 0 && per_tile < vocab_tile;
        let tops = if publishes { (0..batch).map(|_| Mutex::new(Vec::with_capacity(need + per_tile))).collect() } else { Vec::new() };
        ListBound { bounds: unreached_bounds(reads, batch), tops, need }
    }

    fn args(&self) -> ListBoundArgs {
        ListBoundArgs { bounds: ptr_or_null(&self.bounds), tops: ptr_or_null(&self.tops), need: self.need as u64 }
    }
}

/// `n` bounds that nothing has reached yet (`-inf`), or none when the kernel reads no bound.
fn unreached_bounds(reads: bool, n: usize) -> Vec<AtomicU32> {
    if reads {
        (0..n).map(|_| AtomicU32::new(f32::NEG_INFINITY.to_bits())).collect()
    } else {
        Vec::new()
    }
}

/// A launch buffer's pointer for `KernelArgs`: null for an empty one (one the kernel does not read).
fn ptr_or_null<T>(v: &[T]) -> *const T {
    if v.is_empty() {
        std::ptr::null()
    } else {
        v.as_ptr()
    }
}

/// Applies a per-row token table (penalties, logit bias) to the listed tokens among a quad's
/// four logits, in place. Called only for quads whose bitset test says some token is listed
/// (a few per row and launch).
pub(crate) type ListedQuadFn<T> = unsafe extern "C" fn(table: *const T, row: u64, v: u64, x: *mut f32);
/// Inserts the quad's eligible tokens (`x > -inf`) into a (row, tile) list. Called only when
/// the quad's best beats the list's bar: the entry that ranks last (a top list's heap root,
/// `lists.rs`; a residual list's last entry).
pub(crate) type InsertFn<T = Scored> = unsafe extern "C" fn(list: *mut T, per_tile: u64, v: u64, x: *const f32);

/// [`InsertFn`] for lists that carry each entry's raw logit in `raws` (the same slots): `x`
/// points to the quad's 4 processed logits, then its 4 raw ones (`lists::insert_quad_paired`,
/// the heap form of `abi::raw::insert_paired`).
pub(crate) type InsertPairedFn = unsafe extern "C" fn(list: *mut Scored, raws: *mut f32, per_tile: u64, v: u64, x: *const f32);

/// A per-row token table the epilogue applies out of line: its tokens and what it does to a
/// listed token's logit.
pub(crate) trait ListedTable {
    fn listed(&self) -> &RowTokens;
    /// The new value of `x` for token `v` of `row` (`x` if `v` is not listed).
    fn apply(&self, row: usize, v: u32, x: f32) -> f32;
}

impl ListedTable for PenaltyTable {
    fn listed(&self) -> &RowTokens {
        &self.listed
    }
    fn apply(&self, row: usize, v: u32, x: f32) -> f32 {
        PenaltyTable::apply(self, row, v, x)
    }
}

impl ListedTable for LogitBiasTable {
    fn listed(&self) -> &RowTokens {
        &self.listed
    }
    fn apply(&self, row: usize, v: u32, x: f32) -> f32 {
        LogitBiasTable::apply(self, row, v, x)
    }
}

/// SAFETY (caller): `table` is a live table for this launch's shape, `x` points to 4 floats,
/// `v + 3` may pass the vocabulary (those lanes are never listed: the bitset's padding is 0).
unsafe extern "C" fn apply_quad<T: ListedTable>(table: *const T, row: u64, v: u64, x: *mut f32) {
    let (table, x) = unsafe { (&*table, std::slice::from_raw_parts_mut(x, 4)) };
    for (j, xj) in x.iter_mut().enumerate() {
        *xj = table.apply(row as usize, v as u32 + j as u32, *xj);
    }
}

/// A launch's table of kind `T` after its layout was checked for the shape.
fn checked_table<'t, T: ListedTable>(
    declared: bool,
    table: Option<&'t T>,
    what: &'static str,
    values: impl Fn(&T) -> usize,
    batch: usize,
    vocab: usize,
) -> Result<Option<&'t T>, CpuCodegenError> {
    match (declared, table) {
        (true, Some(t)) => {
            t.listed().check(batch, vocab, values(t)).map_err(|e| CpuCodegenError::BadArgument(format!("{what}: {e}")))?;
            Ok(Some(t))
        }
        (true, None) => Err(CpuCodegenError::Missing(what)),
        (false, Some(_)) => Err(CpuCodegenError::Unexpected(what)),
        (false, None) => Ok(None),
    }
}

/// SAFETY (caller): `list` points to `per_tile` entries sorted by score, `lanes` to 8 floats:
/// the quad's 4 scores (`-inf` for lanes that are masked or past the vocabulary), then its 4
/// transformed logits.
unsafe extern "C" fn insert_residual_quad(list: *mut Candidate, per_tile: u64, v: u64, lanes: *const f32) {
    let (list, lanes) = unsafe { (std::slice::from_raw_parts_mut(list, per_tile as usize), std::slice::from_raw_parts(lanes, 8)) };
    for j in 0..4 {
        if lanes[j] > f32::NEG_INFINITY {
            speculative::insert_residual(list, Candidate { score: lanes[j], index: v as u32 + j as u32, logit: lanes[4 + j] });
        }
    }
}

type FusedFn = unsafe extern "C" fn(args: *const KernelArgs, tile_begin: u64, tile_end: u64);
/// [`LogitSource::Scratch`]: the epilogue of one tile whose logits are in `scratch`.
type ScratchFn = unsafe extern "C" fn(args: *const KernelArgs, tile_begin: u64, tile_end: u64, scratch: *mut f32);

/// The JIT'd function, by where its logits come from.
#[derive(Clone, Copy)]
enum Entry {
    Fused(FusedFn),
    Scratch { epilogue: ScratchFn, engine: tiles::MatrixEngine },
}

/// The args shared by the worker threads of one launch.
struct SharedArgs(*const KernelArgs);
// SAFETY: the kernel only reads through the input pointers, and concurrent calls write
// disjoint candidate and lse slots (each tile belongs to exactly one call).
unsafe impl Sync for SharedArgs {}
unsafe impl Send for SharedArgs {}
impl SharedArgs {
    fn get(&self) -> *const KernelArgs {
        self.0
    }
}

/// Owns the JIT'd code; frees it when the kernel is dropped.
struct JitCode(Option<JITModule>);
// SAFETY: after finalization the module is never touched again except to free it, and the
// code it holds is immutable.
unsafe impl Send for JitCode {}
unsafe impl Sync for JitCode {}
impl Drop for JitCode {
    fn drop(&mut self) {
        if let Some(module) = self.0.take() {
            // SAFETY: the only pointer into this code is `CpuKernel::entry`, dropped with it.
            unsafe { module.free_memory() };
        }
    }
}

/// The inputs and outputs of one stage-one launch (see DESIGN.md, "CPU stage one").
pub struct CpuLaunch<'a> {
    /// `[batch, dim]`, already widened to f32 by the runtime.
    pub hidden: &'a [f32],
    /// `[vocab, dim]` raw little-endian elements of `pipeline.weights.dtype`.
    pub weights: &'a [u8],
    /// Rows.
    pub batch: usize,
    /// Hidden size.
    pub dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// `[batch]` effective temperatures (`SamplingParams::row_temperatures`).
    pub temperatures: &'a [f32],
    /// `[batch]` iff the pipeline filters (`SamplingParams::filter`): a sampled row whose filter
    /// is not OFF draws no noise, its candidates are its argmax (stage three draws its sample).
    pub filters: Option<&'a [RowFilter]>,
    /// `[vocab]`.
    pub bias: Option<&'a [f32]>,
    /// `[batch, ceil(vocab / 32)]` allowed-token bitset.
    pub allowed: Option<&'a [u32]>,
    /// The launch's Philox key (rows without their own seed).
    pub seed: u64,
    /// `[batch]` per-row seeds: row `r` draws `noise_bits(row_seeds[r], 0, s, v, step)` instead
    /// of `noise_bits(seed, r, s, v, step)`.
    pub row_seeds: Option<&'a [u64]>,
    /// `[batch]` per-row decode steps (`SamplingParams::row_steps`); `None` = step 0 for all.
    pub row_steps: Option<&'a [u32]>,
    /// Global index of token 0 (a multiple of 4): noise is drawn at `v + vocab_offset`.
    pub vocab_offset: u32,
    /// Launch row of row 0 (`SamplingParams::row_offset`): a row without its own seed draws
    /// counter row `row_offset + r`.
    pub row_offset: u32,
    /// iff the pipeline has a `penalties` transform (`SamplingParams::penalty_table`).
    pub penalties: Option<&'a PenaltyTable>,
    /// iff the pipeline has a `logit_bias` transform (`SamplingParams::logit_bias_table`).
    pub logit_bias: Option<&'a LogitBiasTable>,
    /// `[batch]` tokens to score (each `< vocab`) and `[batch]` where their transformed logits
    /// go (`-inf` for an excluded target), iff the pipeline has `target_logprob`.
    pub targets: Option<(&'a [u32], &'a mut [f32])>,
    /// The ranks (DESIGN.md step 7c), only for a pipeline that ranks its targets: each row's
    /// threshold and the counts against it, besides every other output.
    pub ranks: Option<RankCounts<'a>>,
    /// Only these vocabulary tiles run (`None`: all of them); the other tiles' slots of every
    /// output are left as given. The ranks' thresholds are a launch of each target's tile.
    pub vocab_tiles: Option<std::ops::Range<usize>>,
    /// `[batch, tiles, per_tile]` iff `pipeline.list_capacity() > 0`, any `per_tile >= 1`:
    /// shorter than the capacity, a tile's list may drop a token of the row's top `capacity`,
    /// which stage three's merge reports (`abi::ListError::Overflow`); the runtime's exact
    /// nucleus path lists whole tiles. The kernel inserts into it, so the caller fills it with
    /// `Scored::EMPTY`.
    pub lists: Option<&'a mut [Scored]>,
    /// iff the pipeline verifies drafts (`Pipeline::verify`; its targets are the draft tokens).
    pub residual: Option<ResidualLists<'a>>,
    /// `StageTwo { batch, samples, tiles }.candidate_count()` slots.
    pub candidates: &'a mut [Candidate],
    /// `[batch * tiles]`, iff the kernel was compiled with the logsumexp (`CpuKernel::logsumexp`).
    pub lse: Option<&'a mut [LsePartial]>,
    /// The raw logprob mode's outputs, iff `pipeline.needs_raw_logsumexp()`. In that mode the
    /// candidates carry the raw logit and `targets` receive the raw logits.
    pub raw: Option<CpuRawOutputs<'a>>,
    /// Rows whose whole row of logits the launch keeps (only for a pipeline with lists).
    pub capture: Option<Capture<'a>>,
}

/// What a ranking launch counts (DESIGN.md step 7c).
pub struct RankCounts<'a> {
    /// `[batch]` each row's target logit (raw in the raw mode), the bits this launch computes
    /// for it: a token counts iff its logit is at least this.
    pub thresholds: &'a [f32],
    /// `[batch * tiles]` zeroed per (row, tile) counts.
    pub counts: &'a mut [u32],
}

/// A row slot of [`Capture::slots`] that captures nothing.
pub const CAPTURE_NONE: u32 = u32::MAX;

/// The exact nucleus's capture (DESIGN.md step 9): a row whose top-p / min-p nucleus may
/// outgrow the lists keeps every token's eligible logit (`-inf` when excluded), so that serving
/// it exactly needs no second pass over the weights. The logits are the ones the launch's
/// lists, logsumexp and argmax read, so the cut sees the same bits.
pub struct Capture<'a> {
    /// `[batch]`: row `r`'s slot in `logits`, or [`CAPTURE_NONE`].
    pub slots: &'a [u32],
    /// `[slots, capture_stride(vocab)]`: each captured row's eligible logits.
    pub logits: &'a mut [f32],
    /// Parallel to `logits`: the raw logits, iff `pipeline.lists_carry_raw()` (the drawn
    /// token's raw logit is reported).
    pub raws: Option<&'a mut [f32]>,
}

/// Floats per captured row: the vocabulary rounded up to whole quads (the kernel stores quads).
pub fn capture_stride(vocab: usize) -> usize {
    vocab.next_multiple_of(4)
}

/// What stage one writes for the raw logprob mode (DESIGN.md step 10, `abi::raw`).
pub struct CpuRawOutputs<'a> {
    /// `[batch * tiles]` partials of the raw logits over every token.
    pub lse: &'a mut [LsePartial],
    /// `[batch, tiles, per_tile >= raw_list_capacity()]` top lists by raw logit, iff
    /// `pipeline.raw_list_capacity() > 0`, filled with `Scored::EMPTY` by the caller.
    pub lists: Option<&'a mut [Scored]>,
    /// Parallel to `CpuLaunch::lists`: the raw logit of each entry, iff
    /// `pipeline.lists_carry_raw()` (any initial values; an empty entry's is meaningless).
    pub list_raws: Option<&'a mut [f32]>,
}

/// Speculative verification's stage-one extras: which noise each row draws and where each
/// (row, tile) keeps its best tokens by that noise's perturbed score.
pub struct ResidualLists<'a> {
    /// `[batch]` the noise stream of each row's candidate and residual list:
    /// `NoiseStream::SpecResidual` for a draft row, `Token` for a bonus row (its ordinary sample).
    pub streams: &'a [NoiseStream],
    /// `[batch, tiles, per_tile ≥ 1]` lists sorted by score, pre-filled with
    /// `abi::speculative::RESIDUAL_EMPTY` (`per_tile` = the launch's choice: whole tiles list
    /// every eligible token).
    pub lists: &'a mut [Candidate],
}

/// A compiled stage-one kernel for one pipeline and config. Its launches run on the process's
/// shared pool for `config.threads` ([`crate::thread_pool`]), not on a pool of its own.
pub struct CpuKernel {
    entry: Entry,
    clif: String,
    pipeline: Pipeline,
    config: CpuConfig,
    /// Whether the kernel writes logsumexp partials (and so takes an `lse` buffer).
    logsumexp: bool,
    /// Who sums this kernel's partials ([`LseSums::ScratchPass`]: `lse_pass` after each
    /// tile's epilogue).
    lse_sums: LseSums,
    /// Whether its noise skips read `KernelArgs::row_bounds` (`Plan::row_bounds`).
    row_bounds: bool,
    /// Whether its list gates read `KernelArgs::list_bound` / `raw_list_bound`
    /// (`Plan::list_bounds`, `Plan::raw_list_bounds`).
    list_bounds: bool,
    raw_list_bounds: bool,
    pool: std::sync::Arc<rayon::ThreadPool>,
    _code: JitCode,
}

impl std::fmt::Debug for CpuKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuKernel").field("pipeline", &self.pipeline.name).field("config", &self.config).finish()
    }
}

fn compile_error(e: impl std::fmt::Debug) -> CpuCodegenError {
    CpuCodegenError::Compile(format!("{e:?}"))
}

fn check_host() -> Result<(), CpuCodegenError> {
    #[cfg(target_arch = "x86_64")]
    {
        // Cranelift lowers `fma` to a libcall and `nearest`/`insertlane` to slow paths without these.
        if !std::is_x86_feature_detected!("fma") {
            return Err(CpuCodegenError::MissingHostFeature("fma"));
        }
        if !std::is_x86_feature_detected!("sse4.1") {
            return Err(CpuCodegenError::MissingHostFeature("sse4.1"));
        }
    }
    Ok(())
}

impl CpuKernel {
    /// Lowers and JITs the stage-one kernel of `pipeline` for `config`.
    pub fn compile(pipeline: &Pipeline, config: &CpuConfig) -> Result<CpuKernel, CpuCodegenError> {
        Self::compile_with(pipeline, config, pipeline.needs_logsumexp())
    }

    /// [`CpuKernel::compile`], choosing whether the kernel writes logsumexp partials. A filter
    /// pipeline needs them only for rows with a lone top-p (`SamplingParams::needs_logsumexp`),
    /// and they are most of a filtered launch's extra cost, so the runtime compiles both.
    pub fn compile_with(pipeline: &Pipeline, config: &CpuConfig, logsumexp: bool) -> Result<CpuKernel, CpuCodegenError> {
        pipeline.validate()?;
        if !logsumexp && pipeline.logprob_mode.is_processed() && pipeline.reports_logprobs() {
            return Err(CpuCodegenError::BadArgument("the pipeline outputs need the logsumexp".into()));
        }
        config.validate()?;
        check_host()?;
        config.engine.check(pipeline)?;
        // The scratch engines' partials come from `lse_pass` where the host has its vectors.
        let raw_lse = pipeline.needs_raw_logsumexp();
        let source = match config.engine {
            CpuEngine::Cranelift => LogitSource::Fused,
            CpuEngine::Avx512Bf16 | CpuEngine::AmxBf16 => LogitSource::Scratch {
                lse: if (logsumexp || raw_lse) && crate::lse_pass::available() { LseSums::ScratchPass } else { LseSums::Epilogue },
            },
        };

        let mut flags = settings::builder();
        for (name, value) in [("opt_level", "speed"), ("use_colocated_libcalls", "false"), ("is_pic", "false")] {
            flags.set(name, value).map_err(compile_error)?;
        }
        #[allow(unused_mut)]
        let mut isa_builder = cranelift_native::builder().map_err(|msg| CpuCodegenError::UnsupportedHost(msg.to_string()))?;
        // With AVX-512 DQ and VL, Cranelift lowers every i64x2 multiply to `vpmullq` (3 uops),
        // ahead of its `pmuludq` rule for the 32 × 32 → 64-bit widening multiplies that
        // Philox's rounds are (`math::mul_hi_lo`). The epilogue uses no other DQ instruction;
        // without it a launch at D = 1024 ran 15–18 % faster from B = 16 (BENCHMARKS.md, CPU
        // 2026-12-06 ninth session), the same bits.
        #[cfg(target_arch = "x86_64")]
        isa_builder.set("has_avx512dq", "false").map_err(compile_error)?;
        let isa = isa_builder
            .finish(settings::Flags::new(flags))
            .map_err(compile_error)?;
        let mut module = JITModule::new(JITBuilder::with_isa(isa, default_libcall_names()));
        if module.target_config().pointer_type() != types::I64 {
            return Err(CpuCodegenError::UnsupportedHost("the kernel needs 64-bit pointers".into()));
        }

        let mut sig = module.make_signature();
        let params = match source {
            LogitSource::Fused => 3,
            LogitSource::Scratch { .. } => 4,
        };
        sig.params.extend(std::iter::repeat_n(AbiParam::new(types::I64), params));
        let id = module.declare_function("flashsample_stage1", Linkage::Local, &sig).map_err(compile_error)?;
        let mut ctx = module.make_context();
        ctx.func.signature = sig;
        ctx.func.name = UserFuncName::user(0, id.as_u32());
        let plan = Plan { needs_lse: logsumexp, logits: source, noise_skip: config.noise_skip, ..Plan::new(pipeline, config.row_block, config.vocab_tile) };
        let lse_sums = plan.lse_sums();
        let row_bounds = plan.row_bounds();
        let list_bounds = plan.list_bounds();
        let raw_list_bounds = plan.raw_list_bounds();
        let mut fctx = FunctionBuilderContext::new();
        lower::build(&mut ctx.func, &mut fctx, &plan, module.target_config());
        let clif = ctx.func.display().to_string();
        module.define_function(id, &mut ctx).map_err(compile_error)?;
        module.clear_context(&mut ctx);
        module.finalize_definitions().map_err(compile_error)?;
        let code = module.get_finalized_function(id);
        // SAFETY: the function was declared with this signature in the default (C) call convention.
        let entry = unsafe {
            match source {
                LogitSource::Fused => Entry::Fused(std::mem::transmute::<*const u8, FusedFn>(code)),
                LogitSource::Scratch { .. } => Entry::Scratch {
                    epilogue: std::mem::transmute::<*const u8, ScratchFn>(code),
                    engine: tiles::for_engine(config.engine)
                        .ok_or(CpuCodegenError::MissingHostFeature("the engine's instructions"))?,
                },
            }
        };
        let pool = crate::pool::thread_pool(config.threads)?;
        Ok(CpuKernel {
            entry,
            clif,
            logsumexp,
            lse_sums,
            row_bounds,
            list_bounds,
            raw_list_bounds,
            pipeline: pipeline.clone(),
            config: config.clone(),
            pool,
            _code: JitCode(Some(module)),
        })
    }

    /// Whether this kernel writes logsumexp partials.
    pub fn logsumexp(&self) -> bool {
        self.logsumexp
    }

    /// The kernel's Cranelift IR text as built, before Cranelift's optimizations.
    pub fn clif(&self) -> &str {
        &self.clif
    }

    /// The config it was compiled for.
    pub fn config(&self) -> &CpuConfig {
        &self.config
    }

    /// The pipeline it was compiled from.
    pub fn pipeline(&self) -> &Pipeline {
        &self.pipeline
    }

    /// Vocab tiles covering `vocab` tokens.
    pub fn tiles(&self, vocab: usize) -> usize {
        StageTwo::tiles_for(vocab, self.config.vocab_tile as usize)
    }

    /// Runs stage one over all tiles on the kernel's thread pool.
    pub fn launch(&self, a: CpuLaunch<'_>) -> Result<(), CpuCodegenError> {
        let p = &self.pipeline;
        // Token and row indices travel as u32 (the candidate index, the Philox counter).
        if a.vocab > INDEX_LIMIT {
            return Err(CpuCodegenError::TooLarge { what: "vocab", value: a.vocab, max: INDEX_LIMIT });
        }
        if a.batch > u32::MAX as usize {
            return Err(CpuCodegenError::TooLarge { what: "batch", value: a.batch, max: u32::MAX as usize });
        }
        let esize = p.weights.dtype.size_bytes();
        let hidden_len = checked(a.batch, a.dim, "hidden")?;
        let weights_len = checked(checked(a.vocab, a.dim, "weights")?, esize, "weights")?;
        expect_len("hidden", a.hidden.len(), hidden_len)?;
        expect_len("weights", a.weights.len(), weights_len)?;
        expect_len("temperatures", a.temperatures.len(), a.batch)?;
        match (p.filter_max_k().is_some(), a.filters) {
            (true, Some(f)) => expect_len("filters", f.len(), a.batch)?,
            (true, None) => return Err(CpuCodegenError::Missing("filters")),
            (false, Some(_)) => return Err(CpuCodegenError::Unexpected("filters")),
            (false, None) => {}
        }
        let bias = match (p.has_bias(), a.bias) {
            (true, Some(b)) => {
                expect_len("bias", b.len(), a.vocab)?;
                b.as_ptr()
            }
            (true, None) => return Err(CpuCodegenError::Missing("bias")),
            (false, Some(_)) => return Err(CpuCodegenError::Unexpected("bias")),
            (false, None) => std::ptr::null(),
        };
        let allowed = match (p.has_mask(), a.allowed) {
            (true, Some(m)) => {
                expect_len("allowed", m.len(), checked(a.batch, a.vocab.div_ceil(32), "allowed")?)?;
                m.as_ptr()
            }
            (true, None) => return Err(CpuCodegenError::Missing("allowed")),
            (false, Some(_)) => return Err(CpuCodegenError::Unexpected("allowed")),
            (false, None) => std::ptr::null(),
        };
        let tiles = self.tiles(a.vocab);
        let samples = p.samples_per_row() as usize;
        let layout = StageTwo { batch: a.batch, samples, tiles };
        let count = checked(checked(a.batch, samples, "candidates")?, tiles, "candidates")?;
        expect_len("candidates", a.candidates.len(), count)?;
        debug_assert_eq!(count, layout.candidate_count());
        let lse = match (self.logsumexp, a.lse) {
            (true, Some(l)) => {
                expect_len("lse", l.len(), checked(a.batch, tiles, "lse")?)?;
                l.as_mut_ptr()
            }
            (true, None) => return Err(CpuCodegenError::Missing("lse")),
            (false, Some(_)) => return Err(CpuCodegenError::Unexpected("lse")),
            (false, None) => std::ptr::null_mut(),
        };
        if !a.vocab_offset.is_multiple_of(4) {
            return Err(CpuCodegenError::BadArgument(format!("vocab_offset {} is not a multiple of 4", a.vocab_offset)));
        }
        if let Some(seeds) = a.row_seeds {
            expect_len("row seeds", seeds.len(), a.batch)?;
        }
        if let Some(steps) = a.row_steps {
            expect_len("row steps", steps.len(), a.batch)?;
        }
        let pen_table = checked_table(p.has_penalties(), a.penalties, "penalties", |t| t.subtract.len(), a.batch, a.vocab)?;
        if let Some(t) = pen_table {
            expect_len("repetition penalties", t.repetition.len(), a.batch)?;
        }
        let lb_table = checked_table(p.has_logit_bias(), a.logit_bias, "logit_bias", |t| t.values.len(), a.batch, a.vocab)?;
        let (targets, target_logits) = match (p.targets.is_some() || p.verify.is_some(), a.targets) {
            (true, Some((t, out))) => {
                expect_len("targets", t.len(), a.batch)?;
                expect_len("target logits", out.len(), a.batch)?;
                if let Some((row, &v)) = t.iter().enumerate().find(|(_, &v)| v as usize >= a.vocab) {
                    return Err(CpuCodegenError::BadArgument(format!("target {v} of row {row} is outside the vocabulary of {}", a.vocab)));
                }
                (t.as_ptr(), out.as_mut_ptr())
            }
            (true, None) => return Err(CpuCodegenError::Missing("targets")),
            (false, Some(_)) => return Err(CpuCodegenError::Unexpected("targets")),
            (false, None) => (std::ptr::null(), std::ptr::null_mut()),
        };
        let (rank_thresholds, rank_counts) = match (p.ranks_targets(), a.ranks) {
            (true, Some(r)) => {
                expect_len("rank thresholds", r.thresholds.len(), a.batch)?;
                expect_len("rank counts", r.counts.len(), checked(a.batch, tiles, "rank counts")?)?;
                (r.thresholds.as_ptr(), r.counts.as_mut_ptr())
            }
            (false, Some(_)) => return Err(CpuCodegenError::Unexpected("rank counts")),
            (_, None) => (std::ptr::null(), std::ptr::null_mut()),
        };
        let run_tiles = a.vocab_tiles.unwrap_or(0..tiles);
        if run_tiles.start > run_tiles.end || run_tiles.end > tiles {
            return Err(CpuCodegenError::BadArgument(format!(
                "vocabulary tiles {run_tiles:?} of a launch with {tiles} tiles"
            )));
        }
        let (residual_lists, residual_per_tile, streams) = match (p.verify.is_some(), a.residual) {
            (true, Some(r)) => {
                expect_len("residual streams", r.streams.len(), a.batch)?;
                let slots = checked(a.batch, tiles, "residual lists")?.max(1);
                let per_tile = r.lists.len() / slots;
                if per_tile == 0 || r.lists.len() != per_tile * slots {
                    return Err(CpuCodegenError::BadArgument(format!(
                        "residual lists of {} entries are not [batch {}, tiles {tiles}, per_tile >= 1]",
                        r.lists.len(),
                        a.batch
                    )));
                }
                (r.lists.as_mut_ptr(), per_tile, Some(r.streams))
            }
            (true, None) => return Err(CpuCodegenError::Missing("residual lists")),
            (false, Some(_)) => return Err(CpuCodegenError::Unexpected("residual lists")),
            (false, None) => (std::ptr::null_mut(), 0, None),
        };
        let slots = checked(a.batch, tiles, "lists")?.max(1);
        let per_tile = a.lists.as_ref().map_or(0, |l| l.len() / slots);
        let lists = match (p.list_capacity() > 0, a.lists) {
            (true, Some(l)) => {
                if per_tile == 0 || l.len() != per_tile * slots {
                    return Err(CpuCodegenError::BadArgument(format!("lists of {} entries are not [batch {}, tiles {tiles}, per_tile >= 1]", l.len(), a.batch)));
                }
                l.as_mut_ptr()
            }
            (true, None) => return Err(CpuCodegenError::Missing("lists")),
            (false, Some(_)) => return Err(CpuCodegenError::Unexpected("lists")),
            (false, None) => std::ptr::null_mut(),
        };
        let (raw_lse, raw_lists, raw_per_tile, list_raws) = match (p.needs_raw_logsumexp(), a.raw) {
            (true, Some(r)) => {
                expect_len("raw lse", r.lse.len(), checked(a.batch, tiles, "raw lse")?)?;
                let raw_per_tile = r.lists.as_ref().map_or(0, |l| l.len() / slots);
                let raw_lists = match (p.raw_list_capacity() > 0, r.lists) {
                    (true, Some(l)) if raw_per_tile >= p.raw_list_capacity() as usize && l.len() == raw_per_tile * slots => {
                        l.as_mut_ptr()
                    }
                    (true, Some(l)) => {
                        return Err(CpuCodegenError::BadArgument(format!(
                            "raw lists of {} entries are not [batch {}, tiles {tiles}, per_tile >= {}]",
                            l.len(),
                            a.batch,
                            p.raw_list_capacity()
                        )))
                    }
                    (true, None) => return Err(CpuCodegenError::Missing("raw lists")),
                    (false, Some(_)) => return Err(CpuCodegenError::Unexpected("raw lists")),
                    (false, None) => std::ptr::null_mut(),
                };
                let list_raws = match (p.lists_carry_raw(), r.list_raws) {
                    (true, Some(l)) => {
                        expect_len("list raw logits", l.len(), per_tile * slots)?;
                        l.as_mut_ptr()
                    }
                    (true, None) => return Err(CpuCodegenError::Missing("list raw logits")),
                    (false, Some(_)) => return Err(CpuCodegenError::Unexpected("list raw logits")),
                    (false, None) => std::ptr::null_mut(),
                };
                (r.lse.as_mut_ptr(), raw_lists, raw_per_tile, list_raws)
            }
            (true, None) => return Err(CpuCodegenError::Missing("raw outputs")),
            (false, Some(_)) => return Err(CpuCodegenError::Unexpected("raw outputs")),
            (false, None) => (std::ptr::null_mut(), std::ptr::null_mut(), 0, std::ptr::null_mut()),
        };
        let stride = capture_stride(a.vocab);
        let (capture_slots, capture_logits, capture_raws) = match (p.list_capacity() > 0, a.capture) {
            (true, Some(c)) => {
                expect_len("capture slots", c.slots.len(), a.batch)?;
                let rows = c.logits.len() / stride.max(1);
                if c.logits.len() != rows * stride {
                    return Err(CpuCodegenError::BadArgument(format!(
                        "captured logits of {} floats are not [rows, {stride}]",
                        c.logits.len()
                    )));
                }
                if let Some((row, &slot)) = c.slots.iter().enumerate().find(|(_, &s)| s != CAPTURE_NONE && s as usize >= rows) {
                    return Err(CpuCodegenError::BadArgument(format!("capture slot {slot} of row {row} is past the {rows} captured rows")));
                }
                let raws = match (p.lists_carry_raw(), c.raws) {
                    (true, Some(r)) => {
                        expect_len("captured raw logits", r.len(), c.logits.len())?;
                        r.as_mut_ptr()
                    }
                    (true, None) => return Err(CpuCodegenError::Missing("captured raw logits")),
                    (false, Some(_)) => return Err(CpuCodegenError::Unexpected("captured raw logits")),
                    (false, None) => std::ptr::null_mut(),
                };
                (c.slots.as_ptr(), c.logits.as_mut_ptr(), raws)
            }
            (false, Some(_)) => return Err(CpuCodegenError::Unexpected("capture (the pipeline keeps no lists)")),
            (_, None) => (std::ptr::null(), std::ptr::null_mut(), std::ptr::null_mut()),
        };
        if a.batch == 0 || a.vocab == 0 {
            return Ok(());
        }
        let (mut row_keys, mut row_counters): (Vec<u64>, Vec<u32>) = match a.row_seeds {
            Some(seeds) => (seeds.to_vec(), vec![0; a.batch]),
            None => (vec![a.seed; a.batch], (0..a.batch as u32).map(|r| a.row_offset.wrapping_add(r)).collect()),
        };
        let mut row_word3: Vec<u32> = (0..a.batch)
            .map(|r| counter_word3(a.row_steps.map_or(0, |s| s[r]), streams.map_or(NoiseStream::Token, |s| s[r])))
            .collect();
        // The epilogue draws the noise of 4 rows at once (one Philox per lane): whole groups.
        let padded = a.batch.next_multiple_of(4);
        row_keys.resize(padded, 0);
        row_counters.resize(padded, 0);
        row_word3.resize(padded, 0);

        let hidden = match self.entry {
            Entry::Fused(_) => {
                let even_odd = matches!(p.weights.dtype, DType::BF16 | DType::F16);
                hidden_blocks(a.hidden, a.batch, a.dim, self.config.row_block as usize, even_odd)
            }
            Entry::Scratch { .. } => Vec::new(),
        };
        let engine_hidden = match self.entry {
            Entry::Fused(_) => tiles::PreparedHidden::zeroed(0),
            Entry::Scratch { engine, .. } => (engine.prepare)(a.hidden, a.batch, a.dim)?,
        };
        // The raw mode's counted logits for `lse_pass` take a second half (`lower::raw_half_bytes`).
        let raw_pass = self.lse_sums == LseSums::ScratchPass && p.needs_raw_logsumexp();
        let tile_len = tiles::scratch_len(a.batch, self.config.vocab_tile as usize);
        let scratch_len = if raw_pass { 2 * tile_len } else { tile_len };
        if matches!(self.entry, Entry::Scratch { .. }) && scratch_len * 4 > MAX_SCRATCH_BYTES {
            return Err(CpuCodegenError::TooLarge { what: "logit scratch bytes (batch × vocab_tile × 4, twice for the raw partials)", value: scratch_len * 4, max: MAX_SCRATCH_BYTES });
        }
        let row_scale: Vec<f32> =
            a.temperatures.iter().map(|&t| if t != 0.0 { 1.0f32 / t } else { 1.0 }).collect();
        let row_argmax: Vec<u32> = a
            .temperatures
            .iter()
            .enumerate()
            .map(|(r, &t)| u32::from(t == 0.0 || a.filters.is_some_and(|f| f[r].is_drawn_in_stage_three(false))))
            .collect();
        // Fresh per launch: a bound is a score this launch's tokens reach.
        let row_bounds = unreached_bounds(self.row_bounds, a.batch * samples);
        let vocab_tile = self.config.vocab_tile as usize;
        let list_bound = ListBound::new(self.list_bounds, a.batch, per_tile, vocab_tile, p.list_capacity() as usize);
        let raw_list_bound = ListBound::new(self.raw_list_bounds, a.batch, raw_per_tile, vocab_tile, p.raw_list_capacity() as usize);
        let args = KernelArgs {
            hidden: hidden.as_ptr(),
            weights: a.weights.as_ptr(),
            row_scale: row_scale.as_ptr(),
            row_argmax: row_argmax.as_ptr(),
            bias,
            allowed,
            candidates: a.candidates.as_mut_ptr(),
            lse,
            batch: a.batch as u64,
            dim: a.dim as u64,
            vocab: a.vocab as u64,
            tiles: tiles as u64,
            row_keys: row_keys.as_ptr(),
            row_counters: row_counters.as_ptr(),
            row_word3: row_word3.as_ptr(),
            quad_offset: u64::from(a.vocab_offset / 4),
            pen_bits: pen_table.map_or(std::ptr::null(), |t| t.listed.bits.as_ptr()),
            pen_table: pen_table.map_or(std::ptr::null(), |t| t as *const PenaltyTable),
            penalize: apply_quad::<PenaltyTable>,
            lb_bits: lb_table.map_or(std::ptr::null(), |t| t.listed.bits.as_ptr()),
            lb_table: lb_table.map_or(std::ptr::null(), |t| t as *const LogitBiasTable),
            add_logit_bias: apply_quad::<LogitBiasTable>,
            targets,
            target_logits,
            rank_thresholds,
            rank_counts,
            lists,
            per_tile: per_tile as u64,
            insert: crate::lists::insert_quad,
            row_bounds: ptr_or_null(&row_bounds),
            samples: samples as u64,
            list_bound: list_bound.args(),
            raw_list_bound: raw_list_bound.args(),
            residual_lists,
            residual_per_tile: residual_per_tile as u64,
            insert_residual: insert_residual_quad,
            raw_lse,
            raw_lists,
            raw_per_tile: raw_per_tile as u64,
            list_raws,
            insert_paired: crate::lists::insert_quad_paired,
            capture_slots,
            capture_logits,
            capture_raws,
            capture_stride: stride as u64,
        };
        let shared = SharedArgs(&args);
        // One task per tile: when one worker falls behind (another process takes its core),
        // the others take over the rest tile by tile. Each worker keeps one scratch for every
        // tile it runs.
        let vocab_tile = self.config.vocab_tile as usize;
        let scratches: Vec<std::sync::Mutex<Vec<f32>>> = match self.entry {
            Entry::Fused(_) => Vec::new(),
            Entry::Scratch { .. } => (0..self.config.threads).map(|_| std::sync::Mutex::new(Vec::new())).collect(),
        };
        let run = |tile: usize| match self.entry {
            // SAFETY: every pointer in `args` covers the length checked above for this shape,
            // the buffers outlive the call, and tasks cover disjoint tiles.
            Entry::Fused(f) => unsafe {
                f(shared.get(), tile as u64, tile as u64 + 1);
                crate::lists::finish_tile(&*shared.get(), tile);
                publish_bounds(&*shared.get(), tile);
            },
            Entry::Scratch { epilogue, engine } => {
                let worker = rayon::current_thread_index().unwrap_or(0) % scratches.len();
                // Only this worker locks its scratch; a poisoned lock holds a usable buffer.
                let mut scratch = scratches[worker].lock().unwrap_or_else(|e| e.into_inner());
                scratch.resize(scratch_len, 0.0);
                let v_begin = tile * vocab_tile;
                let v_end = (v_begin + vocab_tile).min(a.vocab);
                // SAFETY: `compile` checked the host's features and the dtypes for this engine;
                // the lengths of hidden and weights were checked above, and the scratch holds a
                // whole tile.
                unsafe {
                    let job = tiles::TileJob { hidden: engine_hidden.as_slice(), batch: a.batch, dim: a.dim, weights: a.weights.as_ptr(), vocab: a.vocab, v_begin, v_end };
                    (engine.tiles)(&job, &mut scratch);
                    // The scratch now holds this tile's logits in the layout `tiles` documents.
                    epilogue(shared.get(), tile as u64, tile as u64 + 1, scratch.as_mut_ptr());
                    let args = &*shared.get();
                    if self.lse_sums == LseSums::ScratchPass {
                        let (tiles, quads) = (args.tiles as usize, (v_end - v_begin).div_ceil(4));
                        // `lse_pass::available` held at compile; the scratch holds the tile's
                        // quads (and the raw half after them); row r's partial of this tile is
                        // written only by this task.
                        if self.logsumexp {
                            crate::lse_pass::write_partials(&scratch, a.batch, quads, |r| args.lse.add(r * tiles + tile));
                        }
                        if raw_pass {
                            crate::lse_pass::write_partials(&scratch[tile_len..], a.batch, quads, |r| args.raw_lse.add(r * tiles + tile));
                        }
                    }
                    crate::lists::finish_tile(args, tile);
                    publish_bounds(args, tile);
                }
            }
        };
        if run_tiles.len() == 1 {
            run(run_tiles.start);
        } else {
            self.pool.install(|| run_tiles.into_par_iter().with_max_len(1).for_each(run));
        }
        Ok(())
    }
}

/// A finished tile's bounds for the tiles after it: [`publish_row_bounds`], then
/// [`publish_list_bounds`].
///
/// # Safety
/// As theirs.
unsafe fn publish_bounds(args: &KernelArgs, tile: usize) {
    // SAFETY: the caller's.
    unsafe {
        publish_row_bounds(args, tile);
        publish_list_bounds(args, tile);
    }
}

/// Raises each (row, sample)'s cross-tile bound (`KernelArgs::row_bounds`) to the score its
/// candidate in `tile` reached, once the tile's epilogue has returned. Every published value
/// is a score a token of this launch reaches, so later tiles' noise skips stay exact whatever
/// order the tiles run in; a candidate that reached nothing (`-inf`, or NaN) publishes nothing.
///
/// # Safety
/// `args` is a launch's arguments (`row_bounds` `[B, S]` or null, `candidates`
/// `[B, S, tiles]`), and `tile`'s epilogue has returned.
unsafe fn publish_row_bounds(args: &KernelArgs, tile: usize) {
    if args.row_bounds.is_null() {
        return;
    }
    let tiles = args.tiles as usize;
    for rs in 0..args.batch as usize * args.samples as usize {
        // SAFETY: slot (row, sample, tile) of the checked `[B, S, tiles]` candidates, which
        // only this tile's task writes; bound `rs` of the `[B, S]` bounds.
        let (score, bound) = unsafe { ((*args.candidates.add(rs * tiles + tile)).score, &*args.row_bounds.add(rs)) };
        if score > f32::NEG_INFINITY {
            bound.fetch_max_f32(score);
        }
    }
}

/// Merges `tile`'s sorted lists of each kind (`lists::finish_tile` has run) into each row's
/// running top (`ListBoundArgs::tops`) and, once that holds `need` logits, raises the row's
/// list bound to the last of them. Those are logits of distinct listed tokens of the launch,
/// so at least `need` of the row's tokens reach the bound and none below it is among the
/// row's top `need`: every token stage three merges still enters its list (or its list
/// overflows, as without the bound), whatever order the tiles run in.
///
/// # Safety
/// As [`publish_row_bounds`], with `lists` `[B, tiles, per_tile]`, `raw_lists` `[B, tiles,
/// raw_per_tile]` and their bounds' `tops` and `bounds` `[B]` or null.
unsafe fn publish_list_bounds(args: &KernelArgs, tile: usize) {
    // SAFETY: the caller's.
    unsafe {
        publish_list_bound(args, &args.list_bound, args.lists, args.per_tile as usize, tile);
        publish_list_bound(args, &args.raw_list_bound, args.raw_lists, args.raw_per_tile as usize, tile);
    }
}

/// [`publish_list_bounds`] for one kind: `lists` `[B, tiles, per_tile]` bounded by `kind`.
///
/// # Safety
/// As [`publish_list_bounds`].
unsafe fn publish_list_bound(args: &KernelArgs, kind: &ListBoundArgs, lists: *const Scored, per_tile: usize, tile: usize) {
    if kind.tops.is_null() {
        return;
    }
    let (tiles, need) = (args.tiles as usize, kind.need as usize);
    for r in 0..args.batch as usize {
        // SAFETY: this tile's sorted list of row `r` (only this task wrote it), and row `r`'s
        // running top and bound.
        let (list, top, bound) =
            unsafe { (std::slice::from_raw_parts(lists.add((r * tiles + tile) * per_tile), per_tile), &*kind.tops.add(r), &*kind.bounds.add(r)) };
        // Entries at or below the bound cannot raise it (the bound only lags the running top's
        // last logit), so most tiles of a launch take no lock.
        let floor = f32::from_bits(bound.load(Ordering::Relaxed));
        let listed: Vec<f32> = list.iter().take_while(|s| !s.is_empty() && s.logit > floor).map(|s| s.logit).collect();
        if listed.is_empty() {
            continue;
        }
        // A poisoned lock holds a usable list.
        let mut top = top.lock().unwrap_or_else(|e| e.into_inner());
        *top = merge_descending(&top, &listed, need);
        if top.len() == need {
            bound.fetch_max_f32(top[need - 1]);
        }
    }
}

/// The first `n` of the union of `a` and `b`, both sorted descending.
fn merge_descending(a: &[f32], b: &[f32], n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n.min(a.len() + b.len()));
    let (mut i, mut j) = (0, 0);
    while out.len() < n && (i < a.len() || j < b.len()) {
        if j == b.len() || (i < a.len() && a[i] >= b[j]) {
            out.push(a[i]);
            i += 1;
        } else {
            out.push(b[j]);
            j += 1;
        }
    }
    out
}

/// Raising an f32 held as bits (the kernels' bounds) to at least a value.
trait FetchMaxF32 {
    fn fetch_max_f32(&self, value: f32);
}

impl FetchMaxF32 for AtomicU32 {
    fn fetch_max_f32(&self, value: f32) {
        let _ = self.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| (value > f32::from_bits(b)).then_some(value.to_bits()));
    }
}

/// Largest vocabulary whose indices stay clear of `INDEX_NONFINITE` and `INDEX_NONE`.
const INDEX_LIMIT: usize = flashsample_abi::INDEX_NONFINITE as usize;

fn checked(a: usize, b: usize, what: &'static str) -> Result<usize, CpuCodegenError> {
    a.checked_mul(b).ok_or(CpuCodegenError::TooLarge { what, value: usize::MAX, max: isize::MAX as usize })
}

fn expect_len(what: &'static str, got: usize, expected: usize) -> Result<(), CpuCodegenError> {
    if got == expected {
        Ok(())
    } else {
        Err(CpuCodegenError::Length { what, expected, got })
    }
}

/// The hidden layout the kernel reads: rows grouped into the kernel's row blocks (full blocks
/// of `row_block` from row 0, then the remainder), each block occupying its rows' `rows · dim`
/// floats as `[chunk][row][8]` for the whole 8-element chunks, then `[tail element][row]`.
/// With `even_odd` (16-bit weights) each 8-element chunk holds elements 0,2,4,6 then 1,3,5,7,
/// matching how the kernel splits 8 packed weights into two f32x4 with one op each.
fn hidden_blocks(hidden: &[f32], batch: usize, dim: usize, row_block: usize, even_odd: bool) -> Vec<f32> {
    let mut out = vec![0.0f32; batch * dim];
    let full = dim / 8 * 8;
    for r0 in (0..batch).step_by(row_block) {
        let rows = row_block.min(batch - r0);
        let block = &mut out[r0 * dim..(r0 + rows) * dim];
        for i in 0..rows {
            let src = &hidden[(r0 + i) * dim..(r0 + i + 1) * dim];
            for (c, chunk) in src[..full].chunks_exact(8).enumerate() {
                let dst = &mut block[(c * rows + i) * 8..][..8];
                if even_odd {
                    for k in 0..4 {
                        dst[k] = chunk[2 * k];
                        dst[4 + k] = chunk[2 * k + 1];
                    }
                } else {
                    dst.copy_from_slice(chunk);
                }
            }
            for (t, &x) in src[full..].iter().enumerate() {
                block[rows * full + t * rows + i] = x;
            }
        }
    }
    out
}
