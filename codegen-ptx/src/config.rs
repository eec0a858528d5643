//! Stage-one configurations: the target architecture and device limits, the schedule types
//! ([`Schedule`]: mainloop kind × grid kind), the tile, its validation against the limits and
//! the launch geometry it implies. The heuristic lives in `heuristic`, the shared-memory layout
//! in `layout`, the autotuner's search space in `flashsample-autotune`.

use crate::layout::SmemLayout;
use crate::PtxError;
use flashsample_ir::{DType, Pipeline, MAX_LIST_CAPACITY};
pub use flashsample_abi::rng::NoiseSkip;
use serde::{Deserialize, Serialize};

/// Residual-list entries per (draft row, vocab tile) on the GPU: half the CPU's
/// `abi::speculative::RESIDUAL_PER_TILE`. A GPU tile is 256 tokens where a CPU tile is up to
/// 2048, so four entries cover as much of a row's head; every entry is a warp-wide selection
/// round of the residual epilogue, and a shorter list stays exact (the decision's bound
/// test sends a rejection it cannot prove to the recompute).
pub const GPU_RESIDUAL_PER_TILE: u32 = 4;

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

    /// The NVPTX processor name (`sm_80`, `sm_90`).
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
    /// (major, minor).
    pub compute_capability: (u32, u32),
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// `CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`, bytes.
    pub max_shared_per_block_optin: u32,
    /// `CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK`.
    pub max_threads_per_block: u32,
    /// `CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK`.
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

/// How a grid covers the (vocab tile, batch tile) work items, for schedules that cannot
/// warp-specialize (everything but [`Schedule::WgmmaTma`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Grid {
    /// One CTA per work item (grid `(tiles, batch tiles)`).
    PerItem,
    /// As many CTAs as the device holds at once, each looping over the items. On a ring
    /// mainloop a CTA issues the next item's first slices before this item's epilogue (whose
    /// scratch then sits after the ring instead of aliasing it), so the epilogue overlaps the
    /// next item's HBM stream.
    Persistent,
}

/// How a grid covers the work items: [`Grid`], plus the warp-specialized schedules that only
/// the TMA ring can feed (a producer warpgroup streams the ring; consumer warps multiply and
/// run the epilogue).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GridKind {
    /// One CTA per work item.
    PerItem,
    /// Persistent CTAs looping over the items ([`Grid::Persistent`]).
    Persistent,
    /// Persistent CTAs of two consumer sets of `warps` warps plus a producer warpgroup (the
    /// CUTLASS ping-pong schedule). The producer streams every slice of the CTA's items
    /// through the TMA ring, gated only by the empty mbarriers; consumer set `s` takes the
    /// CTA's items `s, s + 2, ...`. While one set runs an epilogue the other multiplies, so
    /// the W stream never pauses for an epilogue, with no timer to tune.
    PingPong,
    /// Persistent CTAs of one consumer set of `warps` warps plus a producer warpgroup (the
    /// CUTLASS cooperative schedule, which cuBLAS runs at B = 256). The consumers only wait
    /// for full slots and release them; the producer refills each slot the moment every
    /// consumer warp released it and streams the next item's first slices during the
    /// epilogue, so no consumer warp stalls on the others' releases to issue a load.
    Cooperative,
    /// [`GridKind::Cooperative`] CTAs in clusters of two along the batch (cuBLAS's 1 × 2
    /// cluster at B = 256): a pair takes two batch tiles of one vocab tile at a time (an odd
    /// last batch tile pairs with an empty one, which writes nothing), and each CTA's producer
    /// multicasts one warpgroup's half of the W slice into both CTAs' rings, so a W slice
    /// crosses L2 once per pair instead of twice. A slot is refilled once the consumers of
    /// both CTAs released it. Two consumer warpgroups (8 warps).
    CooperativePair,
}

impl From<Grid> for GridKind {
    fn from(g: Grid) -> GridKind {
        match g {
            Grid::PerItem => GridKind::PerItem,
            Grid::Persistent => GridKind::Persistent,
        }
    }
}

/// The stage-one schedule: a mainloop kind (how a CTA multiplies and how its operands reach
/// shared memory) and the grid kind it runs under. Every value is a schedule codegen has;
/// the ring depths and the k slice are checked by [`GpuConfig::validate_shape`].
///
/// | variant | loads | multiply | ring runs ahead |
/// |---|---|---|---|
/// | `Simt` | global loads (L1) | FMA per thread | — |
/// | `MmaSync` | `cp.async` ring | `ldmatrix` + `mma.sync.m16n8k16` | `stages − 1` |
/// | `Wgmma` | `cp.async` ring | `wgmma.mma_async` from shared memory | `stages − 2` (`drain`: `stages − 1`) |
/// | `WgmmaTma` | TMA ring with mbarriers | `wgmma.mma_async` | `stages − 1` |
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Schedule {
    /// Each thread accumulates its own (token, column) pairs from global memory: any dtypes
    /// (the only path for f32 or mixed operands), any D.
    Simt {
        /// One CTA per work item or a persistent grid.
        grid: Grid,
    },
    /// Tensor cores (sm_80+): a `stages`-deep (2..=8) `cp.async` ring of `k_step`-element
    /// slices (64 or 128), `ldmatrix` fragments and `mma.sync`.
    MmaSync {
        /// Ring depth.
        stages: u32,
        /// Hidden-dimension elements per slice.
        k_step: u32,
        /// One CTA per work item or a persistent grid.
        grid: Grid,
    },
    /// Hopper's warpgroup MMA (sm_90a, compute capability 9.0): the same `cp.async` ring of
    /// 64-element slices (one 128-byte swizzle atom per row), `stages` 3..=8; each group of 4
    /// warps multiplies its vocab rows straight from the ring. A slice's wgmmas stay in flight
    /// across the next barrier unless `drain`, which waits for them every slice so that no
    /// slot is held by MMAs in flight and the ring runs one slice deeper (the MMAs are a fifth
    /// of a slice's time at LM-head shapes: one more slice of loads is worth more).
    Wgmma {
        /// Ring depth.
        stages: u32,
        /// Whether each slice's wgmmas are waited for before the next refill.
        drain: bool,
        /// One CTA per work item or a persistent grid.
        grid: Grid,
    },
    /// [`Schedule::Wgmma`] fed by the Tensor Memory Accelerator: one thread issues a slice's
    /// boxes, a full and an empty mbarrier per slot replace the CTA barrier per slice. Needs
    /// one 32-row block per warp (`vocab_tile = 32 · warps`) and operand shapes the tensor
    /// maps describe ([`GpuConfig::tma_fits`]; the runtime drops to `Wgmma` for others,
    /// [`GpuConfig::for_shape`]).
    WgmmaTma {
        /// Ring depth.
        stages: u32,
        /// One CTA per item, persistent, or ping-pong.
        grid: GridKind,
    },
}

impl Schedule {
    /// The grid kind.
    pub fn grid(&self) -> GridKind {
        match *self {
            Schedule::Simt { grid } | Schedule::MmaSync { grid, .. } | Schedule::Wgmma { grid, .. } => grid.into(),
            Schedule::WgmmaTma { grid, .. } => grid,
        }
    }

    /// Depth of the shared-memory ring (1 on the SIMT path, which has none).
    pub fn stages(&self) -> u32 {
        match *self {
            Schedule::Simt { .. } => 1,
            Schedule::MmaSync { stages, .. } | Schedule::Wgmma { stages, .. } | Schedule::WgmmaTma { stages, .. } => stages,
        }
    }

    /// The same schedule with a ring of `stages` slots (SIMT: unchanged).
    pub fn with_stages(self, stages: u32) -> Schedule {
        match self {
            Schedule::Simt { .. } => self,
            Schedule::MmaSync { k_step, grid, .. } => Schedule::MmaSync { stages, k_step, grid },
            Schedule::Wgmma { drain, grid, .. } => Schedule::Wgmma { stages, drain, grid },
            Schedule::WgmmaTma { grid, .. } => Schedule::WgmmaTma { stages, grid },
        }
    }

    /// Hidden-dimension elements per ring slice (wgmma: 64; SIMT: 0, it has no ring).
    pub fn k_step(&self) -> u32 {
        match *self {
            Schedule::Simt { .. } => 0,
            Schedule::MmaSync { k_step, .. } => k_step,
            Schedule::Wgmma { .. } | Schedule::WgmmaTma { .. } => WGMMA_K_STEP,
        }
    }

    /// Short name of the mainloop kind, for errors and tables.
    pub fn mainloop_name(&self) -> &'static str {
        match self {
            Schedule::Simt { .. } => "simt",
            Schedule::MmaSync { .. } => "mma.sync",
            Schedule::Wgmma { drain: false, .. } => "wgmma",
            Schedule::Wgmma { drain: true, .. } => "wgmma drained",
            Schedule::WgmmaTma { .. } => "wgmma + tma",
        }
    }
}

/// The k slice of the wgmma schedules: one 128-byte swizzle atom per row.
pub const WGMMA_K_STEP: u32 = 64;

/// One stage-one tile configuration. A CTA (with [`GridKind::PingPong`]: a consumer set)
/// computes a `vocab_tile × batch_tile` block of logits and the candidates of that vocab tile
/// for `batch_tile` rows, on the [`Schedule`] `schedule`.
///
/// - `vocab_tile`: vocabulary rows per CTA and the candidate-buffer tile
///   ([`GpuConfig::tiles`]). A multiple of `32 · warps`: each warp owns
///   `vocab_tile / warps` rows in blocks of 32 (two m16 MMA tiles, so that every thread owns
///   whole quads of 4 consecutive tokens: one Philox call per quad).
/// - `batch_tile`: batch rows per CTA (the MMA `n`), a multiple of 8, at most 128.
/// - `warps`: warps per CTA (per consumer set); they split the vocab tile.
/// - `list_per_tile`: entries of each (row, vocab tile) top list (DESIGN.md step 6b); 0 for
///   pipelines without lists, else `1..=min(MAX_LIST_CAPACITY, vocab_tile)` (normally at
///   most the capacity; longer for the exact nucleus path's whole-tile lists). Shorter lists are
///   faster; stage three detects when one was too short (status 3) and the runtime reruns
///   with [`GpuConfig::exact_lists`].
/// - `residual_per_tile`: entries of each (draft row, vocab tile) residual list of a verifying
///   pipeline (DESIGN.md "Speculative verification"): [`GPU_RESIDUAL_PER_TILE`],
///   or `vocab_tile` for the recompute of one row over its whole vocabulary; 0 for pipelines
///   without `verify` (and then absent from the serialized form).
/// - `stagger_us`: the second CTA of each SM in the first wave (CTAs `nsmid .. 2·nsmid`) sleeps
///   this long (`%globaltimer`) before starting. Two co-resident CTAs otherwise start together,
///   take the same time per tile and run their epilogues (noise, argmax: no loads in flight)
///   at the same moments; staggered, one CTA's epilogue overlaps the other's W stream. Only
///   useful where two CTAs fit on an SM; 0 (off) up to [`MAX_STAGGER_US`]. `%nsmid` may exceed
///   the SM count where SM ids are not contiguous; then a few first-slot CTAs wait and a few
///   second-slot ones do not, which costs only part of the gain.
///
/// Serialized as these fields; tuning files written before [`Schedule`] existed (flat
/// `stages`, `k_step`, `persistent`, `wgmma`, `tma`, `wgmma_drain`, `pingpong` fields) still
/// load, and a flag combination no schedule has is a deserialization error naming it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "legacy::ConfigRepr")]
pub struct GpuConfig {
    /// Vocabulary rows per work item.
    pub vocab_tile: u32,
    /// Batch rows per work item.
    pub batch_tile: u32,
    /// Warps per consumer set.
    pub warps: u32,
    /// The mainloop and grid.
    pub schedule: Schedule,
    /// Top-list entries per (row, tile); 0 without lists.
    pub list_per_tile: u32,
    /// Start delay of second-slot CTAs, in microseconds (0: off).
    pub stagger_us: u32,
    /// Residual-list entries per (draft row, tile) of a verifying pipeline; 0 otherwise.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub residual_per_tile: u32,
    /// The epilogue's noise skips (absent in older tuning files: [`NoiseSkip::default`]).
    #[serde(default)]
    pub noise_skip: NoiseSkip,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// Threads of the ping-pong producer warpgroup, and the registers it keeps: `setmaxnreg`'s
/// minimum, 24 (CUTLASS keeps 40). Its TMA issue loop uses a dozen (ptxas 12.9, no spill), and
/// the 16 it gives back per thread lift the consumers from 232 to 240: the 128 × 128 ping-pong
/// sampler's spills 164 / 256 → 132 / 192 B, the 256 × 128 cooperative tile's 24 / 12 → 0.
const PRODUCER_THREADS: u32 = 128;
const PRODUCER_REGS: u32 = 24;
/// The register file of one sm_90 CTA, and the most a thread may hold (`setmaxnreg` takes
/// multiples of 8 in 24..=256; ptxas allocates at most 255, so 248).
const REGS_PER_SM_SM90: u32 = 65_536;
const MAX_REGS_PER_THREAD: u32 = 248;

/// Longest [`GpuConfig::stagger_us`] accepted: about a tile's time at the largest shapes.
pub const MAX_STAGGER_US: u32 = 200;

/// Default `list_per_tile` of a `vocab_tile`-token tile (before the capacity's and the tile's
/// caps): one entry per 32 tokens, 4 to 8. Lists cost stage one a selection round per entry
/// and stage three a merge over tiles × entries, so their density (entries per token), not
/// their length, sets both costs, and sets how often a row overflows them (status 3, a rerun
/// of the overflowed rows): when more than that many of its top `need` tokens share one tile.
/// H100 (BENCHMARKS.md, twenty-ninth and thirtieth sessions): 4 entries instead of 8 took
/// 4–13 % off filtered B 64 / 128 on the 128-token ping-pong tile, but only 1–2 % off B 256 /
/// 512 on the 256-token tile (none at D 8192 B 256), where halving the density would make
/// overflows far likelier on a trained LM's rows: a BPE vocabulary gives its most frequent
/// tokens the lowest ids, so a row's top 50 crowd a few tiles; a workload whose rows overflow
/// in launch after launch reruns them, then runs doubled lists for the host API's next
/// launches, exact ones (`need` entries) if those overflow too
/// (`runtime::stage_three::ShortListGate`), and the device API cannot rerun.
pub fn default_list_per_tile(vocab_tile: u32) -> u32 {
    (vocab_tile / 32).clamp(4, 8)
}

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
    /// A `vocab_tile × batch_tile` tile of `warps` warps on `schedule`, without lists or
    /// stagger ([`GpuConfig::fit_lists`], [`GpuConfig::with_stagger`]).
    pub fn new(vocab_tile: u32, batch_tile: u32, warps: u32, schedule: Schedule) -> GpuConfig {
        GpuConfig {
            vocab_tile,
            batch_tile,
            warps,
            schedule,
            list_per_tile: 0,
            stagger_us: 0,
            residual_per_tile: 0,
            noise_skip: NoiseSkip::default(),
        }
    }

    /// This config with the epilogue's noise skips `noise_skip`.
    pub fn with_noise_skip(self, noise_skip: NoiseSkip) -> GpuConfig {
        GpuConfig { noise_skip, ..self }
    }

    /// This config with a first-wave stagger of `stagger_us`.
    pub fn with_stagger(self, stagger_us: u32) -> GpuConfig {
        GpuConfig { stagger_us, ..self }
    }

    /// This config on `schedule` (same tile, lists and stagger).
    pub fn with_schedule(self, schedule: Schedule) -> GpuConfig {
        GpuConfig { schedule, ..self }
    }

    /// The same mainloop with one CTA per work item: where a persistent (or ping-pong) tile's
    /// epilogue scratch does not fit beside the ring, this one aliases it.
    pub fn one_cta_per_item(&self) -> GpuConfig {
        let schedule = match self.schedule {
            Schedule::Simt { .. } => Schedule::Simt { grid: Grid::PerItem },
            Schedule::MmaSync { stages, k_step, .. } => Schedule::MmaSync { stages, k_step, grid: Grid::PerItem },
            Schedule::Wgmma { stages, drain, .. } => Schedule::Wgmma { stages, drain, grid: Grid::PerItem },
            Schedule::WgmmaTma { stages, .. } => Schedule::WgmmaTma { stages, grid: GridKind::PerItem },
        };
        self.clone().with_schedule(schedule)
    }

    /// The same tile and schedule with the deepest ring (fewer stages than this one's, never
    /// fewer than the ring's minimum) that `validate` accepts for `pipeline` on `limits`:
    /// a tuned entry whose ring filled shared memory for a plain pipeline, taken by a pipeline
    /// that also keeps a list tile (a filter, residual lists). `None` for SIMT or if no depth
    /// fits.
    pub fn shallower_ring_that_fits(&self, pipeline: &Pipeline, limits: &GpuLimits) -> Option<GpuConfig> {
        let min = match self.schedule {
            Schedule::Simt { .. } => return None,
            Schedule::MmaSync { .. } => 2,
            Schedule::Wgmma { .. } | Schedule::WgmmaTma { .. } => 3,
        };
        (min..self.stages())
            .rev()
            .map(|stages| self.clone().with_schedule(self.schedule.with_stages(stages)))
            .find(|c| c.validate(pipeline, limits).is_ok())
    }

    /// Whether this config runs a tensor-core ring (mma.sync or wgmma), not SIMT.
    pub fn is_tensor(&self) -> bool {
        !matches!(self.schedule, Schedule::Simt { .. })
    }

    /// Depth of the ring ([`Schedule::stages`]).
    pub fn stages(&self) -> u32 {
        self.schedule.stages()
    }

    /// Elements per ring slice ([`Schedule::k_step`]).
    pub fn k_step(&self) -> u32 {
        self.schedule.k_step()
    }

    /// Whether the mainloop multiplies with `wgmma` (the module then targets sm_90a).
    pub fn uses_wgmma(&self) -> bool {
        matches!(self.schedule, Schedule::Wgmma { .. } | Schedule::WgmmaTma { .. })
    }

    /// Whether the ring is fed by the TMA (and the launch passes tensor maps).
    pub fn uses_tma(&self) -> bool {
        matches!(self.schedule, Schedule::WgmmaTma { .. })
    }

    /// Whether CTAs loop over work items (persistent or ping-pong grids).
    pub fn is_persistent(&self) -> bool {
        self.schedule.grid() != GridKind::PerItem
    }

    /// Whether the CTA is the ping-pong schedule ([`GridKind::PingPong`]).
    pub fn is_pingpong(&self) -> bool {
        self.schedule.grid() == GridKind::PingPong
    }

    /// Whether the CTA is warp-specialized: a producer warpgroup feeds consumer sets
    /// ([`GridKind::PingPong`], [`GridKind::Cooperative`], [`GridKind::CooperativePair`]).
    pub fn is_warp_specialized(&self) -> bool {
        matches!(self.schedule.grid(), GridKind::PingPong | GridKind::Cooperative | GridKind::CooperativePair)
    }

    /// CTAs per cluster: 2 for [`GridKind::CooperativePair`], else 1 (no cluster).
    pub fn cluster_ctas(&self) -> u32 {
        if self.schedule.grid() == GridKind::CooperativePair {
            2
        } else {
            1
        }
    }

    /// Batch tiles the grid walks: [`GpuConfig::batch_tiles`], rounded up to a multiple of
    /// the cluster size so that a cluster's CTAs always share a vocab tile.
    pub fn grid_batch_tiles(&self, batch: usize) -> usize {
        self.batch_tiles(batch).next_multiple_of(self.cluster_ctas() as usize)
    }

    /// Threads per CTA: `warps` warps, or when warp-specialized the consumer sets of `warps`
    /// warps and the producer warpgroup (one warp of it issues; a whole warpgroup, because
    /// `setmaxnreg` moves registers a warpgroup at a time).
    pub fn block_threads(&self) -> u32 {
        if self.is_warp_specialized() {
            self.consumer_threads() * self.consumer_sets() + PRODUCER_THREADS
        } else {
            self.consumer_threads()
        }
    }

    /// When warp-specialized, registers per thread: (the kernel's `.maxnreg`, the producer's
    /// after `setmaxnreg.dec`, the consumers' after `setmaxnreg.inc`). The producer needs a
    /// few dozen; what it gives back lets the consumers' epilogue run without spilling (at the
    /// kernel-wide 168 of 384 threads the 128 × 64 tile spilled about 1 KB per thread).
    pub(crate) fn specialized_registers(&self) -> (u32, u32, u32) {
        let floor8 = |r: u32| (r / 8 * 8).min(MAX_REGS_PER_THREAD);
        let kernel = floor8(REGS_PER_SM_SM90 / self.block_threads());
        let producer = PRODUCER_REGS.min(kernel);
        let consumers = self.consumer_sets() * self.consumer_threads();
        let consumer = floor8((REGS_PER_SM_SM90 - producer * PRODUCER_THREADS) / consumers).max(kernel);
        (kernel, producer, consumer)
    }

    /// Threads that multiply and reduce one work item (`warps · 32`).
    pub(crate) fn consumer_threads(&self) -> u32 {
        self.warps * 32
    }

    /// Epilogue areas: one per consumer set.
    pub(crate) fn consumer_sets(&self) -> u32 {
        if self.is_pingpong() {
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

    /// Slices in flight ahead of the one being multiplied: `stages − 1`, except on the
    /// `cp.async` wgmma ring without `drain` (`stages − 2`), where the previous slice's wgmmas
    /// may still read their slot. 0 on the SIMT path. The cost model reads this too.
    pub fn prefetch_depth(&self) -> u32 {
        match self.schedule {
            Schedule::Simt { .. } => 0,
            Schedule::Wgmma { stages, drain: false, .. } => stages - 2,
            Schedule::MmaSync { stages, .. } | Schedule::Wgmma { stages, drain: true, .. } => stages - 1,
            // The producer refills the slot of slice kt − 1 once every warp has released it.
            Schedule::WgmmaTma { stages, .. } => stages - 1,
        }
    }

    /// The shared-memory layout of a stage-one CTA (ring, epilogue areas, mbarriers).
    pub fn smem_layout(&self) -> SmemLayout {
        SmemLayout::of(self)
    }

    /// Dynamic shared memory of a stage-one launch, in bytes (above 48 KiB the runtime must
    /// raise `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` to this).
    pub fn smem_bytes(&self) -> u32 {
        self.smem_layout().total
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

    /// Whether the epilogue overlaps the next item's prologue loads (persistent ring).
    pub fn overlaps_epilogue(&self) -> bool {
        self.is_persistent() && self.is_tensor()
    }

    /// Whether the TMA path can read operands of this shape: 16-byte row strides
    /// (`dim % 8 == 0`) and whole 32-row blocks of W (`vocab % 32 == 0`), as the W tensor map
    /// views row `32K + 4g + 2h + e` as four dimensions so that one box per warpgroup lands in
    /// wgmma's row order (a partial block would put rows past V inside the map's bounds).
    pub fn tma_fits(dim: usize, vocab: usize) -> bool {
        dim.is_multiple_of(8) && vocab.is_multiple_of(32) && dim > 0 && vocab > 0
    }

    /// This config for an operand shape: where [`GpuConfig::tma_fits`] fails, a
    /// [`Schedule::WgmmaTma`] becomes the same tile on the `cp.async` wgmma ring
    /// ([`Schedule::Wgmma`], ping-pong becoming a persistent grid).
    pub fn for_shape(&self, dim: usize, vocab: usize) -> GpuConfig {
        match self.schedule {
            Schedule::WgmmaTma { stages, grid } if !GpuConfig::tma_fits(dim, vocab) => {
                let grid = if grid == GridKind::PerItem { Grid::PerItem } else { Grid::Persistent };
                self.clone().with_schedule(Schedule::Wgmma { stages, drain: false, grid })
            }
            _ => self.clone(),
        }
    }

    /// The `list_per_tile` this config should use for `pipeline`: 0 without lists; a value
    /// already in range is kept, anything else becomes `min(capacity, default_list_per_tile(vocab_tile), vocab_tile)`. A
    /// verifying pipeline also gets its `residual_per_tile` ([`GPU_RESIDUAL_PER_TILE`]).
    pub fn fit_lists(&mut self, pipeline: &Pipeline) {
        self.residual_per_tile = if pipeline.verify.is_some() {
            GPU_RESIDUAL_PER_TILE.min(self.vocab_tile)
        } else {
            0
        };
        let cap = crate::list_capacity(pipeline);
        let max = cap.min(self.vocab_tile);
        self.list_per_tile = if cap == 0 {
            0
        } else if (1..=max).contains(&self.list_per_tile) {
            self.list_per_tile
        } else {
            default_list_per_tile(self.vocab_tile).min(max)
        };
    }

    /// The same config with lists that cannot overflow when stage three merges `need` per
    /// row: `min(need, vocab_tile)` entries per tile (a list holding the whole tile is
    /// complete by construction). `need` is the capacity, or `MAX_LIST_CAPACITY` for the
    /// exact nucleus path (lists of whole tiles up to 1024 tokens).
    pub fn exact_lists(&self, need: u32) -> GpuConfig {
        let mut c = self.clone();
        c.list_per_tile = need.clamp(1, MAX_LIST_CAPACITY).min(self.vocab_tile);
        c
    }

    /// The same config with residual lists holding whole tiles (every eligible token of a
    /// row): the recompute of a draft row whose residual bound failed.
    pub fn whole_tile_residuals(&self) -> GpuConfig {
        GpuConfig { residual_per_tile: self.vocab_tile, ..self.clone() }
    }

    /// Stage-three grid: one CTA per batch row.
    pub fn filter_grid(&self, batch: usize) -> (u32, u32, u32) {
        (batch as u32, 1, 1)
    }

    /// Stage-three threads per CTA.
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
    /// `(min(tiles · batch tiles, resident), 1, 1)` (with clusters: whole clusters of the
    /// batch tiles rounded up to the cluster), where `resident` is how many of these CTAs the
    /// whole device holds at once (occupancy per SM × SMs; more would queue behind
    /// the first and finish last). Zero-sized when `batch` or `vocab` is 0 (do not launch).
    /// The block is `(block_threads(), 1, 1)`.
    pub fn grid(&self, batch: usize, vocab: usize, resident: u32) -> (u32, u32, u32) {
        let (tiles, btiles) = (self.tiles(vocab) as u64, self.batch_tiles(batch) as u64);
        if self.is_persistent() {
            // A cluster's CTAs take consecutive items of one vocab tile: whole clusters of
            // the padded item count (a multiple of the cluster size, as the batch tiles are).
            let cluster = u64::from(self.cluster_ctas());
            let items = tiles * self.grid_batch_tiles(batch) as u64;
            let ctas = items.min(u64::from(resident.max(1)) / cluster * cluster).max(items.min(cluster));
            (ctas as u32, 1, 1)
        } else {
            (tiles as u32, btiles as u32, 1)
        }
    }

    /// Stage-one block: `(block_threads(), 1, 1)`.
    pub fn block(&self) -> (u32, u32, u32) {
        (self.block_threads(), 1, 1)
    }

    /// Stage-two grid: one CTA per batch row.
    pub fn stage2_grid(&self, batch: usize) -> (u32, u32, u32) {
        (batch as u32, 1, 1)
    }

    /// Stage-two threads per CTA.
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
        if self.schedule.grid() == GridKind::CooperativePair && self.warps != 8 {
            // Each CTA of the pair multicasts one warpgroup's W box.
            return Err(bad("warps", format!("{} warps; the cooperative pair needs 8 (a W box per CTA of the pair)", self.warps)));
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
        if self.is_tensor() && !uses_tensor_cores(pipeline) {
            return Err(PtxError::UnsupportedDtypes {
                hidden: pipeline.hidden.dtype,
                weights: pipeline.weights.dtype,
                reason: "tensor cores need hidden and weights of the same 16-bit dtype; use Schedule::Simt",
            });
        }
        match self.schedule {
            Schedule::Simt { .. } => {}
            Schedule::MmaSync { stages, k_step, .. } => {
                if !matches!(k_step, 64 | 128) {
                    return Err(bad("k_step", format!("{k_step}; the mma.sync ring takes 64 or 128 (swizzled 128-byte rows)")));
                }
                if !(2..=8).contains(&stages) {
                    return Err(bad("stages", format!("{stages}; the mma.sync ring takes 2..=8")));
                }
            }
            Schedule::Wgmma { stages, .. } | Schedule::WgmmaTma { stages, .. } => {
                if !self.warps.is_multiple_of(4) {
                    return Err(bad("warps", format!("{}; wgmma runs whole warpgroups, so a multiple of 4", self.warps)));
                }
                if !(3..=8).contains(&stages) {
                    return Err(bad("stages", format!("{stages}; wgmma keeps one slice's MMAs in flight while the ring refills, so 3..=8")));
                }
            }
        }
        if self.uses_tma() && self.quads_per_thread() != 1 {
            return Err(bad(
                "vocab_tile",
                format!("{} with {} warps; the TMA W box covers 32 rows per warp, so vocab_tile = 32 · warps", self.vocab_tile, self.warps),
            ));
        }
        if self.stagger_us > MAX_STAGGER_US {
            return Err(bad("stagger_us", format!("{} µs; 0..={MAX_STAGGER_US}", self.stagger_us)));
        }
        let cap = crate::list_capacity(pipeline);
        if cap == 0 && self.list_per_tile != 0 {
            return Err(bad(
                "list_per_tile",
                format!("{}; the pipeline keeps no lists (filter / top_logprobs), so 0", self.list_per_tile),
            ));
        }
        let residual_ok = match pipeline.verify {
            Some(_) => (1..=self.vocab_tile).contains(&self.residual_per_tile),
            None => self.residual_per_tile == 0,
        };
        if !residual_ok {
            return Err(bad(
                "residual_per_tile",
                format!(
                    "{}; a verifying pipeline needs 1..=vocab_tile {} (`fit_lists`), any other 0",
                    self.residual_per_tile, self.vocab_tile
                ),
            ));
        }
        // Longer than the capacity is allowed: the runtime's exact nucleus path lists whole
        // tiles (up to `MAX_LIST_CAPACITY` entries).
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
        if self.uses_wgmma() && limits.compute_capability != (9, 0) {
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
        let needed = if self.is_warp_specialized() {
            regs * self.consumer_sets() * self.consumer_threads() + PRODUCER_REGS * PRODUCER_THREADS
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
}

/// The serde forms of [`GpuConfig`]: the current one, and the flat flags of tuning files
/// written before [`Schedule`] existed.
mod legacy {
    use super::{GpuConfig, Grid, GridKind, NoiseSkip, Schedule};
    use serde::Deserialize;

    #[derive(Deserialize)]
    #[serde(untagged)]
    pub(super) enum ConfigRepr {
        Current(Current),
        Flags(Flags),
    }

    #[derive(Deserialize)]
    pub(super) struct Current {
        vocab_tile: u32,
        batch_tile: u32,
        warps: u32,
        schedule: Schedule,
        #[serde(default)]
        list_per_tile: u32,
        #[serde(default)]
        stagger_us: u32,
        #[serde(default)]
        residual_per_tile: u32,
        #[serde(default)]
        noise_skip: NoiseSkip,
    }

    /// The flat form: `stages == 1` meant SIMT; fields added later default to off.
    #[derive(Deserialize)]
    pub(super) struct Flags {
        vocab_tile: u32,
        batch_tile: u32,
        k_step: u32,
        warps: u32,
        stages: u32,
        persistent: bool,
        #[serde(default)]
        list_per_tile: u32,
        #[serde(default)]
        wgmma: bool,
        #[serde(default)]
        tma: bool,
        #[serde(default)]
        wgmma_drain: bool,
        #[serde(default)]
        stagger_us: u32,
        #[serde(default)]
        pingpong: bool,
        #[serde(default)]
        noise_skip: NoiseSkip,
    }

    impl TryFrom<ConfigRepr> for GpuConfig {
        type Error = String;

        fn try_from(repr: ConfigRepr) -> Result<GpuConfig, String> {
            let f = match repr {
                ConfigRepr::Current(c) => {
                    return Ok(GpuConfig {
                        vocab_tile: c.vocab_tile,
                        batch_tile: c.batch_tile,
                        warps: c.warps,
                        schedule: c.schedule,
                        list_per_tile: c.list_per_tile,
                        stagger_us: c.stagger_us,
                        residual_per_tile: c.residual_per_tile,
                        noise_skip: c.noise_skip,
                    })
                }
                ConfigRepr::Flags(f) => f,
            };
            let grid = if f.persistent { Grid::Persistent } else { Grid::PerItem };
            let schedule = match (f.stages, f.wgmma, f.tma, f.wgmma_drain, f.pingpong) {
                (1, false, false, false, false) => Schedule::Simt { grid },
                (1, ..) => return Err("stages = 1 (SIMT) with wgmma, tma, wgmma_drain or pingpong".into()),
                (stages, false, false, false, false) => Schedule::MmaSync { stages, k_step: f.k_step, grid },
                (stages, true, false, drain, false) if f.k_step == super::WGMMA_K_STEP => Schedule::Wgmma { stages, drain, grid },
                (stages, true, true, false, pingpong) if f.k_step == super::WGMMA_K_STEP => Schedule::WgmmaTma {
                    stages,
                    grid: match (pingpong, f.persistent) {
                        (true, true) => GridKind::PingPong,
                        (true, false) => return Err("pingpong without persistent".into()),
                        (false, _) => grid.into(),
                    },
                },
                _ => {
                    return Err(format!(
                        "no schedule has wgmma = {}, tma = {}, wgmma_drain = {}, pingpong = {}, k_step = {}",
                        f.wgmma, f.tma, f.wgmma_drain, f.pingpong, f.k_step
                    ))
                }
            };
            Ok(GpuConfig {
                vocab_tile: f.vocab_tile,
                batch_tile: f.batch_tile,
                warps: f.warps,
                schedule,
                list_per_tile: f.list_per_tile,
                stagger_us: f.stagger_us,
                residual_per_tile: 0,
                noise_skip: f.noise_skip,
            })
        }
    }
}
