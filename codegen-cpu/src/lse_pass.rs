//! A tile's logsumexp partials (`abi::LsePartial`, DESIGN.md step 7) from its transformed
//! logits, 16 lanes at a time with AVX-512, for the engines whose logits come through the
//! scratch (`LogitSource::Scratch`).
//!
//! The JIT'd epilogue works on quads (128-bit lanes), where a token's term and its window's
//! running sums cost ~40 instructions; this pass costs a few per token. The epilogue leaves each
//! quad-row's transformed logits in place of its raw ones, `-inf` for a token that does not
//! count (masked, past the vocabulary, or in a quad whose raw logits poisoned the row), and
//! the raw mode's counted raw logits in a second half of the scratch
//! (`lower::LseSums::ScratchPass`); after it returns this pass writes every row's partials
//! for the tile from each. Per row it takes the
//! largest logit (its window is the partial's top), then adds each counted token's term
//! `LseTerm::of(x)` to the sum of its window when that is one of the three kept: the integers
//! `LsePartial::add` reaches token by token, in any order (windows are absolute).

#[cfg(target_arch = "x86_64")]
use flashsample_abi::lse::{LseTerm, INV_WINDOW, KEPT_WINDOWS, TERM_SCALE, WINDOW, WINDOW_LIMIT};
#[cfg(target_arch = "x86_64")]
use flashsample_abi::math::{EXP_C, LN2_HI, LN2_LO, LOG2_E};
use flashsample_abi::LsePartial;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Whether this host runs the pass (AVX-512 F and DQ); otherwise the epilogue keeps the
/// partials itself.
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512dq")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Writes `partials[r]` for every row `r < batch` from a tile's `quads` quads of transformed
/// logits in `scratch` (quad `q`, row `r`, lane `j` at `scratch[(q · batch + r) · 4 + j]`,
/// `-inf` where a token does not count).
///
/// # Safety
/// [`available`] holds; `scratch` holds `quads · batch · 4` floats; `partials(r)` is a valid,
/// exclusive pointer to row `r`'s partial of this tile.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn write_partials(scratch: &[f32], batch: usize, quads: usize, partials: impl Fn(usize) -> *mut LsePartial) {
    debug_assert!(scratch.len() >= quads * batch * 4);
    for row in 0..batch {
        // SAFETY: the caller's: the features are present, the scratch covers the quads and
        // the partial's pointer is valid.
        unsafe { *partials(row) = row_partial(scratch.as_ptr(), batch, quads, row) };
    }
}

/// [`write_partials`] where the pass is not [`available`] (the kernel never selects it there):
/// `LsePartial::add` token by token.
///
/// # Safety
/// `scratch` holds `quads · batch · 4` floats; `partials(r)` is a valid, exclusive pointer.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) unsafe fn write_partials(scratch: &[f32], batch: usize, quads: usize, partials: impl Fn(usize) -> *mut LsePartial) {
    for row in 0..batch {
        let mut p = LsePartial::EMPTY;
        for q in 0..quads {
            scratch[(q * batch + row) * 4..][..4].iter().for_each(|&x| p.add(x));
        }
        // SAFETY: the caller's.
        unsafe { *partials(row) = p };
    }
}

/// Four quads of `row` (quad `q0 ..`, `-inf` past `quads`) as one vector.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn load16(scratch: *const f32, batch: usize, quads: usize, row: usize, q0: usize) -> __m512 {
    let ninf = _mm_set1_ps(f32::NEG_INFINITY);
    let quad = |q: usize| {
        if q < quads {
            // SAFETY: quad `q < quads` of `row < batch` lies inside the scratch (the caller's).
            unsafe { _mm_loadu_ps(scratch.add((q * batch + row) * 4)) }
        } else {
            ninf
        }
    };
    let v = _mm512_castps128_ps512(quad(q0));
    let v = _mm512_insertf32x4::<1>(v, quad(q0 + 1));
    let v = _mm512_insertf32x4::<2>(v, quad(q0 + 2));
    _mm512_insertf32x4::<3>(v, quad(q0 + 3))
}

/// `abi::math::exp_f32` lane-wise for `f ∈ [0, 16)`, where its input clamp and final select
/// change nothing: the same operations (`mul_add` as one fused multiply-add each).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
fn exp_in_window(f: __m512) -> __m512 {
    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    let n = _mm512_roundscale_ps::<NEAREST>(_mm512_mul_ps(f, _mm512_set1_ps(LOG2_E)));
    // `-n`: the sign bit flipped, as Rust's negation.
    let neg_n = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(n), _mm512_set1_epi32(i32::MIN)));
    let r = _mm512_fmadd_ps(neg_n, _mm512_set1_ps(LN2_HI), f);
    let r = _mm512_fmadd_ps(neg_n, _mm512_set1_ps(LN2_LO), r);
    let p = _mm512_fmadd_ps(r, _mm512_set1_ps(EXP_C[5]), _mm512_set1_ps(EXP_C[4]));
    let p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(EXP_C[3]));
    let p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(EXP_C[2]));
    let p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(EXP_C[1]));
    let p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(EXP_C[0]));
    let p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.0));
    let p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.0));
    let biased = _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127));
    let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(biased));
    _mm512_mul_ps(p, scale)
}

/// Row `row`'s partial of the tile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn row_partial(scratch: *const f32, batch: usize, quads: usize, row: usize) -> LsePartial {
    // SAFETY (every `load16`): the caller's bounds.
    let mut top = _mm512_set1_ps(f32::NEG_INFINITY);
    for q0 in (0..quads).step_by(4) {
        top = _mm512_max_ps(top, unsafe { load16(scratch, batch, quads, row, q0) });
    }
    let Some(top) = LseTerm::of(_mm512_reduce_max_ps(top)) else {
        return LsePartial::EMPTY;
    };
    let top_window = _mm512_set1_epi32(top.window);
    let mut acc = [[_mm512_setzero_si512(); 2]; KEPT_WINDOWS];
    for q0 in (0..quads).step_by(4) {
        let x = unsafe { load16(scratch, batch, quads, row, q0) };
        let counted = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(f32::NEG_INFINITY));
        if counted == 0 {
            continue;
        }
        // `LseTerm::of`: k = floor(x / 16), f = x − 16·k ∈ [0, 16), T = exp_f32(f) · 2²³
        // (exact), the window k clamped to ±WINDOW_LIMIT.
        const FLOOR: i32 = _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC;
        let k = _mm512_roundscale_ps::<FLOOR>(_mm512_mul_ps(x, _mm512_set1_ps(INV_WINDOW)));
        let f = _mm512_sub_ps(x, _mm512_mul_ps(k, _mm512_set1_ps(WINDOW)));
        let term = _mm512_mul_ps(exp_in_window(f), _mm512_set1_ps(TERM_SCALE));
        let lim = WINDOW_LIMIT as f32;
        let kc = _mm512_min_ps(_mm512_max_ps(k, _mm512_set1_ps(-lim)), _mm512_set1_ps(lim));
        let below = _mm512_sub_epi32(top_window, _mm512_cvttps_epi32(kc));
        // Terms are integers below 2^46.1: their truncation to i64 is exact.
        let lo = _mm512_cvttps_epi64(_mm512_castps512_ps256(term));
        let hi = _mm512_cvttps_epi64(_mm512_extractf32x8_ps::<1>(term));
        for (j, sums) in acc.iter_mut().enumerate() {
            let hit = _mm512_mask_cmpeq_epi32_mask(counted, below, _mm512_set1_epi32(j as i32));
            sums[0] = _mm512_mask_add_epi64(sums[0], hit as __mmask8, sums[0], lo);
            sums[1] = _mm512_mask_add_epi64(sums[1], (hit >> 8) as __mmask8, sums[1], hi);
        }
    }
    // A tile sums at most MAX_PARTIAL_TOKENS terms, so every sum fits u64 and the lanes'
    // wrapping i64 adds give it exactly.
    let sums = acc.map(|[a, b]| (_mm512_reduce_add_epi64(a) as u64).wrapping_add(_mm512_reduce_add_epi64(b) as u64));
    LsePartial { sums, window: top.window, pad: 0 }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use flashsample_abi::lse::EMPTY_WINDOW;

    /// The pass against `LsePartial::add` token by token, on rows with every kind of token:
    /// uncounted ones, windows far below the top, ties at window edges, a ragged last quad.
    #[test]
    fn partials_equal_the_abi_sum_of_each_token() {
        if !available() {
            eprintln!("skipped: no AVX-512 F and DQ on this host");
            return;
        }
        let (batch, tokens) = (5usize, 203usize);
        let quads = tokens.div_ceil(4);
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut scratch = vec![f32::NEG_INFINITY; quads * batch * 4];
        let mut expected = vec![LsePartial::EMPTY; batch];
        for row in 0..batch {
            for t in 0..tokens {
                let u = (next() >> 40) as f32 / (1u64 << 24) as f32;
                let x = match (row, next() % 8) {
                    // Row 4 counts nothing.
                    (4, _) => f32::NEG_INFINITY,
                    (_, 0) => f32::NEG_INFINITY,
                    (_, 1) => 16.0 * ((next() % 9) as f32 - 4.0),
                    (r, _) => (u - 0.5) * 40.0 * (r as f32 + 1.0) + 3.0,
                };
                scratch[((t / 4) * batch + row) * 4 + t % 4] = x;
                expected[row].add(x);
            }
        }
        let mut got = vec![LsePartial { sums: [7; KEPT_WINDOWS], window: 7, pad: 0 }; batch];
        let out = got.as_mut_ptr();
        // SAFETY: available() held; the scratch covers `quads` quads of `batch` rows; each
        // row's pointer is its own element of `got`.
        unsafe { write_partials(&scratch, batch, quads, |r| out.add(r)) };
        assert_eq!(got, expected);
        assert_eq!(got[4], LsePartial::EMPTY);
        assert!(got.iter().take(4).all(|p| p.window != EMPTY_WINDOW), "{got:?}");
    }
}
