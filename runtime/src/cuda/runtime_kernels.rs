//! The runtime's glue kernel (`codegen_ptx` `glue.rs`: the finishing kernel), loaded once per
//! device and launched with its typed arguments.

use super::device::drv;
use super::plan::push_args;
use super::CudaDevice;
use crate::{Error, Result};
use cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchConfig};
use cudarc::nvrtc::Ptx;
use flashsample_codegen_ptx::{FinalizeArgs, FINALIZE, GLUE_THREADS};
use std::sync::Arc;

/// The runtime's glue kernel, loaded once per device.
pub(crate) struct AuxKernels {
    finalize: CudaFunction,
    _module: Arc<CudaModule>,
}

/// One thread per element, [`GLUE_THREADS`] a block, at least one block.
fn elementwise(n: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (n.div_ceil(GLUE_THREADS).max(1), 1, 1), block_dim: (GLUE_THREADS, 1, 1), shared_mem_bytes: 0 }
}

impl AuxKernels {
    pub(crate) fn load(device: &CudaDevice) -> Result<AuxKernels> {
        let text = flashsample_codegen_ptx::compile_glue().map_err(|e| Error::Cuda(format!("the glue kernels: {e}")))?;
        let module = device.context().load_module(Ptx::from_src(text)).map_err(drv("cuModuleLoadData(glue kernels)"))?;
        let get = |name: &'static str| module.load_function(name).map_err(drv("cuModuleGetFunction(glue kernel)"));
        Ok(AuxKernels {
            finalize: get(FINALIZE.kernel)?,
            _module: module.clone(),
        })
    }

    /// Queues the finalization of `n = batch * samples` samples (`codegen_ptx` `glue.rs`);
    /// `logprobs = 0` skips the logprobs (then `logits` and `lse` are not read).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn finalize(
        &self,
        stream: &CudaStream,
        tokens: u64,
        status: u64,
        logits: u64,
        lse: u64,
        logprobs: u64,
        n: u32,
        samples: u32,
    ) -> Result<()> {
        let args = FinalizeArgs { tokens, status, logits, lse, logprobs, n, samples }.args();
        let mut b = stream.launch_builder(&self.finalize);
        push_args(&mut b, &args);
        // SAFETY: the arguments follow `FINALIZE`; `tokens`, `logits`, `logprobs` hold `n`
        // elements and `status`, `lse` `n / samples` (the caller's contract).
        unsafe { b.launch(elementwise(n)) }.map_err(drv("cuLaunchKernel(flashsample_finalize)"))?;
        Ok(())
    }
}
