//! What a decode loop needs from the CPU backend: noise that advances with each row's step
//! (pathwise equal to the float64 reference at every (seed, step)), and per-row outcomes (one
//! bad request never sinks its batch).

use flashsample::{Device, RowError, RowFilter, RowStatusError, Sampler, SamplingParams};
use flashsample_abi::INDEX_NONE;
use flashsample_ir::{DType, Outputs, Pipeline, PipelineBuilder};
use flashsample_tests::{Case, MatrixData};

const ALL_OUTPUTS: Outputs = Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 0 };

fn plain() -> Pipeline {
    PipelineBuilder::new("Stepped", DType::BF16, DType::BF16)
        .temperature_per_row("t")
        .mask("allowed")
        .gumbel("seed", 2)
        .outputs(ALL_OUTPUTS)
        .build()
        .unwrap()
}

/// Penalties, a mask, per-row top-k / top-p / min-p and top logprobs: the filter's draw
/// (stage three) also reads the step.
fn serving() -> Pipeline {
    PipelineBuilder::new("SteppedServing", DType::BF16, DType::BF16)
        .penalties("penalties")
        .temperature_per_row("t")
        .mask("allowed")
        .filter("filter", 8)
        .gumbel("seed", 2)
        .outputs(Outputs { top_logprobs: 3, ..ALL_OUTPUTS })
        .build()
        .unwrap()
}

fn sample(sampler: &Sampler, case: &Case, params: &SamplingParams<'_>) -> flashsample::Samples {
    sampler.sample(case.hidden.tensor(), case.weights.tensor(), params).unwrap()
}

#[test]
fn every_step_is_pathwise_equal_to_the_reference() {
    for p in [plain(), serving()] {
        let sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
        let case = Case::random(&p, 9, 64, 1500, 11, 3.0);
        let rows: Vec<usize> = (0..case.batch).collect();
        for step in [0u32, 1, 2, 1000, (1 << 30) - 1] {
            // Rows at different steps in one launch, as requests of different ages are.
            let steps: Vec<u32> = (0..case.batch as u32).map(|r| step.wrapping_add(r % 3)).collect();
            let params = SamplingParams { row_steps: Some(&steps), ..case.params(&p) };
            let got = sample(&sampler, &case, &params);
            case.check_with(&p, &params, &got, &rows).unwrap_or_else(|e| panic!("{} step {step}: {e}", p.name));
        }
    }
}

#[test]
fn steps_draw_fresh_noise_and_step_zero_is_the_stepless_launch() {
    let p = plain();
    let sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
    // Flat logits, so every sample is decided by the noise.
    let case = Case::random(&p, 16, 32, 4000, 5, 1e-3);
    let base = case.params(&p);
    let none = sample(&sampler, &case, &base);
    let zeros = vec![0u32; case.batch];
    let zero = sample(&sampler, &case, &SamplingParams { row_steps: Some(&zeros), ..base });
    assert_eq!(none.tokens, zero.tokens, "step 0 must reproduce a launch without steps");
    let mut seen = std::collections::HashSet::new();
    for step in 0..8u32 {
        let steps = vec![step; case.batch];
        let got = sample(&sampler, &case, &SamplingParams { row_steps: Some(&steps), ..base });
        assert!(seen.insert(got.tokens.clone()), "step {step} repeated an earlier step's samples");
        // The same step gives the same samples: a replayed step is reproducible.
        assert_eq!(got.tokens, sample(&sampler, &case, &SamplingParams { row_steps: Some(&steps), ..base }).tokens);
    }
}

#[test]
fn a_row_with_its_own_seed_and_step_is_independent_of_its_position() {
    let p = plain();
    let sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
    let case = Case::identical_rows(&p, 6, 32, 900, 2.0);
    let seeds: Vec<u64> = (0..6).map(|r| 77 + r).collect();
    let steps: Vec<u32> = (0..6).map(|r| 40 + r).collect();
    let params = SamplingParams { row_seeds: Some(&seeds), row_steps: Some(&steps), ..case.params(&p) };
    let got = sample(&sampler, &case, &params);
    let (rseeds, rsteps): (Vec<u64>, Vec<u32>) = (seeds.iter().rev().copied().collect(), steps.iter().rev().copied().collect());
    let rev = sample(&sampler, &case, &SamplingParams { row_seeds: Some(&rseeds), row_steps: Some(&rsteps), ..params });
    for r in 0..6 {
        assert_eq!(got.row_outcome(r).unwrap(), rev.row_outcome(5 - r).unwrap(), "row {r}");
    }
}

#[test]
fn row_steps_of_the_wrong_length_are_a_parameter_error() {
    let p = plain();
    let sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
    let case = Case::random(&p, 4, 16, 100, 1, 1.0);
    let steps = [1u32; 3];
    let e = sampler.sample(case.hidden.tensor(), case.weights.tensor(), &SamplingParams { row_steps: Some(&steps), ..case.params(&p) });
    assert!(matches!(e, Err(flashsample::Error::Param(flashsample::ParamError::Length { what: "row steps", expected: 4, got: 3 }))), "{e:?}");
}

/// B = 64 with one bad row: the other 63 rows are sampled and equal to the reference.
fn check_one_bad_row(p: &Pipeline, case: &Case, bad: usize, want: RowStatusError) {
    let sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
    let got = case.run_rows(&sampler).unwrap_or_else(|e| panic!("{}: the batch failed: {e}", p.name));
    assert_eq!(got.row_outcome(bad), Err(want.clone()), "{}", p.name);
    assert_eq!(got.row_errors.iter().filter(|e| e.is_some()).count(), 1, "{}: {:?}", p.name, got.row_errors);
    assert!(got.tokens[bad * got.samples_per_row..][..got.samples_per_row].iter().all(|&t| t == INDEX_NONE));
    if let Some(lp) = &got.logprobs {
        assert!(lp[bad * got.samples_per_row].is_nan(), "{}: a failed row's logprob must be NaN", p.name);
    }
    let good: Vec<usize> = (0..case.batch).filter(|&r| r != bad).collect();
    case.check(p, &got, &good).unwrap_or_else(|e| panic!("{}: {e}", p.name));
    assert!(case.run(&sampler).is_err(), "{}: the strict form must still fail", p.name);
    assert_eq!(got.clone().into_complete().unwrap_err().to_string(), flashsample::Error::from(want).to_string());
}

#[test]
fn a_nan_hidden_row_fails_alone() {
    for p in [plain(), serving()] {
        let mut case = Case::random(&p, 64, 32, 3000, 21, 3.0);
        let mut h = case.hidden.exact.clone();
        h[17 * 32 + 5] = f32::NAN;
        case.hidden = MatrixData::from_f32(DType::BF16, 64, 32, &h);
        check_one_bad_row(&p, &case, 17, RowStatusError::Row(RowError::NonFinite { row: 17 }));
    }
}

#[test]
fn an_all_masked_row_fails_alone() {
    for p in [plain(), serving()] {
        let mut case = Case::random(&p, 64, 32, 3000, 22, 3.0);
        let words = case.vocab.div_ceil(32);
        case.mask[40 * words..41 * words].fill(0);
        check_one_bad_row(&p, &case, 40, RowStatusError::Row(RowError::AllMasked { row: 40 }));
    }
}

/// B = 64: 63 rows on top-k 5 and one lone top-p 0.95 at T = 2 whose nucleus holds thousands of
/// tokens (past max_k = 8 and past 1024): every row is sampled, equal to the reference, also at
/// a decode step and with per-row seeds (the exact path draws with the row's own stream and
/// step, not its position in the recomputed launch).
#[test]
fn a_nucleus_past_the_lists_is_served_among_top_k_rows() {
    let p = serving();
    let sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
    let mut case = Case::random(&p, 64, 16, 5000, 23, 3.0);
    for (r, f) in case.filters.iter_mut().enumerate() {
        *f = if r == 63 { RowFilter::top_p(0.95) } else { RowFilter::top_k(5) };
    }
    case.temperatures[63] = 2.0;
    assert!(case.kept_by_filter(&p, 63) > 1024, "the nucleus fits the lists");
    let rows: Vec<usize> = (0..64).collect();
    let steps = [9u32; 64];
    let seeds: Vec<u64> = (0..64).map(|r| 1000 + r).collect();
    for params in [
        case.params(&p),
        SamplingParams { row_steps: Some(&steps), ..case.params(&p) },
        SamplingParams { row_steps: Some(&steps), row_seeds: Some(&seeds), ..case.params(&p) },
    ] {
        let got = sample(&sampler, &case, &params);
        assert!(got.is_complete(), "{:?}", got.row_errors);
        case.check_with(&p, &params, &got, &rows).unwrap();
    }
}
