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

/// One stage-three launch's inputs: `rows` rows of `tiles` lists of `per_tile` entries, each
/// row's logsumexp, filter, temperature and stage-two status, merged to `need` (the
/// pipeline's `max_k`) at most.
struct Launch {
    rows: usize,
    tiles: usize,
    per_tile: usize,
    need: u32,
    entries: Vec<Scored>,
    lse: Vec<f32>,
    filters: Vec<RowFilter>,
    temperatures: Vec<f32>,
    status: Vec<u32>,
}

impl Launch {
    /// The fixed launch: [`lists`], [`FILTERS`]; row 1 greedy (temperature 0), row 3 failed
    /// in stage two (non-finite).
    fn fixed(seed: u64) -> Launch {
        let (entries, lse) = lists(seed);
        Launch {
            rows: ROWS,
            tiles: TILES,
            per_tile: PER_TILE,
            need: NEED,
            entries,
            lse,
            filters: FILTERS.to_vec(),
            temperatures: vec![0.7, 0.0, 1.0, 0.7, 0.9],
            status: vec![0, 0, 0, RowStatus::NonFinite.code(), 0],
        }
    }

    /// What the launch leaves: tokens, scores, logits, status, logprobs, and the survivors it
    /// keeps for a decision (`FilterArgs::kept`, `Scored [rows, need]` as u32 pairs).
    fn run(&self, finish: bool) -> [Vec<u32>; 6] {
        let p = PipelineBuilder::new("Finish", DType::BF16, DType::BF16).temperature_per_row("t").filter("filter", self.need).gumbel("seed", 1).build().unwrap();
        let mut c = GpuConfig::new(VOCAB_TILE as u32, 8, 4, Schedule::Simt { grid: Grid::PerItem });
        c.list_per_tile = self.per_tile as u32;
        let ir = flashsample_codegen_ptx::llvm_ir(&p, &c).unwrap();
        let mut mem = Memory { bufs: Vec::new() };
        let shared = ["top", "cand", "red", "misc", "hist", "wsum", "ex"];
        let globals: HashMap<String, u64> = shared.iter().map(|a| (format!("@fs_filter_{a}"), mem.add(vec![0; 1 << 16]))).collect();
        let filter = Module::with_callees(&ir, &[FILTER.kernel], &globals);
        let rows = self.rows;
        let stage_two_tokens: Vec<u32> = (0..rows as u32).map(|r| r * 11 + 3).collect();
        let stage_two_logits: Vec<f32> = (0..rows).map(|r| 1.5 - r as f32 * 0.25).collect();
        let lists = mem.add(bytes(&self.entries));
        let (tokens, scores, logits) = (mem.add(bytes(&stage_two_tokens)), mem.add(vec![0; rows * 4]), mem.add(bytes(&stage_two_logits)));
        let (out_status, lse, logprobs) = (mem.add(bytes(&self.status)), mem.add(bytes(&self.lse)), mem.add(vec![0xcd; rows * 4]));
        let kept = mem.add(vec![0xab; rows * self.need as usize * size_of::<Scored>()]);
        let args = FilterArgs {
            lists,
            tiles: self.tiles as u32,
            per_tile: self.per_tile as u32,
            need: self.need,
            batch: rows as u32,
            samples: 1,
            filters: mem.add(bytes(&self.filters)),
            lse,
            temperatures: mem.add(bytes(&self.temperatures)),
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
        filter.run_grid(FILTER.kernel, &arg_words(&args), (rows as u32, 1, 1), FILTER_THREADS as usize, &mut mem);
        if !finish {
            finalize(&FinalizeArgs { tokens, status: out_status, logits, lse, logprobs, n: rows as u32, samples: 1 }, &mut mem);
        }
        [read(&mem, tokens), read(&mem, scores), read(&mem, logits), read(&mem, out_status), read(&mem, logprobs), read(&mem, kept)]
    }

    /// Checks each row's status and kept survivors against the abi: `merge_row` of the row's
    /// `row_need`, then `survivors` (status 3 / 4 on their errors; no survivors kept for a row
    /// that is not drawn, failed or refused). Returns how many rows were served.
    fn check(&self, status: &[u32], kept: &[u32], what: &str) -> usize {
        let kept: Vec<Scored> = bytemuck::pod_collect_to_vec(&bytes(kept));
        let layout = TopLists { batch: self.rows, tiles: self.tiles, per_tile: self.per_tile };
        let need_max = self.need as usize;
        let mut served = 0;
        for r in 0..self.rows {
            let row = &kept[r * need_max..][..need_max];
            let drawn = self.status[r] == 0 && self.filters[r].is_drawn_in_stage_three(self.temperatures[r] == 0.0);
            let need = row_need(&self.filters[r], drawn, 0, need_max);
            // A row that is not drawn keeps stage two's status (not checked here).
            let want = match (drawn, merge_row(layout.row(&self.entries, r), self.per_tile, need, r)) {
                (false, _) => Err(RowStatus::Ok),
                (true, Err(e)) => Err(RowStatus::from(e)),
                (true, Ok(top)) => match survivors(&top, &self.filters[r], self.lse[r], top.len() < need, r) {
                    Ok(n) => Ok(top[..n].to_vec()),
                    Err(e) => Err(RowStatus::from(e)),
                },
            };
            match want {
                Ok(survivors) => {
                    assert_eq!(status[r], RowStatus::Ok.code(), "{what} row {r}: status");
                    let want: Vec<Scored> = survivors.iter().copied().chain(std::iter::repeat(Scored::EMPTY)).take(need_max).collect();
                    assert_eq!(bytes(row), bytes(&want), "{what} row {r}: {} survivors", survivors.len());
                    served += 1;
                }
                Err(st) => {
                    if drawn {
                        assert_eq!(status[r], st.code(), "{what} row {r}: status");
                    }
                    assert_eq!(row[0].index, INDEX_NONE, "{what} row {r}: no survivors kept");
                }
            }
        }
        served
    }
}

fn run(finish: bool, seed: u64) -> [Vec<u32>; 6] {
    Launch::fixed(seed).run(finish)
}

/// The survivors a filtered row keeps for the decision are the abi's (`merge_row` +
/// `survivors` of its lists, in order, `Scored::EMPTY` after them); a row that stage three
/// does not draw (greedy, failed, overflowed) keeps none (an `EMPTY` first entry).
#[test]
fn stage_three_keeps_each_filtered_rows_survivors_for_the_decision() {
    for seed in [5, 6, 7] {
        let launch = Launch::fixed(seed);
        let [_, _, _, status, _, kept] = launch.run(true);
        let layout = TopLists { batch: ROWS, tiles: TILES, per_tile: PER_TILE };
        // Row 0's one full list overflows; row 2's hot tile overflows at NEED, not at its top-k 3.
        let overflows = |r: usize, need: usize| merge_row(layout.row(&launch.entries, r), PER_TILE, need, r).is_err();
        assert!(overflows(0, NEED as usize) && overflows(2, NEED as usize) && !overflows(2, 3), "seed {seed}");
        assert_eq!(status[0], RowStatus::ListOverflow.code(), "seed {seed}: row 0");
        let served = launch.check(&status, &kept, &format!("seed {seed}"));
        assert!(served >= 2, "seed {seed}: {served} filtered rows served");
    }
}

/// Random launches: list lengths 1–8 against a `max_k` of up to 32, 8–160 tiles, rows whose
/// lists are scattered, clustered in a few full tiles (fewer than `need` merged) or led by one
/// hot tile, logits on a coarse grid (ties), random top-k / top-p / min-p: every row's status
/// and kept survivors are the abi's.
#[test]
fn random_lists_keep_the_abis_statuses_and_survivors() {
    let (mut served, mut overflowed) = (0, 0);
    for seed in 0..8u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1000 + seed);
        let (rows, tiles, per_tile) = (6, rng.random_range(8..=160usize), rng.random_range(1..=8usize));
        let need = rng.random_range(per_tile as u32 + 1..=32);
        let (mut entries, mut lse) = (Vec::new(), Vec::new());
        for r in 0..rows {
            let (live, hot): (Vec<bool>, Option<usize>) = match r % 3 {
                0 => ((0..tiles).map(|_| rng.random_bool(0.9)).collect(), None),
                1 => {
                    let few: Vec<usize> = (0..rng.random_range(1..=3)).map(|_| rng.random_range(0..tiles)).collect();
                    ((0..tiles).map(|t| few.contains(&t)).collect(), None)
                }
                _ => (vec![true; tiles], Some(rng.random_range(0..tiles))),
            };
            let mut sum = 0f64;
            for (t, &live) in live.iter().enumerate() {
                let count = if !live { 0 } else if rng.random_bool(0.8) { per_tile } else { rng.random_range(0..per_tile) };
                let lift = if hot == Some(t) { 12.0 } else { 0.0 };
                let tokens: Vec<Scored> =
                    (0..count).map(|j| Scored { logit: rng.random_range(-32..16) as f32 / 4.0 + lift, index: (t * VOCAB_TILE + j * 7) as u32 }).collect();
                let sorted = flashsample_abi::filter::whole_row(&tokens);
                sum += sorted.iter().map(|e| f64::from(e.logit).exp()).sum::<f64>();
                entries.extend(sorted.into_iter().chain(std::iter::repeat(Scored::EMPTY)).take(per_tile));
            }
            lse.push((sum.ln() + 0.1) as f32);
        }
        let filters: Vec<RowFilter> = (0..rows)
            .map(|_| RowFilter {
                top_k: if rng.random_bool(0.6) { rng.random_range(1..=need) } else { 0 },
                top_p: [1.0, 0.9, 0.5][rng.random_range(0..3)],
                min_p: [0.0, 0.1][rng.random_range(0..2)],
            })
            .collect();
        let launch = Launch { rows, tiles, per_tile, need, entries, lse, filters, temperatures: vec![0.8; rows], status: vec![0; rows] };
        let [_, _, _, status, _, kept] = launch.run(true);
        served += launch.check(&status, &kept, &format!("seed {seed} (tiles {tiles}, per_tile {per_tile}, need {need})"));
        overflowed += status.iter().filter(|&&s| s == RowStatus::ListOverflow.code()).count();
    }
    assert!(served >= 10 && overflowed >= 5, "{served} rows served, {overflowed} overflowed");
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
