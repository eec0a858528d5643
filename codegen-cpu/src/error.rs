/// Why a CPU kernel could not be configured, compiled or launched.
#[derive(Debug, thiserror::Error)]
pub enum CpuCodegenError {
    #[error("invalid CPU config: `{field}` {reason}")]
    InvalidConfig { field: &'static str, reason: String },
    #[error("invalid pipeline: {0}")]
    Pipeline(#[from] flashsample_ir::IrError),
    #[error("Cranelift does not support this host: {0}")]
    UnsupportedHost(String),
    #[error("the host CPU lacks `{0}`, which the CPU kernel needs")]
    MissingHostFeature(&'static str),
    #[error("the {engine} engine cannot multiply {hidden:?} hidden states by {weights:?} weights exactly; use the cranelift engine")]
    EngineDtype { engine: crate::CpuEngine, hidden: flashsample_ir::DType, weights: flashsample_ir::DType },
    #[error("hidden row {row} holds {value:e}, which is not a bf16 value (the pipeline declares bf16 hidden states)")]
    HiddenNotBf16 { row: usize, value: f32 },
    #[error("Cranelift failed to build the kernel: {0}")]
    Compile(String),
    #[error("could not start the kernel's thread pool: {0}")]
    ThreadPool(String),
    #[error("`{what}` has {got} elements, expected {expected}")]
    Length { what: &'static str, expected: usize, got: usize },
    #[error("the pipeline declares `{0}`, but no value was passed for it")]
    Missing(&'static str),
    #[error("`{0}` was passed, but the pipeline does not declare it")]
    Unexpected(&'static str),
    #[error("invalid launch argument: {0}")]
    BadArgument(String),
    #[error("`{what}` is {value}, more than the kernel supports ({max})")]
    TooLarge { what: &'static str, value: usize, max: usize },
}
