//! The kernels' parameter lists, defined once: each table generates its kernel's LLVM
//! signature here and, as a typed argument struct ([`Stage1Args`], [`Stage2Args`],
//! [`FilterArgs`]), the order in which the runtime pushes the launch arguments. Adding a
//! parameter is one line of a table; the header, the struct and the push order follow.
//!
//! Pointers are device addresses (`u64`, 0 = absent where a parameter is optional); DESIGN.md
//! ("GPU") gives each parameter's shape.

/// How a kernel parameter is passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// A global pointer the kernel only reads (`ptr addrspace(1) noalias readonly`).
    ConstPtr,
    /// A global pointer the kernel writes (`ptr addrspace(1) noalias`).
    MutPtr,
    /// A 64-bit integer (`i64`).
    U64,
    /// A 32-bit integer (`i32`).
    U32,
    /// Two 128-byte `CUtensorMap`s passed by value as one kernel-constant parameter
    /// (`ptr byval([256 x i8]) align 64 "nvvm.grid_constant"`, PTX `.param .align 64 .b8
    /// [256]`), addressed in place through a generic pointer as CUTLASS's `__grid_constant__
    /// const CUtensorMap`: no device copy, and a captured graph node holds them.
    TensorMaps,
}

/// The words of a [`ParamKind::TensorMaps`] argument: the W map, then the H map.
pub type TensorMapWords = [u64; 32];

impl ParamKind {
    fn llvm(self) -> &'static str {
        match self {
            ParamKind::ConstPtr => "ptr addrspace(1) noalias readonly",
            ParamKind::MutPtr => "ptr addrspace(1) noalias",
            ParamKind::U64 => "i64",
            ParamKind::U32 => "i32",
            ParamKind::TensorMaps => "ptr byval([256 x i8]) align 64 \"nvvm.grid_constant\"",
        }
    }
}

/// One parameter: its name (the IR value `%name`) and kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Param {
    /// The name (`%name` in the kernel's IR, the field of the argument struct).
    pub name: &'static str,
    /// How it is passed.
    pub kind: ParamKind,
}

/// A kernel's parameters in launch order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelParams {
    /// The kernel's entry name.
    pub kernel: &'static str,
    /// The parameters in order.
    pub params: &'static [Param],
}

impl KernelParams {
    /// `define ptx_kernel void @name(<params>) <attrs>`: the table's own kernel, or one launched
    /// with the same arguments (stage one's table also serves `flashsample_target_logits`).
    pub(crate) fn llvm_header(&self, name: &str, attrs: &str) -> String {
        let params: Vec<String> = self.params.iter().map(|p| format!("{} %{}", p.kind.llvm(), p.name)).collect();
        format!("define ptx_kernel void @{name}({}) {attrs}", params.join(", "))
    }

    /// The position of parameter `name`, if the kernel has it.
    pub fn index(&self, name: &str) -> Option<usize> {
        self.params.iter().position(|p| p.name == name)
    }
}

/// One launch argument, as the runtime pushes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelArg {
    /// A pointer or `u64` parameter.
    U64(u64),
    /// A `u32` parameter.
    U32(u32),
    /// A [`ParamKind::TensorMaps`] parameter (boxed: 256 bytes beside 8-byte words).
    TensorMaps(Box<TensorMapWords>),
}

macro_rules! param_ty {
    (ConstPtr) => { u64 };
    (MutPtr) => { u64 };
    (U64) => { u64 };
    (U32) => { u32 };
    (TensorMaps) => { TensorMapWords };
}

macro_rules! param_arg {
    (U32, $v:expr) => {
        KernelArg::U32($v)
    };
    (TensorMaps, $v:expr) => {
        KernelArg::TensorMaps(Box::new($v))
    };
    ($kind:ident, $v:expr) => {
        KernelArg::U64($v)
    };
}

/// A kernel's parameter table and its typed argument struct, from one list.
macro_rules! kernel_params {
    (
        $(#[$meta:meta])*
        $table:ident, $args:ident, $kernel:literal {
            $( $(#[$fmeta:meta])* $field:ident: $kind:ident, )*
        }
    ) => {
        #[doc = concat!("The parameters of `", $kernel, "`, in launch order.")]
        pub const $table: KernelParams = KernelParams {
            kernel: $kernel,
            params: &[$(Param { name: stringify!($field), kind: ParamKind::$kind }),*],
        };

        $(#[$meta])*
        ///
        /// Fields in launch order, named as the kernel's parameters.
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        #[allow(missing_docs)]
        pub struct $args {
            $( $(#[$fmeta])* pub $field: param_ty!($kind), )*
        }

        impl $args {
            #[doc = concat!("The arguments in `", stringify!($table), "` order, to push onto a launch.")]
            pub fn args(&self) -> Vec<KernelArg> {
                vec![$( param_arg!($kind, self.$field) ),*]
            }
        }
    };
}

kernel_params! {
    /// The arguments of one stage-one launch (`flashsample_stage1`).
    STAGE1, Stage1Args, "flashsample_stage1" {
        /// `[B, D]` of the pipeline's hidden dtype.
        hidden: ConstPtr,
        /// `[V, D]` of the pipeline's weights dtype.
        weights: ConstPtr,
        /// `f32 [B]`: effective per-row temperatures.
        temperatures: ConstPtr,
        /// `f32 [V]` or 0.
        bias: ConstPtr,
        /// `u32 [B, ceil(V/32)]` allowed-token bitset or 0.
        allowed: ConstPtr,
        /// `Candidate [B, S, tiles]`.
        candidates: MutPtr,
        /// `LsePartial [B, tiles]` or 0.
        lse: MutPtr,
        seed: U64,
        batch: U32,
        dim: U32,
        vocab: U32,
        /// Global index of the first token (a multiple of 4).
        vocab_offset: U32,
        /// `u64 [B]` per-row seeds or 0.
        row_seeds: ConstPtr,
        /// `u32 [B, ceil(V/32)]` penalized-token bitset or 0.
        pen_bits: ConstPtr,
        /// `u32 [B + 1]` CSR offsets or 0.
        pen_offsets: ConstPtr,
        /// `u32` sorted tokens per row or 0.
        pen_tokens: ConstPtr,
        /// `f32` per-entry subtraction or 0.
        pen_subtract: ConstPtr,
        /// `f32 [B]` repetition penalties or 0.
        pen_repetition: ConstPtr,
        /// `Scored [B, tiles, list_per_tile]` or 0.
        lists: MutPtr,
        /// The TMA schedules' tensor maps (W, then H), by value; unread by the others.
        tmaps: TensorMaps,
        /// `u32 [B]` per-row decode steps (noise counter word 3 = step · 4 + stream,
        /// `abi::rng::counter_word3`) or 0 (every step 0).
        row_steps: ConstPtr,
        /// `u32 [B, ceil(V/32)]` logit-biased-token bitset or 0.
        lb_bits: ConstPtr,
        /// `u32 [B + 1]` CSR offsets or 0.
        lb_offsets: ConstPtr,
        /// `u32` sorted tokens per row or 0.
        lb_tokens: ConstPtr,
        /// `f32` per-entry bias (finite or -inf) or 0.
        lb_values: ConstPtr,
        /// `u32 [B]` the token each row scores (`target_logprob`) or 0.
        targets: ConstPtr,
        /// `f32 [B]`: the tile holding row r's target writes its transformed logit (`-inf`
        /// when excluded) at r; stage two turns it into the logprob in place. 0 without targets.
        target_logprobs: MutPtr,
        /// `u32 [B, S]`, zeroed before the launch: per (row, sample) the order key
        /// (`Func::order_key`) of the best score a tile has published so far, which later
        /// tiles read to skip noise that cannot win (exact). 0: no cross-tile skip.
        row_bounds: MutPtr,
        /// The launch row of this kernel's row 0 (a plan runs a large batch in row chunks):
        /// the noise counter row of a row without its own seed is `row_base + row`.
        row_base: U32,
        /// `LsePartial [B, tiles]` of the raw logits (DESIGN.md step 10), or 0 in the
        /// processed mode.
        raw_lse: MutPtr,
        /// `Scored [B, tiles, list_per_tile]` lists keyed by raw logit (raw `top_logprobs`), or 0.
        raw_lists: MutPtr,
        /// `f32 [B, tiles, list_per_tile]`: beside each entry of `lists` its raw logit
        /// (`Pipeline::lists_carry_raw`), or 0.
        list_raws: MutPtr,
        /// `Candidate [B, tiles, residual_per_tile]`: a verifying pipeline's residual lists
        /// (each draft row's best tokens per tile by the residual stream's `x + G_res`), or 0.
        residual_lists: MutPtr,
        /// `k + 1` of a verifying launch: launch row `r` is a draft row iff
        /// `r mod spec_period ≠ k` (the last row of each sequence is its bonus); 0 makes every
        /// row a draft row (the recompute of single rows). Unread without `verify`.
        spec_period: U32,
        /// `u32 [B]`, zeroed, on a launch that ranks its targets (DESIGN.md step 7c), else 0:
        /// stage one then adds per (warp, row) the count of the tile's tokens whose logit is
        /// at least `target_logprobs[row]` (written before it by `flashsample_target_logits`,
        /// read, not written, by stage one).
        target_ranks: MutPtr,
        /// `RowFilter [B]` the launch's filters (0: none): a row stage three draws
        /// (`RowFilter::is_drawn_in_stage_three`) takes its argmax, and the nucleus capture
        /// reads them.
        filters: ConstPtr,
        /// Capture slots (`R`): the first `capture_rows` rows whose filter may outgrow the
        /// lists keep their logits in `capture` (`nucleus::capture_slot`); 0 for none.
        capture_rows: U32,
        /// `f32 [R, V]`: a captured row's transformed logits `x` (`-inf` where excluded) at its
        /// slot, which the nucleus kernels read instead of multiplying again; 0 for none.
        capture: MutPtr,
        /// `u32 [B, G]`, zeroed before the launch, `G` = [`crate::list_bound_groups`]: per
        /// row and group `g` the largest order key of a processed list's best entry among the
        /// tiles `t ≡ g (mod G)` so far. The minimum over a row's groups is a key that `G`
        /// distinct tokens of the row reach, so no token below it is among the `G ≥ need`
        /// best that stage three merges, and the list selection drops such tokens (exact).
        /// 0: no list bound (the kernel's config lists whole tiles, or the caller gives none).
        list_bounds: MutPtr,
    }
}

kernel_params! {
    /// The arguments of one stage-two launch (`flashsample_stage2`).
    STAGE2, Stage2Args, "flashsample_stage2" {
        /// Stage one's candidates.
        candidates: ConstPtr,
        /// Stage one's logsumexp partials or 0.
        lse: ConstPtr,
        batch: U32,
        samples: U32,
        tiles: U32,
        /// `u32 [B·S]`.
        out_tokens: MutPtr,
        /// `f32 [B·S]`.
        out_scores: MutPtr,
        /// `f32 [B·S]`.
        out_logits: MutPtr,
        /// `f32 [B]` or 0.
        out_lse: MutPtr,
        /// `u32 [B]` (`abi::RowStatus` codes).
        out_status: MutPtr,
        /// Stage one's `f32 [B]` target logits, turned in place into `x − lse` (NaN for a
        /// failed row), or 0.
        target_logprobs: MutPtr,
        /// Stage one's `u32 [B]` target ranks (DESIGN.md step 7c), set to 0 for a failed row,
        /// or 0.
        target_ranks: MutPtr,
        /// Stage one's raw logsumexp partials (DESIGN.md step 10) or 0. When given, the
        /// target logprobs take the raw row logsumexp instead of the processed one.
        raw_lse: ConstPtr,
        /// `f32 [B]` the raw row logsumexp, or 0.
        out_raw_lse: MutPtr,
        /// 1 when stage two is the launch's last stage (no stage three, exact nucleus or
        /// decision): it then finishes the samples itself (`glue::finish_sample`: a failed
        /// row's samples become `INDEX_NONE`, logprobs `logit − lse`), one kernel fewer than
        /// `flashsample_finalize`; 0 leaves that to the finishing kernel.
        finish: U32,
        /// With `finish`: `f32 [B·S]` logprobs against the reported logsumexp (the raw one
        /// when `raw_lse` is given), or 0 for none.
        out_logprobs: MutPtr,
    }
}

kernel_params! {
    /// The arguments of one stage-three launch (`flashsample_filter`).
    FILTER, FilterArgs, "flashsample_filter" {
        /// Stage one's `Scored [B, tiles, per_tile]` lists.
        lists: ConstPtr,
        tiles: U32,
        per_tile: U32,
        /// Entries merged per row (the capacity, or `MAX_LIST_CAPACITY` in the fallback).
        need: U32,
        batch: U32,
        samples: U32,
        /// `RowFilter [B]` or 0.
        filters: ConstPtr,
        /// `f32 [B]` stage two's row logsumexp, or 0 (read as NaN).
        lse: ConstPtr,
        /// `f32 [B]` the launch's temperatures: a row at 0 is greedy (its lists' best wins).
        temperatures: ConstPtr,
        /// 1 when the pipeline is greedy (every row).
        all_greedy: U32,
        seed: U64,
        /// `u64 [B]` or 0.
        row_seeds: ConstPtr,
        vocab_offset: U32,
        top_n: U32,
        out_tokens: MutPtr,
        out_scores: MutPtr,
        out_logits: MutPtr,
        /// `Scored [B, top_n]` (logit field = logprob) or 0.
        out_top: MutPtr,
        /// `u32 [B]` (`abi::RowStatus` codes).
        out_status: MutPtr,
        /// `u32 [B]` per-row decode steps, as stage one's, or 0.
        row_steps: ConstPtr,
        /// As stage one's `row_base`: the noise counter row is `row_base + row`.
        row_base: U32,
        /// Stage one's raw lists (`Scored [B, tiles, per_tile]`) or 0; when given, the top
        /// logprobs are their merged first `top_n` minus `raw_lse` (DESIGN.md step 10).
        raw_lists: ConstPtr,
        /// `f32 [B]` stage two's raw row logsumexp, or 0 (read as NaN).
        raw_lse: ConstPtr,
        /// Stage one's `f32` raw logit beside each entry of `lists`, or 0: a drawn token
        /// then reports its raw logit.
        list_raws: ConstPtr,
        /// 1 when stage three is the launch's last stage (no exact nucleus or decision after
        /// it): it then finishes every row's samples (`glue::finish_sample`), in place of
        /// `flashsample_finalize`.
        finish: U32,
        /// With `finish`: `f32 [B·S]` logprobs against the reported logsumexp (`raw_lse`
        /// when given, else `lse`), or 0 for none.
        out_logprobs: MutPtr,
        /// A verifying launch's `Scored [B, need]`, or 0: each filtered row's survivors
        /// (`abi::filter::survivors` of its merged lists, in their order), `Scored::EMPTY`
        /// after them; a first entry `EMPTY` where the row has none (not filtered, failed,
        /// its lists overflowed or its nucleus outgrew them). The decision reads them.
        kept: MutPtr,
    }
}

kernel_params! {
    /// The arguments of one speculative decision launch (`flashsample_decide`, one CTA per
    /// sequence; DESIGN.md "Speculative verification").
    DECIDE, DecideArgs, "flashsample_decide" {
        /// `u32 [B]` row status (stages two and three).
        status: ConstPtr,
        /// `u32 [B]` each row's token: a draft row's argmax, a bonus row's sample.
        row_tokens: ConstPtr,
        /// `f32 [B]` the logits of `row_tokens`.
        row_logits: ConstPtr,
        /// `f32 [B]` stage two's row logsumexp, or 0 (read as NaN).
        lse: ConstPtr,
        /// `f32 [B]` stage one's target capture: each draft row's transformed logit at its
        /// draft token.
        draft_logits: ConstPtr,
        /// Stage one's `Candidate [B, tiles, per_tile]` residual lists.
        residual_lists: ConstPtr,
        tiles: U32,
        per_tile: U32,
        /// `u32 [S·k]` the draft tokens.
        drafts: ConstPtr,
        /// `f32 [S·k, V]` sampled drafts' distributions, or 0 (greedy drafts: `δ(d_j)`).
        draft_probs: ConstPtr,
        vocab: U32,
        /// Drafts per sequence.
        k: U32,
        sequences: U32,
        /// `f32 [B]` effective temperatures (0 = greedy row), as stage one's.
        temperatures: ConstPtr,
        /// 1 when the pipeline is greedy (every row).
        all_greedy: U32,
        /// `RowFilter [B]` or 0.
        filters: ConstPtr,
        /// Stage three's `Scored [B, kept_width]` survivors of each filtered row
        /// (`FilterArgs::kept`), or 0 (a filtered draft row then needs a recompute).
        kept: ConstPtr,
        kept_width: U32,
        seed: U64,
        /// `u64 [B]` or 0.
        row_seeds: ConstPtr,
        /// `u32 [B]` or 0.
        row_steps: ConstPtr,
        /// As stage one's: a row without its own seed has counter row `row_base + row`.
        row_base: U32,
        vocab_offset: U32,
        /// `u32 [S]` drafts accepted.
        out_accepted: MutPtr,
        /// `u32 [S, k + 1]` accepted drafts, then the next token; `INDEX_NONE` after.
        out_tokens: MutPtr,
        /// `f32 [S, k + 1]` their logprobs `x − lse` (NaN where no token), or 0.
        out_logprobs: MutPtr,
        /// `u32 [S]` `abi::speculative::SpecStatus` codes.
        out_status: MutPtr,
    }
}

kernel_params! {
    /// The arguments of `flashsample_spec_targets` (the drafts as stage one's targets).
    SPEC_TARGETS, SpecTargetsArgs, "flashsample_spec_targets" {
        /// `u32 [S·k]`.
        drafts: ConstPtr,
        k: U32,
        /// Rows `S·(k + 1)`.
        batch: U32,
        /// `u32 [B]`: a draft row's draft token, 0 for a bonus row.
        targets: MutPtr,
    }
}

// The exact nucleus's kernels (DESIGN.md "Exact nucleus on the device"; `nucleus/`). Every one
// reads `picks` (`u32 [rows + 1]`: the picked launch rows, then their count, written by the
// pick kernel) and exits at once when its picked row does not exist. Per-pick buffers are
// `[rows, vocab]`, pick `j` at `j · vocab` (`NucleusLayout`).

kernel_params! {
    /// The arguments of the nucleus pick (`flashsample_nucleus_pick`, one warp).
    NUCLEUS_PICK, NucleusPickArgs, "flashsample_nucleus_pick" {
        /// `u32 [B]` stage three's statuses.
        status: ConstPtr,
        batch: U32,
        /// Rows the nucleus kernels serve at most (`R`).
        rows: U32,
        samples: U32,
        /// `u32 [rows + 1]`: the first `rows` rows of status 4, in row order, then their count.
        picks: MutPtr,
        /// `u64 [rows, S]` the draw's best keys, zeroed here.
        best: MutPtr,
        /// `u32 [rows]` the draw's finished-CTA counters, zeroed here.
        done: MutPtr,
        /// Stage one's `row_base` and `spec_period`: a verifying pipeline's draft rows are
        /// never picked (its decision reads their lists; only bonus rows are samples).
        row_base: U32,
        spec_period: U32,
    }
}

kernel_params! {
    /// The arguments of the nucleus logits (`flashsample_nucleus_logits`): stage one's matmul
    /// and transform chain for the picked rows over the whole vocabulary.
    NUCLEUS_LOGITS, NucleusLogitsArgs, "flashsample_nucleus_logits" {
        picks: ConstPtr,
        rows: U32,
        /// Stage one's inputs of the same names (the launch's, not only the picked rows').
        hidden: ConstPtr,
        weights: ConstPtr,
        temperatures: ConstPtr,
        bias: ConstPtr,
        allowed: ConstPtr,
        dim: U32,
        vocab: U32,
        pen_bits: ConstPtr,
        pen_offsets: ConstPtr,
        pen_tokens: ConstPtr,
        pen_subtract: ConstPtr,
        pen_repetition: ConstPtr,
        lb_bits: ConstPtr,
        lb_offsets: ConstPtr,
        lb_tokens: ConstPtr,
        lb_values: ConstPtr,
        /// `f32 [rows, V]` the transformed logits (`-inf` where excluded).
        x: MutPtr,
        /// `f32 [rows, V]` the raw logits (DESIGN.md step 10), or 0 unless the pipeline's lists
        /// carry them.
        raw: MutPtr,
        /// `u32 [rows, V]` each token's ascending sort key (`!order_key(x)`), and the token.
        keys: MutPtr,
        vals: MutPtr,
        /// Stage one's capture (`filters`, `capture_rows`, `capture`), or 0: when every picked
        /// row was captured, its `x` is read from there and W is not read again.
        filters: ConstPtr,
        capture_rows: U32,
        capture: ConstPtr,
    }
}

kernel_params! {
    /// The arguments of one radix pass's histogram (`flashsample_nucleus_hist`).
    NUCLEUS_HIST, NucleusHistArgs, "flashsample_nucleus_hist" {
        picks: ConstPtr,
        rows: U32,
        /// `u32 [rows, V]` the pass's input keys.
        keys: ConstPtr,
        vocab: U32,
        /// The pass's digit: bits `shift .. shift + 8` of the key.
        shift: U32,
        /// `u32 [rows, tiles, 256]` per sort tile, its digits' counts.
        hist: MutPtr,
    }
}

kernel_params! {
    /// The arguments of one radix pass's stable scatter (`flashsample_nucleus_scatter`).
    NUCLEUS_SCATTER, NucleusScatterArgs, "flashsample_nucleus_scatter" {
        picks: ConstPtr,
        rows: U32,
        keys: ConstPtr,
        vals: ConstPtr,
        /// The pass's histogram.
        hist: ConstPtr,
        vocab: U32,
        shift: U32,
        keys_out: MutPtr,
        vals_out: MutPtr,
    }
}

kernel_params! {
    /// The arguments of the nucleus cut (`flashsample_nucleus_cut`, one CTA per picked row).
    NUCLEUS_CUT, NucleusCutArgs, "flashsample_nucleus_cut" {
        picks: ConstPtr,
        rows: U32,
        /// `u32 [rows, V]` the sorted keys.
        keys: ConstPtr,
        /// `RowFilter [B]`.
        filters: ConstPtr,
        vocab: U32,
        /// `f32 [rows, V]` scratch for the top-p masses.
        masses: MutPtr,
        /// `u32 [rows]` how many sorted entries survive (`abi::filter::survivors`).
        kept: MutPtr,
    }
}

kernel_params! {
    /// The arguments of the nucleus draw (`flashsample_nucleus_draw`).
    NUCLEUS_DRAW, NucleusDrawArgs, "flashsample_nucleus_draw" {
        picks: ConstPtr,
        rows: U32,
        /// `u32 [rows, V]` the sorted tokens, `x` and `raw` the logits kernel's.
        vals: ConstPtr,
        x: ConstPtr,
        raw: ConstPtr,
        kept: ConstPtr,
        vocab: U32,
        samples: U32,
        /// Stage one's noise parameters of the same names.
        seed: U64,
        row_seeds: ConstPtr,
        row_steps: ConstPtr,
        row_base: U32,
        vocab_offset: U32,
        best: MutPtr,
        done: MutPtr,
        /// The launch's outputs (stage three's), overwritten for the picked rows.
        out_tokens: MutPtr,
        out_scores: MutPtr,
        out_logits: MutPtr,
        out_status: MutPtr,
    }
}

// The runtime's glue kernels (`glue.rs`): one thread per element, [`crate::GLUE_THREADS`] a block.

kernel_params! {
    /// The arguments of `flashsample_finalize` over `n = batch · samples` samples.
    FINALIZE, FinalizeArgs, "flashsample_finalize" {
        /// `u32 [n]`: a sample of a row whose status is not ok becomes `abi::INDEX_NONE`.
        tokens: MutPtr,
        /// `u32 [n / samples]` `abi::RowStatus` codes.
        status: ConstPtr,
        /// `f32 [n]` the samples' logits (read only with `logprobs`).
        logits: ConstPtr,
        /// `f32 [n / samples]` the rows' logsumexp (read only with `logprobs`).
        lse: ConstPtr,
        /// `f32 [n]` `logit − lse` (NaN for a failed row), or 0 for none.
        logprobs: MutPtr,
        n: U32,
        samples: U32,
    }
}

/// The kernels' parameters as typed IR values (`%name`), for the code that reads them: the
/// type follows the parameter's [`ParamKind`] (pointers `Ptr<Global>`, `U32` `I32`, `U64`
/// `I64`, the by-value tensor maps a generic `Ptr` to the parameter itself), and a test checks
/// every one against the tables.
pub(crate) mod arg {
    use crate::ir::{Generic, Global, Ptr, I32, I64};

    macro_rules! args {
        ($($name:ident: $ty:ty = $text:literal,)*) => {
            $(pub(crate) const $name: $ty = <$ty>::named($text);)*

            /// Every value's name and LLVM type.
            #[cfg(test)]
            pub(super) const ALL: &[(&str, &str)] = &[$(($text, <$ty as crate::ir::Value>::LLVM)),*];
        };
    }

    args! {
    ALL_GREEDY: I32 = "%all_greedy",
    ALLOWED: Ptr<Global> = "%allowed",
    BATCH: I32 = "%batch",
    BEST: Ptr<Global> = "%best",
    BIAS: Ptr<Global> = "%bias",
    CANDIDATES: Ptr<Global> = "%candidates",
    CAPTURE: Ptr<Global> = "%capture",
    CAPTURE_ROWS: I32 = "%capture_rows",
    DIM: I32 = "%dim",
    DONE: Ptr<Global> = "%done",
    DRAFT_LOGITS: Ptr<Global> = "%draft_logits",
    DRAFT_PROBS: Ptr<Global> = "%draft_probs",
    DRAFTS: Ptr<Global> = "%drafts",
    FILTERS: Ptr<Global> = "%filters",
    FINISH: I32 = "%finish",
    HIDDEN: Ptr<Global> = "%hidden",
    HIST: Ptr<Global> = "%hist",
    K: I32 = "%k",
    KEPT: Ptr<Global> = "%kept",
    KEPT_WIDTH: I32 = "%kept_width",
    KEYS: Ptr<Global> = "%keys",
    KEYS_OUT: Ptr<Global> = "%keys_out",
    LB_BITS: Ptr<Global> = "%lb_bits",
    LB_OFFSETS: Ptr<Global> = "%lb_offsets",
    LB_TOKENS: Ptr<Global> = "%lb_tokens",
    LB_VALUES: Ptr<Global> = "%lb_values",
    LIST_BOUNDS: Ptr<Global> = "%list_bounds",
    LIST_RAWS: Ptr<Global> = "%list_raws",
    LISTS: Ptr<Global> = "%lists",
    LOGITS: Ptr<Global> = "%logits",
    LOGPROBS: Ptr<Global> = "%logprobs",
    LSE: Ptr<Global> = "%lse",
    MASSES: Ptr<Global> = "%masses",
    N: I32 = "%n",
    NEED: I32 = "%need",
    OUT_ACCEPTED: Ptr<Global> = "%out_accepted",
    OUT_LOGITS: Ptr<Global> = "%out_logits",
    OUT_LSE: Ptr<Global> = "%out_lse",
    OUT_LOGPROBS: Ptr<Global> = "%out_logprobs",
    OUT_RAW_LSE: Ptr<Global> = "%out_raw_lse",
    OUT_SCORES: Ptr<Global> = "%out_scores",
    OUT_STATUS: Ptr<Global> = "%out_status",
    OUT_TOKENS: Ptr<Global> = "%out_tokens",
    OUT_TOP: Ptr<Global> = "%out_top",
    PEN_BITS: Ptr<Global> = "%pen_bits",
    PEN_OFFSETS: Ptr<Global> = "%pen_offsets",
    PEN_REPETITION: Ptr<Global> = "%pen_repetition",
    PEN_SUBTRACT: Ptr<Global> = "%pen_subtract",
    PEN_TOKENS: Ptr<Global> = "%pen_tokens",
    PER_TILE: I32 = "%per_tile",
    PICKS: Ptr<Global> = "%picks",
    RAW: Ptr<Global> = "%raw",
    RAW_LISTS: Ptr<Global> = "%raw_lists",
    RAW_LSE: Ptr<Global> = "%raw_lse",
    RESIDUAL_LISTS: Ptr<Global> = "%residual_lists",
    ROW_BASE: I32 = "%row_base",
    ROW_BOUNDS: Ptr<Global> = "%row_bounds",
    ROW_LOGITS: Ptr<Global> = "%row_logits",
    ROW_SEEDS: Ptr<Global> = "%row_seeds",
    ROW_STEPS: Ptr<Global> = "%row_steps",
    ROW_TOKENS: Ptr<Global> = "%row_tokens",
    ROWS: I32 = "%rows",
    SAMPLES: I32 = "%samples",
    SEED: I64 = "%seed",
    SEQUENCES: I32 = "%sequences",
    SHIFT: I32 = "%shift",
    SPEC_PERIOD: I32 = "%spec_period",
    STATUS: Ptr<Global> = "%status",
    TARGET_LOGPROBS: Ptr<Global> = "%target_logprobs",
    TARGET_RANKS: Ptr<Global> = "%target_ranks",
    TARGETS: Ptr<Global> = "%targets",
    TEMPERATURES: Ptr<Global> = "%temperatures",
    TILES: I32 = "%tiles",
    TMAPS: Ptr<Generic> = "%tmaps",
    TOKENS: Ptr<Global> = "%tokens",
    TOP_N: I32 = "%top_n",
    VALS: Ptr<Global> = "%vals",
    VALS_OUT: Ptr<Global> = "%vals_out",
    VOCAB: I32 = "%vocab",
    VOCAB_OFFSET: I32 = "%vocab_offset",
    WEIGHTS: Ptr<Global> = "%weights",
    X: Ptr<Global> = "%x",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_typed_argument_is_a_parameter_of_its_kind() {
        let tables = [
            STAGE1, STAGE2, FILTER, DECIDE, SPEC_TARGETS, NUCLEUS_PICK, NUCLEUS_LOGITS, NUCLEUS_HIST, NUCLEUS_SCATTER, NUCLEUS_CUT, NUCLEUS_DRAW,
            FINALIZE,
        ];
        for (text, llvm) in arg::ALL {
            let name = text.strip_prefix('%').expect("a parameter value is %name");
            let kinds: Vec<ParamKind> = tables.iter().flat_map(|t| t.params.iter().filter(|p| p.name == name).map(|p| p.kind)).collect();
            assert!(!kinds.is_empty(), "{text} is no kernel's parameter");
            for k in kinds {
                assert!(k.llvm().starts_with(llvm), "{text}: {llvm} but a kernel passes it as {}", k.llvm());
            }
        }
    }
}
