//! Speculative verification's residual lists (DESIGN.md "Speculative verification"): per
//! (draft row, vocab tile) the `residual_per_tile` best tokens by the residual stream's
//! perturbed score `x + G_res`, selected from the list tile by warp-wide rounds and written as
//! `abi::Candidate`s sorted by score (ties to the lower index, as `abi::speculative::insert_residual`).

use super::lists::{select_at, LaneQueue, Popped, TileColumn};
use super::{Gen, Item, Thread};
use crate::entries::{Candidate, CANDIDATE_BYTES};
use crate::ir::{i32c, Func, Icmp, F32, I1, I32};
use crate::math;
use crate::params::arg;
use flashsample_abi::rng::NoiseStream;
use flashsample_abi::INDEX_NONE;

/// Whether kernel row `row` (launch row `%row_base + row`) of a verifying launch is a draft
/// row: `(row_base + row) mod spec_period ≠ spec_period − 1` (each sequence's last row is its
/// bonus); every row when `%spec_period` is 0.
pub(crate) fn is_draft_row(f: &mut Func, row: &I32) -> I1 {
    let launch_row = f.add(row, &arg::ROW_BASE);
    let every = f.icmp(Icmp::Eq, &arg::SPEC_PERIOD, &i32c(0));
    let period = f.sel(&every, &i32c(1), &arg::SPEC_PERIOD);
    let pos = f.urem(&launch_row, &period);
    let last = f.sub(&period, &i32c(1));
    let draft = f.icmp(Icmp::Ne, &pos, &last);
    f.or(&every, &draft)
}

/// Draft rows a warp selects side by side ([`Gen::group_rows`]). One: the bonus row of each
/// sequence (every `k + 1`-th row) then skips its noise and rounds, where a pair of rows
/// rarely has nothing to store. On an H100 (BENCHMARKS.md, GPU 2026-12-07) pairs without that
/// skip made the verifying stage one 4–13 % slower than single rows with it (D = 4096, B = 64,
/// k = 3: 1434 against 1276 µs).
const RESIDUAL_ROWS_PER_WARP: u32 = 1;

impl Gen<'_> {
    /// The residual lists of the item's draft rows. A warp selects `rows` rows side by side
    /// (uniform branches, so the warp-wide rounds see every lane; the rows' noise chains and
    /// rounds interleave, as in [`Gen::list_epilogue`]): lane `l` reads the `E = vocab_tile / 32`
    /// consecutive transformed logits `l·E ..` of each row's column from the list tile (stored
    /// here unless the list epilogue already did), draws their residual-stream Gumbel noise (the
    /// token noise's counter layout, `abi::speculative::residual_bits`, one Philox block per 4
    /// tokens) and keys `order_key(x + G)` (0 for an excluded token, which never enters a list)
    /// into a [`LaneQueue`]; `residual_per_tile` rounds of it then write the list, the popping
    /// lane taking the token's score and `x` from its registers. Every token of a draft row
    /// draws its noise: the list is exact without any noise skip. A group none of whose columns
    /// is a draft row of the launch and tile skips the work; inside a group that runs, such a
    /// column runs alike on clamped inputs and stores nothing.
    pub(super) fn residual_epilogue(&self, f: &mut Func, th: &Thread, it: &Item, x: &[F32]) {
        let c = self.c;
        let vt = c.vocab_tile;
        let bt = c.batch_tile;
        let base = if c.list_per_tile > 0 {
            f.add(&th.scratch, &i32c(c.smem_layout().list_tile))
        } else {
            self.store_list_tile(f, th, x)
        };
        let per_tile = c.residual_per_tile;
        let per_lane = vt / 32;
        let rows = self.group_rows(RESIDUAL_ROWS_PER_WARP);
        let none = i32c(INDEX_NONE as i32);
        let has_out = f.non_null(&arg::RESIDUAL_LISTS);
        let has_rs = f.non_null(&arg::ROW_SEEDS);
        let lane_first = f.mul(&th.lane, &i32c(per_lane));
        // Global index of the lane's first token (the noise counter's token).
        let first = f.add(&it.v0, &lane_first);
        let first_g = f.add(&first, &arg::VOCAB_OFFSET);
        let last_row = f.add(&arg::BATCH, &i32c(-1));
        let warp_first = f.mul(&th.warp, &i32c(rows));
        f.for_loop(&warp_first, &i32c(bt), &i32c(c.warps * rows), |f, col0| {
            // Per row of the group: its column, its row (clamped to the launch: a row past it
            // draws the last row's stream, so its loads stay in bounds) and its store guard.
            let columns: Vec<(TileColumn, I32, I1)> = (0..rows)
                .map(|r| {
                    let column = self.tile_column(f, &base, col0, r, &lane_first);
                    let row = f.add(&it.b0, &column.col_rd);
                    let row_ok = f.icmp(Icmp::Ult, &row, &arg::BATCH);
                    let draft = is_draft_row(f, &row);
                    let ok = f.and(&row_ok, &draft);
                    let ok = f.and(&ok, &column.inside);
                    let ok = f.and(&ok, &has_out);
                    (column, row, ok)
                })
                .collect();
            // A group with no row to store (bonus rows, rows past the launch or the tile)
            // skips its noise and rounds: warp-uniform, as the group is the warp's.
            let any_ok = columns.iter().skip(1).fold(columns[0].2.clone(), |a, (_, _, ok)| f.or(&a, ok));
            f.if_then(&any_ok, |f| {
                // Per row: its scores and logits, its queue, the list slot and the store guard.
                let mut group = Vec::new();
                for (TileColumn { vals: xs, .. }, row, ok) in columns {
                    let row_rd = f.umin(&row, &last_row);
                    let r64 = f.zext(&row_rd);
                    let stream = math::row_stream(f, &has_rs, &row_rd, &r64);
                    let word3 = math::stream_word3(f, &r64, NoiseStream::SpecResidual);
                    let mut scores = Vec::new();
                    let mut block = None;
                    for (o, xv) in xs.iter().enumerate() {
                        let g = f.add(&first_g, &i32c(o as u32));
                        let bits = if per_lane.is_multiple_of(4) {
                            // The lane's first token is a multiple of 4: token o is word o mod 4.
                            if o % 4 == 0 {
                                let ctr = f.lshr(&g, &i32c(2));
                                block = Some(math::philox_block(f, [&ctr, &stream.ctr_row, &i32c(0), &word3], &stream.key));
                            }
                            f.extract(block.as_ref().expect("a block per 4 tokens"), o % 4)
                        } else {
                            math::token_bits(f, &g, &stream, &i32c(0), &word3)
                        };
                        let noise = math::gumbel(f, &bits);
                        scores.push(f.fadd(xv, &noise));
                    }
                    let keys: Vec<I32> = scores.iter().map(|s| f.order_key(s)).collect();
                    let queue = LaneQueue::sorted(f, &keys);
                    let slot0 = it.first_slot(f, &row, per_tile);
                    group.push((queue, scores, xs, slot0, ok));
                }
                f.for_loop(&i32c(0), &i32c(per_tile), &i32c(1), |f, k| {
                    // Every row's round first (straight-line, so they interleave), then the stores.
                    let popped: Vec<Popped> = group.iter().map(|(queue, ..)| queue.pop(f, &th.lane)).collect();
                    for (Popped { real, me, pos, .. }, (_, scores, xs, slot0, ok)) in popped.into_iter().zip(&group) {
                        let idx = f.add(&first, &pos);
                        let index = f.sel(&real, &idx, &none);
                        let write = f.and(&me, ok);
                        f.if_then(&write, |f| {
                            let score = select_at(f, &pos, scores);
                            let score = f.sel(&real, &score, &F32::NEG_INF);
                            let logit = select_at(f, &pos, xs);
                            let logit = f.sel(&real, &logit, &F32::NEG_INF);
                            let slot = f.add(slot0, k);
                            let s64 = f.zext(&slot);
                            let a = f.gaddr(&arg::RESIDUAL_LISTS, &s64, CANDIDATE_BYTES);
                            Candidate { score, index, logit }.store(f, &a);
                        });
                    }
                });
            });
        });
    }
}
