//! Every CPU engine against the scalar model of DESIGN.md: a matrix engine's tiles feed the same
//! JIT'd epilogue as the fused Cranelift kernel, so the checks of `stage_one.rs` run here once
//! per engine on bf16 × bf16 pipelines (the dtypes every engine supports). An engine this host
//! lacks must refuse to compile with `MissingHostFeature`, never run.

mod common;

use common::*;
use flashsample_abi::{StageTwo, INDEX_NONFINITE};
use flashsample_codegen_cpu::{CpuCodegenError, CpuConfig, CpuEngine, CpuKernel, NoiseSkip};
use flashsample_ir::{DType, Outputs, Pipeline, PipelineBuilder};
use rand::Rng;

fn pipelines() -> Vec<Pipeline> {
    let lse = Outputs { score: true, logsumexp: true, logprob: false, top_logprobs: 0 };
    let top = Outputs { top_logprobs: 3, ..Outputs::default() };
    let new = |name| PipelineBuilder::new(name, DType::BF16, DType::BF16);
    vec![
        new("Plain").gumbel("seed", 1).build().unwrap(),
        new("Full").temperature_per_row("t").bias("b").mask("m").softcap(3.0).gumbel("seed", 3).outputs(lse).build().unwrap(),
        new("Serving")
            .penalties("pen")
            .temperature_per_row("t")
            .mask("m")
            .filter("f", 5)
            .gumbel("seed", 2)
            .outputs(top)
            .build()
            .unwrap(),
        new("Greedy").mask("m").softcap(2.5).argmax().outputs(lse).build().unwrap(),
    ]
}

/// The engines this host can run; asserts that the others refuse to compile.
fn runnable_engines() -> Vec<CpuEngine> {
    let p = &pipelines()[0];
    CpuEngine::ALL
        .into_iter()
        .filter(|&engine| match engine.missing_host_feature() {
            None => true,
            Some(feature) => {
                let cfg = CpuConfig { vocab_tile: 8, row_block: 1, threads: 1, engine, noise_skip: NoiseSkip::default() };
                match CpuKernel::compile(p, &cfg) {
                    Err(CpuCodegenError::MissingHostFeature(f)) => assert_eq!(f, feature),
                    other => panic!("{engine} without {feature}: {other:?}"),
                }
                eprintln!("engine {engine}: this host lacks {feature}; checked that it refuses to compile");
                false
            }
        })
        .collect()
}

/// Hidden states that are bf16 values, as the runtime passes them for a bf16 pipeline.
fn bf16_inputs(p: &Pipeline, rng: &mut rand::rngs::StdRng, batch: usize, dim: usize, vocab: usize) -> Inputs {
    let mut inp = random_inputs(p, rng, batch, dim, vocab);
    inp.hidden = inp.hidden.iter().map(|&h| half::bf16::from_f32(h).to_f32()).collect();
    inp
}

/// (batch, dim, vocab, vocab_tile, threads): rows around the microkernel's 4-row block, dims
/// around its 32-element step, vocabularies that end inside a quad, and hidden states past
/// the engine's 512 KiB row chunk (70 rows × 4100: chunks of 60 and 10 rows).
const SHAPES: [(usize, usize, usize, u32, usize); 10] = [
    (70, 4100, 50, 16, 2),
    (1, 1, 5, 4, 1),
    (3, 7, 37, 12, 2),
    (13, 33, 133, 64, 2),
    (5, 130, 67, 8, 3),
    (8, 32, 301, 100, 2),
    (2, 16, 4, 4, 1),
    (4, 0, 9, 4, 2),
    (7, 64, 50, 16, 1),
    (12, 95, 203, 32, 2),
];

#[test]
fn every_engine_matches_the_model_for_every_shape_and_pipeline() {
    let mut rng = rng(11);
    for engine in runnable_engines() {
        for p in pipelines() {
            for &(batch, dim, vocab, tile, threads) in &SHAPES {
                let kernel = compile_on(&p, engine, tile, 4, threads);
                let inp = bf16_inputs(&p, &mut rng, batch, dim, vocab);
                check(&kernel, &p, &inp, false);
            }
        }
    }
}

/// Small integers make every product and sum exact in any order: every engine must then match
/// the model bit for bit, epilogue included.
#[test]
fn every_engine_is_bit_exact_when_the_matmul_is_exact() {
    let mut rng = rng(12);
    for engine in runnable_engines() {
        for p in pipelines() {
            for &(batch, dim, vocab, tile) in &[(3usize, 1usize, 203usize, 8u32), (7, 45, 97, 12), (13, 64, 40, 4)] {
                let kernel = compile_on(&p, engine, tile, 2, 2);
                let mut inp = bf16_inputs(&p, &mut rng, batch, dim, vocab);
                inp.hidden = (0..batch * dim).map(|_| rng.random_range(-3i32..=3) as f32).collect();
                inp.weights = (0..vocab * dim).flat_map(|_| encode(DType::BF16, rng.random_range(-4i32..=4) as f32)).collect();
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

/// An engine's dot product order depends on neither the tile, the thread count nor the batch
/// position, so reduced results are bit-identical across configs.
#[test]
fn engine_results_do_not_depend_on_the_config() {
    let p = &pipelines()[1];
    let mut rng = rng(13);
    // Both token orders of the engine's tiles (`tiles::TokenOrder`: streams up to 8 rows).
    for batch in [9, 1] {
        let inp = bf16_inputs(p, &mut rng, batch, 77, 533);
        for engine in runnable_engines() {
            let mut results = Vec::new();
            for (tile, threads) in [(4, 1), (64, 2), (512, 3), (536, 2), (20, 4)] {
                let kernel = compile_on(p, engine, tile, 3, threads);
                let (cands, lse) = run(&kernel, p, &inp);
                let layout = StageTwo { batch, samples: 3, tiles: kernel.tiles(533) };
                let r = layout.reduce(&cands, lse.as_deref()).unwrap();
                results.push((r.tokens, r.scores.iter().map(|s| s.to_bits()).collect::<Vec<_>>()));
            }
            for r in &results[1..] {
                assert_eq!(r, &results[0], "{engine}, B = {batch}");
            }
        }
    }
}

#[test]
fn every_engine_flags_a_nan_hidden_row_only() {
    let p = &pipelines()[1];
    for engine in runnable_engines() {
        let kernel = compile_on(p, engine, 8, 3, 2);
        let mut rng = rng(14);
        let (batch, dim, vocab) = (8, 40, 45);
        let mut inp = bf16_inputs(p, &mut rng, batch, dim, vocab);
        inp.hidden[dim + 17] = f32::NAN;
        check(&kernel, p, &inp, false);
        let (cands, _) = run(&kernel, p, &inp);
        let layout = StageTwo { batch, samples: 3, tiles: kernel.tiles(vocab) };
        for r in 0..batch {
            for t in 0..layout.tiles {
                assert_eq!(cands[layout.slot(r, 0, t)].index == INDEX_NONFINITE, r == 1, "{engine} row {r} tile {t}");
            }
        }
    }
}

/// Allows exactly one token per 4-token tile, at `offset`, so each tile's candidate logit is
/// that one token's raw logit.
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

/// DESIGN.md's f32 contract of the AVX-512-BF16 tiles, in scalar code: 16 lanes, each adding
/// the odd then the even product of its pair per 32-element step (exact products, each sum
/// rounded to nearest-even and flushed to zero when subnormal; subnormal inputs read as zero),
/// then the lanes summed as (i, i + 8), (i, i + 4), then ((0 + 1) + (2 + 3)).
fn avx512bf16_contract(h: &[f32], w: &[f32]) -> f32 {
    let daz = |x: f32| if x.is_subnormal() { 0.0f32.copysign(x) } else { x };
    let ftz = |x: f32| if x.is_subnormal() { 0.0f32.copysign(x) } else { x };
    let dim = h.len();
    let term = |d: usize| if d < dim { f64::from(daz(h[d])) * f64::from(daz(w[d])) } else { 0.0 };
    let mut lanes = [0.0f32; 16];
    for k in 0..dim.div_ceil(32) {
        for (i, lane) in lanes.iter_mut().enumerate() {
            let odd = ftz((f64::from(*lane) + term(32 * k + 2 * i + 1)) as f32);
            *lane = ftz((f64::from(odd) + term(32 * k + 2 * i)) as f32);
        }
    }
    let y: Vec<f32> = (0..8).map(|i| lanes[i] + lanes[i + 8]).collect();
    let x: Vec<f32> = (0..4).map(|i| y[i] + y[i + 4]).collect();
    (x[0] + x[1]) + (x[2] + x[3])
}

/// The error bound of DESIGN.md's AMX contract: Intel does not document the tile unit's internal
/// rounding, and it is no sequential order (measured: a lone pair is `rnd(c + rnd(p0 + p1))`;
/// with more pairs no order of f32 roundings matches every bit), so the contract is a bound:
/// each 32-element step's result is within `17·u·(|c| + Σ|p|)` of exact (`u = 2^-24`; the
/// worst seen was 8.3), and the `dim % 32` tail adds plain f32 rounding. Returns the bound on
/// `|logit − Σ h·w|` for one (row, token).
fn amx_bound(h: &[f32], w: &[f32]) -> f64 {
    let u = 2f64.powi(-24);
    let full = h.len() / 32 * 32;
    let (mut bound, mut abs) = (0.0f64, 0.0f64);
    for step in h[..full].chunks(32).zip(w[..full].chunks(32)) {
        let step_abs: f64 = step.0.iter().zip(step.1).map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs()).sum();
        abs += step_abs;
        bound += 17.0 * u * abs;
    }
    let tail_abs: f64 = h[full..].iter().zip(&w[full..]).map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs()).sum();
    bound + (h.len() - full + 1) as f64 * u * (abs + tail_abs)
}

/// Each (row, tile)'s one eligible token, so each candidate's logit is a raw dot product:
/// calls `check(batch, dim, row, token, logit)` for every one.
fn raw_logits(engine: CpuEngine, shapes: &[(usize, usize, usize, u32)], mut check: impl FnMut(&[f32], &[f32], String, f32)) {
    let p = PipelineBuilder::new("Contract", DType::BF16, DType::BF16).mask("m").argmax().build().unwrap();
    let mut rng = rng(15);
    for &(batch, dim, vocab, tile) in shapes {
        let kernel = compile_on(&p, engine, tile, 1, 2);
        // Values spread over many binades so the accumulation order shows in the low bits.
        let spread = |rng: &mut rand::rngs::StdRng| {
            let x: f32 = rng.random_range(-1.0f32..1.0) * 2f32.powi(rng.random_range(-12..12));
            half::bf16::from_f32(x).to_f32()
        };
        let hidden: Vec<f32> = (0..batch * dim).map(|_| spread(&mut rng)).collect();
        let weights: Vec<f32> = (0..vocab * dim).map(|_| spread(&mut rng)).collect();
        let tiles = kernel.tiles(vocab);
        let words = vocab.div_ceil(32);
        for offset in [0, 1, 2, 3, tile as usize - 1] {
            // Token `tile·t + offset` of each tile (where the tile has it).
            let token = |t: usize| Some(t * tile as usize + offset).filter(|&v| v < vocab && v / tile as usize == t);
            let mut allowed = vec![0u32; batch * words];
            for r in 0..batch {
                for v in (0..tiles).filter_map(token) {
                    allowed[r * words + v / 32] |= 1 << (v % 32);
                }
            }
            let inp = Inputs {
                batch,
                dim,
                vocab,
                dtype: DType::BF16,
                hidden: hidden.clone(),
                weights: weights.iter().flat_map(|&x| encode(DType::BF16, x)).collect(),
                temperatures: vec![1.0; batch],
                bias: None,
                allowed: Some(allowed),
                seed: 0,
                row_seeds: None,
                row_steps: None,
                vocab_offset: 0,
                row_offset: 0,
                penalties: None, logit_bias: None, filters: None,
            };
            let (cands, _) = run(&kernel, &p, &inp);
            for r in 0..batch {
                for t in 0..tiles {
                    let got = cands[r * tiles + t];
                    let Some(v) = token(t) else {
                        assert!(got.index > vocab as u32, "{engine} tile {t} has no eligible token: {got:?}");
                        continue;
                    };
                    assert_eq!(got.index, v as u32, "{engine} B={batch} D={dim} V={vocab} tile {tile} row {r}");
                    let at = format!("{engine} B={batch} D={dim} V={vocab} tile {tile} row {r} token {v}");
                    check(&hidden[r * dim..][..dim], &weights[v * dim..][..dim], at, got.logit);
                }
            }
        }
    }
}

#[test]
fn avx512bf16_logits_are_the_documented_f32_contract_bit_for_bit() {
    if !runnable_engines().contains(&CpuEngine::Avx512Bf16) {
        return;
    }
    let shapes = [(7, 95, 64, 4), (13, 256, 40, 4), (3, 4096, 12, 4), (1, 31, 8, 4), (1, 100, 16, 4), (5, 70, 20, 4)];
    raw_logits(CpuEngine::Avx512Bf16, &shapes, |h, w, at, got| {
        let want = avx512bf16_contract(h, w);
        assert_eq!(got.to_bits(), want.to_bits(), "{at}: {got:e} vs {want:e}");
    });
}

/// Every block shape (1 × 1 up to 16 rows; above, 1 × 4 in row chunks of a multiple of four
/// groups, 2 × 2 in the others, with a zero row group), tiles that
/// end inside a block, a vocabulary that ends inside one (the copied last block), `dim % 32`
/// tails and a row chunk (70 rows × 4100), within the contract's bound of exact. A token read
/// from the wrong row or a pair from the wrong element is off by far more.
#[test]
fn amx_logits_are_within_the_documented_bound() {
    if !runnable_engines().contains(&CpuEngine::AmxBf16) {
        return;
    }
    let shapes = [
        (7, 96, 64, 4),
        (13, 256, 200, 128),
        (3, 4096, 12, 4),
        (1, 31, 8, 4),
        (1, 100, 150, 64),
        (16, 64, 333, 68),
        (17, 96, 130, 64),
        (40, 70, 97, 32),
        (70, 4100, 40, 20),
        // 1 × 4 blocks: one pass of four row groups (above), two passes of a chunk of eight
        // (streamed, then cached), and a chunk of eight followed by one of two (2 × 2).
        (100, 64, 70, 32),
        (130, 2048, 40, 16),
    ];
    let (mut checked, mut inexact) = (0, 0);
    raw_logits(CpuEngine::AmxBf16, &shapes, |h, w, at, got| {
        let exact: f64 = h.iter().zip(w).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
        let bound = amx_bound(h, w);
        assert!((f64::from(got) - exact).abs() <= bound, "{at}: {got:e}, exact {exact:e}, bound {bound:e}");
        checked += 1;
        inexact += usize::from(f64::from(got) != exact);
    });
    // The spread values make most sums inexact: the bound was tested, not skipped.
    assert!(checked > 1000 && inexact > checked / 2, "{checked} checked, {inexact} inexact");
}

/// `vdpbf16ps` reads subnormal bf16 inputs as zero (DESIGN.md): a weight row holding one
/// subnormal against a hidden row of ones gives logit 0 on this engine, while the Cranelift
/// engine widens it exactly.
#[test]
fn avx512bf16_reads_subnormal_bf16_as_zero() {
    if !runnable_engines().contains(&CpuEngine::Avx512Bf16) {
        return;
    }
    let p = PipelineBuilder::new("Daz", DType::BF16, DType::BF16).mask("m").argmax().build().unwrap();
    let (dim, vocab) = (33usize, 128usize);
    let mut weights = vec![0u8; vocab * dim * 2];
    for v in 0..vocab {
        let bits = (1 + v as u16) | if v % 2 == 1 { 0x8000 } else { 0 };
        let at = (v * dim + v % dim) * 2;
        weights[at..at + 2].copy_from_slice(&bits.to_le_bytes());
    }
    for (engine, zero) in [(CpuEngine::Avx512Bf16, true), (CpuEngine::Cranelift, false)] {
        let kernel = compile_on(&p, engine, 4, 1, 1);
        let inp = Inputs {
            batch: 1,
            dim,
            vocab,
            dtype: DType::BF16,
            hidden: vec![1.0; dim],
            weights: weights.clone(),
            temperatures: vec![1.0],
            bias: None,
            allowed: Some(one_per_tile(1, vocab, 0)),
            seed: 0,
            row_seeds: None,
            row_steps: None,
            vocab_offset: 0,
            row_offset: 0,
            penalties: None, logit_bias: None, filters: None,
        };
        let (cands, _) = run(&kernel, &p, &inp);
        for (t, c) in cands.iter().enumerate() {
            let exact = half::bf16::from_bits(1 + 4 * t as u16).to_f32();
            assert!(exact.is_subnormal());
            let want = if zero { 0.0 } else { exact };
            assert_eq!(c.logit, want, "{engine} token {}", 4 * t);
        }
    }
}

#[test]
fn avx512bf16_refuses_what_it_cannot_compute_exactly() {
    let cfg = CpuConfig { vocab_tile: 8, row_block: 1, threads: 1, engine: CpuEngine::Avx512Bf16, noise_skip: NoiseSkip::default() };
    if CpuEngine::Avx512Bf16.missing_host_feature().is_some() {
        return; // runnable_engines() checks the refusal on such hosts
    }
    for (hidden, weights) in [(DType::F32, DType::BF16), (DType::BF16, DType::F16), (DType::F32, DType::F32)] {
        let p = PipelineBuilder::new("P", hidden, weights).build().unwrap();
        match CpuKernel::compile(&p, &cfg) {
            Err(CpuCodegenError::EngineDtype { engine: CpuEngine::Avx512Bf16, .. }) => {}
            other => panic!("{hidden:?} x {weights:?}: {other:?}"),
        }
    }
    // A bf16 pipeline launched with hidden values that are not bf16: a typed error naming the row.
    let p = &pipelines()[0];
    let kernel = compile_on(p, CpuEngine::Avx512Bf16, 8, 1, 1);
    let mut inp = bf16_inputs(p, &mut rng(16), 3, 5, 20);
    inp.hidden[2 * 5 + 1] = 1.0 + f32::EPSILON;
    let mut cands = vec![flashsample_abi::Candidate { score: 0.0, index: 0, logit: 0.0 }; 3 * kernel.tiles(20)];
    let err = kernel
        .launch(flashsample_codegen_cpu::CpuLaunch { targets: None, ranks: None, vocab_tiles: None, residual: None, raw: None, capture: None,
            hidden: &inp.hidden,
            weights: &inp.weights,
            batch: 3,
            dim: 5,
            vocab: 20,
            temperatures: &inp.temperatures,
            filters: None,
            bias: None,
            allowed: None,
            seed: 1,
            row_seeds: None,
            row_steps: None,
            vocab_offset: 0,
            row_offset: 0,
            penalties: None, logit_bias: None,
            lists: None,
            candidates: &mut cands,
            lse: None,
        })
        .unwrap_err();
    assert!(matches!(err, CpuCodegenError::HiddenNotBf16 { row: 2, .. }), "{err:?}");
}
