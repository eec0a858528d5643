//! The stage-one kernel as one Cranelift function,
//! `fn(args: *const KernelArgs, tile_begin: u64, tile_end: u64)`.
//!
//! Loop nest: tile → vocab quad (4 tokens) → register block of `row_block` hidden rows →
//! 8-element chunks of `dim`. A quad's four weight rows (4·D elements) stay in L1 while every
//! row block streams past them, so W is read from memory once per launch whatever the batch.
//! Each block accumulates `rows × 4` f32x4 partial dot products (each loaded weight vector
//! feeds `rows` FMAs, each hidden vector 4), reduces them to one f32x4 of 4 logits per row and
//! parks those in a small stack buffer; one shared epilogue then runs per row. A tile's running
//! winner per (row, sample) and its running logsumexp partial live in the output slots
//! themselves, so nothing of size `[B, V]` ever exists.
//!
//! (Walking the quad's rows one after another instead, for a purely sequential weight stream,
//! measured slower at B = 16 and no faster at B = 1.)

use crate::kernel::{KernelArgs, ListBoundArgs};
use crate::math::{self, fconst, i32x4_lanes, iconst};
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{
    types, Block, Function, InstBuilder, MemFlagsData, SigRef, StackSlot, StackSlotData, StackSlotKind, Value,
};
use cranelift_codegen::isa::TargetFrontendConfig;
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext, Variable};
use flashsample_abi::lse::{EMPTY_WINDOW, KEPT_WINDOWS, TERM_SCALE_LOG2};
use flashsample_abi::rng::NoiseSkip;
use flashsample_abi::{LsePartial, INDEX_NONE, INDEX_NONFINITE};
use flashsample_ir::{DType, Pipeline, Sampler, Transform};
use std::mem::{offset_of, size_of};

/// One elementwise step of the epilogue, in pipeline order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Step {
    Temperature,
    Bias,
    Softcap(f32),
    Penalties,
    LogitBias,
}

/// Where the epilogue's raw logits come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LogitSource {
    /// The kernel's own register-blocked dot products (`fn(args, tile_begin, tile_end)`).
    Fused,
    /// A matrix engine already wrote the tile's logits, `[quad][row][4]` f32 (`crate::tiles`),
    /// at the 4th parameter: `fn(args, tile_begin, tile_end, scratch)`, one tile per call;
    /// `lse` says who sums the partials (the fused logits have only the epilogue).
    Scratch { lse: LseSums },
}

/// What the lowering needs to know about a pipeline and a config.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    pub dtype: DType,
    pub samples: u32,
    pub row_block: u32,
    pub vocab_tile: u32,
    /// Sampler `Argmax`: no noise is emitted at all.
    pub argmax: bool,
    /// A temperature transform exists (rows with `T == 0` are greedy) or a filter does (stage
    /// three draws the sample of a row whose filter is not OFF): rows may take their argmax.
    pub argmax_rows: bool,
    pub steps: Vec<Step>,
    pub has_mask: bool,
    pub has_bias: bool,
    pub needs_lse: bool,
    /// `target_logprob`: the tile holding a row's target writes its transformed logit.
    pub targets: bool,
    /// `target_logprob(.., rank)`: a launch with `KernelArgs::rank_counts` also counts.
    pub ranks: bool,
    /// Entries of each (row, tile) top list; 0 = no lists.
    pub list_capacity: u32,
    /// Speculative verification: each (row, tile) also keeps its best tokens by the row's
    /// perturbed score `x + G` (`Candidate`s, `KernelArgs::residual_lists`), and the noise
    /// skip tests against that list's last entry instead of the winner.
    pub residual_lists: bool,
    /// Which noise the epilogue skips (`CpuConfig::noise_skip`; [`Plan::row_bounds`]).
    pub noise_skip: NoiseSkip,
    pub logits: LogitSource,
    /// The raw logprob mode's extra work (`abi::raw`); `None` in the processed mode.
    pub raw: Option<RawPlan>,
}

/// What the raw logprob mode adds to the epilogue (DESIGN.md step 10): the raw logits (the
/// model's transforms only), their logsumexp partials over every token, and, as declared,
/// top lists by raw logit and the raw logit beside each processed list entry.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct RawPlan {
    /// The model's transforms, in pipeline order (bias, softcap).
    pub steps: Vec<Step>,
    /// Entries of each (row, tile) raw top list; 0 = none.
    pub list_capacity: u32,
    /// The processed lists carry each entry's raw logit (`Pipeline::lists_carry_raw`).
    pub paired_lists: bool,
}

impl Plan {
    /// Who sums the partials this plan keeps (processed, and the raw mode's).
    pub(crate) fn lse_sums(&self) -> LseSums {
        match self.logits {
            LogitSource::Fused => LseSums::Epilogue,
            LogitSource::Scratch { lse } => lse,
        }
    }

    /// Whether the noise skips also test against the row's cross-tile bound
    /// (`KernelArgs::row_bounds`): a sampling kernel with [`NoiseSkip::CrossTile`], unless it
    /// verifies (its residual lists need tokens below the winner).
    pub fn row_bounds(&self) -> bool {
        self.noise_skip.uses_row_bounds() && !self.argmax && !self.residual_lists
    }

    /// Whether the top lists' insertion gate also tests against the row's list bound
    /// (`KernelArgs::list_bound`): a kernel with lists and [`NoiseSkip::CrossTile`], unless it
    /// verifies (a filtered draft row's survivors come from the same lists; kept out of the
    /// cut for simplicity, not for exactness).
    pub fn list_bounds(&self) -> bool {
        self.noise_skip.uses_row_bounds() && self.list_capacity > 0 && !self.residual_lists
    }

    /// [`Plan::list_bounds`] for the raw mode's lists by raw logit (`KernelArgs::raw_list_bound`).
    pub fn raw_list_bounds(&self) -> bool {
        self.noise_skip.uses_row_bounds() && self.raw.as_ref().is_some_and(|r| r.list_capacity > 0) && !self.residual_lists
    }

    pub fn new(pipeline: &Pipeline, row_block: u32, vocab_tile: u32) -> Plan {
        let steps: Vec<Step> = pipeline
            .transforms
            .iter()
            .filter_map(|t| match t {
                Transform::Temperature(_) => Some(Step::Temperature),
                Transform::Bias { .. } => Some(Step::Bias),
                Transform::Softcap { cap } => Some(Step::Softcap(cap.get())),
                Transform::Penalties { .. } => Some(Step::Penalties),
                Transform::LogitBias { .. } => Some(Step::LogitBias),
                // Masks are step 4; the filter acts on stage one's lists (step 6b).
                Transform::Mask { .. } | Transform::Ban { .. } | Transform::Filter { .. } => None,
            })
            .collect();
        Plan {
            dtype: pipeline.weights.dtype,
            samples: pipeline.samples_per_row(),
            row_block,
            vocab_tile,
            argmax: matches!(pipeline.sampler, Sampler::Argmax),
            argmax_rows: pipeline.temperature().is_some() || pipeline.filter_max_k().is_some(),
            steps: steps.clone(),
            has_mask: pipeline.has_mask(),
            has_bias: pipeline.has_bias(),
            needs_lse: pipeline.needs_logsumexp(),
            // Verification reads each draft row's transformed logit at its draft token.
            targets: pipeline.targets.is_some() || pipeline.verify.is_some(),
            ranks: pipeline.ranks_targets(),
            list_capacity: pipeline.list_capacity(),
            residual_lists: pipeline.verify.is_some(),
            noise_skip: NoiseSkip::default(),
            logits: LogitSource::Fused,
            raw: pipeline.needs_raw_logsumexp().then(|| RawPlan {
                steps: steps.iter().copied().filter(|s| matches!(s, Step::Bias | Step::Softcap(_))).collect(),
                list_capacity: pipeline.raw_list_capacity(),
                paired_lists: pipeline.lists_carry_raw(),
            }),
        }
    }
}


/// Who sums a launch's logsumexp partials (DESIGN.md step 7), processed and raw alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LseSums {
    /// The epilogue adds each quad to its row's partial (`Lowering::emit_lse`).
    Epilogue,
    /// The epilogue leaves each quad-row's counted logits in the scratch (`-inf` for the
    /// others): the processed ones in place of the raw logits, the raw mode's in a second
    /// half of the same layout ([`raw_half_bytes`]); `lse_pass` writes the partials after it
    /// (`LogitSource::Scratch` only, which carries the choice).
    ScratchPass,
}

/// Bytes from the scratch to its second half, where `LseSums::ScratchPass` puts the raw
/// mode's counted logits: one tile's `crate::tiles::scratch_len` floats.
pub(crate) fn raw_half_bytes(batch: usize, vocab_tile: u32) -> usize {
    crate::tiles::scratch_len(batch, vocab_tile as usize) * 4
}

const CANDIDATE_BYTES: i64 = size_of::<flashsample_abi::Candidate>() as i64;
const LSE_BYTES: i64 = size_of::<LsePartial>() as i64;
// `emit_lse` reduces the window sums as a pair (windows 0 and 1) and one alone (window 2).
const _: () = assert!(KEPT_WINDOWS == 3);
const LSE_WINDOW_OFFSET: i32 = offset_of!(LsePartial, window) as i32;
const SCORED_BYTES: i64 = size_of::<flashsample_abi::Scored>() as i64;
const I64: types::Type = types::I64;
const I32: types::Type = types::I32;
const F32: types::Type = types::F32;
const F32X4: types::Type = types::F32X4;
const I32X4: types::Type = types::I32X4;

/// Loads from the caller's input buffers: in bounds (the launch checked the lengths), unaligned,
/// and never written while the kernel runs. `notrap` + `readonly` + `can_move` makes them pure to the egraph,
/// which then places each load next to its one use (the FMA), where the backend folds it into a
/// memory operand. (A may-trap load would stay at its place at the loop top, and the values of
/// every load of the body would be live at once and spill.)
fn input() -> MemFlagsData {
    MemFlagsData::new().with_notrap().with_readonly().with_can_move()
}

/// Loads and stores of the candidate and lse slots (read-modify-write).
fn output() -> MemFlagsData {
    MemFlagsData::new().with_notrap()
}

/// Loads and stores of the args struct and of the kernel's own stack slots.
fn own() -> MemFlagsData {
    MemFlagsData::trusted()
}

/// Builds the kernel body into `func`, whose signature is `(i64, i64, i64)`, plus a fourth
/// `i64` (the scratch) for [`LogitSource::Scratch`].
pub(crate) fn build(func: &mut Function, fctx: &mut FunctionBuilderContext, plan: &Plan, target: TargetFrontendConfig) {
    let mut b = FunctionBuilder::new(func, fctx);
    let entry = b.create_block();
    b.append_block_params_for_function_params(entry);
    b.switch_to_block(entry);
    let params = b.block_params(entry).to_vec();
    let mut k = Lowering::new(b, plan, params[0], target.default_call_conv);
    k.scratch = params.get(3).copied();
    k.emit(params[1], params[2]);
    k.b.seal_all_blocks();
    k.b.finalize(target);
}

/// Per-launch values loaded once at entry; they dominate the whole function.
struct Launch {
    hidden: Value,
    weights: Value,
    row_scale: Value,
    row_argmax: Value,
    bias: Value,
    allowed: Value,
    candidates: Value,
    lse: Value,
    row_keys: Value,
    row_counters: Value,
    row_word3: Value,
    quad_offset: Value,
    pen_bits: Value,
    pen_table: Value,
    penalize: Value,
    /// `[lb_bits, lb_table, add_logit_bias]`, loaded iff the plan has [`Step::LogitBias`].
    logit_bias: Option<[Value; 3]>,
    /// `[targets, target_logits]`, loaded iff the plan scores targets.
    targets: Option<[Value; 2]>,
    /// `[rank_thresholds, rank_counts]` (null unless the launch ranks), loaded iff the plan
    /// ranks targets.
    ranks: Option<[Value; 2]>,
    lists: Value,
    per_tile: Value,
    insert: Value,
    /// `[residual_lists, residual_per_tile, insert_residual]`, loaded iff the plan keeps them.
    residual: Option<[Value; 3]>,
    /// `row_bounds` (`KernelArgs`), loaded iff the plan's noise skips read it.
    row_bounds: Option<Value>,
    /// `list_bound.bounds` and `raw_list_bound.bounds` (`KernelArgs`), each loaded iff the
    /// plan's gate of that list kind reads it.
    list_bounds: Option<Value>,
    raw_list_bounds: Option<Value>,
    /// `[raw_lse, raw_lists, raw_per_tile, list_raws, insert_paired]` (`KernelArgs`), loaded
    /// iff the plan has a [`RawPlan`].
    raw: Option<RawLaunch>,
    /// With [`LseSums::ScratchPass`] and a [`RawPlan`]: [`raw_half_bytes`] for this batch.
    raw_half: Option<Value>,
    /// Whether the epilogue may capture rows (`KernelArgs::capture_slots`): iff the plan
    /// keeps lists, the only pipelines whose nucleus can outgrow them. The capture's fields are
    /// loaded where they are used, so they hold no register through the main loop.
    capture: bool,
    batch: Value,
    vocab: Value,
    tiles: Value,
    /// Bytes of one hidden row (f32).
    hidden_row: Value,
    /// Bytes of one weight row.
    weight_row: Value,
    /// Bytes of the hidden-row prefix covered by whole 8-element chunks.
    chunk_bytes: Value,
    /// Bytes of a whole hidden row, where the scalar tail stops.
    dim_bytes: Value,
    /// Weight-row byte offset where the scalar tail starts.
    weight_tail_start: Value,
    last_token: Value,
    mask_words: Value,
}

/// The raw mode's per-launch values (`KernelArgs`'s raw fields).
struct RawLaunch {
    lse: Value,
    lists: Value,
    per_tile: Value,
    list_raws: Value,
    insert_paired: Value,
}

/// One top list kind of a (row, tile): where its lists are and how long each is, and the
/// row bounds its gate also tests (`KernelArgs::list_bound` or `raw_list_bound`).
#[derive(Clone, Copy)]
struct ListSpec {
    lists: Value,
    per_tile: Value,
    bounds: Option<Value>,
}

/// Per-quad values, defined at the quad's head.
struct Quad {
    v: Value,
    weight_rows: [Value; 4],
    /// Bit k set iff token `v + k` exists (`< vocab`).
    valid_bits: Value,
    bias: Option<Value>,
    /// With [`LogitSource::Scratch`]: the address of this quad's row 0 in the scratch.
    scratch_rows: Option<Value>,
}

/// One row's f32x4 of a quad as step 6 sees it.
struct Lanes {
    score: Value,
    /// The logits the winner carries: the transformed ones, or the raw ones in the raw mode.
    x: Value,
    /// All-ones lanes for allowed, existing tokens.
    allowed: Value,
}

struct Lowering<'a, 'p> {
    b: FunctionBuilder<'a>,
    plan: &'p Plan,
    args: Value,
    tile: Variable,
    row: Variable,
    epi_row: Variable,
    epi_end: Variable,
    logits_slot: StackSlot,
    scratch_slot: StackSlot,
    /// Four f32 handed to the out-of-line helpers (penalties, list insertion).
    call_slot: StackSlot,
    /// `fn(i64, i64, i64, i64)`, the helpers' signature.
    helper_sig: cranelift_codegen::ir::SigRef,
    /// `fn(i64, i64, i64, i64, i64)`, the paired list insertion's (`kernel::InsertPairedFn`),
    /// iff the plan's lists carry raw logits.
    paired_sig: Option<SigRef>,
    /// The engine-filled logits of the tile ([`LogitSource::Scratch`]).
    scratch: Option<Value>,
    /// Per sample: the Philox words of one row group and quad, `[word][lane]` (64 bytes), and
    /// the (quad, group) they belong to (0: none yet); see `row_group_noise_words`.
    noise_words: StackSlot,
    noise_tags: StackSlot,
}

impl<'a, 'p> Lowering<'a, 'p> {
    fn new(mut b: FunctionBuilder<'a>, plan: &'p Plan, args: Value, call_conv: cranelift_codegen::isa::CallConv) -> Self {
        let tile = b.declare_var(I64);
        let row = b.declare_var(I64);
        let epi_row = b.declare_var(I64);
        let epi_end = b.declare_var(I64);
        let logits_slot =
            b.create_sized_stack_slot(StackSlotData::new(StackSlotKind::ExplicitSlot, 16 * plan.row_block, 4));
        let scratch_slot = b.create_sized_stack_slot(StackSlotData::new(StackSlotKind::ExplicitSlot, 32, 4));
        // The paired insertion reads a second vector, the raw logits, at +16.
        let paired = plan.raw.as_ref().is_some_and(|r| r.paired_lists);
        let call_bytes = if paired { 32 } else { 16 };
        let call_slot = b.create_sized_stack_slot(StackSlotData::new(StackSlotKind::ExplicitSlot, call_bytes, 4));
        let mut sig = cranelift_codegen::ir::Signature::new(call_conv);
        sig.params.extend([cranelift_codegen::ir::AbiParam::new(I64); 4]);
        let helper_sig = b.import_signature(sig.clone());
        let paired_sig = paired.then(|| {
            sig.params.push(cranelift_codegen::ir::AbiParam::new(I64));
            b.import_signature(sig)
        });
        let noise_words = b.create_sized_stack_slot(StackSlotData::new(StackSlotKind::ExplicitSlot, 64 * plan.samples, 4));
        let noise_tags = b.create_sized_stack_slot(StackSlotData::new(StackSlotKind::ExplicitSlot, 8 * plan.samples, 3));
        Lowering {
            b,
            plan,
            args,
            tile,
            row,
            epi_row,
            epi_end,
            logits_slot,
            scratch_slot,
            call_slot,
            helper_sig,
            paired_sig,
            scratch: None,
            noise_words,
            noise_tags,
        }
    }

    fn arg(&mut self, offset: usize) -> Value {
        let args = self.args;
        self.b.ins().load(I64, own(), args, offset as i32)
    }

    fn load_launch(&mut self) -> Launch {
        let hidden = self.arg(offset_of!(KernelArgs, hidden));
        let weights = self.arg(offset_of!(KernelArgs, weights));
        let row_scale = self.arg(offset_of!(KernelArgs, row_scale));
        let row_argmax = self.arg(offset_of!(KernelArgs, row_argmax));
        let bias = self.arg(offset_of!(KernelArgs, bias));
        let allowed = self.arg(offset_of!(KernelArgs, allowed));
        let candidates = self.arg(offset_of!(KernelArgs, candidates));
        let lse = self.arg(offset_of!(KernelArgs, lse));
        let row_keys = self.arg(offset_of!(KernelArgs, row_keys));
        let row_counters = self.arg(offset_of!(KernelArgs, row_counters));
        let row_word3 = self.arg(offset_of!(KernelArgs, row_word3));
        let quad_offset = self.arg(offset_of!(KernelArgs, quad_offset));
        let pen_bits = self.arg(offset_of!(KernelArgs, pen_bits));
        let pen_table = self.arg(offset_of!(KernelArgs, pen_table));
        let penalize = self.arg(offset_of!(KernelArgs, penalize));
        let lists = self.arg(offset_of!(KernelArgs, lists));
        let residual = self.plan.residual_lists.then(|| {
            [
                self.arg(offset_of!(KernelArgs, residual_lists)),
                self.arg(offset_of!(KernelArgs, residual_per_tile)),
                self.arg(offset_of!(KernelArgs, insert_residual)),
            ]
        });
        let row_bounds = self.plan.row_bounds().then(|| self.arg(offset_of!(KernelArgs, row_bounds)));
        let bound_at = offset_of!(KernelArgs, list_bound) + offset_of!(ListBoundArgs, bounds);
        let list_bounds = self.plan.list_bounds().then(|| self.arg(bound_at));
        let raw_bound_at = offset_of!(KernelArgs, raw_list_bound) + offset_of!(ListBoundArgs, bounds);
        let raw_list_bounds = self.plan.raw_list_bounds().then(|| self.arg(raw_bound_at));
        let per_tile = self.arg(offset_of!(KernelArgs, per_tile));
        let insert = self.arg(offset_of!(KernelArgs, insert));
        let batch = self.arg(offset_of!(KernelArgs, batch));
        let dim = self.arg(offset_of!(KernelArgs, dim));
        let vocab = self.arg(offset_of!(KernelArgs, vocab));
        let tiles = self.arg(offset_of!(KernelArgs, tiles));
        let logit_bias = self.plan.steps.contains(&Step::LogitBias).then(|| {
            [
                self.arg(offset_of!(KernelArgs, lb_bits)),
                self.arg(offset_of!(KernelArgs, lb_table)),
                self.arg(offset_of!(KernelArgs, add_logit_bias)),
            ]
        });
        let targets = self
            .plan
            .targets
            .then(|| [self.arg(offset_of!(KernelArgs, targets)), self.arg(offset_of!(KernelArgs, target_logits))]);
        let ranks = self
            .plan
            .ranks
            .then(|| [self.arg(offset_of!(KernelArgs, rank_thresholds)), self.arg(offset_of!(KernelArgs, rank_counts))]);
        let raw = self.plan.raw.is_some().then(|| RawLaunch {
            lse: self.arg(offset_of!(KernelArgs, raw_lse)),
            lists: self.arg(offset_of!(KernelArgs, raw_lists)),
            per_tile: self.arg(offset_of!(KernelArgs, raw_per_tile)),
            list_raws: self.arg(offset_of!(KernelArgs, list_raws)),
            insert_paired: self.arg(offset_of!(KernelArgs, insert_paired)),
        });
        let capture = self.plan.list_capacity > 0;
        let b = &mut self.b;
        let hidden_row = b.ins().ishl_imm_u(dim, 2);
        let esize = self.plan.dtype.size_bytes() as i64;
        let weight_row = b.ins().imul_imm_s(dim, esize);
        let chunk_elems = b.ins().band_imm_s(dim, !7i64);
        let chunk_bytes = b.ins().ishl_imm_u(chunk_elems, 2);
        let weight_tail_start = b.ins().imul_imm_s(chunk_elems, esize);
        let last_token = b.ins().iadd_imm_s(vocab, -1);
        let vocab_31 = b.ins().iadd_imm_s(vocab, 31);
        let mask_words = b.ins().ushr_imm_u(vocab_31, 5);
        // `raw_half_bytes(batch, vocab_tile)`, linear in the batch.
        let row_bytes = raw_half_bytes(1, self.plan.vocab_tile) as i64;
        let raw_half = (self.plan.lse_sums() == LseSums::ScratchPass && self.plan.raw.is_some()).then(|| b.ins().imul_imm_s(batch, row_bytes));
        Launch {
            hidden,
            weights,
            row_scale,
            row_argmax,
            bias,
            allowed,
            candidates,
            lse,
            row_keys,
            row_counters,
            row_word3,
            quad_offset,
            pen_bits,
            pen_table,
            penalize,
            logit_bias,
            targets,
            ranks,
            lists,
            residual,
            row_bounds,
            list_bounds,
            raw_list_bounds,
            per_tile,
            insert,
            raw,
            raw_half,
            capture,
            batch,
            vocab,
            tiles,
            hidden_row,
            weight_row,
            chunk_bytes,
            dim_bytes: hidden_row,
            weight_tail_start,
            last_token,
            mask_words,
        }
    }

    /// `for i in begin..end { body(i) }`, leaving the builder after the loop.
    fn counted_loop(&mut self, begin: Value, end: Value, body: impl FnOnce(&mut Self, Value)) {
        let var = self.b.declare_var(I64);
        self.b.def_var(var, begin);
        let head = self.b.create_block();
        let body_block = self.b.create_block();
        let done = self.b.create_block();
        self.b.ins().jump(head, &[]);
        self.b.switch_to_block(head);
        let i = self.b.use_var(var);
        let more = self.b.ins().icmp(IntCC::UnsignedLessThan, i, end);
        self.b.ins().brif(more, body_block, &[], done, &[]);
        self.b.switch_to_block(body_block);
        body(self, i);
        let next = self.b.ins().iadd_imm_s(i, 1);
        self.b.def_var(var, next);
        self.b.ins().jump(head, &[]);
        self.b.switch_to_block(done);
    }

    /// `body(s)` for every sample `s`; no loop when there is one sample.
    fn for_samples(&mut self, body: impl FnOnce(&mut Self, Value)) {
        let zero = self.b.ins().iconst(I64, 0);
        if self.plan.samples == 1 {
            body(self, zero);
        } else {
            let n = self.b.ins().iconst(I64, i64::from(self.plan.samples));
            self.counted_loop(zero, n, body);
        }
    }

    /// Address of candidate slot (row, sample, tile).
    fn candidate_addr(&mut self, l: &Launch, row: Value, sample: Value) -> Value {
        let tile = self.b.use_var(self.tile);
        let b = &mut self.b;
        let rs = b.ins().imul_imm_s(row, i64::from(self.plan.samples));
        let rs = b.ins().iadd(rs, sample);
        let slot = b.ins().imul(rs, l.tiles);
        let slot = b.ins().iadd(slot, tile);
        let off = b.ins().imul_imm_s(slot, CANDIDATE_BYTES);
        b.ins().iadd(l.candidates, off)
    }

    /// Address of (row, this tile)'s partial in the partials at `base` (processed or raw).
    fn lse_addr(&mut self, l: &Launch, base: Value, row: Value) -> Value {
        let tile = self.b.use_var(self.tile);
        let b = &mut self.b;
        let slot = b.ins().imul(row, l.tiles);
        let slot = b.ins().iadd(slot, tile);
        let off = b.ins().imul_imm_s(slot, LSE_BYTES);
        b.ins().iadd(base, off)
    }

    /// Stores an empty partial (`abi::LsePartial::EMPTY`) for (row, this tile) at `base`.
    fn clear_lse(&mut self, l: &Launch, base: Value, row: Value) {
        let addr = self.lse_addr(l, base, row);
        let zero = self.b.ins().iconst(I64, 0);
        for j in 0..KEPT_WINDOWS {
            self.b.ins().store(output(), zero, addr, 8 * j as i32);
        }
        let empty = self.b.ins().iconst(I32, i64::from(EMPTY_WINDOW));
        self.b.ins().store(output(), empty, addr, LSE_WINDOW_OFFSET);
    }

    fn store_candidate(&mut self, addr: Value, score: Value, index: Value, logit: Value) {
        let flags = output();
        self.b.ins().store(flags, score, addr, 0);
        self.b.ins().store(flags, index, addr, 4);
        self.b.ins().store(flags, logit, addr, 8);
    }

    fn emit(&mut self, tile_begin: Value, tile_end: Value) {
        let l = self.load_launch();
        for sample in 0..self.plan.samples {
            let none = self.b.ins().iconst(I64, 0);
            self.b.ins().stack_store(I64, none, self.noise_tags, 8 * sample as i32);
        }
        self.b.def_var(self.tile, tile_begin);
        let tile_head = self.b.create_block();
        let tile_body = self.b.create_block();
        let exit = self.b.create_block();
        self.b.ins().jump(tile_head, &[]);

        self.b.switch_to_block(tile_head);
        let tile = self.b.use_var(self.tile);
        let more = self.b.ins().icmp(IntCC::UnsignedLessThan, tile, tile_end);
        self.b.ins().brif(more, tile_body, &[], exit, &[]);

        self.b.switch_to_block(tile_body);
        self.emit_tile(&l, tile);
        let next = self.b.ins().iadd_imm_s(tile, 1);
        self.b.def_var(self.tile, next);
        self.b.ins().jump(tile_head, &[]);

        self.b.switch_to_block(exit);
        self.b.ins().return_(&[]);
    }

    fn emit_tile(&mut self, l: &Launch, tile: Value) {
        let vt = i64::from(self.plan.vocab_tile);
        let v_begin = self.b.ins().imul_imm_s(tile, vt);
        let v_tile_end = self.b.ins().iadd_imm_s(v_begin, vt);
        let v_end = self.b.ins().umin(v_tile_end, l.vocab);

        // Every slot of this tile starts empty; a tile with nothing allowed stays that way.
        let zero = self.b.ins().iconst(I64, 0);
        self.counted_loop(zero, l.batch, |k, row| {
            k.for_samples(|k, s| {
                let addr = k.candidate_addr(l, row, s);
                let neg_inf = k.b.ins().f32const(f32::NEG_INFINITY);
                let none = k.b.ins().iconst(I32, i64::from(INDEX_NONE));
                k.store_candidate(addr, neg_inf, none, neg_inf);
            });
            if k.plan.needs_lse {
                k.clear_lse(l, l.lse, row);
            }
            if let Some(raw) = &l.raw {
                k.clear_lse(l, raw.lse, row);
            }
        });

        let v_var = self.b.declare_var(I64);
        self.b.def_var(v_var, v_begin);
        let quad_head = self.b.create_block();
        let quad_body = self.b.create_block();
        let quad_next = self.b.create_block();
        let tile_done = self.b.create_block();
        self.b.ins().jump(quad_head, &[]);

        self.b.switch_to_block(quad_head);
        let v = self.b.use_var(v_var);
        let more = self.b.ins().icmp(IntCC::UnsignedLessThan, v, v_end);
        self.b.ins().brif(more, quad_body, &[], tile_done, &[]);

        self.b.switch_to_block(quad_body);
        let quad = self.emit_quad_head(l, v, v_begin);
        match self.plan.logits {
            LogitSource::Fused => self.emit_row_blocks(l, &quad, quad_next),
            LogitSource::Scratch { .. } => self.emit_scratch_rows(l, &quad, quad_next),
        }

        self.b.switch_to_block(quad_next);
        let next = self.b.ins().iadd_imm_s(v, 4);
        self.b.def_var(v_var, next);
        self.b.ins().jump(quad_head, &[]);

        self.b.switch_to_block(tile_done);
    }

    fn emit_quad_head(&mut self, l: &Launch, v: Value, v_begin: Value) -> Quad {
        let scratch_rows = self.scratch.map(|scratch| {
            let b = &mut self.b;
            let quad = b.ins().isub(v, v_begin);
            let quad = b.ins().ushr_imm_u(quad, 2);
            let rows = b.ins().imul(quad, l.batch);
            let off = b.ins().ishl_imm_u(rows, 4);
            b.ins().iadd(scratch, off)
        });
        let b = &mut self.b;
        // Tokens past the vocabulary read the last row (never out of bounds) and are masked off.
        let mut tokens = [v; 4];
        let mut weight_rows = [v; 4];
        for j in 0..4 {
            let t = b.ins().iadd_imm_s(v, j as i64);
            tokens[j] = b.ins().umin(t, l.last_token);
            let off = b.ins().imul(tokens[j], l.weight_row);
            weight_rows[j] = b.ins().iadd(l.weights, off);
        }
        let remaining = b.ins().isub(l.vocab, v);
        let full = b.ins().icmp_imm_u(IntCC::UnsignedGreaterThanOrEqual, remaining, 4);
        let one = b.ins().iconst(I64, 1);
        let partial = b.ins().ishl(one, remaining);
        let partial = b.ins().iadd_imm_s(partial, -1);
        let partial = b.ins().ireduce(I32, partial);
        let all = b.ins().iconst(I32, 0xf);
        let valid_bits = b.ins().select(full, all, partial);
        let bias = if self.plan.has_bias {
            let mut vec = None;
            for (j, &t) in tokens.iter().enumerate() {
                let off = b.ins().ishl_imm_u(t, 2);
                let addr = b.ins().iadd(l.bias, off);
                let x = b.ins().load(F32, input(), addr, 0);
                vec = Some(match vec {
                    None => b.ins().scalar_to_vector(F32X4, x),
                    Some(acc) => b.ins().insertlane(acc, x, j as u8),
                });
            }
            vec
        } else {
            None
        };
        Quad { v, weight_rows, valid_bits, bias, scratch_rows }
    }

    /// [`LogitSource::Scratch`]: the epilogue of every row of the quad, then `done`.
    fn emit_scratch_rows(&mut self, l: &Launch, q: &Quad, done: Block) {
        let zero = self.b.ins().iconst(I64, 0);
        self.b.def_var(self.epi_row, zero);
        let head = self.b.create_block();
        let body = self.b.create_block();
        let next = self.b.create_block();
        self.b.ins().jump(head, &[]);

        self.b.switch_to_block(head);
        let row = self.b.use_var(self.epi_row);
        let more = self.b.ins().icmp(IntCC::UnsignedLessThan, row, l.batch);
        self.b.ins().brif(more, body, &[], done, &[]);

        self.b.switch_to_block(body);
        self.emit_epilogue(l, q, row, next);
        self.b.switch_to_block(next);
        let row_next = self.b.ins().iadd_imm_s(row, 1);
        self.b.def_var(self.epi_row, row_next);
        self.b.ins().jump(head, &[]);
    }

    /// Full row blocks, then one remainder block, then `done`.
    fn emit_row_blocks(&mut self, l: &Launch, q: &Quad, done: Block) {
        let rb = self.plan.row_block as usize;
        let zero = self.b.ins().iconst(I64, 0);
        self.b.def_var(self.row, zero);
        let dispatch = self.b.create_block();
        let epi_head = self.b.create_block();
        let blocks: Vec<Block> = (0..=rb).map(|_| self.b.create_block()).collect();
        self.b.ins().jump(dispatch, &[]);

        self.b.switch_to_block(dispatch);
        let row = self.b.use_var(self.row);
        let rem = self.b.ins().isub(l.batch, row);
        let is_full = self.b.ins().icmp_imm_u(IntCC::UnsignedGreaterThanOrEqual, rem, rb as i64);
        let mut check = self.b.create_block();
        self.b.ins().brif(is_full, blocks[rb], &[], check, &[]);
        for (rows, &block) in blocks.iter().enumerate().take(rb).skip(1) {
            self.b.switch_to_block(check);
            let next_check = self.b.create_block();
            let is_rows = self.b.ins().icmp_imm_u(IntCC::Equal, rem, rows as i64);
            self.b.ins().brif(is_rows, block, &[], next_check, &[]);
            check = next_check;
        }
        self.b.switch_to_block(check);
        self.b.ins().jump(done, &[]);

        for (rows, &block) in blocks.iter().enumerate().skip(1) {
            self.b.switch_to_block(block);
            let row = self.b.use_var(self.row);
            self.emit_matmul_block(l, q, row, rows);
            let end = self.b.ins().iadd_imm_s(row, rows as i64);
            self.b.def_var(self.epi_row, row);
            self.b.def_var(self.epi_end, end);
            self.b.ins().jump(epi_head, &[]);
        }
        // blocks[0] is never a target (rem == 0 goes to `done`); give it a body so it is filled.
        self.b.switch_to_block(blocks[0]);
        self.b.ins().jump(done, &[]);

        self.b.switch_to_block(epi_head);
        let epi_row = self.b.use_var(self.epi_row);
        let epi_end = self.b.use_var(self.epi_end);
        let epi_body = self.b.create_block();
        let epi_done = self.b.create_block();
        let more = self.b.ins().icmp(IntCC::UnsignedLessThan, epi_row, epi_end);
        self.b.ins().brif(more, epi_body, &[], epi_done, &[]);

        self.b.switch_to_block(epi_body);
        let epi_next = self.b.create_block();
        self.emit_epilogue(l, q, epi_row, epi_next);
        self.b.switch_to_block(epi_next);
        let next = self.b.ins().iadd_imm_s(epi_row, 1);
        self.b.def_var(self.epi_row, next);
        self.b.ins().jump(epi_head, &[]);

        self.b.switch_to_block(epi_done);
        self.b.def_var(self.row, epi_end);
        self.b.ins().jump(dispatch, &[]);
    }

    /// Two f32x4 of weights from 8 consecutive elements of one weight row, in the lane order of
    /// the hidden chunk layout (16-bit types: even elements, then odd; f32: natural order).
    fn load_weight_chunk(&mut self, row: Value, offset: Value) -> (Value, Value) {
        let b = &mut self.b;
        let addr = b.ins().iadd(row, offset);
        match self.plan.dtype {
            DType::F32 => {
                let a = b.ins().load(F32X4, input(), addr, 0);
                let c = b.ins().load(F32X4, input(), addr, 16);
                (a, c)
            }
            DType::BF16 => {
                let x = b.ins().load(I32X4, input(), addr, 0);
                let even = b.ins().ishl_imm_u(x, 16);
                let high_half = iconst(b, I32X4, 0xffff_0000);
                let odd = b.ins().band(x, high_half);
                (math::from_bits(b, even), math::from_bits(b, odd))
            }
            DType::F16 => {
                let x = b.ins().load(I32X4, input(), addr, 0);
                let low_half = iconst(b, I32X4, 0xffff);
                let even = b.ins().band(x, low_half);
                let odd = b.ins().ushr_imm_u(x, 16);
                (math::f16_to_f32(b, even), math::f16_to_f32(b, odd))
            }
        }
    }

    /// One weight element at `row + offset`, widened to f32.
    fn load_weight_scalar(&mut self, row: Value, offset: Value) -> Value {
        let b = &mut self.b;
        let addr = b.ins().iadd(row, offset);
        match self.plan.dtype {
            DType::F32 => b.ins().load(F32, input(), addr, 0),
            DType::BF16 => {
                let x = b.ins().uload16(I32, input(), addr, 0);
                let bits = b.ins().ishl_imm_u(x, 16);
                math::from_bits(b, bits)
            }
            DType::F16 => {
                let x = b.ins().uload16(I32, input(), addr, 0);
                math::f16_to_f32(b, x)
            }
        }
    }

    /// `count` consecutive 8-element chunks of the quad's weights against the block's hidden
    /// rows, advancing the pointer variables past them.
    fn emit_chunks(&mut self, q: &Quad, acc: &[[Variable; 4]], h_ptrs: &[Variable; 4], w_off: Variable, rows: usize, count: usize) {
        let esize = self.plan.dtype.size_bytes() as i64;
        let k = rows as i64;
        let wo = self.b.use_var(w_off);
        for c in 0..count as i64 {
            let w_chunk = if c == 0 { wo } else { self.b.ins().iadd_imm_s(wo, 8 * esize * c) };
            for j in 0..4 {
                let hp = self.b.use_var(h_ptrs[j]);
                let (wa, wb) = self.load_weight_chunk(q.weight_rows[j], w_chunk);
                for (i, acc_row) in acc.iter().enumerate().take(rows) {
                    let off = (32 * (c * k + i as i64)) as i32;
                    let ha = self.b.ins().load(F32X4, input(), hp, off);
                    let a = self.b.use_var(acc_row[j]);
                    let a = self.b.ins().fma(ha, wa, a);
                    let hb = self.b.ins().load(F32X4, input(), hp, off + 16);
                    let a = self.b.ins().fma(hb, wb, a);
                    self.b.def_var(acc_row[j], a);
                }
            }
        }
        for &var in h_ptrs {
            let hp = self.b.use_var(var);
            let next = self.b.ins().iadd_imm_s(hp, 32 * k * count as i64);
            self.b.def_var(var, next);
        }
        let next = self.b.ins().iadd_imm_s(wo, 8 * esize * count as i64);
        self.b.def_var(w_off, next);
    }

    /// Logits of `rows` hidden rows starting at `row0` for the quad, into the logits slot.
    ///
    /// The block's hidden rows are interleaved by chunk (see `KernelArgs::hidden`), so one
    /// pointer with immediate offsets reaches every row. Each of the quad's 4 weight rows gets
    /// its own copy of that pointer: the loads then differ as far as Cranelift can tell, so it
    /// folds each into its FMA as a memory operand instead of merging them into registers that
    /// the 4·rows accumulators need.
    fn emit_matmul_block(&mut self, l: &Launch, q: &Quad, row0: Value, rows: usize) {
        let esize = self.plan.dtype.size_bytes() as i64;
        let k = rows as i64;
        let block_off = self.b.ins().imul(row0, l.hidden_row);
        let block = self.b.ins().iadd(l.hidden, block_off);
        let zero_vec = fconst(&mut self.b, F32X4, 0.0);
        let acc: Vec<[Variable; 4]> = (0..rows)
            .map(|_| {
                [0; 4].map(|_| {
                    let var = self.b.declare_var(F32X4);
                    self.b.def_var(var, zero_vec);
                    var
                })
            })
            .collect();
        let tail_acc: Vec<Variable> = (0..rows)
            .map(|_| {
                let var = self.b.declare_var(F32X4);
                self.b.def_var(var, zero_vec);
                var
            })
            .collect();

        // Whole 8-element chunks: `rows` × 32 bytes of hidden per chunk, two chunks per
        // iteration (after one lone chunk when their count is odd) to halve the loop overhead.
        let h_ptrs = [0; 4].map(|_| {
            let var = self.b.declare_var(I64);
            self.b.def_var(var, block);
            var
        });
        let w_off = self.b.declare_var(I64);
        let zero = self.b.ins().iconst(I64, 0);
        self.b.def_var(w_off, zero);
        let chunk_region = self.b.ins().imul_imm_s(l.chunk_bytes, k);
        let chunk_end = self.b.ins().iadd(block, chunk_region);
        let lone_chunk = self.b.create_block();
        let pair_check = self.b.create_block();
        let pair_loop = self.b.create_block();
        let chunks_done = self.b.create_block();
        let odd = self.b.ins().band_imm_s(l.chunk_bytes, 32);
        self.b.ins().brif(odd, lone_chunk, &[], pair_check, &[]);

        self.b.switch_to_block(lone_chunk);
        self.emit_chunks(q, &acc, &h_ptrs, w_off, rows, 1);
        self.b.ins().jump(pair_check, &[]);

        self.b.switch_to_block(pair_check);
        let hp = self.b.use_var(h_ptrs[0]);
        let more = self.b.ins().icmp(IntCC::UnsignedLessThan, hp, chunk_end);
        self.b.ins().brif(more, pair_loop, &[], chunks_done, &[]);

        self.b.switch_to_block(pair_loop);
        self.emit_chunks(q, &acc, &h_ptrs, w_off, rows, 2);
        let hp = self.b.use_var(h_ptrs[0]);
        let more = self.b.ins().icmp(IntCC::UnsignedLessThan, hp, chunk_end);
        self.b.ins().brif(more, pair_loop, &[], chunks_done, &[]);

        // The last `dim % 8` elements, one at a time across the quad's four rows.
        self.b.switch_to_block(chunks_done);
        let t_ptr = self.b.declare_var(I64);
        self.b.def_var(t_ptr, chunk_end);
        self.b.def_var(w_off, l.weight_tail_start);
        let block_region = self.b.ins().imul_imm_s(l.dim_bytes, k);
        let block_end = self.b.ins().iadd(block, block_region);
        let tail_loop = self.b.create_block();
        let tail_done = self.b.create_block();
        let any = self.b.ins().icmp(IntCC::UnsignedLessThan, chunk_end, block_end);
        self.b.ins().brif(any, tail_loop, &[], tail_done, &[]);

        self.b.switch_to_block(tail_loop);
        let tp = self.b.use_var(t_ptr);
        let wo = self.b.use_var(w_off);
        let first = self.load_weight_scalar(q.weight_rows[0], wo);
        let mut w = self.b.ins().scalar_to_vector(F32X4, first);
        for (j, &row) in q.weight_rows.iter().enumerate().skip(1) {
            let x = self.load_weight_scalar(row, wo);
            w = self.b.ins().insertlane(w, x, j as u8);
        }
        for (i, &var) in tail_acc.iter().enumerate() {
            let h = self.b.ins().load(F32, input(), tp, 4 * i as i32);
            let h = self.b.ins().splat(F32X4, h);
            let a = self.b.use_var(var);
            let a = self.b.ins().fma(h, w, a);
            self.b.def_var(var, a);
        }
        let tp_next = self.b.ins().iadd_imm_s(tp, 4 * k);
        let wo_next = self.b.ins().iadd_imm_s(wo, esize);
        self.b.def_var(t_ptr, tp_next);
        self.b.def_var(w_off, wo_next);
        let more = self.b.ins().icmp(IntCC::UnsignedLessThan, tp_next, block_end);
        self.b.ins().brif(more, tail_loop, &[], tail_done, &[]);

        self.b.switch_to_block(tail_done);
        for i in 0..rows {
            let parts = acc[i].map(|v| self.b.use_var(v));
            let sum = math::transpose_sum(&mut self.b, parts);
            let tail = self.b.use_var(tail_acc[i]);
            let logits = self.b.ins().fadd(sum, tail);
            self.b.ins().stack_store(I64, logits, self.logits_slot, (16 * i) as i32);
        }
    }

    /// `steps` applied in order to the row's four matmul logits `x` (DESIGN.md step 3).
    fn emit_steps(&mut self, l: &Launch, q: &Quad, row: Value, mut x: Value, steps: &[Step]) -> Value {
        for &step in steps {
            let b = &mut self.b;
            x = match step {
                Step::Temperature => {
                    let off = b.ins().ishl_imm_u(row, 2);
                    let addr = b.ins().iadd(l.row_scale, off);
                    let scale = b.ins().load(F32, input(), addr, 0);
                    let scale = b.ins().splat(F32X4, scale);
                    b.ins().fmul(x, scale)
                }
                // `q.bias` is loaded exactly when the pipeline has a bias step.
                Step::Bias => match q.bias {
                    Some(bias) => b.ins().fadd(x, bias),
                    None => x,
                },
                Step::Softcap(cap) => math::softcap_f32(b, x, cap),
                Step::Penalties => self.emit_listed(q, row, x, l.mask_words, [l.pen_bits, l.pen_table, l.penalize]),
                // `l.logit_bias` is loaded exactly when the pipeline has this step.
                Step::LogitBias => match l.logit_bias {
                    Some(table) => self.emit_listed(q, row, x, l.mask_words, table),
                    None => x,
                },
            };
        }
        x
    }

    /// DESIGN.md steps 2–7 for one row of the quad; ends by jumping to `next`.
    fn emit_epilogue(&mut self, l: &Launch, q: &Quad, row: Value, next: Block) {
        // The scratch is only 4-byte aligned. Only `LseSums::ScratchPass` writes it: each
        // quad-row's slot after its one load.
        let scratch_flags = if self.plan.lse_sums() == LseSums::ScratchPass { output() } else { input() };
        let (addr, flags) = match q.scratch_rows {
            Some(rows) => {
                let off = self.b.ins().ishl_imm_u(row, 4);
                (self.b.ins().iadd(rows, off), scratch_flags)
            }
            None => {
                let block_row = self.b.use_var(self.row);
                let b = &mut self.b;
                let slot_addr = b.ins().stack_addr(I64, self.logits_slot, 0);
                let local = b.ins().isub(row, block_row);
                let local_off = b.ins().ishl_imm_u(local, 4);
                (b.ins().iadd(slot_addr, local_off), own())
            }
        };
        let b = &mut self.b;
        let raw = b.ins().load(F32X4, flags, addr, 0);

        // Step 2: a NaN/inf raw logit of an existing token poisons the (row, tile) for every sample.
        let raw_bits = math::to_bits(b, raw);
        let exp_mask = iconst(b, I32X4, 0x7f80_0000);
        let exp = b.ins().band(raw_bits, exp_mask);
        let nonfinite = b.ins().icmp(IntCC::Equal, exp, exp_mask);
        let nonfinite = b.ins().vhigh_bits(I32, nonfinite);
        let nonfinite = b.ins().band(nonfinite, q.valid_bits);
        let poison = b.create_block();
        let finite = b.create_block();
        b.set_cold_block(poison);
        b.ins().brif(nonfinite, poison, &[], finite, &[]);

        self.b.switch_to_block(poison);
        // score = +inf makes the marker sticky: no later token of the tile can beat it.
        self.for_samples(|k, s| {
            let addr = k.candidate_addr(l, row, s);
            let inf = k.b.ins().f32const(f32::INFINITY);
            let nan = k.b.ins().f32const(f32::NAN);
            let index = k.b.ins().iconst(I32, i64::from(INDEX_NONFINITE));
            k.store_candidate(addr, inf, index, nan);
        });
        if self.plan.lse_sums() == LseSums::ScratchPass {
            // The poisoned quad adds nothing to the row's partials.
            let ninf = fconst(&mut self.b, F32X4, f32::NEG_INFINITY);
            if self.plan.needs_lse {
                self.b.ins().store(output(), ninf, addr, 0);
            }
            if let Some(half) = l.raw_half {
                let raw_addr = self.b.ins().iadd(addr, half);
                self.b.ins().store(output(), ninf, raw_addr, 0);
            }
        }
        self.b.ins().jump(next, &[]);

        self.b.switch_to_block(finite);
        // Step 3.
        let steps = self.plan.steps.clone();
        let x = self.emit_steps(l, q, row, raw, &steps);

        // Step 10: the raw logits, from the same matmul value by the model's steps alone.
        let raw_steps = self.plan.raw.as_ref().map(|rp| rp.steps.clone());
        let raw_x = raw_steps.map(|steps| self.emit_steps(l, q, row, raw, &steps));

        // Step 4.
        let b = &mut self.b;
        let allowed_bits = if self.plan.has_mask {
            let word = b.ins().ushr_imm_u(q.v, 5);
            let base = b.ins().imul(row, l.mask_words);
            let word = b.ins().iadd(base, word);
            let off = b.ins().ishl_imm_u(word, 2);
            let addr = b.ins().iadd(l.allowed, off);
            let bits = b.ins().load(I32, input(), addr, 0);
            let shift = b.ins().band_imm_s(q.v, 31);
            let shift = b.ins().ireduce(I32, shift);
            let bits = b.ins().ushr(bits, shift);
            b.ins().band(bits, q.valid_bits)
        } else {
            q.valid_bits
        };
        let allowed = lane_mask(b, allowed_bits);

        if let Some([thresholds, counts]) = l.ranks {
            // Step 7c: count against the row's target logit (raw in the raw mode), when the
            // launch ranks; everything else goes on below.
            let (count, rest) = (self.b.create_block(), self.b.create_block());
            self.b.ins().brif(counts, count, &[], rest, &[]);
            self.b.switch_to_block(count);
            let (tx, tallowed) = match raw_x {
                Some(rx) => (rx, lane_mask(&mut self.b, q.valid_bits)),
                None => (x, allowed),
            };
            self.emit_rank_count(l, q, row, tx, tallowed, thresholds, counts);
            self.b.ins().jump(rest, &[]);
            self.b.switch_to_block(rest);
        }

        if self.plan.needs_lse {
            self.emit_partial(l, l.lse, row, x, allowed, addr);
        }
        // The raw distribution counts every existing token, allowed or not.
        let raw_lanes = match (raw_x, &l.raw) {
            (Some(rx), Some(rl)) => {
                let valid = lane_mask(&mut self.b, q.valid_bits);
                let raw_addr = match l.raw_half {
                    Some(half) => self.b.ins().iadd(addr, half),
                    None => addr,
                };
                self.emit_partial(l, rl.lse, row, rx, valid, raw_addr);
                Some((rx, valid, rl))
            }
            _ => None,
        };
        if let Some(targets) = l.targets {
            // The reported logit: raw in the raw mode.
            let (tx, tallowed) = raw_lanes.as_ref().map_or((x, allowed), |r| (r.0, r.1));
            self.emit_target(q, row, tx, tallowed, targets);
        }
        if self.plan.list_capacity > 0 {
            let spec = ListSpec { lists: l.lists, per_tile: l.per_tile, bounds: l.list_bounds };
            // `paired_sig` is imported exactly when the plan's lists carry raw logits.
            match (&raw_lanes, self.paired_sig) {
                (Some((rx, _, rl)), Some(sig)) => {
                    self.emit_list_update(l, q, row, spec, x, allowed, Some((*rx, rl.list_raws, rl.insert_paired, sig)))
                }
                _ => self.emit_list_update(l, q, row, spec, x, allowed, None),
            }
        }
        if l.capture {
            // The raw logits are captured where the lists carry them (`kernel::Capture::raws`).
            let paired = self.plan.raw.as_ref().is_some_and(|r| r.paired_lists);
            let rx = raw_lanes.as_ref().filter(|_| paired).map(|r| r.0);
            self.emit_capture(q, row, x, allowed, rx);
        }
        if let Some((rx, valid, rl)) = &raw_lanes {
            if self.plan.raw.as_ref().is_some_and(|r| r.list_capacity > 0) {
                let spec = ListSpec { lists: rl.lists, per_tile: rl.per_tile, bounds: l.raw_list_bounds };
                self.emit_list_update(l, q, row, spec, *rx, *valid, None);
            }
        }
        // The winner's carried logit: the raw one in the raw mode (its logprob is reported).
        let carried = raw_lanes.as_ref().map_or(x, |r| r.0);

        // Steps 5 and 6, per sample.
        // A row that takes its argmax (greedy, or drawn in stage three) draws no noise.
        let greedy = if self.plan.argmax_rows && !self.plan.argmax {
            let off = self.b.ins().ishl_imm_u(row, 2);
            let addr = self.b.ins().iadd(l.row_argmax, off);
            Some(self.b.ins().load(I32, input(), addr, 0))
        } else {
            None
        };
        // The best score this quad could reach: its best eligible logit plus the largest noise
        // `gumbel_f32` can return. Rounding is monotone, so when even that does not beat the
        // running winner, no token of the quad can, and its Philox and Gumbel work is skipped.
        let reachable = if self.plan.argmax {
            None
        } else {
            let b = &mut self.b;
            let xs = eligible(b, x, allowed);
            let x_max = math::hmax(b, xs);
            let noise_max = b.ins().f32const(flashsample_abi::rng::gumbel_f32_upper_bound());
            Some((x_max, b.ins().fadd(x_max, noise_max)))
        };
        self.for_samples(|k, s| {
            let sample_done = k.b.create_block();
            let score = if let Some((x_max, reachable)) = reachable {
                // With residual lists the bar is the list's last entry (at most the winner's
                // score), so the skip never drops a token the list keeps.
                let best_so_far = match l.residual {
                    Some(residual) => {
                        let tail = k.residual_tail(l, row, residual);
                        k.b.ins().load(F32, output(), tail, 0)
                    }
                    None => {
                        let addr = k.candidate_addr(l, row, s);
                        k.b.ins().load(F32, output(), addr, 0)
                    }
                };
                // The row's cross-tile bound: the best score a finished tile of this launch
                // reached. That token may have a higher index than this quad's, so only a
                // score strictly below it is beaten (the running winner's tokens come first).
                let row_bound = l.row_bounds.map(|bounds| {
                    let slot = k.b.ins().imul_imm_s(row, i64::from(k.plan.samples));
                    let slot = k.b.ins().iadd(slot, s);
                    let off = k.b.ins().ishl_imm_u(slot, 2);
                    let addr = k.b.ins().iadd(bounds, off);
                    k.b.ins().load(F32, output(), addr, 0)
                });
                let tests = k.plan.noise_skip.tests_bounds();
                let unreachable = |b: &mut FunctionBuilder, reach: Value| {
                    if !tests {
                        return b.ins().iconst(types::I8, 0);
                    }
                    let beaten = b.ins().fcmp(FloatCC::LessThanOrEqual, reach, best_so_far);
                    match row_bound {
                        Some(bound) => {
                            let below = b.ins().fcmp(FloatCC::LessThan, reach, bound);
                            b.ins().bor(beaten, below)
                        }
                        None => beaten,
                    }
                };
                let hopeless = unreachable(&mut k.b, reachable);
                let contender = k.b.create_block();
                k.b.ins().brif(hopeless, sample_done, &[], contender, &[]);
                k.b.switch_to_block(contender);
                let score_var = k.b.declare_var(F32X4);
                let noisy = k.b.create_block();
                let join = k.b.create_block();
                if let Some(g) = greedy {
                    let greedy_block = k.b.create_block();
                    k.b.ins().brif(g, greedy_block, &[], noisy, &[]);
                    k.b.switch_to_block(greedy_block);
                    k.b.def_var(score_var, x);
                    k.b.ins().jump(join, &[]);
                } else {
                    k.b.ins().jump(noisy, &[]);
                }
                k.b.switch_to_block(noisy);
                let words = k.noise_words(l, q, row, s);
                let b = &mut k.b;
                // The second skip, now that the uniforms are known: the quad's largest noise is
                // at most `gumbel_bucket_bound` of its largest uniform's leading ones, so a quad
                // that cannot win even so skips the Gumbel transform (two logarithms and three
                // divisions) and the selection. With flat logits, where the first skip never
                // fires, this one skips all but a few quads per tile.
                let hi01 = b.ins().umax(words[0], words[1]);
                let hi23 = b.ins().umax(words[2], words[3]);
                let bits_max = b.ins().umax(hi01, hi23);
                let leading = b.ins().bnot(bits_max);
                let leading = b.ins().bor_imm_u(leading, 0xff);
                let leading_ones = b.ins().clz(leading);
                let lf = b.ins().fcvt_from_sint(F32, leading_ones);
                let one = b.ins().f32const(1.0);
                let lf = b.ins().fadd(lf, one);
                let ln2 = b.ins().f32const(std::f32::consts::LN_2);
                let bound = b.ins().fmul(lf, ln2);
                let slack = b.ins().f32const(flashsample_abi::rng::GUMBEL_BUCKET_SLACK);
                let bound = b.ins().fadd(bound, slack);
                let reach = b.ins().fadd(x_max, bound);
                let beaten = unreachable(b, reach);
                let gumbel = b.create_block();
                b.ins().brif(beaten, sample_done, &[], gumbel, &[]);
                b.switch_to_block(gumbel);
                let mut bits = b.ins().scalar_to_vector(I32X4, words[0]);
                for (lane, &w) in words.iter().enumerate().skip(1) {
                    bits = b.ins().insertlane(bits, w, lane as u8);
                }
                let noise = math::gumbel_f32(b, bits);
                let noisy_score = b.ins().fadd(x, noise);
                k.b.def_var(score_var, noisy_score);
                k.b.ins().jump(join, &[]);
                k.b.switch_to_block(join);
                k.b.use_var(score_var)
            } else {
                x
            };
            if let Some(residual) = l.residual {
                k.emit_residual_update(l, row, q, Lanes { score, x, allowed }, residual);
            }
            k.emit_select(l, q, row, s, Lanes { score, x: carried, allowed });
            k.b.ins().jump(sample_done, &[]);
            k.b.switch_to_block(sample_done);
        });
        self.b.ins().jump(next, &[]);
    }

    /// The four Philox words of (`row`, sample `s`, this quad): for a batch of one row, from one
    /// scalar Philox; otherwise from `row_group_noise_words` (four generators in the lanes of
    /// one vector Philox cost more than one scalar one, so a lone row keeps the scalar one).
    fn noise_words(&mut self, l: &Launch, q: &Quad, row: Value, s: Value) -> [Value; 4] {
        let single = self.b.create_block();
        let grouped = self.b.create_block();
        let join = self.b.create_block();
        let vars = [(); 4].map(|_| self.b.declare_var(I32));
        let lone = self.b.ins().icmp_imm_u(IntCC::Equal, l.batch, 1);
        self.b.ins().brif(lone, single, &[], grouped, &[]);

        self.b.switch_to_block(single);
        let b = &mut self.b;
        let quad_index = b.ins().ushr_imm_u(q.v, 2);
        let quad_index = b.ins().iadd(quad_index, l.quad_offset);
        let c0 = b.ins().ireduce(I32, quad_index);
        let c1 = b.ins().load(I32, input(), l.row_counters, 0);
        let key = b.ins().load(I64, input(), l.row_keys, 0);
        let key_lo = b.ins().ireduce(I32, key);
        let key_hi = b.ins().ushr_imm_u(key, 32);
        let key_hi = b.ins().ireduce(I32, key_hi);
        let c2 = b.ins().ireduce(I32, s);
        let c3 = b.ins().load(I32, input(), l.row_word3, 0);
        let words = math::philox4x32_10(b, [c0, c1, c2, c3], [key_lo, key_hi]);
        for (&var, w) in vars.iter().zip(words) {
            self.b.def_var(var, w);
        }
        self.b.ins().jump(join, &[]);

        self.b.switch_to_block(grouped);
        let words = self.row_group_noise_words(l, q, row, s);
        for (&var, w) in vars.iter().zip(words) {
            self.b.def_var(var, w);
        }
        self.b.ins().jump(join, &[]);

        self.b.switch_to_block(join);
        vars.map(|var| self.b.use_var(var))
    }

    /// The four Philox words of (`row`, sample `s`, this quad), computed for the row's group of
    /// four rows (`row & !3` ..) at once, one generator per lane, the first time a row of the
    /// group needs them, and kept in `noise_words` under the tag (quad, group) per sample. The
    /// row arrays are padded to whole groups (`KernelArgs::row_keys`), so the lanes past the
    /// batch read padding and are never used.
    fn row_group_noise_words(&mut self, l: &Launch, q: &Quad, row: Value, s: Value) -> [Value; 4] {
        let b = &mut self.b;
        let group = b.ins().ushr_imm_u(row, 2);
        let v_high = b.ins().ishl_imm_u(q.v, 32);
        let group_tag = b.ins().iadd_imm_s(group, 1);
        let tag = b.ins().bor(v_high, group_tag);
        let tags = b.ins().stack_addr(I64, self.noise_tags, 0);
        let s8 = b.ins().ishl_imm_u(s, 3);
        let tag_addr = b.ins().iadd(tags, s8);
        let words_base = b.ins().stack_addr(I64, self.noise_words, 0);
        let s64 = b.ins().ishl_imm_u(s, 6);
        let words_addr = b.ins().iadd(words_base, s64);
        let cached = b.ins().load(I64, own(), tag_addr, 0);
        let fresh = b.ins().icmp(IntCC::Equal, cached, tag);
        let compute = b.create_block();
        let have = b.create_block();
        b.set_cold_block(compute);
        b.ins().brif(fresh, have, &[], compute, &[]);

        b.switch_to_block(compute);
        let quad_index = b.ins().ushr_imm_u(q.v, 2);
        let quad_index = b.ins().iadd(quad_index, l.quad_offset);
        let c0 = b.ins().ireduce(I32, quad_index);
        let c0 = b.ins().splat(I32X4, c0);
        let first_row = b.ins().ishl_imm_u(group, 2);
        let row4 = b.ins().ishl_imm_u(first_row, 2);
        let ctr_addr = b.ins().iadd(l.row_counters, row4);
        let c1 = b.ins().load(I32X4, input(), ctr_addr, 0);
        let row8 = b.ins().ishl_imm_u(first_row, 3);
        let key_addr = b.ins().iadd(l.row_keys, row8);
        // Keys 0–1 and 2–3 as (lo, hi) word pairs; lanes of the low and of the high words.
        let keys01 = b.ins().load(I32X4, input(), key_addr, 0);
        let keys23 = b.ins().load(I32X4, input(), key_addr, 16);
        let key_lo = math::shuffle32(b, keys01, keys23, [0, 2, 4, 6]);
        let key_hi = math::shuffle32(b, keys01, keys23, [1, 3, 5, 7]);
        let c2 = b.ins().ireduce(I32, s);
        let c2 = b.ins().splat(I32X4, c2);
        let word3_addr = b.ins().iadd(l.row_word3, row4);
        let c3 = b.ins().load(I32X4, input(), word3_addr, 0);
        let lanes = math::philox4x32_10(b, [c0, c1, c2, c3], [key_lo, key_hi]);
        for (j, &w) in lanes.iter().enumerate() {
            b.ins().store(own(), w, words_addr, 16 * j as i32);
        }
        b.ins().store(own(), tag, tag_addr, 0);
        b.ins().jump(have, &[]);

        b.switch_to_block(have);
        let lane = b.ins().band_imm_s(row, 3);
        let lane4 = b.ins().ishl_imm_u(lane, 2);
        let lane_addr = b.ins().iadd(words_addr, lane4);
        [0, 1, 2, 3].map(|j| b.ins().load(I32, own(), lane_addr, 16 * j))
    }

    /// The address of lane `lane` (i32, 0..4) of the vector stored at the start of the
    /// scratch slot (a second vector at +16 has its lane at +16 from it).
    fn scratch_lane(&mut self, lane: Value) -> Value {
        let b = &mut self.b;
        let lane64 = b.ins().uextend(I64, lane);
        let off = b.ins().ishl_imm_u(lane64, 2);
        let base = b.ins().stack_addr(I64, self.scratch_slot, 0);
        b.ins().iadd(base, off)
    }

    /// Step 6: fold this quad's best allowed token into the running winner of (row, sample, tile).
    fn emit_select(&mut self, l: &Launch, q: &Quad, row: Value, s: Value, lanes: Lanes) {
        let Lanes { score, x, allowed } = lanes;
        let addr = self.candidate_addr(l, row, s);
        let b = &mut self.b;
        let scores = eligible(b, score, allowed);
        let best_here = math::hmax(b, scores);
        let best_so_far = b.ins().load(F32, output(), addr, 0);
        // Strictly greater: on a tie the earlier (lower) token of an earlier quad keeps the slot.
        let better = b.ins().fcmp(FloatCC::GreaterThan, best_here, best_so_far);
        let update = b.create_block();
        let done = b.create_block();
        b.ins().brif(better, update, &[], done, &[]);

        b.switch_to_block(update);
        let splat = b.ins().splat(F32X4, best_here);
        let winners = b.ins().fcmp(FloatCC::Equal, scores, splat);
        let winners = b.ins().vhigh_bits(I32, winners);
        // The lowest winning lane: ties inside the quad go to the lower token.
        let lane = b.ins().ctz(winners);
        b.ins().stack_store(I64, score, self.scratch_slot, 0);
        b.ins().stack_store(I64, x, self.scratch_slot, 16);
        let lane_addr = self.scratch_lane(lane);
        let b = &mut self.b;
        let win_score = b.ins().load(F32, own(), lane_addr, 0);
        let win_logit = b.ins().load(F32, own(), lane_addr, 16);
        let v32 = b.ins().ireduce(I32, q.v);
        let index = b.ins().iadd(v32, lane);
        self.store_candidate(addr, win_score, index, win_logit);
        self.b.ins().jump(done, &[]);
        self.b.switch_to_block(done);
    }

    /// Step 3, a per-row token table (penalties, logit bias): one bitset test per quad; the rare
    /// quads holding a listed token call the table's `apply_quad`, which binary-searches the
    /// row's list (DESIGN.md). `table` is the table's `[bits, table, helper]`.
    fn emit_listed(&mut self, q: &Quad, row: Value, x: Value, mask_words: Value, table: [Value; 3]) -> Value {
        let [table_bits, table_ptr, helper] = table;
        let b = &mut self.b;
        let word = b.ins().ushr_imm_u(q.v, 5);
        let base = b.ins().imul(row, mask_words);
        let word = b.ins().iadd(base, word);
        let off = b.ins().ishl_imm_u(word, 2);
        let addr = b.ins().iadd(table_bits, off);
        let bits = b.ins().load(I32, input(), addr, 0);
        let shift = b.ins().band_imm_s(q.v, 31);
        let shift = b.ins().ireduce(I32, shift);
        let bits = b.ins().ushr(bits, shift);
        let listed = b.ins().band(bits, q.valid_bits);
        let x_var = b.declare_var(F32X4);
        b.def_var(x_var, x);
        let call = b.create_block();
        let done = b.create_block();
        b.set_cold_block(call);
        b.ins().brif(listed, call, &[], done, &[]);

        b.switch_to_block(call);
        b.ins().stack_store(I64, x, self.call_slot, 0);
        let ptr = b.ins().stack_addr(I64, self.call_slot, 0);
        b.ins().call_indirect(self.helper_sig, helper, &[table_ptr, row, q.v, ptr]);
        let applied = b.ins().stack_load(I64, F32X4, self.call_slot, 0);
        b.def_var(x_var, applied);
        b.ins().jump(done, &[]);

        b.switch_to_block(done);
        b.use_var(x_var)
    }

    /// Step 6b: when the quad's best eligible logit beats the entry that ranks last in this
    /// (row, tile)'s list in `spec` (entry 0: during a launch the lists are heaps, `lists.rs`),
    /// hand the quad to `insert_quad`. Tokens arrive in increasing order, so an equal logit
    /// never displaces an entry (ties go to the lower index). With `paired =
    /// Some((raw, list_raws, insert_paired, its signature))` (step 10) the entries' raw logits
    /// move with them.
    #[allow(clippy::too_many_arguments)]
    fn emit_list_update(&mut self, l: &Launch, q: &Quad, row: Value, spec: ListSpec, x: Value, allowed: Value, paired: Option<(Value, Value, Value, SigRef)>) {
        let tile = self.b.use_var(self.tile);
        let b = &mut self.b;
        let xs = eligible(b, x, allowed);
        let best = math::hmax(b, xs);
        let slot = b.ins().imul(row, l.tiles);
        let slot = b.ins().iadd(slot, tile);
        let slot = b.ins().imul(slot, spec.per_tile);
        let off = b.ins().imul_imm_s(slot, SCORED_BYTES);
        let list = b.ins().iadd(spec.lists, off);
        let bar = b.ins().load(F32, output(), list, 0);
        let beats = b.ins().fcmp(FloatCC::GreaterThan, best, bar);
        // The row's list bound: no token below it is among the row's top `need` (DESIGN.md
        // step 6b). A token equal to it may be (ties go by index), so it still enters.
        let beats = match spec.bounds {
            Some(bounds) => {
                let off = b.ins().ishl_imm_u(row, 2);
                let addr = b.ins().iadd(bounds, off);
                let bound = b.ins().load(F32, output(), addr, 0);
                let reaches = b.ins().fcmp(FloatCC::GreaterThanOrEqual, best, bound);
                b.ins().band(beats, reaches)
            }
            None => beats,
        };
        let call = b.create_block();
        let done = b.create_block();
        b.set_cold_block(call);
        b.ins().brif(beats, call, &[], done, &[]);

        b.switch_to_block(call);
        b.ins().stack_store(I64, xs, self.call_slot, 0);
        let ptr = b.ins().stack_addr(I64, self.call_slot, 0);
        match paired {
            None => {
                b.ins().call_indirect(self.helper_sig, l.insert, &[list, spec.per_tile, q.v, ptr]);
            }
            Some((raw, list_raws, insert_paired, sig)) => {
                b.ins().stack_store(I64, raw, self.call_slot, 16);
                // The companion holds one f32 per entry, at the same slot.
                let raw_off = b.ins().imul_imm_s(slot, 4);
                let raws = b.ins().iadd(list_raws, raw_off);
                b.ins().call_indirect(sig, insert_paired, &[list, raws, spec.per_tile, q.v, ptr]);
            }
        }
        b.ins().jump(done, &[]);
        b.switch_to_block(done);
    }

    /// The address of the last entry of this (row, tile)'s residual list.
    fn residual_tail(&mut self, l: &Launch, row: Value, [lists, per_tile, _]: [Value; 3]) -> Value {
        let tile = self.b.use_var(self.tile);
        let b = &mut self.b;
        let slot = b.ins().imul(row, l.tiles);
        let slot = b.ins().iadd(slot, tile);
        let slot = b.ins().iadd_imm_s(slot, 1);
        let slot = b.ins().imul(slot, per_tile);
        let off = b.ins().imul_imm_s(slot, CANDIDATE_BYTES);
        let end = b.ins().iadd(lists, off);
        b.ins().iadd_imm_s(end, -CANDIDATE_BYTES)
    }

    /// Speculative verification: when the quad's best eligible score beats the last entry of
    /// this (row, tile)'s residual list, hand the quad's scores and logits to
    /// `insert_residual_quad`. Tokens arrive in increasing order, so an equal score never
    /// displaces an entry (ties go to the lower index).
    fn emit_residual_update(&mut self, l: &Launch, row: Value, q: &Quad, lanes: Lanes, residual: [Value; 3]) {
        let [_, per_tile, insert] = residual;
        let tail = self.residual_tail(l, row, residual);
        let b = &mut self.b;
        let scores = eligible(b, lanes.score, lanes.allowed);
        let best = math::hmax(b, scores);
        let last = b.ins().load(F32, output(), tail, 0);
        let beats = b.ins().fcmp(FloatCC::GreaterThan, best, last);
        let call = b.create_block();
        let done = b.create_block();
        b.set_cold_block(call);
        b.ins().brif(beats, call, &[], done, &[]);

        b.switch_to_block(call);
        let first = b.ins().imul_imm_s(per_tile, CANDIDATE_BYTES);
        let list = b.ins().isub(tail, first);
        let list = b.ins().iadd_imm_s(list, CANDIDATE_BYTES);
        b.ins().stack_store(I64, scores, self.scratch_slot, 0);
        b.ins().stack_store(I64, lanes.x, self.scratch_slot, 16);
        let ptr = b.ins().stack_addr(I64, self.scratch_slot, 0);
        b.ins().call_indirect(self.helper_sig, insert, &[list, per_tile, q.v, ptr]);
        b.ins().jump(done, &[]);
        b.switch_to_block(done);
    }

    /// Step 7b: if the row's target lies in this quad, its transformed logit (`-inf` when the
    /// token is excluded) goes to `target_logits[row]`. Exactly one quad of the launch holds
    /// it, so the store races with nothing.
    fn emit_target(&mut self, q: &Quad, row: Value, x: Value, allowed: Value, [targets, target_logits]: [Value; 2]) {
        let b = &mut self.b;
        let row4 = b.ins().ishl_imm_u(row, 2);
        let at = b.ins().iadd(targets, row4);
        let target = b.ins().load(I32, input(), at, 0);
        let v32 = b.ins().ireduce(I32, q.v);
        let lane = b.ins().isub(target, v32);
        let here = b.ins().icmp_imm_u(IntCC::UnsignedLessThan, lane, 4);
        let store = b.create_block();
        let done = b.create_block();
        b.ins().brif(here, store, &[], done, &[]);

        b.switch_to_block(store);
        let xs = eligible(b, x, allowed);
        b.ins().stack_store(I64, xs, self.scratch_slot, 0);
        let lane_addr = self.scratch_lane(lane);
        let b = &mut self.b;
        let value = b.ins().load(F32, own(), lane_addr, 0);
        let dst = b.ins().iadd(target_logits, row4);
        b.ins().store(output(), value, dst, 0);
        b.ins().jump(done, &[]);
        b.switch_to_block(done);
    }

    /// The exact nucleus's capture (`kernel::Capture`): a row with a slot stores the quad's
    /// eligible logits (and `raw_x`, the raw ones, where the lists carry them) at
    /// `slot · stride + v`; a launch without a capture (null slots) or a row without a slot
    /// skips it.
    fn emit_capture(&mut self, q: &Quad, row: Value, x: Value, allowed: Value, raw_x: Option<Value>) {
        let slots = self.arg(offset_of!(KernelArgs, capture_slots));
        let b = &mut self.b;
        let (lookup, store, done) = (b.create_block(), b.create_block(), b.create_block());
        b.ins().brif(slots, lookup, &[], done, &[]);

        b.switch_to_block(lookup);
        let row4 = b.ins().ishl_imm_u(row, 2);
        let at = b.ins().iadd(slots, row4);
        let slot = b.ins().load(I32, input(), at, 0);
        let none = b.ins().icmp_imm_u(IntCC::Equal, slot, i64::from(crate::kernel::CAPTURE_NONE));
        b.ins().brif(none, done, &[], store, &[]);

        b.switch_to_block(store);
        let logits = self.arg(offset_of!(KernelArgs, capture_logits));
        let stride = self.arg(offset_of!(KernelArgs, capture_stride));
        // Not null where `raw_x` is given: a capture of a pipeline whose lists carry raw logits
        // has them (checked at launch).
        let raws = raw_x.map(|rx| (rx, self.arg(offset_of!(KernelArgs, capture_raws))));
        let b = &mut self.b;
        let slot = b.ins().uextend(I64, slot);
        let first = b.ins().imul(slot, stride);
        let token = b.ins().iadd(first, q.v);
        let off = b.ins().ishl_imm_u(token, 2);
        let xs = eligible(b, x, allowed);
        let dst = b.ins().iadd(logits, off);
        b.ins().store(output(), xs, dst, 0);
        if let Some((rx, raws)) = raws {
            let dst = b.ins().iadd(raws, off);
            b.ins().store(output(), rx, dst, 0);
        }
        b.ins().jump(done, &[]);
        b.switch_to_block(done);
    }

    /// Step 7c: adds the quad's tokens whose eligible logit (`-inf` when excluded) is at least
    /// the row's threshold `thresholds[row]` (its target's logit) to the (row, tile) count;
    /// only this tile's task touches that count.
    #[allow(clippy::too_many_arguments)]
    fn emit_rank_count(&mut self, l: &Launch, q: &Quad, row: Value, x: Value, allowed: Value, thresholds: Value, counts: Value) {
        let tile = self.b.use_var(self.tile);
        let b = &mut self.b;
        let row4 = b.ins().ishl_imm_u(row, 2);
        let at = b.ins().iadd(thresholds, row4);
        let threshold = b.ins().load(F32, input(), at, 0);
        let threshold = b.ins().splat(F32X4, threshold);
        let xs = eligible(b, x, allowed);
        let at_least = b.ins().fcmp(FloatCC::GreaterThanOrEqual, xs, threshold);
        let lanes = b.ins().vhigh_bits(I32, at_least);
        let lanes = b.ins().band(lanes, q.valid_bits);
        let n = b.ins().popcnt(lanes);
        let slot = b.ins().imul(row, l.tiles);
        let slot = b.ins().iadd(slot, tile);
        let off = b.ins().ishl_imm_u(slot, 2);
        let at = b.ins().iadd(counts, off);
        let c = b.ins().load(I32, output(), at, 0);
        let c = b.ins().iadd(c, n);
        b.ins().store(output(), c, at, 0);
    }

    /// Step 7 for one partial (at `base`) by the plan's [`LseSums`]: the quad added to it
    /// here, or its counted logits (`-inf` for the others) stored at `slot` for `lse_pass`.
    fn emit_partial(&mut self, l: &Launch, base: Value, row: Value, x: Value, allowed: Value, slot: Value) {
        match self.plan.lse_sums() {
            LseSums::Epilogue => self.emit_lse(l, base, row, x, allowed),
            LseSums::ScratchPass => {
                let b = &mut self.b;
                let counted = counted_lanes(b, x, allowed);
                let ninf = fconst(b, F32X4, f32::NEG_INFINITY);
                let kept = math::select(b, counted, x, ninf);
                b.ins().store(output(), kept, slot, 0);
            }
        }
    }

    /// Step 7: adds the quad's counted tokens (allowed, finite `x`) to the (row, tile)
    /// partial, exactly as `abi::LsePartial::add` does: the quad's top window first (a new
    /// top moves the kept sums down), then each lane's integer term into the sum of its window.
    fn emit_lse(&mut self, l: &Launch, base: Value, row: Value, x: Value, allowed: Value) {
        let addr = self.lse_addr(l, base, row);
        let b = &mut self.b;
        let counted = counted_lanes(b, x, allowed);
        let (window, term) = math::lse_term(b, x);
        let empty = iconst(b, I32X4, EMPTY_WINDOW as u32);
        let window = b.ins().bitselect(counted, window, empty);
        let windows: Vec<Value> = (0..4u8).map(|i| b.ins().extractlane(window, i)).collect();
        let quad_top = windows.iter().skip(1).fold(windows[0], |m, &k| b.ins().smax(m, k));
        // Branch-free: a quad whose lanes all lie more than two windows below the row's top
        // adds zeros and keeps the top (a quad that raises the top has a lane at it), and
        // with flat rows nearly every quad has a kept lane, so a skip test would only add a
        // branch.
        let flags = output();
        let old_top = b.ins().load(I32, flags, addr, LSE_WINDOW_OFFSET);
        let top = b.ins().smax(old_top, quad_top);
        // A new top window moves sum j to j + shift; past the kept windows it is dropped.
        let shift = b.ins().isub(top, old_top);
        let old: Vec<Value> = (0..KEPT_WINDOWS).map(|j| b.ins().load(I64, flags, addr, 8 * j as i32)).collect();
        let zero = b.ins().iconst(I64, 0);
        let mut sums: Vec<Value> = (0..KEPT_WINDOWS)
            .map(|i| {
                let mut moved = zero;
                for (j, &s) in old.iter().enumerate().take(i + 1) {
                    let hit = b.ins().icmp_imm_s(IntCC::Equal, shift, (i - j) as i64);
                    moved = b.ins().select(hit, s, moved);
                }
                moved
            })
            .collect();
        let top_lanes = b.ins().splat(I32X4, top);
        // Masked lanes sit in EMPTY_WINDOW, far below every kept window (the difference fits
        // i32: windows are within ±WINDOW_LIMIT).
        let below = b.ins().isub(top_lanes, window);
        // Each window's lanes' halves are summed across the quad in i32 (four halves below
        // 2^23.1 stay below 2^25.1), then added to the window's u64 sum as `hi · 2²³ + lo`:
        // the same integers the lanes' terms add up to one by one.
        // Uncounted lanes add nothing (with no counted lane the top is EMPTY_WINDOW and their
        // `below` is 0).
        let (hi, lo) = math::term_halves(b, term);
        let hi = b.ins().band(hi, counted);
        let lo = b.ins().band(lo, counted);
        let pairs: Vec<Value> = (0..KEPT_WINDOWS)
            .map(|j| {
                let jv = iconst(b, I32X4, j as u32);
                let hit = b.ins().icmp(IntCC::Equal, below, jv);
                let h = b.ins().band(hi, hit);
                let l = b.ins().band(lo, hit);
                // [h0 + h1, h2 + h3, l0 + l1, l2 + l3]
                b.ins().iadd_pairwise(h, l)
            })
            .collect();
        // [H0, L0, H1, L1] and [H2, L2, H2, L2].
        let first = b.ins().iadd_pairwise(pairs[0], pairs[1]);
        let last = b.ins().iadd_pairwise(pairs[2], pairs[2]);
        let halves = [(first, 0u8), (first, 2), (last, 0)];
        for (sum, &(v, lane)) in sums.iter_mut().zip(&halves) {
            let h = b.ins().extractlane(v, lane);
            let l = b.ins().extractlane(v, lane + 1);
            let h = b.ins().uextend(I64, h);
            let l = b.ins().uextend(I64, l);
            let h = b.ins().ishl_imm_u(h, i64::from(TERM_SCALE_LOG2));
            let add = b.ins().iadd(h, l);
            *sum = b.ins().iadd(*sum, add);
        }
        b.ins().store(flags, top, addr, LSE_WINDOW_OFFSET);
        for (j, &s) in sums.iter().enumerate() {
            b.ins().store(flags, s, addr, 8 * j as i32);
        }
    }
}

/// The lanes a logsumexp counts (`LseTerm::of`): allowed, with a finite `x`.
fn counted_lanes(b: &mut FunctionBuilder, x: Value, allowed: Value) -> Value {
    let ax = b.ins().fabs(x);
    let inf = fconst(b, F32X4, f32::INFINITY);
    let finite = b.ins().fcmp(FloatCC::LessThan, ax, inf);
    b.ins().band(finite, allowed)
}

/// All-ones lanes where bit `k` of `bits` is set (a quad's allowed or existing tokens).
fn lane_mask(b: &mut FunctionBuilder, bits: Value) -> Value {
    let lane_bits = i32x4_lanes(b, [1, 2, 4, 8]);
    let splat_bits = b.ins().splat(I32X4, bits);
    let masked = b.ins().band(splat_bits, lane_bits);
    let zero_vec = iconst(b, I32X4, 0);
    b.ins().icmp(IntCC::NotEqual, masked, zero_vec)
}

/// `v` where the token is eligible (allowed, and `v > -inf`, so NaN is not), else `-inf`,
/// lane-wise: what the argmax, the list test and the target read.
fn eligible(b: &mut FunctionBuilder, v: Value, allowed: Value) -> Value {
    let neg_inf = fconst(b, F32X4, f32::NEG_INFINITY);
    let above = b.ins().fcmp(FloatCC::GreaterThan, v, neg_inf);
    let ok = b.ins().band(above, allowed);
    math::select(b, ok, v, neg_inf)
}
