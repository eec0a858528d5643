//! Tests of stage three without a GPU, on its LLVM IR interpreted on the host
//! ([`super::ir_sim`]): a stage three that finishes the launch (`FilterArgs::finish`) leaves
//! the same bits as a stage three followed by `flashsample_finalize`, over random per-tile
//! lists and rows that are filtered, greedy (temperature 0), unfiltered or failed in stage two.

use super::ir_sim::{arg_words, Memory, Module};
use flashsample_abi::filter::{merge_row, row_need, survivors, TopLists};
use flashsample_abi::{RowFilter, RowStatus, Scored, INDEX_NONE};
use super::glue_sim::finalize;
use flashsample_codegen_ptx::{FilterArgs, FinalizeArgs, GpuConfig, Grid, Schedule, FILTER, FILTER_THREADS};
use flashsample_ir::{DType, PipelineBuilder};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

const ROWS: usize = 5;
/// More tiles than `NEED`: the merge finds its head threshold (a radix select over the tiles'
/// first entries) before staging 1120 entries a row.
const TILES: usize = 140;
const PER_TILE: usize = 8;
const VOCAB_TILE: usize = 128;
/// The pipeline's `max_k`: what stage three merges of a row without a top-k
/// (`abi::filter::row_need`).
const NEED: u32 = 16;
/// Row 1 is greedy (its temperature is 0) and row 3 fails in stage two, so rows 0, 2 and 4
/// are drawn in stage three.
const FILTERS: [RowFilter; ROWS] = [
    RowFilter { top_k: 0, top_p: 0.95, min_p: 0.0 },
    RowFilter { top_k: 0, top_p: 0.9, min_p: 0.0 },
    RowFilter { top_k: 3, top_p: 0.8, min_p: 0.0 },
    RowFilter { top_k: 0, top_p: 1.0, min_p: 0.0 },
    RowFilter { top_k: 4, top_p: 1.0, min_p: 0.1 },
];

fn bytes<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn read(mem: &Memory, addr: u64) -> Vec<u32> {
    bytemuck::pod_collect_to_vec(&mem.bufs[(addr >> 40) as usize - 1])
}

/// Per (row, tile) its best `PER_TILE` tokens by logit (descending, a tile's tokens distinct),
/// and per row the logsumexp of every listed logit. Row 0's only tokens (its other tiles'
/// lists are empty) fill its last tile's list: fewer than `NEED` merged with a full list, an
/// overflow (`merge_row`), which stage three must report, not a short top list. Row 2's tile 7
/// holds its best `PER_TILE` tokens: an overflow at `NEED`, not at the row's own top-k 3.
fn lists(seed: u64) -> (Vec<Scored>, Vec<f32>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    let mut lse = Vec::new();
    for row in 0..ROWS {
        let mut sum = 0f64;
        for tile in 0..TILES {
            if row == 0 && tile < TILES - 1 {
                out.extend([Scored::EMPTY; PER_TILE]);
                continue;
            }
            let range = if row == 2 && tile == 7 { 4.5..6.0 } else { -8.0..4.0 };
            let mut entries: Vec<Scored> =
                (0..PER_TILE).map(|j| Scored { logit: rng.random_range(range.clone()), index: (tile * VOCAB_TILE + j * 7) as u32 }).collect();
            entries.sort_by(|a, b| b.logit.total_cmp(&a.logit));
            sum += entries.iter().map(|e| f64::from(e.logit).exp()).sum::<f64>();
            out.extend(entries);
        }
        lse.push((sum.ln() + 0.25) as f32);
    }
    (out, lse)
}

/// What one launch leaves: tokens, scores, logits, status, logprobs, and the survivors it
/// keeps for a decision (`FilterArgs::kept`, `Scored [ROWS, NEED]` as u32 pairs).
fn run(finish: bool, seed: u64) -> [Vec<u32>; 6] {
    let p = PipelineBuilder::new("Finish", DType::BF16, DType::BF16).temperature_per_row("t").filter("filter", NEED).gumbel("seed", 1).build().unwrap();
    let mut c = GpuConfig::new(VOCAB_TILE as u32, 8, 4, Schedule::Simt { grid: Grid::PerItem });
    c.list_per_tile = PER_TILE as u32;
    let ir = flashsample_codegen_ptx::llvm_ir(&p, &c).unwrap();
    let mut mem = Memory { bufs: Vec::new() };
    let shared = ["top", "cand", "red", "misc", "hist", "wsum", "ex"];
    let globals: HashMap<String, u64> = shared.iter().map(|a| (format!("@fs_filter_{a}"), mem.add(vec![0; 1 << 16]))).collect();
    let filter = Module::with_callees(&ir, &[FILTER.kernel], &globals);
    let (entries, row_lse) = lists(seed);
    let filters = FILTERS;
    // Row 1 is greedy (temperature 0), row 3 failed in stage two (non-finite).
    let temperatures = [0.7f32, 0.0, 1.0, 0.7, 0.9];
    let status = [0u32, 0, 0, RowStatus::NonFinite.code(), 0];
    let stage_two_tokens: Vec<u32> = (0..ROWS as u32).map(|r| r * 11 + 3).collect();
    let stage_two_logits: Vec<f32> = (0..ROWS).map(|r| 1.5 - r as f32 * 0.25).collect();
    let lists = mem.add(bytes(&entries));
    let (tokens, scores, logits) = (mem.add(bytes(&stage_two_tokens)), mem.add(vec![0; ROWS * 4]), mem.add(bytes(&stage_two_logits)));
    let (out_status, lse, logprobs) = (mem.add(bytes(&status)), mem.add(bytes(&row_lse)), mem.add(vec![0xcd; ROWS * 4]));
    let kept = mem.add(vec![0xab; ROWS * NEED as usize * size_of::<Scored>()]);
    let args = FilterArgs {
        lists,
        tiles: TILES as u32,
        per_tile: PER_TILE as u32,
        need: NEED,
        batch: ROWS as u32,
        samples: 1,
        filters: mem.add(bytes(&filters)),
        lse,
        temperatures: mem.add(bytes(&temperatures)),
        all_greedy: 0,
        seed: 42,
        row_seeds: 0,
        vocab_offset: 0,
        top_n: 0,
        out_tokens: tokens,
        out_scores: scores,
        out_logits: logits,
        out_top: 0,
        out_status,
        row_steps: 0,
        row_base: 0,
        raw_lists: 0,
        raw_lse: 0,
        list_raws: 0,
        finish: u32::from(finish),
        out_logprobs: if finish { logprobs } else { 0 },
        kept,
    }
    .args();
    filter.run_grid(FILTER.kernel, &arg_words(&args), (ROWS as u32, 1, 1), FILTER_THREADS as usize, &mut mem);
    if !finish {
        finalize(&FinalizeArgs { tokens, status: out_status, logits, lse, logprobs, n: ROWS as u32, samples: 1 }, &mut mem);
    }
    [read(&mem, tokens), read(&mem, scores), read(&mem, logits), read(&mem, out_status), read(&mem, logprobs), read(&mem, kept)]
}

/// The survivors a filtered row keeps for the decision are the abi's (`merge_row` +
/// `survivors` of its lists, in order, `Scored::EMPTY` after them); a row that stage three
/// does not draw (greedy, failed, overflowed) keeps none (an `EMPTY` first entry).
#[test]
fn stage_three_keeps_each_filtered_rows_survivors_for_the_decision() {
    let filters = [(0, true), (1, false), (2, true), (3, false), (4, true)];
    for seed in [5, 6, 7] {
        let [_, _, _, status, _, kept] = run(true, seed);
        let kept: Vec<Scored> = bytemuck::pod_collect_to_vec(&bytes(&kept));
        let (entries, row_lse) = lists(seed);
        let layout = TopLists { batch: ROWS, tiles: TILES, per_tile: PER_TILE };
        let mut served = 0;
        for (r, drawn) in filters {
            let row = &kept[r * NEED as usize..][..NEED as usize];
            // A drawn row's status is the abi's: an overflow where merge_row of the row's own
            // need finds one.
            let need = row_need(&FILTERS[r], drawn, 0, NEED as usize);
            let overflows = merge_row(layout.row(&entries, r), PER_TILE, need, r).is_err();
            assert!(r != 0 || overflows, "seed {seed}: row 0's one full list overflows");
            let at_capacity = merge_row(layout.row(&entries, r), PER_TILE, NEED as usize, r).is_err();
            assert!(r != 2 || (at_capacity && !overflows), "seed {seed}: row 2 overflows at NEED, not at its top-k");
            if drawn && status[r] != RowStatus::NonFinite.code() {
                let want = if overflows { RowStatus::ListOverflow } else { RowStatus::Ok };
                assert_eq!(status[r], want.code(), "seed {seed} row {r}: status");
            }
            if !drawn || status[r] != RowStatus::Ok.code() {
                assert_eq!(row[0].index, INDEX_NONE, "seed {seed} row {r}: no survivors kept");
                continue;
            }
            let top = merge_row(layout.row(&entries, r), PER_TILE, need, r).unwrap();
            let n = survivors(&top, &FILTERS[r], row_lse[r], top.len() < need, r).unwrap();
            let want: Vec<Scored> = top[..n].iter().copied().chain(std::iter::repeat(Scored::EMPTY)).take(NEED as usize).collect();
            assert_eq!(bytes(row), bytes(&want), "seed {seed} row {r}: {n} survivors");
            served += 1;
        }
        assert!(served >= 2, "seed {seed}: {served} filtered rows served");
    }
}

#[test]
fn a_finishing_stage_three_equals_stage_three_then_the_finishing_kernel() {
    for seed in [5, 6] {
        let (finished, two_kernels) = (run(true, seed), run(false, seed));
        assert_eq!(finished, two_kernels, "seed {seed}: tokens, scores, logits, status, logprobs, kept survivors");
        let [tokens, _, _, status, logprobs, _] = &finished;
        assert_eq!(tokens[3], INDEX_NONE, "a row stage two failed has no sample");
        assert_eq!(tokens[1], 14, "a greedy row keeps stage two's argmax");
        for r in [0, 2, 4] {
            let listed = tokens[r] != INDEX_NONE && (tokens[r] as usize % VOCAB_TILE).is_multiple_of(7);
            assert!(listed || status[r] != 0, "row {r}: stage three drew token {} from the lists", tokens[r]);
        }
        assert!(status.iter().filter(|&&s| s == 0).count() >= 3, "most rows are ok: {status:?}");
        for (r, (&t, &lp)) in tokens.iter().zip(logprobs).enumerate() {
            let lp = f32::from_bits(lp);
            assert_eq!(lp.is_nan(), status[r] != 0, "row {r}: logprob {lp}, status {}", status[r]);
            assert!(status[r] != 0 || (t != INDEX_NONE && lp <= 0.0), "row {r}: token {t}, logprob {lp}");
        }
    }
}
