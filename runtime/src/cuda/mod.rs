//! The CUDA device: PTX from `flashsample-codegen-ptx`, loaded and launched through the
//! driver API (cudarc; libcuda is loaded at run time by default, so builds need no CUDA toolkit).
//!
//! - [`CudaDevice`]: one opened GPU (context, stream, limits read from its attributes).
//! - [`DeviceTensor`]: a matrix in GPU memory. Upload LM-head weights once with
//!   [`CudaDevice::upload`]; host tensors passed to a CUDA sampler are uploaded on every call.
//! - [`SamplingPlan`]: the device API. Made once per (pipeline, device, max batch, D, V) with
//!   [`CudaSampler::plan`]; each launch reads the caller's device buffers ([`DeviceInputs`]),
//!   writes the caller's ([`DeviceOutputs`]) and enqueues on the caller's stream.
//! - [`CudaSampler`]: a [`crate::Sampler`]'s CUDA half ([`crate::Sampler::cuda`]): plans, the
//!   host API on top of them, and the benchmarks' timing entry points.
//! - Kernels compile once per (pipeline, config) per process; their PTX is cached on disk
//!   (see [`cache_dir`]).
//!
//! The module points one way: `device` ← `cache` ← `plan` ← `backend`; nothing here imports
//! the sampler.

mod args;
mod runtime_kernels;
mod backend;
mod cache;
#[cfg(test)]
mod decide_sim;
#[cfg(test)]
mod filter_sim;
#[cfg(test)]
mod glue_sim;
#[cfg(test)]
mod ir_sim;
#[cfg(test)]
mod nucleus_sim;
#[cfg(test)]
mod stage1_sim;
#[cfg(test)]
mod stage2_sim;
mod device;
mod plan;
mod ptx;
mod tma;
mod verify;

pub use args::{
    DeviceIn, DeviceInputs, DeviceLogitBias, DeviceMatrix, DeviceOut, DeviceOutputs, DevicePenalties, DeviceRowTokens,
};
pub use backend::CudaSampler;
pub use cache::cache_dir;
pub use device::{CudaDevice, DeviceTensor};
pub(crate) use device::drv;
pub use plan::{DeviceDrafts, SamplingPlan, VerifyOutputs, DEFAULT_NUCLEUS_ROWS};
