//! A row's logsumexp as an exact, order-independent sum (DESIGN.md step 7).
//!
//! Every backend sums `exp(x)` over a row's allowed tokens in pieces (per thread, per lane,
//! per warp, per vocabulary tile, per shard) and in orders that depend on the tile config,
//! the schedule and the thread count. Floating-point sums would make the logsumexp, and so
//! every logprob, depend on them. Here each token's term is a fixed-point integer in an
//! absolute window of the logit axis, and pieces are added as integers: the sum is the same
//! in any order and any grouping, so a row's logsumexp is bitwise the same whatever the batch,
//! the tiles or the schedule (the batch-invariance guarantee, DESIGN.md "Batch invariance").
//!
//! - Token term ([`LseTerm::of`]): for a finite allowed `x`, `k = floor(x / 16)` (f32),
//!   `f = x − 16·k` (exact, in `[0, 16)`), `t = math::exp_f32(f)` (in `[1, e¹⁶)`), and the term
//!   is `T = trunc(t · 2²³)` (exact: `t ≥ 1` has 23 fraction bits; `T < 2^46.1`) in window
//!   `k`, clamped to `±WINDOW_LIMIT`. Its value is `T · 2⁻²³ · e^(16k)`.
//! - A sum ([`LsePartial`], [`LseSum`]) keeps the top window `w` and the exact integer sums of
//!   the terms in windows `w`, `w − 1` and `w − 2`; terms further down are dropped. Whether a
//!   term is dropped depends only on the global top window (windows are absolute), so merging
//!   is associative and commutative. A dropped term is below `e⁻³²` of the largest one, so
//!   the dropped mass is below `V · e⁻³²` (2⁻²⁸·⁸ for V = 151936) of the total.
//! - [`LseSum::logsumexp`]: `16·w + ln(S) − 23·ln 2` with `S = s₀ + s₁·e⁻¹⁶ + s₂·e⁻³²` in f64 and
//!   `ln S = e·ln 2 + ln_f32(m)` (`S = m·2^e`, `m ∈ [1, 2)`), rounded to f32 once. Every
//!   operation is spelled out so the GPU's stage two computes the same bits.

use crate::math::{exp_f32, ln_f32};
use bytemuck::{Pod, Zeroable};

/// Nats of logit per window (a power of two, so `x / WINDOW` and `WINDOW · k` are exact).
pub const WINDOW: f32 = 16.0;
/// `1 / WINDOW`.
pub const INV_WINDOW: f32 = 1.0 / WINDOW;
/// Fixed-point scale of a term: `T = trunc(exp(f) · TERM_SCALE)`.
pub const TERM_SCALE: f32 = 8_388_608.0; // 2^23
/// `log2(TERM_SCALE)`.
pub const TERM_SCALE_LOG2: i32 = 23;
/// Windows are clamped to `[-WINDOW_LIMIT, WINDOW_LIMIT]`: a row whose largest allowed logit
/// is at or past `±WINDOW · WINDOW_LIMIT` (±2³³) has a saturated logsumexp (`±inf`).
pub const WINDOW_LIMIT: i32 = 1 << 29;
/// The window of an empty sum: below every term's, and `WINDOW_LIMIT − EMPTY_WINDOW` fits i32.
pub const EMPTY_WINDOW: i32 = -(1 << 30);
/// Windows kept below and including the top one.
pub const KEPT_WINDOWS: usize = 3;
/// Most tokens one [`LsePartial`] may sum (its u64 sums then cannot overflow:
/// `2¹⁷ · 2^46.1 < 2⁶⁴`). Stage-one tiles are validated against it.
pub const MAX_PARTIAL_TOKENS: usize = 1 << 17;
/// `e⁻¹⁶` and `e⁻³²` in f64: the weights of the two windows below the top one.
pub const WINDOW_WEIGHTS: [f64; KEPT_WINDOWS] = [1.0, 1.125_351_747_192_591_2e-7, 1.266_416_554_909_417_6e-14];

/// One token's term: `value · 2⁻²³ · e^(16·window)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LseTerm {
    /// Absolute window `floor(x / 16)`, clamped to `±WINDOW_LIMIT`.
    pub window: i32,
    /// `trunc(exp_f32(x − 16·floor(x / 16)) · 2²³)`.
    pub value: u64,
}

impl LseTerm {
    /// The term of a transformed logit, or `None` if it does not count (`-inf`: excluded;
    /// NaN; `+inf`, whose row fails as non-finite anyway).
    pub fn of(x: f32) -> Option<LseTerm> {
        if !x.is_finite() {
            return None;
        }
        let k = (x * INV_WINDOW).floor();
        let f = x - k * WINDOW;
        let t = exp_f32(f);
        let window = k.clamp(-(WINDOW_LIMIT as f32), WINDOW_LIMIT as f32) as i32;
        Some(LseTerm { window, value: (t * TERM_SCALE) as u64 })
    }
}

/// `sums` of windows `window − j` moved to a top window `to ≥ window`: entry `i` of the result
/// holds the old entry `i − (to − window)`, or 0.
fn realign<T: Copy + Default>(sums: [T; KEPT_WINDOWS], window: i32, to: i32) -> [T; KEPT_WINDOWS] {
    let shift = i64::from(to) - i64::from(window);
    std::array::from_fn(|i| {
        let j = i as i64 - shift;
        if (0..KEPT_WINDOWS as i64).contains(&j) {
            sums[j as usize]
        } else {
            T::default()
        }
    })
}

/// `a ⊕ b` for sums `(sums, top window)`: both realigned to the higher window, then added.
fn merged<T: Copy + Default + std::ops::Add<Output = T>>(a: ([T; KEPT_WINDOWS], i32), b: ([T; KEPT_WINDOWS], i32)) -> ([T; KEPT_WINDOWS], i32) {
    let top = a.1.max(b.1);
    let (x, y) = (realign(a.0, a.1, top), realign(b.0, b.1, top));
    (std::array::from_fn(|i| x[i] + y[i]), top)
}

/// One (row, vocabulary tile)'s sum, as stage one writes it (32 bytes). It sums at most
/// [`MAX_PARTIAL_TOKENS`] tokens, so its u64 sums cannot overflow.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct LsePartial {
    /// Exact sums of the terms in windows `window`, `window − 1`, `window − 2`.
    pub sums: [u64; KEPT_WINDOWS],
    /// The top window ([`EMPTY_WINDOW`] for no token).
    pub window: i32,
    /// Zero.
    pub pad: u32,
}

impl LsePartial {
    /// A tile with no counted token.
    pub const EMPTY: LsePartial = LsePartial { sums: [0; KEPT_WINDOWS], window: EMPTY_WINDOW, pad: 0 };

    /// Adds one transformed logit (nothing if it does not count; see [`LseTerm::of`]).
    pub fn add(&mut self, x: f32) {
        if let Some(t) = LseTerm::of(x) {
            let mut term = [0; KEPT_WINDOWS];
            term[0] = t.value;
            self.merge(&LsePartial { sums: term, window: t.window, pad: 0 });
        }
    }

    /// Adds another partial of the same tile (both together within [`MAX_PARTIAL_TOKENS`]).
    pub fn merge(&mut self, other: &LsePartial) {
        (self.sums, self.window) = merged((self.sums, self.window), (other.sums, other.window));
    }
}

/// A row's sum over any number of partials (u128: no overflow for any vocabulary).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LseSum {
    /// Exact sums of windows `window`, `window − 1`, `window − 2`.
    pub sums: [u128; KEPT_WINDOWS],
    /// The top window ([`EMPTY_WINDOW`] for no token).
    pub window: i32,
}

impl Default for LseSum {
    fn default() -> Self {
        LseSum::EMPTY
    }
}

impl LseSum {
    /// No token.
    pub const EMPTY: LseSum = LseSum { sums: [0; KEPT_WINDOWS], window: EMPTY_WINDOW };

    /// The sum of `partials`, in any order.
    pub fn of(partials: &[LsePartial]) -> LseSum {
        let mut s = LseSum::EMPTY;
        for p in partials {
            s.add(p);
        }
        s
    }

    /// Adds a partial.
    pub fn add(&mut self, p: &LsePartial) {
        self.merge(&LseSum { sums: p.sums.map(u128::from), window: p.window });
    }

    /// Adds another row sum (e.g. another shard's).
    pub fn merge(&mut self, other: &LseSum) {
        (self.sums, self.window) = merged((self.sums, self.window), (other.sums, other.window));
    }

    /// `ln Σ exp(x)`: `-inf` for no token, `±inf` when the top window is saturated.
    pub fn logsumexp(&self) -> f32 {
        if self.sums[0] == 0 {
            return f32::NEG_INFINITY;
        }
        if self.window >= WINDOW_LIMIT {
            return f32::INFINITY;
        }
        if self.window <= -WINDOW_LIMIT {
            return f32::NEG_INFINITY;
        }
        let s = self
            .sums
            .iter()
            .zip(WINDOW_WEIGHTS)
            .fold(0.0f64, |acc, (&v, w)| acc + u128_to_f64(v) * w);
        // s ≥ 2²³ (the top window holds at least one term ≥ 2²³): normal, positive.
        let bits = s.to_bits();
        let e = ((bits >> 52) & 0x7ff) as i32 - 1023;
        let m = f64::from_bits((bits & 0x000f_ffff_ffff_ffff) | (1023u64 << 52));
        let ln_m = f64::from(ln_f32(m as f32));
        let lse = f64::from(self.window) * f64::from(WINDOW) + f64::from(e - TERM_SCALE_LOG2) * std::f64::consts::LN_2 + ln_m;
        lse as f32
    }
}

/// `hi · 2⁶⁴ + lo` in f64, each half rounded on its own (what the GPU computes from two u64s).
pub fn u128_to_f64(v: u128) -> f64 {
    let hi = (v >> 64) as u64 as f64;
    let lo = v as u64 as f64;
    hi * 18_446_744_073_709_551_616.0 + lo
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lse_f64(xs: &[f32]) -> f64 {
        let m = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        m + xs.iter().map(|&x| (f64::from(x) - m).exp()).sum::<f64>().ln()
    }

    fn partial(xs: &[f32]) -> LsePartial {
        let mut p = LsePartial::EMPTY;
        for &x in xs {
            p.add(x);
        }
        p
    }

    /// A deterministic spread of logits over several windows, some far below the top.
    fn logits(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                ((s >> 8) as f32 / (1u32 << 24) as f32) * 90.0 - 60.0
            })
            .collect()
    }

    #[test]
    fn constants_are_what_they_say() {
        assert_eq!(TERM_SCALE, 2f32.powi(TERM_SCALE_LOG2));
        // Correctly rounded e⁻¹⁶ and e⁻³² (0x1.e355bbaee85cbp-24, 0x1.c8464f7616468p-47).
        assert_eq!(WINDOW_WEIGHTS[1].to_bits(), 0x3e7e_355b_baee_85cb);
        assert_eq!(WINDOW_WEIGHTS[2].to_bits(), 0x3d0c_8464_f761_6468);
        // The largest term fits the bound the u64 partial sums rely on.
        let biggest = LseTerm::of(f32::from_bits(16f32.to_bits() - 1)).unwrap();
        assert!(biggest.value as f64 * MAX_PARTIAL_TOKENS as f64 <= u64::MAX as f64, "{biggest:?}");
    }

    /// The GPU takes a thread's top window as the window of its largest finite logit:
    /// windows must be monotone in `x`.
    #[test]
    fn windows_are_monotone() {
        let mut xs = logits(20_000, 5);
        xs.extend([-1e30, -8.6e9, -16.0, -1e-40, -0.0, 0.0, 1e-40, 15.999999, 16.0, 8.6e9, 1e30, f32::MAX, f32::MIN]);
        xs.sort_by(f32::total_cmp);
        let windows: Vec<i32> = xs.iter().map(|&x| LseTerm::of(x).unwrap().window).collect();
        assert!(windows.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn terms_are_exact_fixed_point() {
        assert_eq!(LseTerm::of(0.0), Some(LseTerm { window: 0, value: 1 << 23 }));
        assert_eq!(LseTerm::of(16.0), Some(LseTerm { window: 1, value: 1 << 23 }));
        assert_eq!(LseTerm::of(-16.0), Some(LseTerm { window: -1, value: 1 << 23 }));
        assert_eq!(LseTerm::of(f32::NEG_INFINITY), None);
        assert_eq!(LseTerm::of(f32::NAN), None);
        assert_eq!(LseTerm::of(f32::INFINITY), None);
        // Far logits saturate their window, and their remainder is exactly 0.
        assert_eq!(LseTerm::of(1e30), Some(LseTerm { window: WINDOW_LIMIT, value: 1 << 23 }));
        assert_eq!(LseTerm::of(-1e30), Some(LseTerm { window: -WINDOW_LIMIT, value: 1 << 23 }));
    }

    #[test]
    fn logsumexp_matches_f64() {
        for (n, seed) in [(1, 1), (7, 2), (1000, 3), (151_936, 4)] {
            let xs = logits(n, seed);
            let got = LseSum::of(&[partial(&xs)]).logsumexp() as f64;
            let want = lse_f64(&xs);
            assert!((got - want).abs() <= 4e-6 * want.abs().max(1.0), "n {n}: {got} vs {want}");
        }
        assert_eq!(LseSum::of(&[partial(&[3.5])]).logsumexp(), 3.5);
        assert_eq!(LseSum::EMPTY.logsumexp(), f32::NEG_INFINITY);
        assert_eq!(LseSum::of(&[partial(&[1e30, 0.0])]).logsumexp(), f32::INFINITY);
        assert_eq!(LseSum::of(&[partial(&[-1e30])]).logsumexp(), f32::NEG_INFINITY);
    }

    /// The point of the design: any split into pieces and any merge order give the same bits.
    #[test]
    fn any_grouping_and_order_gives_the_same_bits() {
        let xs = logits(5000, 9);
        let whole = LseSum::of(&[partial(&xs)]);
        for tile in [1, 3, 4, 32, 64, 128, 256, 1000, 4999] {
            let mut parts: Vec<LsePartial> = xs.chunks(tile).map(partial).collect();
            assert_eq!(LseSum::of(&parts), whole, "tile {tile}");
            parts.reverse();
            assert_eq!(LseSum::of(&parts), whole, "tile {tile}, reversed");
            // Pairwise tree of partial merges, as lanes and warps combine them.
            while parts.len() > 1 {
                parts = parts
                    .chunks(2)
                    .map(|c| {
                        let mut p = c[0];
                        if let Some(q) = c.get(1) {
                            p.merge(q);
                        }
                        p
                    })
                    .collect();
            }
            assert_eq!(LseSum::of(&parts), whole, "tile {tile}, tree");
        }
        // Interleaved (strided) pieces, as the mma fragment layouts split a tile.
        let strided: Vec<LsePartial> = (0..8).map(|l| partial(&xs.iter().copied().skip(l).step_by(8).collect::<Vec<_>>())).collect();
        assert_eq!(LseSum::of(&strided), whole);
        // Shards merged as sums.
        let mut a = LseSum::of(&[partial(&xs[..2000])]);
        a.merge(&LseSum::of(&[partial(&xs[2000..])]));
        assert_eq!(a, whole);
    }

    #[test]
    fn far_terms_drop_by_the_global_top_window_only() {
        // A piece whose own top is low keeps terms the row's top window drops; the merge
        // drops them again, so the result equals the whole row's.
        let xs = [100.0f32, 40.0, 39.0, 60.0, 1.0, -5.0];
        let whole = LseSum::of(&[partial(&xs)]);
        let low = partial(&xs[1..3]);
        let mut hi = partial(&[xs[0], xs[3], xs[4], xs[5]]);
        hi.merge(&low);
        assert_eq!(LseSum::of(&[hi]), whole);
        assert_eq!(whole.window, 6);
        assert!((whole.logsumexp() as f64 - lse_f64(&xs)).abs() < 1e-5);
    }
}
