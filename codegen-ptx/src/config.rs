//! Tile configurations of the stage-one kernel, their validation against device limits,
//! the launch geometry they imply, and the autotuner's search space.

use crate::PtxError;
use flashsample_ir::{DType, Pipeline, MAX_LIST_CAPACITY};
use serde::{Deserialize, Serialize};

/// The PTX target a module is generated for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Arch {
    /// Ampere / Ada (`.target sm_80`): mma.sync bf16/f16, ldmatrix, cp.async.
    Sm80,
    /// Hopper (`.target sm_90`); the PTX uses no `sm_90a` features, so it JIT-compiles forward.
    Sm90,
}

impl Arch {
    /// The target for a compute capability: 8.x → `Sm80`, 9.x and newer → `Sm90`.
    pub fn from_compute_capability(cc: (u32, u32)) -> Result<Arch, PtxError> {
        match cc.0 {
            8 => Ok(Arch::Sm80),
            9.. => Ok(Arch::Sm90),
            _ => Err(PtxError::UnsupportedArch {
                compute_capability: cc,
            }),
        }
    }

    pub fn sm_name(self) -> &'static str {
        match self {
            Arch::Sm80 => "sm_80",
            Arch::Sm90 => "sm_90",
        }
    }
}

/// Device limits, as the runtime reads them from the driver. Codegen reads no other
/// source of architectural limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuLimits {
    pub compute_capability: (u32, u32),
    pub sm_count: u32,
    /// `CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`, bytes.
    pub max_shared_per_block_optin: u32,
    pub max_threads_per_block: u32,
    pub max_regs_per_block: u32,
}

impl GpuLimits {
    /// An H200 (sm 9.0, 132 SMs, 227 KiB opt-in shared memory per block), as recorded from
    /// its driver; for tests and offline enumeration.
    pub const H200: GpuLimits = GpuLimits {
        compute_capability: (9, 0),
        sm_count: 132,
        max_shared_per_block_optin: 232_448,
        max_threads_per_block: 1024,
        max_regs_per_block: 65_536,
    };
}

/// One stage-one tile configuration. A CTA computes a `vocab_tile × batch_tile` block of
/// logits and the candidates of that vocab tile for `batch_tile` rows.
///
/// - `vocab_tile`: vocabulary rows per CTA and the candidate-buffer tile
///   ([`GpuConfig::tiles`]). A multiple of `32 · warps`: each warp owns
///   `vocab_tile / warps` rows in blocks of 32 (two m16 MMA tiles, so that every thread owns
///   whole quads of 4 consecutive tokens: one Philox call per quad).
/// - `batch_tile`: batch rows per CTA (the MMA `n`), a multiple of 8, at most 128.
/// - `k_step`: hidden-dimension elements per pipeline stage (64 or 128; tensor path).
/// - `warps`: warps per CTA; they split the vocab tile.
/// - `stages`: depth of the `cp.async` shared-memory ring (2..=8) for the tensor-core
///   path; `1` selects the SIMT path (no ring, any dtypes; required for f32 or mixed dtypes).
/// - `persistent`: launch as many CTAs as the device holds at once (the runtime asks the
///   driver's occupancy calculator), each looping over the (vocab tile, batch tile) work
///   items, instead of one CTA per item. On the tensor path a persistent CTA issues the next
///   item's first `stages − 1` slices before running this item's epilogue (the epilogue's
///   scratch then sits after the ring instead of aliasing it), so the epilogue's math
///   overlaps the next item's HBM stream instead of leaving the SM's memory pipe idle.
/// - `list_per_tile`: entries of each (row, vocab tile) top list (DESIGN.md step 6b); 0 for
///   pipelines without lists, else `1..=min(MAX_LIST_CAPACITY, vocab_tile)` (normally at
///   most the capacity; longer only for the NucleusTooLarge fallback). Shorter lists are
///   faster; stage three detects when one was too short (status 3) and the runtime reruns
///   with [`GpuConfig::exact_lists`]. Absent in older tuning files (serde default 0; the
///   runtime fills it in with [`GpuConfig::fit_lists`]).
/// - `wgmma`: Hopper's warpgroup MMA (`wgmma.mma_async`, sm_90a PTX, compute capability
///   9.0 only) instead of `ldmatrix` + `mma.sync`: each group of 4 warps multiplies its
///   vocab rows straight from the shared-memory ring (no fragment loads, about twice
///   `mma.sync`'s tensor rate on an H100/H200). Needs `warps % 4 == 0` and `k_step == 64`
///   (one 128-byte swizzle atom per row). Absent in older tuning files (serde default false).
/// - `tma` (needs `wgmma`): the ring is filled by the Tensor Memory Accelerator
///   (`cp.async.bulk.tensor`, one thread issues a stage's boxes) and guarded by mbarriers
///   (a full and an empty barrier per slot) instead of per-thread `cp.async` and a CTA
///   barrier per slice; the ring runs `stages − 1` slices ahead. Needs `D % 8 == 0` and
///   `V % 4 == 0` (the tensor maps' strides and the permuted row view, see
///   [`GpuConfig::tma_fits`]); the runtime runs other shapes with `tma` off.
/// - `wgmma_drain` (needs `wgmma`, not `tma`): each warpgroup waits for a slice's MMAs before
///   the next slice's barrier, so no slot is held by MMAs in flight and the `cp.async` ring runs
///   `stages − 1` slices ahead instead of `stages − 2`. The MMAs are a fifth of a slice's time
///   at LM-head shapes, so one more slice of loads in flight is worth more than overlapping them.
/// - `stagger_us`: the second CTA of each SM in the first wave (CTAs `nsmid .. 2·nsmid`) sleeps
///   this long (`%globaltimer`) before starting. Two co-resident CTAs otherwise start together,
///   take the same time per tile and run their epilogues (noise, argmax: no loads in flight)
///   at the same moments; staggered, one CTA's epilogue overlaps the other's W stream. Only
///   useful where two CTAs fit on an SM; 0 (off) up to [`MAX_STAGGER_US`]. `%nsmid` may exceed
///   the SM count where SM ids are not contiguous; then a few first-slot CTAs wait and a few
///   second-slot ones do not, which costs only part of the gain.
/// - `pingpong` (needs `tma` and `persistent`): warp specialization. The CTA runs two consumer
///   warpgroup sets of `warps` warps each plus one producer warp ([`GpuConfig::block_threads`]).
///   The producer streams the CTA's items slice by slice through the TMA ring, gated only by the
///   empty mbarriers; consumer set `s` takes the CTA's items `s, s + 2, ...`. While one set
///   runs an item's epilogue (no loads of its own), the other multiplies the next item, so the
///   W stream never pauses for an epilogue (the CUTLASS ping-pong schedule, without a timer).
///   Absent in older tuning files (serde default false).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuConfig {
    pub vocab_tile: u32,
    pub batch_tile: u32,
    pub k_step: u32,
    pub warps: u32,
    pub stages: u32,
    pub persistent: bool,
    #[serde(default)]
    pub list_per_tile: u32,
    #[serde(default)]
    pub wgmma: bool,
    #[serde(default)]
    pub tma: bool,
    #[serde(default)]
    pub wgmma_drain: bool,
    #[serde(default)]
    pub stagger_us: u32,
    #[serde(default)]
    pub pingpong: bool,
}

/// Threads of the ping-pong producer warpgroup, and the registers it keeps (CUTLASS's 40).
const PRODUCER_THREADS: u32 = 128;
const PRODUCER_REGS: u32 = 40;
/// The register file of one sm_90 CTA, and the most a thread may hold (`setmaxnreg` takes
/// multiples of 8 in 24..=256; ptxas allocates at most 255, so 248).
const REGS_PER_SM_SM90: u32 = 65_536;
const MAX_REGS_PER_THREAD: u32 = 248;

/// Longest [`GpuConfig::stagger_us`] accepted: about a tile's time at the largest shapes.
pub const MAX_STAGGER_US: u32 = 200;
/// The heuristic's stagger for its two-CTA-per-SM tiles (H200, gen 11: 30 µs was best of
/// 0–80 at D 4096 and D 8192, B = 64).
pub const HEURISTIC_STAGGER_US: u32 = 30;
/// The staggers the autotuner tries (besides 0) on tiles of which two fit on an SM.
pub const STAGGER_CANDIDATES_US: [u32; 3] = [20, 30, 40];

/// Default `list_per_tile` (capped by the capacity and the tile): 8 keeps stage one's list
/// epilogue cheap, and a row overflows only when 8 of its top `need` tokens share one tile.
pub const DEFAULT_LIST_PER_TILE: u32 = 8;

/// Most f32 accumulators one thread may hold (`vocab_tile / (8·warps) · batch_tile / 2 ·…`).
pub const MAX_ACCUMULATORS_PER_THREAD: u32 = 128;
/// Threads of the stage-two kernel (one CTA per batch row).
pub const STAGE2_THREADS: u32 = 256;
/// Threads of the stage-three (filter) kernel (one CTA per batch row).
pub const FILTER_THREADS: u32 = 256;

/// Whether a pipeline's dtypes run on tensor cores (same 16-bit dtype on both operands).
pub fn uses_tensor_cores(pipeline: &Pipeline) -> bool {
    pipeline.hidden.dtype == pipeline.weights.dtype
        && matches!(pipeline.hidden.dtype, DType::BF16 | DType::F16)
}

fn bad(knob: &'static str, reason: impl Into<String>) -> PtxError {
    PtxError::InvalidConfig {
        knob,
        reason: reason.into(),
    }
}

impl GpuConfig {
    /// Whether this config runs the tensor-core (mma.sync or wgmma) path; `stages == 1` is SIMT.
    pub fn is_tensor(&self) -> bool {
        self.stages >= 2
    }

    /// Threads per CTA: `warps` warps, or with `pingpong` two consumer sets of `warps` warps
    /// and the producer warpgroup (one warp of it issues; a whole warpgroup, because
    /// `setmaxnreg` moves registers a warpgroup at a time).
    pub fn block_threads(&self) -> u32 {
        if self.pingpong {
            self.consumer_threads() * 2 + PRODUCER_THREADS
        } else {
            self.consumer_threads()
        }
    }

    /// With `pingpong`, registers per thread: (the kernel's `.maxnreg`, the producer's after
    /// `setmaxnreg.dec`, the consumers' after `setmaxnreg.inc`). The producer needs a few
    /// dozen; what it gives back lets the consumers' epilogue run without spilling (at the
    /// kernel-wide 168 of 384 threads the 128 × 64 tile spilled about 1 KB per thread, H200).
    pub(crate) fn pingpong_registers(&self) -> (u32, u32, u32) {
        let floor8 = |r: u32| (r / 8 * 8).min(MAX_REGS_PER_THREAD);
        let kernel = floor8(REGS_PER_SM_SM90 / self.block_threads());
        let producer = PRODUCER_REGS.min(kernel);
        let consumer = floor8((REGS_PER_SM_SM90 - producer * PRODUCER_THREADS) / (2 * self.consumer_threads())).max(kernel);
        (kernel, producer, consumer)
    }

    /// Threads that multiply and reduce one work item (`warps · 32`).
    pub(crate) fn consumer_threads(&self) -> u32 {
        self.warps * 32
    }

    /// Epilogue scratch areas: one per consumer set.
    pub(crate) fn consumer_sets(&self) -> u32 {
        if self.pingpong {
            2
        } else {
            1
        }
    }

    /// 32-row vocab blocks per warp (each thread owns one quad of each).
    pub(crate) fn quads_per_thread(&self) -> u32 {
        self.vocab_tile / (32 * self.warps)
    }

    /// f32 accumulators per thread: 4 tokens per quad × 2 columns per 8-column n tile.
    pub fn accumulators_per_thread(&self) -> u32 {
        self.quads_per_thread() * 4 * (self.batch_tile / 8) * 2
    }

    /// Bytes of one ring stage: the W tile then the H tile, `k_step` elements per row.
    pub(crate) fn stage_bytes(&self) -> u32 {
        (self.vocab_tile + self.batch_tile) * self.k_step * 2
    }

    /// Slices in flight ahead of the one being multiplied: `stages − 1` with mma.sync; with
    /// wgmma `stages − 2`, as the previous slice's wgmmas may still read their slot (unless
    /// `wgmma_drain` waits for them).
    pub(crate) fn prefetch_depth(&self) -> u32 {
        if self.tma {
            // The producer refills the slot of slice kt − 1 once every warp has released it.
            self.stages - 1
        } else if self.wgmma && !self.wgmma_drain {
            self.stages - 2
        } else {
            self.stages - 1
        }
    }

    /// CTAs of this config that fit on one SM at once, by threads (2048 per SM on every sm_80+
    /// part), shared memory (the SM holds the per-block opt-in limit plus 1 KB) and estimated
    /// registers; at least 1.
    pub fn resident_per_sm(&self, limits: &GpuLimits) -> u32 {
        const THREADS_PER_SM: u32 = 2048;
        const SHARED_PER_SM_SLACK: u32 = 1024;
        let threads = THREADS_PER_SM / self.block_threads().max(1);
        let smem = (limits.max_shared_per_block_optin + SHARED_PER_SM_SLACK) / self.smem_bytes().max(1);
        let regs = limits.max_regs_per_block / (self.estimated_registers().min(255) * self.block_threads()).max(1);
        threads.min(smem).min(regs).clamp(1, 32)
    }

    /// Whether two CTAs share an SM, so that a stagger can overlap one's epilogue with the
    /// other's W stream.
    pub fn two_per_sm(&self, limits: &GpuLimits) -> bool {
        self.resident_per_sm(limits) >= 2
    }

    /// Whether the epilogue overlaps the next item's prologue loads (persistent tensor path).
    pub fn overlaps_epilogue(&self) -> bool {
        self.persistent && self.is_tensor()
    }

    /// Bytes of the `cp.async` ring (0 on the SIMT path).
    pub(crate) fn ring_bytes(&self) -> u32 {
        if self.is_tensor() {
            self.stages * self.stage_bytes()
        } else {
            0
        }
    }

    /// Where the epilogue's scratch starts: after the ring when the epilogue overlaps the
    /// next item's loads, else at 0 (aliasing the drained ring).
    pub(crate) fn scratch_base(&self) -> u32 {
        if self.overlaps_epilogue() {
            self.ring_bytes()
        } else {
            0
        }
    }

    /// Bytes of the epilogue's cross-warp scratch:
    /// per (warp, column) score, index, logit, lse max, lse sum, non-finite flag.
    pub(crate) fn scratch_bytes(&self) -> u32 {
        self.warps * self.batch_tile * 4 * 6
    }

    /// Bytes of the list epilogue's tile of transformed logits (`batch_tile` columns of
    /// `vocab_tile` f32), placed after the scratch; 0 without lists.
    pub(crate) fn list_bytes(&self) -> u32 {
        if self.list_per_tile > 0 {
            self.vocab_tile * self.batch_tile * 4
        } else {
            0
        }
    }

    /// Dynamic shared memory of a stage-one launch, in bytes (above 48 KiB the runtime must
    /// raise `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` to this).
    pub fn smem_bytes(&self) -> u32 {
        self.mbarrier_base() + self.mbarrier_bytes()
    }

    /// Bytes of one consumer set's epilogue area: the scratch, then the list tile.
    pub(crate) fn epilogue_bytes(&self) -> u32 {
        self.scratch_bytes() + self.list_bytes()
    }

    /// Where the TMA ring's mbarriers start (after the ring and the epilogue's scratch).
    pub(crate) fn mbarrier_base(&self) -> u32 {
        let epilogue = self.epilogue_bytes() * self.consumer_sets();
        let data = if self.overlaps_epilogue() {
            self.ring_bytes() + epilogue
        } else {
            self.ring_bytes().max(epilogue)
        };
        data.next_multiple_of(8)
    }

    /// A full and an empty mbarrier (8 bytes each) per ring slot with `tma`, else none; with
    /// `pingpong` also one mainloop-done barrier per consumer set.
    pub(crate) fn mbarrier_bytes(&self) -> u32 {
        match (self.tma, self.pingpong) {
            (true, true) => 16 * self.stages + 16,
            (true, false) => 16 * self.stages,
            _ => 0,
        }
    }

    /// Whether the TMA path can read operands of this shape: 16-byte row strides
    /// (`dim % 8 == 0`) and whole 32-row blocks of W (`vocab % 32 == 0`), as the W tensor map
    /// views row `32K + 4g + 2h + e` as four dimensions so that one box per warpgroup lands in
    /// wgmma's row order (a partial block would put rows past V inside the map's bounds).
    pub fn tma_fits(dim: usize, vocab: usize) -> bool {
        dim.is_multiple_of(8) && vocab.is_multiple_of(32) && dim > 0 && vocab > 0
    }

    /// This config for an operand shape: where [`GpuConfig::tma_fits`] fails, `tma` (and the
    /// `pingpong` schedule it feeds) switched off: the same tile on the `cp.async` ring.
    pub fn for_shape(&self, dim: usize, vocab: usize) -> GpuConfig {
        let tma = self.tma && GpuConfig::tma_fits(dim, vocab);
        GpuConfig { tma, pingpong: self.pingpong && tma, ..self.clone() }
    }

    /// The `list_per_tile` this config should use for `pipeline`: 0 without lists; a value
    /// already in range is kept, anything else becomes `min(capacity, 8, vocab_tile)`.
    pub fn fit_lists(&mut self, pipeline: &Pipeline) {
        let cap = pipeline.list_capacity();
        let max = cap.min(self.vocab_tile);
        self.list_per_tile = if cap == 0 {
            0
        } else if (1..=max).contains(&self.list_per_tile) {
            self.list_per_tile
        } else {
            DEFAULT_LIST_PER_TILE.min(max)
        };
    }

    /// The same config with lists that cannot overflow when stage three merges `need` per
    /// row: `min(need, vocab_tile)` entries per tile (a list holding the whole tile is
    /// complete by construction). `need` is the capacity, or `MAX_LIST_CAPACITY` for the
    /// NucleusTooLarge fallback.
    pub fn exact_lists(&self, need: u32) -> GpuConfig {
        let mut c = self.clone();
        c.list_per_tile = need.clamp(1, MAX_LIST_CAPACITY).min(self.vocab_tile);
        c
    }

    /// Stage-three grid: one CTA per batch row.
    pub fn filter_grid(&self, batch: usize) -> (u32, u32, u32) {
        (batch as u32, 1, 1)
    }

    pub fn filter_block_threads(&self) -> u32 {
        FILTER_THREADS
    }

    /// Candidate-buffer tiles for `vocab` tokens: `ceil(vocab / vocab_tile)`.
    pub fn tiles(&self, vocab: usize) -> usize {
        vocab.div_ceil(self.vocab_tile as usize)
    }

    /// Batch tiles for `batch` rows.
    pub fn batch_tiles(&self, batch: usize) -> usize {
        batch.div_ceil(self.batch_tile as usize)
    }

    /// Stage-one grid `(x, y, z)`: `(tiles, batch tiles, 1)`, or for a persistent config
    /// `(min(tiles · batch tiles, resident), 1, 1)`, where `resident` is how many of these
    /// CTAs the whole device holds at once (occupancy per SM × SMs; more would queue behind
    /// the first and finish last). Zero-sized when `batch` or `vocab` is 0 (do not launch).
    /// The block is `(block_threads(), 1, 1)`.
    pub fn grid(&self, batch: usize, vocab: usize, resident: u32) -> (u32, u32, u32) {
        let (tiles, btiles) = (self.tiles(vocab) as u64, self.batch_tiles(batch) as u64);
        if self.persistent {
            let items = tiles * btiles;
            let ctas = items.min(u64::from(resident.max(1)));
            (ctas as u32, 1, 1)
        } else {
            (tiles as u32, btiles as u32, 1)
        }
    }

    pub fn block(&self) -> (u32, u32, u32) {
        (self.block_threads(), 1, 1)
    }

    /// Stage-two grid: one CTA per batch row.
    pub fn stage2_grid(&self, batch: usize) -> (u32, u32, u32) {
        (batch as u32, 1, 1)
    }

    pub fn stage2_block_threads(&self) -> u32 {
        STAGE2_THREADS
    }

    /// Rough per-thread register need, for pruning (accumulators + addressing + epilogue).
    pub(crate) fn estimated_registers(&self) -> u32 {
        self.accumulators_per_thread() + 72
    }

    /// Checks what code generation relies on, independent of the device.
    pub fn validate_shape(&self, pipeline: &Pipeline) -> Result<(), PtxError> {
        pipeline.validate()?;
        if !(1..=32).contains(&self.warps) {
            return Err(bad("warps", format!("{} warps; 1..=32", self.warps)));
        }
        if self.vocab_tile == 0 || !self.vocab_tile.is_multiple_of(32 * self.warps) {
            return Err(bad(
                "vocab_tile",
                format!(
                    "{} is not a positive multiple of 32 · warps = {}",
                    self.vocab_tile,
                    32 * self.warps
                ),
            ));
        }
        if self.batch_tile == 0 || !self.batch_tile.is_multiple_of(8) || self.batch_tile > 128 {
            return Err(bad(
                "batch_tile",
                format!(
                    "{} is not a multiple of 8 in 8..=128 (mma n = 8)",
                    self.batch_tile
                ),
            ));
        }
        if self.batch_tile > self.consumer_threads() {
            return Err(bad(
                "batch_tile",
                format!(
                    "{} exceeds the {} threads that reduce it",
                    self.batch_tile,
                    self.consumer_threads()
                ),
            ));
        }
        if self.accumulators_per_thread() > MAX_ACCUMULATORS_PER_THREAD {
            return Err(bad(
                "vocab_tile",
                format!(
                    "{} accumulators per thread (vocab_tile·batch_tile / (32·warps)); at most {MAX_ACCUMULATORS_PER_THREAD}",
                    self.accumulators_per_thread()
                ),
            ));
        }
        if self.is_tensor() {
            if !uses_tensor_cores(pipeline) {
                return Err(PtxError::UnsupportedDtypes {
                    hidden: pipeline.hidden.dtype,
                    weights: pipeline.weights.dtype,
                    reason: "tensor cores (stages >= 2) need hidden and weights of the same 16-bit dtype; use stages = 1 (SIMT)",
                });
            }
            if !matches!(self.k_step, 64 | 128) {
                return Err(bad(
                    "k_step",
                    format!(
                        "{}; the tensor path takes 64 or 128 (swizzled 128-byte rows)",
                        self.k_step
                    ),
                ));
            }
            if self.stages > 8 {
                return Err(bad("stages", format!("{}; 1 (SIMT) or 2..=8", self.stages)));
            }
            if self.wgmma && !self.warps.is_multiple_of(4) {
                return Err(bad("warps", format!("{}; wgmma runs whole warpgroups, so a multiple of 4", self.warps)));
            }
            if self.wgmma && self.stages < 3 {
                return Err(bad("stages", format!("{}; wgmma keeps one slice's MMAs in flight while the ring refills, so 3..=8", self.stages)));
            }
            if self.tma && !self.wgmma {
                return Err(bad("tma", "the TMA ring feeds wgmma; set wgmma too"));
            }
            if self.tma && self.quads_per_thread() != 1 {
                return Err(bad(
                    "tma",
                    format!("vocab_tile {} with {} warps; the TMA W box covers 32 rows per warp, so vocab_tile = 32 · warps", self.vocab_tile, self.warps),
                ));
            }
            if self.pingpong && !(self.tma && self.persistent) {
                return Err(bad("pingpong", "the ping-pong schedule streams a persistent CTA's items through the TMA ring; set tma and persistent"));
            }
            if self.wgmma_drain && (!self.wgmma || self.tma) {
                return Err(bad("wgmma_drain", "drains the wgmma cp.async ring; needs wgmma without tma"));
            }
            if self.wgmma && self.k_step != 64 {
                return Err(bad("k_step", format!("{}; wgmma takes 64 (one 128-byte swizzle atom per row)", self.k_step)));
            }
        } else if self.stages != 1 {
            return Err(bad("stages", format!("{}; 1 (SIMT) or 2..=8", self.stages)));
        } else if self.wgmma || self.tma || self.wgmma_drain || self.pingpong {
            return Err(bad("wgmma", "the SIMT path (stages = 1) has no wgmma or TMA; use stages >= 2"));
        }
        if self.stagger_us > MAX_STAGGER_US {
            return Err(bad("stagger_us", format!("{} µs; 0..={MAX_STAGGER_US}", self.stagger_us)));
        }
        let cap = pipeline.list_capacity();
        if cap == 0 && self.list_per_tile != 0 {
            return Err(bad(
                "list_per_tile",
                format!("{}; the pipeline keeps no lists (filter / top_logprobs), so 0", self.list_per_tile),
            ));
        }
        // Longer than the capacity is allowed: the runtime's NucleusTooLarge fallback merges
        // `MAX_LIST_CAPACITY` entries per row.
        let max = MAX_LIST_CAPACITY.min(self.vocab_tile);
        if cap > 0 && !(1..=max).contains(&self.list_per_tile) {
            return Err(bad(
                "list_per_tile",
                format!(
                    "{}; must be in 1..=min({MAX_LIST_CAPACITY}, vocab_tile {})",
                    self.list_per_tile, self.vocab_tile
                ),
            ));
        }
        Ok(())
    }

    /// Prunes configs that cannot run on a device: bad shapes, dtype mixes without a path,
    /// shared memory, threads or registers over the limits.
    pub fn validate(&self, pipeline: &Pipeline, limits: &GpuLimits) -> Result<(), PtxError> {
        Arch::from_compute_capability(limits.compute_capability)?;
        self.validate_shape(pipeline)?;
        if self.wgmma && limits.compute_capability != (9, 0) {
            return Err(PtxError::WgmmaNeedsSm90a {
                compute_capability: limits.compute_capability,
            });
        }
        if self.block_threads() > limits.max_threads_per_block {
            return Err(PtxError::OverLimit {
                what: "threads per block",
                needed: self.block_threads(),
                limit: limits.max_threads_per_block,
            });
        }
        if self.smem_bytes() > limits.max_shared_per_block_optin {
            return Err(PtxError::OverLimit {
                what: "shared memory per block (bytes)",
                needed: self.smem_bytes(),
                limit: limits.max_shared_per_block_optin,
            });
        }
        let regs = self.estimated_registers();
        let needed = if self.pingpong {
            regs * 2 * self.consumer_threads() + PRODUCER_REGS * PRODUCER_THREADS
        } else {
            regs * self.block_threads()
        };
        if regs > 255 || needed > limits.max_regs_per_block {
            return Err(PtxError::OverLimit {
                what: "registers per block (estimated)",
                needed,
                limit: limits.max_regs_per_block.min(255 * self.block_threads()),
            });
        }
        Ok(())
    }

    /// The documented fallback when no tuned config exists:
    /// - f32 or mixed dtypes: SIMT, 4 warps, 128 × 8 tile.
    /// - batch ≤ 8 (memory-bound GEMV): 8 warps split a 256-row vocab tile, batch tile 8,
    ///   k_step 64, 4 stages (≈ 135 KB of `cp.async` in flight per SM).
    /// - batch ≤ 16: 4 warps, 128 × 16, k_step 64, 4 stages.
    /// - batch ≤ 32: 4 warps, 128 × 32, k_step 64, 4 stages, staggered 30 µs (two CTAs per
    ///   SM; H200, gen 11, D 4096 B = 32: 308 against 330 µs unstaggered).
    /// - larger: 8 warps, 256 × 64, k_step 64, 4 stages (H200, gen 7: 434 µs at B = 64,
    ///   D 4096, against 483 µs for 4 warps 128 × 64 with 3 stages); on compute capability
    ///   9.0 with wgmma and 5 stages (H200, gen 8, D 4096: 426 µs at B = 64 against 444 for
    ///   mma.sync in the same run, 1125 against 1332 at B = 256).
    /// - 32 < batch ≤ 64 with wgmma: 4 warps, 128 × 64, 4 stages, `wgmma_drain`, staggered
    ///   30 µs: two CTAs per SM whose epilogues overlap each other's W stream (H200, gen 11, same
    ///   process: 352 against 390 µs for 256 × 64 with 5 stages at D 4096 B = 64, 558 against
    ///   580 at D 8192). At B = 128 the same tile was slower (567 against 540 µs). Where two do
    ///   not fit (a pipeline's lists take the room), 256 × 64 as below.
    /// - batch ≥ 192 with wgmma: 256 × 128, 4 stages (H200, gen 10, same process: 973 against
    ///   1039 µs at D 4096 B = 256 for 256 × 64 with 5 stages, 1388 against 1603 at D 8192).
    /// - batch > 32 on compute capability 9.0 where the TMA maps describe the shape
    ///   ([`GpuConfig::tma_fits`]): `pingpong`, 4-warp sets, 128 × 64 with 8 stages (128 × 128
    ///   with 6 from batch 192), before all of the above (H200, gen 12, same process, D 4096 /
    ///   D 8192: B = 64 320 / 520 µs against 343 / 530 for the drained staggered pair, B = 128
    ///   467 / 728 against 525 / 749, B = 256 with 128 × 128 898 / 1256 against 939 / 1398).
    ///   Stages are reduced to fit (lists); from batch 192, a pipeline with lists whose
    ///   128 × 128 tile does not fit takes 128 × 64; where not even 3 stages fit, the tiles
    ///   above.
    ///
    /// Stages are reduced until shared memory fits `limits`.
    pub fn heuristic(
        pipeline: &Pipeline,
        batch: usize,
        dim: usize,
        vocab: usize,
        limits: &GpuLimits,
    ) -> GpuConfig {
        if !uses_tensor_cores(pipeline) {
            let mut c = GpuConfig {
                vocab_tile: 128,
                batch_tile: 8,
                k_step: 64,
                warps: 4,
                stages: 1,
                persistent: false,
                list_per_tile: 0,
                wgmma: false,
                tma: false,
                wgmma_drain: false,
                stagger_us: 0,
                pingpong: false,
            };
            c.fit_lists(pipeline);
            return c;
        }
        let wgmma = batch > 32 && limits.compute_capability == (9, 0);
        let tile = |vocab_tile: u32, batch_tile: u32, warps: u32| {
            let mut c = GpuConfig {
                vocab_tile,
                batch_tile,
                k_step: 64,
                warps,
                stages: if wgmma && vocab_tile == 256 && batch_tile == 64 { 5 } else { 4 },
                persistent: false,
                list_per_tile: 0,
                wgmma,
                tma: false,
                wgmma_drain: wgmma && vocab_tile == 128,
                stagger_us: 0,
                pingpong: false,
            };
            c.fit_lists(pipeline);
            let fits = |c: &GpuConfig| c.smem_bytes() <= limits.max_shared_per_block_optin;
            while c.stages > 3 && !fits(&c) {
                c.stages -= 1;
            }
            // wgmma needs 3 stages; below that, mma.sync with 2.
            if !fits(&c) {
                c.wgmma = false;
                c.wgmma_drain = false;
                while c.stages > 2 && !fits(&c) {
                    c.stages -= 1;
                }
            }
            if vocab_tile == 128 && batch_tile >= 32 && c.two_per_sm(limits) {
                c.stagger_us = HEURISTIC_STAGGER_US;
            }
            c
        };
        // The ping-pong schedule on the TMA ring, where the maps describe the shape and the
        // tile fits (lists may not leave room); None sends the batch to the tiles below.
        let pingpong = |batch_tile: u32, stages: u32| {
            if !wgmma || !GpuConfig::tma_fits(dim, vocab) {
                return None;
            }
            let mut c = GpuConfig {
                vocab_tile: 128,
                batch_tile,
                k_step: 64,
                warps: 4,
                stages,
                persistent: true,
                list_per_tile: 0,
                wgmma: true,
                tma: true,
                wgmma_drain: false,
                stagger_us: 0,
                pingpong: true,
            };
            c.fit_lists(pipeline);
            while c.stages > 3 && c.validate(pipeline, limits).is_err() {
                c.stages -= 1;
            }
            c.validate(pipeline, limits).is_ok().then_some(c)
        };
        if let Some(c) = match batch {
            33..=191 => pingpong(64, 8),
            // A pipeline's lists leave no room for three 128-column slots next to two
            // 64 KiB list tiles; the 64-column tile keeps the ping-pong overlap instead.
            192.. => pingpong(128, 6).or_else(|| pingpong(64, 8)),
            _ => None,
        } {
            return c;
        }
        match batch {
            0..=8 => tile(256, 8, 8),
            9..=16 => tile(128, 16, 4),
            17..=32 => tile(128, 32, 4),
            // The pair of 128 × 64 CTAs only pays where two fit (lists may not leave room).
            33..=64 if wgmma => Some(tile(128, 64, 4)).filter(|c| c.two_per_sm(limits)).unwrap_or_else(|| tile(256, 64, 8)),
            192.. if wgmma => tile(256, 128, 8),
            _ => tile(256, 64, 8),
        }
    }

    /// The autotuner's search space for `pipeline` on a device, pruned by [`GpuConfig::validate`].
    /// Pipelines with lists also try `list_per_tile` 8 and 32 (capped): longer lists cost
    /// stage one time but overflow (and rerun) less.
    pub fn enumerate(pipeline: &Pipeline, limits: &GpuLimits) -> Vec<GpuConfig> {
        let mut out = Vec::new();
        let tensor = uses_tensor_cores(pipeline);
        let cap = pipeline.list_capacity();
        for warps in [4u32, 8] {
            for quads in [1u32, 2, 4] {
                for batch_tile in [8u32, 16, 32, 64, 128] {
                    let (k_steps, stages): (&[u32], &[u32]) = if tensor {
                        (&[64, 128], &[2, 3, 4, 6, 8])
                    } else {
                        (&[64], &[1])
                    };
                    for &k_step in k_steps {
                        for &stages in stages {
                            for persistent in [false, true] {
                                let vocab_tile = 32 * warps * quads;
                                let mut lists: Vec<u32> = if cap == 0 {
                                    vec![0]
                                } else {
                                    [DEFAULT_LIST_PER_TILE, 32].iter().map(|&l| l.min(cap).min(vocab_tile)).collect()
                                };
                                lists.dedup();
                                for list_per_tile in lists {
                                    // (wgmma, tma, wgmma_drain, pingpong)
                                    let rings = [
                                        (false, false, false, false),
                                        (true, false, false, false),
                                        (true, false, true, false),
                                        (true, true, false, false),
                                        (true, true, false, true),
                                    ];
                                    for (wgmma, tma, wgmma_drain, pingpong) in rings {
                                        let c = GpuConfig {
                                            vocab_tile,
                                            batch_tile,
                                            k_step,
                                            warps,
                                            stages,
                                            persistent,
                                            list_per_tile,
                                            wgmma,
                                            tma,
                                            wgmma_drain,
                                            stagger_us: 0,
                                            pingpong,
                                        };
                                        // validate drops wgmma off compute capability 9.0.
                                        if c.validate(pipeline, limits).is_err() {
                                            continue;
                                        }
                                        // A stagger only matters where two CTAs share an SM.
                                        let staggers: &[u32] = if c.is_tensor() && c.two_per_sm(limits) { &STAGGER_CANDIDATES_US } else { &[] };
                                        for &stagger_us in staggers {
                                            out.push(GpuConfig { stagger_us, ..c.clone() });
                                        }
                                        out.push(c);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        out
    }
}
