//! Top-k / min-p / top-p filtering and top-n logprobs from fused candidate lists.
//!
//! Stage one keeps, per (row, vocab tile), the tile's `per_tile` best tokens by transformed
//! logit ([`Scored`], sorted, padded with [`Scored::EMPTY`]); nothing of size `[B, V]` exists.
//! Stage two merges a row's lists into its global top `need` ([`merge_row`]), applies the
//! row's [`RowFilter`] to them ([`survivors`]) and draws from the renormalized survivors by
//! Gumbel-max with the same Philox noise as the unfiltered path ([`draw`]), so a filtered sample
//! is pathwise the argmax of `x_v + g_v` over the surviving set.
//!
//! Exactness: a tile list of `per_tile >= need` entries cannot lose a global top-`need` token.
//! A shorter list (the GPU's default, for speed) is exact unless some full tile's last entry
//! ranks strictly before the `need`-th selected token; that case is detected ([`ListError::Overflow`]) and the runtime reruns with
//! `per_tile = capacity`. A row that sets no top-k but a top-p / min-p whose nucleus does not fit
//! in the lists fails with [`ListError::NucleusTooLarge`], never a wrong sample; the runtimes
//! then serve that row alone exactly: they recompute its logits with lists holding whole tiles,
//! take its whole sorted vocabulary ([`whole_row`]) and cut it with `complete = true`, the same
//! [`survivors`] and [`draw`] as any list (DESIGN.md step 9 "Exact nucleus").
//!
//! Sums of masses run in the blocked order of [`BlockedMass`]: sequential inside blocks of
//! [`SUM_BLOCK`] entries, so a list of at most `SUM_BLOCK` entries is summed strictly in order,
//! and a whole vocabulary's blocks can be summed in parallel with the same f32 result.
//!
//! Order of the filters is vLLM's: top-k, min-p (which commutes with top-k: it compares with
//! the maximum), then top-p on the probabilities renormalized over what is left. Every f32 step
//! below is the one the GPU's stage two emits, in the same order.

use crate::math::{exp_f32, ln_f32};
use crate::params::RowFilter;
use crate::rng::{counter, gumbel_f32, key, noise_bits, philox4x32_10};
use crate::INDEX_NONE;
use bytemuck::{Pod, Zeroable};

/// One token of a candidate list: its transformed logit (no noise) and vocabulary index.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct Scored {
    /// Transformed logit.
    pub logit: f32,
    /// Vocabulary index, or `INDEX_NONE` for padding.
    pub index: u32,
}

impl Scored {
    /// Padding of a list with fewer eligible tokens than slots.
    pub const EMPTY: Scored = Scored { logit: f32::NEG_INFINITY, index: INDEX_NONE };

    /// Whether this is padding.
    pub fn is_empty(&self) -> bool {
        self.index == INDEX_NONE
    }

    /// List order: higher logit first, ties to the lower index (order-independent).
    pub fn ranks_before(&self, other: &Scored) -> bool {
        self.logit > other.logit || (self.logit == other.logit && self.index < other.index)
    }

    /// [`Scored::ranks_before`] as an ordering for sorting into list order (`Less` ranks
    /// first; entries neither of which ranks before the other, such as padding, are `Equal`).
    pub fn rank_order(&self, other: &Scored) -> std::cmp::Ordering {
        if self.ranks_before(other) {
            std::cmp::Ordering::Less
        } else if other.ranks_before(self) {
            std::cmp::Ordering::Greater
        } else {
            std::cmp::Ordering::Equal
        }
    }
}

/// Layout of stage one's list buffer: `[B, tiles, per_tile]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TopLists {
    /// Rows.
    pub batch: usize,
    /// Vocabulary tiles.
    pub tiles: usize,
    /// Entries per (row, tile) list.
    pub per_tile: usize,
}

impl TopLists {
    /// Entries of the whole buffer.
    pub fn len(&self) -> usize {
        self.batch * self.tiles * self.per_tile
    }

    /// Whether the buffer holds no entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// All tiles' lists of one row.
    pub fn row<'a>(&self, lists: &'a [Scored], row: usize) -> &'a [Scored] {
        &lists[row * self.tiles * self.per_tile..][..self.tiles * self.per_tile]
    }

    /// Offset of (row, tile)'s list.
    pub fn slot(&self, row: usize, tile: usize) -> usize {
        (row * self.tiles + tile) * self.per_tile
    }
}

/// Inserts `s` into a sorted list, dropping the last entry, and returns its place; a no-op
/// (`None`) if `s` ranks after all. The list is sorted by [`Scored::ranks_before`] (padding
/// last), so `s` ranks before a suffix of it: [`insert_by`].
pub fn insert(list: &mut [Scored], s: Scored) -> Option<usize> {
    insert_by(list, s, |e| s.ranks_before(e))
}

/// Inserts `v` into a sorted `list` at the first entry it goes `before`, dropping the last
/// entry, and returns that place; `None`, changing nothing, when it goes before none.
/// `before` must be false on a prefix of `list` and true on the rest (where a new entry goes
/// in a sorted list), so the place is found by bisection.
pub fn insert_by<T: Copy>(list: &mut [T], v: T, before: impl Fn(&T) -> bool) -> Option<usize> {
    let pos = list.partition_point(|e| !before(e));
    (pos < list.len()).then(|| {
        shift_in(list, pos, v);
        pos
    })
}

/// Puts `v` at `pos` (`< list.len()`), moving the entries from `pos` one place on and
/// dropping the last: what [`insert_by`] does at its place, and what a list's companion
/// array (`raw::insert_paired`) does at the same place.
pub fn shift_in<T: Copy>(list: &mut [T], pos: usize, v: T) {
    list.copy_within(pos..list.len() - 1, pos + 1);
    list[pos] = v;
}

/// Why a row's lists cannot give its exact filtered sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ListError {
    /// A tile's list was too short for the row's cut (status 3; the GPU reruns with longer lists).
    #[error("row {row}: a vocabulary tile may hold more top tokens than its list kept")]
    Overflow {
        /// The row.
        row: usize,
    },
    /// A top-p / min-p nucleus past the lists' capacity (status 4).
    #[error(
        "row {row}: its top-p / min-p nucleus has more than the {capacity} tokens the candidate lists \
         hold; `Sampler::sample` serves such a row exactly, a device-API plan serves its first `R` \
         such rows per launch on the device and reports the rest (raise `R` with \
         `CudaSampler::plan_with_nucleus_rows`, serve the row on the host API, or set a top-k for it)"
    )]
    NucleusTooLarge {
        /// The row.
        row: usize,
        /// Entries the lists held.
        capacity: usize,
    },
}

/// Every entry of a row's lists, in list order (padding dropped). For lists that hold whole
/// tiles this is the row's whole eligible vocabulary, sorted: the exact nucleus path's `top`.
pub fn whole_row(row_lists: &[Scored]) -> Vec<Scored> {
    whole_row_with(row_lists, |keyed| keyed.sort_unstable_by_key(|e| e.0))
}

/// [`whole_row`] with the sort of `(key, entry)` pairs by key left to `sort` (a parallel sort
/// for a whole vocabulary). Keys are distinct, so any sort gives the same order.
pub fn whole_row_with(row_lists: &[Scored], sort: impl FnOnce(&mut [(u64, Scored)])) -> Vec<Scored> {
    // One u64 key per entry, ascending in list order: the logit's bits mapped to an unsigned
    // order, descending, with -0 read as +0 (they tie in `ranks_before`), then the index.
    let key = |s: &Scored| {
        let bits = (s.logit + 0.0).to_bits();
        let ascending = if bits >> 31 == 1 { !bits } else { bits | 1 << 31 };
        (u64::from(!ascending) << 32) | u64::from(s.index)
    };
    let mut all: Vec<(u64, Scored)> = row_lists.iter().filter(|s| !s.is_empty()).map(|s| (key(s), *s)).collect();
    sort(&mut all);
    all.into_iter().map(|e| e.1).collect()
}

/// Entries per block of a [`BlockedMass`] sum: the largest list, so every list of
/// `flashsample_ir::MAX_LIST_CAPACITY` entries or fewer is summed strictly in order.
pub const SUM_BLOCK: usize = flashsample_ir::MAX_LIST_CAPACITY as usize;

/// The running f32 sum of a sorted list's masses in the one order every backend uses: entries
/// are added in order inside blocks of [`SUM_BLOCK`]; a block's sum starts at `+0` and is added
/// to the total of the blocks before it when the block is full. The prefix before entry `j` is
/// `done + block`, so a parallel backend gives the same f32 values from per-block sums (one
/// thread per block) and a sequential scan of the block totals.
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockedMass {
    /// Sum of the completed blocks, in block order.
    done: f32,
    /// Sum of the current block's entries so far.
    block: f32,
    /// Entries in the current block.
    in_block: usize,
}

impl BlockedMass {
    /// The mass of every entry added so far (`done + block`; exactly `block` in the first block).
    pub fn total(&self) -> f32 {
        self.done + self.block
    }

    /// Adds the next entry's mass.
    pub fn add(&mut self, mass: f32) {
        self.block += mass;
        self.in_block += 1;
        if self.in_block == SUM_BLOCK {
            self.done += self.block;
            self.block = 0.0;
            self.in_block = 0;
        }
    }
}

/// How many f32 additions separate any prefix sum of an `n`-entry list from its terms in the
/// [`BlockedMass`] order: the depth the reference's error bound on the top-p cut scales with.
pub fn blocked_sum_depth(n: usize) -> usize {
    n.min(SUM_BLOCK) + n / SUM_BLOCK
}

/// How many of a row's best tokens stage three merges (`merge_row`'s `need`): what the row's
/// outputs read. Its `top_n` processed top logprobs; and, for a row drawn in stage three
/// (`drawn`: its filter is on and it is not greedy), its top-k when it has one (its survivors
/// are a prefix of those, so more would change nothing but the chance of an overflow), else
/// `capacity` (a top-p or min-p nucleus may reach that far). 0: the row is not merged.
pub fn row_need(filter: &RowFilter, drawn: bool, top_n: usize, capacity: usize) -> usize {
    let filtered = match (drawn, filter.top_k) {
        (false, _) => 0,
        (true, 0) => capacity,
        (true, k) => (k as usize).min(capacity),
    };
    filtered.max(top_n)
}

/// The row's global top `need` tokens, sorted, from its tiles' lists (`per_tile` each).
/// Shorter than `need` exactly when the row has fewer eligible tokens.
///
/// `ListError::Overflow` when a list may have dropped one of them: a full list (its last slot
/// holds a token) may have dropped tokens, all ranking after its last entry, and one of those
/// belongs if that entry ranks before the `need`-th token merged, or if fewer than `need`
/// were merged at all (a mask that leaves a row a few dozen tokens, digits say, may put more
/// of them in one tile than its list holds). Lists holding their whole tile drop nothing: the
/// GPU skips the test for them (`per_tile ≥ vocab_tile`); the host merges only lists shorter
/// than their tiles.
pub fn merge_row(row_lists: &[Scored], per_tile: usize, need: usize, row: usize) -> Result<Vec<Scored>, ListError> {
    let mut all = whole_row(row_lists);
    all.truncate(need);
    if per_tile < need {
        if let Some(last) = all.last() {
            let short = all.len() < need;
            let overflow = row_lists.chunks(per_tile).any(|tile| {
                let tail = tile[per_tile - 1];
                !tail.is_empty() && (short || tail.ranks_before(last))
            });
            if overflow {
                return Err(ListError::Overflow { row });
            }
        }
    }
    Ok(all)
}

/// How many of `top` (sorted, the row's global top list) survive the row's filter.
///
/// `complete` says `top` holds every eligible token of the row; `lse` is the row's full
/// logsumexp (used only when neither top-k nor min-p bounded the set inside the list).
/// `capacity` is the list length, for the error message.
pub fn survivors(top: &[Scored], f: &RowFilter, lse: f32, complete: bool, row: usize) -> Result<usize, ListError> {
    let too_large = ListError::NucleusTooLarge { row, capacity: top.len() };
    if top.is_empty() {
        return Ok(0);
    }
    let mut n = top.len();
    // Whether `top[..n]` is the whole candidate set so far, not a truncation of it.
    let mut bounded = complete;
    if f.top_k > 0 && (f.top_k as usize) <= n {
        n = f.top_k as usize;
        bounded = true;
    }
    if f.min_p > 0.0 {
        let threshold = top[0].logit + ln_f32(f.min_p);
        let passing = top[..n].iter().take_while(|s| s.logit >= threshold).count();
        if !bounded && passing == n {
            return Err(too_large);
        }
        n = passing;
        bounded = true;
    }
    if f.top_p < 1.0 {
        // Masses relative to the list's maximum when the set is bounded (renormalized over
        // it), else to the row's full logsumexp.
        let base = if bounded { top[0].logit } else { lse };
        let masses = masses(&top[..n], base);
        let cut = if bounded {
            let mut total = BlockedMass::default();
            masses.iter().for_each(|&e| total.add(e));
            f.top_p * total.total()
        } else {
            f.top_p
        };
        let mut cum = BlockedMass::default();
        let mut kept = 0;
        for &e in &masses {
            if kept > 0 && cum.total() >= cut {
                break;
            }
            cum.add(e);
            kept += 1;
        }
        if !bounded && kept == n && cum.total() < cut {
            return Err(too_large);
        }
        n = kept;
    } else if !bounded {
        // Only reached for a row whose filter is off; callers use the unfiltered path there.
        return Err(too_large);
    }
    Ok(n)
}

/// The Gumbel-max draw over `kept` for one (row, sample) at decode step `step`: the noise of
/// token `v` is `noise_bits(seed, stream_row, sample, v + vocab_offset, step)`, as in stage one.
/// Returns the winner and its perturbed score; `None` for an empty set.
pub fn draw(kept: &[Scored], seed: u64, stream_row: u32, step: u32, sample: u32, vocab_offset: u32) -> Option<(Scored, f32)> {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("fma") {
        // SAFETY: the host has FMA.
        return unsafe { fma::draw(kept, seed, stream_row, step, sample, vocab_offset) };
    }
    draw_inline(kept, seed, stream_row, step, sample, vocab_offset)
}

#[inline(always)]
fn draw_inline(kept: &[Scored], seed: u64, stream_row: u32, step: u32, sample: u32, vocab_offset: u32) -> Option<(Scored, f32)> {
    let mut best: Option<(Scored, f32)> = None;
    for s in kept {
        let g = gumbel_f32(noise_bits(seed, stream_row, sample, s.index.wrapping_add(vocab_offset), step));
        best = better_draw(best, (*s, s.logit + g));
    }
    best
}

/// The better of a draw's best so far and a candidate: the higher score, ties to the lower
/// token. A total order on distinct tokens, so any grouping of a set gives the same winner.
pub fn better_draw(best: Option<(Scored, f32)>, c: (Scored, f32)) -> Option<(Scored, f32)> {
    match best {
        Some((b, bs)) if !(c.1 > bs || (c.1 == bs && c.0.index < b.index)) => Some((b, bs)),
        _ => Some(c),
    }
}

/// A kept set laid out by token, for [`draw`]'s result computed in token order with one
/// Philox call per token quad (the quad's four tokens share it, as in stage one): a quarter of
/// the calls for a set that holds much of the vocabulary.
#[derive(Clone, Debug)]
pub struct KeptByToken {
    /// `[vocab]`: the kept token's logit, NaN for a token not kept (kept logits are finite).
    logits: Vec<f32>,
}

impl KeptByToken {
    /// The layout of `kept` (local indices below `vocab`).
    pub fn new(kept: &[Scored], vocab: usize) -> KeptByToken {
        let mut logits = vec![f32::NAN; vocab];
        for s in kept {
            logits[s.index as usize] = s.logit;
        }
        KeptByToken { logits }
    }

    /// Token quads of the layout (`vocab / 4`, rounded up).
    pub fn quads(&self) -> usize {
        self.logits.len().div_ceil(4)
    }

    /// [`draw`] over the kept tokens of quads `quads` (all of them: `0..self.quads()`), the
    /// same winner and score.
    pub fn draw(&self, quads: std::ops::Range<usize>, seed: u64, stream_row: u32, step: u32, sample: u32, vocab_offset: u32) -> Option<(Scored, f32)> {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("fma") {
            // SAFETY: the host has FMA.
            return unsafe { fma::draw_by_quads(self, quads, seed, stream_row, step, sample, vocab_offset) };
        }
        self.draw_inline(quads, seed, stream_row, step, sample, vocab_offset)
    }

    #[inline(always)]
    fn draw_inline(&self, quads: std::ops::Range<usize>, seed: u64, stream_row: u32, step: u32, sample: u32, vocab_offset: u32) -> Option<(Scored, f32)> {
        let key = key(seed);
        let mut best = None;
        for q in quads {
            let xs = &self.logits[4 * q..(4 * q + 4).min(self.logits.len())];
            if xs.iter().all(|x| x.is_nan()) {
                continue;
            }
            // `vocab_offset % 4 == 0`: a local quad is a global quad, its word j token 4q + j's.
            let base = (4 * q as u32).wrapping_add(vocab_offset);
            let words = philox4x32_10(counter(stream_row, sample, base, step), key);
            for (j, &x) in xs.iter().enumerate().filter(|(_, x)| !x.is_nan()) {
                let s = Scored { logit: x, index: (4 * q + j) as u32 };
                best = better_draw(best, (s, x + gumbel_f32(words[j])));
            }
        }
        best
    }
}

/// `exp_f32(x − base)` of each entry (a whole vocabulary's worth on the exact nucleus path).
fn masses(top: &[Scored], base: f32) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("fma") {
        // SAFETY: the host has FMA.
        return unsafe { fma::masses(top, base) };
    }
    masses_inline(top, base)
}

/// A plain loop into a filled buffer, not `map(..).collect()`: the collect's body is a generic
/// function compiled without the caller's target features, where `mul_add` is a libm call (10×
/// slower on the exact nucleus path's whole vocabulary).
#[inline(always)]
fn masses_inline(top: &[Scored], base: f32) -> Vec<f32> {
    let mut out = vec![0.0f32; top.len()];
    for (m, s) in out.iter_mut().zip(top) {
        *m = exp_f32(s.logit - base);
    }
    out
}

/// The bulk loops compiled for hosts with FMA: `mul_add` becomes one instruction (and the
/// loops vectorize) instead of a libm call. Fused multiply-adds round once either way, so the
/// results are bit for bit the portable ones (a test checks it).
#[cfg(target_arch = "x86_64")]
mod fma {
    use super::*;

    #[target_feature(enable = "fma")]
    pub(super) fn draw(kept: &[Scored], seed: u64, stream_row: u32, step: u32, sample: u32, vocab_offset: u32) -> Option<(Scored, f32)> {
        draw_inline(kept, seed, stream_row, step, sample, vocab_offset)
    }

    #[target_feature(enable = "fma")]
    pub(super) fn masses(top: &[Scored], base: f32) -> Vec<f32> {
        masses_inline(top, base)
    }

    #[target_feature(enable = "fma")]
    pub(super) fn draw_by_quads(
        kept: &KeptByToken,
        quads: std::ops::Range<usize>,
        seed: u64,
        stream_row: u32,
        step: u32,
        sample: u32,
        vocab_offset: u32,
    ) -> Option<(Scored, f32)> {
        kept.draw_inline(quads, seed, stream_row, step, sample, vocab_offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sc(logit: f32, index: u32) -> Scored {
        Scored { logit, index }
    }

    #[test]
    fn insert_keeps_order_and_drops_the_tail() {
        let mut l = [Scored::EMPTY; 3];
        for s in [sc(1.0, 4), sc(3.0, 1), sc(2.0, 2), sc(3.0, 0), sc(0.5, 9)] {
            insert(&mut l, s);
        }
        assert_eq!(l, [sc(3.0, 0), sc(3.0, 1), sc(2.0, 2)]);
    }

    #[test]
    fn insert_keeps_the_best_of_every_prefix_at_every_length() {
        // Random tokens with many tied logits (8 values) inserted into lists of 1..=70 entries:
        // after each insert the list is the best `len` tokens so far in list order, padded.
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x9e37_79b9_7f4a_7c15);
        for len in 1..=70usize {
            let mut list = vec![Scored::EMPTY; len];
            let mut seen: Vec<Scored> = Vec::new();
            let mut tokens: Vec<u32> = (0..200).collect();
            for i in (1..tokens.len()).rev() {
                tokens.swap(i, rng.random_range(0..=i));
            }
            for &index in &tokens {
                let s = sc(rng.random_range(0..8) as f32 - 3.0, index);
                insert(&mut list, s);
                seen.push(s);
                seen.sort_by(Scored::rank_order);
                let want: Vec<Scored> = seen.iter().copied().chain(std::iter::repeat(Scored::EMPTY)).take(len).collect();
                assert_eq!(list, want, "len {len} after {} inserts", seen.len());
            }
        }
    }

    #[test]
    fn merge_detects_a_tile_that_may_have_dropped_winners() {
        // Two tiles of two slots; tile 0 holds the three best tokens but kept only two.
        let lists = [sc(9.0, 0), sc(8.0, 1), sc(1.0, 5), sc(0.0, 6)];
        assert_eq!(merge_row(&lists, 2, 3, 0), Err(ListError::Overflow { row: 0 }));
        // Needing two, tile 0's two are exactly the answer: no token of it can be missing.
        assert_eq!(merge_row(&lists, 2, 2, 0).unwrap(), vec![sc(9.0, 0), sc(8.0, 1)]);
        // A tile whose last entry did not make the cut is complete.
        let lists = [sc(9.0, 0), sc(1.0, 1), sc(5.0, 5), sc(4.0, 6)];
        assert_eq!(merge_row(&lists, 2, 3, 0).unwrap(), vec![sc(9.0, 0), sc(5.0, 5), sc(4.0, 6)]);
        // Fewer eligible tokens than asked: a short, exact answer.
        let lists = [sc(2.0, 3), Scored::EMPTY, Scored::EMPTY, Scored::EMPTY];
        assert_eq!(merge_row(&lists, 2, 3, 0).unwrap(), vec![sc(2.0, 3)]);
        // Fewer merged than asked, but tile 0's list is full: it may have dropped a third token
        // that would be in the answer (a mask leaving a row three tokens, all in tile 0).
        let lists = [sc(9.0, 0), sc(8.0, 1), Scored::EMPTY, Scored::EMPTY];
        assert_eq!(merge_row(&lists, 2, 3, 0), Err(ListError::Overflow { row: 0 }));
        let lists = [sc(9.0, 0), Scored::EMPTY, sc(8.0, 5), Scored::EMPTY];
        assert_eq!(merge_row(&lists, 2, 3, 0).unwrap(), vec![sc(9.0, 0), sc(8.0, 5)]);
    }

    /// The lists' contract on random rows (random vocabularies, tile and list lengths, masks
    /// scattered or in one run, ties, filters, top logprobs): a row's merge of short lists is
    /// either an overflow or exactly its true top `row_need` (that of lists holding whole
    /// tiles), and `row_need` cuts no survivor: merging the capacity gives the same ones.
    #[test]
    fn short_lists_give_the_true_top_or_an_overflow() {
        use rand::{rngs::StdRng, Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(29);
        let (mut served, mut overflowed) = (0, 0);
        for trial in 0..6000 {
            let vocab = rng.random_range(1..300usize);
            let tile = rng.random_range(1..=64usize);
            let per_tile = rng.random_range(1..=8usize);
            let capacity = rng.random_range(1..=24usize);
            let top_n = if rng.random_bool(0.3) { rng.random_range(1..=capacity) } else { 0 };
            let eligible: Vec<bool> = if rng.random_bool(0.3) {
                let (start, len) = (rng.random_range(0..vocab), rng.random_range(1..=40));
                (0..vocab).map(|v| (start..start + len).contains(&v)).collect()
            } else {
                let p = rng.random_range(0.05..=1.0);
                (0..vocab).map(|_| rng.random_bool(p)).collect()
            };
            // Logits on a coarse grid, so that ties are common.
            let logits: Vec<f32> = (0..vocab).map(|_| rng.random_range(-16..16) as f32 / 4.0).collect();
            let lists = |per: usize| -> Vec<Scored> {
                (0..vocab.div_ceil(tile))
                    .flat_map(|t| {
                        let tokens: Vec<Scored> = (t * tile..((t + 1) * tile).min(vocab)).filter(|&v| eligible[v]).map(|v| sc(logits[v], v as u32)).collect();
                        whole_row(&tokens).into_iter().chain(std::iter::repeat(Scored::EMPTY)).take(per)
                    })
                    .collect()
            };
            let all = whole_row(&lists(tile));
            let lse = all.iter().map(|s| f64::from(s.logit).exp()).sum::<f64>().ln() as f32;
            let filter = RowFilter {
                top_k: if rng.random_bool(0.6) { rng.random_range(1..=capacity as u32) } else { 0 },
                top_p: [1.0, 0.9, 0.5][rng.random_range(0..3)],
                min_p: [0.0, 0.1][rng.random_range(0..2)],
            };
            let drawn = filter.is_drawn_in_stage_three(false);
            let need = row_need(&filter, drawn, top_n, capacity);
            if need == 0 {
                continue;
            }
            let truth: Vec<Scored> = all.iter().copied().take(need).collect();
            match merge_row(&lists(per_tile), per_tile, need, 0) {
                Err(ListError::Overflow { .. }) => overflowed += 1,
                Err(e) => panic!("trial {trial}: {e:?}"),
                Ok(top) => {
                    assert_eq!(top, truth, "trial {trial}: V {vocab} tile {tile} per_tile {per_tile} need {need}");
                    served += 1;
                }
            }
            if drawn {
                let wide: Vec<Scored> = all.iter().copied().take(capacity).collect();
                let kept = |top: &[Scored], n: usize| survivors(top, &filter, lse, top.len() < n, 0).map(|k| top[..k].to_vec());
                assert_eq!(kept(&truth, need), kept(&wide, capacity), "trial {trial}: {filter:?} need {need} of {capacity}");
            }
        }
        assert!(served > 1000 && overflowed > 500, "{served} served, {overflowed} overflowed");
    }

    #[test]
    fn a_row_merges_what_its_outputs_read() {
        let cap = 50;
        assert_eq!(row_need(&RowFilter::top_k(5), true, 0, cap), 5);
        assert_eq!(row_need(&RowFilter::top_k(5), true, 8, cap), 8);
        assert_eq!(row_need(&RowFilter { top_k: 5, top_p: 0.9, min_p: 0.1 }, true, 0, cap), 5);
        assert_eq!(row_need(&RowFilter::top_p(0.9), true, 0, cap), cap);
        assert_eq!(row_need(&RowFilter::top_k(5), false, 0, cap), 0, "a greedy or unfiltered row");
        assert_eq!(row_need(&RowFilter::OFF, false, 3, cap), 3);
        // A tile holding the row's best three of 2-entry lists: an overflow for a top-k 3 row,
        // not for a top-k 2 row, whose survivors are the same either way.
        let lists = [sc(9.0, 0), sc(8.0, 1), sc(1.0, 5), sc(0.0, 6)];
        let need = |k| row_need(&RowFilter::top_k(k), true, 0, cap);
        assert_eq!(merge_row(&lists, 2, need(3), 0), Err(ListError::Overflow { row: 0 }));
        assert_eq!(merge_row(&lists, 2, need(2), 0).unwrap(), vec![sc(9.0, 0), sc(8.0, 1)]);
    }

    #[test]
    fn filters_compose_like_vllm() {
        let top: Vec<Scored> = [3.0f32, 2.0, 1.0, 0.0, -1.0].iter().enumerate().map(|(i, &x)| sc(x, i as u32)).collect();
        let f = |top_k, top_p, min_p| RowFilter { top_k, top_p, min_p };
        assert_eq!(survivors(&top, &f(2, 1.0, 0.0), 0.0, true, 0), Ok(2));
        // p(0) ≈ 0.636 over the full five: 0.6 keeps one token, 0.7 two.
        assert_eq!(survivors(&top, &f(0, 0.6, 0.0), 0.0, true, 0), Ok(1));
        assert_eq!(survivors(&top, &f(0, 0.7, 0.0), 0.0, true, 0), Ok(2));
        // After top-k = 2 the renormalized p(0) ≈ 0.731: 0.7 keeps one token.
        assert_eq!(survivors(&top, &f(2, 0.7, 0.0), 0.0, true, 0), Ok(1));
        // min-p 0.1 keeps x >= 3 + ln 0.1 ≈ 0.70: three tokens.
        assert_eq!(survivors(&top, &f(0, 1.0, 0.1), 0.0, true, 0), Ok(3));
    }

    #[test]
    fn blocked_sums_are_sequential_within_a_block_and_parallel_across_blocks() {
        let masses: Vec<f32> = (0..3 * SUM_BLOCK + 17).map(|i| exp_f32(-((i * 37 % 101) as f32) / 7.0)).collect();
        // Up to one block: exactly the sequential f32 sum, prefix by prefix.
        let (mut blocked, mut sequential) = (BlockedMass::default(), 0.0f32);
        for &m in &masses[..SUM_BLOCK] {
            blocked.add(m);
            sequential += m;
            assert_eq!(blocked.total().to_bits(), sequential.to_bits());
        }
        // Past it: per-block sums (as parallel threads compute them) and a scan of their totals.
        let mut all = BlockedMass::default();
        masses.iter().for_each(|&m| all.add(m));
        let mut done = 0.0f32;
        for block in masses.chunks(SUM_BLOCK) {
            done += block.iter().fold(0.0f32, |a, &m| a + m);
        }
        assert_eq!(all.total().to_bits(), done.to_bits());
        assert_eq!(blocked_sum_depth(10), 10);
        assert_eq!(blocked_sum_depth(3 * SUM_BLOCK + 17), SUM_BLOCK + 3);
    }

    #[test]
    fn a_whole_sorted_vocabulary_is_cut_exactly() {
        // 3000 equal tokens, in two "tiles" listed whole: the 0.5-nucleus is the first 1500
        // (ties to the lower index), past any list.
        let lists: Vec<Scored> = (0..3000u32).rev().map(|v| sc(0.0, v)).collect();
        let top = whole_row(&lists);
        assert_eq!(top.len(), 3000);
        assert!(top.windows(2).all(|w| w[0].ranks_before(&w[1])));
        let lse = (3000.0f32).ln();
        let f = RowFilter::top_p(0.5);
        // Truncated to 1024 the nucleus does not fit; the whole row cuts it.
        assert_eq!(survivors(&top[..1024], &f, lse, false, 3), Err(ListError::NucleusTooLarge { row: 3, capacity: 1024 }));
        let n = survivors(&top, &f, lse, true, 3).unwrap();
        assert!((1499..=1501).contains(&n), "{n}");
        let min_p = RowFilter { min_p: 0.5, ..RowFilter::OFF };
        assert_eq!(survivors(&top, &min_p, lse, true, 3), Ok(3000));
    }

    #[test]
    fn the_fma_build_of_the_bulk_loops_is_bit_identical() {
        let top: Vec<Scored> = (0..5000u32).map(|i| sc(-((i * 7919 % 4099) as f32) / 97.0, i)).collect();
        let portable = masses_inline(&top, 0.25);
        assert!(masses(&top, 0.25).iter().zip(&portable).all(|(a, b)| a.to_bits() == b.to_bits()));
        // A set with gaps (every third token), drawn in list order and by token quads.
        let kept: Vec<Scored> = top.iter().copied().filter(|s| s.index % 3 != 1).collect();
        let by_token = KeptByToken::new(&kept, top.len() + 2);
        for sample in 0..4 {
            let (a, b) = (draw(&top, 5, 6, 7, sample, 8).unwrap(), draw_inline(&top, 5, 6, 7, sample, 8).unwrap());
            assert_eq!((a.0, a.1.to_bits()), (b.0, b.1.to_bits()));
            let want = draw(&kept, 5, 6, 7, sample, 8).unwrap();
            let all = by_token.draw(0..by_token.quads(), 5, 6, 7, sample, 8).unwrap();
            let portable = by_token.draw_inline(0..by_token.quads(), 5, 6, 7, sample, 8).unwrap();
            // Split in two ranges and merged: the same winner.
            let half = by_token.quads() / 2;
            let split = better_draw(by_token.draw(0..half, 5, 6, 7, sample, 8), by_token.draw(half..by_token.quads(), 5, 6, 7, sample, 8).unwrap()).unwrap();
            for got in [all, portable, split] {
                assert_eq!((got.0, got.1.to_bits()), (want.0, want.1.to_bits()));
            }
        }
    }

    #[test]
    fn a_nucleus_past_the_list_is_an_error() {
        let top = [sc(0.0, 0), sc(0.0, 1)];
        let lse = (1000.0f32).ln(); // 1000 equal tokens: two hold 0.2% of the mass
        let f = RowFilter { top_k: 0, top_p: 0.9, min_p: 0.0 };
        assert_eq!(survivors(&top, &f, lse, false, 7), Err(ListError::NucleusTooLarge { row: 7, capacity: 2 }));
        let f = RowFilter { top_k: 0, top_p: 1.0, min_p: 0.5 };
        assert_eq!(survivors(&top, &f, lse, false, 7), Err(ListError::NucleusTooLarge { row: 7, capacity: 2 }));
        // The same list with all tokens present is fine.
        assert_eq!(survivors(&top, &RowFilter { top_k: 0, top_p: 0.9, min_p: 0.0 }, lse, true, 7), Ok(2));
    }
}
