//! The exact nucleus on the device (DESIGN.md "Exact nucleus on the device"): kernels that
//! serve the rows stage three left with status 4 (a top-p / min-p nucleus larger than the
//! lists) inside the launch, with no host round trip, so a device-API launch and a captured
//! graph sample them exactly. Always enqueued after stage three; each exits at once when its
//! picked row does not exist, so a launch without such a row pays only the launches.
//!
//! | kernel | file | what |
//! |---|---|---|
//! | `flashsample_nucleus_pick` | `pick.rs` | the first `R` rows of status 3 or 4 |
//! | `flashsample_nucleus_logits` | `logits.rs` | their logits `x` over the whole vocabulary: stage one's multiply order and transform chain |
//! | `flashsample_nucleus_hist`, `_scatter` | `sort.rs` | a stable LSD radix sort of order keys, 4 passes of 8 bits |
//! | `flashsample_nucleus_cut` | `cut.rs` | `abi::filter::survivors` over the sorted row (`complete = true`) |
//! | `flashsample_nucleus_draw` | `draw.rs` | `abi::filter::draw` over the kept prefix, then the row's outputs and status 0 |
//!
//! Buffers: one scratch block per plan, laid out by [`NucleusLayout`]; parameters in
//! `params.rs` (`NUCLEUS_*`).

mod cut;
mod draw;
mod logits;
pub(crate) use logits::{fma_over_k, mma_over_k};
mod pick;
mod sort;

use crate::config::GpuConfig;
use crate::ir::{i32c, Func, Icmp, F32, I1, I32, I64};
use crate::params::arg;
use flashsample_abi::filter::SUM_BLOCK;
use flashsample_ir::Pipeline;

/// Threads of every nucleus kernel but the pick (one warp) and the cut.
pub const NUCLEUS_THREADS: u32 = 256;
/// Threads of the cut's CTA: one per mass block up to `MAX_MASS_BLOCKS`.
pub const NUCLEUS_CUT_THREADS: u32 = 1024;
/// Tokens per CTA of the logits kernel (8 warps of 16 tokens on the tensor-core path).
pub const NUCLEUS_LOGITS_TOKENS: u32 = 128;
/// Entries per CTA of a radix pass (8 warps × 16 steps of 32).
pub const NUCLEUS_SORT_TILE: u32 = 4096;
/// Sorted entries per CTA of the draw.
pub const NUCLEUS_DRAW_TILE: u32 = 2048;
/// Radix passes of 8 bits over the 32-bit keys; the sorted keys end where they started.
pub const NUCLEUS_RADIX_PASSES: u32 = 4;
/// Mass blocks the cut holds in shared memory: vocabularies up to this many `SUM_BLOCK`s.
const MAX_MASS_BLOCKS: u32 = 1024;
/// The largest vocabulary the nucleus kernels serve (the cut's shared block sums); a plan
/// for a larger one serves no row on the device (status 4 stays).
pub const NUCLEUS_MAX_VOCAB: usize = MAX_MASS_BLOCKS as usize * SUM_BLOCK;

const _: () = assert!(SUM_BLOCK == 1024, "the cut's block arithmetic shifts by 10");
const _: () = assert!(NUCLEUS_RADIX_PASSES.is_multiple_of(2), "the sorted row ends in the first buffer");
const _: () = assert!(NUCLEUS_SORT_TILE == (NUCLEUS_THREADS / 32) * 16 * 32);

/// Whether a pipeline's module has the nucleus kernels: a sampling pipeline with a filter
/// (only its rows can get status 4).
pub fn has_nucleus_kernels(p: &Pipeline) -> bool {
    p.filter_max_k().is_some() && !p.is_greedy()
}

/// Whether stage one keeps the logits of the rows `capture_slot` gives a slot (the nucleus
/// kernels then read them instead of multiplying again): pipelines with the nucleus kernels
/// whose lists do not carry raw logits (those rows are recomputed, raw logits and all).
pub fn captures_logits(p: &Pipeline) -> bool {
    has_nucleus_kernels(p) && !p.lists_carry_raw()
}

/// The nucleus capture slot of launch row `row` (uniform over the calling warp), the one rule
/// stage one and the logits kernel share: the rows whose filter may outgrow the lists
/// (`RowFilter::may_outgrow_lists`: no top-k, a top-p or min-p) get slots in row order, the
/// first `%capture_rows` of them; `(captured, slot)`. Nothing is captured when `%capture` or
/// `%filters` is 0. A row that may outgrow counts its predecessors with warp ballots (one
/// filter load per 32 rows, stopping once the slots are taken); any other row costs one
/// filter load.
pub(crate) fn capture_slot(f: &mut Func, lane: &I32, row: &I32) -> (I1, I32) {
    let has = f.non_null(&arg::CAPTURE);
    let filters = f.non_null(&arg::FILTERS);
    let has = f.and(&has, &filters);
    let captured = f.var(&I1::FALSE);
    let slot = f.var(&i32c(0));
    f.if_then(&has, |f| {
        let r64 = f.zext(row);
        let own = crate::filter::load_row_filter(f, &r64);
        let may = crate::filter::may_outgrow_lists(f, &own);
        f.if_then(&may, |f| {
            // Rows before `row` in warp-sized groups, until the slots are all taken.
            let count = f.var(&i32c(0));
            let base = f.var(&i32c(0));
            let all = i32c(u32::MAX);
            f.while_loop(
                |f| {
                    let b = f.get(&base);
                    let more = f.icmp(Icmp::Ult, &b, row);
                    let c = f.get(&count);
                    let free = f.icmp(Icmp::Ult, &c, &arg::CAPTURE_ROWS);
                    f.and(&more, &free)
                },
                |f| {
                    let b = f.get(&base);
                    let r = f.add(&b, lane);
                    let before = f.icmp(Icmp::Ult, &r, row);
                    let rs = f.sel(&before, &r, &i32c(0));
                    let rs64 = f.zext(&rs);
                    let rf = crate::filter::load_row_filter(f, &rs64);
                    let m = crate::filter::may_outgrow_lists(f, &rf);
                    let hit = f.and(&before, &m);
                    // Only the count matters here: the lanes' slots are not used.
                    let _ = pick::next_slot(f, &all, &count, &hit);
                    let next = f.add(&b, &i32c(32));
                    f.set(&base, &next);
                },
            );
            let n = f.get(&count);
            let fits = f.icmp(Icmp::Ult, &n, &arg::CAPTURE_ROWS);
            f.set(&captured, &fits);
            f.set(&slot, &n);
        });
    });
    (f.get(&captured), f.get(&slot))
}

/// The byte layout of a plan's nucleus scratch for `rows` picked rows (`R`) of `vocab`
/// tokens and `samples` per row; `raw`: the raw logits are kept (`Pipeline::lists_carry_raw`).
/// Every field offset is 8-byte aligned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NucleusLayout {
    /// Picked rows at most (`R`).
    pub rows: usize,
    /// Tokens per row.
    pub vocab: usize,
    /// Samples per row.
    pub samples: usize,
    /// Whether the raw logits are kept (step 10).
    pub raw: bool,
}

/// Byte offsets of the fields of a [`NucleusLayout`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NucleusOffsets {
    /// `u32 [rows + 1]`.
    pub picks: usize,
    /// `u64 [rows, samples]`.
    pub best: usize,
    /// `u32 [rows]`.
    pub done: usize,
    /// `u32 [rows]`.
    pub kept: usize,
    /// `u32 [rows, tiles, 256]`.
    pub hist: usize,
    /// `f32 [rows, vocab]`.
    pub x: usize,
    /// `f32 [rows, vocab]` when `raw`.
    pub raw: Option<usize>,
    /// `u32 [rows, vocab]` each: the sort's two key and token buffers (the sorted ones are
    /// `keys[0]`, `vals[0]`; `keys[1]` holds the cut's masses afterwards).
    pub keys: [usize; 2],
    /// The tokens beside `keys`.
    pub vals: [usize; 2],
    /// Total bytes.
    pub bytes: usize,
}

impl NucleusLayout {
    /// Sort tiles (radix-pass CTAs) per picked row.
    pub fn sort_tiles(&self) -> usize {
        self.vocab.div_ceil(NUCLEUS_SORT_TILE as usize)
    }

    /// The field offsets.
    pub fn offsets(&self) -> NucleusOffsets {
        let mut at = 0usize;
        let mut field = |bytes: usize| {
            let o = at;
            at += bytes.div_ceil(8) * 8;
            o
        };
        let per_row = self.rows * self.vocab * 4;
        let picks = field((self.rows + 1) * 4);
        let best = field(self.rows * self.samples * 8);
        let done = field(self.rows * 4);
        let kept = field(self.rows * 4);
        let hist = field(self.rows * self.sort_tiles() * 256 * 4);
        let x = field(per_row);
        let raw = self.raw.then(|| field(per_row));
        let keys = [field(per_row), field(per_row)];
        let vals = [field(per_row), field(per_row)];
        NucleusOffsets { picks, best, done, kept, hist, x, raw, keys, vals, bytes: at }
    }

    /// Grids of the kernels (blocks: one warp for the pick, [`NUCLEUS_CUT_THREADS`] for the
    /// cut, [`NUCLEUS_THREADS`] for the rest).
    pub fn logits_grid(&self) -> (u32, u32, u32) {
        (self.vocab.div_ceil(NUCLEUS_LOGITS_TOKENS as usize) as u32, 1, 1)
    }
    /// The grid of each radix pass (histogram and scatter).
    pub fn sort_grid(&self) -> (u32, u32, u32) {
        (self.sort_tiles() as u32, self.rows as u32, 1)
    }
    /// The cut's grid: one CTA per picked row.
    pub fn cut_grid(&self) -> (u32, u32, u32) {
        (self.rows as u32, 1, 1)
    }
    /// The draw's grid.
    pub fn draw_grid(&self) -> (u32, u32, u32) {
        (self.vocab.div_ceil(NUCLEUS_DRAW_TILE as usize) as u32, self.rows as u32, 1)
    }
}

/// The nucleus kernels' text (after stage one's helpers in the same module: the math, the
/// out-of-line penalty and logit-bias searches).
pub(crate) fn emit(p: &Pipeline, c: &GpuConfig) -> String {
    let mut m = String::from(DECLS);
    m.push_str(&pick::emit(p.verify.is_some()));
    m.push_str(&logits::emit(p, c));
    m.push_str(&sort::emit_hist());
    m.push_str(&sort::emit_scatter());
    m.push_str(&cut::emit());
    m.push_str(&draw::emit());
    m
}

/// Intrinsics only these kernels use.
const DECLS: &str = "declare i32 @llvm.ctpop.i32(i32)\n\
                     declare void @llvm.nvvm.bar.warp.sync(i32)\n";

/// `picks[rows]`: how many rows were picked.
fn pick_count(f: &mut Func) -> I32 {
    let r64 = f.zext(&arg::ROWS);
    let a = f.gaddr(&arg::PICKS, &r64, 4);
    f.load(&a, 4)
}

/// `picks[j]`: picked row `j`'s launch row (of this chunk).
fn picked_row(f: &mut Func, j: &I32) -> I32 {
    let j64 = f.zext(j);
    let a = f.gaddr(&arg::PICKS, &j64, 4);
    f.load(&a, 4)
}

/// Element `i` of pick `j`'s `[rows, vocab]` buffer: `j · vocab + i` as i64.
fn row_elem(f: &mut Func, j: &I32, i: &I64) -> I64 {
    let j64: I64 = f.zext(j);
    let v64 = f.zext(&arg::VOCAB);
    let base = f.mul(&j64, &v64);
    f.add(&base, i)
}

/// The logit an ascending sort key stands for: `!key` is `Func::order_key`'s key, whose top
/// bit marks a non-negative float (`-0` reads as `+0`, which ties with it everywhere).
fn decode_key(f: &mut Func, key: &I32) -> F32 {
    let k = f.not(key);
    f.key_value(&k)
}

/// The number of set bits of `v`.
fn popc(f: &mut Func, v: &I32) -> I32 {
    f.call("@llvm.ctpop.i32", &[v])
}

/// Every thread's global writes so far are visible device-wide before its later ones.
fn fence_gpu(f: &mut Func) {
    f.s("call void asm sideeffect \"membar.gl;\", \"~{memory}\"() #1");
}

