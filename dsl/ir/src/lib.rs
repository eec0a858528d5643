//! The flashsample pipeline IR: what a fused LM-head sampling kernel computes.
//!
//! A [`Pipeline`] is plain data: a bf16/f16/f32 matmul `logits = hidden · weightsᵀ`,
//! an ordered list of elementwise [`Transform`]s applied to each logit in the
//! matmul epilogue, one [`Sampler`] and the extra [`Outputs`] requested. It is
//! validated once ([`Pipeline::validate`]), has a canonical text form
//! ([`std::fmt::Display`] / [`Pipeline::parse`], whose docs give its syntax and how it differs
//! from the `flashsample!` macro's) and a stable [`Pipeline::fingerprint`] that keys kernel
//! caches. The `flashsample!` macro, the CLI and tests all build pipelines through
//! [`PipelineBuilder`].

mod builder;
mod pipeline;
mod text;
mod validate;

pub use builder::PipelineBuilder;
pub use pipeline::{DType, DraftKind, LogprobMode, Operand, Outputs, Pipeline, Sampler, Targets, Temperature, Transform, Verify, F32};
pub use text::ParseError;
pub use validate::{IrError, Location};

/// Most samples per row one launch may draw (each sample is an independent Gumbel draw).
pub const MAX_SAMPLES_PER_ROW: u32 = 64;

/// Largest `max_k` of a [`Transform::Filter`] and largest `top_logprobs`: the fused candidate
/// lists live in shared memory on the GPU's stage two.
pub const MAX_LIST_CAPACITY: u32 = 1024;
