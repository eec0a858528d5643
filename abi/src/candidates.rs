//! Stage one writes one [`Candidate`] per (row, sample, vocab tile) and, when the pipeline
//! wants a logsumexp, one [`LsePartial`] per (row, tile). Stage two ([`StageTwo`]) reduces them.

use crate::lse::{LsePartial, LseSum};
use crate::RowStatus;
use bytemuck::{Pod, Zeroable};

/// Index of a tile in which every token was excluded (masked, banned or `-inf`).
pub const INDEX_NONE: u32 = u32::MAX;
/// Index of a tile that met a non-finite raw logit (NaN or ±inf from the matmul).
pub const INDEX_NONFINITE: u32 = u32::MAX - 1;

/// One tile's winner for one (row, sample).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct Candidate {
    /// Perturbed score (transformed logit + Gumbel noise; the logit for greedy rows).
    pub score: f32,
    /// Global vocabulary index, or [`INDEX_NONE`] / [`INDEX_NONFINITE`].
    pub index: u32,
    /// The winner's transformed logit, without noise.
    pub logit: f32,
}

/// A row that cannot be sampled.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RowError {
    /// Every token of the row is excluded.
    #[error("row {row}: every token is masked, banned or -inf, so there is nothing to sample")]
    AllMasked {
        /// The row.
        row: usize,
    },
    /// The row's logits are not finite (status 2).
    #[error("row {row}: the logits contain NaN or infinity (check the hidden states and weights for NaN/inf, and the parameters for values that overflow f32)")]
    NonFinite {
        /// The row.
        row: usize,
    },
}

/// The layout of one launch's candidate buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageTwo {
    /// Rows.
    pub batch: usize,
    /// Samples per row.
    pub samples: usize,
    /// Vocabulary tiles.
    pub tiles: usize,
}

/// The final samples of one launch, row-major `[B, samples]`.
#[derive(Clone, Debug, PartialEq)]
pub struct RowResult {
    /// Sampled token of each (row, sample).
    pub tokens: Vec<u32>,
    /// Its perturbed score.
    pub scores: Vec<f32>,
    /// Transformed logit of each sampled token.
    pub logits: Vec<f32>,
    /// Per row, when the launch computed partials.
    pub logsumexp: Option<Vec<f32>>,
}

impl RowResult {
    /// Writes `part`, the results of consecutive rows from `first` on (`samples` a row), over
    /// this launch's: a range of rows run again as a launch of its own.
    pub fn overwrite_rows(&mut self, first: usize, samples: usize, part: RowResult) {
        let at = first * samples;
        self.tokens[at..][..part.tokens.len()].copy_from_slice(&part.tokens);
        self.scores[at..][..part.scores.len()].copy_from_slice(&part.scores);
        self.logits[at..][..part.logits.len()].copy_from_slice(&part.logits);
        if let (Some(all), Some(some)) = (&mut self.logsumexp, part.logsumexp) {
            all[first..][..some.len()].copy_from_slice(&some);
        }
    }
}

impl StageTwo {
    /// Number of vocab tiles of `tile` tokens covering `vocab`.
    pub fn tiles_for(vocab: usize, tile: usize) -> usize {
        vocab.div_ceil(tile)
    }

    /// Candidates of the whole launch.
    pub fn candidate_count(&self) -> usize {
        self.batch * self.samples * self.tiles
    }

    /// Slot of (row, sample, tile) in the candidate buffer.
    pub fn slot(&self, row: usize, sample: usize, tile: usize) -> usize {
        (row * self.samples + sample) * self.tiles + tile
    }

    /// Whether `a` beats `b`: higher score, ties to the lower index (so the result is
    /// independent of reduction order).
    pub fn beats(a: &Candidate, b: &Candidate) -> bool {
        a.score > b.score || (a.score == b.score && a.index < b.index)
    }

    /// The winning candidate of (row, sample) over all tiles: `Ok(None)` if every tile was
    /// empty, `Err` if any tile met a non-finite raw logit or its winner's score is `+inf` or
    /// NaN (a transformed logit that overflowed f32, e.g. `logit / T` for a tiny `T`).
    pub fn winner(&self, candidates: &[Candidate], row: usize, sample: usize) -> Result<Option<Candidate>, RowError> {
        let mut best: Option<Candidate> = None;
        for c in &candidates[self.slot(row, sample, 0)..][..self.tiles] {
            match c.index {
                INDEX_NONFINITE => return Err(RowError::NonFinite { row }),
                INDEX_NONE => {}
                _ if c.score.is_nan() || c.score == f32::INFINITY => return Err(RowError::NonFinite { row }),
                _ if best.is_none_or(|b| Self::beats(c, &b)) => best = Some(*c),
                _ => {}
            }
        }
        Ok(best)
    }

    /// The row's logsumexp over all tiles' partials (`-inf` if nothing was allowed): the
    /// exact sum of [`crate::lse`], so it does not depend on the tiling.
    pub fn logsumexp(&self, lse: &[LsePartial], row: usize) -> f32 {
        LseSum::of(&lse[row * self.tiles..][..self.tiles]).logsumexp()
    }

    /// Reduces the candidates of every row and sample, each row on its own: a row that cannot
    /// be sampled gets its [`RowStatus`] (all masked, non-finite) and `INDEX_NONE` tokens with
    /// NaN scores, logits and logsumexp; the other rows are sampled as by [`StageTwo::reduce`].
    pub fn reduce_rows(&self, candidates: &[Candidate], lse: Option<&[LsePartial]>) -> (RowResult, Vec<RowStatus>) {
        assert_eq!(candidates.len(), self.candidate_count(), "candidate buffer does not match its layout");
        let n = self.batch * self.samples;
        let mut out = RowResult {
            tokens: Vec::with_capacity(n),
            scores: Vec::with_capacity(n),
            logits: Vec::with_capacity(n),
            logsumexp: lse.map(|_| Vec::with_capacity(self.batch)),
        };
        let mut status = Vec::with_capacity(self.batch);
        for row in 0..self.batch {
            let winners: Result<Vec<Candidate>, RowStatus> = (0..self.samples)
                .map(|sample| match self.winner(candidates, row, sample) {
                    Ok(Some(c)) => Ok(c),
                    Ok(None) => Err(RowStatus::AllMasked),
                    Err(_) => Err(RowStatus::NonFinite),
                })
                .collect();
            let failed = Candidate { score: f32::NAN, index: INDEX_NONE, logit: f32::NAN };
            let (row_status, winners) = match winners {
                Ok(w) => (RowStatus::Ok, w),
                Err(st) => (st, vec![failed; self.samples]),
            };
            for c in winners {
                out.tokens.push(c.index);
                out.scores.push(c.score);
                out.logits.push(c.logit);
            }
            if let (Some(lse), Some(dst)) = (lse, out.logsumexp.as_mut()) {
                dst.push(if row_status == RowStatus::Ok { self.logsumexp(lse, row) } else { f32::NAN });
            }
            status.push(row_status);
        }
        (out, status)
    }

    /// Reduces the candidates of every row and sample; any row error fails the launch: the
    /// first failed row's, as [`StageTwo::reduce_rows`] reports it.
    pub fn reduce(&self, candidates: &[Candidate], lse: Option<&[LsePartial]>) -> Result<RowResult, RowError> {
        let (out, status) = self.reduce_rows(candidates, lse);
        match status.iter().enumerate().find(|(_, s)| **s != RowStatus::Ok) {
            None => Ok(out),
            Some((row, RowStatus::AllMasked)) => Err(RowError::AllMasked { row }),
            // `reduce_rows` writes only Ok, AllMasked and NonFinite.
            Some((row, _)) => Err(RowError::NonFinite { row }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(score: f32, index: u32) -> Candidate {
        Candidate { score, index, logit: score }
    }

    #[test]
    fn overwriting_rows_touches_those_rows_only() {
        let launch = |v: f32, rows: usize| RowResult {
            tokens: vec![v as u32; rows * 2],
            scores: vec![v; rows * 2],
            logits: vec![-v; rows * 2],
            logsumexp: Some(vec![v; rows]),
        };
        let mut all = launch(0.0, 4);
        all.overwrite_rows(1, 2, launch(7.0, 2));
        assert_eq!(all.tokens, [0, 0, 7, 7, 7, 7, 0, 0]);
        assert_eq!(all.logits, [0.0, 0.0, -7.0, -7.0, -7.0, -7.0, 0.0, 0.0]);
        assert_eq!(all.logsumexp, Some(vec![0.0, 7.0, 7.0, 0.0]));
    }

    #[test]
    fn reduce_picks_max_and_breaks_ties_low() {
        let s = StageTwo { batch: 2, samples: 1, tiles: 3 };
        let cands = [c(1.0, 5), c(2.0, 9), c(2.0, 7), c(-1.0, 0), c(0.0, INDEX_NONE), c(-0.5, 20)];
        let r = s.reduce(&cands, None).unwrap();
        assert_eq!(r.tokens, vec![7, 20]);
        assert_eq!(r.scores, vec![2.0, -0.5]);
    }

    #[test]
    fn reduce_reports_bad_rows() {
        let s = StageTwo { batch: 2, samples: 1, tiles: 2 };
        let masked = [c(1.0, 1), c(0.0, 2), c(0.0, INDEX_NONE), c(0.0, INDEX_NONE)];
        assert_eq!(s.reduce(&masked, None), Err(RowError::AllMasked { row: 1 }));
        let nan = [c(1.0, 1), c(0.0, INDEX_NONFINITE), c(0.0, 3), c(0.0, 4)];
        assert_eq!(s.reduce(&nan, None), Err(RowError::NonFinite { row: 0 }));
        // A transformed logit that overflowed to +inf wins its tile with score +inf.
        let overflow = [c(1.0, 1), c(2.0, 2), c(0.0, 3), c(f32::INFINITY, 4)];
        assert_eq!(s.reduce(&overflow, None), Err(RowError::NonFinite { row: 1 }));
    }

    #[test]
    fn reduce_rows_keeps_the_good_rows() {
        let s = StageTwo { batch: 3, samples: 1, tiles: 2 };
        let cands = [c(1.0, 1), c(0.0, 2), c(0.0, INDEX_NONE), c(0.0, INDEX_NONE), c(0.0, INDEX_NONFINITE), c(5.0, 4)];
        let (r, status) = s.reduce_rows(&cands, None);
        assert_eq!(status, vec![RowStatus::Ok, RowStatus::AllMasked, RowStatus::NonFinite]);
        assert_eq!(r.tokens, vec![1, INDEX_NONE, INDEX_NONE]);
        assert!(r.scores[1].is_nan() && r.logits[2].is_nan());
    }

    #[test]
    fn logsumexp_merges_tile_partials() {
        let xs = [0.5f32, -1.0, 3.0, 2.0];
        let want = xs.iter().map(|&x| f64::from(x).exp()).sum::<f64>().ln();
        let p = |a: &[f32]| {
            let mut p = LsePartial::EMPTY;
            a.iter().for_each(|&x| p.add(x));
            p
        };
        let s = StageTwo { batch: 1, samples: 1, tiles: 3 };
        let got = s.logsumexp(&[p(&xs[..1]), LsePartial::EMPTY, p(&xs[1..])], 0);
        assert!((f64::from(got) - want).abs() < 1e-6);
        assert_eq!(got, s.logsumexp(&[p(&xs[2..]), p(&xs[..2]), LsePartial::EMPTY], 0));
    }
}
