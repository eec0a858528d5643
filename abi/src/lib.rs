//! The contract every flashsample backend implements, written once.
//!
//! - [`rng`]: the counter-based noise (Philox-4x32-10, counter from row, sample and
//!   vocabulary index) and the exact f32 algorithm that turns its bits into Gumbel noise.
//! - [`math`]: the f32 `ln`, `exp` and `tanh` algorithms that every backend emits op for op
//!   (explicit fused multiply-adds, no approximations), so CPU and GPU noise is bit-identical.
//! - [`candidates`]: the stage-one output layout (per row, sample and vocab tile) and the
//!   stage-two reduction over tiles, including the error rows (all masked, non-finite).
//! - [`lse`]: the row logsumexp as an exact integer sum, the same in any order or tiling.
//! - [`params`]: the run-time sampling parameters a launch takes, and their validation.
//! - [`row_tokens`]: the per-row sparse token lookup (bitset + binary search) of the penalty
//!   and logit-bias tables.
//! - [`filter`]: top-k / min-p / top-p and top-n logprobs from per-tile candidate lists.
//! - [`raw`]: the raw logprob mode: raw logits, their logsumexp, lists and the drawn token's.
//! - [`sharded`]: the exact merge of per-shard samples by log-mass (tensor-parallel heads).
//! - [`speculative`]: how draft tokens are accepted and the next token drawn, and their noise.
//! - [`status`]: the per-row status codes the kernels write and the errors they stand for.
//! - [`subset`]: some rows of a launch as a launch of their own (the exact nucleus path).

pub mod candidates;
pub mod filter;
pub mod lse;
pub mod math;
pub mod params;
pub mod raw;
pub mod rng;
pub mod row_tokens;
pub mod sharded;
pub mod speculative;
pub mod status;
pub mod subset;

pub use candidates::{Candidate, RowError, RowResult, StageTwo, INDEX_NONE, INDEX_NONFINITE};
pub use lse::{LsePartial, LseSum, LseTerm};
pub use filter::{ListError, Scored, TopLists};
pub use status::{RowStatus, RowStatusError};
pub use params::{
    penalize_f32, LogitBiasTable, ParamError, PenaltyArg, PenaltyTable, RowFilter, SamplingParams, TemperatureArg,
};
pub use row_tokens::{RowTokens, RowTokensError};
pub use subset::RowSubset;
