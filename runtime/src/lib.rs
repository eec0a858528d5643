//! flashsample: fused LM-head sampling. Declare a pipeline with [`flashsample!`] (or build a
//! [`ir::Pipeline`] at run time), pick a [`Device`], and [`Sampler::sample`] draws tokens
//! straight from hidden states and LM-head weights without writing the `[B, V]` logits.
//!
//! This crate is the public facade: devices, typed matrix arguments, the sampler that
//! validates inputs, chooses a tile config, compiles (and caches) the kernel for the device
//! and reduces its per-tile candidates into [`Samples`]. On CUDA, [`cuda::SamplingPlan`] is the
//! device-side API for decode loops that keep tokens on the GPU.
//!
//! Modules point one way: the launch types ([`Shape`], [`Samples`], [`KernelConfig`]) sit in a
//! leaf that every backend uses; the sampler dispatches to the CPU backend and `cuda`; the
//! sharded and tensor-parallel samplers sit on top of [`Sampler`].
//!
//! # Cargo features
//! - `cuda` (default): the GPU backend (PTX through LLVM, launched through cudarc). Without it
//!   the crate builds and runs on the CPU with no LLVM or CUDA installed.
//! - `dynamic-loading` (default): libcuda is loaded at run time (cudarc `dynamic-loading`).
//! - `dynamic-linking`: link libcuda at build time instead (cudarc `dynamic-linking`, what
//!   candle's CUDA build uses). Choose one of the two, with `default-features = false`.

mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod device;
mod error;
mod launch;
mod sampler;
mod sharded;
mod stage_three;
mod tensor;
mod verify;
#[cfg(feature = "cuda")]
pub mod tp;
pub mod tuning;

pub use device::Device;
pub use error::{error_line, Error, Result};
pub use flashsample_abi::{ListError, ParamError, PenaltyArg, RowError, RowFilter, RowStatus, RowStatusError, SamplingParams, TemperatureArg};
pub use flashsample_codegen_cpu::{CpuConfig, CpuEngine};
pub use flashsample_macros::flashsample;
pub use half::{bf16, f16};
pub use launch::{KernelConfig, Samples, Shape};
pub use sampler::Sampler;
pub use sharded::ShardedSampler;
pub use tensor::{Element, Matrix, Tensor};
pub use verify::Verified;
#[cfg(feature = "cuda")]
pub use cuda::{CudaDevice, DeviceTensor};
#[cfg(feature = "cuda")]
pub use flashsample_codegen_ptx::{GpuConfig, Grid, GridKind, NoiseSkip, Schedule};
#[cfg(feature = "cuda")]
pub use tp::{TensorParallelSampler, TpError};

/// The pipeline IR, re-exported for builders and the macro's expansion.
pub use flashsample_ir as ir;
