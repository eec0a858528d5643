//! AMX-BF16 tiles: one vocabulary tile's raw logits for every hidden row from Intel's tile
//! matrix unit (`tdpbf16ps`: a 16 × 16 f32 block += 16 × 32 bf16 by 32 × 16 bf16 per
//! instruction), written into the same per-thread scratch as [`crate::tiles`] (layout
//! `[quad][row][4]`), which the JIT'd epilogue reads right after.
//!
//! Roles: the tile unit's `A` operand is 16 weight rows (16 tokens × 32 elements, loaded straight
//! from the `[vocab, dim]` weights with the row stride), `B` is 16 hidden rows in the unit's
//! pair-interleaved layout ([`pack_hidden`], once per launch), so a `C` block is 16 tokens ×
//! 16 hidden rows and no weight byte is ever copied.
//!
//! The f32 contract (DESIGN.md, "CPU matrix engine") is a bound, not an order: the unit's
//! internal rounding matches no sequential order of f32 additions (measured), so per (row,
//! token) each step `k` of `dim / 32` (elements `32k .. 32k + 32`, one `tdpbf16ps`) lands within
//! `17·u·(|c| + Σ|p|)` of exact; the `dim % 32` tail elements, if any, are summed in order in
//! plain f32 and added last. Every (row, token) goes through the same steps in the same order
//! whatever the tile, the block shape, the batch or the thread, so a row's logits have the
//! same bits in every launch.
//!
//! Linux hands out the tile registers only to a process that asks (`arch_prctl
//! ARCH_REQ_XCOMP_PERM`); [`missing_host_feature`] asks once and reports a refusal as a
//! missing feature, so a kernel that compiles can run.

#[cfg(target_arch = "x86_64")]
use std::arch::asm;
use std::sync::OnceLock;

/// Tokens (tile rows of `A`) and hidden rows (columns of `C`) per tile-unit block.
pub(crate) const BLOCK: usize = 16;
/// bf16 elements of one `A` row: one step of the reduction.
const STEP: usize = 32;
/// Bytes of one tile row (every tile here is 16 rows × 64 bytes).
const ROW_BYTES: usize = 64;

/// Why this host cannot run AMX tiles (`None`: it can). CPUID's AMX-TILE and AMX-BF16 bits,
/// AVX-512F for the scratch transposes, and the kernel's permission for this process.
pub(crate) fn missing_host_feature() -> Option<&'static str> {
    static MISSING: OnceLock<Option<&'static str>> = OnceLock::new();
    *MISSING.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Option<&'static str> {
    use std::arch::x86_64::__cpuid_count;
    // CPUID leaf 7 subleaf 0 is defined when leaf 0 reports ≥ 7.
    let edx = if __cpuid_count(0, 0).eax >= 7 { __cpuid_count(7, 0).edx } else { 0 };
    if edx & (1 << 24) == 0 {
        return Some("amx-tile");
    }
    if edx & (1 << 22) == 0 {
        return Some("amx-bf16");
    }
    if !std::is_x86_feature_detected!("avx512f") {
        return Some("avx512f");
    }
    request_tile_data()
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Option<&'static str> {
    Some("amx-bf16")
}

/// Asks Linux for the tile data state (XTILEDATA, state component 18) for this process; every
/// thread may use the tile registers afterwards.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_data() -> Option<&'static str> {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with this code only changes the process's permitted xsave features.
    let rc = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
    if rc == 0 {
        None
    } else {
        Some("amx tile data (the kernel refused ARCH_REQ_XCOMP_PERM)")
    }
}

#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
fn request_tile_data() -> Option<&'static str> {
    Some("amx tile data (requested on Linux only)")
}

/// Where [`pack_hidden`]'s `[batch][dim % 32]` tail elements start: after every group's blocks.
fn tails_offset(batch: usize, dim: usize) -> usize {
    groups(batch) * (dim / STEP) * BLOCK * STEP
}

/// Elements of [`pack_hidden`]'s output for `batch` rows of `dim`.
fn packed_len(batch: usize, dim: usize) -> usize {
    tails_offset(batch, dim) + batch * (dim % STEP)
}

/// Hidden row groups of [`BLOCK`] rows, rounded up to an even count so the 2 × 2 block shape
/// always has a second (zero) group.
fn groups(batch: usize) -> usize {
    batch.div_ceil(BLOCK).next_multiple_of(2)
}

/// Hidden states (bf16 bit patterns, `[batch, dim]`) in the tile unit's `B` layout: for group
/// `g` of 16 rows and step `s`, a 1 KiB block whose tile row `k` holds, for each row `n` of the
/// group, the pair of elements `32s + 2k, 32s + 2k + 1`; rows past the batch are zero. The
/// `dim % 32` tail elements follow, `[batch][tail]`.
pub(crate) fn pack_hidden(hidden: &[u16], batch: usize, dim: usize) -> crate::tiles::PreparedHidden {
    let steps = dim / STEP;
    let tail = dim % STEP;
    let mut packed = crate::tiles::PreparedHidden::zeroed(packed_len(batch, dim));
    let out = packed.as_mut_slice();
    for r in 0..batch {
        let (g, n) = (r / BLOCK, r % BLOCK);
        let row = &hidden[r * dim..][..dim];
        for s in 0..steps {
            let block = &mut out[(g * steps + s) * BLOCK * STEP..][..BLOCK * STEP];
            for k in 0..STEP / 2 {
                block[(k * BLOCK + n) * 2] = row[s * STEP + 2 * k];
                block[(k * BLOCK + n) * 2 + 1] = row[s * STEP + 2 * k + 1];
            }
        }
    }
    let tails = tails_offset(batch, dim);
    for r in 0..batch {
        out[tails + r * tail..][..tail].copy_from_slice(&hidden[r * dim + steps * STEP..][..tail]);
    }
    packed
}

/// The 64-byte tile configuration: palette 1, all eight tiles 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    const ALL_FULL: TileConfig = {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut t = 0;
        while t < 8 {
            c[16 + 2 * t] = ROW_BYTES as u8;
            c[48 + t] = BLOCK as u8;
            t += 1;
        }
        TileConfig(c)
    };
}

/// One tile's logits, `[quad][row][4]`, for tokens `v_begin..v_end` (`v_end ≤ vocab`) from
/// [`pack_hidden`]'s layout. Up to 16 rows, blocks of 16 tokens × 16 rows (1 × 1: 16 weight
/// rows streamed side by side; four blocks side by side, 64 rows, were 1.4–1.9× slower at B ≤ 4
/// and D = 1024 and 8–25 % slower at B = 8 and 16); above, 16 tokens × 64 rows (1 × 4) or 32
/// tokens × 32 rows (2 × 2) per row chunk. The blocking changes no bit: each (row, token) sums
/// its steps in the same order in every shape.
///
/// # Safety
/// [`missing_host_feature`] is `None`; `weights` points to `vocab × dim` little-endian bf16;
/// `job.hidden` is `pack_hidden` of `batch × dim` values; `scratch` holds at least
/// `tiles::scratch_len(batch, v_end − v_begin)` floats.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn tile_logits(job: &crate::tiles::TileJob<'_>, scratch: &mut [f32]) {
    let &crate::tiles::TileJob { hidden: packed, batch, dim, weights, vocab, v_begin, v_end } = job;
    debug_assert!(packed.len() == packed_len(batch, dim) && v_end <= vocab && v_begin < v_end);
    debug_assert!(scratch.len() >= crate::tiles::scratch_len(batch, v_end - v_begin));
    let weights = weights.cast::<u16>();
    let tokens = (v_end - v_begin).next_multiple_of(4);
    let token_groups = tokens.div_ceil(BLOCK);
    // Only the tile's last block can reach past the vocabulary (it starts before `v_end`, as
    // `tokens` exceeds the tile by less than a quad); its rows then come from a copy that
    // repeats the last weight row (their logits land in padding the epilogue masks, or
    // nowhere). Rows past the tile but inside the vocabulary are read in place and dropped.
    let last = v_begin + (token_groups - 1) * BLOCK;
    let padded: Vec<u16> = if last + BLOCK > vocab {
        (0..BLOCK)
            .flat_map(|i| {
                let v = (last + i).min(vocab - 1);
                // SAFETY: `v < vocab`: the row is inside the weights.
                unsafe { std::slice::from_raw_parts(weights.add(v * dim), dim) }.iter().copied()
            })
            .collect()
    } else {
        Vec::new()
    };
    // The weight rows of the block of 16 tokens starting at local token `16·g`.
    let block_rows = |g: usize| -> *const u16 {
        let v = v_begin + g * BLOCK;
        if v + BLOCK <= vocab {
            // SAFETY: rows `v .. v + 16` are inside the weights.
            unsafe { weights.add(v * dim) }
        } else {
            debug_assert_eq!(v, last);
            padded.as_ptr()
        }
    };
    let ctx = Ctx { packed, batch, dim, scratch: scratch.as_mut_ptr(), tokens };
    // SAFETY: the host has AMX (the caller's guarantee); the config describes 8 full tiles.
    unsafe { asm!("ldtilecfg [{}]", in(reg) TileConfig::ALL_FULL.0.as_ptr(), options(nostack, readonly)) };
    // Row chunks of whole 2 × 2 row-group pairs.
    let chunk_groups = crate::tiles::chunk_rows(dim, 2 * BLOCK) / BLOCK;
    if batch <= BLOCK {
        for g in 0..token_groups {
            let next = (g + 1 < token_groups).then(|| block_rows(g + 1));
            // SAFETY: as below.
            unsafe { ctx.block_1x1(block_rows(g), g, next) };
        }
    } else {
        for chunk in (0..groups(batch)).step_by(chunk_groups) {
            let chunk_end = (chunk + chunk_groups).min(groups(batch));
            if (chunk_end - chunk).is_multiple_of(4) {
                // Four row groups per weight tile: each pass streams the block once for four
                // products, where the 2 × 2 shape takes two passes (the second from L2) with
                // the memory stream idle during it.
                for g in 0..token_groups {
                    let next = (g + 1 < token_groups).then(|| [block_rows(g + 1)]);
                    for rg in (chunk..chunk_end).step_by(4) {
                        let pass = if rg == chunk { WeightPass::Stream { next } } else { WeightPass::Cached };
                        // SAFETY: as above; `rg + 3 < groups(batch)`.
                        unsafe { ctx.block_1x4(block_rows(g), g, rg, pass) };
                    }
                }
                continue;
            }
            for g in (0..token_groups).step_by(2) {
                let w = [0, 1].map(|i| block_rows((g + i).min(token_groups - 1)));
                let next = (g + 2 < token_groups).then(|| [0, 1].map(|i| block_rows((g + 2 + i).min(token_groups - 1))));
                for rg in (chunk..chunk_end).step_by(2) {
                    let pass = if rg == chunk { WeightPass::Stream { next } } else { WeightPass::Cached };
                    // SAFETY: as above; `rg + 1 < groups(batch)` (an even count).
                    unsafe { ctx.block_2x2(w, g, token_groups, rg, pass) };
                }
            }
        }
    }
    // SAFETY: releases the tile state this function configured.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// Which pass over the weight rows of a block of `N` token groups (a [`Ctx::block_1x4`] or
/// [`Ctx::block_2x2`] call) a call is.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum WeightPass<const N: usize> {
    /// The first of the row chunk: it streams the rows from memory, prefetching them ahead,
    /// and in its last steps the next blocks' first lines (`next`; [`NEXT_BLOCK_LEAD`]).
    Stream { next: Option<[*const u16; N]> },
    /// A later one: the rows are in L2.
    Cached,
}

/// What every block of one [`tile_logits`] call shares.
#[cfg(target_arch = "x86_64")]
struct Ctx<'a> {
    packed: &'a [u16],
    batch: usize,
    dim: usize,
    scratch: *mut f32,
    /// Local tokens the scratch holds (the tile's tokens rounded up to a quad).
    tokens: usize,
}

#[cfg(target_arch = "x86_64")]
impl Ctx<'_> {
    /// The packed hidden block of row group `g`, step `s`.
    fn hidden_block(&self, g: usize, s: usize) -> *const u16 {
        self.packed[(g * (self.dim / STEP) + s) * BLOCK * STEP..].as_ptr()
    }

    /// Token group `g` × the single row group, in tile 0; `next`: the next group's first weight
    /// row: up to [`SEQUENTIAL_NEXT_BLOCK_MAX_DIM`] the steps prefetch its whole block into L2
    /// ([`prefetch_next_block`]), above it the last steps its rows' first lines
    /// ([`NEXT_BLOCK_LEAD`]).
    ///
    /// # Safety
    /// As [`tile_logits`]; tiles configured; `w` has 16 rows of `dim` readable.
    unsafe fn block_1x1(&self, w: *const u16, g: usize, next: Option<*const u16>) {
        let stride = 2 * self.dim;
        // SAFETY: tile 0 is a configured accumulator.
        unsafe { asm!("tilezero tmm0", options(nostack, nomem)) };
        for s in 0..self.dim / STEP {
            let off = s * STEP;
            if self.dim <= SEQUENTIAL_NEXT_BLOCK_MAX_DIM {
                prefetch(&[w], self.dim, off);
                if let Some(n) = next {
                    prefetch_next_block(n, s);
                }
            } else {
                prefetch_streaming(&[w], next.map(|n| [n]), self.dim, s);
            }
            // SAFETY: 16 rows of 64 bytes at `w + off` with the row stride, and a 1 KiB hidden
            // block: all inside the caller's buffers.
            unsafe {
                asm!(
                    "tileloadd tmm6, [{h} + {hs}*1]",
                    "tileloadd tmm4, [{w0} + {ws}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    h = in(reg) self.hidden_block(0, s),
                    hs = in(reg) ROW_BYTES,
                    w0 = in(reg) w.add(off),
                    ws = in(reg) stride,
                    options(nostack, readonly),
                )
            };
        }
        // SAFETY: as this function's; tile 0 holds this group's logits.
        unsafe { self.emit(&mut Block::default(), 0, w, g, 0) };
    }

    /// Token group `g` × row groups `rg .. rg + 4`, in tiles 0–3 (tile `j`: row group
    /// `rg + j`): one weight tile load feeds four products; `pass` says whether the weights come
    /// from memory.
    ///
    /// # Safety
    /// As [`Self::block_1x1`]; `rg + 3` is a packed group.
    unsafe fn block_1x4(&self, w: *const u16, g: usize, rg: usize, pass: WeightPass<1>) {
        let stride = 2 * self.dim;
        // SAFETY: tiles 0–3 are configured accumulators.
        unsafe { asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem)) };
        for s in 0..self.dim / STEP {
            let off = s * STEP;
            if let WeightPass::Stream { next } = pass {
                prefetch_streaming(&[w], next, self.dim, s);
            }
            // SAFETY: as in `block_1x1`.
            unsafe {
                asm!(
                    "tileloadd tmm4, [{w0} + {ws}*1]",
                    "tileloadd tmm5, [{h0} + {hs}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm5",
                    "tileloadd tmm6, [{h1} + {hs}*1]",
                    "tdpbf16ps tmm1, tmm4, tmm6",
                    "tileloadd tmm7, [{h2} + {hs}*1]",
                    "tdpbf16ps tmm2, tmm4, tmm7",
                    "tileloadd tmm5, [{h3} + {hs}*1]",
                    "tdpbf16ps tmm3, tmm4, tmm5",
                    h0 = in(reg) self.hidden_block(rg, s),
                    h1 = in(reg) self.hidden_block(rg + 1, s),
                    h2 = in(reg) self.hidden_block(rg + 2, s),
                    h3 = in(reg) self.hidden_block(rg + 3, s),
                    hs = in(reg) ROW_BYTES,
                    w0 = in(reg) w.add(off),
                    ws = in(reg) stride,
                    options(nostack, readonly),
                )
            };
        }
        let mut c = Block::default();
        for j in 0..4 {
            // SAFETY: as this function's; tile `j` holds row group `rg + j`'s logits.
            unsafe { self.emit(&mut c, j, w, g, rg + j) };
        }
    }

    /// Token groups `g, g + 1` × row groups `rg, rg + 1`, in tiles 0–3 (tile `2·i + j`: token
    /// group `g + i`, row group `rg + j`); `pass` says whether the weights come from memory.
    ///
    /// # Safety
    /// As [`Self::block_1x1`]; `rg + 1` is a packed group.
    unsafe fn block_2x2(&self, w: [*const u16; 2], g: usize, groups: usize, rg: usize, pass: WeightPass<2>) {
        let stride = 2 * self.dim;
        // SAFETY: tiles 0–3 are configured accumulators.
        unsafe { asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem)) };
        for s in 0..self.dim / STEP {
            let off = s * STEP;
            if let WeightPass::Stream { next } = pass {
                prefetch_streaming(&w, next, self.dim, s);
            }
            // SAFETY: as in `block_1x1`.
            unsafe {
                asm!(
                    "tileloadd tmm4, [{w0} + {ws}*1]",
                    "tileloadd tmm6, [{h0} + {hs}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm7, [{h1} + {hs}*1]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tileloadd tmm5, [{w1} + {ws}*1]",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    h0 = in(reg) self.hidden_block(rg, s),
                    h1 = in(reg) self.hidden_block(rg + 1, s),
                    hs = in(reg) ROW_BYTES,
                    w0 = in(reg) w[0].add(off),
                    w1 = in(reg) w[1].add(off),
                    ws = in(reg) stride,
                    options(nostack, readonly),
                )
            };
        }
        let mut c = Block::default();
        for (i, &rows) in w.iter().enumerate().take(groups - g) {
            for j in 0..2 {
                // SAFETY: as this function's; tile `2i + j` holds this block's logits.
                unsafe { self.emit(&mut c, 2 * i + j, rows, g + i, rg + j) };
            }
        }
    }

    /// Stores tile `t` (token group `g`, weight rows `w`, row group `rg`) in `c`, adds the
    /// `dim % 32` tail products and writes its real (token, row) logits to the scratch.
    ///
    /// # Safety
    /// As [`Self::block_1x1`]; tile `t` holds that group's logits.
    unsafe fn emit(&self, c: &mut Block, t: usize, w: *const u16, g: usize, rg: usize) {
        // SAFETY: tile `t` is configured (the caller's guarantee).
        unsafe { c.store(t) };
        let rows = self.batch.saturating_sub(rg * BLOCK).min(BLOCK);
        let tail = self.dim % STEP;
        if tail != 0 {
            let full = self.dim - tail;
            let tails = &self.packed[tails_offset(self.batch, self.dim)..];
            for m in 0..BLOCK {
                // SAFETY: row `m` of the block has `dim` elements.
                let wt = unsafe { std::slice::from_raw_parts(w.add(m * self.dim + full), tail) };
                for n in 0..rows {
                    let ht = &tails[(rg * BLOCK + n) * tail..][..tail];
                    let sum = ht.iter().zip(wt).fold(0.0f32, |acc, (&h, &w)| acc + bf16(h) * bf16(w));
                    c.0[m][n] += sum;
                }
            }
        }
        let first = g * BLOCK;
        let quads = (self.tokens.saturating_sub(first)).min(BLOCK) / 4;
        // SAFETY: quads `first/4 .. + quads` and rows `rg·16 .. + rows` are inside the scratch.
        unsafe { c.scatter(self.scratch, first / 4, quads, self.batch, rg * BLOCK, rows) };
    }
}

/// How many steps (64-byte lines of each weight row) ahead the weight blocks are prefetched.
/// A tile load reads 16 rows of 64 bytes, one line from each of 16 (2 × 2: 32) rows streamed
/// side by side, more streams than the hardware prefetchers follow. Measured on the 2-vCPU
/// Sapphire Rapids VM, D = 4096, V = 151936, launches of each distance interleaved in one
/// process (BENCHMARKS.md, 2026-12-06): 2 steps took B = 1 from 91–153 to 76–98 ms (min of
/// 7–9) and B = 256 from 924 to 770; 4–16 steps and the L2 hints were no better.
const PREFETCH_STEPS: usize = 2;

/// How many lines of the next block's weight rows the last steps of a block's streaming pass
/// prefetch (one per step): the 1 × 1 blocks (B ≤ 16) above [`SEQUENTIAL_NEXT_BLOCK_MAX_DIM`]
/// and the streaming pass of the 1 × 4 and 2 × 2 ones. Each block otherwise starts its 16 or 32
/// streams cold. Before/after binaries alternating on
/// the Sapphire Rapids VM (`cpu_bench --no-peers`): at B ≤ 4, D = 1024 (32 steps a block)
/// fused/floor went from 1.26–1.27 (B = 1) and 1.34–1.36 (B = 4) to 1.16–1.21 and 1.27–1.28
/// with 8 lines, where 16 and 32 lines were no better and 2 changed nothing; at B = 64,
/// D = 4096 the launch went from 87.1–103.7 to 76.3–89.9 ms (BENCHMARKS.md, CPU 2026-12-06
/// tenth session).
const NEXT_BLOCK_LEAD: usize = 8;

/// Prefetches, for every weight row of the blocks `w`, the line [`PREFETCH_STEPS`] past `off`.
#[cfg(target_arch = "x86_64")]
fn prefetch<const N: usize>(w: &[*const u16; N], dim: usize, off: usize) {
    prefetch_at(w, dim, off + PREFETCH_STEPS * STEP);
}

/// A streaming pass's prefetches at step `s` of `dim / STEP`: the blocks `w`'s lines
/// [`PREFETCH_STEPS`] ahead, and in the last [`NEXT_BLOCK_LEAD`] steps one line of the next
/// blocks `next` (their first lines, in order), so their streams do not start cold.
#[cfg(target_arch = "x86_64")]
fn prefetch_streaming<const N: usize>(w: &[*const u16; N], next: Option<[*const u16; N]>, dim: usize, s: usize) {
    prefetch(w, dim, s * STEP);
    let steps = dim / STEP;
    if let Some(n) = next.filter(|_| s + NEXT_BLOCK_LEAD >= steps) {
        prefetch_at(&n, dim, (s + NEXT_BLOCK_LEAD - steps) * STEP);
    }
}

/// The largest `dim` whose 1 × 1 blocks prefetch the next block whole ([`prefetch_next_block`]):
/// rows of 2 KiB or less are 32-line streams, which the hardware prefetchers barely start on
/// before they end. At D = 2048 (1.06–1.11× → 1.16–1.24×) and D = 8192, B = 4 (1.02–1.03× →
/// 1.10–1.13×) the whole-block prefetch was slower than the rows' own streams
/// (BENCHMARKS.md, eleventh session).
const SEQUENTIAL_NEXT_BLOCK_MAX_DIM: usize = 1024;

/// Step `s` of a 1 × 1 block's prefetch of the next block (first weight row `next`): its lines
/// `16s .. 16s + 16` into L2, so over the block's `dim / 32` steps the whole next block
/// (`dim / 2` lines, 16 rows back to back) in address order, one block ahead, where the rows'
/// own prefetches ([`PREFETCH_STEPS`]) start 16 short streams cold at every block. Before/after
/// alternating on the Sapphire Rapids VM (`cpu_bench --no-peers`, BENCHMARKS.md eleventh
/// session): D = 1024 B = 1 from 1.17–1.23× the floor to 1.11–1.14×; into L1 it was slower
/// (1.32–1.37×), and the same for the 2 × 2 blocks' next pair slower at B = 64.
#[cfg(target_arch = "x86_64")]
fn prefetch_next_block(next: *const u16, s: usize) {
    use std::arch::x86_64::*;
    let base = next.cast::<i8>().wrapping_add(s * BLOCK * ROW_BYTES);
    for l in 0..BLOCK {
        // A prefetch never faults; `wrapping_add` makes no claim about the allocation.
        // SAFETY: SSE is baseline on x86_64.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(base.wrapping_add(l * ROW_BYTES)) };
    }
}

/// Prefetches, for every weight row of the blocks `w`, the line at element `off`.
#[cfg(target_arch = "x86_64")]
fn prefetch_at<const N: usize>(w: &[*const u16; N], dim: usize, off: usize) {
    use std::arch::x86_64::*;
    for p in w {
        for m in 0..BLOCK {
            // A prefetch never faults; `wrapping_add` makes no claim about the allocation.
            let at = p.wrapping_add(m * dim + off).cast::<i8>();
            // SAFETY: SSE is baseline on x86_64.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(at) };
        }
    }
}

fn bf16(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// One `C` tile in memory: `[token][row]` f32.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
#[derive(Default)]
struct Block([[f32; BLOCK]; BLOCK]);

#[cfg(target_arch = "x86_64")]
impl Block {
    /// Stores tile `t` (0–3) here.
    ///
    /// # Safety
    /// Tile `t` is configured.
    unsafe fn store(&mut self, t: usize) {
        let p = self.0.as_mut_ptr();
        // SAFETY: `p` has 16 rows of 64 bytes.
        unsafe {
            match t {
                0 => asm!("tilestored [{p} + {s}*1], tmm0", p = in(reg) p, s = in(reg) ROW_BYTES, options(nostack)),
                1 => asm!("tilestored [{p} + {s}*1], tmm1", p = in(reg) p, s = in(reg) ROW_BYTES, options(nostack)),
                2 => asm!("tilestored [{p} + {s}*1], tmm2", p = in(reg) p, s = in(reg) ROW_BYTES, options(nostack)),
                _ => asm!("tilestored [{p} + {s}*1], tmm3", p = in(reg) p, s = in(reg) ROW_BYTES, options(nostack)),
            }
        }
    }

    /// Writes quads `0..quads` of this block (tokens `4q .. 4q + 4`) for rows `0..rows` to the
    /// scratch's quads `quad0 + q`, rows `row0 + n`: `scratch[((quad0 + q)·batch + row0 + n)·4 + j]`.
    ///
    /// # Safety
    /// Those scratch floats are writable; `quads ≤ 4`, `rows ≤ 16`.
    #[target_feature(enable = "avx512f")]
    unsafe fn scatter(&self, scratch: *mut f32, quad0: usize, quads: usize, batch: usize, row0: usize, rows: usize) {
        use std::arch::x86_64::*;
        for q in 0..quads {
            // SAFETY: rows `4q .. 4q + 4` of the block.
            let [c0, c1, c2, c3] = [0, 1, 2, 3].map(|j| unsafe { _mm512_load_ps(self.0[4 * q + j].as_ptr()) });
            // Per 128-bit lane L: a 4 × 4 transpose, so lane L of `u[i]` is row 4L + i's 4 tokens.
            let t0 = _mm512_unpacklo_ps(c0, c1);
            let t1 = _mm512_unpackhi_ps(c0, c1);
            let t2 = _mm512_unpacklo_ps(c2, c3);
            let t3 = _mm512_unpackhi_ps(c2, c3);
            let pd = _mm512_castps_pd;
            let u = [
                _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t0), pd(t2))),
                _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t0), pd(t2))),
                _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t1), pd(t3))),
                _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t1), pd(t3))),
            ];
            let mut lanes = [[0.0f32; BLOCK]; 4];
            for (i, v) in u.iter().enumerate() {
                // SAFETY: 16 floats.
                unsafe { _mm512_storeu_ps(lanes[i].as_mut_ptr(), *v) };
            }
            let base = (quad0 + q) * batch + row0;
            for n in 0..rows {
                let (lane, i) = (n / 4, n % 4);
                // SAFETY: the caller's guarantee for row `row0 + n` of quad `quad0 + q`.
                unsafe {
                    std::ptr::copy_nonoverlapping(lanes[i][4 * lane..].as_ptr(), scratch.add((base + n) * 4), 4);
                }
            }
        }
    }
}
