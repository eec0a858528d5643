//! The shared-memory ring of k slices that every tensor-core schedule multiplies from, and its
//! two feeds, written once (CUTLASS's `PipelineTmaAsync` + `PipelineState`):
//!
//! - [`Feed::CpAsync`]: every thread copies its 16-byte chunks (`cp.async`, or predicated
//!   2-byte loads for unaligned operands), one commit group per slice; a slice is full once
//!   every thread's group landed and the CTA passed a barrier, which also proves the slot
//!   being refilled is no longer read. The ring runs [`GpuConfig::prefetch_depth`] ahead.
//! - [`Feed::Tma`]: one thread issues a slice's boxes (`cp.async.bulk.tensor`); a full and an
//!   empty mbarrier per slot replace the barrier. Slices are numbered across a persistent
//!   CTA's items (`j = seq · ktiles + kt`), so a slot's phase parity follows from `j` alone
//!   ([`PipelineState`]). The ring runs `stages − 1` ahead.
//!
//! A mainloop calls, per slice `kt`: [`Gen::wait_full`] (the slot to read), its MMAs,
//! [`Gen::release`] (the slot it no longer reads) and [`Gen::refill`] (the next slice into
//! the free slot); around the k loop [`Gen::prologue`] and [`Gen::end_item`].
//!
//! [`GpuConfig::prefetch_depth`]: crate::GpuConfig::prefetch_depth

use super::{Gen, Item, Thread, SMEM};
use crate::ir::{i32c, Func, Generic, Icmp, Int, SharedAddr, I1, I16, I32, I64, X4};
use crate::params::arg;
use crate::ptx;

/// How the ring is filled.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Feed {
    /// Per-thread `cp.async`; `wgmma`: the consumer reads through the async proxy (a proxy
    /// fence after each thread's wait) and the W rows sit at wgmma's permuted shared rows.
    CpAsync { wgmma: bool },
    /// The TMA; `producer_warp`: a dedicated producer (ping-pong) refills the ring, so the
    /// consumers only release slots; otherwise thread 0 refills after its releases.
    Tma { producer_warp: bool },
}

/// Kernel-wide values of the ring, computed once before the item loop.
pub(super) struct Ring {
    pub(super) feed: Feed,
    /// Shared-window address of `@fs_smem` (32 bits, which saves the 64-bit adds and
    /// registers of every cp.async, ldmatrix and mbarrier address).
    pub(super) smem: SharedAddr,
    /// k slices of `k_step` per item.
    pub(super) ktiles: I32,
    /// `cp.async` only: whether both operands allow 16-byte chunks.
    aligned: Option<I1>,
    /// [`GridKind::CooperativePair`](crate::GridKind::CooperativePair) only: this CTA's rank
    /// in its pair (which W box it multicasts; the other rank's empty barriers it arrives on).
    rank: Option<I32>,
}

/// Per-item values of the ring for one consumer: the first slice's number across the CTA's
/// items and the lanes that release and refill (TMA only).
pub(super) struct ItemRing {
    j0: Option<I32>,
    lane0: Option<I1>,
    tid0: Option<I1>,
}

/// Proof that a slice has landed ([`Gen::wait_full`]); the TMA feed already knows its slot.
pub(super) struct Full {
    slot: Option<I32>,
}

/// A slice's place in the ring: its number `j` (across the CTA's items), slot `j % stages`,
/// and the round `j / stages` whose parity names the phase of the slot's barriers that
/// belongs to this slice.
pub(super) struct PipelineState {
    pub(super) j: I32,
}

impl PipelineState {
    pub(super) fn slot(&self, f: &mut Func, stages: u32) -> I32 {
        f.urem(&self.j, &i32c(stages))
    }

    pub(super) fn round(&self, f: &mut Func, stages: u32) -> I32 {
        f.udiv(&self.j, &i32c(stages))
    }

    /// The phase parity the slot's full barrier completes when this slice has landed.
    pub(super) fn full_phase(f: &mut Func, round: &I32) -> I32 {
        f.and(round, &i32c(1))
    }

    /// The phase parity of the slot's empty barrier that the previous round's consumers
    /// complete (the slot is free to refill).
    pub(super) fn empty_phase(f: &mut Func, round: &I32) -> I32 {
        let next = f.add(round, &i32c(1));
        f.and(&next, &i32c(1))
    }
}

impl Gen<'_> {
    /// The ring's kernel-wide values for `feed`.
    pub(super) fn ring(&self, f: &mut Func, feed: Feed) -> Ring {
        let ks = self.c.k_step();
        let smem = f.shared_addr(&SMEM);
        let ks_up = f.add(&arg::DIM, &i32c(ks - 1));
        let ktiles = f.udiv(&ks_up, &i32c(ks));
        let aligned = matches!(feed, Feed::CpAsync { .. }).then(|| {
            // cp.async needs 16-byte aligned global chunks: rows of D·2 bytes with D % 8 == 0
            // and 16-byte aligned bases. Otherwise the same ring is filled by predicated
            // 2-byte loads.
            let d7 = f.and(&arg::DIM, &i32c(7));
            let d_ok = f.icmp(Icmp::Eq, &d7, &i32c(0));
            let hi: I64 = f.ptrtoint(&arg::HIDDEN);
            let wi: I64 = f.ptrtoint(&arg::WEIGHTS);
            let hw = f.or(&hi, &wi);
            let hw = f.and(&hw, &I64::c(15));
            let p_ok = f.icmp(Icmp::Eq, &hw, &I64::c(0));
            f.and(&d_ok, &p_ok)
        });
        let rank = (self.c.cluster_ctas() == 2).then(|| ptx::cluster_ctarank(f));
        Ring { feed, smem, ktiles, aligned, rank }
    }

    /// The first [`GpuConfig::prefetch_depth`](crate::GpuConfig::prefetch_depth) slices of
    /// item `it` (only where `valid`, if given). The `cp.async` feed always commits that many
    /// groups, so the group counting stays static.
    pub(super) fn prologue(&self, f: &mut Func, th: &Thread, it: &Item, ring: &Ring, valid: Option<&I1>) {
        let depth = self.c.prefetch_depth();
        match ring.feed {
            Feed::Tma { .. } => {
                let t0 = f.icmp(Icmp::Eq, &th.tid, &i32c(0));
                let go = match valid {
                    Some(v) => f.and(&t0, v),
                    None => t0,
                };
                f.if_then(&go, |f| {
                    for s in 0..depth {
                        let in_range = f.icmp(Icmp::Ult, &i32c(s), &ring.ktiles);
                        f.if_then(&in_range, |f| self.tma_issue(f, it, ring, &i32c(s)));
                    }
                });
            }
            Feed::CpAsync { .. } => {
                for s in 0..depth {
                    let in_range = f.icmp(Icmp::Ult, &i32c(s), &ring.ktiles);
                    let go = match valid {
                        Some(v) => f.and(&in_range, v),
                        None => in_range,
                    };
                    f.if_then(&go, |f| self.load_stage(f, th, it, ring, &i32c(s), &i32c(s)));
                    ptx::cp_async_commit(f);
                }
            }
        }
    }

    /// Per-item values of the ring for a consumer of item `it`.
    pub(super) fn begin_item(&self, f: &mut Func, th: &Thread, it: &Item, ring: &Ring) -> ItemRing {
        match ring.feed {
            Feed::CpAsync { .. } => ItemRing { j0: None, lane0: None, tid0: None },
            Feed::Tma { producer_warp } => {
                let j0 = f.mul(&it.seq, &ring.ktiles);
                let lane0 = f.icmp(Icmp::Eq, &th.lane, &i32c(0));
                let tid0 = (!producer_warp).then(|| f.icmp(Icmp::Eq, &th.tid, &i32c(0)));
                ItemRing { j0: Some(j0), lane0: Some(lane0), tid0 }
            }
        }
    }

    /// Waits until slice `kt` has landed (for every thread); [`Gen::slot`] then names its
    /// slot. `cp.async`: this thread's groups up to slice `kt`, then a CTA barrier (which also
    /// proves that every warp is done reading the slot the next refill overwrites); TMA: the
    /// slot's full mbarrier, no CTA barrier.
    pub(super) fn wait_full(&self, f: &mut Func, ring: &Ring, item: &ItemRing, kt: &I32) -> Full {
        let stages = self.c.stages();
        match ring.feed {
            Feed::CpAsync { wgmma } => {
                ptx::cp_async_wait(f, self.c.prefetch_depth() - 1);
                if wgmma {
                    // This thread's cp.async writes become visible to wgmma's (async-proxy) reads.
                    ptx::fence_proxy_async(f);
                }
                f.barrier();
                Full { slot: None }
            }
            Feed::Tma { .. } => {
                let state = PipelineState { j: f.add(item.j0.as_ref().expect("TMA item"), kt) };
                let slot = state.slot(f, stages);
                let round = state.round(f, stages);
                let phase = PipelineState::full_phase(f, &round);
                let (full, _) = self.mbarriers(f, ring, &slot);
                ptx::mbarrier_wait(f, &full, &phase);
                Full { slot: Some(slot) }
            }
        }
    }

    /// The slot of slice `kt`, which [`Gen::wait_full`] waited for.
    pub(super) fn slot(&self, f: &mut Func, full: Full, kt: &I32) -> I32 {
        match full.slot {
            Some(slot) => slot,
            None => PipelineState { j: kt.clone() }.slot(f, self.c.stages()),
        }
    }

    /// After this warpgroup's MMAs of slice `kt − 1` completed: TMA: each warp releases that
    /// slice's slot (one arrival on its empty barrier). `cp.async`: nothing, the next
    /// [`Gen::wait_full`]'s barrier releases it.
    pub(super) fn release(&self, f: &mut Func, ring: &Ring, item: &ItemRing, kt: &I32) {
        if let Feed::Tma { .. } = ring.feed {
            let started = f.icmp(Icmp::Ugt, kt, &i32c(0));
            let release = f.and(&started, item.lane0.as_ref().expect("TMA item"));
            f.if_then(&release, |f| {
                let j = f.add(item.j0.as_ref().expect("TMA item"), kt);
                let prev = f.add(&j, &i32c(-1));
                self.release_slot(f, ring, &prev);
            });
        }
    }

    /// Issues the slice that goes into the slot freed at iteration `kt`. `cp.async`: slice
    /// `kt + prefetch_depth` (every thread, and a commit either way so the group counting
    /// stays static); TMA: thread 0 issues slice `kt + stages − 1` once every warp released
    /// its slot; with a producer warp, nothing (it refills on its own).
    pub(super) fn refill(&self, f: &mut Func, th: &Thread, it: &Item, ring: &Ring, item: &ItemRing, kt: &I32) {
        let c = self.c;
        match ring.feed {
            Feed::CpAsync { .. } => {
                let pf = f.add(kt, &i32c(c.prefetch_depth()));
                let pf_ok = f.icmp(Icmp::Ult, &pf, &ring.ktiles);
                f.if_then(&pf_ok, |f| {
                    let slot = f.urem(&pf, &i32c(c.stages()));
                    self.load_stage(f, th, it, ring, &pf, &slot);
                });
                ptx::cp_async_commit(f);
            }
            Feed::Tma { producer_warp: true } => {}
            Feed::Tma { producer_warp: false } => {
                let next = f.add(kt, &i32c(c.stages() - 1));
                let more = f.icmp(Icmp::Ult, &next, &ring.ktiles);
                let go = f.and(&more, item.tid0.as_ref().expect("TMA item"));
                f.if_then(&go, |f| self.tma_issue(f, it, ring, &next));
            }
        }
    }

    /// After the item's k loop (and its MMAs): `cp.async`: no group left in flight; TMA: each
    /// warp releases the last slice's slot. The caller then passes a CTA barrier.
    pub(super) fn end_item(&self, f: &mut Func, ring: &Ring, item: &ItemRing) {
        match ring.feed {
            Feed::CpAsync { .. } => ptx::cp_async_wait(f, 0),
            Feed::Tma { .. } => {
                f.if_then(item.lane0.as_ref().expect("TMA item"), |f| {
                    let j = f.add(item.j0.as_ref().expect("TMA item"), &ring.ktiles);
                    let last = f.add(&j, &i32c(-1));
                    self.release_slot(f, ring, &last);
                });
            }
        }
    }

    /// Shared addresses of ring slot `slot`'s full and empty mbarriers.
    fn mbarriers(&self, f: &mut Func, ring: &Ring, slot: &I32) -> (SharedAddr, SharedAddr) {
        let layout = self.c.smem_layout();
        let base = f.shared_offset(&ring.smem, &i32c(layout.mbarriers));
        let s8 = f.shl(slot, &i32c(3));
        let full = f.shared_offset(&base, &s8);
        let empty = f.shared_offset(&full, &i32c(layout.empty_barriers() - layout.mbarriers));
        (full, empty)
    }

    /// This warp is done reading (global) slice `j`'s slot: one arrival on its empty barrier
    /// (the pair's: on both CTAs', as the other CTA's producer writes this slot too).
    fn release_slot(&self, f: &mut Func, ring: &Ring, j: &I32) {
        let slot = PipelineState { j: j.clone() }.slot(f, self.c.stages());
        let (_, empty) = self.mbarriers(f, ring, &slot);
        ptx::mbarrier_arrive(f, &empty);
        if let Some(rank) = &ring.rank {
            let other = f.xor(rank, &i32c(1));
            ptx::mbarrier_arrive_remote(f, &empty, &other);
        }
    }

    /// With ping-pong: the mainloop-done mbarrier of consumer set `set` (after the slots').
    pub(super) fn mainloop_done(&self, f: &mut Func, ring: &Ring, set: &I32) -> SharedAddr {
        let base = f.shared_offset(&ring.smem, &i32c(self.c.smem_layout().mainloop_done_barriers()));
        let s8 = f.shl(set, &i32c(3));
        f.shared_offset(&base, &s8)
    }

    /// Thread 0 initialises every slot's mbarriers: full expects the producer's one arrival
    /// (plus the stage's transaction bytes), empty one arrival per consumer warp of each CTA
    /// that writes the slot (the pair's: both CTAs'); with ping-pong each set's
    /// mainloop-done barrier one arrival per warp of the set.
    pub(super) fn init_mbarriers(&self, f: &mut Func, th: &Thread, ring: &Ring) {
        let t0 = f.icmp(Icmp::Eq, &th.tid, &i32c(0));
        f.if_then(&t0, |f| {
            let mut bars = Vec::new();
            for s in 0..self.c.stages() {
                let (full, empty) = self.mbarriers(f, ring, &i32c(s));
                bars.extend([(full, 1), (empty, self.c.warps * self.c.cluster_ctas())]);
            }
            if self.c.is_pingpong() {
                for set in 0..2 {
                    bars.push((self.mainloop_done(f, ring, &i32c(set)), self.c.warps));
                }
            }
            for (bar, count) in bars {
                ptx::mbarrier_init(f, &bar, count);
            }
            ptx::fence_mbarrier_init(f);
        });
        f.barrier();
    }

    /// Producer (thread 0): slice `kt` of item `it` into its ring slot through the TMA, once
    /// the slot's previous slice is released. Slices are numbered across the CTA's items
    /// (`j = seq · ktiles + kt`, slot `j % stages`), so every slot's phases alternate.
    ///
    /// The W tensor map (`%tmaps`, 5-d) views row `r = 32K + 4g + 2h + e` as dims
    /// `(k, g, e, K, h)` (strides 4, 1, 32 and 2 rows: the order of the shared rows, not of
    /// memory). With `vocab_tile = 32 · warps` (one 32-row block per warp), one box
    /// `{64, 8, 2, 4, 2}` at `(k0, 0, 0, v0/32 + 4G, 0)` is warpgroup `G`'s 128 rows, landing
    /// at shared row `g + 8e + 16k + 64h` of its operands: where [`Gen::wgmma_smem_row`] puts
    /// W row `v0 + 32(4G + k) + 4g + 2h + e`. So a slice is one 16 KB box per warpgroup. The H map (2-d, at
    /// `%tmaps + 128`) gives one `{64, batch_tile}` box. Rows past V or B and k past D are
    /// zero-filled by the TMA and still count towards the stage's bytes.
    pub(super) fn tma_issue(&self, f: &mut Func, it: &Item, ring: &Ring, kt: &I32) {
        let c = self.c;
        let layout = c.smem_layout();
        let stages = c.stages();
        let j0 = f.mul(&it.seq, &ring.ktiles);
        let state = PipelineState { j: f.add(&j0, kt) };
        let slot = state.slot(f, stages);
        let (full, empty) = self.mbarriers(f, ring, &slot);
        let reuse = f.icmp(Icmp::Uge, &state.j, &i32c(stages));
        f.if_then(&reuse, |f| {
            let round = state.round(f, stages);
            let phase = PipelineState::empty_phase(f, &round);
            ptx::mbarrier_wait(f, &empty, &phase);
        });
        ptx::mbarrier_arrive_expect_tx(f, &full, layout.slot_bytes);
        let slot_off = f.mul(&slot, &i32c(layout.slot_bytes));
        let dst0 = f.shared_offset(&ring.smem, &slot_off);
        let k0 = f.mul(kt, &i32c(c.k_step()));
        // The maps are a by-value kernel parameter (grid constant): its generic address.
        let w_map: I64 = f.ptrtoint::<Generic, _>(&arg::TMAPS);
        let h_map = f.add(&w_map, &I64::c(128));
        let blk0 = f.lshr(&it.v0, &i32c(5));
        match &ring.rank {
            // The pair: this CTA's warpgroup box, into both CTAs' slots (their full barriers
            // expect the whole slot, so each completes once both boxes and its H box landed).
            Some(rank) => {
                let b4 = f.shl(rank, &i32c(2));
                let blk = f.add(&blk0, &b4);
                let off = f.mul(rank, &i32c(128 * 128));
                let dst = f.shared_offset(&dst0, &off);
                ptx::tma_load_5d_multicast(f, &dst, &w_map, &k0, &blk, &full, 0b11);
            }
            None => {
                for grp in 0..c.warps / 4 {
                    let blk = f.add(&blk0, &i32c(4 * grp));
                    let dst = f.shared_offset(&dst0, &i32c(grp * 128 * 128));
                    ptx::tma_load_5d(f, &dst, &w_map, &k0, &blk, &full);
                }
            }
        }
        let dst = f.shared_offset(&dst0, &i32c(layout.h_tile));
        ptx::tma_load_2d(f, &dst, &h_map, &k0, &it.b0, &full);
    }

    /// Issues slice `kt` of item `it` into ring slot `slot` (no commit).
    ///
    /// Shared layout of a stage: W tile `vocab_tile` rows then H tile `batch_tile` rows, each
    /// row `k_step` elements (128 or 256 bytes) of 16-byte chunks. Chunk `c` of row `r` is
    /// stored at chunk `c ^ s(r)` with `s(r) = (r >> 2) & 7` for W and `r & 7` for H, so the 8
    /// row addresses of every ldmatrix phase (W rows 4g + const, H rows n..n+7) fall in 8
    /// distinct bank groups.
    fn load_stage(&self, f: &mut Func, th: &Thread, it: &Item, ring: &Ring, kt: &I32, slot: &I32) {
        let c = self.c;
        let ks = c.k_step();
        let cpr = ks / 8; // 16-byte chunks per row
        let row_bytes = ks * 2;
        let w_tile_bytes = c.vocab_tile * row_bytes;
        let stage_bytes = c.smem_layout().slot_bytes;
        let smem = &ring.smem;
        let kbase = f.mul(kt, &i32c(ks));
        let slot_off = f.mul(slot, &i32c(stage_bytes));
        let chunks = |f: &mut Func, asynchronous: bool| {
            for (is_w, rows, tile_off, base_row, limit, ptr) in [
                (true, c.vocab_tile, 0, &it.v0, &arg::VOCAB, &arg::WEIGHTS),
                (false, c.batch_tile, w_tile_bytes, &it.b0, &arg::BATCH, &arg::HIDDEN),
            ] {
                let n_chunks = rows * cpr;
                let nthr = c.block_threads();
                for u in 0..n_chunks.div_ceil(nthr) {
                    let i = f.add(&th.tid, &i32c(u * nthr));
                    let body = |f: &mut Func| {
                        let row = f.lshr(&i, &i32c(cpr.trailing_zeros()));
                        let cc = f.and(&i, &i32c(cpr - 1));
                        // wgmma: W row `row` sits at shared row `at` of the warpgroup's
                        // m64 operands, swizzled by the 128-byte mode (`at & 7`).
                        let at = if is_w && c.uses_wgmma() { self.wgmma_smem_row(f, &row) } else { row.clone() };
                        let s = if is_w && !c.uses_wgmma() { f.lshr(&row, &i32c(2)) } else { at.clone() };
                        let s = f.and(&s, &i32c(7));
                        let sw = f.xor(&cc, &s);
                        let ro = f.mul(&at, &i32c(row_bytes));
                        let so = f.shl(&sw, &i32c(4));
                        let dst = f.add(&slot_off, &ro);
                        let dst = f.add(&dst, &so);
                        let dst = f.add(&dst, &i32c(tile_off));
                        let gr = f.add(base_row, &row);
                        let row_ok = f.icmp(Icmp::Ult, &gr, limit);
                        let c8 = f.shl(&cc, &i32c(3));
                        let k = f.add(&kbase, &c8);
                        let gr64: I64 = f.zext(&gr);
                        let d64: I64 = f.zext(&arg::DIM);
                        let row_elem = f.mul(&gr64, &d64);
                        if asynchronous {
                            let k_ok = f.icmp(Icmp::Ult, &k, &arg::DIM);
                            let ok = f.and(&row_ok, &k_ok);
                            // The chunk's row pointer does not depend on the slice, so LLVM
                            // hoists it out of the k loop; a slice adds its byte offset (one
                            // 64-bit add per chunk) and only the final pointer is selected.
                            let c64 = f.zext(&c8);
                            let e = f.add(&row_elem, &c64);
                            let row_ptr = f.gaddr(ptr, &e, 2);
                            let kb: I64 = f.zext(&kbase);
                            let kb = f.shl(&kb, &I64::c(1));
                            let src = f.byte_offset(&row_ptr, &kb);
                            let src = f.sel(&ok, &src, ptr);
                            let d32 = f.shared_offset(smem, &dst);
                            // src-size 0 zero-fills the chunk: rows past V or B, k past D.
                            let size = f.sel(&ok, &i32c(16), &i32c(0));
                            ptx::cp_async_16(f, &d32, &src, &size);
                        } else {
                            let mut halves = Vec::new();
                            for e in 0..8 {
                                let ke = f.add(&k, &i32c(e));
                                let k_ok = f.icmp(Icmp::Ult, &ke, &arg::DIM);
                                let ok = f.and(&row_ok, &k_ok);
                                let k64 = f.zext(&ke);
                                let ix = f.add(&row_elem, &k64);
                                let ix = f.sel(&ok, &ix, &I64::c(0));
                                let a = f.gaddr(ptr, &ix, 2);
                                let v: I16 = f.load(&a, 2);
                                let v = f.sel(&ok, &v, &I16::c(0));
                                halves.push(f.zext::<I16, I32>(&v));
                            }
                            let mut vec = X4::<I32>::UNDEF;
                            for w in 0..4 {
                                let hi = f.shl(&halves[2 * w + 1], &i32c(16));
                                let word = f.or(&halves[2 * w], &hi);
                                vec = f.insert_lane(&vec, &word, w as u32);
                            }
                            let sa = f.saddr(&SMEM, &dst);
                            f.store(&vec, &sa, 16);
                        }
                    };
                    if (u + 1) * nthr > n_chunks {
                        let inr = f.icmp(Icmp::Ult, &i, &i32c(n_chunks));
                        f.if_then(&inr, body);
                    } else {
                        body(f);
                    }
                }
            }
        };
        let aligned = ring.aligned.as_ref().expect("the cp.async ring checks alignment");
        f.if_else(aligned, |f| chunks(f, true), |f| chunks(f, false));
    }
}
