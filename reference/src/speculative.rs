//! Float64 speculative verification (`abi::speculative`): per sequence, the accepted drafts and
//! the next token, from the target rows' exact distributions and the shared Philox noise.

use crate::{Problem, ReferenceError, ToF64};
use flashsample_abi::rng::{gumbel_f64, uniform_f64};
use flashsample_abi::speculative::{accept_bits, check_drafts, residual_bits, DraftKind, SpecError};

/// One sequence's verification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecOutcome {
    /// Draft tokens accepted, `0..=k`.
    pub accepted: usize,
    /// The token after them: the residual draw at the first rejection, or the bonus token.
    pub next: u32,
}

/// Why verification could not run.
#[derive(Debug, thiserror::Error)]
pub enum SpecReferenceError {
    /// The draft inputs are invalid.
    #[error(transparent)]
    Draft(#[from] SpecError),
    /// A target row failed.
    #[error(transparent)]
    Reference(#[from] ReferenceError),
}

impl<H: ToF64, W: ToF64> Problem<'_, H, W> {
    /// The distribution the sampler draws `row` from: [`Problem::probabilities`], or a point
    /// mass on the f64 argmax (ties to the lower index) for a greedy row.
    pub fn target_distribution(&self, row: usize) -> Result<Vec<f64>, ReferenceError> {
        let rl = self.row_logits(row)?;
        if !rl.greedy {
            return self.probabilities(row);
        }
        let best = (0..self.vocab).fold(0, |b, v| if rl.logits[v] > rl.logits[b] { v } else { b });
        let mut p = vec![0.0; self.vocab];
        p[best] = 1.0;
        Ok(p)
    }

    /// Verifies `batch / (k + 1)` sequences of `k` drafts each (`drafts`: `[B·k]`; `q`: the
    /// draft distributions `[B·k, V]` for [`DraftKind::Sampled`]) against this problem's rows,
    /// sequence `i` owning rows `i·(k+1) ..= i·(k+1) + k` (DESIGN.md "Speculative verification").
    pub fn verify(&self, k: usize, kind: DraftKind, drafts: &[u32], q: Option<&[f32]>) -> Result<Vec<SpecOutcome>, SpecReferenceError> {
        let sequences = self.batch / (k + 1);
        if sequences * (k + 1) != self.batch {
            return Err(ReferenceError::Shape(format!("{} rows are not sequences of k + 1 = {}", self.batch, k + 1)).into());
        }
        if (kind == DraftKind::Sampled) != q.is_some() {
            return Err(ReferenceError::Shape("sampled drafts take their distributions; greedy drafts none".into()).into());
        }
        check_drafts(sequences, k, self.vocab, drafts, q)?;
        let mut out = Vec::with_capacity(sequences);
        for i in 0..sequences {
            let mut outcome = None;
            for j in 0..k {
                let row = i * (k + 1) + j;
                let p = self.target_distribution(row)?;
                let d = drafts[i * k + j] as usize;
                let q_row = |v: usize| match q {
                    Some(q) => f64::from(q[(i * k + j) * self.vocab + v]),
                    None => f64::from(u8::from(v == d)),
                };
                let (seed, ctr) = self.params.row_stream(row);
                let step = self.params.row_step(row);
                if uniform_f64(accept_bits(seed, ctr, step)) < p[d] / q_row(d) {
                    continue;
                }
                // The residual max(0, p − q), drawn by Gumbel-max; if rounding left it empty
                // (p = q), p itself.
                let residual: Vec<f64> = (0..self.vocab).map(|v| (p[v] - q_row(v)).max(0.0)).collect();
                let weights = if residual.iter().any(|&r| r > 0.0) { residual } else { p };
                let mut best: Option<(f64, usize)> = None;
                for (v, &w) in weights.iter().enumerate() {
                    if w > 0.0 {
                        // Keyed by the global token, as the kernels' residual lists are.
                        let s = w.ln() + gumbel_f64(residual_bits(seed, ctr, v as u32 + self.params.vocab_offset, step));
                        if best.is_none_or(|(b, _)| s > b) {
                            best = Some((s, v));
                        }
                    }
                }
                let next = best.map_or(0, |(_, v)| v as u32);
                outcome = Some(SpecOutcome { accepted: j, next });
                break;
            }
            let outcome = match outcome {
                Some(o) => o,
                None => {
                    // Every draft accepted: the bonus is row k's ordinary sample.
                    let (samples, _) = self.sample_rows(&[i * (k + 1) + k])?;
                    SpecOutcome { accepted: k, next: samples[0].token }
                }
            };
            out.push(outcome);
        }
        Ok(out)
    }
}
