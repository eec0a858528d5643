//! Speculative verification's contract (DESIGN.md "Speculative verification"): how the k draft
//! tokens of a sequence are accepted or rejected against the target's rows and how the next
//! token is drawn, with which noise, so that every backend and the float64 reference agree
//! pathwise. Sequence `i` with `k` drafts owns the target rows `i·(k+1) + j`, `j = 0..=k`
//! (row `j` holds the hidden state that predicts draft position `j`; row `k` the bonus).
//!
//! For `j = 0..k` in order: with `p_j` the distribution the sampler draws row `j` from (the
//! pipeline's transforms and the row's filter; a point mass on the argmax for a greedy row) and
//! `q_j` the draft's, draft token `d_j` is accepted iff `u_j < p_j(d_j) / q_j(d_j)`, with
//! `u_j = uniform_f64(`[`accept_bits`]`)`. At the first rejection the next token is the
//! residual draw `argmax_v { ln(p_j(v) − q_j(v)) + gumbel(`[`residual_bits`]`(v)) }` over the
//! tokens with `p_j(v) > q_j(v)` (ties to the lower index), and verification stops. After k
//! acceptances the next token is what the sampler draws for row `k` (its ordinary token noise:
//! the bonus is an ordinary sample). This is Leviathan et al.'s / Chen et al.'s rejection
//! scheme, so the emitted tokens are distributed exactly as sampling the target one position
//! at a time.
//!
//! A greedy draft (`DraftKind::Greedy`) has `q_j = δ(d_j)`: accepted with probability
//! `p_j(d_j)`, and the residual is `p_j` without `d_j`.

use crate::rng::{counter_word3, key, philox4x32_10, NoiseStream};
use crate::{Candidate, INDEX_NONE};

/// Entries of each (draft row, tile) residual list stage one keeps: the tile's best tokens by
/// the residual stream's perturbed score `x + G_res` (DESIGN.md "Speculative verification").
pub const RESIDUAL_PER_TILE: usize = 8;

/// Relative slack of the residual bound: a stored residual score `s` (f32 `x + G_res`) bounds
/// its token's exact `ln p + gumbel_f64` by `s − L + RESIDUAL_BOUND_SLACK·(1 + |s|)`, covering
/// `|gumbel_f64 − gumbel_f32|` and the f32 rounding of `x + G`, generously (a larger slack
/// only recomputes more often). The host's decision and the device's use this one formula.
pub const RESIDUAL_BOUND_SLACK: f64 = 1e-4;

/// The upper bound `s − L + slack` on the exact residual score of any token whose stored
/// residual score is at most `s`, in the operation order both deciders use.
pub fn residual_upper_bound(score: f32, lse: f64) -> f64 {
    let s = f64::from(score);
    (s - lse) + RESIDUAL_BOUND_SLACK * (1.0 + s.abs())
}

/// An unused residual-list entry: it ranks after every token.
pub const RESIDUAL_EMPTY: Candidate = Candidate { score: f32::NEG_INFINITY, index: INDEX_NONE, logit: f32::NEG_INFINITY };

/// Inserts `c` into a residual list sorted by score (descending; an equal score keeps the
/// earlier, lower token), dropping the last entry; a no-op if `c` ranks after all.
pub fn insert_residual(list: &mut [Candidate], c: Candidate) {
    crate::filter::insert_by(list, c, |e| c.score > e.score);
}

/// A sequence's outcome of the device's decision kernel (`out_status [S]` of
/// `flashsample_decide`, DESIGN.md "Speculative verification"): the sequence was decided, or
/// why not. Only [`SpecStatus::Ok`] sequences carry tokens; for the two draft faults the
/// sequence's `accepted` entry holds the draft position at fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum SpecStatus {
    /// Decided: `accepted` drafts, then the next token.
    Ok = 0,
    /// A row of the sequence could not be sampled (a draft row all masked or non-finite, or
    /// the bonus row with any status but ok): the first such row's status says why.
    RowFailed = 1,
    /// A draft row's target is not in the lists: an unfiltered row was rejected and its
    /// residual winner is not provably among the residual lists (the bound failed, or no
    /// listed token has `p > q`), or a filtered row has no survivors there (its lists
    /// overflowed or its nucleus outgrew them). The row needs stage one over its whole
    /// vocabulary (the host API recomputes it).
    Recompute = 2,
    /// A draft token is not below `V` (the device API's drafts are not checked on the host).
    DraftToken = 3,
    /// A sampled draft's probability of its own token is not positive and finite, or a
    /// distribution entry the decision read (at a residual candidate) is negative, NaN or
    /// infinite. The decision reads the distributions only there; the host API checks them
    /// whole before the launch (`check_drafts`).
    DraftProbability = 4,
}

impl SpecStatus {
    /// Every status, in code order.
    pub const ALL: [SpecStatus; 5] = [SpecStatus::Ok, SpecStatus::RowFailed, SpecStatus::Recompute, SpecStatus::DraftToken, SpecStatus::DraftProbability];

    /// The code the kernel writes.
    pub const fn code(self) -> u32 {
        self as u32
    }

    /// The status of a code, `None` for an unknown one.
    pub fn from_code(code: u32) -> Option<SpecStatus> {
        Self::ALL.into_iter().find(|s| s.code() == code)
    }
}

/// Why the device decision left a sequence undecided (`SamplingPlan::sequence_errors`).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SequenceError {
    /// A row of the sequence could not be sampled.
    #[error("sequence {sequence}: {error}")]
    Row {
        /// The sequence.
        sequence: usize,
        /// Its first failed row's error.
        error: crate::RowStatusError,
    },
    /// A draft token not below the vocabulary ([`SpecStatus::DraftToken`]).
    #[error("sequence {sequence}, draft {position}: the draft token is outside the vocabulary")]
    DraftToken {
        /// The sequence.
        sequence: usize,
        /// The draft position.
        position: usize,
    },
    /// An invalid draft distribution ([`SpecStatus::DraftProbability`]).
    #[error("sequence {sequence}, draft {position}: the draft's probability of its token is not positive and finite, or an entry the decision read is negative, NaN or infinite")]
    DraftProbability {
        /// The sequence.
        sequence: usize,
        /// The draft position.
        position: usize,
    },
    /// A draft row's target needs the row over its whole vocabulary ([`SpecStatus::Recompute`]).
    #[error("sequence {sequence}: a draft row's residual draw or filter needs a recompute of its row over the whole vocabulary (the host API `Sampler::verify` does it)")]
    Recompute {
        /// The sequence.
        sequence: usize,
    },
}

/// Where the draft tokens came from (the IR's, so the pipeline and the contract name one enum).
pub use flashsample_ir::DraftKind;

/// The 32 bits of the acceptance uniform of the target row keyed `(key, ctr_row)` at `step`:
/// Philox counter `[0, ctr_row, 0, counter_word3(step, SpecAccept)]`, word 0.
pub fn accept_bits(seed: u64, ctr_row: u32, step: u32) -> u32 {
    philox4x32_10([0, ctr_row, 0, counter_word3(step, NoiseStream::SpecAccept)], key(seed))[0]
}

/// The 32 noise bits of token `v` in the residual draw of the target row keyed
/// `(key, ctr_row)`: the token noise's counter layout with the `SpecResidual` stream. `v` is
/// the global token (`local + vocab_offset`), as for the token noise.
pub fn residual_bits(seed: u64, ctr_row: u32, v: u32, step: u32) -> u32 {
    philox4x32_10([v >> 2, ctr_row, 0, counter_word3(step, NoiseStream::SpecResidual)], key(seed))[(v & 3) as usize]
}

/// A draft input that cannot be verified, naming the sequence and draft position.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SpecError {
    /// A draft token past the vocabulary.
    #[error("sequence {sequence}, draft {position}: token {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The sequence.
        sequence: usize,
        /// The draft position.
        position: usize,
        /// The token.
        token: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// The draft's probability of its own token is 0, negative or NaN (it could not have
    /// drawn it), or its distribution holds a negative or NaN entry.
    #[error("sequence {sequence}, draft {position}: the draft distribution is invalid ({what})")]
    DraftProbability {
        /// The sequence.
        sequence: usize,
        /// The draft position.
        position: usize,
        /// What is wrong.
        what: &'static str,
    },
    /// A count of draft tokens that does not split `rows` target rows into sequences of
    /// `k + 1` rows with `k` drafts each.
    #[error("{drafts} draft tokens do not split {rows} target rows into S sequences of k + 1 rows with k drafts each (S·k drafts, S·(k + 1) rows)")]
    Sequences {
        /// The target rows.
        rows: usize,
        /// The draft tokens.
        drafts: usize,
    },
    /// Buffer lengths that do not match `B` sequences of `k` drafts.
    #[error("`{what}` has {got} entries, expected {expected}")]
    Length {
        /// The buffer.
        what: &'static str,
        /// Its length.
        got: usize,
        /// `B·k` or `B·k·V`.
        expected: usize,
    },
}

/// The draft whose target position launch row `row` holds (`i·k + j` for row `i·(k + 1) + j`,
/// `j < k`), or `None` for a sequence's bonus row (`j = k`).
pub fn draft_of_row(row: usize, k: usize) -> Option<usize> {
    let (i, j) = (row / (k + 1), row % (k + 1));
    (j != k).then_some(i * k + j)
}

/// `k`, the drafts per sequence, of `rows` target rows and `drafts` draft tokens: `S`
/// sequences own `S·(k + 1)` rows and `S·k` drafts, so `S = rows − drafts` and `k = drafts / S`.
pub fn drafts_per_sequence(rows: usize, drafts: usize) -> Result<usize, SpecError> {
    match rows.checked_sub(drafts) {
        Some(0) if drafts == 0 => Ok(0),
        Some(sequences) if sequences > 0 && drafts.is_multiple_of(sequences) => Ok(drafts / sequences),
        _ => Err(SpecError::Sequences { rows, drafts }),
    }
}

/// Whether every entry of `row` is finite and `≥ 0` (`-0` included), as
/// `x.is_finite() && x >= 0.0` says, on the bits and without a branch per entry, so the compiler vectorizes it: a
/// launch of 64 sequences of 7 drafts over V = 151936 checks 68M entries, which the branchy
/// form took 115–120 ms for on one core of the Sapphire Rapids VM, this one 29–36 ms (about the
/// core's read speed).
fn is_distribution_row(row: &[f32]) -> bool {
    const INF_BITS: u32 = 0x7f80_0000;
    const NEG_ZERO_BITS: u32 = 0x8000_0000;
    row.chunks(256).all(|chunk| {
        // Non-negative finite floats are exactly the bit patterns below +inf's; of the
        // negative ones (sign bit set, so above them) only -0 passes.
        let bad = chunk.iter().fold(0u32, |bad, x| {
            let b = x.to_bits();
            bad | u32::from((b >= INF_BITS) & (b != NEG_ZERO_BITS))
        });
        bad == 0
    })
}

/// Checks `B` sequences' draft tokens (`[B·k]`) and, for sampled drafts, the draft
/// distributions (`[B·k, V]`): every token `< V`, every entry finite and ≥ 0, and the draft's
/// probability of its own token > 0.
pub fn check_drafts(batch: usize, k: usize, vocab: usize, tokens: &[u32], q: Option<&[f32]>) -> Result<(), SpecError> {
    if tokens.len() != batch * k {
        return Err(SpecError::Length { what: "draft tokens", got: tokens.len(), expected: batch * k });
    }
    if let Some(q) = q {
        if q.len() != batch * k * vocab {
            return Err(SpecError::Length { what: "draft distributions", got: q.len(), expected: batch * k * vocab });
        }
    }
    for (i, &t) in tokens.iter().enumerate() {
        let (sequence, position) = (i / k.max(1), i % k.max(1));
        if t as usize >= vocab {
            return Err(SpecError::TokenOutOfRange { sequence, position, token: t, vocab });
        }
        if let Some(q) = q {
            let row = &q[i * vocab..][..vocab];
            if !is_distribution_row(row) {
                return Err(SpecError::DraftProbability { sequence, position, what: "an entry is negative, NaN or infinite" });
            }
            if row[t as usize] <= 0.0 {
                return Err(SpecError::DraftProbability { sequence, position, what: "the draft token has probability 0" });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_map_to_their_drafts_and_the_bonus_rows_to_none() {
        let k2: Vec<Option<usize>> = (0..6).map(|r| draft_of_row(r, 2)).collect();
        assert_eq!(k2, [Some(0), Some(1), None, Some(2), Some(3), None]);
        assert!((0..4).all(|r| draft_of_row(r, 0).is_none()), "k = 0: every row is a bonus row");
    }
    use crate::rng::noise_bits;

    #[test]
    fn streams_never_share_a_counter() {
        // Same key, row, token and step: the token, acceptance and residual streams differ.
        let (seed, row, step) = (7, 3, 5);
        let token = noise_bits(seed, row, 0, 0, step);
        assert_ne!(token, residual_bits(seed, row, 0, step));
        assert_ne!(token, accept_bits(seed, row, step));
        assert_ne!(accept_bits(seed, row, step), accept_bits(seed, row, step + 1));
    }

    #[test]
    fn bad_drafts_name_the_sequence_and_position() {
        let q = vec![0.25f32; 2 * 2 * 4];
        assert_eq!(check_drafts(2, 2, 4, &[0, 1, 2, 3], Some(&q)), Ok(()));
        assert_eq!(check_drafts(2, 2, 4, &[0, 1, 4, 3], None), Err(SpecError::TokenOutOfRange { sequence: 1, position: 0, token: 4, vocab: 4 }));
        let mut zero = q.clone();
        zero[3 * 4 + 3] = 0.0;
        assert!(matches!(check_drafts(2, 2, 4, &[0, 1, 2, 3], Some(&zero)), Err(SpecError::DraftProbability { sequence: 1, position: 1, .. })));
        let mut nan = q.clone();
        nan[1] = f32::NAN;
        assert!(matches!(check_drafts(2, 2, 4, &[0, 1, 2, 3], Some(&nan)), Err(SpecError::DraftProbability { sequence: 0, position: 0, .. })));
        assert!(matches!(check_drafts(2, 2, 4, &[0, 1, 2], None), Err(SpecError::Length { .. })));
    }

    #[test]
    fn the_bitwise_row_check_is_finite_and_non_negative() {
        let valid = |x: f32| x.is_finite() && x >= 0.0;
        let specials = [0.0, -0.0, f32::MIN_POSITIVE, f32::from_bits(1), -f32::from_bits(1), 1.0, -1.0, f32::MAX, f32::MIN, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, f32::from_bits(0x7f80_0001), f32::from_bits(0xff80_0001)];
        // One odd entry at every position of a row spanning several 256-entry chunks.
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x9e37_79b9_7f4a_7c15);
        let randoms = (0..100_000).map(|_| f32::from_bits(rng.random()));
        for (i, x) in specials.into_iter().chain(randoms).enumerate() {
            let mut row = vec![0.5f32; 700];
            row[i % 700] = x;
            assert_eq!(is_distribution_row(&row), valid(x), "{x:e} ({:#x})", x.to_bits());
        }
    }

    #[test]
    fn spec_status_codes_round_trip() {
        for s in SpecStatus::ALL {
            assert_eq!(SpecStatus::from_code(s.code()), Some(s));
        }
        assert_eq!(SpecStatus::from_code(5), None);
    }

    #[test]
    fn rows_and_drafts_give_k() {
        assert_eq!(drafts_per_sequence(6, 4), Ok(2));
        assert_eq!(drafts_per_sequence(3, 0), Ok(0));
        assert_eq!(drafts_per_sequence(0, 0), Ok(0));
        assert_eq!(drafts_per_sequence(16, 14), Ok(7));
        assert_eq!(drafts_per_sequence(7, 4), Err(SpecError::Sequences { rows: 7, drafts: 4 }));
        assert_eq!(drafts_per_sequence(4, 4), Err(SpecError::Sequences { rows: 4, drafts: 4 }));
    }
}
