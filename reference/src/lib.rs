//! Float64 ground truth for every flashsample IR op.
//!
//! Plain loops, no tiling, no shortcuts: the logits of each row are computed in f64 from
//! the exact values of the bf16/f16/f32 inputs, transformed in pipeline order, perturbed
//! with the same Philox bits every backend uses ([`flashsample_abi::rng::gumbel_f64`]) and
//! maximized. Each result carries an error bound derived from f32 accumulation error, so
//! tests can demand pathwise equality: a backend's sample must be the reference's token
//! unless the top two perturbed scores are closer than the bound.

use flashsample_abi::{
    math::{EXP_MIN_INPUT, TANH_SATURATE},
    rng::{gumbel_f64, noise_bits, GUMBEL_F32_ABS_ERROR},
    ParamError, RowError, RowFilter, SamplingParams,
};
use flashsample_ir::{Pipeline, Transform};
use rayon::prelude::*;

/// A matmul element whose exact value the reference reads.
pub trait ToF64: Copy + Send + Sync {
    fn to_f64(self) -> f64;
}
impl ToF64 for half::bf16 {
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
}
impl ToF64 for half::f16 {
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
}
impl ToF64 for f32 {
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}

/// One launch's inputs, as the reference sees them.
pub struct Problem<'a, H, W> {
    pub pipeline: &'a Pipeline,
    pub hidden: &'a [H],
    pub weights: &'a [W],
    pub batch: usize,
    pub dim: usize,
    pub vocab: usize,
    pub params: &'a SamplingParams<'a>,
}

/// Why the reference could not sample.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ReferenceError {
    #[error(transparent)]
    Param(#[from] ParamError),
    #[error(transparent)]
    Row(#[from] RowError),
    #[error("shape: {0}")]
    Shape(String),
}

/// The reference result of one (row, sample).
#[derive(Clone, Debug, PartialEq)]
pub struct SampleReference {
    pub token: u32,
    /// Highest perturbed score.
    pub score: f64,
    /// Second-highest perturbed score (`-inf` if only one token is allowed).
    pub runner_up: f64,
    /// Transformed logit of `token`.
    pub logit: f64,
    /// Bound on |f32 backend score − f64 score| for any token of this row.
    pub bound: f64,
    /// The row's top-k / min-p / top-p set is not determined robustly: a logit or cumulative
    /// mass at its edge is within the f32 error bound, so an f32 backend may cut a token or two
    /// differently. Then [`check_pathwise`] accepts any token of `possible` that beats `floor`.
    pub ambiguous: bool,
    /// When `ambiguous`: every token an f32 backend may keep, with its reference score.
    pub possible: Vec<(u32, f64)>,
    /// When `ambiguous`: the best score among the tokens every f32 backend keeps.
    pub floor: f64,
}

/// One row's transformed logits, f64, with `-inf` for excluded tokens, and their error bounds.
#[derive(Clone, Debug)]
pub struct RowLogits {
    pub logits: Vec<f64>,
    /// Per token: bound on |f32 transformed logit − f64 transformed logit|.
    pub bounds: Vec<f64>,
    pub greedy: bool,
}

const U: f64 = 1.0 / 16_777_216.0; // f32 unit roundoff, 2^-24
/// The smallest normal f32, 2^-126.
const F32_MIN_NORMAL: f64 = f32::MIN_POSITIVE as f64;

/// Whether `x` is nonzero and below f32's normal range (an f32 subnormal, or smaller).
fn is_subnormal_f32(x: f64) -> bool {
    x != 0.0 && x.abs() < F32_MIN_NORMAL
}

impl<H: ToF64, W: ToF64> Problem<'_, H, W> {
    fn check(&self) -> Result<(), ReferenceError> {
        if self.hidden.len() != self.batch * self.dim || self.weights.len() != self.vocab * self.dim {
            return Err(ReferenceError::Shape(format!(
                "hidden has {} elements, weights {}; expected {}x{} and {}x{}",
                self.hidden.len(),
                self.weights.len(),
                self.batch,
                self.dim,
                self.vocab,
                self.dim
            )));
        }
        self.params.validate(self.pipeline, self.batch, self.vocab)?;
        Ok(())
    }

    /// Transformed logits of `row` (DESIGN.md steps 1–4) with per-token f32 error bounds.
    pub fn row_logits(&self, row: usize) -> Result<RowLogits, ReferenceError> {
        self.check()?;
        let t = self.params.row_temperature(self.pipeline, row);
        let greedy = self.pipeline.is_greedy() || t == 0.0;
        let allowed = self.params.allowed_bitset(self.batch, self.vocab);
        let penalties = self.params.penalties;
        let words = self.vocab.div_ceil(32);
        let h: Vec<f64> = self.hidden[row * self.dim..][..self.dim].iter().map(|x| x.to_f64()).collect();
        // γ_n bound of an n-term f32 dot product in any order (Higham), n = D + 2 for the
        // extra rounding of non-exact products and the final reduction.
        let n = (self.dim + 2) as f64;
        let gamma = n * U / (1.0 - n * U);
        let per_token: Vec<(f64, f64)> = (0..self.vocab)
            .into_par_iter()
            .map(|v| {
                let w = &self.weights[v * self.dim..][..self.dim];
                let (mut raw, mut abs, mut flushed) = (0.0f64, 0.0f64, 0.0f64);
                for (hd, wd) in h.iter().zip(w) {
                    let wd = wd.to_f64();
                    let p = hd * wd;
                    raw += p;
                    abs += p.abs();
                    if is_subnormal_f32(*hd) || is_subnormal_f32(wd) {
                        flushed += p.abs();
                    }
                }
                if !raw.is_finite() {
                    return (f64::NAN, 0.0);
                }
                // Engines that flush subnormals (CPU `vdpbf16ps` tiles, DESIGN.md "CPU matrix
                // engine") drop the products of subnormal inputs and flush at most 2 (D + 2)
                // subnormal products or partial sums (each under 2^-126).
                let daz_ftz = flushed + 2.0 * n * F32_MIN_NORMAL;
                let (mut x, mut err) = (raw, gamma * abs + daz_ftz);
                for tr in &self.pipeline.transforms {
                    match tr {
                        Transform::Temperature(_) if t != 0.0 => {
                            let inv = 1.0 / f64::from(t);
                            err = err * inv * (1.0 + U) + (x * inv).abs() * 3.0 * U;
                            x *= inv;
                        }
                        Transform::Bias { .. } => {
                            x += f64::from(self.params.bias.map_or(0.0, |b| b[v]));
                            err += x.abs() * U;
                        }
                        Transform::Softcap { cap } => {
                            let c = f64::from(cap.get());
                            // c·tanh(x/c) is 1-Lipschitz; tanh_f32 is within 2.5e-7 absolute.
                            err += x.abs() * U + c * (2.5e-7 + 2.0 * U);
                            x = c * (x / c).tanh();
                            // f32 tanh saturates to exactly 1 past TANH_SATURATE.
                            if (x / c).abs() > f64::from(TANH_SATURATE).tanh() {
                                err += c * (1.0 - f64::from(TANH_SATURATE).tanh());
                            }
                        }
                        Transform::Penalties { .. } => {
                            if let Some(p) = penalties {
                                let count: Option<u64> = p.history[row]
                                    .iter()
                                    .filter(|(tok, _)| *tok as usize == v)
                                    .map(|&(_, n)| u64::from(n))
                                    .reduce(|a, b| a + b);
                                if let Some(n) = count {
                                    let rep = f64::from(p.repetition[row]);
                                    let scale = if x > 0.0 { 1.0 / rep } else { rep };
                                    x *= scale;
                                    let sub = f64::from(p.frequency[row]) * n as f64
                                        + if n > 0 { f64::from(p.presence[row]) } else { 0.0 };
                                    err = err * scale + x.abs() * U + 3.0 * sub.abs() * U;
                                    x -= sub;
                                    err += x.abs() * U;
                                }
                            }
                        }
                        _ => {}
                    }
                }
                let ok = allowed.as_ref().is_none_or(|bits| bits[row * words + v / 32] >> (v % 32) & 1 == 1);
                if ok {
                    (x, err)
                } else {
                    (f64::NEG_INFINITY, 0.0)
                }
            })
            .collect();
        if per_token.iter().any(|(x, _)| x.is_nan()) {
            return Err(RowError::NonFinite { row }.into());
        }
        let (logits, bounds) = per_token.into_iter().unzip();
        Ok(RowLogits { logits, bounds, greedy })
    }

    /// The distribution every sampler must draw `row` from: `softmax` of its transformed
    /// logits, restricted to and renormalized over the row's filter set (if any).
    pub fn probabilities(&self, row: usize) -> Result<Vec<f64>, ReferenceError> {
        let rl = self.row_logits(row)?;
        let lse = logsumexp(&rl.logits);
        if lse == f64::NEG_INFINITY {
            return Err(RowError::AllMasked { row }.into());
        }
        let candidates = self.candidate_set(row, &rl);
        let mass = logsumexp(&candidates.kept.iter().map(|&v| rl.logits[v]).collect::<Vec<_>>());
        let mut p = vec![0.0; self.vocab];
        for &v in &candidates.kept {
            p[v] = (rl.logits[v] - mass).exp();
        }
        Ok(p)
    }

    /// The tokens `row` samples among: the allowed ones, then the row's top-k, min-p and top-p
    /// (vLLM's order, DESIGN.md stage three) unless the row is greedy or unfiltered.
    pub fn candidate_set(&self, row: usize, rl: &RowLogits) -> CandidateSet {
        let mut order: Vec<usize> = (0..self.vocab).filter(|&v| rl.logits[v] > f64::NEG_INFINITY).collect();
        let filter = self.params.row_filter(row);
        if rl.greedy || self.pipeline.filter_max_k().is_none() || filter.is_off() {
            let n = order.len();
            return CandidateSet { possible: order.clone(), kept: order, sure: n };
        }
        order.sort_by(|&a, &b| rl.logits[b].total_cmp(&rl.logits[a]).then(a.cmp(&b)));
        filter_sorted(&order, &rl.logits, &rl.bounds, &filter)
    }

    /// Reference samples of `rows` (every sample of each), in order, and their logsumexps.
    pub fn sample_rows(&self, rows: &[usize]) -> Result<(Vec<SampleReference>, Vec<f64>), ReferenceError> {
        let mut out = Vec::new();
        let mut lses = Vec::new();
        for &row in rows {
            let rl = self.row_logits(row)?;
            let lse = logsumexp(&rl.logits);
            if lse == f64::NEG_INFINITY {
                return Err(RowError::AllMasked { row }.into());
            }
            lses.push(lse);
            let candidates = self.candidate_set(row, &rl);
            let (key, stream_row) = self.params.row_stream(row);
            for sample in 0..self.pipeline.samples_per_row() {
                let (mut best, mut second, mut token) = (f64::NEG_INFINITY, f64::NEG_INFINITY, u32::MAX);
                let mut bound = 0.0f64;
                let (mut possible, mut floor) = (Vec::new(), f64::NEG_INFINITY);
                let ambiguous = candidates.is_ambiguous();
                for (j, &v) in candidates.possible.iter().enumerate() {
                    let x = rl.logits[v];
                    let (s, b) = if rl.greedy {
                        (x, rl.bounds[v])
                    } else {
                        let global = v as u32 + self.params.vocab_offset;
                        let g = gumbel_f64(noise_bits(key, stream_row, sample, global));
                        (x + g, rl.bounds[v] + GUMBEL_F32_ABS_ERROR + (x + g).abs() * U)
                    };
                    bound = bound.max(b);
                    if ambiguous {
                        possible.push((v as u32, s));
                        if j < candidates.sure {
                            floor = floor.max(s);
                        }
                    }
                    if j >= candidates.kept.len() {
                        continue;
                    }
                    if s > best {
                        second = best;
                        best = s;
                        token = v as u32;
                    } else if s > second {
                        second = s;
                    }
                }
                out.push(SampleReference {
                    token,
                    score: best,
                    runner_up: second,
                    logit: rl.logits[token as usize],
                    bound,
                    ambiguous,
                    possible,
                    floor,
                });
            }
        }
        Ok((out, lses))
    }

    /// Reference samples for every row.
    pub fn sample_all(&self) -> Result<(Vec<SampleReference>, Vec<f64>), ReferenceError> {
        self.sample_rows(&(0..self.batch).collect::<Vec<_>>())
    }
}

/// The tokens a row samples among, and how far an f32 backend's cut may move.
#[derive(Clone, Debug, PartialEq)]
pub struct CandidateSet {
    /// The set in f64. Most likely first when a filter applied; vocabulary order otherwise.
    pub kept: Vec<usize>,
    /// `kept[..sure]` survives any f32 rounding within the bounds.
    pub sure: usize,
    /// Every token an f32 backend may keep (`kept` is a prefix of it).
    pub possible: Vec<usize>,
}

impl CandidateSet {
    pub fn is_ambiguous(&self) -> bool {
        self.sure != self.kept.len() || self.possible.len() != self.kept.len()
    }
}

/// top-k, then min-p, then top-p over `order` (eligible tokens, most likely first), in f64,
/// with the range of prefix lengths an f32 backend may cut at given the logits' error `b`.
fn filter_sorted(order: &[usize], logits: &[f64], bounds: &[f64], f: &RowFilter) -> CandidateSet {
    let b = order.iter().map(|&v| bounds[v]).fold(0.0, f64::max);
    let x = |j: usize| logits[order[j]];
    let count = |pred: &dyn Fn(f64) -> bool| order.iter().take_while(|&&v| pred(logits[v])).count();
    // Nominal cut `n` and its robust range `lo..=hi`.
    let (mut n, mut lo, mut hi) = (order.len(), order.len(), order.len());
    if f.top_k > 0 && (f.top_k as usize) < n {
        let k = f.top_k as usize;
        n = k;
        lo = count(&|v| v > x(k) + 2.0 * b).min(k);
        hi = count(&|v| v >= x(k - 1) - 2.0 * b).max(k);
    }
    if f.min_p > 0.0 && n > 0 {
        // The f32 threshold adds ln_f32's error (< 1e-6) to the logit's.
        let threshold = x(0) + f64::from(f.min_p).ln();
        let tol = 2.0 * b + 1e-6 * (1.0 + threshold.abs());
        n = n.min(count(&|v| v >= threshold));
        lo = lo.min(count(&|v| v > threshold + tol));
        hi = hi.min(count(&|v| v >= threshold - tol));
    }
    if f.top_p < 1.0 && n > 0 {
        let mass = logsumexp(&order[..n].iter().map(|&v| logits[v]).collect::<Vec<_>>());
        let p = f64::from(f.top_p);
        // Relative error of the f32 cumulative masses: the logits' error, exp_f32, the sum, and
        // the mass an uncertain earlier cut adds or removes.
        let spread = if hi > lo {
            let all = logsumexp(&order[..hi.max(n)].iter().map(|&v| logits[v]).collect::<Vec<_>>());
            let few = logsumexp(&order[..lo.max(1)].iter().map(|&v| logits[v]).collect::<Vec<_>>());
            1.0 - (few - all).exp()
        } else {
            0.0
        };
        let tol = 4.0 * b + (n as f64 + 8.0) * 4.0 * U + spread;
        // Token j is kept iff j == 0 or the mass strictly before it is below p.
        let mut before = Vec::with_capacity(hi.max(n));
        let mut cum = 0.0;
        for j in 0..hi.max(n) {
            before.push(cum);
            cum += (x(j) - mass).exp();
        }
        let cut = |limit: f64| (1..before.len()).take_while(|&j| before[j] < limit).count() + 1;
        n = n.min(cut(p));
        lo = lo.min(cut(p - tol));
        hi = hi.min(cut(p + tol));
    }
    let lo = lo.clamp(1.min(n), n);
    let hi = hi.max(n);
    CandidateSet { kept: order[..n].to_vec(), sure: lo, possible: order[..hi].to_vec() }
}

/// Stable f64 logsumexp; `-inf` entries are skipped, all `-inf` gives `-inf`.
pub fn logsumexp(xs: &[f64]) -> f64 {
    let m = xs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + xs.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
}

/// Tolerance for an f32 backend's logsumexp against [`logsumexp`]: the logit bound plus the
/// rounding of an f32 sum of `vocab` terms and of `exp_f32`'s underflow cut-off.
pub fn logsumexp_tolerance(logit_bound: f64, vocab: usize) -> f64 {
    logit_bound + (vocab as f64 + 8.0) * U + (f64::from(EXP_MIN_INPUT)).exp() * vocab as f64
}

/// A backend's answer for one (row, sample) checked against the reference, pathwise.
pub fn check_pathwise(reference: &SampleReference, token: u32, score: f32) -> Result<(), String> {
    let score = f64::from(score);
    if reference.ambiguous {
        let Some(&(_, want)) = reference.possible.iter().find(|(t, _)| *t == token) else {
            return Err(format!("token {token} is outside every filter set within f32 rounding of the reference's"));
        };
        if (score - want).abs() > reference.bound {
            return Err(format!("token {token}: score {score} vs reference {want} (bound {})", reference.bound));
        }
        if want < reference.floor - 2.0 * reference.bound {
            return Err(format!(
                "token {token} (score {want}) loses to a token every filter set keeps (score {}, bound {})",
                reference.floor, reference.bound
            ));
        }
        return Ok(());
    }
    if (score - reference.score).abs() > reference.bound {
        return Err(format!(
            "score {score} is {} away from the reference maximum {} (bound {})",
            (score - reference.score).abs(),
            reference.score,
            reference.bound
        ));
    }
    let near_tie = reference.score - reference.runner_up <= 2.0 * reference.bound;
    if token != reference.token && !near_tie {
        return Err(format!(
            "token {token} but the reference samples {} (score {}, runner-up {}, bound {})",
            reference.token, reference.score, reference.runner_up, reference.bound
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashsample_abi::TemperatureArg;
    use flashsample_ir::{DType, PipelineBuilder};

    #[test]
    fn greedy_picks_the_largest_logit() {
        let p = PipelineBuilder::new("G", DType::F32, DType::F32).argmax().build().unwrap();
        let hidden = [1.0f32, 2.0];
        let weights = [1.0f32, 0.0, 0.0, 1.0, -1.0, 0.0];
        let params = SamplingParams::default();
        let prob = Problem { pipeline: &p, hidden: &hidden, weights: &weights, batch: 1, dim: 2, vocab: 3, params: &params };
        let (s, lse) = prob.sample_all().unwrap();
        assert_eq!(s[0].token, 1);
        assert_eq!(s[0].score, 2.0);
        let want = (1f64.exp() + 2f64.exp() + (-1f64).exp()).ln();
        assert!((lse[0] - want).abs() < 1e-12);
    }

    #[test]
    fn temperature_zero_row_is_greedy_and_masks_exclude() {
        let p = PipelineBuilder::new("T", DType::F32, DType::F32)
            .temperature_per_row("t")
            .mask("allowed")
            .build()
            .unwrap();
        let hidden = [1.0f32, 1.0];
        let weights = [3.0f32, 2.0, 1.0];
        let temps = [0.0f32, 1.0];
        let mask = [0b110u32, 0b001];
        let params = SamplingParams { temperature: TemperatureArg::PerRow(&temps), mask: Some(&mask), seed: 1, ..Default::default() };
        let prob = Problem { pipeline: &p, hidden: &hidden, weights: &weights, batch: 2, dim: 1, vocab: 3, params: &params };
        let (s, _) = prob.sample_all().unwrap();
        assert_eq!(s[0].token, 1, "greedy over allowed {{1, 2}}");
        assert_eq!(s[1].token, 0, "only token 0 allowed");
        assert_eq!(s[1].runner_up, f64::NEG_INFINITY);
        let all_masked = [0u32, 1];
        let params = SamplingParams { mask: Some(&all_masked), ..params };
        let prob = Problem { params: &params, ..prob };
        assert_eq!(prob.sample_all().unwrap_err(), ReferenceError::Row(RowError::AllMasked { row: 0 }));
    }

    #[test]
    fn filters_and_penalties_follow_vllm() {
        let p = PipelineBuilder::new("F", DType::F32, DType::F32).penalties("pen").filter("f", 4).build().unwrap();
        // Logits 3, 2, 1, 0, -1 for tokens 0..5.
        let hidden = [1.0f32];
        let weights = [3.0f32, 2.0, 1.0, 0.0, -1.0];
        let history = vec![vec![(0u32, 2u32), (4, 0)]];
        let pen = flashsample_abi::PenaltyArg { repetition: &[2.0], presence: &[0.5], frequency: &[0.25], history: &history };
        let filter = [RowFilter { top_k: 3, top_p: 1.0, min_p: 0.0 }];
        let params = SamplingParams { penalties: Some(pen), filter: Some(&filter), ..Default::default() };
        let prob = Problem { pipeline: &p, hidden: &hidden, weights: &weights, batch: 1, dim: 1, vocab: 5, params: &params };
        let rl = prob.row_logits(0).unwrap();
        // Token 0: 3 / 2 − 0.25·2 − 0.5 = 0.5; token 4 (prompt only): −1 · 2 = −2.
        assert_eq!(rl.logits, vec![0.5, 2.0, 1.0, 0.0, -2.0]);
        let set = prob.candidate_set(0, &rl);
        assert_eq!(set.kept, vec![1, 2, 0]);
        let probs = prob.probabilities(0).unwrap();
        assert!(probs[3] == 0.0 && probs[4] == 0.0 && (probs.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        let (s, _) = prob.sample_all().unwrap();
        assert!(set.kept.contains(&(s[0].token as usize)));
    }

    #[test]
    fn nan_hidden_is_an_error() {
        let p = PipelineBuilder::new("N", DType::F32, DType::F32).build().unwrap();
        let params = SamplingParams::default();
        let prob = Problem { pipeline: &p, hidden: &[f32::NAN], weights: &[1.0f32, 2.0], batch: 1, dim: 1, vocab: 2, params: &params };
        assert_eq!(prob.sample_all().unwrap_err(), ReferenceError::Row(RowError::NonFinite { row: 0 }));
    }

    #[test]
    fn pathwise_check_accepts_near_ties_only() {
        let r = SampleReference {
            token: 3,
            score: 1.0,
            runner_up: 0.5,
            logit: 0.0,
            bound: 0.01,
            ambiguous: false,
            possible: vec![],
            floor: f64::NEG_INFINITY,
        };
        assert!(check_pathwise(&r, 3, 1.005).is_ok());
        assert!(check_pathwise(&r, 4, 1.0).is_err());
        assert!(check_pathwise(&r, 3, 1.02).is_err());
        let tie = SampleReference { runner_up: 0.995, ..r };
        assert!(check_pathwise(&tie, 4, 0.999).is_ok());
        // An uncertain cut: token 9 may or may not be kept, token 3 always is.
        let edge = SampleReference { ambiguous: true, possible: vec![(3, 1.0), (9, 1.5)], floor: 1.0, ..r };
        assert!(check_pathwise(&edge, 9, 1.5).is_ok());
        assert!(check_pathwise(&edge, 3, 1.0).is_ok());
        assert!(check_pathwise(&edge, 7, 1.0).is_err());
        let lower = SampleReference { possible: vec![(3, 1.0), (9, 0.5)], ..edge };
        assert!(check_pathwise(&lower, 9, 0.5).is_err(), "9 loses to the always-kept 3");
    }
}
