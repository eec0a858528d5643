//! The CPU search space: tile configs that can be fast on a machine with these cores and caches.

use flashsample::{ir::Pipeline, CpuConfig, CpuEngine};

/// What the CPU search space depends on, read from the machine (or recorded, for tests).
#[derive(Clone, Debug, PartialEq)]
pub struct CpuLimits {
    /// Worker threads of the kernel.
    pub threads: usize,
    /// Per-core L2 size in bytes.
    pub l2_bytes: usize,
}

impl CpuLimits {
    /// This machine's limits: worker threads from the OS, L2 from sysfs (2 MiB if unreadable).
    pub fn detect() -> CpuLimits {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let l2_bytes = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index2/size")
            .ok()
            .and_then(|s| parse_cache_size(s.trim()))
            .unwrap_or(2 << 20);
        CpuLimits { threads, l2_bytes }
    }
}

/// Parses sysfs cache sizes such as `2048K` or `2M`.
pub fn parse_cache_size(s: &str) -> Option<usize> {
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: usize = digits.parse().ok()?;
    match unit {
        "" => Some(n),
        "K" => Some(n << 10),
        "M" => Some(n << 20),
        _ => None,
    }
}

/// Vocab tile widths tried.
pub const VOCAB_TILES: [u32; 7] = [32, 64, 128, 256, 512, 1024, 2048];
/// Row blocks tried.
pub const ROW_BLOCKS: [u32; 3] = [1, 2, 4];

/// Every config worth compiling for this pipeline and shape, on every engine that can run
/// the pipeline on this host, pruned before any compile:
/// - invalid configs (`CpuConfig::validate`),
/// - Cranelift: tiles whose weights (`vocab_tile × dim` elements) overflow half the L2, so the
///   tile's rows would be evicted between row blocks; matrix engines: tiles whose logit
///   scratch (`batch × vocab_tile` f32) overflows half the L2 (the engine streams the weight
///   rows once per tile, and has no row block to vary),
/// - tilings with fewer tiles than threads (idle cores), unless the vocabulary is that small,
/// - row blocks larger than the (power-of-two rounded) batch.
///
/// Another engine than the heuristic's sums each dot product in another order, so its
/// configs fail the tuner's batch-invariance check (`tune::ShapeInputs`) and are never kept.
pub fn enumerate(pipeline: &Pipeline, batch: usize, dim: usize, vocab: usize, limits: &CpuLimits) -> Vec<CpuConfig> {
    let elem_bytes = pipeline.weights.dtype.size_bytes();
    let mut out = Vec::new();
    let engines = CpuEngine::ALL.into_iter().filter(|e| e.check(pipeline).is_ok());
    for engine in engines {
        let row_blocks: &[u32] = if engine == CpuEngine::Cranelift { &ROW_BLOCKS } else { &ROW_BLOCKS[..1] };
        for &vocab_tile in &VOCAB_TILES {
            for &row_block in row_blocks {
                let c = CpuConfig { vocab_tile, row_block, threads: limits.threads, engine, noise_skip: Default::default() };
                if keep(&c, batch, dim, vocab, elem_bytes, limits) {
                    out.push(c);
                }
            }
        }
    }
    out
}

fn keep(c: &CpuConfig, batch: usize, dim: usize, vocab: usize, elem_bytes: usize, limits: &CpuLimits) -> bool {
    if c.validate().is_err() {
        return false;
    }
    let tile_bytes = match c.engine {
        CpuEngine::Cranelift => c.vocab_tile as usize * dim * elem_bytes,
        CpuEngine::Avx512Bf16 | CpuEngine::AmxBf16 => c.vocab_tile as usize * batch * 4,
    };
    let tiles = vocab.div_ceil(c.vocab_tile as usize);
    let smallest_tile = c.vocab_tile == VOCAB_TILES[0];
    let fits = tile_bytes <= limits.l2_bytes / 2 && tiles >= limits.threads;
    (fits || smallest_tile) && c.row_block as usize <= batch.next_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Recorded from this project's 2-core Sapphire Rapids VM.
    const SPR_VM: CpuLimits = CpuLimits { threads: 2, l2_bytes: 2 << 20 };

    #[test]
    fn parses_sysfs_sizes() {
        assert_eq!(parse_cache_size("2048K"), Some(2 << 20));
        assert_eq!(parse_cache_size("2M"), Some(2 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("big"), None);
    }

    fn bf16() -> Pipeline {
        flashsample::ir::PipelineBuilder::new("P", flashsample::ir::DType::BF16, flashsample::ir::DType::BF16).build().unwrap()
    }

    #[test]
    fn prunes_tiles_that_overflow_l2() {
        let space: Vec<CpuConfig> =
            enumerate(&bf16(), 16, 4096, 151_936, &SPR_VM).into_iter().filter(|c| c.engine == CpuEngine::Cranelift).collect();
        assert!(!space.is_empty());
        // 4096 × 2 bytes = 8 KiB per vocab row: at most 128 rows fit in half of 2 MiB.
        assert!(space.iter().all(|c| c.vocab_tile <= 128), "{space:?}");
        assert!(space.iter().all(|c| c.validate().is_ok()));
    }

    #[test]
    fn engines_the_host_or_the_dtypes_rule_out_are_not_searched() {
        let f32_pipeline =
            flashsample::ir::PipelineBuilder::new("P", flashsample::ir::DType::F32, flashsample::ir::DType::BF16).build().unwrap();
        assert!(enumerate(&f32_pipeline, 64, 4096, 151_936, &SPR_VM).iter().all(|c| c.engine == CpuEngine::Cranelift));
        let space = enumerate(&bf16(), 64, 4096, 151_936, &SPR_VM);
        let engine_configs: Vec<_> = space.iter().filter(|c| c.engine == CpuEngine::Avx512Bf16).collect();
        assert_eq!(!engine_configs.is_empty(), CpuEngine::Avx512Bf16.missing_host_feature().is_none(), "{space:?}");
        // 64 rows × 4 bytes × vocab_tile ≤ 1 MiB.
        assert!(engine_configs.iter().all(|c| c.vocab_tile <= 4096 && c.row_block == 1), "{engine_configs:?}");
    }

    #[test]
    fn small_batches_skip_big_row_blocks_and_small_vocabs_keep_a_config() {
        let space = enumerate(&bf16(), 1, 256, 151_936, &SPR_VM);
        assert!(space.iter().all(|c| c.row_block == 1), "{space:?}");
        let tiny = enumerate(&bf16(), 3, 64, 40, &CpuLimits { threads: 64, l2_bytes: 1 << 20 });
        assert!(!tiny.is_empty(), "a 40-token vocabulary still gets the smallest tile");
        assert!(tiny.iter().all(|c| c.vocab_tile == VOCAB_TILES[0]));
    }
}
