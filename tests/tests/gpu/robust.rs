//! Extreme parameter values on the GPU, against the float64 reference: the same cases as the
//! CPU suite's `extreme_values_are_errors_or_correct_samples`. Ignored without a GPU (run with
//! `--include-ignored` on one); without one they fail rather than pass.

use flashsample::{Device, PenaltyArg, RowError, RowStatusError, Sampler, SamplingParams, TemperatureArg};
use flashsample_ir::{DType, Outputs, Pipeline, PipelineBuilder};
use flashsample_tests::MatrixData;

fn gpu() -> Device {
    Device::cuda(0).expect("this test needs a CUDA GPU")
}

fn pipeline() -> Pipeline {
    PipelineBuilder::new("Extreme", DType::BF16, DType::BF16)
        .penalties("pen")
        .temperature_per_row("t")
        .outputs(Outputs { score: true, logprob: true, ..Outputs::default() })
        .build()
        .unwrap()
}

/// `batch` rows of `e_0` against weights whose column 0 holds `logits` (bf16-exact), D = 16.
fn head(batch: usize, logits: &[f32]) -> (MatrixData, MatrixData) {
    let dim = 16;
    let hidden: Vec<f32> = (0..batch * dim).map(|i| if i % dim == 0 { 1.0 } else { 0.0 }).collect();
    let weights: Vec<f32> = logits.iter().flat_map(|&x| std::iter::once(x).chain(std::iter::repeat_n(0.0, dim - 1))).collect();
    (MatrixData::from_f32(DType::BF16, batch, dim, &hidden), MatrixData::from_f32(DType::BF16, logits.len(), dim, &weights))
}

fn check(p: &Pipeline, h: &MatrixData, w: &MatrixData, params: &SamplingParams<'_>, samples: &flashsample::Samples) {
    let problem = flashsample_reference::Problem {
        pipeline: p,
        hidden: &h.exact,
        weights: &w.exact,
        batch: h.rows,
        dim: h.cols,
        vocab: w.rows,
        params,
    };
    let (refs, _) = problem.sample_all().unwrap();
    for (r, reference) in refs.iter().enumerate() {
        flashsample_reference::check_pathwise(reference, samples.tokens[r], samples.scores.as_ref().unwrap()[r])
            .unwrap_or_else(|e| panic!("row {r}: {e}"));
    }
}

fn logits() -> Vec<f32> {
    (0..40).map(|v| match v { 39 => 6.0, 7 => 5.0, 15 => 4.5, _ => (v as f32 * 0.7).sin() }).collect()
}

/// Tiny temperatures are greedy; penalty counts add up without wrapping.
#[test]
#[ignore = "needs a CUDA GPU"]
fn tiny_temperatures_and_huge_counts_match_the_reference_on_the_gpu() {
    let p = pipeline();
    let sampler = Sampler::new(p.clone(), &gpu()).unwrap();
    let (h, w) = head(4, &logits());
    let temps = [1e-38f32, 1e-45, 0.0, 2.0];
    let ones = [1.0f32; 4];
    let zeros = [0.0f32; 4];
    let history = vec![vec![(39, 0)], vec![(39, 1)], vec![(7, u32::MAX), (7, 1), (39, 3)], vec![]];
    let freq = [0.0f32, 2.0, 2.0, 0.0];
    let pen = PenaltyArg { repetition: &ones, presence: &zeros, frequency: &freq, history: &history };
    let params = SamplingParams { temperature: TemperatureArg::PerRow(&temps), penalties: Some(pen), seed: 9, ..Default::default() };
    let out = sampler.sample(h.tensor(), w.tensor(), &params).unwrap();
    assert_eq!(out.tokens[0], 39, "a tiny temperature is greedy: {out:?}");
    assert_eq!(out.tokens[2], 15, "39 and 7 are penalized away: {out:?}");
    assert!(out.logprobs.as_ref().unwrap().iter().all(|l| l.is_finite()), "{out:?}");
    check(&p, &h, &w, &params, &out);
}

/// A logit of 1e34 at T = 1e-5 overflows f32: that row fails with `NonFinite` (DESIGN.md step 8:
/// the PTX stage two flags a `+inf` winner, as `abi::StageTwo` does), the others are sampled.
#[test]
#[ignore = "needs a CUDA GPU"]
fn an_overflowing_logit_fails_its_row_on_the_gpu() {
    let p = pipeline();
    let sampler = Sampler::new(p.clone(), &gpu()).unwrap();
    let mut big = logits();
    big[3] = 1e34;
    let (h, w) = head(4, &big);
    let temps = [1.0f32, 1e-5, 1.0, 1.0];
    let ones = [1.0f32; 4];
    let zeros = [0.0f32; 4];
    let history = vec![vec![]; 4];
    let pen = PenaltyArg { repetition: &ones, presence: &zeros, frequency: &zeros, history: &history };
    let params = SamplingParams { temperature: TemperatureArg::PerRow(&temps), penalties: Some(pen), ..Default::default() };
    let out = sampler.sample(h.tensor(), w.tensor(), &params).expect("per-row outcomes: the launch succeeds");
    assert_eq!(out.row_errors[1], Some(RowStatusError::Row(RowError::NonFinite { row: 1 })), "{out:?}");
    assert!([0, 2, 3].iter().all(|&r| out.row_errors[r].is_none() && out.tokens[r] == 3), "{out:?}");
}
