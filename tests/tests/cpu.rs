//! The Cranelift CPU backend against the float64 reference: pathwise on random shapes,
//! chi-square against softmax, and every edge case and bad input.

use flashsample::{Device, Error, ParamError, PenaltyArg, RowError, RowFilter, RowStatusError, Sampler, SamplingParams, TemperatureArg, Tensor};
use flashsample_ir::{DType, Outputs, Pipeline, PipelineBuilder};
use flashsample_tests::{chi_square, chi_square_filter_cases, chi_square_filtered, chi_square_pipelines, Case, MatrixData};
use proptest::prelude::*;

const ALL_OUTPUTS: Outputs = Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 0 };
const SCORE: Outputs = Outputs { score: true, logsumexp: false, logprob: false, top_logprobs: 0 };

/// The pipelines the property tests draw from: every transform, sampler and dtype.
fn pipelines() -> Vec<Pipeline> {
    vec![
        PipelineBuilder::new("Plain", DType::BF16, DType::BF16).outputs(SCORE).build().unwrap(),
        PipelineBuilder::new("Qwen", DType::BF16, DType::BF16)
            .temperature_per_row("temperature")
            .bias("bias")
            .mask("allowed")
            .ban("banned")
            .softcap(30.0)
            .gumbel("seed", 3)
            .outputs(ALL_OUTPUTS)
            .build()
            .unwrap(),
        PipelineBuilder::new("Gemma", DType::F16, DType::F16)
            .softcap(3.0)
            .temperature_scalar("t")
            .outputs(ALL_OUTPUTS)
            .build()
            .unwrap(),
        PipelineBuilder::new("Greedy", DType::F32, DType::BF16).bias("bias").argmax().outputs(ALL_OUTPUTS).build().unwrap(),
        PipelineBuilder::new("Full32", DType::F32, DType::F32).temperature_const(0.8).mask("m").outputs(SCORE).build().unwrap(),
        serving(),
        request_bias(),
    ]
}

/// Per-request logit biases in vLLM's order (after the model's softcap, before penalties and
/// temperature), next to the global bias, with every output.
fn request_bias() -> Pipeline {
    PipelineBuilder::new("RequestBias", DType::BF16, DType::BF16)
        .softcap(30.0)
        .logit_bias("logit_bias")
        .bias("bias")
        .penalties("penalties")
        .temperature_per_row("temperature")
        .gumbel("seed", 2)
        .outputs(ALL_OUTPUTS)
        .build()
        .unwrap()
}

/// What a serving stack runs: penalties, per-row temperature, a grammar mask, per-row
/// top-k / top-p / min-p, two samples per row, logprobs and the top 5 logprobs.
fn serving() -> Pipeline {
    PipelineBuilder::new("Serving", DType::BF16, DType::BF16)
        .penalties("penalties")
        .temperature_per_row("temperature")
        .mask("allowed")
        .filter("filter", 8)
        .gumbel("seed", 2)
        .outputs(Outputs { top_logprobs: 5, ..ALL_OUTPUTS })
        .build()
        .unwrap()
}

fn cpu() -> Device {
    Device::cpu()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Same seed ⇒ same sample as the reference, row by row, for random shapes including
    /// V not a multiple of any tile, B in 1..70 and odd D.
    #[test]
    fn pathwise_against_reference(
        which in 0usize..7,
        batch in 1usize..70,
        dim in prop::sample::select(vec![1usize, 3, 7, 31, 64, 129, 200]),
        vocab in 1usize..1500,
        seed in any::<u64>(),
    ) {
        let pipeline = &pipelines()[which];
        let sampler = Sampler::new(pipeline.clone(), &cpu()).unwrap();
        let case = Case::random(pipeline, batch, dim, vocab, seed, 3.0);
        // Near-flat logits (D = 1) give top-p nuclei wider than the lists: served exactly too.
        let samples = case.run(&sampler).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let rows: Vec<usize> = (0..batch).collect();
        case.check(pipeline, &samples, &rows).map_err(TestCaseError::fail)?;
    }
}

#[test]
fn pathwise_at_qwen_scale() {
    // Full Qwen vocabulary at a reduced hidden size: the shape the main job runs.
    let pipeline = &pipelines()[1];
    let sampler = Sampler::new(pipeline.clone(), &cpu()).unwrap();
    let case = Case::random(pipeline, 4, 256, 151_936, 7, 4.0);
    let samples = case.run(&sampler).unwrap();
    case.check(pipeline, &samples, &[0, 1, 2, 3]).unwrap();
}

/// A softcap that saturates most logits (every one past `TANH_SATURATE · cap` is the same f32
/// value) and then a top-k / top-p / min-p: f32 ties go to the lower token, as in the reference.
#[test]
fn saturated_softcap_then_filter_matches_the_reference() {
    let mut mismatches = Vec::new();
    for cap in [0.5f32, 2.0] {
        for cap_first in [false, true] {
            let b = PipelineBuilder::new("CapFilter", DType::BF16, DType::BF16);
            let b = if cap_first { b.softcap(cap).temperature_per_row("t") } else { b.temperature_per_row("t").softcap(cap) };
            let p = b.filter("f", 8).outputs(SCORE).build().unwrap();
            let sampler = Sampler::new(p.clone(), &cpu()).unwrap();
            for seed in 0..25u64 {
                let case = Case::random(&p, 10, 16, 500, seed, 40.0);
                let samples = case.run(&sampler).unwrap();
                if let Err(e) = case.check(&p, &samples, &(0..10).collect::<Vec<_>>()) {
                    mismatches.push(format!("cap {cap} first {cap_first} seed {seed}: {e}"));
                }
            }
        }
    }
    assert!(mismatches.is_empty(), "{} of 100 launches disagree:\n{}", mismatches.len(), mismatches.join("\n"));
}

const SIGNIFICANCE: f64 = 1e-3;

/// Every row's top 32 among the first 40 tokens, one vocabulary tile: the launch's short lists
/// (`min(capacity, 16)` entries a tile) overflow, and the launch runs again with lists of the
/// capacity, exactly (without the rerun the rows come back `ListOverflow`).
#[test]
fn short_lists_overflow_and_rerun_exactly() {
    let (p, case) = Case::hot_tile_top_k();
    let got = case.run(&Sampler::new(p.clone(), &cpu()).unwrap()).unwrap();
    case.check_hot_tile_top_k(&p, &got).unwrap();
}

/// A mask leaving each row 20 side-by-side tokens, more than a tile list holds, on top-k 32:
/// the short merge is an overflow and the launch reruns exactly, never a top-k cut to the
/// list's 16.
#[test]
fn a_mask_of_clustered_tokens_overflows_the_lists_and_reruns_exactly() {
    let masked: Vec<usize> = (0..8).collect();
    let (p, case) = Case::clustered_mask_top_k(&masked);
    let got = case.run(&Sampler::new(p.clone(), &cpu()).unwrap()).unwrap();
    case.check_clustered_mask_top_k(&p, &got, &masked).unwrap();
}

/// Rows 2 and 5 of 8 masked so: rows 2..6 run again as a launch of their own, whose noise
/// streams and outputs must be those of the whole launch (pathwise the reference), and the
/// rows around them keep the first launch's. The second launch's overflow recurs, so the
/// third runs doubled lists (here the capacity) from the start.
#[test]
fn rows_overflowing_mid_batch_rerun_alone_exactly() {
    let masked = [2, 5];
    let (p, case) = Case::clustered_mask_top_k(&masked);
    let sampler = Sampler::new(p.clone(), &cpu()).unwrap();
    for (launch, reruns) in [4, 4, 0].into_iter().enumerate() {
        let got = case.run(&sampler).unwrap();
        case.check_clustered_mask_top_k(&p, &got, &masked).unwrap_or_else(|e| panic!("launch {launch}: {e}"));
        assert_eq!(got.list_reruns, reruns, "launch {launch}: rows 2..6, then none on the doubled lists (the capacity)");
    }
}

/// Rows 1 and 6 of 8 allowed only 40 side-by-side tokens (one CPU tile) under top-k 64: the
/// short lists (16) and the doubled ones (32) both fill and overflow, exact ones (64) do not.
/// Five launches of one sampler walk every `ListLength`: short and rerun, short and rerun
/// (recurring: doubled next), doubled and rerun (recurring: exact next), then exact twice;
/// every launch pathwise the reference and all the same tokens.
#[test]
fn recurring_overflows_lengthen_the_lists_step_by_step() {
    let p = PipelineBuilder::new("Wide", DType::BF16, DType::BF16).temperature_per_row("t").mask("allowed").filter("f", 64).gumbel("seed", 1).outputs(SCORE).build().unwrap();
    let (batch, vocab) = (8, 3000);
    let mut case = Case::random(&p, batch, 32, vocab, 21, 2.0).with_filter(RowFilter::top_k(64));
    case.allow_only(&[1, 6], 500..540);
    let sampler = Sampler::new(p.clone(), &cpu()).unwrap();
    let rows: Vec<usize> = (0..batch).collect();
    let first = case.run(&sampler).unwrap();
    let mut reruns = Vec::new();
    for launch in 0..5 {
        let got = if launch == 0 { first.clone() } else { case.run(&sampler).unwrap() };
        case.check(&p, &got, &rows).unwrap_or_else(|e| panic!("launch {launch}: {e}"));
        assert_eq!(got.tokens, first.tokens, "launch {launch}");
        assert!([1, 6].iter().all(|&r| (500..540).contains(&got.tokens[r])), "launch {launch}: {:?}", got.tokens);
        reruns.push(got.list_reruns);
    }
    assert_eq!(reruns, [6, 6, 6, 0, 0], "rows 1..7 rerun on short, short and doubled lists, then none on exact ones");
}

#[test]
fn chi_square_for_every_transform() {
    for pipeline in &chi_square_pipelines() {
        let sampler = Sampler::new(pipeline.clone(), &cpu()).unwrap();
        let mut case = Case::identical_rows(pipeline, 2000, 8, 12, 1.5);
        let counts = case.draw_counts(&sampler, 5).unwrap();
        let probs = case.probabilities(pipeline, 0);
        let (stat, p) = chi_square(&counts, &probs);
        assert!(p > SIGNIFICANCE, "{}: chi-square {stat:.1}, p = {p:.2e}\ncounts {counts:?}\nprobs {probs:?}", pipeline.name);
    }
}

#[test]
fn chi_square_for_every_filter_and_the_penalties() {
    for (pipeline, filter) in &chi_square_filter_cases() {
        let sampler = Sampler::new(pipeline.clone(), &cpu()).unwrap();
        chi_square_filtered(&sampler, *filter, 8).unwrap();
    }
}

#[test]
fn chi_square_rejects_the_wrong_top_k() {
    // Power check: top-4 samples must be rejected as samples of top-5.
    let (pipeline, _) = &chi_square_filter_cases()[0];
    let mut case = Case::identical_rows(pipeline, 2000, 8, 12, 1.5).with_filter(RowFilter::top_k(4));
    let counts = case.draw_counts(&Sampler::new(pipeline.clone(), &cpu()).unwrap(), 5).unwrap();
    let case = case.with_filter(RowFilter::top_k(5));
    let (stat, p) = chi_square(&counts, &case.probabilities(pipeline, 0));
    assert!(p < SIGNIFICANCE, "chi-square failed to reject top-5: {stat}, p = {p}");
}

#[test]
fn serving_pipeline_pathwise_at_qwen_scale() {
    let pipeline = serving();
    let sampler = Sampler::new(pipeline.clone(), &cpu()).unwrap();
    let case = Case::random(&pipeline, 10, 128, 151_936, 11, 4.0);
    let samples = case.run(&sampler).unwrap();
    case.check(&pipeline, &samples, &(0..10).collect::<Vec<_>>()).unwrap();
    assert!(samples.top_logprobs.as_ref().unwrap().iter().all(|t| t.len() == 5));
}

#[test]
fn logit_bias_pathwise_with_and_without_bias_rows() {
    // Rows with and without their own bias in one batch (every third row has none), -inf bans,
    // biases that move the argmax; the filter pipeline too (lists and stage three see the
    // biased logits).
    let filtered = PipelineBuilder::new("BiasFilter", DType::BF16, DType::BF16)
        .logit_bias("logit_bias")
        .temperature_per_row("temperature")
        .filter("filter", 8)
        .outputs(Outputs { top_logprobs: 3, ..ALL_OUTPUTS })
        .build()
        .unwrap();
    for pipeline in [request_bias(), filtered] {
        let sampler = Sampler::new(pipeline.clone(), &cpu()).unwrap();
        for (seed, vocab) in [(1u64, 3001usize), (2, 151_936)] {
            let case = Case::random(&pipeline, 9, 64, vocab, seed, 3.0);
            assert!(case.logit_bias.iter().any(Vec::is_empty) && case.logit_bias.iter().any(|r| !r.is_empty()));
            let samples = case.run(&sampler).unwrap();
            case.check(&pipeline, &samples, &(0..9).collect::<Vec<_>>()).unwrap();
        }
    }
}

#[test]
fn logit_bias_moves_the_argmax_and_neg_inf_bans() {
    let p = PipelineBuilder::new("GreedyBias", DType::F32, DType::F32)
        .logit_bias("logit_bias")
        .argmax()
        .outputs(ALL_OUTPUTS)
        .build()
        .unwrap();
    let sampler = Sampler::new(p.clone(), &cpu()).unwrap();
    let mut case = Case::random(&p, 4, 32, 1000, 9, 2.0);
    case.logit_bias = vec![Vec::new(); 4];
    let unbiased = case.run(&sampler).unwrap().tokens;
    // Row 0: the argmax is banned; row 1: a far token is pushed past it; row 2: both at once;
    // row 3: none.
    let far = |t: u32| (t + 500) % 1000;
    case.logit_bias = vec![
        vec![(unbiased[0], f32::NEG_INFINITY)],
        vec![(far(unbiased[1]), 100.0)],
        vec![(unbiased[2], f32::NEG_INFINITY), (far(unbiased[2]), 50.0)],
        vec![],
    ];
    let biased = case.run(&sampler).unwrap();
    assert_ne!(biased.tokens[0], unbiased[0]);
    assert_eq!(biased.tokens[1..4], [far(unbiased[1]), far(unbiased[2]), unbiased[3]]);
    case.check(&p, &biased, &[0, 1, 2, 3]).unwrap();
    // A row whose every token is banned fails alone.
    case.logit_bias[1] = (0..1000).map(|t| (t, f32::NEG_INFINITY)).collect();
    let s = case.run_rows(&sampler).unwrap();
    assert!(matches!(s.row_errors[1], Some(RowStatusError::Row(RowError::AllMasked { row: 1 }))), "{:?}", s.row_errors);
    assert!(s.row_errors.iter().enumerate().all(|(r, e)| r == 1 || e.is_none()));
    assert_eq!(s.tokens[2], far(unbiased[2]));
}

#[test]
fn bad_logit_biases_are_errors_naming_the_row_and_the_token() {
    let p = request_bias();
    let sampler = Sampler::new(p.clone(), &cpu()).unwrap();
    let case = Case::random(&p, 3, 16, 500, 4, 1.0);
    let params = case.params(&p);
    let run = |rows: &[Vec<(u32, f32)>]| {
        sampler.sample(case.hidden.tensor(), case.weights.tensor(), &SamplingParams { logit_bias: Some(rows), ..params }).unwrap_err()
    };
    let e = run(&[vec![], vec![(3, 1.0)], vec![(500, 1.0)]]);
    assert!(matches!(e, Error::Param(ParamError::LogitBiasOutOfRange { row: 2, token: 500, vocab: 500 })), "{e}");
    let e = run(&[vec![(7, f32::NAN)], vec![], vec![]]);
    assert!(matches!(e, Error::Param(ParamError::LogitBiasValue { row: 0, token: 7, .. })), "{e}");
    let e = run(&[vec![], vec![(9, f32::INFINITY)], vec![]]);
    assert!(matches!(e, Error::Param(ParamError::LogitBiasValue { row: 1, token: 9, value: f32::INFINITY })), "{e}");
    let e = run(&[vec![], vec![], vec![(4, 1.0), (2, -1.0), (4, f32::NEG_INFINITY)]]);
    assert!(matches!(e, Error::Param(ParamError::LogitBiasDuplicate { row: 2, token: 4 })), "{e}");
    assert!(e.to_string().contains("token 4") && e.to_string().contains("row 2"), "{e}");
    let e = run(&[vec![], vec![]]);
    assert!(matches!(e, Error::Param(ParamError::Length { what: "logit_bias", expected: 3, got: 2 })), "{e}");
    let e = sampler.sample(case.hidden.tensor(), case.weights.tensor(), &SamplingParams { logit_bias: None, ..params }).unwrap_err();
    assert!(matches!(e, Error::Param(ParamError::Missing("logit_bias"))), "{e}");
}

#[test]
fn bounded_filters_skip_the_logsumexp_without_changing_a_token() {
    // Top-k-bounded rows need no row logsumexp, so that launch runs a kernel without it; asking
    // for logprobs forces the other kernel. Tokens and scores must not notice.
    let build = |outputs| {
        PipelineBuilder::new("Bounded", DType::BF16, DType::BF16)
            .temperature_per_row("t")
            .filter("f", 16)
            .gumbel("seed", 2)
            .outputs(outputs)
            .build()
            .unwrap()
    };
    let lean = build(SCORE);
    let full = build(Outputs { logprob: true, ..SCORE });
    let case = Case::random(&lean, 12, 32, 3000, 8, 3.0).with_filter(RowFilter { top_k: 10, top_p: 0.8, min_p: 0.0 });
    let a = case.run(&Sampler::new(lean.clone(), &cpu()).unwrap()).unwrap();
    let b = case.run(&Sampler::new(full.clone(), &cpu()).unwrap()).unwrap();
    assert_eq!((&a.tokens, &a.scores), (&b.tokens, &b.scores));
    assert!(a.logprobs.is_none() && b.logprobs.is_some());
    case.check(&lean, &a, &(0..12).collect::<Vec<_>>()).unwrap();
    assert!(!case.params(&lean).needs_logsumexp(&lean, 12) && case.params(&full).needs_logsumexp(&full, 12));
}

#[test]
fn per_row_seeds_make_a_row_independent_of_its_position() {
    let p = plain();
    let sampler = Sampler::new(p.clone(), &cpu()).unwrap();
    let case = Case::random(&p, 6, 16, 3000, 5, 1.0);
    let seeds: Vec<u64> = (0..6).map(|r| 1000 + r).collect();
    let params = SamplingParams { row_seeds: Some(&seeds), ..case.params(&p) };
    let a = sampler.sample(case.hidden.tensor(), case.weights.tensor(), &params).unwrap();
    // Reverse the rows and their seeds: every request must get the same token back.
    let reversed: Vec<f32> = (0..6).rev().flat_map(|r| case.hidden.exact[r * 16..][..16].to_vec()).collect();
    let hidden = MatrixData::from_f32(DType::BF16, 6, 16, &reversed);
    let rseeds: Vec<u64> = seeds.iter().rev().cloned().collect();
    let params_r = SamplingParams { row_seeds: Some(&rseeds), ..params };
    let b = sampler.sample(hidden.tensor(), case.weights.tensor(), &params_r).unwrap();
    let back: Vec<u32> = b.tokens.iter().rev().cloned().collect();
    assert_eq!(a.tokens, back);
    // And the reference agrees pathwise.
    let problem = case.problem(&p, &params);
    let (refs, _) = problem.sample_all().unwrap();
    for (r, reference) in refs.iter().enumerate() {
        flashsample_reference::check_pathwise(reference, a.tokens[r], a.scores.as_ref().unwrap()[r]).unwrap();
    }
    // Without per-row seeds the rows draw other noise.
    assert_ne!(a.tokens, case.run(&sampler).unwrap().tokens);
}

#[test]
fn vocab_offset_shifts_the_noise_to_global_indices() {
    let p = plain();
    let sampler = Sampler::new(p.clone(), &cpu()).unwrap();
    let case = Case::random(&p, 16, 16, 2000, 6, 0.5);
    let params = SamplingParams { vocab_offset: 4096, ..case.params(&p) };
    let shifted = sampler.sample(case.hidden.tensor(), case.weights.tensor(), &params).unwrap();
    let problem = case.problem(&p, &params);
    let (refs, _) = problem.sample_all().unwrap();
    for (r, reference) in refs.iter().enumerate() {
        flashsample_reference::check_pathwise(reference, shifted.tokens[r], shifted.scores.as_ref().unwrap()[r]).unwrap();
    }
    assert_ne!(shifted.tokens, case.run(&sampler).unwrap().tokens);
    let odd = SamplingParams { vocab_offset: 6, ..params };
    assert!(matches!(sampler.sample(case.hidden.tensor(), case.weights.tensor(), &odd), Err(Error::Param(ParamError::VocabOffset { .. }))));
}

#[test]
fn filter_and_penalty_errors_name_the_row_and_the_problem() {
    let p = serving();
    let sampler = Sampler::new(p.clone(), &cpu()).unwrap();
    // A flat distribution over 5000 tokens: the 0.9-nucleus holds thousands, past max_k = 8,
    // and a nucleus of ~50 is past it too: both are served exactly.
    for top_p in [0.9, 0.01] {
        let case = Case::random(&p, 3, 16, 5000, 2, 1e-3).with_filter(RowFilter::top_p(top_p));
        case.check(&p, &case.run(&sampler).unwrap(), &[0, 1, 2]).unwrap();
    }
    // With a top-k the same rows are fine.
    let ok = Case::random(&p, 3, 16, 5000, 2, 1e-3).with_filter(RowFilter { top_k: 8, top_p: 0.9, min_p: 0.0 });
    ok.check(&p, &ok.run(&sampler).unwrap(), &[0, 1, 2]).unwrap();

    let base = Case::random(&p, 3, 16, 500, 3, 1.0);
    let params = base.params(&p);
    let run = |params: &SamplingParams<'_>| sampler.sample(base.hidden.tensor(), base.weights.tensor(), params).unwrap_err();
    let big_k = [RowFilter::OFF, RowFilter::top_k(9), RowFilter::OFF];
    let e = run(&SamplingParams { filter: Some(&big_k), ..params });
    assert!(matches!(&e, Error::Param(ParamError::Filter { row: 1, .. })) && e.to_string().contains("max_k = 8"), "{e}");
    let bad_p = [RowFilter::OFF, RowFilter::OFF, RowFilter::top_p(0.0)];
    assert!(matches!(run(&SamplingParams { filter: Some(&bad_p), ..params }), Error::Param(ParamError::Filter { row: 2, .. })));
    let short = [RowFilter::OFF];
    assert!(matches!(run(&SamplingParams { filter: Some(&short), ..params }), Error::Param(ParamError::Length { what: "filter", .. })));
    assert!(matches!(run(&SamplingParams { filter: None, ..params }), Error::Param(ParamError::Missing(_))));
    let zero_rep = [1.0, 0.0, 1.0];
    let pen = PenaltyArg { repetition: &zero_rep, ..params.penalties.unwrap() };
    let e = run(&SamplingParams { penalties: Some(pen), ..params });
    assert!(matches!(&e, Error::Param(ParamError::Penalty { row: 1, .. })) && e.to_string().contains("repetition"), "{e}");
    let far = vec![vec![], vec![(500, 1)], vec![]];
    let pen = PenaltyArg { history: &far, ..params.penalties.unwrap() };
    assert!(matches!(run(&SamplingParams { penalties: Some(pen), ..params }), Error::Param(ParamError::HistoryOutOfRange { row: 1, token: 500, .. })));
}

/// Top-p 0.95 at T = 2 and min-p nuclei of thousands of tokens (past max_k and past 1024, the
/// largest lists) are served exactly: pathwise equal to the reference, every sample of each row.
#[test]
fn nuclei_larger_than_the_lists_are_served_exactly() {
    let p = serving();
    let sampler = Sampler::new(p.clone(), &cpu()).unwrap();
    let mut case = Case::random(&p, 5, 32, 7000, 31, 3.0);
    case.temperatures.fill(2.0);
    case.filters = vec![
        RowFilter::top_p(0.95),
        RowFilter { min_p: 0.01, ..RowFilter::OFF },
        RowFilter { top_k: 0, top_p: 0.98, min_p: 0.002 },
        RowFilter::top_k(8),
        RowFilter::top_p(0.95),
    ];
    for row in [0, 1, 2, 4] {
        let kept = case.kept_by_filter(&p, row);
        assert!(kept > flashsample_ir::MAX_LIST_CAPACITY as usize, "row {row}: a nucleus of {kept} fits the lists");
    }
    let samples = case.run_rows(&sampler).unwrap();
    assert!(samples.is_complete(), "{:?}", samples.row_errors);
    case.check(&p, &samples, &[0, 1, 2, 3, 4]).unwrap();
}

#[test]
fn more_nuclei_than_the_capture_holds_are_served_exactly() {
    // Twelve rows whose nucleus outgrows the lists: the launch's capture holds the first
    // eight (served from their captured logits), the rest run stage one again with whole-tile
    // lists; a top-k row and an unfiltered row between them, an odd vocabulary (the capture's
    // last quad is partial) and a mask (excluded tokens are not in the cut).
    let p = serving();
    let sampler = Sampler::new(p.clone(), &cpu()).unwrap();
    let mut case = Case::random(&p, 14, 32, 6001, 37, 3.0);
    case.temperatures.fill(2.0);
    case.filters = (0..14)
        .map(|r| match r {
            3 => RowFilter::top_k(8),
            9 => RowFilter::OFF,
            _ if r % 2 == 0 => RowFilter::top_p(0.95),
            _ => RowFilter { min_p: 0.002, ..RowFilter::OFF },
        })
        .collect();
    let nuclei: Vec<usize> = (0..14).filter(|&r| r != 3 && r != 9).collect();
    for &row in &nuclei {
        let kept = case.kept_by_filter(&p, row);
        assert!(kept > flashsample_ir::MAX_LIST_CAPACITY as usize, "row {row}: a nucleus of {kept} fits the lists");
    }
    let samples = case.run_rows(&sampler).unwrap();
    assert!(samples.is_complete(), "{:?}", samples.row_errors);
    case.check(&p, &samples, &(0..14).collect::<Vec<_>>()).unwrap();
}

#[test]
fn chi_square_detects_a_wrong_distribution() {
    // Power check: samples at temperature 0.7 must be rejected as samples of temperature 1.
    let pipeline = PipelineBuilder::new("Temp", DType::BF16, DType::BF16).temperature_per_row("t").build().unwrap();
    let mut case = Case::identical_rows(&pipeline, 2000, 8, 12, 1.5);
    let counts = case.draw_counts(&Sampler::new(pipeline.clone(), &cpu()).unwrap(), 5).unwrap();
    case.temperatures.iter_mut().for_each(|t| *t = 1.0);
    let (stat, p) = chi_square(&counts, &case.probabilities(&pipeline, 0));
    assert!(p < SIGNIFICANCE, "chi-square failed to reject the wrong temperature: {stat}, p = {p}");
}

fn plain() -> Pipeline {
    PipelineBuilder::new("Plain", DType::BF16, DType::BF16).outputs(SCORE).build().unwrap()
}

#[test]
fn one_row_one_token_vocabulary() {
    let p = plain();
    let case = Case::random(&p, 1, 5, 1, 3, 1.0);
    let s = case.run(&Sampler::new(p.clone(), &cpu()).unwrap()).unwrap();
    assert_eq!(s.tokens, vec![0]);
}

#[test]
fn all_but_one_token_masked() {
    let p = PipelineBuilder::new("M", DType::BF16, DType::BF16).mask("m").build().unwrap();
    let mut case = Case::random(&p, 3, 16, 300, 5, 2.0);
    case.mask.iter_mut().for_each(|w| *w = 0);
    let words = 300usize.div_ceil(32);
    for (row, keep) in [(0usize, 299usize), (1, 0), (2, 137)] {
        case.mask[row * words + keep / 32] |= 1 << (keep % 32);
    }
    let s = case.run(&Sampler::new(p, &cpu()).unwrap()).unwrap();
    assert_eq!(s.tokens, vec![299, 0, 137]);
}

#[test]
fn fully_masked_row_is_an_error_naming_the_row() {
    let p = PipelineBuilder::new("M", DType::BF16, DType::BF16).mask("m").build().unwrap();
    let mut case = Case::random(&p, 4, 16, 100, 5, 2.0);
    let words = 100usize.div_ceil(32);
    case.mask[2 * words..3 * words].iter_mut().for_each(|w| *w = 0);
    match case.run(&Sampler::new(p, &cpu()).unwrap()) {
        Err(Error::Row(RowError::AllMasked { row: 2 })) => {}
        other => panic!("expected AllMasked for row 2, got {other:?}"),
    }
}

#[test]
fn nan_hidden_state_is_an_error_naming_the_row() {
    let p = plain();
    let mut case = Case::random(&p, 3, 16, 100, 5, 2.0);
    let mut h = case.hidden.exact.clone();
    h[16 + 3] = f32::NAN;
    case.hidden = MatrixData::from_f32(DType::BF16, 3, 16, &h);
    match case.run(&Sampler::new(p, &cpu()).unwrap()) {
        Err(Error::Row(RowError::NonFinite { row: 1 })) => {}
        other => panic!("expected NonFinite for row 1, got {other:?}"),
    }
}

/// Extreme but valid parameters give the reference's sample or a typed error, never NaN or a
/// wrong token: a tiny temperature is greedy, penalty counts add up without wrapping, a logit
/// that overflows f32 fails its row, and absurd penalties are parameter errors.
#[test]
fn extreme_values_are_errors_or_correct_samples() {
    let p = PipelineBuilder::new("Extreme", DType::F32, DType::F32)
        .penalties("pen")
        .temperature_per_row("t")
        .outputs(Outputs { score: true, logprob: true, ..Outputs::default() })
        .build()
        .unwrap();
    let sampler = Sampler::new(p.clone(), &cpu()).unwrap();
    // One logit per token (D = 1): token 39 is the argmax, token 7 next, 15 third.
    let vocab = 40;
    let weights: Vec<f32> = (0..vocab).map(|v| match v { 39 => 6.0, 7 => 5.0, 15 => 4.5, _ => (v as f32 * 0.7).sin() }).collect();
    let hidden = [1.0f32; 4];
    let (h, w) = (Tensor::host(&hidden, 4, 1).unwrap(), Tensor::host(&weights, vocab, 1).unwrap());
    let temps = [1e-38f32, 1e-45, 0.0, 2.0];
    let history = vec![vec![]; 4];
    let ones = [1.0f32; 4];
    let zeros = [0.0f32; 4];
    let pen = PenaltyArg { repetition: &ones, presence: &zeros, frequency: &zeros, history: &history };
    let params = SamplingParams { temperature: TemperatureArg::PerRow(&temps), penalties: Some(pen), seed: 9, ..Default::default() };
    let check = |params: &SamplingParams<'_>, samples: &flashsample::Samples| {
        let problem = flashsample_reference::Problem { pipeline: &p, hidden: &hidden, weights: &weights, batch: 4, dim: 1, vocab, params };
        let (refs, _) = problem.sample_all().unwrap();
        for (r, reference) in refs.iter().enumerate() {
            flashsample_reference::check_pathwise(reference, samples.tokens[r], samples.scores.as_ref().unwrap()[r])
                .unwrap_or_else(|e| panic!("row {r}: {e}"));
        }
    };
    let out = sampler.sample(h, w, &params).unwrap();
    assert_eq!(&out.tokens[..3], &[39, 39, 39], "tiny temperatures are greedy");
    assert!(out.logprobs.as_ref().unwrap().iter().all(|l| l.is_finite()), "{out:?}");
    check(&params, &out);

    // Counts of one token add up past u32::MAX: token 7 is penalized by 2^33, not dropped.
    let history = vec![vec![(39, 0)], vec![(39, 1)], vec![(7, u32::MAX), (7, 1), (39, 3)], vec![]];
    let freq = [0.0f32, 2.0, 2.0, 0.0];
    let pen = PenaltyArg { repetition: &ones, presence: &zeros, frequency: &freq, history: &history };
    let params = SamplingParams { penalties: Some(pen), ..params };
    let out = sampler.sample(h, w, &params).unwrap();
    assert_eq!(out.tokens[2], 15, "39 and 7 are penalized away: {out:?}");
    check(&params, &out);

    // A logit of 1e34 at T = 1e-5 overflows f32: that row fails, the others are sampled.
    let big: Vec<f32> = weights.iter().enumerate().map(|(v, &x)| if v == 3 { 1e34 } else { x }).collect();
    let temps = [1.0f32, 1e-5, 1.0, 1.0];
    let out = sampler
        .sample(h, Tensor::host(&big, vocab, 1).unwrap(), &SamplingParams { temperature: TemperatureArg::PerRow(&temps), ..params })
        .unwrap();
    assert_eq!(out.row_errors[1], Some(RowStatusError::Row(RowError::NonFinite { row: 1 })), "{out:?}");
    assert!([0, 2, 3].iter().all(|&r| out.row_errors[r].is_none() && out.tokens[r] == 3), "{out:?}");

    // Penalties that only push logits toward overflow are parameter errors naming the row.
    for (rep, frequency) in [(1e-45f32, 0.0f32), (1.0, -1e38)] {
        let reps = [1.0, 1.0, 1.0, rep];
        let freqs = [0.0, 0.0, 0.0, frequency];
        let pen = PenaltyArg { repetition: &reps, presence: &zeros, frequency: &freqs, history: &history };
        let e = sampler.sample(h, w, &SamplingParams { penalties: Some(pen), ..params }).unwrap_err();
        assert!(matches!(e, Error::Param(ParamError::Penalty { row: 3, .. })), "{e}");
    }
}

#[test]
fn temperature_zero_is_greedy() {
    let p = PipelineBuilder::new("T", DType::BF16, DType::BF16).temperature_per_row("t").outputs(SCORE).build().unwrap();
    let mut case = Case::random(&p, 9, 32, 777, 11, 2.0);
    case.temperatures.iter_mut().for_each(|t| *t = 0.0);
    let sampler = Sampler::new(p.clone(), &cpu()).unwrap();
    let a = case.run(&sampler).unwrap();
    case.seed ^= 0xdead_beef;
    let b = case.run(&sampler).unwrap();
    assert_eq!(a.tokens, b.tokens, "greedy rows must not depend on the seed");
    let params = case.params(&p);
    let problem = case.problem(&p, &params);
    for row in 0..9 {
        let logits = problem.row_logits(row).unwrap().logits;
        let (argmax, best) = logits.iter().enumerate().fold((0, f64::NEG_INFINITY), |a, (i, &x)| if x > a.1 { (i, x) } else { a });
        let second = logits.iter().enumerate().filter(|&(i, _)| i != argmax).map(|(_, &x)| x).fold(f64::NEG_INFINITY, f64::max);
        if best - second > 1e-3 {
            assert_eq!(a.tokens[row] as usize, argmax, "row {row}");
        }
    }
}

#[test]
fn same_seed_same_samples_different_seed_different_samples() {
    let p = plain();
    let sampler = Sampler::new(p.clone(), &cpu()).unwrap();
    let mut case = Case::random(&p, 32, 16, 5000, 1, 0.5);
    let a = case.run(&sampler).unwrap();
    assert_eq!(a, case.run(&sampler).unwrap());
    case.seed += 1;
    assert_ne!(a.tokens, case.run(&sampler).unwrap().tokens);
}

#[test]
fn thread_count_does_not_change_samples() {
    let p = pipelines()[1].clone();
    let case = Case::random(&p, 5, 40, 3000, 9, 2.0);
    let one = case.run(&Sampler::new(p.clone(), &Device::cpu_with_threads(1).unwrap()).unwrap()).unwrap();
    let two = case.run(&Sampler::new(p, &Device::cpu_with_threads(2).unwrap()).unwrap()).unwrap();
    assert_eq!(one, two);
}

/// Peaked rows (most tokens tens of nats below the top, as a trained LM's at T ≤ 1) over
/// many tiles: the noise skips' cross-tile row bound, which tiles publish as they finish in
/// whatever order the workers take them, skips most of the vocabulary's noise, and every
/// sample stays the reference's, on one worker and on two.
#[test]
fn cross_tile_noise_skips_keep_peaked_rows_pathwise() {
    for which in [0usize, 1, 2] {
        let p = pipelines()[which].clone();
        let case = Case::random(&p, 9, 48, 20_000, 5 + which as u64, 40.0);
        let rows: Vec<usize> = (0..9).collect();
        for threads in [1, 2] {
            let sampler = Sampler::new(p.clone(), &Device::cpu_with_threads(threads).unwrap()).unwrap();
            let samples = case.run(&sampler).unwrap();
            case.check(&p, &samples, &rows).unwrap_or_else(|e| panic!("{} on {threads} threads: {e}", p.name));
        }
    }
}

#[test]
fn bad_inputs_give_clear_errors() {
    let p = PipelineBuilder::new("T", DType::BF16, DType::BF16).temperature_per_row("t").bias("b").build().unwrap();
    let sampler = Sampler::new(p.clone(), &cpu()).unwrap();
    let case = Case::random(&p, 2, 8, 50, 1, 1.0);
    let params = case.params(&p);
    let empty: Vec<flashsample::bf16> = vec![];
    let err = |r: flashsample::Result<_>| r.unwrap_err().to_string();

    let e = err(sampler.sample(Tensor::host(&empty, 0, 8).unwrap(), case.weights.tensor(), &params));
    assert!(e.contains("empty batch"), "{e}");
    let other = MatrixData::random(&mut rand::SeedableRng::seed_from_u64(1), DType::BF16, 50, 9, 1.0);
    let e = err(sampler.sample(case.hidden.tensor(), other.tensor(), &params));
    assert!(e.contains("shape mismatch") && e.contains("8 != 9"), "{e}");
    let f32w = MatrixData::random(&mut rand::SeedableRng::seed_from_u64(1), DType::F32, 50, 8, 1.0);
    let e = err(sampler.sample(case.hidden.tensor(), f32w.tensor(), &params));
    assert!(e.contains("dtype mismatch") && e.contains("weights"), "{e}");
    let short_bias = [0.0f32; 3];
    let e = err(sampler.sample(case.hidden.tensor(), case.weights.tensor(), &SamplingParams { bias: Some(&short_bias), ..params }));
    assert!(e.contains("`bias` has 3 elements, expected 50"), "{e}");
    let neg = [-1.0f32, 1.0];
    let e = err(sampler.sample(case.hidden.tensor(), case.weights.tensor(), &SamplingParams { temperature: TemperatureArg::PerRow(&neg), ..params }));
    assert!(e.contains("temperature of row 0 is -1"), "{e}");
    let mut nan_bias = case.bias.clone();
    nan_bias[4] = f32::NAN;
    let e = err(sampler.sample(case.hidden.tensor(), case.weights.tensor(), &SamplingParams { bias: Some(&nan_bias), ..params }));
    assert!(e.contains("bias[4] is NaN"), "{e}");
    let e = err(sampler.sample(case.hidden.tensor(), case.weights.tensor(), &SamplingParams { bias: None, ..params }));
    assert!(e.contains("declares `bias`"), "{e}");
    assert!(Tensor::host(&empty, 2, 8).is_err(), "length/shape mismatch must be rejected");
}

mod declared_with_the_macro {
    use super::*;
    use flashsample::{bf16, flashsample, Matrix};

    flashsample! {
        /// A Qwen-style sampler declared the way users do.
        pub pipeline QwenSampler {
            hidden: bf16[B, D], weights: bf16[V, D];
            logits = matmul(hidden, weights);
            logits = logits / temperature[B];
            logits = logits + bias[V];
            logits = mask(logits, allowed[B, V]);
            logits = softcap(logits, 30.0);
            sample = gumbel_argmax(logits, seed, samples = 2);
            outputs(score, logsumexp);
        }
    }

    flashsample! {
        /// A chat-serving sampler: penalties, per-row temperature and filter, top logprobs.
        pub pipeline ChatSampler {
            hidden: bf16[B, D], weights: bf16[V, D];
            logits = matmul(hidden, weights);
            logits = penalties(logits, penalties[B]);
            logits = logits / temperature[B];
            logits = top_k_top_p(logits, filter[B], max_k = 8);
            sample = gumbel_argmax(logits, seed, samples = 1);
            outputs(score, logprob, top_logprobs = 3);
        }
    }

    #[test]
    fn macro_chat_sampler_with_penalties_filter_and_row_seeds() {
        let built = PipelineBuilder::new("ChatSampler", DType::BF16, DType::BF16)
            .penalties("penalties")
            .temperature_per_row("temperature")
            .filter("filter", 8)
            .outputs(Outputs { score: true, logprob: true, top_logprobs: 3, ..Outputs::default() })
            .build()
            .unwrap();
        assert_eq!(ChatSampler::pipeline(), built);
        let case = Case::random(&built, 10, 24, 999, 4, 3.0);
        let ours = ChatSampler::new(&cpu()).unwrap();
        let h: Vec<bf16> = case.hidden.exact.iter().map(|&x| bf16::from_f32(x)).collect();
        let w: Vec<bf16> = case.weights.exact.iter().map(|&x| bf16::from_f32(x)).collect();
        let (hm, wm) = (Matrix::new(&h, 10, 24).unwrap(), Matrix::new(&w, 999, 24).unwrap());
        let params = case.params(&built);
        let pen = params.penalties.unwrap();
        let samples = ours.sample(hm, wm, pen, &case.temperatures, &case.filters, case.seed).unwrap();
        assert_eq!(samples, case.run(&Sampler::new(built.clone(), &cpu()).unwrap()).unwrap());
        case.check(&built, &samples, &(0..10).collect::<Vec<_>>()).unwrap();
        let seeds: Vec<u64> = (0..10).map(|r| 77 + r).collect();
        let seeded = ours.sample_with_seeds(hm, wm, pen, &case.temperatures, &case.filters, &seeds).unwrap();
        let want = Sampler::new(built.clone(), &cpu())
            .unwrap()
            .sample(case.hidden.tensor(), case.weights.tensor(), &SamplingParams { row_seeds: Some(&seeds), ..params })
            .unwrap();
        assert_eq!(seeded, want);
    }

    #[test]
    fn macro_pipeline_samples_like_the_builder_pipeline() {
        let built = PipelineBuilder::new("QwenSampler", DType::BF16, DType::BF16)
            .temperature_per_row("temperature")
            .bias("bias")
            .mask("allowed")
            .softcap(30.0)
            .gumbel("seed", 2)
            .outputs(Outputs { score: true, logsumexp: true, logprob: false, top_logprobs: 0 })
            .build()
            .unwrap();
        assert_eq!(QwenSampler::pipeline(), built);
        let case = Case::random(&built, 6, 24, 999, 3, 2.0);
        let ours = QwenSampler::new(&cpu()).unwrap();
        let h: Vec<bf16> = case.hidden.exact.iter().map(|&x| bf16::from_f32(x)).collect();
        let w: Vec<bf16> = case.weights.exact.iter().map(|&x| bf16::from_f32(x)).collect();
        let samples = ours
            .sample(
                Matrix::new(&h, 6, 24).unwrap(),
                Matrix::new(&w, 999, 24).unwrap(),
                &case.temperatures,
                &case.bias,
                &case.mask,
                case.seed,
            )
            .unwrap();
        assert_eq!(samples, case.run(&Sampler::new(built.clone(), &cpu()).unwrap()).unwrap());
        case.check(&built, &samples, &[0, 1, 2, 3, 4, 5]).unwrap();
    }
}

mod sharded {
    use super::*;
    use flashsample::ShardedSampler;

    /// Splits `case`'s weights into shards of the given sizes.
    fn shards(case: &Case, sizes: &[usize]) -> Vec<MatrixData> {
        let mut start = 0;
        sizes
            .iter()
            .map(|&n| {
                let rows = &case.weights.exact[start * case.dim..(start + n) * case.dim];
                start += n;
                MatrixData::from_f32(case.weights.dtype, n, case.dim, rows)
            })
            .collect()
    }

    #[test]
    fn sharded_sampling_is_exact_in_distribution() {
        let p = PipelineBuilder::new("Shards", DType::BF16, DType::BF16)
            .temperature_per_row("t")
            .mask("m")
            .gumbel("seed", 2)
            .outputs(Outputs { score: false, logsumexp: true, logprob: true, top_logprobs: 0 })
            .build()
            .unwrap();
        let vocab = 40;
        for sizes in [vec![17, 23], vec![1, 9, 4, 13, 2, 3, 7, 1], vec![10, 10, 10, 10]] {
            let mut case = Case::identical_rows(&p, 1500, 8, vocab, 1.5);
            // Mask shard 0 entirely for every row (a fully masked shard), plus scattered tokens.
            let words = vocab.div_ceil(32);
            for row in 0..case.batch {
                for t in 0..sizes[0] {
                    case.mask[row * words + t / 32] &= !(1 << (t % 32));
                }
                case.mask[row * words + (vocab - 1) / 32] |= 1 << ((vocab - 1) % 32);
            }
            let sampler = ShardedSampler::new(p.clone(), &cpu()).unwrap();
            let parts = shards(&case, &sizes);
            let tensors: Vec<Tensor> = parts.iter().map(|m| m.tensor()).collect();
            let mut counts = vec![0u64; vocab];
            for seed in 0..4 {
                case.seed = 77 + seed;
                let s = sampler.sample(case.hidden.tensor(), &tensors, &case.params(&p)).unwrap();
                for &t in &s.tokens {
                    assert!((t as usize) >= sizes[0], "token {t} is in the fully masked shard");
                    counts[t as usize] += 1;
                }
                // The merged logsumexp is the unsharded one.
                let params = case.params(&p);
                let problem = case.problem(&p, &params);
                let want = flashsample_reference::logsumexp(&problem.row_logits(0).unwrap().logits);
                let lse = s.logsumexp.as_ref().unwrap();
                assert!((f64::from(lse[0]) - want).abs() < 1e-4, "{} vs {want}", lse[0]);
            }
            let params = case.params(&p);
            let problem = case.problem(&p, &params);
            let (stat, pv) = chi_square(&counts, &problem.probabilities(0).unwrap());
            assert!(pv > SIGNIFICANCE, "shards {sizes:?}: chi-square {stat:.1}, p = {pv:.2e}, counts {counts:?}");
        }
    }

    /// Each shard sees the per-request logit biases of its own tokens: a row whose biases leave
    /// one token of one shard samples it, a pushed token wins, and every row's merged
    /// logsumexp is the unsharded reference's.
    #[test]
    fn per_request_logit_bias_reaches_each_shard_by_global_token() {
        let p = PipelineBuilder::new("Shards", DType::BF16, DType::BF16)
            .logit_bias("logit_bias")
            .temperature_per_row("t")
            .outputs(Outputs { score: false, logsumexp: true, logprob: false, top_logprobs: 0 })
            .build()
            .unwrap();
        let vocab = 40;
        let mut case = Case::random(&p, 4, 8, vocab, 5, 1.5);
        case.logit_bias[0] = (0..40).filter(|&t| t != 30).map(|t| (t, f32::NEG_INFINITY)).collect();
        case.logit_bias[1] = vec![(20, 200.0)];
        let sampler = ShardedSampler::new(p.clone(), &cpu()).unwrap();
        let parts = shards(&case, &[13, 11, 16]);
        let tensors: Vec<Tensor> = parts.iter().map(|m| m.tensor()).collect();
        let params = case.params(&p);
        let s = sampler.sample(case.hidden.tensor(), &tensors, &params).unwrap();
        assert_eq!(s.tokens[..2], [30, 20]);
        let problem = case.problem(&p, &params);
        for row in 0..4 {
            let want = flashsample_reference::logsumexp(&problem.row_logits(row).unwrap().logits);
            let got = f64::from(s.logsumexp.as_ref().unwrap()[row]);
            assert!((got - want).abs() < 1e-4 * want.abs().max(1.0), "row {row}: {got} vs {want}");
        }
    }

    /// A row with its own seed draws its shard, like its tokens, from that seed alone: identical
    /// requests agree wherever they sit in the batch.
    #[test]
    fn per_row_seeds_pick_the_shard_too() {
        let p = PipelineBuilder::new("Shards", DType::BF16, DType::BF16).temperature_per_row("t").outputs(SCORE).build().unwrap();
        let case = Case::identical_rows(&p, 64, 8, 40, 1.5);
        let parts = shards(&case, &[13, 11, 16]);
        let tensors: Vec<Tensor> = parts.iter().map(|m| m.tensor()).collect();
        let sampler = ShardedSampler::new(p.clone(), &cpu()).unwrap();
        let run = |seeds: &[u64]| {
            let params = SamplingParams { row_seeds: Some(seeds), ..case.params(&p) };
            sampler.sample(case.hidden.tensor(), &tensors, &params).unwrap().tokens
        };
        for seed in 0..10u64 {
            let same = vec![seed; 64];
            let tokens = run(&same);
            assert!(tokens.iter().all(|&t| t == tokens[0]), "seed {seed}: identical requests disagree: {tokens:?}");
        }
        // And a row's sample does not depend on the other rows' seeds.
        let seeds: Vec<u64> = (0..64).collect();
        let mut shifted = seeds.clone();
        shifted.rotate_left(5);
        let (a, b) = (run(&seeds), run(&shifted));
        for r in 0..64 {
            assert_eq!(a[(r + 5) % 64], b[r], "row seed {}", (r + 5) % 64);
        }
    }

    #[test]
    fn every_shard_masked_is_an_error() {
        let p = PipelineBuilder::new("Shards", DType::BF16, DType::BF16).mask("m").build().unwrap();
        let mut case = Case::random(&p, 2, 8, 64, 1, 1.0);
        case.mask[2..4].iter_mut().for_each(|w| *w = 0);
        let parts = shards(&case, &[30, 34]);
        let tensors: Vec<Tensor> = parts.iter().map(|m| m.tensor()).collect();
        let err = ShardedSampler::new(p.clone(), &cpu()).unwrap().sample(case.hidden.tensor(), &tensors, &case.params(&p));
        assert!(matches!(err, Err(Error::Row(RowError::AllMasked { row: 1 }))), "{err:?}");
    }
}
