//! Shared fixtures for the integration tests: random LM-head problems in any dtype, their
//! float64 reference, and the pathwise and chi-square checks every backend must pass.

pub mod elementwise;
pub mod gpu;
pub mod invariance;
pub mod modes;
pub mod spec;

use flashsample::{bf16, f16, KernelConfig, PenaltyArg, RowFilter, Samples, SamplingParams, Sampler, TemperatureArg, Tensor};
use flashsample_ir::{DType, LogprobMode, Pipeline, Temperature, Transform};
use flashsample_reference::{check_pathwise, logsumexp_tolerance, Problem};
use rand::{rngs::StdRng, Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

/// A matrix in one dtype, with its exact values as f32 for the reference.
pub struct MatrixData {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    bf16: Vec<bf16>,
    f16: Vec<f16>,
    pub exact: Vec<f32>,
}

impl MatrixData {
    /// Gaussian entries of standard deviation `std`, rounded to `dtype`.
    pub fn random(rng: &mut StdRng, dtype: DType, rows: usize, cols: usize, std: f32) -> Self {
        let normal = Normal::new(0.0f32, std).expect("finite std");
        let raw: Vec<f32> = (0..rows * cols).map(|_| normal.sample(rng)).collect();
        Self::from_f32(dtype, rows, cols, &raw)
    }

    pub fn from_f32(dtype: DType, rows: usize, cols: usize, raw: &[f32]) -> Self {
        let mut m = MatrixData { dtype, rows, cols, bf16: vec![], f16: vec![], exact: vec![] };
        match dtype {
            DType::BF16 => {
                m.bf16 = raw.iter().map(|&x| bf16::from_f32(x)).collect();
                m.exact = m.bf16.iter().map(|x| x.to_f32()).collect();
            }
            DType::F16 => {
                m.f16 = raw.iter().map(|&x| f16::from_f32(x)).collect();
                m.exact = m.f16.iter().map(|x| x.to_f32()).collect();
            }
            DType::F32 => m.exact = raw.to_vec(),
        }
        m
    }

    pub fn tensor(&self) -> Tensor<'_> {
        let t = match self.dtype {
            DType::BF16 => Tensor::host(&self.bf16, self.rows, self.cols),
            DType::F16 => Tensor::host(&self.f16, self.rows, self.cols),
            DType::F32 => Tensor::host(&self.exact, self.rows, self.cols),
        };
        t.expect("fixture shapes are consistent")
    }
}

/// One random launch: matrices and every run-time parameter a pipeline may declare.
/// The tokens [`Case::clustered_mask_top_k`] allows.
const CLUSTERED_TOKENS: std::ops::Range<usize> = 1000..1020;

pub struct Case {
    pub batch: usize,
    pub dim: usize,
    pub vocab: usize,
    pub hidden: MatrixData,
    pub weights: MatrixData,
    pub temperatures: Vec<f32>,
    pub bias: Vec<f32>,
    pub mask: Vec<u32>,
    pub banned: Vec<Vec<u32>>,
    pub seed: u64,
    /// A mix of rows with no filter, top-k (1..=8), top-p, min-p and all three; pipelines with a
    /// filter declare `max_k >= 8`.
    pub filters: Vec<RowFilter>,
    pub repetition: Vec<f32>,
    pub presence: Vec<f32>,
    pub frequency: Vec<f32>,
    /// Per row, a few (token, count) pairs; count 0 stands for a prompt token.
    pub history: Vec<Vec<(u32, u32)>>,
    /// Per row, a per-request logit bias: every third row none; the others a few tokens with
    /// a `-inf` ban, a bias large enough to move the argmax, or a small one (token 0 is never
    /// banned, so every row stays samplable).
    pub logit_bias: Vec<Vec<(u32, f32)>>,
    /// Per row, a token to score (`target_logprob`), from its own random stream.
    pub targets: Vec<u32>,
}

impl Case {
    /// Random inputs for `pipeline`; logits have a standard deviation of about `logit_std`.
    pub fn random(pipeline: &Pipeline, batch: usize, dim: usize, vocab: usize, seed: u64, logit_std: f32) -> Case {
        let mut rng = StdRng::seed_from_u64(seed);
        let hidden = MatrixData::random(&mut rng, pipeline.hidden.dtype, batch, dim, 1.0);
        let weights = MatrixData::random(&mut rng, pipeline.weights.dtype, vocab, dim, logit_std / (dim as f32).sqrt());
        // A few greedy rows (temperature 0) among tempered ones.
        let temperatures = (0..batch).map(|r| if r % 7 == 3 { 0.0 } else { rng.random_range(0.3..1.5) }).collect();
        let bias = (0..vocab).map(|v| if v % 11 == 5 { f32::NEG_INFINITY } else { rng.random_range(-1.0..1.0) }).collect();
        let words = vocab.div_ceil(32);
        let mut mask: Vec<u32> = (0..batch * words).map(|_| rng.random::<u32>() | rng.random::<u32>()).collect();
        for row in 0..batch {
            mask[row * words] |= 1; // keep every row samplable: token 0 is never banned or biased away
        }
        let banned = (0..batch).map(|_| (0..3).map(|_| rng.random_range(0..vocab as u32)).filter(|&t| t != 0).collect()).collect();
        let filters = (0..batch)
            .map(|r| match r % 5 {
                0 => RowFilter::OFF,
                1 => RowFilter::top_k(rng.random_range(1..=8)),
                2 => RowFilter::top_p(rng.random_range(0.3..0.9)),
                3 => RowFilter { min_p: rng.random_range(0.05..0.5), ..RowFilter::OFF },
                _ => RowFilter { top_k: rng.random_range(2..=8), top_p: rng.random_range(0.5..0.95), min_p: 0.02 },
            })
            .collect();
        let repetition = (0..batch).map(|_| rng.random_range(1.0..1.6)).collect();
        let presence = (0..batch).map(|_| rng.random_range(0.0..0.8)).collect();
        let frequency = (0..batch).map(|_| rng.random_range(0.0..0.4)).collect();
        let history = (0..batch)
            .map(|_| (0..rng.random_range(0..6)).map(|_| (rng.random_range(0..vocab as u32), rng.random_range(0..4))).collect())
            .collect();
        let seed_value = rng.random();
        Case {
            batch,
            dim,
            vocab,
            hidden,
            weights,
            temperatures,
            bias,
            mask,
            banned,
            seed: seed_value,
            filters,
            repetition,
            presence,
            frequency,
            history,
            logit_bias: random_logit_bias(seed, batch, vocab, logit_std),
            targets: {
                let mut rng = StdRng::seed_from_u64(seed ^ 0x7461_7267_6574);
                (0..batch).map(|_| rng.random_range(0..vocab as u32)).collect()
            },
        }
    }

    pub fn params(&self, pipeline: &Pipeline) -> SamplingParams<'_> {
        let has = |f: fn(&Transform) -> bool| pipeline.transforms.iter().any(f);
        SamplingParams {
            temperature: match pipeline.temperature() {
                Some(Temperature::PerRow { .. }) => TemperatureArg::PerRow(&self.temperatures),
                Some(Temperature::Scalar { .. }) => TemperatureArg::Scalar(self.temperatures[0]),
                _ => TemperatureArg::None,
            },
            bias: has(|t| matches!(t, Transform::Bias { .. })).then_some(&self.bias[..]),
            mask: has(|t| matches!(t, Transform::Mask { .. })).then_some(&self.mask[..]),
            banned: has(|t| matches!(t, Transform::Ban { .. })).then_some(&self.banned[..]),
            seed: self.seed,
            filter: pipeline.filter_max_k().map(|_| &self.filters[..]),
            logit_bias: pipeline.has_logit_bias().then_some(&self.logit_bias[..]),
            targets: pipeline.targets.is_some().then_some(&self.targets[..]),
            penalties: pipeline.has_penalties().then_some(PenaltyArg {
                repetition: &self.repetition,
                presence: &self.presence,
                frequency: &self.frequency,
                history: &self.history,
            }),
            ..Default::default()
        }
    }

    /// Samples every row; a row the kernels could not sample fails the call (its error).
    pub fn run(&self, sampler: &Sampler) -> flashsample::Result<Samples> {
        self.run_rows(sampler).and_then(Samples::into_complete)
    }

    /// Samples every row, with per-row outcomes (`Samples::row_errors`).
    pub fn run_rows(&self, sampler: &Sampler) -> flashsample::Result<Samples> {
        sampler.sample(self.hidden.tensor(), self.weights.tensor(), &self.params(sampler.pipeline()))
    }

    /// [`Case::run`] with an explicit config.
    pub fn run_with(&self, sampler: &Sampler, config: &KernelConfig) -> flashsample::Result<Samples> {
        sampler.sample_with(self.hidden.tensor(), self.weights.tensor(), &self.params(sampler.pipeline()), config).and_then(Samples::into_complete)
    }

    /// Median seconds of `reps` launches with `config` after `warmup`.
    pub fn median_secs(&self, sampler: &Sampler, config: &KernelConfig, warmup: usize, reps: usize) -> flashsample::Result<f64> {
        let params = self.params(sampler.pipeline());
        let mut t = sampler.time_with(self.hidden.tensor(), self.weights.tensor(), &params, config, warmup, reps.max(1))?;
        t.sort_by(f64::total_cmp);
        Ok(t[t.len() / 2])
    }

    /// A case whose rows all hold the same hidden state (and mask, bans, temperature 0.7), so
    /// every row samples one distribution with its own noise.
    pub fn identical_rows(pipeline: &Pipeline, batch: usize, dim: usize, vocab: usize, logit_std: f32) -> Case {
        let mut case = Case::random(pipeline, batch, dim, vocab, 42, logit_std);
        let first: Vec<f32> = case.hidden.exact[..dim].to_vec();
        let rows: Vec<f32> = (0..batch).flat_map(|_| first.iter().cloned()).collect();
        case.hidden = MatrixData::from_f32(pipeline.hidden.dtype, batch, dim, &rows);
        case.temperatures.iter_mut().for_each(|t| *t = 0.7);
        let words = vocab.div_ceil(32);
        for row in 0..batch {
            case.banned[row] = case.banned[0].clone();
            case.history[row] = case.history[0].clone();
            case.logit_bias[row] = case.logit_bias[0].clone();
            case.repetition[row] = case.repetition[0];
            case.presence[row] = case.presence[0];
            case.frequency[row] = case.frequency[0];
            for w in 0..words {
                case.mask[row * words + w] = case.mask[w];
            }
        }
        case
    }

    /// Token counts over every row and sample of `seeds` launches (seeds 1000, 1001, ...).
    pub fn draw_counts(&mut self, sampler: &Sampler, seeds: u64) -> flashsample::Result<Vec<u64>> {
        let mut counts = vec![0u64; self.vocab];
        for s in 0..seeds {
            self.seed = 1000 + s;
            for &t in &self.run(sampler)?.tokens {
                counts[t as usize] += 1;
            }
        }
        Ok(counts)
    }

    /// The reference softmax of `row` under `pipeline`.
    pub fn probabilities(&self, pipeline: &Pipeline, row: usize) -> Vec<f64> {
        let params = self.params(pipeline);
        self.problem(pipeline, &params).probabilities(row).expect("fixture rows are samplable")
    }

    /// This case as the float64 reference sees it.
    pub fn problem<'a>(&'a self, pipeline: &'a Pipeline, params: &'a SamplingParams<'a>) -> Problem<'a, f32, f32> {
        Problem {
            pipeline,
            hidden: &self.hidden.exact,
            weights: &self.weights.exact,
            batch: self.batch,
            dim: self.dim,
            vocab: self.vocab,
            params,
        }
    }

    /// Checks `samples` row by row against the float64 reference: tokens pathwise (except
    /// near-ties within the derived bound), scores within the bound (when the pipeline
    /// returns them), logsumexp and logprobs too.
    pub fn check(&self, pipeline: &Pipeline, samples: &Samples, rows: &[usize]) -> Result<(), String> {
        self.check_with(pipeline, &self.params(pipeline), samples, rows)
    }

    /// [`Case::check`] of samples drawn with `params` (this case's, with changes such as row
    /// seeds or steps); every checked row must have been sampled.
    pub fn check_with(&self, pipeline: &Pipeline, params: &SamplingParams<'_>, samples: &Samples, rows: &[usize]) -> Result<(), String> {
        for &row in rows {
            if let Err(e) = samples.row_outcome(row) {
                return Err(format!("row {row} was not sampled: {e}"));
            }
        }
        let problem = self.problem(pipeline, params);
        let (refs, lses) = problem.sample_rows(rows).map_err(|e| format!("reference failed: {e}"))?;
        let s = samples.samples_per_row;
        let raw = pipeline.logprob_mode == LogprobMode::Raw;
        for (i, &row) in rows.iter().enumerate() {
            // The distribution the logprob outputs describe: processed, or raw (DESIGN.md step 10).
            let (lse, lse_bound) = if raw {
                problem.reported_logsumexp(row).map_err(|e| e.to_string())?
            } else {
                (lses[i], refs[i * s].lse_bound)
            };
            for k in 0..s {
                let r = &refs[i * s + k];
                let slot = row * s + k;
                let score = samples.scores.as_ref().map_or(r.score as f32, |s| s[slot]);
                check_pathwise(r, samples.tokens[slot], score).map_err(|e| format!("row {row} sample {k}: {e}"))?;
                if let (Some(lp), true) = (&samples.logprobs, raw) {
                    // Every sampled token's raw logprob is known, whichever near-tie won.
                    let (want, tol) = problem.reported_logprob(row, samples.tokens[slot], lse, lse_bound).map_err(|e| e.to_string())?;
                    if (f64::from(lp[slot]) - want).abs() > tol {
                        return Err(format!("row {row} sample {k}: raw logprob {} vs reference {want} (tolerance {tol})", lp[slot]));
                    }
                } else if let Some(lp) = &samples.logprobs {
                    let want = r.logit - lses[i];
                    let tol = r.logprob_tolerance(lses[i], self.vocab);
                    if samples.tokens[slot] == r.token && (f64::from(lp[slot]) - want).abs() > tol {
                        return Err(format!("row {row} sample {k}: logprob {} vs reference {want}", lp[slot]));
                    }
                }
            }
            if let Some(top) = &samples.top_logprobs {
                self.check_top_logprobs(&problem, row, &top[row], lse, lse_bound)?;
            }
            if let Some(got) = &samples.target_logprobs {
                let (want, tol) = problem.target_logprob(row, lse, lse_bound).map_err(|e| e.to_string())?;
                let ok = if want == f64::NEG_INFINITY { got[row] == f32::NEG_INFINITY } else { (f64::from(got[row]) - want).abs() <= tol };
                if !ok {
                    return Err(format!("row {row}: target {} logprob {} vs reference {want} (tolerance {tol})", self.targets[row], got[row]));
                }
            }
            if let Some(got) = &samples.target_ranks {
                let (lo, hi) = problem.target_rank(row).map_err(|e| e.to_string())?;
                if !(lo..=hi).contains(&got[row]) {
                    return Err(format!("row {row}: target {} rank {} outside the reference's [{lo}, {hi}]", self.targets[row], got[row]));
                }
            }
            if let Some(got) = &samples.logsumexp {
                let tol = logsumexp_tolerance(lse_bound, self.vocab);
                if (f64::from(got[row]) - lse).abs() > tol {
                    return Err(format!("row {row}: logsumexp {} vs reference {lse} (tolerance {tol})", got[row]));
                }
            }
        }
        Ok(())
    }
}

impl Case {
    /// How many tokens the reference's filter keeps for `row` (its nucleus, for a top-p /
    /// min-p row): tests of the exact nucleus path check it is past the largest lists.
    pub fn kept_by_filter(&self, pipeline: &Pipeline, row: usize) -> usize {
        let params = self.params(pipeline);
        let problem = self.problem(pipeline, &params);
        let logits = problem.row_logits(row).expect("a samplable row");
        problem.candidate_set(row, &logits).kept.len()
    }

    /// `got` must be `n` most likely tokens of `row`, most likely first, with their logprobs:
    /// each logprob within tolerance of the reference, each token within the f32 bounds of the
    /// reference's n-th largest logit (so only near-ties may swap). Likely under the
    /// distribution the pipeline's logprobs describe (raw or processed).
    fn check_top_logprobs(&self, problem: &Problem<'_, f32, f32>, row: usize, got: &[(u32, f32)], lse: f64, lse_bound: f64) -> Result<(), String> {
        let rl = problem.reported_logits(row).map_err(|e| e.to_string())?;
        let n = problem.pipeline.outputs.top_logprobs as usize;
        let mut sorted: Vec<(f64, f64)> =
            rl.logits.iter().zip(&rl.bounds).map(|(&x, &b)| (x, b)).filter(|(x, _)| *x > f64::NEG_INFINITY).collect();
        sorted.sort_by(|a, b| b.0.total_cmp(&a.0));
        if got.len() != n.min(sorted.len()) {
            return Err(format!("row {row}: {} top logprobs, expected {}", got.len(), n.min(sorted.len())));
        }
        for (j, &(tok, lp)) in got.iter().enumerate() {
            let (x, b) = (rl.logits[tok as usize], rl.bounds[tok as usize]);
            let want = x - lse;
            let tol = b + logsumexp_tolerance(lse_bound, self.vocab) + 2.0 * f64::from(f32::EPSILON) * want.abs();
            if (f64::from(lp) - want).abs() > tol {
                return Err(format!("row {row} top {j}: token {tok} logprob {lp} vs reference {want}"));
            }
            if x + b < sorted[j].0 - sorted[j].1 {
                return Err(format!("row {row} top {j}: token {tok} (logit {x}) is not the {j}-th most likely ({})", sorted[j].0));
            }
            if j > 0 && lp > got[j - 1].1 {
                return Err(format!("row {row}: top logprobs out of order at {j}"));
            }
        }
        Ok(())
    }

    /// The first `b` rows of this case (same bias, mask words, seed and per-row parameters),
    /// weights left empty: callers pass the full head's weights separately.
    pub fn prefix(&self, b: usize) -> Case {
        self.rows(&(0..b).collect::<Vec<_>>())
    }

    /// Rows `ids` of this case, in that order (repeats allowed), with their hidden states, mask
    /// words and per-row parameters; bias and seed are the case's, weights left empty.
    pub fn rows(&self, ids: &[usize]) -> Case {
        let words = self.vocab.div_ceil(32);
        let hidden: Vec<f32> = ids.iter().flat_map(|&r| self.hidden.exact[r * self.dim..][..self.dim].iter().copied()).collect();
        let pick = |v: &[f32]| ids.iter().map(|&r| v[r]).collect::<Vec<f32>>();
        Case {
            batch: ids.len(),
            dim: self.dim,
            vocab: self.vocab,
            hidden: MatrixData::from_f32(self.hidden.dtype, ids.len(), self.dim, &hidden),
            weights: MatrixData::from_f32(self.weights.dtype, 0, self.dim, &[]),
            temperatures: pick(&self.temperatures),
            bias: self.bias.clone(),
            mask: ids.iter().flat_map(|&r| self.mask[r * words..][..words].iter().copied()).collect(),
            banned: ids.iter().map(|&r| self.banned[r].clone()).collect(),
            seed: self.seed,
            filters: ids.iter().map(|&r| self.filters[r]).collect(),
            repetition: pick(&self.repetition),
            presence: pick(&self.presence),
            frequency: pick(&self.frequency),
            history: ids.iter().map(|&r| self.history[r].clone()).collect(),
            logit_bias: ids.iter().map(|&r| self.logit_bias[r].clone()).collect(),
            targets: ids.iter().map(|&r| self.targets[r]).collect(),
        }
    }

    /// Every row gets `filter`.
    pub fn with_filter(mut self, filter: RowFilter) -> Case {
        self.filters.iter_mut().for_each(|f| *f = filter);
        self
    }

    /// Both backends' short-list overflow test: a top-k 32 pipeline reporting 32 top logprobs
    /// and 12 rows (D 128, V 20000) whose top 32 are the first 40 tokens ([`Case::hot_tile`]),
    /// each on top-k 32 + top-p 0.95.
    pub fn hot_tile_top_k() -> (Pipeline, Case) {
        let p = flashsample_ir::PipelineBuilder::new("TopK32", DType::BF16, DType::BF16)
            .temperature_per_row("t")
            .filter("f", 32)
            .gumbel("seed", 4)
            .outputs(flashsample_ir::Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 32 })
            .build()
            .expect("a valid pipeline");
        let case = Case::hot_tile(&p, 12, 128, 20_000, 40).with_filter(RowFilter { top_k: 32, top_p: 0.95, min_p: 0.0 });
        (p, case)
    }

    /// [`Case::hot_tile_top_k`]'s checks of one run: pathwise the reference, and every row's
    /// top logprobs are the hot tokens in order.
    pub fn check_hot_tile_top_k(&self, p: &Pipeline, got: &Samples) -> Result<(), String> {
        self.check(p, got, &(0..self.batch).collect::<Vec<_>>())?;
        for (row, top) in got.top_logprobs.as_ref().ok_or("no top logprobs")?.iter().enumerate() {
            let tokens: Vec<u32> = top.iter().map(|t| t.0).collect();
            if tokens != (0..32).collect::<Vec<u32>>() {
                return Err(format!("row {row}: top logprob tokens {tokens:?}, not 0..32"));
            }
        }
        Ok(())
    }

    /// Both backends' clustered-mask tests: a grammar-like mask leaves each of `masked` of 8
    /// rows (D 64, V 5000) only the 20 tokens 1000..1020 (digits, say, whose ids sit side by
    /// side, so one vocabulary tile holds them all), on top-k 32 with 24 top logprobs; the
    /// other rows allow every token. Each tile list is shorter than 20, so a masked row's merge
    /// finds fewer than `need` tokens while a list is full: that is an overflow and a rerun of
    /// the rows from the first masked one to the last, never a short, wrong top-k.
    pub fn clustered_mask_top_k(masked: &[usize]) -> (Pipeline, Case) {
        let p = flashsample_ir::PipelineBuilder::new("Digits", DType::BF16, DType::BF16)
            .temperature_per_row("t")
            .mask("allowed")
            .filter("f", 32)
            .gumbel("seed", 2)
            .outputs(flashsample_ir::Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 24 })
            .build()
            .expect("a valid pipeline");
        let (batch, vocab) = (8, 5000);
        let mut case = Case::random(&p, batch, 64, vocab, 13, 3.0).with_filter(RowFilter { top_k: 32, top_p: 1.0, min_p: 0.0 });
        case.allow_only(masked, CLUSTERED_TOKENS);
        (p, case)
    }

    /// Masks each of `rows` to allow only `tokens` and every other row to allow every token.
    pub fn allow_only(&mut self, rows: &[usize], tokens: std::ops::Range<usize>) {
        let words = self.vocab.div_ceil(32);
        for row in 0..self.batch {
            let allowed = &mut self.mask[row * words..][..words];
            allowed.fill(if rows.contains(&row) { 0 } else { u32::MAX });
            if rows.contains(&row) {
                tokens.clone().for_each(|t| allowed[t / 32] |= 1 << (t % 32));
            }
        }
    }

    /// [`Case::clustered_mask_top_k`]'s checks of one run: pathwise the reference, every
    /// `masked` row's top logprobs are all 20 allowed tokens and every other row's are 24.
    pub fn check_clustered_mask_top_k(&self, p: &Pipeline, got: &Samples, masked: &[usize]) -> Result<(), String> {
        self.check(p, got, &(0..self.batch).collect::<Vec<_>>())?;
        for (row, top) in got.top_logprobs.as_ref().ok_or("no top logprobs")?.iter().enumerate() {
            let mut tokens: Vec<usize> = top.iter().map(|t| t.0 as usize).collect();
            tokens.sort_unstable();
            match masked.contains(&row) {
                true if tokens != CLUSTERED_TOKENS.collect::<Vec<_>>() => {
                    return Err(format!("row {row}: top logprob tokens {tokens:?}, not the 20 allowed"));
                }
                false if tokens.len() != 24 => return Err(format!("row {row}: {} top logprobs, not 24", tokens.len())),
                _ => {}
            }
        }
        Ok(())
    }

    /// A case whose rows all prefer the first `hot` tokens, in order (one vocabulary tile holds
    /// the whole top-k), so a short per-tile list must overflow and the backend must rerun
    /// exactly.
    pub fn hot_tile(p: &Pipeline, batch: usize, dim: usize, vocab: usize, hot: usize) -> Case {
        let mut case = Case::random(p, batch, dim, vocab, 9, 1.0);
        let h0: Vec<f32> = case.hidden.exact[..dim].to_vec();
        let rows: Vec<f32> = (0..batch).flat_map(|_| h0.iter().cloned()).collect();
        case.hidden = MatrixData::from_f32(p.hidden.dtype, batch, dim, &rows);
        let norm: f32 = h0.iter().map(|x| x * x).sum();
        let mut w = case.weights.exact.clone();
        for v in 0..hot {
            let scale = (8.0 - v as f32 * 0.05) / norm;
            for d in 0..dim {
                w[v * dim + d] = h0[d] * scale;
            }
        }
        case.weights = MatrixData::from_f32(p.weights.dtype, vocab, dim, &w);
        case
    }
}

/// [`Case::logit_bias`]'s rows, from their own random stream (so the other fields do not
/// depend on whether a pipeline takes a logit bias).
fn random_logit_bias(seed: u64, batch: usize, vocab: usize, logit_std: f32) -> Vec<Vec<(u32, f32)>> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6c6f_6769_745f_6269);
    (0..batch)
        .map(|r| {
            if r % 3 == 2 {
                return Vec::new();
            }
            let mut tokens: Vec<u32> = (0..rng.random_range(1..8)).map(|_| rng.random_range(0..vocab as u32)).collect();
            tokens.sort_unstable();
            tokens.dedup();
            tokens
                .into_iter()
                .map(|t| {
                    let bias = match rng.random_range(0..4) {
                        0 if t != 0 => f32::NEG_INFINITY,
                        1 => rng.random_range(3.0..6.0) * logit_std,
                        _ => rng.random_range(-1.0..1.0) * logit_std,
                    };
                    (t, bias)
                })
                .collect()
        })
        .collect()
}

/// Pipelines with a top-k / top-p / min-p filter or penalties and the one filter every row
/// gets, for the chi-square tests of every backend.
pub fn chi_square_filter_cases() -> Vec<(Pipeline, RowFilter)> {
    use flashsample_ir::PipelineBuilder;
    let filtered = |name| PipelineBuilder::new(name, DType::BF16, DType::BF16).temperature_per_row("t").filter("f", 8);
    vec![
        (filtered("TopK").build().expect("valid"), RowFilter::top_k(4)),
        (filtered("TopP").build().expect("valid"), RowFilter::top_p(0.7)),
        (filtered("MinP").build().expect("valid"), RowFilter { min_p: 0.2, ..RowFilter::OFF }),
        (filtered("All3").build().expect("valid"), RowFilter { top_k: 6, top_p: 0.9, min_p: 0.05 }),
        (
            PipelineBuilder::new("Penalties", DType::BF16, DType::BF16).penalties("pen").temperature_per_row("t").build().expect("valid"),
            RowFilter::OFF,
        ),
    ]
}

/// Samples `sampler`'s (filter) pipeline on 2000 identical rows, every one under `filter` and the
/// same penalty history, over 5 seeds, and checks the counts against the reference's
/// renormalized distribution: chi-square p > 1e-3, and with a top-k no token outside it.
/// The p-value, or what failed.
pub fn chi_square_filtered(sampler: &Sampler, filter: RowFilter, dim: usize) -> Result<f64, String> {
    let pipeline = sampler.pipeline();
    let mut case = Case::identical_rows(pipeline, 2000, dim, 12, 1.5).with_filter(filter);
    case.history[0] = vec![(0, 2), (3, 0), (5, 1)];
    for row in 1..case.batch {
        case.history[row] = case.history[0].clone();
    }
    let counts = case.draw_counts(sampler, 5).map_err(|e| e.to_string())?;
    let probs = case.probabilities(pipeline, 0);
    let (stat, p) = chi_square(&counts, &probs);
    if p <= 1e-3 {
        return Err(format!("{} {filter:?}: chi-square {stat:.1}, p = {p:.2e}\ncounts {counts:?}\nprobs {probs:?}", pipeline.name));
    }
    if filter.top_k > 0 {
        let outside: u64 = probs.iter().zip(&counts).filter(|(q, _)| **q == 0.0).map(|(_, c)| c).sum();
        if outside != 0 {
            return Err(format!("{}: {outside} tokens outside the top-k were drawn", pipeline.name));
        }
    }
    Ok(p)
}

/// One pipeline per transform, for the chi-square tests of every backend.
pub fn chi_square_pipelines() -> Vec<Pipeline> {
    use flashsample_ir::PipelineBuilder;
    let b = |name| PipelineBuilder::new(name, DType::BF16, DType::BF16);
    [
        b("Plain").gumbel("seed", 4),
        b("Temp").temperature_per_row("t"),
        b("Bias").bias("b"),
        b("Mask").mask("m").ban("banned"),
        b("LogitBias").logit_bias("logit_bias").temperature_per_row("t"),
        PipelineBuilder::new("Cap", DType::F16, DType::F16).softcap(1.5),
    ]
    .into_iter()
    .map(|p| p.build().expect("valid test pipeline"))
    .collect()
}

/// Pearson's chi-square statistic of `counts` against `probs`, pooling cells whose expected
/// count is below 5 (the usual validity rule), and the p-value under the null.
pub fn chi_square(counts: &[u64], probs: &[f64]) -> (f64, f64) {
    use statrs::distribution::{ChiSquared, ContinuousCDF};
    let n: u64 = counts.iter().sum();
    let (mut stat, mut cells) = (0.0, 0usize);
    let (mut pooled_obs, mut pooled_exp) = (0.0, 0.0);
    for (&c, &p) in counts.iter().zip(probs) {
        let e = p * n as f64;
        if e < 5.0 {
            pooled_obs += c as f64;
            pooled_exp += e;
            continue;
        }
        stat += (c as f64 - e).powi(2) / e;
        cells += 1;
    }
    if pooled_exp > 0.0 {
        stat += (pooled_obs - pooled_exp).powi(2) / pooled_exp.max(1e-12);
        cells += 1;
    }
    let df = (cells.max(2) - 1) as f64;
    let p = 1.0 - ChiSquared::new(df).expect("df > 0").cdf(stat);
    (stat, p)
}

/// README.md, so `cargo test` compiles and runs its Rust example and it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeExample;
