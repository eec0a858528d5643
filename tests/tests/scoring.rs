//! Scoring given tokens (`target_logprob`, DESIGN.md step 7b) on the CPU: each row's
//! target logprob against the float64 reference, with and without sampling, transforms and
//! masks; an excluded target is `-inf`; bad targets are typed errors; the `[rows, V]` logits
//! are never materialized (the kernel writes one f32 per row).

use flashsample::{CpuConfig, Device, Error, KernelConfig, ParamError, Sampler, SamplingParams};
use flashsample_ir::{DType, Outputs, Pipeline, PipelineBuilder};
use flashsample_tests::Case;

fn scorer() -> Pipeline {
    PipelineBuilder::new("Scorer", DType::BF16, DType::BF16)
        .logit_bias("logit_bias")
        .temperature_per_row("t")
        .mask("allowed")
        .softcap(25.0)
        .argmax()
        .target_logprob("targets")
        .outputs(Outputs { score: false, logsumexp: true, logprob: false, top_logprobs: 5 })
        .build()
        .unwrap()
}

fn sampling_scorer() -> Pipeline {
    PipelineBuilder::new("SampleAndScore", DType::BF16, DType::BF16)
        .penalties("pen")
        .temperature_per_row("t")
        .mask("allowed")
        .gumbel("seed", 2)
        .target_logprob("targets")
        .outputs(Outputs { score: true, logsumexp: false, logprob: true, top_logprobs: 0 })
        .build()
        .unwrap()
}

#[test]
fn target_logprobs_match_the_reference() {
    for p in [scorer(), sampling_scorer()] {
        let sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
        for (batch, vocab) in [(1, 1001), (37, 2999), (300, 4093)] {
            let mut case = Case::random(&p, batch, 64, vocab, 41, 5.0);
            // Score the rows' own argmax too (the engine's "is the draft the greedy token?").
            let argmax = Sampler::new(PipelineBuilder::new("A", DType::BF16, DType::BF16).argmax().build().unwrap(), &Device::cpu()).unwrap();
            let greedy = argmax.sample(case.hidden.tensor(), case.weights.tensor(), &SamplingParams::default()).unwrap();
            for r in (0..batch).step_by(3) {
                case.targets[r] = greedy.tokens[r];
            }
            let got = case.run(&sampler).unwrap();
            let t = got.target_logprobs.as_ref().expect("target logprobs");
            assert_eq!(t.len(), batch);
            case.check(&p, &got, &(0..batch).collect::<Vec<_>>()).unwrap_or_else(|e| panic!("{} B={batch} V={vocab}: {e}", p.name));
            assert!(t.iter().all(|&l| l <= 0.0 || l.is_nan()), "{t:?}");
        }
    }
}

#[test]
fn an_excluded_target_scores_minus_infinity_and_the_row_still_samples() {
    let p = scorer();
    let sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
    let mut case = Case::random(&p, 4, 32, 509, 5, 3.0);
    // Every row scores its own argmax (always allowed), except row 2, whose target is masked.
    case.targets = case.run(&sampler).unwrap().tokens;
    case.targets[2] = (case.targets[2] + 1) % 509;
    let words = 509usize.div_ceil(32);
    let target = case.targets[2];
    case.mask[2 * words + target as usize / 32] &= !(1 << (target % 32));
    let got = case.run(&sampler).unwrap();
    let t = got.target_logprobs.unwrap();
    assert_eq!(t[2], f32::NEG_INFINITY);
    assert!(t[0].is_finite() && t[1].is_finite() && t[3].is_finite(), "{t:?}");
    assert!(got.row_errors.iter().all(Option::is_none));
}

#[test]
fn bad_targets_are_typed_errors() {
    let p = scorer();
    let sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
    let mut case = Case::random(&p, 3, 16, 100, 9, 1.0);
    case.targets[1] = 100;
    match case.run(&sampler) {
        Err(Error::Param(ParamError::TargetOutOfRange { row: 1, token: 100, vocab: 100 })) => {}
        other => panic!("{other:?}"),
    }
    let params = SamplingParams { targets: None, ..case.params(&p) };
    match sampler.sample(case.hidden.tensor(), case.weights.tensor(), &params) {
        Err(Error::Param(ParamError::Missing("targets"))) => {}
        other => panic!("{other:?}"),
    }
}

/// A row whose top-p nucleus outgrows the lists is recomputed alone (the exact nucleus path):
/// its scored target comes along, so every row is sampled and scored as the reference says.
#[test]
fn scoring_survives_the_exact_nucleus_path() {
    use flashsample::RowFilter;
    let p = PipelineBuilder::new("ScoreFiltered", DType::BF16, DType::BF16)
        .logit_bias("logit_bias")
        .temperature_per_row("t")
        .mask("allowed")
        .filter("filter", 8)
        .gumbel("seed", 1)
        .target_logprob("targets")
        .outputs(Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 3 })
        .build()
        .unwrap();
    let sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
    let mut case = Case::random(&p, 4, 32, 7000, 13, 3.0);
    case.temperatures.fill(2.0);
    case.filters = vec![RowFilter::top_k(8), RowFilter::top_p(0.95), RowFilter::top_k(4), RowFilter::top_p(0.97)];
    assert!(case.kept_by_filter(&p, 1) > flashsample_ir::MAX_LIST_CAPACITY as usize);
    let got = case.run(&sampler).unwrap();
    case.check(&p, &got, &[0, 1, 2, 3]).unwrap();
    assert!(got.target_logprobs.unwrap().iter().all(|l| !l.is_nan()));
}

/// Prompt scoring of many rows runs in row ranges of bounded scratch (runtime `cpu.rs`
/// `chunk_rows`: here 64-token tiles put the chunk near 400 rows, so 1000 rows are three
/// launches); every row's outputs are the bits it gets in a launch of its own few rows.
#[test]
fn many_rows_score_in_chunks_with_the_bits_of_small_launches() {
    let p = scorer();
    let sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
    let (batch, vocab) = (1000, 151_936);
    let case = Case::random(&p, batch, 32, vocab, 13, 4.0);
    let small_tiles = |b| match sampler.config_for(b, 32, vocab) {
        KernelConfig::Cpu(c) => KernelConfig::Cpu(CpuConfig { vocab_tile: 64, ..c }),
        other => other,
    };
    let all = case.run_with(&sampler, &small_tiles(batch)).unwrap();
    for rows in [0..40, 390..430, 960..1000] {
        let rows: Vec<usize> = rows.collect();
        let part = case.rows(&rows);
        let alone = sampler.sample_with(part.hidden.tensor(), case.weights.tensor(), &part.params(&p), &small_tiles(rows.len())).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (i, &r) in rows.iter().enumerate() {
            assert_eq!(all.tokens[r], alone.tokens[i], "row {r}");
            assert_eq!(all.row_errors[r], alone.row_errors[i], "row {r}");
            assert_eq!(bits(&all.logsumexp.as_ref().unwrap()[r..=r]), bits(&alone.logsumexp.as_ref().unwrap()[i..=i]), "row {r} logsumexp");
            assert_eq!(bits(&all.target_logprobs.as_ref().unwrap()[r..=r]), bits(&alone.target_logprobs.as_ref().unwrap()[i..=i]), "row {r} target");
            assert_eq!(all.top_logprobs.as_ref().unwrap()[r], alone.top_logprobs.as_ref().unwrap()[i], "row {r} top logprobs");
        }
    }
    case.check(&p, &all, &[0, 401, 999]).unwrap();
}

/// The ranking scorer of DESIGN.md step 7c in `mode`: a logit bias, temperature, mask and
/// softcap, so ranks are counted on the transformed logits (or the raw ones).
fn ranking_scorer(mode: flashsample_ir::LogprobMode) -> Pipeline {
    PipelineBuilder::new("Ranker", DType::BF16, DType::BF16)
        .logit_bias("logit_bias")
        .penalties("pen")
        .temperature_per_row("t")
        .mask("allowed")
        .softcap(25.0)
        .argmax()
        .target_logprob_and_rank("targets")
        .outputs(Outputs { score: false, logsumexp: true, logprob: false, top_logprobs: 3 })
        .logprob_mode(mode)
        .build()
        .unwrap()
}

#[test]
fn target_ranks_match_the_reference_in_both_logprob_modes() {
    use flashsample_ir::LogprobMode;
    for mode in [LogprobMode::Processed, LogprobMode::Raw] {
        let p = ranking_scorer(mode);
        let sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
        // 300 rows run as several row chunks of the CPU backend.
        for (batch, vocab) in [(1, 1001), (37, 2999), (300, 4093)] {
            let mut case = Case::random(&p, batch, 64, vocab, 43, 5.0);
            // Each row's own greedy token (rank 1 unless tied) on every fourth row.
            let greedy = case.run(&sampler).unwrap().tokens;
            for r in (0..batch).step_by(4) {
                case.targets[r] = greedy[r];
            }
            let got = case.run(&sampler).unwrap();
            let ranks = got.target_ranks.as_ref().expect("target ranks");
            assert_eq!(ranks.len(), batch);
            case.check(&p, &got, &(0..batch).collect::<Vec<_>>()).unwrap_or_else(|e| panic!("{mode:?} B={batch} V={vocab}: {e}"));
            assert!(ranks.iter().all(|&k| (1..=vocab as u32).contains(&k)), "{ranks:?}");
            if mode == LogprobMode::Processed {
                for r in (0..batch).step_by(4) {
                    assert_eq!(ranks[r], 1, "{mode:?} B={batch}: row {r} scores its own argmax");
                }
            }
        }
    }
}

/// Ties share the larger rank, an excluded target ranks `V`, and the most likely token ranks 1.
#[test]
fn tied_tokens_share_the_larger_rank_and_an_excluded_target_ranks_last() {
    let p = PipelineBuilder::new("Ties", DType::F32, DType::F32).mask("allowed").argmax().target_logprob_and_rank("targets").build().unwrap();
    let sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
    let (dim, vocab) = (16, 2000);
    let mut case = Case::random(&p, 3, dim, vocab, 7, 1.0);
    // Tokens 100..110 share one weight row far above every other: ten tied logits on top.
    let mut w = case.weights.exact.clone();
    let top: Vec<f32> = case.hidden.exact[..dim].iter().map(|h| 4.0 * h.signum()).collect();
    for v in 100..110 {
        w[v * dim..][..dim].copy_from_slice(&top);
    }
    case.weights = flashsample_tests::MatrixData::from_f32(DType::F32, vocab, dim, &w);
    let words = vocab.div_ceil(32);
    case.mask = vec![u32::MAX; 3 * words];
    case.mask[2 * words + 1500 / 32] &= !(1 << (1500 % 32));
    case.targets = vec![105, 100, 1500];
    let got = case.run(&sampler).unwrap();
    let ranks = got.target_ranks.as_ref().unwrap();
    assert_eq!(ranks[0], 10, "row 0: one of ten tied top tokens");
    assert_eq!(ranks[2], vocab as u32, "row 2: its target is masked");
    assert_eq!(got.target_logprobs.as_ref().unwrap()[2], f32::NEG_INFINITY);
    case.check(&p, &got, &[0, 1, 2]).unwrap();
}
