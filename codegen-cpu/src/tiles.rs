//! Matrix-engine tiles: one vocabulary tile's raw logits `Σ_d hidden[r,d]·weights[v,d]` for every
//! hidden row, written into a per-thread scratch that the JIT'd epilogue reads right after, so the
//! logits never leave the caches.
//!
//! Scratch layout, shared with the lowering (`lower::LogitSource::Scratch`): the tile's quad `q`
//! (tokens `v_begin + 4q .. + 4`), row `r`, lane `j` at `scratch[(q · batch + r) · 4 + j]`.
//! Tokens past the vocabulary (the last quad's padding) repeat the last weight row; the
//! epilogue masks them. With `lower::LsePartials::ScratchPass` the epilogue writes each
//! quad-row's counted logits back into the same layout for `crate::lse_pass`.
//!
//! The f32 contract of [`tile_logits_bf16`] (DESIGN.md, "CPU matrix engine"): per (row, token)
//! 16 lanes; lane `i` accumulates the pairs `(32k + 2i, 32k + 2i + 1)` of each 32-element step
//! `k` in order with `vdpbf16ps` (odd element first, then even; each addition rounded to
//! nearest-even, f32 inputs and results flushed to zero when subnormal, bf16 inputs that are
//! subnormal read as zero, products exact), then the 16 lanes are summed by a fixed tree
//! (256-bit halves, 128-bit halves, then `haddps` twice), with MXCSR's default IEEE behaviour.
//! The order depends on neither the tile, the row block nor the thread.

use crate::CpuCodegenError;

/// Most hidden rows one register block of the microkernel holds: 4 rows × 4 tokens = 16
/// accumulators, plus 4 weight vectors and one hidden vector. (6 rows, 24 accumulators, made
/// LLVM spill accumulators to the stack and ran 1.6× slower.)
#[cfg(target_arch = "x86_64")]
const ROWS: usize = 4;

/// Which 4 tokens of a tile one microkernel step reads (each token's sum is its own, so any
/// grouping computes the same bits).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum TokenOrder {
    /// A quad's 4 neighbouring rows, quad after quad: one region of 4 rows at a time, in order.
    Quads,
    /// One token of each quarter of the tile: 4 long sequential runs that the hardware
    /// prefetchers follow, where a quad's rows are 4 runs of `D` elements each. Measured on a
    /// quiet Zen 5 VM, launches at D = 4096: 26.9–27.2 ms against 30.1–31.3 at B = 2,
    /// 29.9–30.9 against 31.4–32.5 at B = 4, level at B = 8 and above (within the noise).
    Streams,
}

/// The largest batch whose tiles use [`TokenOrder::Streams`]: the memory-bound ones.
#[cfg(target_arch = "x86_64")]
const STREAM_BATCH: usize = 8;

#[cfg(target_arch = "x86_64")]
impl TokenOrder {
    /// The tile-local token that step `t` reads in lane `j`, for a tile of `4 · run` local tokens.
    fn local_token(self, j: usize, t: usize, run: usize) -> usize {
        match self {
            TokenOrder::Quads => 4 * t + j,
            TokenOrder::Streams => j * run + t,
        }
    }

    /// How many weight rows ahead of each lane's row the first row block prefetches: the next
    /// quad, or 2 rows down each stream (16 KiB at D = 4096: 6–10 % less CPU time than 1 row
    /// at B = 1; no different at D = 1024, where the hardware prefetchers keep up).
    fn prefetch_rows(self) -> usize {
        match self {
            TokenOrder::Quads => 4,
            TokenOrder::Streams => 2,
        }
    }
}

/// Bytes of hidden states one pass over a tile's tokens keeps hot (half of a 1 MiB L2). Larger
/// batches are split into row chunks, each of which streams the tile's weights again (from L3:
/// `CpuConfig::heuristic` keeps such tiles small).
pub(crate) const HIDDEN_CHUNK_BYTES: usize = 512 << 10;

/// Hidden rows per chunk at `dim`: as many as [`HIDDEN_CHUNK_BYTES`] of bf16 hold, rounded down
/// to a whole number of the engine's row blocks (`block` rows), at least one block.
pub(crate) fn chunk_rows(dim: usize, block: usize) -> usize {
    (HIDDEN_CHUNK_BYTES / (2 * dim.max(1))).max(block) / block * block
}

/// Hidden states as bf16 bit patterns, `[batch, dim]`, from the runtime's exactly widened f32.
/// Errors on a value that is not a bf16 (the engine's products would not be the contract's).
pub(crate) fn hidden_to_bf16(hidden: &[f32], dim: usize) -> Result<PreparedHidden, CpuCodegenError> {
    let mut out = PreparedHidden::zeroed(hidden.len());
    for (i, (o, &x)) in out.as_mut_slice().iter_mut().zip(hidden).enumerate() {
        let bits = x.to_bits();
        // NaN payloads below bit 16 are still NaN after truncation; the epilogue flags them.
        if bits & 0xffff != 0 && !x.is_nan() {
            return Err(CpuCodegenError::HiddenNotBf16 { row: i / dim.max(1), value: x });
        }
        *o = (bits >> 16) as u16 | if x.is_nan() { 0x40 } else { 0 };
    }
    Ok(out)
}

/// One 64-byte cache line of bf16 bit patterns.
#[repr(C, align(64))]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct CacheLine([u16; 32]);

/// A launch's hidden states in an engine's layout ([`MatrixEngine::prepare`]), starting on a
/// cache line. The AMX tile loads read its 1 KiB blocks as 16 rows of 64 bytes; from malloc's
/// 16-byte alignment every such row straddles two lines, and a launch at D = 4096, B = 64 took
/// 75–82 ms against 57–59 ms from an aligned buffer, the same process and weights
/// (BENCHMARKS.md, CPU 2026-12-07).
pub(crate) struct PreparedHidden {
    lines: Vec<CacheLine>,
    len: usize,
}

impl PreparedHidden {
    /// `len` zero elements.
    pub(crate) fn zeroed(len: usize) -> Self {
        PreparedHidden { lines: vec![CacheLine([0; 32]); len.div_ceil(32)], len }
    }

    /// The `len` elements.
    pub(crate) fn as_slice(&self) -> &[u16] {
        &bytemuck::cast_slice(&self.lines)[..self.len]
    }

    /// The `len` elements, to write.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u16] {
        &mut bytemuck::cast_slice_mut(&mut self.lines)[..self.len]
    }
}

/// f32 elements of a tile's scratch: `ceil(tile_tokens / 4)` quads × `batch` rows × 4 lanes.
pub(crate) fn scratch_len(batch: usize, vocab_tile: usize) -> usize {
    vocab_tile.div_ceil(4) * batch * 4
}

/// One tile of one launch, as every engine's tile function takes it.
pub(crate) struct TileJob<'a> {
    /// The hidden states as the engine's [`MatrixEngine::prepare`] laid them out.
    pub hidden: &'a [u16],
    pub batch: usize,
    pub dim: usize,
    /// `vocab × dim` little-endian bf16.
    pub weights: *const u8,
    pub vocab: usize,
    /// The tile's tokens, `v_begin..v_end` (`v_end ≤ vocab`).
    pub v_begin: usize,
    pub v_end: usize,
}

/// An engine's tile function: the tile's logits into the scratch (layout above).
pub(crate) type TileFn = unsafe fn(&TileJob<'_>, &mut [f32]);

/// Lays a launch's f32 hidden states (`[batch, dim]`, bf16 values) out for a tile function.
pub(crate) type PrepareFn = fn(&[f32], usize, usize) -> Result<PreparedHidden, CpuCodegenError>;

/// A matrix engine: how it lays out a launch's hidden states once, and its tile function.
#[derive(Clone, Copy)]
pub(crate) struct MatrixEngine {
    /// The launch's f32 hidden states (`[batch, dim]`, bf16 values) in the tile function's layout.
    pub prepare: PrepareFn,
    /// One tile's logits into the scratch.
    pub tiles: TileFn,
}

/// The matrix engine of `engine` on this architecture (`None` for the fused Cranelift engine).
pub(crate) fn for_engine(engine: crate::CpuEngine) -> Option<MatrixEngine> {
    match engine {
        crate::CpuEngine::Cranelift => None,
        #[cfg(target_arch = "x86_64")]
        crate::CpuEngine::Avx512Bf16 => Some(MatrixEngine { prepare: |h, _, dim| hidden_to_bf16(h, dim), tiles: tile_logits_bf16 }),
        #[cfg(target_arch = "x86_64")]
        crate::CpuEngine::AmxBf16 => Some(MatrixEngine {
            prepare: |h, batch, dim| Ok(crate::amx::pack_hidden(hidden_to_bf16(h, dim)?.as_slice(), batch, dim)),
            tiles: crate::amx::tile_logits,
        }),
        #[cfg(not(target_arch = "x86_64"))]
        crate::CpuEngine::Avx512Bf16 | crate::CpuEngine::AmxBf16 => None,
    }
}

/// One tile's logits, `[quad][row][4]`, for tokens `v_begin..v_end` (`v_end ≤ vocab`), 4 tokens
/// a step in [`TokenOrder::Streams`] up to [`STREAM_BATCH`] rows and [`TokenOrder::Quads`] above.
///
/// # Safety
/// The host has `avx512f`, `avx512bw`, `avx512dq` and `avx512bf16` (`CpuEngine::Avx512Bf16.
/// missing_host_feature()` is `None`); `weights` points to `vocab × dim` little-endian bf16; `hidden` holds
/// `batch × dim` bf16 (the fields of `job`); `scratch` holds at least `scratch_len(batch, v_end − v_begin)` floats.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn tile_logits_bf16(job: &TileJob<'_>, scratch: &mut [f32]) {
    let &TileJob { hidden, batch, dim, weights, vocab, v_begin, v_end } = job;
    debug_assert!(hidden.len() == batch * dim && v_end <= vocab && v_begin < v_end);
    debug_assert!(scratch.len() >= scratch_len(batch, v_end - v_begin));
    let out = scratch.as_mut_ptr();
    let weights = weights.cast::<u16>();
    // Steps `0..run` cover local tokens `0..4·run` in either order; `4·run ≤ scratch_len`'s
    // tokens, and the local tokens past the tile (only in a last, partial quad) read the last
    // weight row and land in padding lanes that the epilogue masks.
    let run = (v_end - v_begin).div_ceil(4);
    // Memory-bound batches read 4 streams; larger ones neighbouring rows (see `TokenOrder`).
    let order = if batch <= STREAM_BATCH { TokenOrder::Streams } else { TokenOrder::Quads };
    let ahead = order.prefetch_rows() * dim;
    // Rows in chunks whose hidden states stay in L2 while the tile's tokens stream past them
    // (with all rows at once, B = 256 at D = 4096 re-read 2 MiB from L3 for every token group).
    let chunk_rows = chunk_rows(dim, ROWS);
    for chunk in (0..batch).step_by(chunk_rows) {
        let chunk_end = (chunk + chunk_rows).min(batch);
        for t in 0..run {
            let local = [0, 1, 2, 3].map(|j| order.local_token(j, t, run));
            // SAFETY: rows are clamped into the vocabulary; `local < 4·run` is inside the scratch.
            let w = local.map(|l| unsafe { weights.add((v_begin + l).min(vocab - 1) * dim) });
            let o = local.map(|l| unsafe { out.add((l / 4 * batch) * 4 + l % 4) });
            group_all_rows(hidden, dim, w, ahead, chunk, chunk_end, o);
        }
    }
}

/// Rows `r0..r_end` of one token group (4 tokens, not necessarily neighbours), in register
/// blocks of up to [`ROWS`] rows; row `r`'s logit of token `j` goes to `out[j] + 4r`.
///
/// # Safety
/// As [`tile_logits_bf16`]; `w` are the group's 4 weight rows, each `out[j] + 4r` is writable
/// for every row `r < r_end`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn group_all_rows(hidden: &[u16], dim: usize, w: [*const u16; 4], ahead: usize, r0: usize, r_end: usize, out: [*mut f32; 4]) {
    let mut r = r0;
    while r < r_end {
        let rows = (r_end - r).min(ROWS);
        // The first row block streams the group from memory and prefetches the next one;
        // later ones find it in cache.
        let first = r == r0;
        // SAFETY: the caller's guarantees; rows `r..r + rows` exist.
        unsafe {
            let h = hidden.as_ptr().add(r * dim);
            let o = out.map(|p| p.add(r * 4));
            // One or two rows are the memory-bound batches: every block prefetches.
            match (rows, first) {
                (1, _) => group_rows::<1, true>(h, w, dim, ahead, o),
                (2, _) => group_rows::<2, true>(h, w, dim, ahead, o),
                (3, true) => group_rows::<3, true>(h, w, dim, ahead, o),
                (3, false) => group_rows::<3, false>(h, w, dim, ahead, o),
                (_, true) => group_rows::<ROWS, true>(h, w, dim, ahead, o),
                (_, false) => group_rows::<ROWS, false>(h, w, dim, ahead, o),
            }
        }
        r += rows;
    }
}

/// `R` hidden rows (`h`, row stride `dim`) against 4 weight rows (each token's 4 independent
/// `vdpbf16ps` chains: one row after the other was a single chain, bound by its latency):
/// row `i`'s logit of token `j` goes to `out[j] + 4i`. With `PREFETCH`, each step also
/// prefetches the same columns `ahead` elements past each weight row (`TokenOrder::prefetch_rows`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16")]
unsafe fn group_rows<const R: usize, const PREFETCH: bool>(h: *const u16, w: [*const u16; 4], dim: usize, ahead: usize, out: [*mut f32; 4]) {
    use std::arch::x86_64::*;
    #[inline(always)]
    fn bh(x: __m512i) -> __m512bh {
        // SAFETY: both are 512 bits of plain data.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(x) }
    }
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    let steps = dim / 32;
    for k in 0..steps {
        let off = 32 * k;
        if PREFETCH {
            for p in w {
                // Past the tile this may point outside the weights: a prefetch never faults,
                // and `wrapping_add` makes no claim about the allocation.
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off + ahead).cast());
            }
        }
        // SAFETY: `off + 32 ≤ dim` for every row read.
        let wv = w.map(|p| bh(unsafe { _mm512_loadu_si512(p.add(off).cast()) }));
        for (i, acc_row) in acc.iter_mut().enumerate() {
            let hv = bh(unsafe { _mm512_loadu_si512(h.add(i * dim + off).cast()) });
            for j in 0..4 {
                acc_row[j] = _mm512_dpbf16_ps(acc_row[j], hv, wv[j]);
            }
        }
    }
    let tail = dim % 32;
    if tail != 0 {
        // Zeroed lanes add 0·0 = +0: no effect on any sum (a -0 sum of products stays -0 only
        // when every product is -0, and +0 + -0 = +0 matches the exact zero sum).
        let mask: __mmask32 = (1u32 << tail) - 1;
        let off = 32 * steps;
        let wv = w.map(|p| bh(unsafe { _mm512_maskz_loadu_epi16(mask, p.add(off).cast()) }));
        for (i, acc_row) in acc.iter_mut().enumerate() {
            let hv = bh(unsafe { _mm512_maskz_loadu_epi16(mask, h.add(i * dim + off).cast()) });
            for j in 0..4 {
                acc_row[j] = _mm512_dpbf16_ps(acc_row[j], hv, wv[j]);
            }
        }
    }
    for (i, acc_row) in acc.iter().enumerate() {
        let lanes = acc_row.map(|a| {
            let y = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps::<1>(a));
            _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps::<1>(y))
        });
        let sums = _mm_hadd_ps(_mm_hadd_ps(lanes[0], lanes[1]), _mm_hadd_ps(lanes[2], lanes[3]));
        let mut logits = [0.0f32; 4];
        // SAFETY: `logits` has 4 floats; each `out[j] + 4i` is writable (the caller's guarantee).
        unsafe {
            _mm_storeu_ps(logits.as_mut_ptr(), sums);
            for (j, &x) in logits.iter().enumerate() {
                *out[j].add(4 * i) = x;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PreparedHidden;

    #[test]
    fn prepared_hidden_starts_on_a_cache_line_and_has_its_length() {
        for len in [0, 1, 31, 32, 33, 4096 * 64 + 7] {
            let mut h = PreparedHidden::zeroed(len);
            assert_eq!(h.as_slice().len(), len);
            assert_eq!(h.as_slice().as_ptr() as usize % 64, 0, "len {len}");
            if let Some(last) = h.as_mut_slice().last_mut() {
                *last = 0x3f80;
            }
            assert!(h.as_slice().iter().rev().skip(1).all(|&x| x == 0));
        }
    }
}
