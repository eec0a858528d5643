use flashsample_ir::DType;

/// Everything that can go wrong between a pipeline and its samples.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The pipeline IR is invalid.
    #[error("invalid pipeline: {0}")]
    Pipeline(#[from] flashsample_ir::IrError),
    /// The pipeline's text form did not parse.
    #[error("invalid pipeline text: {0}")]
    PipelineText(#[from] flashsample_ir::ParseError),
    /// A launch parameter does not fit the pipeline or the shapes.
    #[error(transparent)]
    Param(#[from] flashsample_abi::ParamError),
    /// A row could not be sampled (all masked, non-finite), named by its index.
    #[error(transparent)]
    Row(#[from] flashsample_abi::RowError),
    /// A row's top lists could not serve its filter.
    #[error(transparent)]
    List(#[from] flashsample_abi::ListError),
    /// The hidden states have no rows.
    #[error("empty batch: the hidden states have 0 rows")]
    EmptyBatch,
    /// The named operand has no element along some dimension.
    #[error("empty {0}: it must have at least one element along every dimension")]
    EmptyOperand(&'static str),
    /// Operand shapes that do not fit together (the message names them).
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// An operand of another dtype than the pipeline declares.
    #[error("dtype mismatch: `{operand}` is declared {expected:?} but {got:?} was passed")]
    DType {
        /// The operand.
        operand: &'static str,
        /// The pipeline's dtype for it.
        expected: DType,
        /// The dtype passed.
        got: DType,
    },
    /// A tensor's buffer length (operand, elements, rows, columns) that its shape does not match.
    #[error("{0} holds {1} elements, which does not match its {2} x {3} shape")]
    Length(&'static str, usize, usize, usize),
    /// A CPU device asked for more threads than it may run.
    #[error("{threads} CPU threads requested; a CPU device runs 1..={max}")]
    CpuThreads {
        /// The threads asked for.
        threads: usize,
        /// The most a CPU device runs.
        max: usize,
    },
    /// The Cranelift code generator refused a config or failed.
    #[error("CPU code generation failed: {0}")]
    CpuCodegen(#[from] flashsample_codegen_cpu::CpuCodegenError),
    /// A kernel config of another backend than the sampler's.
    #[error("the kernel config is for another backend than this sampler's ({sampler})")]
    ConfigBackend {
        /// The sampler's backend.
        sampler: String,
    },
    /// A combination this build or backend does not support (the message says which).
    #[error("not supported: {0}")]
    Unsupported(String),
    /// A tensor on another device than the sampler's.
    #[error("tensor lives on {tensor} but the sampler runs on {sampler}")]
    WrongDevice {
        /// Where the tensor lives.
        tensor: String,
        /// Where the sampler runs.
        sampler: String,
    },
    /// No NVIDIA driver (`libcuda`) on this machine.
    #[error("libcuda not found: no NVIDIA driver on this machine")]
    NoCudaDriver,
    /// A CUDA ordinal past the devices the driver reports.
    #[error("no CUDA device {ordinal}: the driver reports {count} device(s)")]
    NoCudaDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// The devices there are.
        count: usize,
    },
    /// A GPU the kernels cannot run on (below sm_80, for instance).
    #[error("unsupported GPU {name} (compute capability {}.{}): {reason}", compute_capability.0, compute_capability.1)]
    UnsupportedGpu {
        /// The device's name.
        name: String,
        /// Its compute capability.
        compute_capability: (u32, u32),
        /// Why it is not supported.
        reason: String,
    },
    /// A CUDA driver call failed; the message names the call.
    #[error("CUDA driver error: {0}")]
    Cuda(String),
    /// The PTX code generator refused a config or failed.
    #[cfg(feature = "cuda")]
    #[error("PTX code generation failed: {0}")]
    PtxCodegen(#[from] flashsample_codegen_ptx::PtxError),
}

/// The library's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `error` and its causes (its `source` chain) on one line, each cause once: a cause whose
/// text an outer error already shows (as `#[error("...: {0}")]` wrappers do) is not repeated.
pub fn error_line(error: &(dyn std::error::Error + 'static)) -> String {
    let mut line = String::new();
    for cause in std::iter::successors(Some(error), |e| e.source()) {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("saving the cache")]
    struct Saving(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("saving the cache: {0}")]
    struct SavingShown(#[source] std::io::Error);

    #[test]
    fn an_error_line_shows_each_cause_once() {
        let io = || std::io::Error::other("disk full");
        assert_eq!(error_line(&Saving(io())), "saving the cache: disk full");
        assert_eq!(error_line(&SavingShown(io())), "saving the cache: disk full");
    }
}
