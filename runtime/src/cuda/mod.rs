//! The CUDA device: PTX from `flashsample-codegen-ptx`, loaded and launched through the
//! driver API (cudarc, libcuda loaded at run time, so builds need no CUDA toolkit).
//!
//! - [`CudaDevice`]: one opened GPU (context, stream, limits read from its attributes).
//! - [`DeviceTensor`]: a matrix in GPU memory. Upload LM-head weights once with
//!   [`CudaDevice::upload`]; host tensors passed to a CUDA sampler are uploaded on every call.
//! - The backend compiles each (pipeline, config) once per process and caches its PTX on disk
//!   (see [`cache_dir`]).

mod backend;
mod cache;
mod device;
mod ptx;
mod tma;

pub(crate) use backend::CudaBackend;
pub use cache::cache_dir;
pub use device::{CudaDevice, DeviceTensor};

use crate::{Error, KernelConfig, Result, Sampler, Tensor};
use flashsample_abi::{Candidate, LsePartial, SamplingParams, StageTwo};

fn cuda_parts<'s>(
    sampler: &'s Sampler,
    hidden: &Tensor<'_>,
    weights: &Tensor<'_>,
    params: &SamplingParams<'_>,
    config: Option<&KernelConfig>,
) -> Result<(&'s CudaBackend, crate::sampler::Shape, flashsample_codegen_ptx::GpuConfig)> {
    let backend = sampler
        .cuda_backend()
        .ok_or_else(|| Error::Unsupported(format!("a CUDA entry point called on a sampler for {}", sampler.device().describe())))?;
    let shape = sampler.check_inputs(hidden, weights, params)?;
    let config = match config {
        Some(KernelConfig::Cuda(c)) => c.clone(),
        Some(_) => return Err(Error::ConfigBackend { sampler: sampler.device().describe() }),
        None => backend.config_for(shape),
    };
    Ok((backend, shape, config))
}

/// Device time (seconds) of each of `reps` fused launches (stage one + stage two, CUDA events),
/// after `warmup`, cycling through `weights` (all of one shape) so no launch finds the
/// previous one's weights in L2. `config` defaults to what `Sampler::sample` would use.
#[doc(hidden)]
pub fn time_fused(
    sampler: &Sampler,
    hidden: Tensor<'_>,
    weights: &[Tensor<'_>],
    params: &SamplingParams<'_>,
    config: Option<&KernelConfig>,
    warmup: usize,
    reps: usize,
) -> Result<Vec<f64>> {
    let first = weights.first().ok_or(Error::EmptyOperand("weights list"))?;
    let (backend, shape, config) = cuda_parts(sampler, &hidden, first, params, config)?;
    for w in weights {
        if (w.rows(), w.cols(), w.dtype()) != (first.rows(), first.cols(), first.dtype()) {
            return Err(Error::Shape("time_fused: every weight buffer must have the same shape and dtype".into()));
        }
    }
    backend.time(&hidden, weights, params, shape, &config, warmup, reps)
}

/// Per-stage device time (seconds: stage one, stage two, stage three, 0 without lists) of
/// each of `reps` launches, as [`time_fused`] otherwise (events between the kernels).
#[doc(hidden)]
pub fn time_fused_stages(
    sampler: &Sampler,
    hidden: Tensor<'_>,
    weights: &[Tensor<'_>],
    params: &SamplingParams<'_>,
    config: Option<&KernelConfig>,
    warmup: usize,
    reps: usize,
) -> Result<Vec<[f64; 3]>> {
    let first = weights.first().ok_or(Error::EmptyOperand("weights list"))?;
    let (backend, shape, config) = cuda_parts(sampler, &hidden, first, params, config)?;
    backend.time_stages(&hidden, weights, params, shape, &config, warmup, reps)
}

/// Test hook: runs stage one alone into a candidate buffer pre-filled with `poison` (and an
/// LSE buffer of NaNs) and returns the buffers as the kernel left them.
#[doc(hidden)]
pub fn debug_stage1_candidates(
    sampler: &Sampler,
    hidden: Tensor<'_>,
    weights: Tensor<'_>,
    params: &SamplingParams<'_>,
    config: Option<&KernelConfig>,
    poison: Candidate,
) -> Result<(StageTwo, Vec<Candidate>, Option<Vec<LsePartial>>)> {
    let (backend, shape, config) = cuda_parts(sampler, &hidden, &weights, params, config)?;
    backend.debug_stage1(&hidden, &weights, params, shape, &config, poison)
}

/// Test hook: whether `sampler`'s kernel for `config` came from the on-disk PTX cache.
#[doc(hidden)]
pub fn debug_kernel_from_disk(sampler: &Sampler, config: &KernelConfig) -> Result<bool> {
    match (sampler.cuda_backend(), config) {
        (Some(b), KernelConfig::Cuda(c)) => b.kernel_from_disk(c),
        _ => Err(Error::ConfigBackend { sampler: sampler.device().describe() }),
    }
}
