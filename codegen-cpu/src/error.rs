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
