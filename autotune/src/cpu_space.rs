//! The CPU search space: tile configs that can be fast on a machine with these cores and caches.

use flashsample::CpuConfig;

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

/// Every config worth compiling for this shape, pruned before any compile:
/// - invalid configs (`CpuConfig::validate`),
/// - tiles whose weights (`vocab_tile × dim` elements) overflow half the L2, so the tile's
///   rows would be evicted between row blocks,
/// - tilings with fewer tiles than threads (idle cores), unless the vocabulary is that small,
/// - row blocks larger than the (power-of-two rounded) batch.
pub fn enumerate(batch: usize, dim: usize, vocab: usize, elem_bytes: usize, limits: &CpuLimits) -> Vec<CpuConfig> {
    let mut out = Vec::new();
    for &vocab_tile in &VOCAB_TILES {
        for &row_block in &ROW_BLOCKS {
            let c = CpuConfig { vocab_tile, row_block, threads: limits.threads };
            if c.validate().is_err() {
                continue;
            }
            let tile_bytes = vocab_tile as usize * dim * elem_bytes;
            let tiles = vocab.div_ceil(vocab_tile as usize);
            let smallest_tile = vocab_tile == VOCAB_TILES[0];
            if tile_bytes > limits.l2_bytes / 2 && !smallest_tile {
                continue;
            }
            if tiles < limits.threads && !smallest_tile {
                continue;
            }
            if row_block as usize > batch.next_power_of_two() {
                continue;
            }
            out.push(c);
        }
    }
    out
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

    #[test]
    fn prunes_tiles_that_overflow_l2() {
        let space = enumerate(16, 4096, 151_936, 2, &SPR_VM);
        assert!(!space.is_empty());
        // 4096 × 2 bytes = 8 KiB per vocab row: at most 128 rows fit in half of 2 MiB.
        assert!(space.iter().all(|c| c.vocab_tile <= 128), "{space:?}");
        assert!(space.iter().all(|c| c.validate().is_ok()));
    }

    #[test]
    fn small_batches_skip_big_row_blocks_and_small_vocabs_keep_a_config() {
        let space = enumerate(1, 256, 151_936, 2, &SPR_VM);
        assert!(space.iter().all(|c| c.row_block == 1), "{space:?}");
        let tiny = enumerate(3, 64, 40, 2, &CpuLimits { threads: 64, l2_bytes: 1 << 20 });
        assert!(!tiny.is_empty(), "a 40-token vocabulary still gets the smallest tile");
        assert!(tiny.iter().all(|c| c.vocab_tile == VOCAB_TILES[0]));
    }
}
