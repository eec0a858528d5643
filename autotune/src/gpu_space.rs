//! The CUDA search space ([`enumerate`]) and a cheap cost model of its configs, from
//! `GpuLimits` and the shape alone, to rank it before anything is compiled (`--top-heuristic K`
//! keeps the K best).
//!
//! The model is a roofline with three efficiency factors; only the *ranking* matters, so the
//! constants are round numbers for an sm_90-class part, not a calibration:
//! - memory: every batch tile streams all of `W` (`V·D·elem` bytes; at LM-head sizes `W` is
//!   far larger than L2), at `HBM_BYTES_PER_S` scaled by how well the `cp.async` ring hides
//!   latency (bytes in flight per SM against `INFLIGHT_BYTES_PER_SM`, Little's law);
//! - tensor-core math on the padded batch (`batch_tile · batch tiles` columns);
//! - the per-token epilogue (temperature, Philox, Gumbel log, compare) on the padded batch;
//!
//! math and epilogue are divided by the wave efficiency of the grid (resident CTAs per SM from
//! shared memory, threads and registers; the last partial wave idles SMs). The epilogue has no
//! loads in flight, so it hides behind the W stream only where a second CTA on the SM runs out
//! of phase (`stagger_us` with two resident CTAs, or a persistent grid's prefetch); otherwise it
//! adds to the stream's time (about a quarter of the warp time at B = 64, BENCHMARKS.md).

use flashsample::{ir::Pipeline, GpuConfig};
use flashsample_codegen_ptx::{uses_tensor_cores, GpuLimits, Grid, GridKind, Schedule, default_list_per_tile, HEURISTIC_STAGGER_US};

/// The staggers tried (besides 0) on tiles of which two fit on an SM.
pub const STAGGER_CANDIDATES_US: [u32; 3] = [20, 30, 40];

/// The schedules of one ring depth, slice and grid: every mainloop kind (wgmma ones only
/// with their 64-element slice), the warp-specialized ones (ping-pong, cooperative, the
/// cooperative pair where the tile has its 8 warps) only on a persistent grid.
fn schedules(stages: u32, k_step: u32, grid: Grid) -> Vec<Schedule> {
    let mut out = vec![Schedule::MmaSync { stages, k_step, grid }];
    if k_step == flashsample_codegen_ptx::WGMMA_K_STEP {
        out.extend([Schedule::Wgmma { stages, drain: false, grid }, Schedule::Wgmma { stages, drain: true, grid }, Schedule::WgmmaTma { stages, grid: grid.into() }]);
        if grid == Grid::Persistent {
            out.extend([GridKind::PingPong, GridKind::Cooperative, GridKind::CooperativePair].map(|grid| Schedule::WgmmaTma { stages, grid }));
        }
    }
    out
}

/// The autotuner's search space for `pipeline` on a device, pruned by [`GpuConfig::validate`]
/// (which also drops wgmma off compute capability 9.0). Pipelines with lists also try
/// `list_per_tile` [`default_list_per_tile`] and 32 (capped): longer lists cost stage one time but overflow (and
/// rerun) less. Staggers ([`STAGGER_CANDIDATES_US`]) only where two CTAs share an SM.
pub fn enumerate(pipeline: &Pipeline, limits: &GpuLimits) -> Vec<GpuConfig> {
    let mut out = Vec::new();
    let tensor = uses_tensor_cores(pipeline);
    // Both kinds of list (processed, and raw in the raw logprob mode) use `list_per_tile`.
    let cap = flashsample_codegen_ptx::list_capacity(pipeline);
    for warps in [4u32, 8] {
        for quads in [1u32, 2, 4] {
            for batch_tile in [8u32, 16, 32, 64, 128] {
                let vocab_tile = 32 * warps * quads;
                let mut lists: Vec<u32> = if cap == 0 {
                    vec![0]
                } else {
                    [default_list_per_tile(vocab_tile), 32].iter().map(|&l| l.min(cap).min(vocab_tile)).collect()
                };
                lists.dedup();
                let (k_steps, depths): (&[u32], &[u32]) = if tensor { (&[64, 128], &[2, 3, 4, 6, 8]) } else { (&[0], &[1]) };
                for &k_step in k_steps {
                    for &stages in depths {
                        for grid in [Grid::PerItem, Grid::Persistent] {
                            let space = if tensor { schedules(stages, k_step, grid) } else { vec![Schedule::Simt { grid }] };
                            for &list_per_tile in &lists {
                                for &schedule in &space {
                                    let c = GpuConfig { list_per_tile, ..GpuConfig::new(vocab_tile, batch_tile, warps, schedule) };
                                    if c.validate(pipeline, limits).is_err() {
                                        continue;
                                    }
                                    let staggers: &[u32] = if c.is_tensor() && c.two_per_sm(limits) { &STAGGER_CANDIDATES_US } else { &[] };
                                    for &stagger_us in staggers {
                                        out.push(c.clone().with_stagger(stagger_us));
                                    }
                                    out.push(c);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// Sustained HBM bandwidth assumed (H200 measures 4.2 TB/s device-to-device).
const HBM_BYTES_PER_S: f64 = 4.0e12;
/// Bytes each SM must have in flight to reach that bandwidth (~1 µs latency × 4 TB/s / 132).
const INFLIGHT_BYTES_PER_SM: f64 = 40.0 * 1024.0;
/// Dense bf16 `mma.sync` FLOP/s per SM (about half the wgmma peak).
const MMA_FLOPS_PER_SM: f64 = 3.5e12;
/// Epilogue instructions per (token, column) and lane-instructions per SM per second.
const EPILOGUE_OPS: f64 = 120.0;
const LANE_OPS_PER_SM: f64 = 128.0 * 1.7e9;
/// The share of the TMA ring's W stream a `cp.async` ring of the same depth reaches: its
/// threads issue every slice and a CTA barrier ends each (H100, B = 16: the TMA tiles 5 %
/// faster than every mma.sync tile, BENCHMARKS.md 2026-12-05 fifth session). Enough that a
/// memory-bound tile's TMA variant is timed first among its shape's.
const CP_ASYNC_STREAM_EFFICIENCY: f64 = 0.95;
/// Fixed cost per launch pair (stage one + stage two), seconds.
const LAUNCH_S: f64 = 6e-6;

/// Modeled seconds of one launch of `c` at (`batch`, `dim`, `vocab`), elements of `elem_bytes`.
pub fn modeled_seconds(c: &GpuConfig, limits: &GpuLimits, batch: usize, dim: usize, vocab: usize, elem_bytes: usize) -> f64 {
    let sms = f64::from(limits.sm_count.max(1));
    let btiles = c.batch_tiles(batch) as f64;
    let padded = btiles * f64::from(c.batch_tile);
    let resident = c.resident_per_sm(limits);
    let (gx, gy, _) = c.grid(batch, vocab, resident * limits.sm_count);
    let ctas = f64::from(gx) * f64::from(gy);
    let slots = f64::from(resident) * sms;
    let waves = (ctas / slots).ceil().max(1.0);
    // Persistent grids loop over the work items, so they have no partial wave of CTAs, but
    // one of work items.
    let items = c.tiles(vocab) as f64 * btiles;
    let wave_eff = if c.is_persistent() { items / ((items / ctas.max(1.0)).ceil() * ctas.max(1.0)) } else { ctas / (waves * slots) };
    let active_per_sm = (ctas / sms).min(f64::from(resident)).max(1e-3);
    // Slices in flight: codegen's own prefetch depth and slot size.
    let ring = if c.is_tensor() { f64::from(c.prefetch_depth().max(1)) * f64::from(c.smem_layout().slot_bytes) } else { f64::from(c.vocab_tile * 64 * 2) };
    let mem_eff = (active_per_sm * ring / INFLIGHT_BYTES_PER_SM).min(1.0);
    // H, re-read by every vocab tile, hits L2 and did not slow the k loop (its warp samples
    // were equal at B = 8 and B = 64, BENCHMARKS.md), so only W's bytes count.
    let bytes = (vocab * dim * elem_bytes) as f64 * btiles;
    let ring_eff = if c.is_tensor() && !c.uses_tma() { CP_ASYNC_STREAM_EFFICIENCY } else { 1.0 };
    let mem = bytes / (HBM_BYTES_PER_S * mem_eff * ring_eff);
    let flops = 2.0 * vocab as f64 * dim as f64 * padded;
    let mma = match (c.is_tensor(), c.uses_wgmma()) {
        (true, true) => 2.0 * MMA_FLOPS_PER_SM,
        (true, false) => MMA_FLOPS_PER_SM,
        (false, _) => MMA_FLOPS_PER_SM / 8.0,
    };
    let math = flops / (mma * sms * wave_eff.max(1e-3));
    let epilogue = vocab as f64 * padded * EPILOGUE_OPS / (LANE_OPS_PER_SM * sms * wave_eff.max(1e-3));
    // A persistent grid's prefetch, a staggered second CTA or the ping-pong's second consumer
    // set runs one tile's epilogue under another's W stream.
    let overlapped = c.is_persistent() || (resident >= 2 && c.stagger_us > 0);
    let time = if overlapped { mem.max(math + epilogue) } else { mem.max(math) + epilogue };
    time + LAUNCH_S
}

/// (`vocab_tile`, `batch_tile`, `warps`, `k_step`).
type TileShape = (u32, u32, u32, u32);

/// `space` ordered for measuring: by modeled time, but round-robin over tile shapes
/// (`vocab_tile`, `batch_tile`, `warps`, `k_step`): first the best variant of every shape in
/// model order, then the second-best of each, and so on. While memory-bound the model ties
/// many ring depths and grid kinds of one tile shape; measuring those first would spend a
/// short budget on near-duplicates. Ties prefer the heuristic's 4-stage ring, then
/// non-persistent grids, then the heuristic's stagger.
pub fn rank(space: Vec<GpuConfig>, pipeline: &Pipeline, limits: &GpuLimits, batch: usize, dim: usize, vocab: usize) -> Vec<GpuConfig> {
    let elem = pipeline.weights.dtype.size_bytes();
    let tie = |c: &GpuConfig| (c.stages().abs_diff(4), c.is_persistent(), c.stagger_us.abs_diff(HEURISTIC_STAGGER_US));
    let mut scored: Vec<(f64, GpuConfig)> =
        space.into_iter().map(|c| (modeled_seconds(&c, limits, batch, dim, vocab, elem), c)).collect();
    scored.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| tie(&a.1).cmp(&tie(&b.1))));
    let mut groups: Vec<(TileShape, Vec<GpuConfig>)> = Vec::new();
    for (_, c) in scored {
        let key = (c.vocab_tile, c.batch_tile, c.warps, c.k_step());
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => g.push(c),
            None => groups.push((key, vec![c])),
        }
    }
    let depth = groups.iter().map(|(_, g)| g.len()).max().unwrap_or(0);
    (0..depth).flat_map(|i| groups.iter().filter_map(move |(_, g)| g.get(i).cloned()).collect::<Vec<_>>()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashsample::ir::{DType, PipelineBuilder};

    fn pipeline() -> Pipeline {
        PipelineBuilder::new("p", DType::BF16, DType::BF16).temperature_per_row("t").build().unwrap()
    }

    #[test]
    fn enumeration_is_pruned_dtype_specific_and_covers_every_schedule() {
        let h200 = GpuLimits::H200;
        let bf = pipeline();
        let space = enumerate(&bf, &h200);
        assert!(space.iter().all(|c| c.is_tensor() && c.validate(&bf, &h200).is_ok()));
        assert!(space.iter().any(|c| c.batch_tile == 8 && c.warps == 8), "GEMV-style configs for small batches");
        for schedule in [
            Schedule::MmaSync { stages: 4, k_step: 128, grid: Grid::Persistent },
            Schedule::Wgmma { stages: 4, drain: true, grid: Grid::PerItem },
            Schedule::WgmmaTma { stages: 4, grid: GridKind::PerItem },
            Schedule::WgmmaTma { stages: 8, grid: GridKind::PingPong },
            Schedule::WgmmaTma { stages: 4, grid: GridKind::Cooperative },
            Schedule::WgmmaTma { stages: 4, grid: GridKind::CooperativePair },
        ] {
            assert!(space.iter().any(|c| c.schedule == schedule), "{schedule:?}");
        }
        // Staggers only where two CTAs share an SM.
        assert!(space.iter().any(|c| c.stagger_us > 0));
        assert!(space.iter().filter(|c| c.stagger_us > 0).all(|c| c.two_per_sm(&h200)));
        // No wgmma below compute capability 9.0; a smaller device gets a smaller space.
        let a100 = GpuLimits { compute_capability: (8, 0), ..h200 };
        assert!(enumerate(&bf, &a100).iter().all(|c| !c.uses_wgmma()));
        let small = GpuLimits { max_shared_per_block_optin: 48 * 1024, ..h200 };
        let s = enumerate(&bf, &small);
        assert!(!s.is_empty() && s.len() < space.len());
        let f32s = enumerate(&PipelineBuilder::new("f", DType::F32, DType::F32).temperature_per_row("t").build().unwrap(), &h200);
        assert!(!f32s.is_empty() && f32s.iter().all(|c| !c.is_tensor()));
        // Pipelines with lists try two list lengths.
        let lists = PipelineBuilder::new("l", DType::BF16, DType::BF16).filter("f", 64).build().unwrap();
        let all = enumerate(&lists, &h200);
        assert!(all.iter().any(|c| c.list_per_tile == 8) && all.iter().any(|c| c.list_per_tile == 32));
        assert!(all.iter().all(|c| c.validate(&lists, &h200).is_ok()));
    }

    #[test]
    fn a_spread_of_the_space_compiles_without_local_memory() {
        let p = pipeline();
        for c in enumerate(&p, &GpuLimits::H200).iter().step_by(17) {
            let k = flashsample_codegen_ptx::compile(&p, c, flashsample_codegen_ptx::Arch::Sm90).unwrap_or_else(|e| panic!("{c:?}: {e}"));
            assert!(!k.ptx.contains(".local"), "{c:?}");
        }
    }

    #[test]
    fn small_batches_prefer_one_batch_tile_and_large_ones_stay_near_the_heuristic() {
        let p = pipeline();
        let l = GpuLimits::H200;
        let space = enumerate(&p, &l);
        assert!(space.len() > 50, "{}", space.len());
        for batch in [1usize, 8, 16, 64, 256] {
            let ranked = rank(space.clone(), &p, &l, batch, 8192, 128_256);
            let best = &ranked[0];
            // Re-reading W per batch tile is the dominant cost while memory-bound.
            if batch <= 64 {
                assert_eq!(best.batch_tiles(batch), 1, "B={batch}: {best:?}");
            }
            let h = GpuConfig::heuristic(&p, batch, 8192, 128_256, &l);
            let t = |c: &GpuConfig| modeled_seconds(c, &l, batch, 8192, 128_256, 2);
            assert!(t(best) <= t(&h), "B={batch}");
            // The model is a roofline: nothing beats the W-bytes floor.
            assert!(t(best) >= 128_256.0 * 8192.0 * 2.0 / HBM_BYTES_PER_S);
        }
    }

    #[test]
    #[ignore = "prints the model's ranking at the H200's limits"]
    fn print_ranking() {
        let p = pipeline();
        let l = GpuLimits::H200;
        for batch in [1usize, 16, 64, 256] {
            let h = GpuConfig::heuristic(&p, batch, 8192, 128_256, &l);
            println!("B={batch} heuristic {:.1} us {h:?}", modeled_seconds(&h, &l, batch, 8192, 128_256, 2) * 1e6);
            for c in rank(enumerate(&p, &l), &p, &l, batch, 8192, 128_256).iter().take(5) {
                println!("  {:.1} us {c:?}", modeled_seconds(c, &l, batch, 8192, 128_256, 2) * 1e6);
            }
        }
    }

    #[test]
    fn resident_ctas_respect_shared_memory() {
        let l = GpuLimits::H200;
        let big = GpuConfig::new(256, 64, 8, Schedule::MmaSync { stages: 4, k_step: 128, grid: Grid::PerItem });
        assert_eq!(big.resident_per_sm(&l), ((l.max_shared_per_block_optin + 1024) / big.smem_bytes()).max(1));
    }

    #[test]
    fn the_tma_ring_ranks_ahead_of_its_cp_async_twin_and_pingpong_first() {
        let (p, l) = (pipeline(), GpuLimits::H200);
        let ring = GpuConfig::new(256, 64, 8, Schedule::Wgmma { stages: 5, drain: false, grid: Grid::PerItem });
        let tma = ring.clone().with_schedule(Schedule::WgmmaTma { stages: 5, grid: GridKind::PerItem });
        let t = |c: &GpuConfig| modeled_seconds(c, &l, 64, 4096, 151_936, 2);
        // One slice more in flight (no slot held by MMAs in flight) and no CTA barrier per slice.
        assert!(t(&tma) < t(&ring));
        let pingpong = GpuConfig::new(128, 64, 4, Schedule::WgmmaTma { stages: 8, grid: GridKind::PingPong });
        pingpong.validate(&p, &l).unwrap();
        assert_eq!(rank(vec![ring.clone(), tma.clone(), pingpong.clone()], &p, &l, 64, 4096, 151_936)[0], pingpong);
    }

    #[test]
    fn a_staggered_pair_of_ctas_hides_the_epilogue_and_ranks_first() {
        let (p, l) = (pipeline(), GpuLimits::H200);
        let pair = GpuConfig::new(128, 64, 4, Schedule::Wgmma { stages: 4, drain: true, grid: Grid::PerItem });
        let staggered = pair.clone().with_stagger(HEURISTIC_STAGGER_US);
        assert!(pair.resident_per_sm(&l) >= 2);
        let t = |c: &GpuConfig| modeled_seconds(c, &l, 64, 4096, 151_936, 2);
        assert!(t(&staggered) < t(&pair));
        let other = pair.clone().with_stagger(40);
        assert_eq!(rank(vec![other.clone(), pair.clone(), staggered.clone()], &p, &l, 64, 4096, 151_936)[0], staggered);
    }
}
