use crate::CpuCodegenError;
use serde::{Deserialize, Serialize};

/// Most rows one register block may hold; beyond this the accumulators spill anyway.
pub(crate) const MAX_ROW_BLOCK: u32 = 8;
/// Largest vocab tile (tokens); a tile's winner is tracked in one slot, so this only bounds work per task.
pub(crate) const MAX_VOCAB_TILE: u32 = 1 << 24;
/// Most worker threads a CPU kernel (and so a CPU device) runs.
pub const MAX_THREADS: usize = 1024;

/// Tuning knobs of the CPU stage-one kernel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuConfig {
    /// Tokens per vocab tile (one candidate per row, sample and tile); a multiple of 4.
    pub vocab_tile: u32,
    /// Hidden rows that share each loaded weight vector (register blocking).
    pub row_block: u32,
    /// Worker threads of the kernel's own thread pool.
    pub threads: usize,
}

impl CpuConfig {
    /// A reasonable config for a `[batch, dim] x [vocab, dim]` launch on this machine.
    pub fn heuristic(batch: usize, dim: usize, vocab: usize) -> Self {
        let _ = dim;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_THREADS);
        // Enough tiles for load balance (8 per thread), few enough that stage two stays trivial.
        let per_tile = vocab.div_ceil(8 * threads).div_ceil(4) * 4;
        let vocab_tile = per_tile.clamp(64, 2048) as u32;
        // 4 rows × 4 tokens = 16 accumulators: a few spill, but it measured fastest at B = 16.
        let row_block = batch.clamp(1, 4) as u32;
        CpuConfig { vocab_tile, row_block, threads }
    }

    pub fn validate(&self) -> Result<(), CpuCodegenError> {
        let bad = |field, reason: String| Err(CpuCodegenError::InvalidConfig { field, reason });
        if self.vocab_tile < 4 || !self.vocab_tile.is_multiple_of(4) || self.vocab_tile > MAX_VOCAB_TILE {
            return bad(
                "vocab_tile",
                format!("is {}; it must be a multiple of 4 in 4..={MAX_VOCAB_TILE}", self.vocab_tile),
            );
        }
        if self.row_block == 0 || self.row_block > MAX_ROW_BLOCK {
            return bad("row_block", format!("is {}; it must be in 1..={MAX_ROW_BLOCK}", self.row_block));
        }
        if self.threads == 0 || self.threads > MAX_THREADS {
            return bad("threads", format!("is {}; it must be in 1..={MAX_THREADS}", self.threads));
        }
        Ok(())
    }
}
