use flashsample_ir::DType;

/// Everything that can go wrong between a pipeline and its samples.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid pipeline: {0}")]
    Pipeline(#[from] flashsample_ir::IrError),
    #[error("invalid pipeline text: {0}")]
    PipelineText(#[from] flashsample_ir::ParseError),
    #[error(transparent)]
    Param(#[from] flashsample_abi::ParamError),
    #[error(transparent)]
    Row(#[from] flashsample_abi::RowError),
    #[error(transparent)]
    List(#[from] flashsample_abi::ListError),
    #[error("empty batch: the hidden states have 0 rows")]
    EmptyBatch,
    #[error("empty {0}: it must have at least one element along every dimension")]
    EmptyOperand(&'static str),
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error("dtype mismatch: `{operand}` is declared {expected:?} but {got:?} was passed")]
    DType { operand: &'static str, expected: DType, got: DType },
    #[error("{0} holds {1} elements, which does not match its {2} x {3} shape")]
    Length(&'static str, usize, usize, usize),
    #[error("{threads} CPU threads requested; a CPU device runs 1..={max}")]
    CpuThreads { threads: usize, max: usize },
    #[error("CPU code generation failed: {0}")]
    CpuCodegen(#[from] flashsample_codegen_cpu::CpuCodegenError),
    #[error("the kernel config is for another backend than this sampler's ({sampler})")]
    ConfigBackend { sampler: String },
    #[error("not supported: {0}")]
    Unsupported(String),
    #[error("tensor lives on {tensor} but the sampler runs on {sampler}")]
    WrongDevice { tensor: String, sampler: String },
    #[error("libcuda not found: no NVIDIA driver on this machine")]
    NoCudaDriver,
    #[error("no CUDA device {ordinal}: the driver reports {count} device(s)")]
    NoCudaDevice { ordinal: usize, count: usize },
    #[error("unsupported GPU {name} (compute capability {}.{}): {reason}", compute_capability.0, compute_capability.1)]
    UnsupportedGpu { name: String, compute_capability: (u32, u32), reason: String },
    /// A CUDA driver call failed; the message names the call.
    #[error("CUDA driver error: {0}")]
    Cuda(String),
    /// The PTX code generator refused a config or failed.
    #[cfg(feature = "cuda")]
    #[error("PTX code generation failed: {0}")]
    PtxCodegen(#[from] flashsample_codegen_ptx::PtxError),
}

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
