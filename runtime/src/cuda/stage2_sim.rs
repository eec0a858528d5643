//! Tests of stage two without a GPU, on its LLVM IR interpreted on the host
//! ([`super::ir_sim`]): a stage two that finishes the launch (`Stage2Args::finish`) leaves the
//! same bits as a stage two followed by `flashsample_finalize`, for rows that are ok,
//! all-masked or non-finite; and from the tiles' logsumexp partials, each row's logsumexp,
//! target logprob and (for a failed row, zeroed) rank are `abi`'s bit for bit.

use super::ir_sim::{arg_words, Memory, Module};
use flashsample_abi::lse::{LsePartial, LseSum};
use flashsample_abi::{Candidate, RowStatus, INDEX_NONE, INDEX_NONFINITE};
use super::glue_sim::finalize;
use flashsample_codegen_ptx::{FinalizeArgs, GpuConfig, Grid, Schedule, Stage2Args, STAGE2, STAGE2_THREADS};
use flashsample_ir::{DType, PipelineBuilder};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

const ROWS: usize = 6;
const SAMPLES: usize = 2;
const TILES: usize = 9;

fn bytes<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn read<T: bytemuck::Pod>(mem: &Memory, addr: u64) -> Vec<T> {
    bytemuck::pod_collect_to_vec(&mem.bufs[(addr >> 40) as usize - 1])
}

/// Stage two's candidates per (row, sample, tile) (row 2 has none at all, row 4 a non-finite
/// tile) and a logsumexp per row.
fn inputs(seed: u64) -> (Vec<Candidate>, Vec<f32>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut cands = Vec::new();
    for row in 0..ROWS {
        for _ in 0..SAMPLES {
            for tile in 0..TILES {
                let index = match (row, tile) {
                    (2, _) => INDEX_NONE,
                    (4, 5) => INDEX_NONFINITE,
                    _ if rng.random_bool(0.2) => INDEX_NONE,
                    _ => (tile * 100 + rng.random_range(0..100)) as u32,
                };
                cands.push(Candidate { score: rng.random_range(-20.0..20.0), index, logit: rng.random_range(-10.0..10.0) });
            }
        }
    }
    (cands, (0..ROWS).map(|_| rng.random_range(5.0..15.0)).collect())
}

/// Stage two of `p` (SIMT config) parsed, with its shared arrays in fresh memory.
fn stage_two(p: &flashsample_ir::Pipeline) -> (Module, Memory) {
    let c = GpuConfig::new(128, 8, 4, Schedule::Simt { grid: Grid::PerItem });
    let ir = flashsample_codegen_ptx::llvm_ir(p, &c).unwrap();
    let mut mem = Memory { bufs: Vec::new() };
    let globals: HashMap<String, u64> =
        [("@fs_stage2_scratch".to_string(), mem.add(vec![0; 32 * 4])), ("@fs_stage2_lse".to_string(), mem.add(vec![0; 32 * 16]))].into();
    (Module::with_callees(&ir, &[STAGE2.kernel], &globals), mem)
}

/// What one launch leaves: tokens, scores, logits, status, logsumexp, logprobs.
type Outputs = (Vec<u32>, Vec<u32>, Vec<u32>, Vec<u32>, Vec<u32>, Vec<u32>);

fn run(finish: bool, seed: u64) -> Outputs {
    let p = PipelineBuilder::new("Finish", DType::BF16, DType::BF16).temperature_per_row("t").gumbel("seed", 1).build().unwrap();
    let (stage2, mut mem) = stage_two(&p);
    let (cands, row_lse) = inputs(seed);
    let n = ROWS * SAMPLES;
    let out = |mem: &mut Memory, words: usize| mem.add(vec![0xcd; words * 4]);
    let candidates = mem.add(bytes(&cands));
    let (tokens, scores, logits) = (out(&mut mem, n), out(&mut mem, n), out(&mut mem, n));
    let (out_lse, out_status, logprobs) = (mem.add(bytes(&row_lse)), out(&mut mem, ROWS), out(&mut mem, n));
    let args = Stage2Args {
        candidates,
        lse: 0,
        batch: ROWS as u32,
        samples: SAMPLES as u32,
        tiles: TILES as u32,
        out_tokens: tokens,
        out_scores: scores,
        out_logits: logits,
        out_lse,
        out_status,
        target_logprobs: 0,
        target_ranks: 0,
        raw_lse: 0,
        out_raw_lse: 0,
        finish: u32::from(finish),
        out_logprobs: if finish { logprobs } else { 0 },
    }
    .args();
    stage2.run_grid(STAGE2.kernel, &arg_words(&args), (ROWS as u32, 1, 1), STAGE2_THREADS as usize, &mut mem);
    if !finish {
        finalize(&FinalizeArgs { tokens, status: out_status, logits, lse: out_lse, logprobs, n: n as u32, samples: SAMPLES as u32 }, &mut mem);
    }
    (read(&mem, tokens), read(&mem, scores), read(&mem, logits), read(&mem, out_status), read(&mem, out_lse), read(&mem, logprobs))
}

#[test]
fn a_finishing_stage_two_equals_stage_two_then_the_finishing_kernel() {
    for seed in [17, 18] {
        let (finished, two_kernels) = (run(true, seed), run(false, seed));
        assert_eq!(finished, two_kernels, "seed {seed}: tokens, scores, logits, status, lse, logprobs");
        let (tokens, _, _, status, ..) = &finished;
        assert_eq!(status[2], flashsample_abi::RowStatus::AllMasked.code(), "row 2 has no candidate");
        assert_eq!(status[4], flashsample_abi::RowStatus::NonFinite.code(), "row 4 has a non-finite tile");
        assert!(tokens[2 * SAMPLES..3 * SAMPLES].iter().chain(&tokens[4 * SAMPLES..5 * SAMPLES]).all(|&t| t == INDEX_NONE));
        assert!(status.iter().filter(|&&s| s == 0).count() >= 3, "most rows are ok: {status:?}");
        for (i, &b) in finished.5.iter().enumerate() {
            let x = f32::from_bits(b);
            assert_eq!(x.is_nan(), status[i / SAMPLES] != 0, "logprob {i} = {x}: NaN exactly on failed rows");
        }
    }
}

/// Each row's logsumexp from its tiles' partials (logits spread over several windows, an
/// empty tile, a row whose every tile is empty), its target's logprob `x − lse` and, for a
/// failed row, NaN and rank 0: `abi::lse`'s bits (the u128 row sums included).
#[test]
fn stage_two_sums_the_partials_and_scores_the_targets_as_the_abi_does() {
    let p = PipelineBuilder::new("Lse", DType::BF16, DType::BF16).argmax().target_logprob_and_rank("targets").build().unwrap();
    let (stage2, mut mem) = stage_two(&p);
    let (cands, _) = inputs(29);
    let cands: Vec<Candidate> = cands.chunks(TILES).step_by(SAMPLES).flatten().copied().collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(31);
    // Row 3's tiles are all empty; row 5's span windows from -40 to 60.
    let partials: Vec<LsePartial> = (0..ROWS * TILES)
        .map(|i| {
            let (row, tile) = (i / TILES, i % TILES);
            let mut part = LsePartial::EMPTY;
            if row != 3 && tile != 4 {
                let spread = if row == 5 { 50.0 } else { 12.0 };
                for _ in 0..rng.random_range(1..40) {
                    part.add(rng.random_range(-spread..spread) + 10.0);
                }
            }
            part
        })
        .collect();
    let target_logits: Vec<f32> = (0..ROWS).map(|r| if r == 1 { f32::NEG_INFINITY } else { rng.random_range(-5.0..15.0) }).collect();
    let out = |mem: &mut Memory, words: usize| mem.add(vec![0xcd; words * 4]);
    let candidates = mem.add(bytes(&cands));
    let lse = mem.add(bytes(&partials));
    let (tokens, scores, logits) = (out(&mut mem, ROWS), out(&mut mem, ROWS), out(&mut mem, ROWS));
    let (out_lse, out_status) = (out(&mut mem, ROWS), out(&mut mem, ROWS));
    let targets = mem.add(bytes(&target_logits));
    let ranks = mem.add(bytes(&[7u32; ROWS]));
    let args = Stage2Args {
        candidates,
        lse,
        batch: ROWS as u32,
        samples: 1,
        tiles: TILES as u32,
        out_tokens: tokens,
        out_scores: scores,
        out_logits: logits,
        out_lse,
        out_status,
        target_logprobs: targets,
        target_ranks: ranks,
        ..Stage2Args::default()
    }
    .args();
    stage2.run_grid(STAGE2.kernel, &arg_words(&args), (ROWS as u32, 1, 1), STAGE2_THREADS as usize, &mut mem);
    let (got_lse, status): (Vec<f32>, Vec<u32>) = (read(&mem, out_lse), read(&mem, out_status));
    let (got_target, got_ranks): (Vec<f32>, Vec<u32>) = (read(&mem, targets), read(&mem, ranks));
    for row in 0..ROWS {
        let want = LseSum::of(&partials[row * TILES..][..TILES]).logsumexp();
        assert_eq!(got_lse[row].to_bits(), want.to_bits(), "row {row}: logsumexp {} vs abi {want}", got_lse[row]);
        let ok = status[row] == RowStatus::Ok.code();
        let want_lp = if ok { target_logits[row] - want } else { f32::NAN };
        assert_eq!(got_target[row].to_bits(), want_lp.to_bits(), "row {row}: target logprob");
        assert_eq!(got_ranks[row], if ok { 7 } else { 0 }, "row {row}: rank (stage two zeroes a failed row's)");
    }
    assert_eq!(got_lse[3], f32::NEG_INFINITY, "no token: -inf");
    assert!(status.iter().any(|&s| s != RowStatus::Ok.code()) && status.iter().filter(|&&s| s == RowStatus::Ok.code()).count() >= 3, "{status:?}");
}
