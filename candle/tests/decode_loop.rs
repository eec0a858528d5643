//! A decode loop over a small candle model on the CPU (random weights: embedding, two
//! residual MLP blocks, final RMS norm) with [`LmHeadSampler`] as the LM head and sampler.
//! At every step its samples must equal flashsample's direct API on the same hidden states
//! bit for bit, and the float64 reference pathwise.

use candle_core::{DType, Device, Tensor, D};
use flashsample::ir::{DType as IrDType, Outputs, Pipeline, PipelineBuilder};
use flashsample::{bf16, RowFilter, Sampler, SamplingParams, TemperatureArg};
use flashsample_candle::LmHeadSampler;
use flashsample_reference::{check_pathwise, logsumexp_tolerance, Problem};
use rand::{rngs::StdRng, SeedableRng};
use rand_distr::{Distribution, Normal};

const BATCH: usize = 4;
const DIM: usize = 64;
const FFN: usize = 128;
const VOCAB: usize = 3001;
const STEPS: u64 = 24;

/// A `[rows, cols]` tensor of N(0, std²) entries in `dtype`, reproducible from `rng`.
fn random(rng: &mut StdRng, rows: usize, cols: usize, std: f32, dtype: DType) -> Tensor {
    let normal = Normal::new(0.0f32, std).expect("finite std");
    let v: Vec<f32> = (0..rows * cols).map(|_| normal.sample(rng)).collect();
    Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

struct Block {
    norm: Tensor,
    up: Tensor,
    down: Tensor,
}

/// Embedding → residual MLP blocks → final RMS norm, in f32; the LM head in bf16.
struct TinyModel {
    embedding: Tensor,
    blocks: Vec<Block>,
    final_norm: Tensor,
    lm_head: Tensor,
}

fn rms_norm(x: &Tensor, gain: &Tensor) -> candle_core::Result<Tensor> {
    let rms = (x.sqr()?.mean_keepdim(D::Minus1)? + 1e-6)?.sqrt()?;
    x.broadcast_div(&rms)?.broadcast_mul(gain)
}

impl TinyModel {
    fn random(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let gain = |rng: &mut StdRng| (random(rng, 1, DIM, 0.1, DType::F32) + 1.0).unwrap().flatten_all().unwrap();
        let blocks = (0..2)
            .map(|_| Block {
                norm: gain(&mut rng),
                up: random(&mut rng, FFN, DIM, 1.0 / (DIM as f32).sqrt(), DType::F32),
                down: random(&mut rng, DIM, FFN, 1.0 / (FFN as f32).sqrt(), DType::F32),
            })
            .collect();
        TinyModel {
            embedding: random(&mut rng, VOCAB, DIM, 1.0, DType::F32),
            blocks,
            final_norm: gain(&mut rng),
            // Logits of standard deviation about 3 for unit-RMS hidden states.
            lm_head: random(&mut rng, VOCAB, DIM, 3.0 / (DIM as f32).sqrt(), DType::BF16),
        }
    }

    /// The bf16 hidden states `[B, D]` for the last tokens `[B, 1]`.
    fn forward(&self, tokens: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = self.embedding.index_select(&tokens.flatten_all()?, 0)?;
        for b in &self.blocks {
            let h = rms_norm(&x, &b.norm)?;
            x = (&x + h.matmul(&b.up.t()?)?.silu()?.matmul(&b.down.t()?)?)?;
        }
        rms_norm(&x, &self.final_norm)?.to_dtype(DType::BF16)
    }
}

/// What a serving stack asks for: per-row temperature and top-k / top-p / min-p, one sample
/// per row, and every output.
fn serving_pipeline() -> Pipeline {
    PipelineBuilder::new("CandleServing", IrDType::BF16, IrDType::BF16)
        .temperature_per_row("temperature")
        .filter("filter", 32)
        .gumbel("seed", 1)
        .outputs(Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 3 })
        .build()
        .unwrap()
}

fn to_bf16_rows(t: &Tensor) -> Vec<bf16> {
    t.flatten_all().unwrap().to_vec1::<bf16>().unwrap()
}

#[test]
fn decode_loop_equals_the_direct_api_and_the_reference() {
    let model = TinyModel::random(21);
    let pipeline = serving_pipeline();
    let adapter = LmHeadSampler::new(pipeline.clone(), &Device::Cpu).unwrap();
    let direct = Sampler::new(pipeline.clone(), &flashsample::Device::cpu()).unwrap();
    let weights = to_bf16_rows(&model.lm_head);

    // Row 2 is greedy; rows 0, 1 and 3 exercise top-k, a lone top-p (nuclei wider than the
    // lists: the exact rerun) and min-p with top-k.
    let temperatures = [0.8f32, 1.1, 0.0, 1.3];
    let filters = [RowFilter::top_k(20), RowFilter::top_p(0.9), RowFilter::OFF, RowFilter { top_k: 32, top_p: 1.0, min_p: 0.02 }];
    let mut tokens = Tensor::new(&[[1u32], [17], [256], [3000]], &Device::Cpu).unwrap();
    let (mut exact, mut history) = (0, Vec::new());
    for step in 0..STEPS {
        // One seed per request, advanced every step.
        let row_seeds: Vec<u64> = (0..BATCH as u64).map(|r| 1_000_003 * r + step).collect();
        let params = SamplingParams {
            temperature: TemperatureArg::PerRow(&temperatures),
            filter: Some(&filters),
            seed: 5,
            row_seeds: Some(&row_seeds),
            ..SamplingParams::default()
        };
        let hidden = model.forward(&tokens).unwrap();
        assert_eq!(hidden.dims(), &[BATCH, DIM]);
        let out = adapter.sample(&hidden, &model.lm_head, &params).unwrap();
        assert_eq!(out.tokens.dims(), &[BATCH, 1]);
        assert_eq!(out.tokens.dtype(), DType::U32);

        // flashsample's direct API on the same bf16 hidden states: identical in every output.
        let h = to_bf16_rows(&hidden);
        let want = direct
            .sample(flashsample::Tensor::host(&h, BATCH, DIM).unwrap(), flashsample::Tensor::host(&weights, VOCAB, DIM).unwrap(), &params)
            .unwrap();
        let got_tokens = out.tokens.flatten_all().unwrap().to_vec1::<u32>().unwrap();
        let f32s = |t: &Option<Tensor>| t.as_ref().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(got_tokens, want.tokens, "step {step}: tokens");
        assert_eq!(f32s(&out.scores), *want.scores.as_ref().unwrap(), "step {step}: scores");
        assert_eq!(f32s(&out.logprobs), *want.logprobs.as_ref().unwrap(), "step {step}: logprobs");
        assert_eq!(f32s(&out.logsumexp), *want.logsumexp.as_ref().unwrap(), "step {step}: logsumexp");
        assert_eq!(out.top_logprobs, want.top_logprobs, "step {step}: top logprobs");

        // The float64 reference, pathwise: same Philox noise, so the same token unless the
        // top two perturbed scores are within the f32 error bound.
        let problem = Problem { pipeline: &pipeline, hidden: &h, weights: &weights, batch: BATCH, dim: DIM, vocab: VOCAB, params: &params };
        let (refs, lses) = problem.sample_all().unwrap();
        let (scores, logprobs, lse) = (f32s(&out.scores), f32s(&out.logprobs), f32s(&out.logsumexp));
        for row in 0..BATCH {
            let r = &refs[row];
            check_pathwise(r, got_tokens[row], scores[row]).unwrap_or_else(|e| panic!("step {step} row {row}: {e}"));
            let tol = logsumexp_tolerance(r.bound, VOCAB);
            assert!((f64::from(lse[row]) - lses[row]).abs() <= tol, "step {step} row {row}: logsumexp {} vs {}", lse[row], lses[row]);
            if got_tokens[row] == r.token {
                exact += 1;
                let lp = r.logit - lses[row];
                assert!((f64::from(logprobs[row]) - lp).abs() <= 2.0 * tol, "step {step} row {row}: logprob {} vs {lp}", logprobs[row]);
            }
        }
        history.push(got_tokens);
        tokens = out.tokens;
    }
    // Near-ties aside the reference's token is the sample's; and the loop really decodes.
    assert!(exact >= (STEPS as usize * BATCH) * 9 / 10, "only {exact} samples equal the reference's token");
    for row in [0, 1, 3] {
        let distinct: std::collections::BTreeSet<u32> = history.iter().map(|t| t[row]).collect();
        assert!(distinct.len() > STEPS as usize / 2, "row {row} decodes only {distinct:?}");
    }
}

/// Prompt scoring through the adapter: a scorer (argmax, target logprobs and ranks) over a
/// candle model's hidden states returns the direct API's target logprobs and ranks as tensors.
#[test]
fn scoring_returns_the_direct_apis_target_logprobs_and_ranks() {
    let model = TinyModel::random(22);
    let pipeline = PipelineBuilder::new("CandleScorer", IrDType::BF16, IrDType::BF16)
        .temperature_per_row("temperature")
        .argmax()
        .target_logprob_and_rank("targets")
        .build()
        .unwrap();
    let adapter = LmHeadSampler::new(pipeline.clone(), &Device::Cpu).unwrap();
    let direct = Sampler::new(pipeline, &flashsample::Device::cpu()).unwrap();
    let tokens = Tensor::new(&[[1u32], [17], [256], [3000]], &Device::Cpu).unwrap();
    let hidden = model.forward(&tokens).unwrap();
    let temperatures = [1.0f32; BATCH];
    let targets = [5u32, 17, 256, 1];
    let params = SamplingParams { temperature: TemperatureArg::PerRow(&temperatures), targets: Some(&targets), ..SamplingParams::default() };
    let out = adapter.sample(&hidden, &model.lm_head, &params).unwrap();
    let h = to_bf16_rows(&hidden);
    let weights = to_bf16_rows(&model.lm_head);
    let want = direct
        .sample(flashsample::Tensor::host(&h, BATCH, DIM).unwrap(), flashsample::Tensor::host(&weights, VOCAB, DIM).unwrap(), &params)
        .unwrap();
    let logprobs = out.target_logprobs.as_ref().expect("target logprobs").to_vec1::<f32>().unwrap();
    let ranks = out.target_ranks.as_ref().expect("target ranks").to_vec1::<u32>().unwrap();
    assert_eq!(Some(logprobs), want.target_logprobs);
    assert_eq!(Some(ranks.clone()), want.target_ranks);
    assert!(ranks.iter().all(|&r| (1..=VOCAB as u32).contains(&r)), "{ranks:?}");
}
