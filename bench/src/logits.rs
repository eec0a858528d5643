//! The shape of the logits a bench's hidden states give: Gaussian rows (the random head), or
//! rows shaped like a trained LM's (issue 23: the noise skips save by the logits' spread, so
//! their benefit is measured on both).
//!
//! A trained LM's next-token logits have a few tokens far above the rest, a roughly
//! power-law decay over the next tens, and a bulk of the vocabulary near-Gaussian and tens of
//! nats below the top at `T ≤ 1`. [`LogitShape::LmLike`] builds hidden states that give
//! exactly that shape against any random W, without changing W (so the weights, the kernel's
//! traffic and the peers are the random head's): row `r`'s hidden state is
//!
//! `h_r = Σ_{i=1..HEAD} c_i · w_{t_i} / ‖w_{t_i}‖² + n_r`,
//!
//! with `HEAD` distinct random tokens `t_i`, `c_i = top_r − DECAY · ln i` and `n_r` a Gaussian
//! vector. Then `⟨h_r, w_{t_i}⟩ ≈ c_i`, and every other token's logit is a near-Gaussian bulk
//! around 0: the cross terms `Σ_j c_j ⟨w_{t_j}, w_v⟩ / ‖w_{t_j}‖²`, of variance about
//! `Σ c_j² / D` (~3.5 at D = 4096), plus `⟨n_r, w_v⟩`, scaled to bring the bulk's standard
//! deviation to [`BULK_STD`]. `top_r` is uniform in [`TOP`], so rows range from flat (the top token's
//! probability ~0.05 at T = 1) to peaked (~0.99).
//!
//! [`LogitShape::LmLikeLowIds`] draws half of each head from the first [`LOW_IDS`] token ids:
//! a BPE vocabulary numbers its tokens by merge order, so the frequent ones, which fill a
//! trained LM's top, have low ids and crowd the first vocabulary tiles. How much they crowd
//! is a model here, not a measurement of a trained LM.

use flashsample::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};
use rand_distr::StandardNormal;
use rayon::prelude::*;

/// Tokens of a row's power-law head.
pub const HEAD: usize = 64;
/// The head's decay: token `i` of the head sits `DECAY · ln i` below the first.
pub const DECAY: f32 = 1.2;
/// The range of a row's top logit above the bulk's mean (raw, before the temperature).
pub const TOP: (f32, f32) = (14.0, 28.0);
/// The bulk's standard deviation: the head's cross terms plus `⟨n_r, w_v⟩`, which makes up
/// what the cross terms leave (none past D ≈ 2048, where the cross terms alone exceed it).
pub const BULK_STD: f32 = 2.5;

/// What the hidden states' logits look like.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogitShape {
    /// Hidden states drawn independently of W: every logit from one (near-)Gaussian.
    #[default]
    Gaussian,
    /// Trained-LM-like rows ([module docs](self)).
    LmLike,
    /// [`LogitShape::LmLike`] with half of each row's head among the first [`LOW_IDS`] ids.
    LmLikeLowIds,
}

/// The ids [`LogitShape::LmLikeLowIds`] draws half of each head from (16 tiles of 256 tokens).
pub const LOW_IDS: usize = 4096;

impl LogitShape {
    /// Whether the rows are built from W's rows (every shape but [`LogitShape::Gaussian`]).
    pub fn is_lm_like(self) -> bool {
        self != LogitShape::Gaussian
    }

    /// `rows` hidden states of dimension `dim` for the head `w` (`[vocab, dim]` bf16): for
    /// [`LogitShape::Gaussian`] `gaussian()` itself (the bench's own generator, so its rows
    /// stay as they were), else [`lm_like_hidden`] seeded by `seed`.
    pub fn hidden(self, w: &[bf16], dim: usize, rows: usize, seed: u64, gaussian: impl FnOnce() -> Vec<bf16>) -> Vec<bf16> {
        match self {
            LogitShape::Gaussian => gaussian(),
            LogitShape::LmLike => lm_like_hidden(w, dim, rows, seed, 0),
            LogitShape::LmLikeLowIds => lm_like_hidden(w, dim, rows, seed, HEAD / 2),
        }
    }
}

/// [`LogitShape::LmLike`]'s hidden states for `rows` rows against `w` (`[vocab, dim]`), the
/// first `low` head tokens of each row drawn from the first [`LOW_IDS`] ids.
pub fn lm_like_hidden(w: &[bf16], dim: usize, rows: usize, seed: u64, low: usize) -> Vec<bf16> {
    let vocab = w.len() / dim;
    let row_of = |v: usize| -> Vec<f32> { w[v * dim..][..dim].iter().map(|x| x.to_f32()).collect() };
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(rows * dim);
    for _ in 0..rows {
        let top: f32 = rng.random_range(TOP.0..TOP.1);
        let mut h = vec![0f32; dim];
        let mut norms2 = 0f64;
        // Σ c_i² / ‖w_{t_i}‖²: the cross terms' variance over W's per-element variance.
        let mut cross = 0f64;
        let mut heads: Vec<usize> = Vec::with_capacity(HEAD);
        while heads.len() < HEAD.min(vocab) {
            let ids = if heads.len() < low { LOW_IDS.min(vocab) } else { vocab };
            let t = rng.random_range(0..ids);
            if !heads.contains(&t) {
                heads.push(t);
            }
        }
        for (i, &t) in heads.iter().enumerate() {
            let wt = row_of(t);
            let n2: f32 = wt.iter().map(|x| x * x).sum();
            norms2 += n2 as f64;
            if n2 > 0.0 {
                let c = top - DECAY * ((i + 1) as f32).ln();
                cross += (c * c / n2) as f64;
                h.iter_mut().zip(&wt).for_each(|(h, w)| *h += c / n2 * w);
            }
        }
        // The bulk: ⟨n, w_v⟩'s spread over the tokens is ‖n‖ times W's per-element standard
        // deviation (estimated from the head's rows), the cross terms' `cross` times W's
        // per-element variance.
        let w_var = norms2 / (heads.len() * dim) as f64;
        let rest = (BULK_STD as f64).powi(2) - cross * w_var;
        if w_var > 0.0 && rest > 0.0 {
            let scale = (rest / w_var).sqrt() as f32;
            for h in h.iter_mut() {
                let z: f32 = rng.sample(StandardNormal);
                *h += scale * z / (dim as f32).sqrt();
            }
        }
        out.extend(h.iter().map(|&x| bf16::from_f32(x)));
    }
    out
}

/// What a row's logits look like at temperature `t`: the numbers a bench prints beside an
/// [`LogitShape::LmLike`] table, so a reader sees the rows the kernels sampled.
#[derive(Clone, Copy, Debug)]
pub struct RowShape {
    /// The most likely token's probability.
    pub top_p: f64,
    /// The top logit over `t` minus the median logit over `t`, in nats.
    pub top_over_median: f64,
    /// Tokens whose logit over `t` lies within `gumbel_f32_upper_bound()` of the top one's: the
    /// tokens whose noise no bound from the top token alone can skip.
    pub near_top: usize,
}

impl RowShape {
    /// The shape of one row of raw logits at temperature `t` (> 0).
    pub fn of(logits: &[f32], t: f32) -> RowShape {
        let x: Vec<f64> = logits.iter().map(|&l| (l / t) as f64).collect();
        let top = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = x.iter().map(|&v| (v - top).exp()).sum();
        let mut sorted = x.clone();
        sorted.sort_by(f64::total_cmp);
        let reach = flashsample_abi::rng::gumbel_f32_upper_bound() as f64;
        RowShape { top_p: 1.0 / sum, top_over_median: top - sorted[sorted.len() / 2], near_top: x.iter().filter(|&&v| v + reach >= top).count() }
    }
}

/// The f32 logits `h·Wᵀ` of `rows` hidden rows (`[rows, dim]`) against `w` (`[vocab, dim]`),
/// `[rows, vocab]`, tokens in parallel: for [`RowShape`], not the kernels' bits.
pub fn host_logits(w: &[bf16], hidden: &[bf16], dim: usize, rows: usize) -> Vec<f32> {
    let vocab = w.len() / dim;
    let h: Vec<Vec<f32>> = (0..rows).map(|r| hidden[r * dim..][..dim].iter().map(|x| x.to_f32()).collect()).collect();
    let mut by_token = vec![0f32; vocab * rows];
    by_token.par_chunks_mut(rows.max(1)).enumerate().for_each(|(v, out)| {
        let wv: Vec<f32> = w[v * dim..][..dim].iter().map(|x| x.to_f32()).collect();
        for (o, h) in out.iter_mut().zip(&h) {
            *o = h.iter().zip(&wv).map(|(a, b)| a * b).sum();
        }
    });
    (0..rows * vocab).map(|i| by_token[(i % vocab) * rows + i / vocab]).collect()
}

/// A line describing the first `show` rows of `hidden` at their temperatures `temps` (one per
/// row; the first `show` are used), for a bench's stderr/stdout beside its table.
pub fn describe_rows(w: &[bf16], hidden: &[bf16], dim: usize, temps: &[f32], show: usize) -> String {
    let rows = show.min(temps.len()).min(hidden.len() / dim);
    let vocab = w.len() / dim;
    let logits = host_logits(w, &hidden[..rows * dim], dim, rows);
    let parts: Vec<String> = (0..rows)
        .map(|r| {
            let s = RowShape::of(&logits[r * vocab..][..vocab], temps[r]);
            format!("T {:.1}: top p {:.2}, top − median {:.1} nats, {} tokens within the noise bound of the top", temps[r], s.top_p, s.top_over_median, s.near_top)
        })
        .collect();
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random `[vocab, dim]` weights of per-element standard deviation `std`.
    fn weights(vocab: usize, dim: usize, std: f32) -> Vec<bf16> {
        let mut rng = StdRng::seed_from_u64(3);
        (0..vocab * dim)
            .map(|_| {
                let z: f32 = rng.sample(StandardNormal);
                bf16::from_f32(z * std)
            })
            .collect()
    }

    /// The built rows have the promised shape: the head's first token on top near `top_r`
    /// above a bulk of spread near `BULK_STD` (plus the cross terms), whatever W's scale.
    #[test]
    fn lm_like_rows_put_a_power_law_head_far_above_a_gaussian_bulk() {
        let (vocab, dim, rows) = (4096, 4096, 6);
        for std in [0.01f32, 0.1] {
            let w = weights(vocab, dim, std);
            let h = lm_like_hidden(&w, dim, rows, 9, 0);
            let logits = host_logits(&w, &h, dim, rows);
            for r in 0..rows {
                let row = &logits[r * vocab..][..vocab];
                let mut sorted = row.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                let mean = row.iter().sum::<f32>() / vocab as f32;
                // The bulk: everything below the head.
                let bulk = &sorted[HEAD..];
                let bulk_mean = bulk.iter().sum::<f32>() / bulk.len() as f32;
                let bulk_std = (bulk.iter().map(|x| (x - bulk_mean).powi(2)).sum::<f32>() / bulk.len() as f32).sqrt();
                assert!(mean.abs() < 0.5, "std {std} row {r}: mean {mean}");
                assert!((2.0..3.0).contains(&bulk_std), "std {std} row {r}: bulk std {bulk_std}");
                let top = sorted[0];
                assert!(top > TOP.0 - 3.0 && top < TOP.1 + 3.0, "std {std} row {r}: top {top}");
                // At T = 0.7 most of the vocabulary lies beyond the noise bound of the top.
                let s = RowShape::of(row, 0.7);
                assert!(s.top_over_median > f64::from(TOP.0 - 3.0) / 0.7, "std {std} row {r}: {s:?}");
                assert!(s.near_top < vocab / 4, "std {std} row {r}: {s:?}");
            }
        }
    }

    /// [`LogitShape::LmLikeLowIds`] puts each row's top token (its head's first) among the low
    /// ids; [`LogitShape::LmLike`] puts it anywhere (all 6 rows below `LOW_IDS` of 16384 ids by
    /// chance: 4⁻⁶).
    #[test]
    fn low_id_rows_put_their_top_token_among_the_low_ids() {
        let (vocab, dim, rows) = (4 * LOW_IDS, 1024, 6);
        let w = weights(vocab, dim, 0.05);
        let top_ids = |low| {
            let h = lm_like_hidden(&w, dim, rows, 3, low);
            let logits = host_logits(&w, &h, dim, rows);
            (0..rows).map(|r| (0..vocab).max_by(|&a, &b| logits[r * vocab + a].total_cmp(&logits[r * vocab + b])).unwrap()).collect::<Vec<_>>()
        };
        assert!(top_ids(HEAD / 2).iter().all(|&t| t < LOW_IDS));
        assert!(!top_ids(0).iter().all(|&t| t < LOW_IDS));
    }

    /// `RowShape` on a row it can be checked by hand: one token 10 nats above 3 others at 0.
    #[test]
    fn row_shape_of_a_hand_made_row() {
        let row = [0.0f32, 10.0, 0.0, 0.0];
        let s = RowShape::of(&row, 1.0);
        let want = 1.0 / (1.0 + 3.0 * (-10f64).exp());
        assert!((s.top_p - want).abs() < 1e-12);
        assert_eq!(s.top_over_median, 10.0);
        assert_eq!(s.near_top, 4);
        let s = RowShape::of(&row, 0.5);
        assert_eq!((s.top_over_median, s.near_top), (20.0, 1));
        let far = [0.0f32, 20.0, 0.0, 0.0];
        assert_eq!(RowShape::of(&far, 1.0).near_top, 1);
    }
}
