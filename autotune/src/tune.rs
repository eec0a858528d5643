//! The measuring loop. Per (D, V) the inputs are made once ([`HeadInputs`]: random weights,
//! uploaded once to the GPU); per batch ([`ShapeInputs`]) the float64 reference of the checked
//! rows is computed once. Every config's samples are checked against it before it is timed.
//!
//! Two modes ([`Effort`]):
//! - full (`quick_reps == 0`): every config of the space, `warmup` + `reps` launches.
//! - pruned: a quick pass in the order given (the caller ranks the space, e.g. by
//!   `gpu_space::rank`), `quick_reps` launches each, until the shape's deadline; then only
//!   the `finalists` fastest (and the heuristic) are timed with `warmup` + `reps`.

use flashsample::{
    ir::Pipeline,
    tuning::{Measured, ShapeKey, TuningEntry},
    DeviceTensor, KernelConfig, Samples, Sampler, Tensor,
};
use flashsample_reference::{check_pathwise, logsumexp_tolerance, Problem, SampleReference};
use flashsample_tests::invariance::{outputs_of, RequestOutputs};
use flashsample_tests::{Case, MatrixData};
use std::time::Instant;

/// How hard to measure.
#[derive(Clone, Copy, Debug)]
pub struct Effort {
    /// Untimed launches before timing.
    pub warmup: usize,
    /// Timed launches (the median is kept).
    pub reps: usize,
    /// Configs kept per shape.
    pub top: usize,
    /// Launches per config in the quick pass; 0 = full mode (no quick pass).
    pub quick_reps: usize,
    /// Configs timed fully after the quick pass.
    pub finalists: usize,
}

/// A config that was compiled and run, and what came of it.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// Correct samples, and its time.
    Timed(Measured),
    /// Failed to compile or launch (the message says why).
    Failed(String),
    /// Ran, but its samples disagreed with the reference.
    Wrong(String),
    /// Not measured: the shape's time budget ran out first.
    Skipped,
}

/// Why a shape could not be tuned.
#[derive(Debug, thiserror::Error)]
pub enum TuneError {
    /// Every config failed or gave wrong samples.
    #[error("no config produced correct samples at {0:?}; first failure: {1}")]
    NothingCorrect(ShapeKey, String),
    /// The runtime failed outside a config's measurement.
    #[error(transparent)]
    Runtime(#[from] flashsample::Error),
    /// The float64 reference rejected the inputs.
    #[error("float64 reference failed: {0}")]
    Reference(String),
}

fn to_json(c: &KernelConfig) -> serde_json::Value {
    serde_json::to_value(c).expect("configs serialize to JSON")
}

/// Rows checked against the float64 reference: the first and the last.
fn checked_rows(batch: usize) -> Vec<usize> {
    if batch > 1 {
        vec![0, batch - 1]
    } else {
        vec![0]
    }
}

/// One LM head `[V, D]` and the largest batch of hidden states, made once per (D, V): the
/// random weights, and their device copy when the sampler runs on a GPU, so no config pays a
/// multi-GB upload.
pub struct HeadInputs {
    /// The weights and the largest batch of hidden states and parameters.
    pub big: Case,
    /// The weights on the GPU, when the sampler runs there.
    pub device_weights: Option<DeviceTensor>,
}

impl HeadInputs {
    /// Random inputs for `max_batch` rows of a `[vocab, dim]` head.
    pub fn new(sampler: &Sampler, max_batch: usize, dim: usize, vocab: usize) -> Result<HeadInputs, TuneError> {
        let big = Case::random(sampler.pipeline(), max_batch, dim, vocab, 0x7075_6e65, 4.0);
        let device_weights = match sampler.device() {
            flashsample::Device::Cuda(dev) => Some(upload(dev, &big.weights)?),
            flashsample::Device::Cpu { .. } => None,
        };
        Ok(HeadInputs { big, device_weights })
    }

    /// The weights as a launch takes them (the device copy if there is one).
    pub fn weights(&self) -> Tensor<'_> {
        match &self.device_weights {
            Some(d) => Tensor::device(d),
            None => self.big.weights.tensor(),
        }
    }
}

fn upload(dev: &std::sync::Arc<flashsample::CudaDevice>, m: &MatrixData) -> flashsample::Result<DeviceTensor> {
    use flashsample::{bf16, f16, ir::DType};
    // `exact` holds values already rounded to the dtype, so converting back is lossless.
    match m.dtype {
        DType::BF16 => dev.upload(&m.exact.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(), m.rows, m.cols),
        DType::F16 => dev.upload(&m.exact.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(), m.rows, m.cols),
        DType::F32 => dev.upload(&m.exact, m.rows, m.cols),
    }
}

/// One batch size of a head: its case (the head's first `batch` rows and parameters) and the
/// reference samples of the checked rows.
pub struct ShapeInputs<'h> {
    head: &'h HeadInputs,
    case: Case,
    rows: Vec<usize>,
    refs: Vec<SampleReference>,
    lses: Vec<f64>,
    /// Every row's outputs under the heuristic config, computed on first use: a candidate
    /// config must reproduce them bit for bit (batch invariance: DESIGN.md).
    baseline: std::sync::OnceLock<Result<Vec<RequestOutputs>, String>>,
}

impl<'h> ShapeInputs<'h> {
    /// The first `batch` rows of `head` and their reference samples.
    pub fn new(pipeline: &Pipeline, head: &'h HeadInputs, batch: usize) -> Result<ShapeInputs<'h>, TuneError> {
        let case = head.big.prefix(batch);
        let rows = checked_rows(batch);
        let params = case.params(pipeline);
        let problem = Problem {
            pipeline,
            hidden: &case.hidden.exact,
            weights: &head.big.weights.exact,
            batch,
            dim: case.dim,
            vocab: case.vocab,
            params: &params,
        };
        let (refs, lses) = problem.sample_rows(&rows).map_err(|e| TuneError::Reference(e.to_string()))?;
        Ok(ShapeInputs { head, case, rows, refs, lses, baseline: std::sync::OnceLock::new() })
    }

    fn run(&self, sampler: &Sampler, config: &KernelConfig) -> flashsample::Result<Samples> {
        sampler.sample_with(self.case.hidden.tensor(), self.head.weights(), &self.case.params(sampler.pipeline()), config)
    }

    fn median_secs(&self, sampler: &Sampler, config: &KernelConfig, warmup: usize, reps: usize) -> flashsample::Result<f64> {
        let params = self.case.params(sampler.pipeline());
        let mut t = sampler.time_with(self.case.hidden.tensor(), self.head.weights(), &params, config, warmup, reps.max(1))?;
        t.sort_by(f64::total_cmp);
        Ok(t[t.len() / 2])
    }

    /// `Case::check` against the cached reference: tokens pathwise (near-ties within the
    /// derived bound may differ), scores within the bound, logsumexp and logprobs too.
    fn check(&self, samples: &Samples) -> Result<(), String> {
        let s = samples.samples_per_row;
        let vocab = self.case.vocab;
        for (i, &row) in self.rows.iter().enumerate() {
            for k in 0..s {
                let r = &self.refs[i * s + k];
                let slot = row * s + k;
                let score = samples.scores.as_ref().map_or(r.score as f32, |sc| sc[slot]);
                check_pathwise(r, samples.tokens[slot], score).map_err(|e| format!("row {row} sample {k}: {e}"))?;
                if let Some(lp) = &samples.logprobs {
                    let want = r.logit - self.lses[i];
                    let tol = r.logprob_tolerance(self.lses[i], vocab);
                    if samples.tokens[slot] == r.token && (f64::from(lp[slot]) - want).abs() > tol {
                        return Err(format!("row {row} sample {k}: logprob {} vs reference {want}", lp[slot]));
                    }
                }
            }
            if let Some(lse) = &samples.logsumexp {
                let tol = logsumexp_tolerance(self.refs[i * s].lse_bound, vocab);
                if (f64::from(lse[row]) - self.lses[i]).abs() > tol {
                    return Err(format!("row {row}: logsumexp {} vs reference {} (tolerance {tol})", lse[row], self.lses[i]));
                }
            }
        }
        Ok(())
    }

    /// Whether `samples` are the heuristic config's bit for bit (tokens, scores, logprobs,
    /// logsumexps, top logprobs): a config that changes any bit would make a request's result
    /// depend on the batch it lands in, so the tuner refuses it.
    fn check_invariant(&self, sampler: &Sampler, samples: &Samples) -> Result<(), String> {
        let baseline = self.baseline.get_or_init(|| {
            let (b, d, v) = (self.case.batch, self.case.dim, self.case.vocab);
            let s = self.run(sampler, &sampler.heuristic_config(b, d, v)).map_err(|e| format!("heuristic config failed: {e}"))?;
            Ok((0..b).map(|row| outputs_of(&s, row)).collect())
        });
        let baseline = baseline.as_ref().map_err(Clone::clone)?;
        match (0..self.case.batch).find(|&row| outputs_of(samples, row) != baseline[row]) {
            None => Ok(()),
            Some(row) => Err(format!(
                "breaks batch invariance: row {row} gives {:?}, the heuristic config {:?}",
                outputs_of(samples, row),
                baseline[row]
            )),
        }
    }

    /// Checks `config`'s samples against the reference and, bit for bit, the heuristic
    /// config's, then times it.
    fn measure(&self, sampler: &Sampler, config: &KernelConfig, warmup: usize, reps: usize) -> Outcome {
        let samples = match self.run(sampler, config) {
            Ok(s) => s,
            Err(e) => return Outcome::Failed(e.to_string()),
        };
        if let Err(e) = self.check(&samples).and_then(|()| self.check_invariant(sampler, &samples)) {
            return Outcome::Wrong(e);
        }
        match self.median_secs(sampler, config, warmup, reps) {
            Ok(s) => Outcome::Timed(Measured { config: to_json(config), median_us: s * 1e6 }),
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// Tunes one shape over `space` (in preference order: the quick pass stops at `deadline`,
/// but always measures at least two configs); `on_config` is called after each config.
pub fn tune_shape(
    sampler: &Sampler,
    inputs: &ShapeInputs<'_>,
    shape: ShapeKey,
    space: &[KernelConfig],
    effort: Effort,
    deadline: Option<Instant>,
    mut on_config: impl FnMut(&KernelConfig, &Outcome),
) -> Result<TuningEntry, TuneError> {
    let heuristic_config = sampler.heuristic_config(shape.batch, shape.dim, shape.vocab);
    let quick = effort.quick_reps > 0;
    let (warmup, reps) = if quick { (1, effort.quick_reps) } else { (effort.warmup, effort.reps) };
    let mut timed: Vec<(KernelConfig, Measured)> = Vec::new();
    let mut first_failure = None;
    for config in space {
        let out_of_time = deadline.is_some_and(|d| Instant::now() >= d) && timed.len() >= 2;
        let outcome = if out_of_time { Outcome::Skipped } else { inputs.measure(sampler, config, warmup, reps) };
        on_config(config, &outcome);
        match outcome {
            Outcome::Timed(m) => timed.push((config.clone(), m)),
            Outcome::Failed(e) | Outcome::Wrong(e) => {
                first_failure.get_or_insert(e);
            }
            Outcome::Skipped => {}
        }
    }
    timed.sort_by(|a, b| a.1.median_us.total_cmp(&b.1.median_us));
    if quick {
        // Few launches rank configs well enough to pick finalists, not to report them.
        timed.truncate(effort.finalists.max(1));
        for (config, m) in timed.iter_mut() {
            if let Ok(s) = inputs.median_secs(sampler, config, effort.warmup, effort.reps) {
                m.median_us = s * 1e6;
            }
        }
        timed.sort_by(|a, b| a.1.median_us.total_cmp(&b.1.median_us));
    }
    let heuristic = match timed.iter().find(|(c, _)| *c == heuristic_config) {
        Some((_, m)) => m.clone(),
        None => match inputs.measure(sampler, &heuristic_config, effort.warmup, effort.reps) {
            Outcome::Timed(m) => m,
            // Recorded as NaN so the table shows the heuristic failed here.
            _ => Measured { config: to_json(&heuristic_config), median_us: f64::NAN },
        },
    };
    let best = timed
        .first()
        .map(|(_, m)| m.clone())
        .ok_or_else(|| TuneError::NothingCorrect(shape, first_failure.unwrap_or_else(|| "empty search space".into())))?;
    let top = timed.into_iter().take(effort.top.max(1)).map(|(_, m)| m).collect();
    Ok(TuningEntry { shape, best, top, heuristic })
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashsample::{CpuConfig, CpuEngine, Device};
    use flashsample_ir::{DType, Outputs, PipelineBuilder};

    /// A tile change keeps every bit and is timed; an engine change (another dot-product
    /// order) moves some bit and is refused as breaking batch invariance.
    #[test]
    fn configs_that_change_any_bit_are_refused() {
        let p = PipelineBuilder::new("Lse", DType::BF16, DType::BF16)
            .temperature_per_row("t")
            .gumbel("seed", 1)
            .outputs(Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 0 })
            .build()
            .unwrap();
        let sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
        let head = HeadInputs::new(&sampler, 6, 64, 1003).unwrap();
        let inputs = ShapeInputs::new(&p, &head, 6).unwrap();
        let KernelConfig::Cpu(h) = sampler.heuristic_config(6, 64, 1003) else { panic!("a CPU config") };
        let retiled = KernelConfig::Cpu(CpuConfig { vocab_tile: if h.vocab_tile == 64 { 128 } else { 64 }, ..h.clone() });
        assert!(matches!(inputs.measure(&sampler, &retiled, 0, 1), Outcome::Timed(_)));
        let other = if h.engine == CpuEngine::Cranelift { CpuEngine::Avx512Bf16 } else { CpuEngine::Cranelift };
        if other.missing_host_feature().is_none() {
            match inputs.measure(&sampler, &KernelConfig::Cpu(CpuConfig { engine: other, row_block: 1, ..h }), 0, 1) {
                Outcome::Wrong(e) => assert!(e.contains("batch invariance"), "{e}"),
                o => panic!("another engine's bits were accepted: {o:?}"),
            }
        }
    }
}
