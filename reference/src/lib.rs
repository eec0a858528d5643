//! Float64 ground truth for every flashsample IR op.
//!
//! Plain loops, no tiling, no shortcuts: the logits of each row are computed in f64 from
//! the exact values of the bf16/f16/f32 inputs, transformed in pipeline order, perturbed
//! with the same Philox bits every backend uses ([`flashsample_abi::rng::gumbel_f64`]) and
//! maximized. Each token's score carries an error bound derived from f32 accumulation error,
//! so tests can demand pathwise equality: a backend's sample must be the reference's token
//! unless another token's score is within both tokens' bounds of it.
//!
//! Where the f32 semantics (DESIGN.md) are not those of real arithmetic, the reference
//! follows f32: a transformed logit past f32's range is `±inf` (`+inf` on an allowed token
//! fails the row with `RowError::NonFinite`; `-inf`, or NaN from `+inf` meeting a `-inf`
//! bias, excludes the token), and a softcap whose argument is past
//! `abi::math::TANH_SATURATE` is exactly `abi::math::softcap_f32`'s saturated value.

use flashsample_abi::{
    filter::blocked_sum_depth,
    math::{softcap_f32, EXP_MIN_INPUT, TANH_SATURATE},
    rng::{gumbel_f64, noise_bits, GUMBEL_F32_ABS_ERROR},
    ParamError, RowError, RowFilter, SamplingParams,
};
use flashsample_ir::{LogprobMode, Pipeline, Transform};
use rayon::prelude::*;

mod speculative;
pub use speculative::{SpecOutcome, SpecReferenceError};

/// A matmul element whose exact value the reference reads.
pub trait ToF64: Copy + Send + Sync {
    /// The element's exact value.
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
    /// The pipeline to evaluate.
    pub pipeline: &'a Pipeline,
    /// `[batch, dim]` hidden states.
    pub hidden: &'a [H],
    /// `[vocab, dim]` LM-head weights.
    pub weights: &'a [W],
    /// Rows of `hidden`.
    pub batch: usize,
    /// Hidden size.
    pub dim: usize,
    /// Rows of `weights`.
    pub vocab: usize,
    /// The launch's run-time parameters.
    pub params: &'a SamplingParams<'a>,
}

/// Why the reference could not sample.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ReferenceError {
    /// The parameters do not fit the pipeline (the backends reject them the same way).
    #[error(transparent)]
    Param(#[from] ParamError),
    /// A row cannot be sampled (all masked, or non-finite logits).
    #[error(transparent)]
    Row(#[from] RowError),
    /// The matrices do not have the stated shapes.
    #[error("shape: {0}")]
    Shape(String),
}

/// One token's perturbed score and the bound on an f32 backend's error in it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoredToken {
    /// Vocabulary index.
    pub token: u32,
    /// Perturbed score in f64 (the transformed logit for greedy rows).
    pub score: f64,
    /// Bound on |f32 backend score − `score`|.
    pub bound: f64,
}

impl ScoredToken {
    /// Whether an f32 backend's score for this token may exceed one of `other`'s.
    fn may_beat(&self, other: &ScoredToken) -> bool {
        self.score + self.bound > other.score - other.bound
    }
}

/// The reference result of one (row, sample).
#[derive(Clone, Debug, PartialEq)]
pub struct SampleReference {
    /// The sampled token.
    pub token: u32,
    /// Highest perturbed score.
    pub score: f64,
    /// Second-highest perturbed score (`-inf` if only one token is allowed).
    pub runner_up: f64,
    /// Transformed logit of `token`.
    pub logit: f64,
    /// Bound on |f32 backend score − f64 score| of `token` (and on its logit).
    pub bound: f64,
    /// The other tokens whose f32 score may beat `token`'s (near-ties within both bounds):
    /// [`check_pathwise`] accepts them too, and no other token.
    pub contenders: Vec<ScoredToken>,
    /// Bound on |f32 logsumexp − f64 logsumexp| of the row from its logits' errors (see
    /// [`logsumexp_tolerance`] for the summation's own error).
    pub lse_bound: f64,
    /// The row's top-k / min-p / top-p set is not determined robustly: a logit or cumulative
    /// mass at its edge is within the f32 error bound, so an f32 backend may cut a token or two
    /// differently. Then [`check_pathwise`] accepts any token of `possible` that may beat `floor`.
    pub ambiguous: bool,
    /// When `ambiguous`: every token an f32 backend may keep.
    pub possible: Vec<ScoredToken>,
    /// When `ambiguous`: the lowest f32 score the best of the tokens every f32 backend keeps
    /// may have (`-inf` if no token is kept by every cut).
    pub floor: f64,
}

impl SampleReference {
    /// Tolerance for an f32 backend's logprob of `token`: its logit's bound, the row
    /// logsumexp's, and the rounding of the difference.
    pub fn logprob_tolerance(&self, lse: f64, vocab: usize) -> f64 {
        self.bound + logsumexp_tolerance(self.lse_bound, vocab) + 2.0 * U * (self.logit - lse).abs()
    }
}

/// One row's transformed logits, f64, with `-inf` for excluded tokens, and their error bounds.
#[derive(Clone, Debug)]
pub struct RowLogits {
    /// Per token: the transformed logit, `-inf` if excluded.
    pub logits: Vec<f64>,
    /// Per token: bound on |f32 transformed logit − f64 transformed logit|.
    pub bounds: Vec<f64>,
    /// The row is sampled by argmax (greedy sampler, or temperature 0).
    pub greedy: bool,
}

const U: f64 = 1.0 / 16_777_216.0; // f32 unit roundoff, 2^-24
/// The smallest normal f32, 2^-126.
const F32_MIN_NORMAL: f64 = f32::MIN_POSITIVE as f64;

/// Whether `x` is nonzero and below f32's normal range (an f32 subnormal, or smaller).
fn is_subnormal_f32(x: f64) -> bool {
    x != 0.0 && x.abs() < F32_MIN_NORMAL
}

/// Magnitude from which round-to-nearest f32 gives ±inf: `f32::MAX` plus half its ulp.
const F32_OVERFLOW: f64 = 340_282_356_779_733_661_637_539_395_458_142_568_448.0;

/// `x` as f32 arithmetic would hold it: `±inf` past f32's range.
fn f32_range(x: f64) -> f64 {
    if x.abs() >= F32_OVERFLOW {
        f64::INFINITY.copysign(x)
    } else {
        x
    }
}

/// One token's transformed logit in f64 and its error bound, before masking.
enum TokenLogit {
    /// The matmul gave NaN or ±inf: the row fails (DESIGN.md step 2).
    RawNonFinite,
    /// The transformed logit (possibly ±inf or NaN after an f32 overflow) and its bound.
    Value(f64, f64),
}

/// `cap · tanh(x / cap)` as `abi::math::softcap_f32` computes it from an f32 `x` within `err`
/// of `x`: past `TANH_SATURATE` f32 holds exactly the saturated value, whose error is then 0.
fn softcap(x: f64, err: f64, cap: f32) -> (f64, f64) {
    let c = f64::from(cap);
    let saturate = f64::from(TANH_SATURATE);
    if x.is_nan() {
        return (x, 0.0);
    }
    // f32 division is monotone and 9 is an f32, so the f32 quotient is past 9 iff the exact
    // quotient of the f32 logit is.
    if (x.abs() - err) / c >= saturate {
        return (f64::from(softcap_f32(f32::INFINITY, cap)).copysign(x), 0.0);
    }
    let y = c * (x / c).tanh();
    // The slope of c·tanh(x/c) is at most sech² at the interval's point nearest 0; it scales
    // the logit's error and the division's rounding. tanh_f32 is within 2.5e-7 absolute; then
    // the product's rounding.
    let slope = 1.0 - ((x.abs() - err).max(0.0) / c).tanh().powi(2);
    let mut e = slope * (err + x.abs() * U) + c * (2.5e-7 + 2.0 * U);
    if (x.abs() + err) / c >= saturate {
        // The f32 quotient may saturate: then f32 holds the saturated value instead.
        e += (f64::from(softcap_f32(f32::INFINITY, cap)) - y.abs()).abs();
    }
    (y, e)
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
        self.logits_in(row, LogprobMode::Processed)
    }

    /// Raw logits of `row` (DESIGN.md "Logprob modes", `abi::raw`): the matmul with only the
    /// model's transforms (`Transform::is_model`), every token counted whatever the masks say,
    /// with their f32 error bounds. A raw `+inf` (an f32 overflow on a token the processed
    /// path excludes) does not count, as `abi::LseTerm::of` drops it. `greedy` is the row's.
    pub fn raw_row_logits(&self, row: usize) -> Result<RowLogits, ReferenceError> {
        self.logits_in(row, LogprobMode::Raw)
    }

    /// The logits the pipeline's logprob outputs describe: [`Self::raw_row_logits`] in the
    /// raw mode, [`Self::row_logits`] otherwise.
    pub fn reported_logits(&self, row: usize) -> Result<RowLogits, ReferenceError> {
        self.logits_in(row, self.pipeline.logprob_mode)
    }

    /// The f64 logsumexp of the logits the logprob outputs describe ([`Self::reported_logits`])
    /// and the bound on its error from theirs (for [`logsumexp_tolerance`]).
    pub fn reported_logsumexp(&self, row: usize) -> Result<(f64, f64), ReferenceError> {
        let rl = self.reported_logits(row)?;
        let lse = logsumexp(&rl.logits);
        Ok((lse, logsumexp_bound(&rl, lse)))
    }

    /// The f64 logprob of `token` in the logprob outputs' distribution ([`Self::reported_logits`]),
    /// given that distribution's logsumexp and its bound ([`Self::reported_logsumexp`]), and the
    /// tolerance an f32 backend's value must meet: `(-inf, 0)` for a token the distribution
    /// excludes.
    pub fn reported_logprob(&self, row: usize, token: u32, lse: f64, lse_bound: f64) -> Result<(f64, f64), ReferenceError> {
        let rl = self.reported_logits(row)?;
        let (x, b) = (rl.logits[token as usize], rl.bounds[token as usize]);
        if x == f64::NEG_INFINITY {
            return Ok((x, 0.0));
        }
        let want = x - lse;
        Ok((want, b + logsumexp_tolerance(lse_bound, self.vocab) + 2.0 * U * want.abs()))
    }

    /// The ranks an f32 backend may report for row `row`'s scored token (DESIGN.md step 7c):
    /// `rank = #{v < V : y_v ≥ y_t}` over the logits the logprob outputs describe
    /// ([`Self::reported_logits`]), as an inclusive range `(lo, hi)`. A token counts surely
    /// when its f64 logit is at least the target's after both move by their bounds against
    /// each other, possibly when their intervals meet; the target itself always counts, and an
    /// excluded target (`-inf`) has rank `V` exactly.
    pub fn target_rank(&self, row: usize) -> Result<(u32, u32), ReferenceError> {
        let rl = self.reported_logits(row)?;
        let t = self.params.targets.map_or(0, |t| t[row]) as usize;
        let (yt, bt) = (rl.logits[t], rl.bounds[t]);
        if yt == f64::NEG_INFINITY {
            return Ok((self.vocab as u32, self.vocab as u32));
        }
        let (mut lo, mut hi) = (1u32, 1u32);
        for (v, (&y, &b)) in rl.logits.iter().zip(&rl.bounds).enumerate() {
            if v == t || y == f64::NEG_INFINITY {
                continue;
            }
            lo += u32::from(y - b >= yt + bt);
            hi += u32::from(y + b >= yt - bt);
        }
        Ok((lo, hi))
    }

    /// [`Self::row_logits`] or [`Self::raw_row_logits`].
    fn logits_in(&self, row: usize, mode: LogprobMode) -> Result<RowLogits, ReferenceError> {
        let raw_mode = mode == LogprobMode::Raw;
        self.check()?;
        let t = self.params.row_temperature(self.pipeline, row);
        let greedy = self.pipeline.is_greedy() || t == 0.0;
        let allowed = self.params.allowed_bitset(self.batch, self.vocab);
        let penalties = self.params.penalties;
        let logit_bias = self.params.logit_bias;
        let words = self.vocab.div_ceil(32);
        let h: Vec<f64> = self.hidden[row * self.dim..][..self.dim].iter().map(|x| x.to_f64()).collect();
        // γ_n bound of an n-term f32 dot product in any order (Higham), n = D + 2 for the
        // extra rounding of non-exact products and the final reduction.
        let n = (self.dim + 2) as f64;
        let gamma = n * U / (1.0 - n * U);
        let per_token: Vec<TokenLogit> = (0..self.vocab)
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
                if !f32_range(raw).is_finite() {
                    return TokenLogit::RawNonFinite;
                }
                // Engines that flush subnormals (CPU `vdpbf16ps` tiles, DESIGN.md "CPU matrix
                // engine") drop the products of subnormal inputs and flush at most 2 (D + 2)
                // subnormal products or partial sums (each under 2^-126).
                let daz_ftz = flushed + 2.0 * n * F32_MIN_NORMAL;
                let (mut x, mut err) = (raw, gamma * abs + daz_ftz);
                for tr in self.pipeline.transforms.iter().filter(|t| !raw_mode || t.is_model()) {
                    match tr {
                        Transform::Temperature(_) if t != 0.0 => {
                            let inv = 1.0 / f64::from(t);
                            err = err * inv * (1.0 + U) + (x * inv).abs() * 3.0 * U;
                            x = f32_range(x * inv);
                        }
                        Transform::Bias { .. } => {
                            x = f32_range(x + f64::from(self.params.bias.map_or(0.0, |b| b[v])));
                            err += x.abs() * U;
                        }
                        Transform::LogitBias { .. } => {
                            // `validate` rejected duplicates, so at most one entry matches.
                            let bias = logit_bias.and_then(|rows| rows[row].iter().find(|&&(tok, _)| tok as usize == v));
                            if let Some(&(_, b)) = bias {
                                x = f32_range(x + f64::from(b));
                                err += x.abs() * U;
                            }
                        }
                        Transform::Softcap { cap } => (x, err) = softcap(x, err, cap.get()),
                        Transform::Penalties { .. } => {
                            if let Some(p) = penalties {
                                // Repeated (token, count) pairs add up; `validate` rejected sums
                                // that overflow.
                                let count: Option<u64> = p.history[row]
                                    .iter()
                                    .filter(|(tok, _)| *tok as usize == v)
                                    .map(|&(_, n)| u64::from(n))
                                    .reduce(|a, b| a.saturating_add(b));
                                if let Some(n) = count {
                                    let rep = f64::from(p.repetition[row]);
                                    let scale = if x > 0.0 { 1.0 / rep } else { rep };
                                    x = f32_range(x * scale);
                                    let frequency = f64::from(p.frequency[row]) * n as f64;
                                    let presence = if n > 0 { f64::from(p.presence[row]) } else { 0.0 };
                                    // The host's f32 `frequency · count + presence`: three roundings.
                                    err = err * scale + x.abs() * U + 3.0 * (frequency.abs() + presence.abs()) * U;
                                    x = f32_range(x - (frequency + presence));
                                    err += x.abs() * U;
                                }
                            }
                        }
                        _ => {}
                    }
                    if x.is_infinite() || x.is_nan() {
                        // f32 holds exactly this value too (up to the edge of f32's range).
                        err = 0.0;
                    }
                }
                let ok = raw_mode || allowed.as_ref().is_none_or(|bits| bits[row * words + v / 32] >> (v % 32) & 1 == 1);
                if raw_mode && x == f64::INFINITY {
                    TokenLogit::Value(f64::NEG_INFINITY, 0.0)
                } else if ok {
                    TokenLogit::Value(x, err)
                } else {
                    TokenLogit::Value(f64::NEG_INFINITY, 0.0)
                }
            })
            .collect();
        let mut logits = Vec::with_capacity(self.vocab);
        let mut bounds = Vec::with_capacity(self.vocab);
        for token in per_token {
            match token {
                TokenLogit::RawNonFinite => return Err(RowError::NonFinite { row }.into()),
                // An allowed token overflowed to +inf: its score wins and is not finite.
                TokenLogit::Value(x, _) if x == f64::INFINITY => return Err(RowError::NonFinite { row }.into()),
                // NaN only from +inf meeting a -inf bias: excluded, as the kernels' `x > -inf` test does.
                TokenLogit::Value(x, _) if x.is_nan() => {
                    logits.push(f64::NEG_INFINITY);
                    bounds.push(0.0);
                }
                TokenLogit::Value(x, e) => {
                    logits.push(x);
                    bounds.push(e);
                }
            }
        }
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
        if !filter.is_drawn_in_stage_three(rl.greedy) || self.pipeline.filter_max_k().is_none() {
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
            let lse_bound = logsumexp_bound(&rl, lse);
            let candidates = self.candidate_set(row, &rl);
            let ambiguous = candidates.is_ambiguous();
            let (key, stream_row) = self.params.row_stream(row);
            let step = self.params.row_step(row);
            for sample in 0..self.pipeline.samples_per_row() {
                let scored: Vec<ScoredToken> = candidates
                    .possible
                    .iter()
                    .map(|&v| {
                        let x = rl.logits[v];
                        let (score, bound) = if rl.greedy {
                            (x, rl.bounds[v])
                        } else {
                            let global = v as u32 + self.params.vocab_offset;
                            let g = gumbel_f64(noise_bits(key, stream_row, sample, global, step));
                            (x + g, rl.bounds[v] + GUMBEL_F32_ABS_ERROR + (x + g).abs() * U)
                        };
                        ScoredToken { token: v as u32, score, bound }
                    })
                    .collect();
                // The f64 sample: the best kept token, ties to the first (the lower index).
                let kept = &scored[..candidates.kept.len()];
                let mut best = 0;
                for (j, c) in kept.iter().enumerate() {
                    if c.score > kept[best].score || (c.score == kept[best].score && c.token < kept[best].token) {
                        best = j;
                    }
                }
                let winner = kept[best];
                let runner_up =
                    kept.iter().enumerate().filter(|&(j, _)| j != best).map(|(_, c)| c.score).fold(f64::NEG_INFINITY, f64::max);
                let contenders =
                    kept.iter().enumerate().filter(|&(j, c)| j != best && c.may_beat(&winner)).map(|(_, c)| *c).collect();
                let floor = scored[..candidates.sure].iter().map(|c| c.score - c.bound).fold(f64::NEG_INFINITY, f64::max);
                out.push(SampleReference {
                    token: winner.token,
                    score: winner.score,
                    runner_up,
                    logit: rl.logits[winner.token as usize],
                    bound: winner.bound,
                    contenders,
                    lse_bound,
                    ambiguous,
                    possible: if ambiguous { scored } else { Vec::new() },
                    floor: if ambiguous { floor } else { f64::NEG_INFINITY },
                });
            }
        }
        Ok((out, lses))
    }

    /// The float64 log-probability of row `row`'s scored token (`params.targets[row]`, DESIGN.md
    /// step 7b) given the row's reference logsumexp and its bound, and the tolerance an f32
    /// backend's value must meet: `(-inf, 0)` for a target the pipeline excludes.
    /// In the raw mode the target's raw logit and `lse` the raw logsumexp
    /// ([`Self::reported_logsumexp`]).
    pub fn target_logprob(&self, row: usize, lse: f64, lse_bound: f64) -> Result<(f64, f64), ReferenceError> {
        self.reported_logprob(row, self.params.targets.map_or(0, |t| t[row]), lse, lse_bound)
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
    /// Whether an f32 backend may cut differently than `kept`.
    pub fn is_ambiguous(&self) -> bool {
        self.sure != self.kept.len() || self.possible.len() != self.kept.len()
    }
}

/// top-k, then min-p, then top-p over `order` (eligible tokens, most likely first), in f64,
/// with the range of prefix lengths an f32 backend may cut at given the logits' errors.
fn filter_sorted(order: &[usize], logits: &[f64], bounds: &[f64], f: &RowFilter) -> CandidateSet {
    let (n, _, _) = cuts(order, logits, f, 0.0);
    let b = cut_bound(order, logits, bounds, n);
    let (n, lo, hi) = cuts(order, logits, f, b);
    CandidateSet { kept: order[..n].to_vec(), sure: lo, possible: order[..hi].to_vec() }
}

/// The largest logit error among the tokens that can reach the f64 cut after `n` tokens: the
/// kept ones, the first dropped one, and any below it whose interval reaches it. A token far
/// below (a heavily penalized one, whose bound is large) cannot move the cut.
fn cut_bound(order: &[usize], logits: &[f64], bounds: &[f64], n: usize) -> f64 {
    let Some(last) = order.len().checked_sub(1).map(|l| n.min(l)) else { return 0.0 };
    let near = order[..=last].iter().map(|&v| bounds[v]).fold(0.0, f64::max);
    let edge = logits[order[last]] - 2.0 * near;
    order[last + 1..].iter().filter(|&&v| logits[v] + bounds[v] >= edge).map(|&v| bounds[v]).fold(near, f64::max)
}

/// The f64 cut `n` of `order` under `f` and the range `lo..=hi` of cuts an f32 backend may
/// make when every logit may be off by `b`: `order[..lo]` is kept by every such backend,
/// nothing past `order[..hi]` by any.
fn cuts(order: &[usize], logits: &[f64], f: &RowFilter, b: f64) -> (usize, usize, usize) {
    let x = |j: usize| logits[order[j]];
    // `order` is sorted by logit, descending: counts of a prefix are binary searches.
    let above = |t: f64| order.partition_point(|&v| logits[v] > t);
    let at_least = |t: f64| order.partition_point(|&v| logits[v] >= t);
    let len = order.len();
    let (mut n, mut lo, mut hi) = (len, len, len);
    if f.top_k > 0 && (f.top_k as usize) < n {
        let k = f.top_k as usize;
        n = k;
        if b == 0.0 {
            // The f32 logits are these exactly (e.g. all saturated by a softcap): f32 ranks
            // them as `order` does, ties to the lower token.
            (lo, hi) = (k, k);
        } else {
            lo = above(x(k) + 2.0 * b).min(k);
            hi = at_least(x(k - 1) - 2.0 * b).max(k);
        }
    }
    if f.min_p > 0.0 && n > 0 {
        // The f32 threshold adds ln_f32's error (< 1e-6) to the logit's.
        let threshold = x(0) + f64::from(f.min_p).ln();
        let tol = 2.0 * b + 1e-6 * (1.0 + threshold.abs());
        n = n.min(at_least(threshold));
        lo = lo.min(above(threshold + tol));
        hi = hi.min(at_least(threshold - tol));
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
        // The f32 sums run in `abi::filter::BlockedMass` order: any prefix is a sum of depth
        // `blocked_sum_depth`, not of its length (they agree up to 1024 entries).
        let tol = 4.0 * b + (blocked_sum_depth(hi.max(n)) as f64 + 8.0) * 4.0 * U + spread;
        let limit = hi.max(n);
        // cum[i]: mass of order[..i], relative to the f64 set's.
        let mut cum = vec![0.0; limit + 1];
        for j in 0..limit {
            cum[j + 1] = cum[j] + (x(j) - mass).exp();
        }
        // Token j is kept iff it is first or the mass ranked before it is below p. In f32 the
        // tokens within 2b of x(j) may rank on either side of it.
        n = n.min(1 + (1..n).take_while(|&j| cum[j] < p).count());
        let surely_before = |j: usize| cum[above(x(j) + 2.0 * b).min(limit)];
        let maybe_before = |j: usize| cum[at_least(x(j) - 2.0 * b).min(limit)] - (x(j) - mass).exp();
        hi = hi.min((0..limit).take_while(|&j| surely_before(j) < p + tol).count().max(1));
        lo = lo.min((0..limit).take_while(|&j| maybe_before(j) < p - tol).count());
    }
    // Every cut keeps the f32 maximum: when that is clearly order[0], order[0] is always kept.
    if len == 1 || (len > 1 && x(0) - x(1) > 2.0 * b) {
        lo = lo.max(1);
    }
    (n, lo.min(n), hi.max(n))
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

/// Bound on |f32 logsumexp − f64 logsumexp| of a row from its logits' errors alone:
/// `lse(x ± b) − lse(x)` for per-token bounds `b`, so a token with a large bound but no mass
/// (a heavily penalized one) does not loosen it.
fn logsumexp_bound(rl: &RowLogits, lse: f64) -> f64 {
    let shifted = |sign: f64| -> Vec<f64> { rl.logits.iter().zip(&rl.bounds).map(|(x, b)| x + sign * b).collect() };
    let up = logsumexp(&shifted(1.0)) - lse;
    let down = lse - logsumexp(&shifted(-1.0));
    up.max(down).max(0.0)
}

/// A backend's answer for one (row, sample) checked against the reference, pathwise: the
/// reference's token, or a contender whose f32 score may beat it, with its score within bound.
pub fn check_pathwise(reference: &SampleReference, token: u32, score: f32) -> Result<(), String> {
    let score = f64::from(score);
    let within = |want: &ScoredToken| -> Result<(), String> {
        if (score - want.score).abs() > want.bound {
            return Err(format!(
                "token {token}: score {score} is {} away from the reference's {} (bound {})",
                (score - want.score).abs(),
                want.score,
                want.bound
            ));
        }
        Ok(())
    };
    if reference.ambiguous {
        let Some(want) = reference.possible.iter().find(|c| c.token == token) else {
            return Err(format!("token {token} is outside every filter set within f32 rounding of the reference's"));
        };
        within(want)?;
        if want.score + want.bound < reference.floor {
            return Err(format!(
                "token {token} (score {} ± {}) loses to a token every filter set keeps (score at least {})",
                want.score, want.bound, reference.floor
            ));
        }
        return Ok(());
    }
    let winner = ScoredToken { token: reference.token, score: reference.score, bound: reference.bound };
    if token == reference.token {
        return within(&winner);
    }
    match reference.contenders.iter().find(|c| c.token == token) {
        Some(c) => within(c),
        None => Err(format!(
            "token {token} but the reference samples {} (score {} ± {}, runner-up {}); token {token} cannot beat it within f32 rounding",
            reference.token, reference.score, reference.bound, reference.runner_up
        )),
    }
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
    fn logit_bias_comes_before_penalties_and_temperature_and_bans_with_neg_inf() {
        let p = PipelineBuilder::new("L", DType::F32, DType::F32)
            .logit_bias("lb")
            .penalties("pen")
            .temperature_per_row("t")
            .build()
            .unwrap();
        // Logits 3, 2, 1, 0 for tokens 0..4; two rows of the same logits.
        let hidden = [1.0f32, 1.0];
        let weights = [3.0f32, 2.0, 1.0, 0.0];
        let history = vec![vec![(1u32, 1u32)], vec![]];
        let pen = flashsample_abi::PenaltyArg { repetition: &[2.0, 1.0], presence: &[0.0; 2], frequency: &[0.0; 2], history: &history };
        let lb = vec![vec![(1u32, 2.0f32), (0, f32::NEG_INFINITY)], vec![]];
        let temps = [0.5f32, 0.5];
        let params = SamplingParams {
            logit_bias: Some(&lb),
            penalties: Some(pen),
            temperature: TemperatureArg::PerRow(&temps),
            ..Default::default()
        };
        let prob = Problem { pipeline: &p, hidden: &hidden, weights: &weights, batch: 2, dim: 1, vocab: 4, params: &params };
        // Row 0, token 1: (2 + 2) / 2 (repetition) / 0.5 = 4; token 0 banned.
        assert_eq!(prob.row_logits(0).unwrap().logits, vec![f64::NEG_INFINITY, 4.0, 2.0, 0.0]);
        // Row 1 has no bias of its own.
        assert_eq!(prob.row_logits(1).unwrap().logits, vec![6.0, 4.0, 2.0, 0.0]);
        let all_banned: Vec<Vec<(u32, f32)>> = vec![(0..4).map(|t| (t, f32::NEG_INFINITY)).collect(), vec![]];
        let params = SamplingParams { logit_bias: Some(&all_banned), ..params };
        let prob = Problem { params: &params, ..prob };
        assert_eq!(prob.sample_all().unwrap_err(), ReferenceError::Row(RowError::AllMasked { row: 0 }));
    }

    #[test]
    fn raw_logits_keep_the_model_transforms_and_every_token() {
        // Logits 3, 2, 1, 0; the model's bias and softcap apply, the request's do not.
        let p = PipelineBuilder::new("R", DType::F32, DType::F32)
            .softcap(2.5)
            .bias("b")
            .logit_bias("lb")
            .penalties("pen")
            .temperature_per_row("t")
            .mask("m")
            .outputs(flashsample_ir::Outputs { logprob: true, ..Default::default() })
            .logprob_mode(LogprobMode::Raw)
            .build()
            .unwrap();
        let weights = [3.0f32, 2.0, 1.0, 0.0];
        let bias = [0.5f32, 0.0, f32::NEG_INFINITY, 0.0];
        let lb = vec![vec![(1u32, 4.0f32)]];
        let history = vec![vec![(0u32, 3u32)]];
        let pen = flashsample_abi::PenaltyArg { repetition: &[1.5], presence: &[0.5], frequency: &[0.5], history: &history };
        let params = SamplingParams {
            bias: Some(&bias),
            logit_bias: Some(&lb),
            penalties: Some(pen),
            temperature: TemperatureArg::PerRow(&[0.5]),
            mask: Some(&[0b0011]),
            ..Default::default()
        };
        let prob = logits_problem(&p, &weights, &params);
        let cap = |x: f64| 2.5 * (x / 2.5).tanh();
        let raw = prob.raw_row_logits(0).unwrap();
        assert_eq!(raw.logits[2], f64::NEG_INFINITY, "the model's -inf bias excludes token 2");
        for (v, x) in [(0, cap(3.0) + 0.5), (1, cap(2.0)), (3, 0.0)] {
            assert!((raw.logits[v] - x).abs() < 1e-6, "token {v}: {}", raw.logits[v]);
        }
        // Token 3 is masked but keeps its raw mass; the processed logits exclude it.
        assert_eq!(prob.row_logits(0).unwrap().logits[3], f64::NEG_INFINITY);
        let (lse, _) = prob.reported_logsumexp(0).unwrap();
        assert!((lse - logsumexp(&raw.logits)).abs() < 1e-15);
        let (lp, tol) = prob.reported_logprob(0, 3, lse, 0.0).unwrap();
        assert!((lp + lse).abs() < 1e-12 && tol > 0.0);
        // The sample still comes from the processed distribution: the logit-biased token 1.
        let (s, _) = prob.sample_all().unwrap();
        assert!(s[0].token == 0 || s[0].token == 1);
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
            contenders: vec![],
            lse_bound: 0.0,
            ambiguous: false,
            possible: vec![],
            floor: f64::NEG_INFINITY,
        };
        assert!(check_pathwise(&r, 3, 1.005).is_ok());
        assert!(check_pathwise(&r, 4, 1.0).is_err());
        assert!(check_pathwise(&r, 3, 1.02).is_err());
        let tie = SampleReference { contenders: vec![ScoredToken { token: 4, score: 0.995, bound: 0.01 }], ..r.clone() };
        assert!(check_pathwise(&tie, 4, 0.999).is_ok());
        assert!(check_pathwise(&tie, 4, 1.01).is_err(), "a contender's score is checked against its own");
        // An uncertain cut: token 9 may or may not be kept, token 3 always is.
        let st = |token, score| ScoredToken { token, score, bound: 0.01 };
        let edge = SampleReference { ambiguous: true, possible: vec![st(3, 1.0), st(9, 1.5)], floor: 0.99, ..r.clone() };
        assert!(check_pathwise(&edge, 9, 1.5).is_ok());
        assert!(check_pathwise(&edge, 3, 1.0).is_ok());
        assert!(check_pathwise(&edge, 7, 1.0).is_err());
        let lower = SampleReference { possible: vec![st(3, 1.0), st(9, 0.5)], ..edge };
        assert!(check_pathwise(&lower, 9, 0.5).is_err(), "9 loses to the always-kept 3");
    }

    /// One logit per token (`D = 1`, hidden 1) under `pipeline`.
    fn logits_problem<'a>(pipeline: &'a Pipeline, weights: &'a [f32], params: &'a SamplingParams<'a>) -> Problem<'a, f32, f32> {
        Problem { pipeline, hidden: &[1.0], weights, batch: 1, dim: 1, vocab: weights.len(), params }
    }

    #[test]
    fn a_huge_penalty_does_not_loosen_the_other_tokens_bounds() {
        // Token 7 is the most likely until its 2^32 counts subtract 2^33 from it: its own bound
        // is large (~1500), but a backend that dropped the penalty and sampled 7 is wrong.
        let p = PipelineBuilder::new("Pen", DType::F32, DType::F32).penalties("pen").build().unwrap();
        let weights: Vec<f32> = (0..16).map(|v| if v == 7 { 9.0 } else { 0.25 * v as f32 }).collect();
        let history = vec![vec![(7u32, u32::MAX), (7, 1)]];
        let pen = flashsample_abi::PenaltyArg { repetition: &[1.0], presence: &[0.0], frequency: &[2.0], history: &history };
        let unpenalized = SamplingParams { seed: 5, ..Default::default() };
        for seed in 0..50 {
            let params = SamplingParams { penalties: Some(pen), seed, ..Default::default() };
            let prob = logits_problem(&p, &weights, &params);
            let rl = prob.row_logits(0).unwrap();
            assert_eq!(rl.logits[7], 9.0 - 2.0 * 4_294_967_296.0);
            assert!(rl.bounds[7] > 1000.0 && rl.bounds[15] < 1e-5, "{:?}", rl.bounds);
            let (s, lse) = prob.sample_all().unwrap();
            assert_ne!(s[0].token, 7);
            // What a backend that wrapped the count to 0 returns: token 7 at its unpenalized score.
            let g = gumbel_f64(noise_bits(seed, 0, 0, 7, 0));
            assert!(check_pathwise(&s[0], 7, (9.0 + g) as f32).is_err(), "seed {seed}: {:?}", s[0]);
            assert!(s[0].lse_bound < 1e-5, "the penalized token has no mass: {}", s[0].lse_bound);
            assert!((lse[0] - logsumexp(&rl.logits)).abs() < 1e-12);
        }
        let _ = unpenalized;
    }

    #[test]
    fn tiny_temperatures_are_greedy_and_overflow_is_non_finite() {
        let p = PipelineBuilder::new("T", DType::F32, DType::F32).temperature_per_row("t").build().unwrap();
        let weights: Vec<f32> = (0..40).map(|v| (v as f32 * 0.37).sin() + if v == 39 { 2.0 } else { 0.0 }).collect();
        for t in [1e-38f32, 1e-45, 0.0] {
            let temps = [t];
            let params = SamplingParams { temperature: TemperatureArg::PerRow(&temps), seed: 3, ..Default::default() };
            let (s, _) = logits_problem(&p, &weights, &params).sample_all().unwrap();
            assert_eq!(s[0].token, 39, "T = {t}");
            assert!(s[0].score.is_finite());
        }
        // At the smallest sampling temperature a logit of 1e34 overflows f32.
        let temps = [flashsample_abi::params::MIN_TEMPERATURE];
        let params = SamplingParams { temperature: TemperatureArg::PerRow(&temps), ..Default::default() };
        let huge = [1.0f32, 1e34];
        let err = logits_problem(&p, &huge, &params).sample_all().unwrap_err();
        assert_eq!(err, ReferenceError::Row(RowError::NonFinite { row: 0 }));
        // ... unless it is masked.
        let m = PipelineBuilder::new("TM", DType::F32, DType::F32).temperature_per_row("t").mask("m").build().unwrap();
        let params = SamplingParams { mask: Some(&[1]), ..params };
        let (s, _) = logits_problem(&m, &huge, &params).sample_all().unwrap();
        assert_eq!(s[0].token, 0);
    }

    #[test]
    fn saturated_softcap_ties_exactly_as_f32_does() {
        // Past TANH_SATURATE every logit is the same f32 value, so a top-k keeps the lowest
        // indices among them, as an f32 backend does.
        let p = PipelineBuilder::new("C", DType::F32, DType::F32).softcap(1.0).filter("f", 4).build().unwrap();
        let weights = [9.5f32, 30.0, 12.0, 0.5, 100.0, -3.0];
        let filter = [RowFilter::top_k(2)];
        let params = SamplingParams { filter: Some(&filter), ..Default::default() };
        let prob = logits_problem(&p, &weights, &params);
        let rl = prob.row_logits(0).unwrap();
        let sat = f64::from(softcap_f32(f32::INFINITY, 1.0));
        assert_eq!(&rl.logits[..3], &[sat, sat, sat]);
        assert_eq!(rl.logits[4], sat);
        assert_eq!(rl.bounds[1], 0.0);
        let set = prob.candidate_set(0, &rl);
        assert_eq!(set.kept, vec![0, 1]);
        assert!(!set.is_ambiguous(), "{set:?}");
    }
}
