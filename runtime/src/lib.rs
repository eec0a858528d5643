//! flashsample: fused LM-head sampling. Declare a pipeline with [`flashsample!`] (or build a
//! [`ir::Pipeline`] at run time), pick a [`Device`], and [`Sampler::sample`] draws tokens
//! straight from hidden states and LM-head weights without writing the `[B, V]` logits.
//!
//! This crate is the public facade: devices, typed matrix arguments, the sampler that
//! validates inputs, chooses a tile config, compiles (and caches) the kernel for the device
//! and reduces its per-tile candidates into [`Samples`].

mod cpu;
pub mod cuda;
mod device;
mod error;
mod sampler;
mod sharded;
mod stage_three;
mod tensor;
pub mod tp;
pub mod tuning;

pub use device::Device;
pub use error::{Error, Result};
pub use flashsample_abi::{ListError, ParamError, PenaltyArg, RowError, RowFilter, SamplingParams, TemperatureArg};
pub use flashsample_macros::flashsample;
pub use half::{bf16, f16};
pub use sampler::{KernelConfig, Sampler, Samples};
pub use flashsample_codegen_cpu::{CpuConfig, CpuEngine};
pub use sharded::ShardedSampler;
pub use tp::{TensorParallelSampler, TpError};
pub use tensor::{Element, Matrix, Tensor};
pub use cuda::{CudaDevice, DeviceTensor};
pub use flashsample_codegen_ptx::GpuConfig;

/// The pipeline IR, re-exported for builders and the macro's expansion.
pub use flashsample_ir as ir;
