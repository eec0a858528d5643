//! The dynamic shared memory of a stage-one CTA, defined once: the emitter reads its offsets,
//! the occupancy math and the launch its size, the autotuner's cost model its ring.
//!
//! ```text
//! [ ring: stages × slot (W tile, then H tile) ]
//! [ epilogue area of consumer set 0 | set 1 (ping-pong) ]   after the ring when the epilogue
//!                                                            overlaps the next item's loads,
//!                                                            else at 0, aliasing the drained ring
//! [ mbarriers (TMA): full × stages, empty × stages, mainloop-done × 2 (ping-pong) ]
//! ```
//!
//! An epilogue area is the cross-warp scratch ([`ScratchLayout`]) followed by the list
//! epilogue's tile of transformed logits (`batch_tile` columns of `vocab_tile` f32) when the
//! pipeline keeps lists or residual lists, and with lists the rows' staged list bounds
//! (`batch_tile` u32).

use crate::config::{GpuConfig, GridKind, Schedule};

/// Byte offsets of the epilogue's cross-warp scratch within an epilogue area: one array per
/// field, each of `warps · batch_tile` entries indexed `warp · batch_tile + column` (4 bytes;
/// 8 for the logsumexp sums). The logsumexp fields alias `score`, `index` and `logit`: the
/// logsumexp phase ends with a barrier before the selection phase writes those.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScratchLayout {
    /// The warp's best score per column (f32).
    pub score: u32,
    /// Its token index (u32).
    pub index: u32,
    /// Its transformed logit (f32).
    pub logit: u32,
    /// Whether the warp saw a non-finite logit in the column (u32, 0 or 1).
    pub nonfinite: u32,
    /// The warp's logsumexp partial (`abi::LsePartial`): its top window (i32) ...
    pub lse_window: u32,
    /// ... and its three u64 window sums (windows `w`, `w − 1`, `w − 2`). Each goes to the
    /// scratch as soon as its column is merged over the warp's lanes: holding the third in
    /// registers until a second round made ptxas spill kilobytes per thread.
    pub lse_sums: [u32; 3],
    /// Bytes of the whole scratch.
    pub bytes: u32,
}

impl ScratchLayout {
    fn of(c: &GpuConfig) -> ScratchLayout {
        let e = c.warps * c.batch_tile * 4;
        ScratchLayout { score: 0, index: e, logit: 2 * e, nonfinite: 5 * e, lse_window: 4 * e, lse_sums: [0, 2 * e, 6 * e], bytes: 8 * e }
    }
}

/// Where everything in a stage-one CTA's dynamic shared memory sits, in bytes from `@fs_smem`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SmemLayout {
    /// Ring slots (0 on the SIMT path).
    pub slots: u32,
    /// Bytes of one slot: the W tile (`vocab_tile` rows of `k_step` 2-byte elements), then the
    /// H tile (`batch_tile` rows).
    pub slot_bytes: u32,
    /// Offset of the H tile within a slot.
    pub h_tile: u32,
    /// Where consumer set 0's epilogue area starts; set `s` at `+ s · epilogue_bytes`.
    pub epilogue: u32,
    /// Bytes of one epilogue area (the scratch, then the list tile).
    pub epilogue_bytes: u32,
    /// The scratch's fields, relative to an epilogue area.
    pub scratch: ScratchLayout,
    /// Offset of the list tile relative to an epilogue area.
    pub list_tile: u32,
    /// Bytes of the list tile (0 without lists and residual lists).
    pub list_tile_bytes: u32,
    /// Offset of the list epilogue's staged list bounds relative to an epilogue area: one u32
    /// per batch column, after the list tile (none without lists).
    pub list_bounds: u32,
    /// Where the mbarriers start (8-byte aligned).
    pub mbarriers: u32,
    /// Mbarriers: a full and an empty one per slot with the TMA ring, plus a mainloop-done
    /// one per consumer set with ping-pong.
    pub mbarrier_count: u32,
    /// Bytes of the whole layout: the launch's dynamic shared memory.
    pub total: u32,
}

impl SmemLayout {
    /// The layout of `c`.
    pub fn of(c: &GpuConfig) -> SmemLayout {
        let slots = if c.is_tensor() { c.stages() } else { 0 };
        let row_bytes = c.k_step() * 2;
        let slot_bytes = (c.vocab_tile + c.batch_tile) * row_bytes;
        let ring = slots * slot_bytes;
        let scratch = ScratchLayout::of(c);
        // The residual lists of a verifying pipeline select from the same tile.
        let tiled = c.list_per_tile > 0 || c.residual_per_tile > 0;
        let list_tile_bytes = if tiled { c.vocab_tile * c.batch_tile * 4 } else { 0 };
        let list_bounds_bytes = if c.list_per_tile > 0 { c.batch_tile * 4 } else { 0 };
        let epilogue_bytes = scratch.bytes + list_tile_bytes + list_bounds_bytes;
        let areas = epilogue_bytes * c.consumer_sets();
        let (epilogue, data) = if c.overlaps_epilogue() { (ring, ring + areas) } else { (0, ring.max(areas)) };
        let mbarriers = data.next_multiple_of(8);
        let mbarrier_count = match c.schedule {
            Schedule::WgmmaTma { stages, grid: GridKind::PingPong } => 2 * stages + 2,
            Schedule::WgmmaTma { stages, .. } => 2 * stages,
            _ => 0,
        };
        SmemLayout {
            slots,
            slot_bytes,
            h_tile: c.vocab_tile * row_bytes,
            epilogue,
            epilogue_bytes,
            scratch,
            list_tile: scratch.bytes,
            list_tile_bytes,
            list_bounds: scratch.bytes + list_tile_bytes,
            mbarriers,
            mbarrier_count,
            total: mbarriers + 8 * mbarrier_count,
        }
    }

    /// Bytes of the ring.
    pub fn ring_bytes(&self) -> u32 {
        self.slots * self.slot_bytes
    }

    /// Offset of slot `slot`'s full mbarrier (the producer's arrival plus the slot's bytes).
    pub fn full_barrier(&self, slot: u32) -> u32 {
        self.mbarriers + 8 * slot
    }

    /// Offset of the first empty mbarrier (one arrival per consumer warp); slot `s`'s at `+ 8s`.
    pub fn empty_barriers(&self) -> u32 {
        self.mbarriers + 8 * self.slots
    }

    /// Offset of the first ping-pong mainloop-done mbarrier; set `s`'s at `+ 8s`.
    pub fn mainloop_done_barriers(&self) -> u32 {
        self.mbarriers + 16 * self.slots
    }
}
