//! `flashsample-codegen-ptx`: lowers a [`flashsample_ir::Pipeline`] and a [`GpuConfig`] to
//! PTX through LLVM's NVPTX backend (via inkwell) — the stage-one kernel
//! (`flashsample_stage1`: tensor-core `logitsᵀ = W·Hᵀ` with the fused sampling epilogue) and
//! the stage-two kernel (`flashsample_stage2`: the reduction over vocab tiles), and for
//! pipelines with a filter or top logprobs the stage-three kernel (`flashsample_filter`).
//!
//! Generation needs neither a GPU nor `ptxas`; the runtime loads the PTX with the driver.
//! Kernel parameters and semantics are those of DESIGN.md ("GPU"); launch geometry comes
//! from [`GpuConfig`] ([`GpuConfig::grid`], [`GpuConfig::block`], [`GpuConfig::smem_bytes`],
//! [`GpuConfig::stage2_grid`], [`GpuConfig::stage2_block_threads`]).

mod config;
mod decide;
mod entries;
mod filter;
mod heuristic;
mod ir;
mod layout;
mod lse;
mod math;
mod glue;
mod math64;
mod nucleus;
mod params;
mod probe;
mod ptx;
mod stage1;
mod stage2;
mod targets;

pub use config::{
    uses_tensor_cores, Arch, GpuConfig, GpuLimits, Grid, GridKind, NoiseSkip, Schedule, default_list_per_tile, GPU_RESIDUAL_PER_TILE,
    FILTER_THREADS, MAX_ACCUMULATORS_PER_THREAD, MAX_STAGGER_US, STAGE2_THREADS, WGMMA_K_STEP,
};
pub use heuristic::HEURISTIC_STAGGER_US;
pub use targets::{target_logits_rows_per_cta, TARGET_LOGITS_KERNEL, TARGET_LOGITS_THREADS};
pub use layout::{ScratchLayout, SmemLayout};
pub use decide::{DECIDE_SHARED, DECIDE_THREADS};
pub use glue::{compile_glue, glue_llvm_ir, GLUE_THREADS};
pub use probe::{
    compile_math_probe, math_probe_llvm_ir, MATH_PROBE_GUMBEL_INPUTS, MATH_PROBE_KERNEL, MATH_PROBE_LN_FIRST_BITS, MATH_PROBE_LN_INPUTS, MATH_PROBE_RECIP_WORDS, MATH_PROBE_THREADS,
};
pub use nucleus::{
    captures_logits, has_nucleus_kernels, NucleusLayout, NucleusOffsets, NUCLEUS_CUT_THREADS, NUCLEUS_DRAW_TILE, NUCLEUS_LOGITS_TOKENS, NUCLEUS_MAX_VOCAB,
    NUCLEUS_RADIX_PASSES, NUCLEUS_SORT_TILE, NUCLEUS_THREADS,
};
pub use params::{
    DecideArgs, FilterArgs, FinalizeArgs, KernelArg, KernelParams, NucleusCutArgs, NucleusDrawArgs, NucleusHistArgs, NucleusLogitsArgs, NucleusPickArgs,
    NucleusScatterArgs, Param, ParamKind, SpecTargetsArgs, Stage1Args, Stage2Args, DECIDE, FILTER, NUCLEUS_CUT, NUCLEUS_DRAW, NUCLEUS_HIST,
    NUCLEUS_LOGITS, NUCLEUS_PICK, NUCLEUS_SCATTER, SPEC_TARGETS, STAGE1, STAGE2, FINALIZE, TensorMapWords,
};

use flashsample_ir::{DType, IrError, Pipeline};
use inkwell::{
    context::Context,
    memory_buffer::MemoryBuffer,
    passes::PassBuilderOptions,
    targets::{CodeModel, FileType, InitializationConfig, RelocMode, Target, TargetTriple},
    OptimizationLevel,
};

/// Changes whenever the generated code may change, so cached PTX from another version is
/// never loaded: the crate version and a hash of this crate's and `abi`'s sources (`build.rs`),
/// because a hand-bumped generation number was forgotten across two codegen generations.
pub const COMPILER_VERSION: &str = concat!(
    "flashsample-codegen-ptx ",
    env!("CARGO_PKG_VERSION"),
    " src ",
    env!("FLASHSAMPLE_PTX_SOURCE_HASH")
);

/// PTX ISA version the modules declare (`.version 8.0`: CUDA 12.0 drivers and newer).
pub const PTX_FEATURES: &str = "+ptx80";

/// Why a pipeline or config could not be lowered.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PtxError {
    /// The pipeline fails validation.
    #[error("invalid pipeline: {0}")]
    Pipeline(#[from] IrError),
    /// A config knob (`knob`) has a value code generation cannot use.
    #[error("invalid GPU config: `{knob}`: {reason}")]
    InvalidConfig {
        /// The knob.
        knob: &'static str,
        /// Why its value cannot be used.
        reason: String,
    },
    /// The config needs more of a device resource (`what`) than the device has.
    #[error("GPU config needs {needed} {what}, the device allows {limit}")]
    OverLimit {
        /// The resource.
        what: &'static str,
        /// What the config needs.
        needed: u32,
        /// What the device allows.
        limit: u32,
    },
    /// The device is older than sm_80.
    #[error("compute capability {}.{} is not supported (flashsample needs sm_80 or newer: mma.sync bf16, ldmatrix, cp.async)", compute_capability.0, compute_capability.1)]
    UnsupportedArch {
        /// The device's compute capability.
        compute_capability: (u32, u32),
    },
    /// A wgmma schedule on a device that is not compute capability 9.0.
    #[error("wgmma configs need an sm_90a device (compute capability 9.0: H100/H200); this one is {}.{}", compute_capability.0, compute_capability.1)]
    WgmmaNeedsSm90a {
        /// The device's compute capability.
        compute_capability: (u32, u32),
    },
    /// The operand dtypes have no path on the config's schedule.
    #[error("hidden {hidden:?} × weights {weights:?}: {reason}")]
    UnsupportedDtypes {
        /// The hidden states' dtype.
        hidden: DType,
        /// The weights' dtype.
        weights: DType,
        /// Why the schedule has no path for them.
        reason: &'static str,
    },
    /// LLVM rejected or failed to compile the module.
    #[error("LLVM failed: {0}")]
    Llvm(String),
}

/// A compiled pipeline: one PTX module holding both kernels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompiledPtx {
    /// The module's PTX text.
    pub ptx: String,
    /// Entry name of the stage-one kernel (`flashsample_stage1`).
    pub stage1: &'static str,
    /// Entry name of the targets' logits before stage one (`flashsample_target_logits`,
    /// [`STAGE1`]'s parameters), present only when the pipeline ranks its targets (DESIGN.md
    /// step 7c).
    pub target_logits: Option<&'static str>,
    /// Entry name of the stage-two kernel (`flashsample_stage2`).
    pub stage2: &'static str,
    /// Entry name of the stage-three kernel (`flashsample_filter`), present only when the
    /// pipeline keeps lists ([`list_capacity`] > 0).
    pub filter: Option<&'static str>,
    /// Entry names of the speculative decision (`flashsample_decide`) and of the drafts'
    /// spreading into stage one's targets (`flashsample_spec_targets`), present only for a
    /// verifying pipeline.
    pub decide: Option<(&'static str, &'static str)>,
    /// The config the stage-one kernel was specialised for (its geometry must be used).
    pub config: GpuConfig,
    /// The target it was generated for.
    pub arch: Arch,
}

/// Code-generation choices that do not change results (only speed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CodegenOptions {
    /// Call the per-token noise / exp / softcap functions instead of inlining them.
    pub outline_math: bool,
    /// Compile stage one without the logsumexp partials (DESIGN.md step 7) even though the
    /// pipeline has them (`Pipeline::needs_logsumexp`): it never reads or writes `lse`, so
    /// the caller passes `lse = 0` to all three kernels. Only for launches where
    /// `SamplingParams::needs_logsumexp` is false (no logsumexp / logprob / top-logprob
    /// output, no sampled row with a lone top-p): tokens, scores and logits are unchanged
    /// there, as stage three never reads the row logsumexp of a bounded row.
    pub skip_logsumexp: bool,
}

impl CodegenOptions {
    /// What [`compile`] uses: outlined math once a thread holds ≥ 32 accumulators. Large
    /// tiles fully unrolled thrash the instruction cache and spill; for small ones the calls
    /// cost more than they save (BENCHMARKS.md).
    pub fn for_config(config: &GpuConfig) -> Self {
        CodegenOptions {
            outline_math: config.accumulators_per_thread() >= 32,
            skip_logsumexp: false,
        }
    }
}

/// Entries per row the GPU's per-tile lists must deliver: the processed lists' capacity
/// (`Pipeline::list_capacity`) and, in the raw logprob mode, the raw lists'
/// (`Pipeline::raw_list_capacity`; DESIGN.md step 10). Stage one keeps both kinds at the
/// config's `list_per_tile`, and stage three runs whenever this is not 0.
pub fn list_capacity(pipeline: &Pipeline) -> u32 {
    pipeline.list_capacity().max(pipeline.raw_list_capacity())
}

/// The groups `G` of stage one's list bounds (parameter `list_bounds`, `u32 [B, G]`) for
/// `pipeline` on `config`, or `None` where its kernel reads no list bound: a pipeline without
/// processed lists, a verifying one (its filtered draft rows' survivors come from the lists;
/// kept out for simplicity), a config whose lists hold whole tiles (the exact rerun needs
/// every token), or a ping-pong config: there a set's list epilogue runs under the other
/// set's mainloop, and staging the bounds cost more than the rounds they saved (BENCHMARKS.md,
/// twenty-third session: +2 % at D 4096 B 64). `G = max(list_per_tile, list_capacity)`, at
/// least what stage three merges.
pub fn list_bound_groups(pipeline: &Pipeline, config: &GpuConfig) -> Option<u32> {
    let lists = pipeline.list_capacity() > 0 && pipeline.verify.is_none();
    let overlapped = config.schedule.grid() == config::GridKind::PingPong;
    (lists && !overlapped && config.list_per_tile < config.vocab_tile).then(|| config.list_per_tile.max(list_capacity(pipeline)))
}

/// Which kernels beside stage one and stage two a pipeline's module holds: the one rule that
/// [`llvm_ir_with`] emits by, [`CompiledPtx`] names and the runtime loads by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModuleKernels {
    /// Stage three (`flashsample_filter`): the pipeline keeps lists ([`list_capacity`]).
    pub filter: bool,
    /// The decision and the drafts' spreading: the pipeline verifies drafts.
    pub decide: bool,
    /// The exact nucleus's kernels ([`has_nucleus_kernels`]).
    pub nucleus: bool,
    /// The targets' logits before stage one (`flashsample_target_logits`): the pipeline ranks
    /// its targets.
    pub rank: bool,
}

impl ModuleKernels {
    /// The kernels `pipeline`'s module holds.
    pub fn of(pipeline: &Pipeline) -> ModuleKernels {
        ModuleKernels {
            filter: list_capacity(pipeline) > 0,
            decide: pipeline.verify.is_some(),
            nucleus: has_nucleus_kernels(pipeline),
            rank: pipeline.ranks_targets(),
        }
    }
}

/// The LLVM IR text of the module (both kernels), before optimisation. For inspection.
pub fn llvm_ir(pipeline: &Pipeline, config: &GpuConfig) -> Result<String, PtxError> {
    llvm_ir_with(pipeline, config, CodegenOptions::for_config(config))
}

/// [`llvm_ir`] with explicit [`CodegenOptions`].
pub fn llvm_ir_with(
    pipeline: &Pipeline,
    config: &GpuConfig,
    options: CodegenOptions,
) -> Result<String, PtxError> {
    config.validate_shape(pipeline)?;
    let mut m = String::from(ir::PRELUDE);
    m.push_str("declare float @llvm.fma.f32(float, float, float)\n");
    // wgmma's 128-byte swizzle is a function of absolute shared addresses: every 8-row
    // atom of the ring must start on a 1024-byte boundary.
    let smem_align = if config.uses_wgmma() { 1024 } else { 16 };
    m.push_str(&format!("@fs_smem = external addrspace(3) global [0 x i8], align {smem_align}\n"));
    m.push_str(stage2::SCRATCH_DECL);
    m.push('\n');
    m.push_str(&math::helpers(options.outline_math));
    m.push_str(lse::DECLS);
    m.push_str(&lse::helpers(if options.outline_math { "#2" } else { "#0" }, 4 * config.quads_per_thread() as usize));
    m.push('\n');
    let kernels = ModuleKernels::of(pipeline);
    let lse = pipeline.needs_logsumexp() && !options.skip_logsumexp;
    m.push_str(&stage1::emit(pipeline, config, lse));
    if kernels.rank {
        m.push('\n');
        m.push_str(&targets::emit(pipeline, config));
    }
    m.push('\n');
    m.push_str(&stage2::emit());
    if kernels.filter {
        m.push('\n');
        m.push_str(&filter::shared_decls());
        m.push_str(&filter::emit(config));
    }
    if kernels.decide {
        m.push('\n');
        m.push_str(&decide::shared_decls());
        m.push_str(&math64::helpers());
        m.push('\n');
        m.push_str(&decide::emit());
        m.push('\n');
        m.push_str(&decide::emit_targets());
    }
    if kernels.nucleus {
        m.push('\n');
        m.push_str(&nucleus::emit(pipeline, config));
    }
    Ok(m)
}

/// Lowers `pipeline` with `config` to PTX for `arch`. Validates the config's shape (not the
/// device limits: call [`GpuConfig::validate`] with the device's [`GpuLimits`] first).
pub fn compile(
    pipeline: &Pipeline,
    config: &GpuConfig,
    arch: Arch,
) -> Result<CompiledPtx, PtxError> {
    compile_with(pipeline, config, arch, CodegenOptions::for_config(config))
}

/// [`compile`] with explicit [`CodegenOptions`].
pub fn compile_with(
    pipeline: &Pipeline,
    config: &GpuConfig,
    arch: Arch,
    options: CodegenOptions,
) -> Result<CompiledPtx, PtxError> {
    let text = llvm_ir_with(pipeline, config, options)?;
    let cpu = match (config.uses_wgmma(), arch) {
        (false, _) => arch.sm_name(),
        (true, Arch::Sm90) => "sm_90a",
        (true, Arch::Sm80) => return Err(PtxError::WgmmaNeedsSm90a { compute_capability: (8, 0) }),
    };
    let ptx = ir_to_ptx(&text, cpu)?;
    let kernels = ModuleKernels::of(pipeline);
    Ok(CompiledPtx {
        ptx,
        stage1: stage1::NAME,
        target_logits: kernels.rank.then_some(TARGET_LOGITS_KERNEL),
        stage2: stage2::NAME,
        filter: kernels.filter.then_some(filter::NAME),
        decide: kernels.decide.then_some((decide::NAME, decide::TARGETS_NAME)),
        config: config.clone(),
        arch,
    })
}

/// Parses LLVM IR text, optimises it at O3 and emits PTX.
/// `cpu`: the NVPTX processor (`sm_80`, `sm_90`, `sm_90a`).
pub(crate) fn ir_to_ptx(text: &str, cpu: &str) -> Result<String, PtxError> {
    Target::initialize_nvptx(&InitializationConfig::default());
    let triple = TargetTriple::create("nvptx64-nvidia-cuda");
    let target = Target::from_triple(&triple).map_err(|e| PtxError::Llvm(e.to_string()))?;
    let machine = target
        .create_target_machine(
            &triple,
            cpu,
            PTX_FEATURES,
            OptimizationLevel::Aggressive,
            RelocMode::Default,
            CodeModel::Default,
        )
        .ok_or_else(|| PtxError::Llvm(format!("no NVPTX target machine for {cpu}")))?;
    let context = Context::create();
    let buffer = MemoryBuffer::create_from_memory_range_copy(text.as_bytes(), "flashsample");
    let module = context
        .create_module_from_ir(buffer)
        .map_err(|e| PtxError::Llvm(e.to_string()))?;
    module.set_data_layout(&machine.get_target_data().get_data_layout());
    module.verify().map_err(|e| PtxError::Llvm(e.to_string()))?;
    module
        .run_passes("default<O3>", &machine, PassBuilderOptions::create())
        .map_err(|e| PtxError::Llvm(e.to_string()))?;
    let out = machine
        .write_to_memory_buffer(&module, FileType::Assembly)
        .map_err(|e| PtxError::Llvm(e.to_string()))?;
    String::from_utf8(out.as_slice().to_vec()).map_err(|e| PtxError::Llvm(e.to_string()))
}
