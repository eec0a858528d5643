//! The measuring loop: for one shape, check every config's output against the float64
//! reference, time the ones that are right, and keep the fastest.

use flashsample::{
    ir::Pipeline,
    tuning::{Measured, ShapeKey, TuningEntry},
    KernelConfig, Sampler,
};
use flashsample_tests::Case;

/// How hard to measure.
#[derive(Clone, Copy, Debug)]
pub struct Effort {
    pub warmup: usize,
    pub reps: usize,
    pub top: usize,
}

/// A config that was compiled and run, and what came of it.
#[derive(Clone, Debug)]
pub enum Outcome {
    Timed(Measured),
    /// Failed to compile or launch (the message says why).
    Failed(String),
    /// Ran, but its samples disagreed with the reference.
    Wrong(String),
}

#[derive(Debug, thiserror::Error)]
pub enum TuneError {
    #[error("no config produced correct samples at {0:?}; first failure: {1}")]
    NothingCorrect(ShapeKey, String),
    #[error(transparent)]
    Runtime(#[from] flashsample::Error),
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

fn measure(sampler: &Sampler, pipeline: &Pipeline, case: &Case, config: &KernelConfig, effort: Effort) -> Outcome {
    let samples = match case.run_with(sampler, config) {
        Ok(s) => s,
        Err(e) => return Outcome::Failed(e.to_string()),
    };
    if let Err(e) = case.check(pipeline, &samples, &checked_rows(case.batch)) {
        return Outcome::Wrong(e);
    }
    match case.median_secs(sampler, config, effort.warmup, effort.reps) {
        Ok(s) => Outcome::Timed(Measured { config: to_json(config), median_us: s * 1e6 }),
        Err(e) => Outcome::Failed(e.to_string()),
    }
}

/// Tunes one shape over `space`; `on_config` is called after each config (progress).
pub fn tune_shape(
    sampler: &Sampler,
    shape: ShapeKey,
    space: &[KernelConfig],
    effort: Effort,
    mut on_config: impl FnMut(&KernelConfig, &Outcome),
) -> Result<TuningEntry, TuneError> {
    let pipeline = sampler.pipeline().clone();
    let case = Case::random(&pipeline, shape.batch, shape.dim, shape.vocab, 0x7075_6e65, 4.0);
    let heuristic_config = sampler.heuristic_config(shape.batch, shape.dim, shape.vocab);
    let mut timed: Vec<Measured> = Vec::new();
    let mut first_failure = None;
    let mut heuristic = None;
    for config in space {
        let outcome = measure(sampler, &pipeline, &case, config, effort);
        on_config(config, &outcome);
        match &outcome {
            Outcome::Timed(m) => {
                if *config == heuristic_config {
                    heuristic = Some(m.clone());
                }
                timed.push(m.clone());
            }
            Outcome::Failed(e) | Outcome::Wrong(e) => {
                first_failure.get_or_insert_with(|| e.clone());
            }
        }
    }
    let heuristic = match heuristic {
        Some(h) => h,
        None => match measure(sampler, &pipeline, &case, &heuristic_config, effort) {
            Outcome::Timed(m) => m,
            // Recorded as NaN so the table shows the heuristic failed here.
            Outcome::Failed(_) | Outcome::Wrong(_) => Measured { config: to_json(&heuristic_config), median_us: f64::NAN },
        },
    };
    timed.sort_by(|a, b| a.median_us.total_cmp(&b.median_us));
    let best = timed
        .first()
        .cloned()
        .ok_or_else(|| TuneError::NothingCorrect(shape, first_failure.unwrap_or_else(|| "empty search space".into())))?;
    timed.truncate(effort.top.max(1));
    Ok(TuningEntry { shape, best, top: timed, heuristic })
}
