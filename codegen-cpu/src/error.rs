/// Why a CPU kernel could not be configured, compiled or launched.
#[derive(Debug, thiserror::Error)]
pub enum CpuCodegenError {
    /// A config field with a value the kernel cannot use.
    #[error("invalid CPU config: `{field}` {reason}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// The pipeline IR is invalid.
    #[error("invalid pipeline: {0}")]
    Pipeline(#[from] flashsample_ir::IrError),
    /// Cranelift has no backend for this host.
    #[error("Cranelift does not support this host: {0}")]
    UnsupportedHost(String),
    /// The host CPU lacks a feature the kernel needs.
    #[error("the host CPU lacks `{0}`, which the CPU kernel needs")]
    MissingHostFeature(&'static str),
    /// A matrix engine that cannot multiply these dtypes exactly.
    #[error("the {engine} engine cannot multiply {hidden:?} hidden states by {weights:?} weights exactly; use the cranelift engine")]
    EngineDtype {
        /// The engine.
        engine: crate::CpuEngine,
        /// The hidden states' dtype.
        hidden: flashsample_ir::DType,
        /// The weights' dtype.
        weights: flashsample_ir::DType,
    },
    /// A hidden state of a bf16 pipeline that is not a bf16 value.
    #[error("hidden row {row} holds {value:e}, which is not a bf16 value (the pipeline declares bf16 hidden states)")]
    HiddenNotBf16 {
        /// The row.
        row: usize,
        /// The value that is not a bf16.
        value: f32,
    },
    /// Cranelift failed to build the kernel.
    #[error("Cranelift failed to build the kernel: {0}")]
    Compile(String),
    /// The kernel's thread pool did not start.
    #[error("could not start the kernel's thread pool: {0}")]
    ThreadPool(String),
    /// A launch argument of the wrong length.
    #[error("`{what}` has {got} elements, expected {expected}")]
    Length {
        /// The argument.
        what: &'static str,
        /// Its expected length.
        expected: usize,
        /// Its length.
        got: usize,
    },
    /// A declared operand the launch did not pass.
    #[error("the pipeline declares `{0}`, but no value was passed for it")]
    Missing(&'static str),
    /// An operand the pipeline does not declare.
    #[error("`{0}` was passed, but the pipeline does not declare it")]
    Unexpected(&'static str),
    /// A launch argument the kernel cannot take (the message says which).
    #[error("invalid launch argument: {0}")]
    BadArgument(String),
    /// A size past what the kernel supports.
    #[error("`{what}` is {value}, more than the kernel supports ({max})")]
    TooLarge {
        /// The quantity.
        what: &'static str,
        /// Its value.
        value: usize,
        /// The most the kernel supports.
        max: usize,
    },
}
