//! Everything the runtime asks of `flashsample-codegen-ptx`, in one place: the device
//! limits and architecture it generates for, the launch geometry its configs define, and the
//! PTX text of a compiled pipeline.

use flashsample_codegen_ptx::{Arch, CompiledPtx, GpuConfig, GpuLimits};

/// Device attributes as the driver reports them.
#[derive(Clone, Debug)]
pub(crate) struct DeviceAttributes {
    pub compute_capability: (u32, u32),
    pub sm_count: u32,
    pub max_smem_per_block_optin: u32,
    pub max_threads_per_block: u32,
    pub max_regs_per_block: u32,
}

/// The PTX target for a compute capability; `None` below 8.0 (no mma.sync bf16, ldmatrix,
/// cp.async). Hopper-class (9.x) gets sm_90; Ampere/Ada (8.x) sm_80. Newer chips get sm_90
/// PTX, which the driver JIT-compiles forward (it uses no arch-specific `a` features).
/// The mapping is codegen's (`Arch::from_compute_capability`), so the two never disagree.
pub(crate) fn arch_for(cc: (u32, u32)) -> Option<Arch> {
    Arch::from_compute_capability(cc).ok()
}

pub(crate) fn limits_from(a: &DeviceAttributes) -> GpuLimits {
    GpuLimits {
        compute_capability: a.compute_capability,
        sm_count: a.sm_count,
        max_shared_per_block_optin: a.max_smem_per_block_optin,
        max_threads_per_block: a.max_threads_per_block,
        max_regs_per_block: a.max_regs_per_block,
    }
}

/// Launch geometry of both stages for one shape.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub stage1_grid: (u32, u32, u32),
    pub stage1_block: u32,
    pub stage1_smem: u32,
    pub tiles: usize,
    pub stage2_grid: (u32, u32, u32),
    pub stage2_block: u32,
    pub filter_grid: (u32, u32, u32),
    pub filter_block: u32,
}

/// `resident`: stage-one CTAs the whole device holds at once (occupancy × SMs).
pub(crate) fn geometry(config: &GpuConfig, batch: usize, vocab: usize, resident: u32) -> Geometry {
    Geometry {
        stage1_grid: config.grid(batch, vocab, resident),
        stage1_block: config.block_threads(),
        stage1_smem: config.smem_bytes(),
        tiles: config.tiles(vocab),
        stage2_grid: config.stage2_grid(batch),
        stage2_block: config.stage2_block_threads(),
        filter_grid: config.filter_grid(batch),
        filter_block: config.filter_block_threads(),
    }
}

pub(crate) fn ptx_text(c: &CompiledPtx) -> &str {
    &c.ptx
}

/// Changes whenever generated code may change, so on-disk PTX from another compiler is
/// never loaded.
pub(crate) fn compiler_version() -> &'static str {
    flashsample_codegen_ptx::COMPILER_VERSION
}

pub(crate) const STAGE1: &str = flashsample_codegen_ptx::STAGE1.kernel;
pub(crate) const TARGET_LOGITS: &str = flashsample_codegen_ptx::TARGET_LOGITS_KERNEL;
pub(crate) const STAGE2: &str = "flashsample_stage2";
pub(crate) const FILTER: &str = "flashsample_filter";
pub(crate) const DECIDE: &str = flashsample_codegen_ptx::DECIDE.kernel;
pub(crate) const SPEC_TARGETS: &str = flashsample_codegen_ptx::SPEC_TARGETS.kernel;
