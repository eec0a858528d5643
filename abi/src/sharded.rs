//! Exact sampling over a vocabulary split into shards (tensor-parallel LM heads), by
//! hierarchical factorization: each shard reports its local sample and its log-mass
//! `log Σ_{v∈shard} exp(x_v)`; the merge draws the shard with probability proportional to its
//! mass, using a Philox stream of its own, and keeps that shard's local sample. Then
//! `P(v) = (Z_k / Z) · (exp(x_v) / Z_k) = exp(x_v) / Z`: exactly the unsharded distribution.

use crate::{
    rng::{counter_word3, gumbel_f64, key, philox4x32_10, NoiseStream},
    Candidate,
};

/// Noise bits for choosing among shards for (row, sample) at decode step `step`: counter
/// `[shard, row, sample, counter_word3(step, Shard)]`, a stream of its own, so shard draws are
/// independent of every token's noise at every step. `(seed, row)` is the row's noise stream,
/// `SamplingParams::row_stream`: `(seed, row)`, or `(row_seeds[row], 0)`.
pub fn shard_noise_bits(seed: u64, row: u32, sample: u32, shard: u32, step: u32) -> u32 {
    philox4x32_10([shard, row, sample, counter_word3(step, NoiseStream::Shard)], key(seed))[0]
}

/// One shard's result for one (row, sample).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShardDraw {
    /// The shard's local winner (global token index), `None` if every token of the shard is excluded.
    pub winner: Option<Candidate>,
    /// `logsumexp` of the shard's transformed logits (`-inf` if none is allowed).
    pub log_mass: f64,
}

/// The shard whose local sample becomes the row's sample, `None` if every shard is empty.
/// Greedy rows take the shard with the best local score (ties to the lower shard). `(seed,
/// row)` is the row's noise stream (see [`shard_noise_bits`]), `step` its decode step.
pub fn pick_shard(draws: &[ShardDraw], seed: u64, row: u32, sample: u32, step: u32, greedy: bool) -> Option<usize> {
    let key_of = |k: usize, d: &ShardDraw| -> Option<f64> {
        let w = d.winner?;
        if greedy {
            Some(f64::from(w.score))
        } else if d.log_mass > f64::NEG_INFINITY {
            Some(d.log_mass + gumbel_f64(shard_noise_bits(seed, row, sample, k as u32, step)))
        } else {
            None
        }
    };
    let mut best: Option<(usize, f64)> = None;
    for (k, d) in draws.iter().enumerate() {
        if let Some(s) = key_of(k, d) {
            if best.is_none_or(|(_, b)| s > b) {
                best = Some((k, s));
            }
        }
    }
    best.map(|(k, _)| k)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draw(token: u32, log_mass: f64) -> ShardDraw {
        ShardDraw { winner: Some(Candidate { score: log_mass as f32, index: token, logit: 0.0 }), log_mass }
    }

    #[test]
    fn empty_shards_are_never_picked() {
        let empty = ShardDraw { winner: None, log_mass: f64::NEG_INFINITY };
        for seed in 0..200 {
            assert_eq!(pick_shard(&[empty, draw(5, -3.0), empty], seed, 0, 0, 0, false), Some(1));
        }
        assert_eq!(pick_shard(&[empty, empty], 1, 0, 0, 0, false), None);
    }

    #[test]
    fn shards_are_picked_in_proportion_to_their_mass() {
        // Masses 1 : 3 : 6.
        let draws = [draw(0, 1f64.ln()), draw(1, 3f64.ln()), draw(2, 6f64.ln())];
        let mut counts = [0u32; 3];
        let n = 60_000;
        for seed in 0..n {
            counts[pick_shard(&draws, seed, 3, 1, (seed % 5) as u32, false).unwrap()] += 1;
        }
        for (c, p) in counts.iter().zip([0.1, 0.3, 0.6]) {
            let f = f64::from(*c) / n as f64;
            // 5 standard deviations of a binomial proportion.
            assert!((f - p).abs() < 5.0 * (p * (1.0 - p) / n as f64).sqrt(), "{counts:?}");
        }
    }

    #[test]
    fn shard_noise_changes_with_the_step_and_is_not_token_noise() {
        let a = shard_noise_bits(11, 2, 0, 1, 0);
        assert_ne!(a, shard_noise_bits(11, 2, 0, 1, 1));
        // Token noise of vocabulary quad 1 uses the same first three counter words, word 0 of the
        // output, but the Token stream.
        assert_ne!(a, crate::rng::noise_bits(11, 2, 0, 4, 0));
    }

    #[test]
    fn greedy_takes_the_best_local_score() {
        let draws = [draw(0, 2.0), draw(1, 7.0), draw(2, 7.0)];
        assert_eq!(pick_shard(&draws, 9, 0, 0, 0, true), Some(1));
    }
}
