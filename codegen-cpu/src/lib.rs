//! Lowers a flashsample [`Pipeline`](flashsample_ir::Pipeline) to Cranelift IR and JITs the
//! fused, multi-threaded CPU stage-one kernel: matmul, transforms, Gumbel noise and the
//! per-tile argmax (plus logsumexp partials) in one pass over the weights.
//!
//! The semantics are DESIGN.md's "Semantics every backend implements", steps 1–7; the
//! noise and the transcendentals are emitted op for op as `flashsample_abi` writes them.

// The matrix engines run on x86-64 only; elsewhere only their feature checks are reached.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
mod amx;
mod config;
mod error;
mod kernel;
mod lists;
mod lower;
mod lse_pass;
mod math;
mod pool;
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
mod tiles;

pub use config::{CpuConfig, CpuEngine, NoiseSkip, MAX_THREADS};
pub use error::CpuCodegenError;
pub use kernel::{capture_stride, Capture, CpuKernel, CpuLaunch, CpuRawOutputs, RankCounts, ResidualLists, CAPTURE_NONE};
pub use pool::thread_pool;
