use crate::CpuCodegenError;
pub use flashsample_abi::rng::NoiseSkip;
use flashsample_ir::{DType, Pipeline};
use serde::{Deserialize, Serialize};

/// Most rows one register block may hold; beyond this the accumulators spill anyway.
pub(crate) const MAX_ROW_BLOCK: u32 = 8;
/// Largest vocab tile (tokens); a tile's winner is tracked in one slot, so this only bounds work per task.
/// A tile's logsumexp partial sums at most `abi::lse::MAX_PARTIAL_TOKENS` tokens (its u64 sums
/// cannot overflow), so no tile is larger.
pub(crate) const MAX_VOCAB_TILE: u32 = flashsample_abi::lse::MAX_PARTIAL_TOKENS as u32;
/// Most worker threads a CPU kernel (and so a CPU device) runs.
pub const MAX_THREADS: usize = 1024;
/// Bytes of one task's logit scratch (`batch × vocab_tile` f32) that the heuristic aims for.
/// Past L2 is fine (the epilogue reads it once, in order, right after the tiles wrote it), and
/// longer tiles make the epilogue cheaper: its winner grows over more tokens, so more quads
/// skip their noise. Measured at B = 256 (Zen 5, CPU time per launch): the epilogue took 191,
/// 163, 145 ms at 192, 384, 768 tokens (D = 1024) while the tiles' time did not move.
const SCRATCH_TARGET_BYTES: usize = 768 << 10;
/// Weight bytes of one tile that the hidden row chunks re-read (`tiles::HIDDEN_CHUNK_BYTES`):
/// kept in L3 (a 12 MiB tile still measured as fast as a 1.5 MiB one, D = 4096, B = 256).
const CHUNKED_TILE_BYTES: usize = 4 << 20;
/// Largest logit scratch a config may ask for; the engine path refuses bigger (row, tile) products.
pub(crate) const MAX_SCRATCH_BYTES: usize = 64 << 20;

/// Where stage one's raw logits come from. The epilogue (DESIGN.md steps 2–7) is always the
/// JIT'd Cranelift code; the engine only decides who computes `Σ_d hidden·weights`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CpuEngine {
    /// The JIT'd kernel computes its own dot products with 128-bit FMAs, fused with the
    /// epilogue: every host Cranelift supports, every dtype, exact f32 products.
    #[default]
    Cranelift,
    /// AVX-512-BF16 tiles (`vdpbf16ps`, 32 products per instruction) compute one vocabulary
    /// tile's logits for all rows into a per-thread L1/L2 scratch, which the JIT'd epilogue
    /// then reads. Needs bf16 hidden states and weights and a CPU with `avx512bf16`
    /// (DESIGN.md, "CPU matrix engine", states its f32 contract).
    Avx512Bf16,
    /// AMX-BF16 tiles (`tdpbf16ps`: a 16 × 16 × 32 block product per instruction, 16× the
    /// bf16 products per cycle of `vdpbf16ps`) into the same scratch. Needs bf16 hidden states
    /// and weights, a CPU with AMX-TILE, AMX-BF16 and AVX-512F, and the OS's permission to use
    /// the tile registers (requested once per process).
    AmxBf16,
}

impl CpuEngine {
    /// Every engine, fallback first.
    pub const ALL: [CpuEngine; 3] = [CpuEngine::Cranelift, CpuEngine::Avx512Bf16, CpuEngine::AmxBf16];

    /// The CPU feature the engine needs that this host lacks, if any (detected at run time).
    pub fn missing_host_feature(self) -> Option<&'static str> {
        match self {
            CpuEngine::Cranelift => None,
            CpuEngine::Avx512Bf16 => {
                #[cfg(target_arch = "x86_64")]
                {
                    for (name, present) in [
                        ("avx512f", std::is_x86_feature_detected!("avx512f")),
                        ("avx512bw", std::is_x86_feature_detected!("avx512bw")),
                        ("avx512dq", std::is_x86_feature_detected!("avx512dq")),
                        ("avx512bf16", std::is_x86_feature_detected!("avx512bf16")),
                    ] {
                        if !present {
                            return Some(name);
                        }
                    }
                    None
                }
                #[cfg(not(target_arch = "x86_64"))]
                Some("avx512bf16")
            }
            CpuEngine::AmxBf16 => crate::amx::missing_host_feature(),
        }
    }

    /// Whether the engine computes `hidden × weights` of these dtypes exactly as its contract says.
    pub fn supports(self, hidden: DType, weights: DType) -> bool {
        match self {
            CpuEngine::Cranelift => true,
            CpuEngine::Avx512Bf16 | CpuEngine::AmxBf16 => hidden == DType::BF16 && weights == DType::BF16,
        }
    }

    /// Why this engine cannot run `pipeline` on this host, if it cannot.
    pub fn check(self, pipeline: &Pipeline) -> Result<(), CpuCodegenError> {
        if let Some(feature) = self.missing_host_feature() {
            return Err(CpuCodegenError::MissingHostFeature(feature));
        }
        if !self.supports(pipeline.hidden.dtype, pipeline.weights.dtype) {
            return Err(CpuCodegenError::EngineDtype {
                engine: self,
                hidden: pipeline.hidden.dtype,
                weights: pipeline.weights.dtype,
            });
        }
        Ok(())
    }

    /// The fastest engine that can run `pipeline` here.
    pub fn best_for(pipeline: &Pipeline) -> CpuEngine {
        Self::ALL.into_iter().rev().find(|e| e.check(pipeline).is_ok()).unwrap_or(CpuEngine::Cranelift)
    }
}

impl std::fmt::Display for CpuEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CpuEngine::Cranelift => "cranelift",
            CpuEngine::Avx512Bf16 => "avx512bf16",
            CpuEngine::AmxBf16 => "amx",
        })
    }
}

impl std::str::FromStr for CpuEngine {
    type Err = CpuCodegenError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|e| e.to_string() == s).ok_or_else(|| CpuCodegenError::InvalidConfig {
            field: "engine",
            reason: format!("is `{s}`; it must be one of cranelift, avx512bf16, amx"),
        })
    }
}

/// Tuning knobs of the CPU stage-one kernel.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CpuConfig {
    /// Tokens per vocab tile (one candidate per row, sample and tile); a multiple of 4.
    pub vocab_tile: u32,
    /// Hidden rows that share each loaded weight vector (register blocking of the Cranelift engine).
    pub row_block: u32,
    /// Worker threads a launch splits its tiles over.
    pub threads: usize,
    /// Who computes the logits. Absent in tuning files written before engines existed, which
    /// measured the Cranelift kernel.
    #[serde(default)]
    pub engine: CpuEngine,
    /// Which noise the epilogue skips (every choice samples the same tokens). Absent in
    /// tuning files written before the CPU's cross-tile bound, whose kernels skipped in-tile.
    #[serde(default)]
    pub noise_skip: NoiseSkip,
}

impl CpuConfig {
    /// A reasonable config for a `[batch, dim] x [vocab, dim]` launch of `pipeline` on this
    /// machine, on the fastest engine the host and the dtypes allow.
    pub fn heuristic(pipeline: &Pipeline, batch: usize, dim: usize, vocab: usize) -> Self {
        Self::heuristic_for_engine(CpuEngine::best_for(pipeline), batch, dim, vocab)
    }

    /// A reasonable config for a `[batch, dim] x [vocab, dim]` launch on `engine`.
    pub fn heuristic_for_engine(engine: CpuEngine, batch: usize, dim: usize, vocab: usize) -> Self {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_THREADS);
        // Enough tiles for load balance (8 per thread), few enough that stage two stays trivial.
        let per_tile = vocab.div_ceil(8 * threads).div_ceil(4) * 4;
        let vocab_tile = match engine {
            CpuEngine::Cranelift => per_tile.clamp(64, 2048) as u32,
            // The scratch (`batch × vocab_tile` f32) stays in L2.
            CpuEngine::Avx512Bf16 | CpuEngine::AmxBf16 => {
                let fits = SCRATCH_TARGET_BYTES / (4 * batch.max(1)) / 4 * 4;
                // Hidden states past L2 are split into row chunks that each re-read the tile's
                // weights: keep those in L3.
                let chunked = batch * dim * 2 > crate::tiles::HIDDEN_CHUNK_BYTES;
                let rereads = if chunked { CHUNKED_TILE_BYTES / (2 * dim.max(1)) / 4 * 4 } else { usize::MAX };
                let tile = per_tile.min(fits).min(rereads).clamp(32, 2048);
                // AMX blocks are 64 (up to 16 rows) or 32 tokens (above): whole blocks only.
                (if engine == CpuEngine::AmxBf16 { tile.max(64) / 64 * 64 } else { tile }) as u32
            }
        };
        // Cranelift: 4 rows × 4 tokens = 16 accumulators: a few spill, but it measured fastest at B = 16.
        let row_block = batch.clamp(1, 4) as u32;
        CpuConfig { vocab_tile, row_block, threads, engine, noise_skip: NoiseSkip::default() }
    }

    /// Checks every field against what the kernel supports (a typed error naming the field).
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
