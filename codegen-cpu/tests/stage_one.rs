//! The JIT'd kernel against the scalar model of DESIGN.md (tests/common).

mod common;

use common::*;
use flashsample_codegen_cpu::{CpuEngine, NoiseSkip};
use flashsample_abi::rng::{gumbel_f32, noise_bits};
use flashsample_abi::filter::merge_row;
use flashsample_abi::{Scored, StageTwo, INDEX_NONE, INDEX_NONFINITE};
use flashsample_ir::{DType, Outputs, Pipeline, PipelineBuilder};
use rand::Rng;

const DTYPES: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

fn pipelines(dtype: DType) -> Vec<Pipeline> {
    let lse = Outputs { score: true, logsumexp: true, logprob: false, top_logprobs: 0 };
    let logprob = Outputs { score: false, logsumexp: false, logprob: true, top_logprobs: 0 };
    let top = Outputs { top_logprobs: 3, ..Outputs::default() };
    let new = |name| PipelineBuilder::new(name, DType::F32, dtype);
    vec![
        new("Plain").gumbel("seed", 1).build().unwrap(),
        new("Full")
            .temperature_per_row("t")
            .bias("b")
            .mask("m")
            .softcap(3.0)
            .gumbel("seed", 3)
            .outputs(lse)
            .build()
            .unwrap(),
        new("Greedy").mask("m").softcap(2.5).argmax().outputs(logprob).build().unwrap(),
        new("CapFirst").softcap(1.5).temperature_per_row("t").bias("b").ban("ban").gumbel("seed", 2).build().unwrap(),
        new("Serving")
            .logit_bias("lb")
            .penalties("pen")
            .temperature_per_row("t")
            .mask("m")
            .filter("f", 5)
            .gumbel("seed", 2)
            .outputs(top)
            .build()
            .unwrap(),
        new("RequestBias").softcap(4.0).logit_bias("lb").bias("b").temperature_per_row("t").gumbel("seed", 2).outputs(lse).build().unwrap(),
        new("TopLogprobs").bias("b").argmax().outputs(Outputs { top_logprobs: 7, ..Outputs::default() }).build().unwrap(),
    ]
}

/// (batch, dim, vocab, vocab_tile, row_block, threads)
const SHAPES: [(usize, usize, usize, u32, u32, usize); 8] = [
    (1, 1, 5, 4, 1, 1),
    (3, 7, 37, 12, 2, 2),
    (9, 33, 133, 64, 4, 2),
    (5, 130, 67, 8, 3, 3),
    (8, 8, 301, 100, 8, 2),
    (2, 16, 4, 4, 2, 1),
    (4, 0, 9, 4, 3, 2),
    (6, 15, 50, 16, 4, 1),
];

#[test]
fn matches_the_model_for_every_dtype_shape_and_pipeline() {
    let mut rng = rng(1);
    for dtype in DTYPES {
        for p in pipelines(dtype) {
            for &(batch, dim, vocab, tile, rb, threads) in &SHAPES {
                let kernel = compile(&p, tile, rb, threads);
                let inp = random_inputs(&p, &mut rng, batch, dim, vocab);
                check(&kernel, &p, &inp, false);
            }
        }
    }
}

#[test]
fn every_batch_size_up_to_nine_with_each_row_block() {
    let mut rng = rng(2);
    let p = &pipelines(DType::BF16)[1];
    for rb in 1..=4 {
        let kernel = compile(p, 12, rb, 2);
        for batch in 1..=9 {
            let inp = random_inputs(p, &mut rng, batch, 33, 61);
            check(&kernel, p, &inp, false);
        }
    }
}

/// Small integers make every product and sum exact in any order, so the kernel must match the
/// model bit for bit: its Philox, Gumbel, softcap and temperature code is `abi`'s, op for op.
#[test]
fn scores_are_bit_exact_when_the_matmul_is_exact() {
    let mut rng = rng(3);
    for dtype in DTYPES {
        for p in pipelines(dtype) {
            for &(batch, dim, vocab, tile, rb) in &[(3usize, 1usize, 203usize, 8u32, 2u32), (7, 9, 97, 12, 4), (2, 24, 40, 4, 1)] {
                let kernel = compile(&p, tile, rb, 2);
                let mut inp = random_inputs(&p, &mut rng, batch, dim, vocab);
                inp.hidden = (0..batch * dim).map(|_| rng.random_range(-3i32..=3) as f32).collect();
                inp.weights = (0..vocab * dim).flat_map(|_| encode(dtype, rng.random_range(-4i32..=4) as f32)).collect();
                if p.temperature().is_some() {
                    inp.temperatures = (0..batch).map(|_| [0.0, 0.5, 1.0, 2.0][rng.random_range(0..4)]).collect();
                }
                if let Some(bias) = &mut inp.bias {
                    for b in bias.iter_mut().filter(|b| b.is_finite()) {
                        *b = (*b * 4.0).round() / 4.0;
                    }
                }
                check(&kernel, &p, &inp, true);
            }
        }
    }
}

/// Allows exactly one token per 4-token tile, at `offset`.
fn one_per_tile(batch: usize, vocab: usize, offset: usize) -> Vec<u32> {
    let words = vocab.div_ceil(32);
    let mut bits = vec![0u32; batch * words];
    for r in 0..batch {
        for v in (offset..vocab).step_by(4) {
            bits[r * words + v / 32] |= 1 << (v % 32);
        }
    }
    bits
}

#[test]
fn every_tokens_noise_is_gumbel_f32_of_its_philox_bits() {
    let p = PipelineBuilder::new("Noise", DType::F32, DType::BF16).mask("m").gumbel("seed", 2).build().unwrap();
    let kernel = compile(&p, 4, 2, 2);
    let (batch, vocab) = (3, 4096);
    for offset in 0..4 {
        let mut rng = rng(4 + offset as u64);
        let mut inp = random_inputs(&p, &mut rng, batch, 1, vocab);
        inp.hidden = vec![0.0; batch];
        inp.seed = 0x0123_4567_89ab_cdef ^ offset as u64;
        inp.allowed = Some(one_per_tile(batch, vocab, offset));
        let (cands, _) = run(&kernel, &p, &inp);
        let layout = StageTwo { batch, samples: 2, tiles: kernel.tiles(vocab) };
        for r in 0..batch {
            for s in 0..2 {
                for t in 0..layout.tiles {
                    let v = 4 * t + offset;
                    let c = cands[layout.slot(r, s, t)];
                    // random_inputs may give per-row seeds, steps and a vocabulary offset: all must reach the noise.
                    let (key, ctr_row) = inp.stream(r);
                    let want = gumbel_f32(noise_bits(key, ctr_row, s as u32, v as u32 + inp.vocab_offset, inp.step(r)));
                    assert_eq!((c.index, c.score.to_bits(), c.logit), (v as u32, want.to_bits(), 0.0), "row {r} sample {s} token {v}");
                }
            }
        }
    }
}

/// Every 16-bit pattern as a weight, each alone in its row (at column v % 9, so both the SIMD
/// chunk lanes and the scalar tail see patterns), times a hidden row of ones: the logit is the
/// widened weight exactly, including f16 subnormals; ±inf and NaN flag their tile.
#[test]
fn every_16_bit_pattern_widens_exactly() {
    for dtype in [DType::BF16, DType::F16] {
        let p = PipelineBuilder::new("Widen", DType::F32, dtype).mask("m").argmax().build().unwrap();
        let kernel = compile(&p, 4, 1, 2);
        let (dim, vocab) = (9usize, 1usize << 16);
        let mut weights = vec![0u8; vocab * dim * 2];
        for v in 0..vocab {
            let at = (v * dim + v % dim) * 2;
            weights[at..at + 2].copy_from_slice(&(v as u16).to_le_bytes());
        }
        let widen = |bits: u16| match dtype {
            DType::BF16 => half::bf16::from_bits(bits).to_f32(),
            _ => half::f16::from_bits(bits).to_f32(),
        };
        for offset in 0..4 {
            let inp = Inputs {
                batch: 1,
                dim,
                vocab,
                dtype,
                hidden: vec![1.0; dim],
                weights: weights.clone(),
                temperatures: vec![1.0],
                bias: None,
                allowed: Some(one_per_tile(1, vocab, offset)),
                seed: 0,
                row_seeds: None,
                row_steps: None,
                vocab_offset: 0,
                row_offset: 0,
                penalties: None, logit_bias: None, filters: None,
            };
            let (cands, _) = run(&kernel, &p, &inp);
            for (t, c) in cands.iter().enumerate() {
                let tile_nonfinite = (4 * t..4 * t + 4).any(|v| !widen(v as u16).is_finite());
                let v = 4 * t + offset;
                let want = widen(v as u16);
                if tile_nonfinite {
                    assert_eq!(c.index, INDEX_NONFINITE, "{dtype:?} tile {t}");
                } else {
                    assert_eq!(c.index, v as u32, "{dtype:?} pattern {v:#06x}");
                    // -0 sums to +0 with the zero columns; every other value keeps its bits.
                    assert!(c.logit.to_bits() == want.to_bits() || (want == 0.0 && c.logit == 0.0),
                        "{dtype:?} pattern {v:#06x}: got {:e}, want {want:e}", c.logit);
                    assert_eq!(c.score.to_bits(), c.logit.to_bits());
                }
            }
        }
    }
}

#[test]
fn f16_subnormals_and_infinities_in_the_matmul() {
    let p = PipelineBuilder::new("Sub", DType::F32, DType::F16).argmax().outputs(Outputs { score: true, logsumexp: true, logprob: false, top_logprobs: 0 }).build().unwrap();
    let kernel = compile(&p, 8, 2, 1);
    let mut rng = rng(5);
    let (batch, dim, vocab) = (3, 19, 40);
    let mut inp = random_inputs(&p, &mut rng, batch, dim, vocab);
    // Mostly subnormal f16 weights (|w| < 2^-14), scaled-up hidden so they decide the argmax.
    inp.weights = (0..vocab * dim)
        .flat_map(|_| {
            let bits: u16 = rng.random_range(1..0x400) | if rng.random_bool(0.5) { 0x8000 } else { 0 };
            bits.to_le_bytes()
        })
        .collect();
    inp.hidden = inp.hidden.iter().map(|h| h * 65536.0).collect();
    check(&kernel, &p, &inp, false);
    // One +inf weight: its tile is non-finite for every row; the others are untouched.
    let at = (13 * dim + 5) * 2;
    inp.weights[at..at + 2].copy_from_slice(&0x7c00u16.to_le_bytes());
    check(&kernel, &p, &inp, false);
    let (cands, _) = run(&kernel, &p, &inp);
    let tiles = kernel.tiles(vocab);
    for r in 0..batch {
        for t in 0..tiles {
            assert_eq!(cands[r * tiles + t].index == INDEX_NONFINITE, t == 1, "row {r} tile {t}");
        }
    }
}

#[test]
fn nan_hidden_flags_every_tile_of_its_row_only() {
    for dtype in DTYPES {
        let p = &pipelines(dtype)[1];
        let kernel = compile(p, 8, 3, 2);
        let mut rng = rng(6);
        let (batch, dim, vocab) = (4, 21, 45);
        let mut inp = random_inputs(p, &mut rng, batch, dim, vocab);
        inp.hidden[dim + 17] = f32::NAN;
        check(&kernel, p, &inp, false);
        let (cands, _) = run(&kernel, p, &inp);
        let layout = StageTwo { batch, samples: 3, tiles: kernel.tiles(vocab) };
        for r in 0..batch {
            for s in 0..3 {
                for t in 0..layout.tiles {
                    let idx = cands[layout.slot(r, s, t)].index;
                    assert_eq!(idx == INDEX_NONFINITE, r == 1, "{dtype:?} row {r} sample {s} tile {t}: {idx}");
                }
            }
        }
        assert!(matches!(layout.reduce(&cands, None), Err(flashsample_abi::RowError::NonFinite { row: 1 })));
    }
}

#[test]
fn fully_excluded_tiles_write_index_none() {
    // Bias after softcap, so a -inf bias stays -inf (softcap would map it to -cap).
    let p = &PipelineBuilder::new("Excluded", DType::F32, DType::F32)
        .temperature_per_row("t")
        .softcap(3.0)
        .bias("b")
        .mask("m")
        .gumbel("seed", 3)
        .outputs(Outputs { score: true, logsumexp: true, logprob: false, top_logprobs: 0 })
        .build()
        .unwrap();
    let kernel = compile(p, 8, 2, 2);
    let mut rng = rng(7);
    let (batch, dim, vocab) = (3, 10, 37);
    let mut inp = random_inputs(p, &mut rng, batch, dim, vocab);
    let words = vocab.div_ceil(32);
    let allowed = inp.allowed.as_mut().unwrap();
    // Row 0: tile 1 (tokens 8..16) masked. All rows: tile 3 (24..32) banned by -inf bias.
    allowed[0] &= !0x0000_ff00;
    for r in 0..batch {
        allowed[r * words] |= 0x00ff_0000;
    }
    let bias = inp.bias.as_mut().unwrap();
    for b in &mut bias[24..32] {
        *b = f32::NEG_INFINITY;
    }
    // Row 2: nothing allowed at all.
    for w in &mut allowed[2 * words..3 * words] {
        *w = 0;
    }
    check(&kernel, p, &inp, false);
    let (cands, lse) = run(&kernel, p, &inp);
    let lse = lse.unwrap();
    let layout = StageTwo { batch, samples: 3, tiles: kernel.tiles(vocab) };
    for s in 0..3 {
        assert_eq!(cands[layout.slot(0, s, 1)].index, INDEX_NONE);
        for r in 0..batch {
            assert_eq!(cands[layout.slot(r, s, 3)].index, INDEX_NONE);
        }
        for t in 0..layout.tiles {
            assert_eq!(cands[layout.slot(2, s, t)].index, INDEX_NONE);
        }
    }
    assert_eq!(lse[layout.tiles + 3], flashsample_abi::LsePartial::EMPTY);
    assert!(matches!(layout.reduce(&cands, Some(&lse)), Err(flashsample_abi::RowError::AllMasked { row: 2 })));
}

#[test]
fn temperature_zero_rows_are_greedy_in_every_sample() {
    let p = &pipelines(DType::BF16)[1];
    let kernel = compile(p, 16, 2, 2);
    let mut rng = rng(8);
    let (batch, dim, vocab) = (4, 12, 70);
    let mut inp = random_inputs(p, &mut rng, batch, dim, vocab);
    inp.temperatures = vec![0.0, 1.0, 0.0, 0.7];
    check(&kernel, p, &inp, false);
    let (cands, lse) = run(&kernel, p, &inp);
    let layout = StageTwo { batch, samples: 3, tiles: kernel.tiles(vocab) };
    let result = layout.reduce(&cands, lse.as_deref()).unwrap();
    for r in [0, 2] {
        let best = (0..vocab)
            .filter(|&v| is_allowed(&inp, r, v))
            .map(|v| (v, transformed(p, &inp, r, v, raw_logit(&inp, r, v))))
            .fold((usize::MAX, f32::NEG_INFINITY), |a, b| if b.1 > a.1 { b } else { a });
        for s in 0..3 {
            let i = r * 3 + s;
            assert_eq!(result.scores[i], result.logits[i], "row {r}: greedy score is the logit");
            assert!((result.logits[i] - best.1).abs() <= 1e-4, "row {r}: {} vs {}", result.logits[i], best.1);
        }
        assert_eq!(result.tokens[r * 3], result.tokens[r * 3 + 1]);
        assert_eq!(result.tokens[r * 3], result.tokens[r * 3 + 2]);
    }
}

/// The dot products' order depends on neither tiling, row blocking nor threads, so the
/// reduced results are bit-identical across configs.
#[test]
fn results_do_not_depend_on_the_config() {
    let p = &pipelines(DType::F16)[1];
    let mut rng = rng(9);
    let inp = random_inputs(p, &mut rng, 7, 45, 533);
    let mut results = Vec::new();
    for (tile, rb, threads) in [(4, 1, 1), (64, 3, 2), (512, 4, 3), (536, 8, 2), (20, 2, 4)] {
        let kernel = compile(p, tile, rb, threads);
        let (cands, lse) = run(&kernel, p, &inp);
        let layout = StageTwo { batch: 7, samples: 3, tiles: kernel.tiles(533) };
        let r = layout.reduce(&cands, lse.as_deref()).unwrap();
        results.push((r.tokens, r.scores.iter().map(|s| s.to_bits()).collect::<Vec<_>>()));
    }
    for r in &results[1..] {
        assert_eq!(r, &results[0]);
    }
}

/// Wide logit ranges make most quads unable to beat their tile's running winner even with the
/// largest possible noise; the kernel skips their noise, which must not change any candidate.
#[test]
fn skipping_hopeless_quads_changes_nothing() {
    let mut rng = rng(10);
    for dtype in DTYPES {
        let p = &pipelines(dtype)[1];
        let kernel = compile(p, 64, 3, 2);
        let mut inp = random_inputs(p, &mut rng, 5, 24, 700);
        for h in &mut inp.hidden {
            *h *= 12.0;
        }
        check(&kernel, p, &inp, false);
    }
}

/// Flat logits: no quad is hopeless by its logits alone, but once a long tile's winner holds
/// the largest of many noises, most quads' uniforms show that they cannot beat it (the bucket
/// bound of `gumbel_f32`); skipping their Gumbel transform must not change any candidate.
#[test]
fn skipping_quads_by_their_uniforms_changes_nothing() {
    let mut rng = rng(12);
    for dtype in [DType::F32, DType::BF16] {
        for p in &pipelines(dtype)[..2] {
            let kernel = compile(p, 2048, 3, 2);
            let mut inp = random_inputs(p, &mut rng, 3, 16, 5000);
            for h in &mut inp.hidden {
                *h *= 0.01;
            }
            check(&kernel, p, &inp, false);
        }
    }
}

/// The cross-tile bounds ([`NoiseSkip::CrossTile`], the default): tiles publish their best
/// scores and their lists' logits as they finish, in whatever order the workers take them, and
/// later tiles skip noise strictly below a row's best score and list insertions below its
/// list bound. Row winners, their scores and logits, the logsumexp partials and each row's
/// merged top list (what stage three reads) are the in-tile kernel's bit for bit, on flat,
/// random and peaked logits and one to four workers; a tile's own candidate may differ only
/// where it could not win: then it scores strictly below the row's winner, or is none.
#[test]
fn cross_tile_bounds_change_no_row_winner_or_merged_list() {
    let mut rng = rng(13);
    let vocab = 3000;
    for dtype in [DType::BF16, DType::F32] {
        let all = pipelines(dtype);
        for p in [&all[0], &all[1], &all[4], &all[6]] {
            for scale in [0.01f32, 1.0, 12.0] {
                let mut inp = random_inputs(p, &mut rng, 6, 24, vocab);
                for h in &mut inp.hidden {
                    *h *= scale;
                }
                for (tile, rb, threads) in [(64, 3, 2), (256, 2, 1), (64, 1, 4)] {
                    let in_tile = compile_with_skip(p, CpuEngine::Cranelift, tile, rb, threads, NoiseSkip::InTile);
                    let cross = compile_with_skip(p, CpuEngine::Cranelift, tile, rb, threads, NoiseSkip::CrossTile);
                    let ctx = format!("{p} {dtype:?} logits ×{scale} tile {tile} threads {threads}");
                    let (want, want_lse, want_lists) = run_with_lists(&in_tile, p, &inp);
                    let (got, got_lse, got_lists) = run_with_lists(&cross, p, &inp);
                    let samples = p.samples_per_row() as usize;
                    let layout = StageTwo { batch: 6, samples, tiles: in_tile.tiles(vocab) };
                    let (w, w_status) = layout.reduce_rows(&want, want_lse.as_deref());
                    let (g, g_status) = layout.reduce_rows(&got, got_lse.as_deref());
                    assert_eq!(g_status, w_status, "{ctx}");
                    assert_eq!(g.tokens, w.tokens, "{ctx}");
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!((bits(&g.scores), bits(&g.logits)), (bits(&w.scores), bits(&w.logits)), "{ctx}");
                    assert_eq!(got_lse, want_lse, "{ctx}");
                    for r in 0..6 {
                        for s in 0..samples {
                            let winner = w.scores[r * samples + s];
                            for t in 0..layout.tiles {
                                let (a, b) = (want[layout.slot(r, s, t)], got[layout.slot(r, s, t)]);
                                if a != b {
                                    assert!(a.index != INDEX_NONFINITE && (b.index == INDEX_NONE || b.score < winner) && a.score < winner,
                                        "{ctx} row {r} sample {s} tile {t}: in-tile {a:?}, cross-tile {b:?}, winner {winner}");
                                }
                            }
                        }
                    }
                    if let (Some(want_lists), Some(got_lists)) = (&want_lists, &got_lists) {
                        let per_tile = p.list_capacity() as usize;
                        let row_len = layout.tiles * per_tile;
                        for r in 0..6 {
                            let merge = |lists: &[Scored]| merge_row(&lists[r * row_len..][..row_len], per_tile, per_tile, r);
                            assert_eq!(merge(got_lists), merge(want_lists), "{ctx} row {r}: merged lists");
                        }
                    }
                }
            }
        }
    }
}
