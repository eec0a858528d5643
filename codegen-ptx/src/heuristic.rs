//! The documented fallback config when no tuned one exists ([`GpuConfig::heuristic`]).
//! Measurements behind each row are in BENCHMARKS.md; this module keeps only the policy.

use crate::config::{uses_tensor_cores, GpuConfig, GpuLimits, Grid, GridKind, Schedule};
#[cfg(doc)]
use crate::config::NoiseSkip;
use flashsample_ir::Pipeline;

/// The heuristic's stagger for its two-CTA-per-SM tiles (the best of 0–80 µs measured at
/// both LM-head shapes, BENCHMARKS.md).
pub const HEURISTIC_STAGGER_US: u32 = 30;

impl GpuConfig {
    /// The fallback when no tuned config exists. First match wins:
    ///
    /// | when | tile (vocab × batch, warps) | schedule | why |
    /// |---|---|---|---|
    /// | f32 or mixed dtypes | 128 × 8, 4 | SIMT | the only path |
    /// | B ≥ 2048, cc 9.0, maps fit, no lists, scoring targets | 256 × 128, 8 | wgmma + TMA, cooperative pair, 4 stages | as below; a cluster of two shares each W slice |
    /// | B ≥ 192, cc 9.0, maps fit, no lists | 256 × 128, 8 | wgmma + TMA, persistent, 4 stages | fewest L2 bytes per logit |
    /// | B ≥ 192, cc 9.0, maps fit, verifying, no filter | 128 × 64, 4 | wgmma + TMA, ping-pong, 4 stages | the residual epilogue runs under the other set's mainloop |
    /// | B ≥ 192, cc 9.0, maps fit, lists (a filter, verifying or not) | 256 × 128, 8 | wgmma + TMA, one CTA per item, 4 stages | fewest L2 bytes per logit; the lists alias the ring |
    /// | B > 32, cc 9.0, maps fit ([`GpuConfig::tma_fits`]) | 128 × 64, 4 (B ≥ 192: 128 × 128) | wgmma + TMA, ping-pong, 8 stages (128 × 128: 6) | one set's epilogue runs under the other's W stream |
    /// | B ≤ 8, cc 9.0, D ≥ 1024, no lists | 256 × 8, 8 | mma.sync, k 128, 3 stages | fewer barriers per byte |
    /// | B ≤ 8 | 256 × 8, 8 | mma.sync, 4 stages | memory-bound GEMV: most bytes in flight per SM |
    /// | B ≤ 16, cc 9.0, maps fit, no lists | 256 × 16, 8 | wgmma + TMA, 4 stages | no CTA barrier per slice |
    /// | B ≤ 16 | 128 × 16, 4 | mma.sync, 4 stages | |
    /// | B ≤ 32 | 128 × 32, 4 | mma.sync, 4 stages, stagger | two CTAs per SM, out of phase |
    /// | B ≤ 64, cc 9.0, two fit per SM | 128 × 64, 4 | wgmma drained, 4 stages, stagger | as above; drained: one more slice in flight |
    /// | B ≥ 192, cc 9.0 | 256 × 128, 8 | wgmma, 4 stages | fewer W re-reads |
    /// | otherwise | 256 × 64, 8 | wgmma (cc 9.0, 5 stages) or mma.sync (4) | |
    ///
    /// Lists ([`GpuConfig::fit_lists`]) take shared memory: stages are reduced until the tile
    /// fits `limits` (wgmma down to 3, then mma.sync down to 2); a ping-pong tile that does not
    /// fit with 3 stages falls through to the rows below (from B = 192 first to 128 × 64). The
    /// stagger is [`HEURISTIC_STAGGER_US`], only on 128-row tiles of batch ≥ 32 of which two fit.
    ///
    /// Every tile keeps [`NoiseSkip::CrossTile`] (the default): the cross-tile skip takes
    /// 8–15 % off B = 256 / 512, and at the memory-bound batches it was the fastest of the
    /// three, row bounds' zeroing included (BENCHMARKS.md, 2026-12-05 fifth session: H100,
    /// B = 16: 449 µs against 452 without skips and 453 with the in-tile skip alone).
    pub fn heuristic(pipeline: &Pipeline, batch: usize, dim: usize, vocab: usize, limits: &GpuLimits) -> GpuConfig {
        if !uses_tensor_cores(pipeline) {
            let mut c = GpuConfig::new(128, 8, 4, Schedule::Simt { grid: Grid::PerItem });
            c.fit_lists(pipeline);
            return c;
        }
        let wgmma = batch > 32 && limits.compute_capability == (9, 0);
        let fits = |c: &GpuConfig| c.smem_bytes() <= limits.max_shared_per_block_optin;
        let tile = |vocab_tile: u32, batch_tile: u32, warps: u32| {
            let grid = Grid::PerItem;
            let schedule = if wgmma {
                let stages = if vocab_tile == 256 && batch_tile == 64 { 5 } else { 4 };
                Schedule::Wgmma { stages, drain: vocab_tile == 128, grid }
            } else {
                Schedule::MmaSync { stages: 4, k_step: 64, grid }
            };
            let mut c = GpuConfig::new(vocab_tile, batch_tile, warps, schedule);
            c.fit_lists(pipeline);
            while c.stages() > 3 && !fits(&c) {
                c.schedule = c.schedule.with_stages(c.stages() - 1);
            }
            // wgmma needs 3 stages; below that, mma.sync with 2.
            if !fits(&c) {
                c.schedule = Schedule::MmaSync { stages: c.stages(), k_step: 64, grid };
                while c.stages() > 2 && !fits(&c) {
                    c.schedule = c.schedule.with_stages(c.stages() - 1);
                }
            }
            if vocab_tile == 128 && batch_tile >= 32 && c.two_per_sm(limits) {
                c.stagger_us = HEURISTIC_STAGGER_US;
            }
            c
        };
        // The ping-pong schedule on the TMA ring, where the maps describe the shape and the
        // tile fits (lists may not leave room); None sends the batch to the tiles below.
        let pingpong = |batch_tile: u32, stages: u32| {
            if !wgmma || !GpuConfig::tma_fits(dim, vocab) {
                return None;
            }
            let mut c = GpuConfig::new(128, batch_tile, 4, Schedule::WgmmaTma { stages, grid: GridKind::PingPong });
            c.fit_lists(pipeline);
            while c.stages() > 3 && c.validate(pipeline, limits).is_err() {
                c.schedule = c.schedule.with_stages(c.stages() - 1);
            }
            c.validate(pipeline, limits).is_ok().then_some(c)
        };
        // A fixed tile for list-free pipelines on sm_90, where the TMA maps describe the shape
        // (TMA tiles) and it fits `limits`; None sends the batch to the tiles below.
        let list_free_sm90 = |c: GpuConfig| {
            (limits.compute_capability == (9, 0)
                && pipeline.list_capacity() == 0
                && (!c.uses_tma() || GpuConfig::tma_fits(dim, vocab))
                && c.validate(pipeline, limits).is_ok())
            .then_some(c)
        };
        // From B = 192 a list-free pipeline takes the 256 × 128 tile on the TMA ring: it
        // streams W through L2 B/128 times and H V/256 times (the ping-pong 128-row tiles
        // carry ~1.35× the L2 bytes, and stage one is L2-bound there). Lists would leave
        // this tile too few stages; they keep the ping-pong rows below.
        let wide = || list_free_sm90(GpuConfig::new(256, 128, 8, Schedule::WgmmaTma { stages: 4, grid: GridKind::Persistent }));
        // A scorer of 2048 rows or more (no noise, no lists: its epilogue is a logsumexp and a
        // target compare) takes the same tile as cooperative CTAs in clusters of two along the
        // batch, so a W slice crosses L2 once per pair instead of twice. H100, twenty-eighth
        // session (BENCHMARKS.md): 6 % / 4 % faster than the persistent tile at D 4096, 2048 /
        // 8192 rows, 1 % / 0 % at D 8192.
        let scorer_pair = || {
            let c = GpuConfig::new(256, 128, 8, Schedule::WgmmaTma { stages: 4, grid: GridKind::CooperativePair });
            (pipeline.targets.is_some() && batch >= 2048).then(|| list_free_sm90(c)).flatten()
        };
        // With lists the same tile runs one CTA per item: its epilogue scratch and lists then
        // alias the ring (beside a persistent 4-stage ring they would need ~360 KB). It gives up
        // the overlap of an item's epilogue with the next item's loads, but reads W B/128 times
        // where the 128 × 64 ping-pong below reads it B/64 times (H100, top-k 50 + top-p 0.9,
        // B 256 / 512: 8–17 % faster at both heads, BENCHMARKS.md fourteenth session). A
        // verifying pipeline's residual lists are per-tile lists too: a filtered verifier takes
        // the same tile, an unfiltered one where `verify_pingpong` below does not validate.
        let wide_lists = || {
            let tile_lists = pipeline.list_capacity() > 0 || pipeline.verify.is_some();
            if !wgmma || !tile_lists || !GpuConfig::tma_fits(dim, vocab) {
                return None;
            }
            let mut c = GpuConfig::new(256, 128, 8, Schedule::WgmmaTma { stages: 4, grid: GridKind::PerItem });
            c.fit_lists(pipeline);
            c.validate(pipeline, limits).is_ok().then_some(c)
        };
        // A verifying pipeline without a filter from B = 192 rows: the 128 × 64 ping-pong with a
        // 4-stage ring.
        // Its residual epilogue (noise for every token of every draft row) hides behind the
        // other warpgroup's mainloop, which the one-CTA-per-item 256 × 128 tile cannot do: on an
        // H100 its stage one took 1110 / 2219 µs against 1284 / 2359 at D 4096, 256 / 512 rows,
        // and 1382 / 2770 against 1531 / 2849 at D 8192 (6 stages: 1207 / 2402 and 1559 / 3150;
        // BENCHMARKS.md, GPU 2026-12-07, twentieth session).
        // A verifier that also filters keeps the tile of the filtered pipelines: there the
        // ping-pong was 4 % faster at one of four points and 0.6–3 % slower at three (same
        // session), and so are filtered samplers' (the ping-pong 2–16 % slower at B 256 / 512).
        let verify_pingpong = || (pipeline.verify.is_some() && pipeline.list_capacity() == 0).then(|| pingpong(64, 4)).flatten();
        // B = 9..=16 on the TMA ring: one thread issues a slice's boxes and the mbarriers
        // replace the CTA barrier per slice, which the memory-bound 16-column tile gains most
        // from (H100: 4.9 % / 5.3 % under mma.sync's 128 × 16 at D 4096 / 8192). Lists keep
        // the mma.sync tile (not measured with them).
        let tma_gemv = || list_free_sm90(GpuConfig::new(256, 16, 8, Schedule::WgmmaTma { stages: 4, grid: GridKind::PerItem }));
        // B ≤ 8 without lists on sm_90 at LM-head widths: 128-element k slices, 3 stages (half
        // the barriers per byte; H100: 1.9 % / 3.4 % under the 64-element 4-stage ring at
        // D 4096 / 8192). Lists would leave it two stages, other devices' shared memory does not
        // hold it, and below D = 1024 a slice is mostly padding.
        let wide_k_gemv = || {
            let c = GpuConfig::new(256, 8, 8, Schedule::MmaSync { stages: 3, k_step: 128, grid: Grid::PerItem });
            if dim >= 1024 {
                list_free_sm90(c)
            } else {
                None
            }
        };
        if let Some(c) = match batch {
            0..=8 => wide_k_gemv(),
            9..=16 => tma_gemv(),
            33..=191 => pingpong(64, 8),
            // Where neither 256 × 128 tile validates (less shared memory): a pipeline's lists
            // leave no room for three 128-column slots next to two 64 KiB list tiles, so the
            // 64-column tile keeps the ping-pong overlap instead.
            192.. => scorer_pair().or_else(wide).or_else(verify_pingpong).or_else(wide_lists).or_else(|| pingpong(128, 6)).or_else(|| pingpong(64, 8)),
            _ => None,
        } {
            return c;
        }
        match batch {
            0..=8 => tile(256, 8, 8),
            9..=16 => tile(128, 16, 4),
            17..=32 => tile(128, 32, 4),
            // The pair of 128 × 64 CTAs only pays where two fit (lists may not leave room).
            33..=64 if wgmma => Some(tile(128, 64, 4)).filter(|c| c.two_per_sm(limits)).unwrap_or_else(|| tile(256, 64, 8)),
            192.. if wgmma => tile(256, 128, 8),
            _ => tile(256, 64, 8),
        }
    }
}
