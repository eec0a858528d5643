//! The one noise source of flashsample.
//!
//! Noise for (seed, row, sample, vocab index `v`, step) is word `v % 4` of
//! `philox4x32_10(counter = [v / 4, row, sample, counter_word3(step, Token)], key = [seed_lo, seed_hi])`.
//! `step` is the row's decode step (`SamplingParams::row_steps`, a device buffer in the
//! device API): a decode loop that advances it draws fresh noise every step without a new seed,
//! so a captured CUDA graph replays with new noise. Step 0 is the noise of a launch without steps.
//! Indexing by the *global* vocabulary index makes the noise independent of tiling,
//! thread count, backend and tensor-parallel sharding. Four consecutive tokens of one
//! row share one Philox call, which is how both backends lay out their epilogues.
//!
//! Bits become a uniform from their top 24 bits, `u = (k + ½)·2⁻²⁴` with
//! `k = bits >> 8`, exactly in (0, 1). That value needs 25 significant bits, one more
//! than f32 holds, so the f32 algorithm ([`gumbel_f32`]) carries it as a pair
//! `u = uh + ul` and computes `-ln u = -(ln uh + ul/uh)`, which is exact to first order.

use crate::math::{ln_f32, ln_f64};

/// Philox-4x32 multiplier of words 0 and 1 (Salmon et al., 2011).
pub const PHILOX_M0: u32 = 0xD251_1F53;
/// Philox-4x32 multiplier of words 2 and 3.
pub const PHILOX_M1: u32 = 0xCD9E_8D57;
/// Philox key schedule increment of key word 0 (the golden ratio).
pub const PHILOX_W0: u32 = 0x9E37_79B9;
/// Philox key schedule increment of key word 1 (√3 − 1).
pub const PHILOX_W1: u32 = 0xBB67_AE85;
/// Rounds of Philox-4x32-10.
pub const PHILOX_ROUNDS: usize = 10;

/// Largest |gumbel_f32 − gumbel_f64| over all inputs (checked exhaustively over
/// structured inputs and randomly elsewhere in this module's tests).
pub const GUMBEL_F32_ABS_ERROR: f64 = 4.0e-6;

/// Philox-4x32 with 10 rounds, as specified by Salmon et al. (Random123).
#[inline]
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = ctr;
    let mut k = key;
    for round in 0..PHILOX_ROUNDS {
        if round > 0 {
            k[0] = k[0].wrapping_add(PHILOX_W0);
            k[1] = k[1].wrapping_add(PHILOX_W1);
        }
        let p0 = u64::from(PHILOX_M0) * u64::from(c[0]);
        let p1 = u64::from(PHILOX_M1) * u64::from(c[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// What a Philox call's noise is for. Its code is the low two bits of counter word 3, so the
/// streams never share a counter whatever the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum NoiseStream {
    /// Per-token Gumbel noise (stage one, the filter's draw, the reference).
    Token = 0,
    /// The tensor-parallel merge's choice of shard (`sharded::shard_noise_bits`).
    Shard = 1,
    /// Speculative verification: acceptance uniforms.
    SpecAccept = 2,
    /// Speculative verification: residual draws.
    SpecResidual = 3,
}

/// Bits of the per-row step in counter word 3 (the low two bits name the [`NoiseStream`]);
/// a step counts modulo `2^STEP_BITS`.
pub const STEP_BITS: u32 = 30;

/// Counter word 3 of a Philox call: `(step mod 2^30) · 4 + stream`. A decode step that
/// increments `step` draws fresh noise for every token; step 0 is the noise of a launch that
/// gives no steps.
pub const fn counter_word3(step: u32, stream: NoiseStream) -> u32 {
    // `<< 2` drops the step's top two bits: steps count modulo 2^STEP_BITS.
    (step << 2) | stream as u32
}

/// The Philox key for a 64-bit seed.
pub fn key(seed: u64) -> [u32; 2] {
    [seed as u32, (seed >> 32) as u32]
}

/// The Philox counter whose output word `vocab % 4` is the noise for this token at `step`.
pub fn counter(row: u32, sample: u32, vocab: u32, step: u32) -> [u32; 4] {
    [vocab >> 2, row, sample, counter_word3(step, NoiseStream::Token)]
}

/// The 32 noise bits of one (seed, row, sample, vocab) token at decode step `step`.
pub fn noise_bits(seed: u64, row: u32, sample: u32, vocab: u32, step: u32) -> u32 {
    philox4x32_10(counter(row, sample, vocab, step), key(seed))[(vocab & 3) as usize]
}

/// The uniform in (0, 1) that `bits` stand for, exactly.
pub fn uniform_f64(bits: u32) -> f64 {
    (f64::from(bits >> 8) + 0.5) * (1.0 / 16_777_216.0)
}

/// Gumbel noise in float64: the reference, and speculative verification's residual draw
/// (with [`ln_f64`], whose bits the device's decision kernel computes too).
pub fn gumbel_f64(bits: u32) -> f64 {
    -ln_f64(-ln_f64(uniform_f64(bits)))
}

/// Gumbel noise in f32, the algorithm every backend emits op for op.
#[inline]
pub fn gumbel_f32(bits: u32) -> f32 {
    let n = ((bits >> 8) << 1) | 1; // 2k + 1 < 2^25
    let nf = n as f32; // round to nearest even: n or n ± 1
    let residual = n as i32 - nf as u32 as i32; // -1, 0 or 1
    let uh = nf * TWO_POW_M25;
    let ul = residual as f32 * TWO_POW_M25;
    let e = -(ln_f32(uh) + ul / uh);
    -ln_f32(e)
}

/// 2⁻²⁵.
pub const TWO_POW_M25: f32 = 2.980_232_2e-8;

/// An upper bound on [`gumbel_f32`] over all 2³² inputs: the exact maximum over the top 2¹⁶
/// uniforms (where the maximum lies), and at least the ~5.5 that all smaller ones stay under.
/// A token whose transformed logit plus this cannot beat a score already drawn for its row
/// cannot win, so backends may skip its noise (DESIGN.md "Noise is drawn only where it can
/// change a winner"): the skip changes no sample.
pub fn gumbel_f32_upper_bound() -> f32 {
    static BOUND: std::sync::OnceLock<f32> = std::sync::OnceLock::new();
    *BOUND.get_or_init(|| {
        // gumbel_f32 reads only bits >> 8, so k covers every input.
        ((1u32 << 24) - (1 << 16)..1 << 24).map(|k| gumbel_f32(k << 8)).fold(6.0f32, f32::max)
    })
}

/// The leading ones `L` of the 24-bit uniform index `bits >> 8` of a noise word, as the
/// kernels count them: `clz(!bits | 0xff)`.
pub fn uniform_leading_ones(bits: u32) -> u32 {
    (!bits | 0xff).leading_zeros()
}

/// An upper bound on [`gumbel_f32`]`(bits)` from [`uniform_leading_ones`]`(bits) = L`: then
/// `u ≤ 1 − 2^−(L+1)`, and `−ln(−ln u) ≤ −ln(1 − u) ≤ (L + 1)·ln 2`, plus
/// [`GUMBEL_BUCKET_SLACK`] for `gumbel_f32`'s rounding (the bound is tight at `L = 24`).
/// Backends compute it with exactly these f32 operations (`(L + 1)` converted, times `ln 2`,
/// plus the slack); a test checks it for every input.
pub fn gumbel_bucket_bound(leading_ones: u32) -> f32 {
    (leading_ones as f32 + 1.0) * std::f32::consts::LN_2 + GUMBEL_BUCKET_SLACK
}

/// What [`gumbel_bucket_bound`] adds for the rounding of [`gumbel_f32`].
pub const GUMBEL_BUCKET_SLACK: f32 = 1.0 / 64.0;

/// Which noise a stage-one kernel skips with the bounds above (DESIGN.md "Noise is drawn only
/// where it can change a winner"), a config knob of both backends. Every choice samples the
/// same tokens bit for bit (a skipped token's score could not have won); they differ in code
/// and work: the tests cost compare-and-branch code on every quad and save Philox calls and
/// logarithms. Only a tile's own candidate may differ: a tile none of whose tokens can win may
/// report another of its tokens, or none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NoiseSkip {
    /// Every token of a sampled row draws its noise: the shortest epilogue.
    Never,
    /// A quad (or, once its uniforms are known, a row's four tokens) whose best logit plus
    /// the Gumbel bound does not beat the running best of its (row, sample) in the tile (on
    /// the GPU, the thread's share of the tile) draws no noise. Each tile's candidate is then
    /// its own best token, whatever other tiles hold.
    InTile,
    /// [`NoiseSkip::InTile`], and also against the row bound: the best score a tile of the
    /// launch has published for the (row, sample) (GPU: `row_bounds`, zeroed before each
    /// launch; CPU: `KernelArgs::row_bounds`), strictly, since that token may come after the
    /// quad's. On the CPU it also gates the top lists' insertions by the row's list bound
    /// (DESIGN.md step 6b's CPU paragraph), which changes no merged list either.
    #[default]
    CrossTile,
}

impl NoiseSkip {
    /// Whether kernels of this choice read and publish the launch's row bounds.
    pub fn uses_row_bounds(self) -> bool {
        self == NoiseSkip::CrossTile
    }

    /// Whether kernels of this choice test noise against a bound at all.
    pub fn tests_bounds(self) -> bool {
        self != NoiseSkip::Never
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gumbel_bucket_bound_covers_every_input() {
        // gumbel_f32 reads only bits >> 8, so k covers every input.
        for k in 0..1u32 << 24 {
            let bits = k << 8;
            assert!(gumbel_f32(bits) <= gumbel_bucket_bound(uniform_leading_ones(bits)), "k = {k:#x}");
        }
        // Tight where it matters: within 1.4 of the largest noise of each bucket (ln 2 from
        // rounding L + 1 up, the rest from −ln(−ln u) < −ln(1 − u)).
        for leading_ones in 0..=24u32 {
            // The bucket's largest k: its leading ones, the zero after them, then all ones.
            let all = (1u32 << 24) - 1;
            let k = if leading_ones == 24 { all } else { all & !(1 << (23 - leading_ones)) };
            assert_eq!(uniform_leading_ones(k << 8), leading_ones);
            assert!(gumbel_bucket_bound(leading_ones) - gumbel_f32(k << 8) < 1.4, "L = {leading_ones}");
        }
    }

    #[test]
    fn gumbel_upper_bound_covers_every_input() {
        let bound = gumbel_f32_upper_bound();
        assert!(bound > 17.0 && bound < 18.0, "{bound}");
        assert_eq!(bound, gumbel_f32(((1 << 24) - 1) << 8), "the largest uniform gives the largest noise");
        for k in (0..1u32 << 24).step_by(7) {
            assert!(gumbel_f32(k << 8) <= bound);
        }
    }

    // Known-answer vectors from Random123's kat_vectors (philox4x32 10 rounds).
    #[test]
    fn philox_known_answers() {
        assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
        assert_eq!(
            philox4x32_10([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0]),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn two_pow_m25_is_exact() {
        assert_eq!(TWO_POW_M25, 2f32.powi(-25));
    }

    #[test]
    fn uniform_is_open_interval() {
        assert!(uniform_f64(0) > 0.0);
        assert!(uniform_f64(u32::MAX) < 1.0);
    }

    fn check(bits: u32) {
        let (a, b) = (f64::from(gumbel_f32(bits)), gumbel_f64(bits));
        assert!((a - b).abs() <= GUMBEL_F32_ABS_ERROR, "bits {bits:#x}: f32 {a} vs f64 {b}");
    }

    #[test]
    fn gumbel_f32_matches_f64_at_the_edges() {
        // Both tails, the 2^23 boundary where the pair form starts to matter, and every
        // value of the top 2^12 and bottom 2^12 of k.
        for k in (0..4096u32).chain((1 << 23) - 4096..(1 << 23) + 4096).chain((1 << 24) - 4096..1 << 24) {
            check(k << 8);
            check((k << 8) | 0xff);
        }
    }

    #[test]
    fn gumbel_f32_matches_f64_on_a_sweep() {
        let mut x = 0x1234_5678u32;
        for _ in 0..2_000_000 {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            check(x);
        }
    }

    #[test]
    fn noise_depends_on_every_coordinate() {
        let base = noise_bits(7, 3, 1, 1001, 0);
        assert_ne!(base, noise_bits(8, 3, 1, 1001, 0));
        assert_ne!(base, noise_bits(7, 4, 1, 1001, 0));
        assert_ne!(base, noise_bits(7, 3, 2, 1001, 0));
        assert_ne!(base, noise_bits(7, 3, 1, 1002, 0));
        assert_ne!(base, noise_bits(7, 3, 1, 1005, 0));
        assert_ne!(base, noise_bits(7, 3, 1, 1001, 1));
    }

    #[test]
    fn step_zero_is_the_stepless_counter() {
        // A launch without steps keeps the noise it had before steps existed: word 3 = 0.
        assert_eq!(counter(3, 1, 1001, 0), [250, 3, 1, 0]);
        assert_eq!(counter(3, 1, 1001, 5), [250, 3, 1, 20]);
    }

    #[test]
    fn steps_wrap_modulo_2_pow_30_and_never_meet_another_stream() {
        assert_eq!(counter_word3(1 << STEP_BITS, NoiseStream::Token), counter_word3(0, NoiseStream::Token));
        assert_eq!(counter_word3(u32::MAX, NoiseStream::Token), counter_word3((1 << STEP_BITS) - 1, NoiseStream::Token));
        for step in [0, 1, 2, 77, (1 << STEP_BITS) - 1] {
            let words: Vec<u32> = [NoiseStream::Token, NoiseStream::Shard, NoiseStream::SpecAccept, NoiseStream::SpecResidual]
                .iter()
                .map(|&s| counter_word3(step, s))
                .collect();
            for (i, a) in words.iter().enumerate() {
                assert!(words[i + 1..].iter().all(|b| b != a), "step {step}: {words:?}");
            }
        }
    }
}
