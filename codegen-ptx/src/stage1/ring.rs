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

use super::{i32v, Gen, Item, Thread};
use crate::ir::{Func, Icmp, Ptr, SharedAddr, Value, I1, I32};
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
        f.typed(format!("urem i32 {}, {stages}", self.j))
    }

    pub(super) fn round(&self, f: &mut Func, stages: u32) -> I32 {
        f.typed(format!("udiv i32 {}, {stages}", self.j))
    }

    /// The phase parity the slot's full barrier completes when this slice has landed.
    pub(super) fn full_phase(f: &mut Func, round: &I32) -> I32 {
        f.typed(format!("and i32 {round}, 1"))
    }

    /// The phase parity of the slot's empty barrier that the previous round's consumers
    /// complete (the slot is free to refill).
    pub(super) fn empty_phase(f: &mut Func, round: &I32) -> I32 {
        let next = f.typed::<I32>(format!("add i32 {round}, 1"));
        f.typed(format!("and i32 {next}, 1"))
    }
}

impl Gen<'_> {
    /// The ring's kernel-wide values for `feed`.
    pub(super) fn ring(&self, f: &mut Func, feed: Feed) -> Ring {
        let ks = self.c.k_step();
        let smem = f.typed("ptrtoint ptr addrspace(3) @fs_smem to i32");
        let ks_up = f.add_u("%dim", &(ks - 1).to_string());
        let ktiles = f.typed(format!("udiv i32 {ks_up}, {ks}"));
        let aligned = matches!(feed, Feed::CpAsync { .. }).then(|| {
            // cp.async needs 16-byte aligned global chunks: rows of D·2 bytes with D % 8 == 0
            // and 16-byte aligned bases. Otherwise the same ring is filled by predicated
            // 2-byte loads.
            let d7 = f.v("and i32 %dim, 7");
            let d_ok = f.v(format!("icmp eq i32 {d7}, 0"));
            let hi = f.v("ptrtoint ptr addrspace(1) %hidden to i64");
            let wi = f.v("ptrtoint ptr addrspace(1) %weights to i64");
            let hw = f.v(format!("or i64 {hi}, {wi}"));
            let hw = f.v(format!("and i64 {hw}, 15"));
            let p_ok = f.v(format!("icmp eq i64 {hw}, 0"));
            I1::raw(f.and1_u(&d_ok, &p_ok))
        });
        Ring { feed, smem, ktiles, aligned }
    }

    /// The first [`GpuConfig::prefetch_depth`](crate::GpuConfig::prefetch_depth) slices of
    /// item `it` (only where `valid`, if given). The `cp.async` feed always commits that many
    /// groups, so the group counting stays static.
    pub(super) fn prologue(&self, f: &mut Func, th: &Thread, it: &Item, ring: &Ring, valid: Option<&I1>) {
        let depth = self.c.prefetch_depth();
        match ring.feed {
            Feed::Tma { .. } => {
                let t0 = f.v(format!("icmp eq i32 {}, 0", th.tid));
                let go = match valid {
                    Some(v) => f.and1_u(&t0, v),
                    None => t0,
                };
                f.if_then_u(&go, |f| {
                    for s in 0..depth {
                        let in_range = f.ult_u(&s.to_string(), ring.ktiles.text());
                        f.if_then_u(&in_range, |f| self.tma_issue(f, it, ring, &s.to_string()));
                    }
                });
            }
            Feed::CpAsync { .. } => {
                for s in 0..depth {
                    let in_range = f.ult_u(&s.to_string(), ring.ktiles.text());
                    let go = match valid {
                        Some(v) => f.and1_u(&in_range, v),
                        None => in_range,
                    };
                    f.if_then_u(&go, |f| self.load_stage(f, th, it, ring, &s.to_string(), &s.to_string()));
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
                let j0 = f.mul(&i32v(&it.seq), &ring.ktiles);
                let lane0 = f.typed(format!("icmp eq i32 {}, 0", th.lane));
                let tid0 = (!producer_warp).then(|| f.typed(format!("icmp eq i32 {}, 0", th.tid)));
                ItemRing { j0: Some(j0), lane0: Some(lane0), tid0 }
            }
        }
    }

    /// Waits until slice `kt` has landed (for every thread); [`Gen::slot`] then names its
    /// slot. `cp.async`: this thread's groups up to slice `kt`, then a CTA barrier (which also
    /// proves that every warp is done reading the slot the next refill overwrites); TMA: the
    /// slot's full mbarrier, no CTA barrier.
    pub(super) fn wait_full(&self, f: &mut Func, ring: &Ring, item: &ItemRing, kt: &str) -> Full {
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
                let state = PipelineState { j: f.add(item.j0.as_ref().expect("TMA item"), &i32v(kt)) };
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
    pub(super) fn slot(&self, f: &mut Func, full: Full, kt: &str) -> I32 {
        match full.slot {
            Some(slot) => slot,
            None => PipelineState { j: i32v(kt) }.slot(f, self.c.stages()),
        }
    }

    /// After this warpgroup's MMAs of slice `kt − 1` completed: TMA: each warp releases that
    /// slice's slot (one arrival on its empty barrier). `cp.async`: nothing, the next
    /// [`Gen::wait_full`]'s barrier releases it.
    pub(super) fn release(&self, f: &mut Func, ring: &Ring, item: &ItemRing, kt: &str) {
        if let Feed::Tma { .. } = ring.feed {
            let started = f.v(format!("icmp ugt i32 {kt}, 0"));
            let release = f.and1_u(&started, item.lane0.as_ref().expect("TMA item").text());
            f.if_then_u(&release, |f| {
                let j = f.add_u(item.j0.as_ref().expect("TMA item").text(), kt);
                let prev = f.v(format!("add i32 {j}, -1"));
                self.release_slot(f, ring, &prev);
            });
        }
    }

    /// Issues the slice that goes into the slot freed at iteration `kt`. `cp.async`: slice
    /// `kt + prefetch_depth` (every thread, and a commit either way so the group counting
    /// stays static); TMA: thread 0 issues slice `kt + stages − 1` once every warp released
    /// its slot; with a producer warp, nothing (it refills on its own).
    pub(super) fn refill(&self, f: &mut Func, th: &Thread, it: &Item, ring: &Ring, item: &ItemRing, kt: &str) {
        let c = self.c;
        match ring.feed {
            Feed::CpAsync { .. } => {
                let pf = f.add_u(kt, &c.prefetch_depth().to_string());
                let pf_ok = f.icmp(Icmp::Ult, &i32v(&pf), &ring.ktiles);
                f.if_then_u(pf_ok.text(), |f| {
                    let slot = f.v(format!("urem i32 {pf}, {}", c.stages()));
                    self.load_stage(f, th, it, ring, &pf, &slot);
                });
                ptx::cp_async_commit(f);
            }
            Feed::Tma { producer_warp: true } => {}
            Feed::Tma { producer_warp: false } => {
                let next = f.add_u(kt, &(c.stages() - 1).to_string());
                let more = f.ult_u(&next, ring.ktiles.text());
                let go = f.and1_u(&more, item.tid0.as_ref().expect("TMA item").text());
                f.if_then_u(&go, |f| self.tma_issue(f, it, ring, &next));
            }
        }
    }

    /// After the item's k loop (and its MMAs): `cp.async`: no group left in flight; TMA: each
    /// warp releases the last slice's slot. The caller then passes a CTA barrier.
    pub(super) fn end_item(&self, f: &mut Func, ring: &Ring, item: &ItemRing) {
        match ring.feed {
            Feed::CpAsync { .. } => ptx::cp_async_wait(f, 0),
            Feed::Tma { .. } => {
                f.if_then_u(item.lane0.as_ref().expect("TMA item").text(), |f| {
                    let j = f.add(item.j0.as_ref().expect("TMA item"), &ring.ktiles);
                    let last = f.v(format!("add i32 {j}, -1"));
                    self.release_slot(f, ring, &last);
                });
            }
        }
    }

    /// Shared addresses of ring slot `slot`'s full and empty mbarriers.
    fn mbarriers(&self, f: &mut Func, ring: &Ring, slot: &I32) -> (SharedAddr, SharedAddr) {
        let layout = self.c.smem_layout();
        let base = f.shared_offset(&ring.smem, &i32v(&layout.mbarriers.to_string()));
        let s8 = f.typed::<I32>(format!("shl i32 {slot}, 3"));
        let full = f.shared_offset(&base, &s8);
        let empty = f.shared_offset(&full, &i32v(&(layout.empty_barriers() - layout.mbarriers).to_string()));
        (full, empty)
    }

    /// This warp is done reading (global) slice `j`'s slot: one arrival on its empty barrier.
    fn release_slot(&self, f: &mut Func, ring: &Ring, j: &str) {
        let slot = PipelineState { j: i32v(j) }.slot(f, self.c.stages());
        let (_, empty) = self.mbarriers(f, ring, &slot);
        ptx::mbarrier_arrive(f, &empty);
    }

    /// With ping-pong: the mainloop-done mbarrier of consumer set `set` (after the slots').
    pub(super) fn mainloop_done(&self, f: &mut Func, ring: &Ring, set: &str) -> SharedAddr {
        let base = f.shared_offset(&ring.smem, &i32v(&self.c.smem_layout().mainloop_done_barriers().to_string()));
        let s8 = f.typed::<I32>(format!("shl i32 {set}, 3"));
        f.shared_offset(&base, &s8)
    }

    /// Thread 0 initialises every slot's mbarriers: full expects the producer's one arrival
    /// (plus the stage's transaction bytes), empty one arrival per warp; with ping-pong each
    /// set's mainloop-done barrier one arrival per warp of the set.
    pub(super) fn init_mbarriers(&self, f: &mut Func, th: &Thread, ring: &Ring) {
        let t0 = f.v(format!("icmp eq i32 {}, 0", th.tid));
        f.if_then_u(&t0, |f| {
            let mut bars = Vec::new();
            for s in 0..self.c.stages() {
                let (full, empty) = self.mbarriers(f, ring, &i32v(&s.to_string()));
                bars.extend([(full, 1), (empty, self.c.warps)]);
            }
            if self.c.is_pingpong() {
                for set in ["0", "1"] {
                    bars.push((self.mainloop_done(f, ring, set), self.c.warps));
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
    pub(super) fn tma_issue(&self, f: &mut Func, it: &Item, ring: &Ring, kt: &str) {
        let c = self.c;
        let layout = c.smem_layout();
        let stages = c.stages();
        let j0 = f.mul(&i32v(&it.seq), &ring.ktiles);
        let state = PipelineState { j: f.add(&j0, &i32v(kt)) };
        let slot = state.slot(f, stages);
        let (full, empty) = self.mbarriers(f, ring, &slot);
        let reuse = f.v(format!("icmp uge i32 {}, {stages}", state.j));
        f.if_then_u(&reuse, |f| {
            let round = state.round(f, stages);
            let phase = PipelineState::empty_phase(f, &round);
            ptx::mbarrier_wait(f, &empty, &phase);
        });
        ptx::mbarrier_arrive_expect_tx(f, &full, layout.slot_bytes);
        let slot_off = f.mul(&slot, &i32v(&layout.slot_bytes.to_string()));
        let dst0 = f.shared_offset(&ring.smem, &slot_off);
        let k0 = f.typed::<I32>(format!("mul i32 {kt}, {}", c.k_step()));
        let maps = f.v("addrspacecast ptr addrspace(1) %tmaps to ptr");
        let w_map = f.typed(format!("ptrtoint ptr {maps} to i64"));
        let h_map = f.typed(format!("add i64 {w_map}, 128"));
        let blk0 = f.typed::<I32>(format!("lshr i32 {}, 5", it.v0));
        for grp in 0..c.warps / 4 {
            let blk = f.add(&blk0, &i32v(&(4 * grp).to_string()));
            let dst = f.shared_offset(&dst0, &i32v(&(grp * 128 * 128).to_string()));
            ptx::tma_load_5d(f, &dst, &w_map, &k0, &blk, &full);
        }
        let dst = f.shared_offset(&dst0, &i32v(&layout.h_tile.to_string()));
        ptx::tma_load_2d(f, &dst, &h_map, &k0, &i32v(&it.b0), &full);
    }

    /// Issues slice `kt` of item `it` into ring slot `slot` (no commit).
    ///
    /// Shared layout of a stage: W tile `vocab_tile` rows then H tile `batch_tile` rows, each
    /// row `k_step` elements (128 or 256 bytes) of 16-byte chunks. Chunk `c` of row `r` is
    /// stored at chunk `c ^ s(r)` with `s(r) = (r >> 2) & 7` for W and `r & 7` for H, so the 8
    /// row addresses of every ldmatrix phase (W rows 4g + const, H rows n..n+7) fall in 8
    /// distinct bank groups.
    fn load_stage(&self, f: &mut Func, th: &Thread, it: &Item, ring: &Ring, kt: &str, slot: &str) {
        let c = self.c;
        let ks = c.k_step();
        let cpr = ks / 8; // 16-byte chunks per row
        let row_bytes = ks * 2;
        let w_tile_bytes = c.vocab_tile * row_bytes;
        let stage_bytes = c.smem_layout().slot_bytes;
        let smem = &ring.smem;
        let kbase = f.mul_u(kt, &ks.to_string());
        let slot_off = f.mul_u(slot, &stage_bytes.to_string());
        let chunks = |f: &mut Func, asynchronous: bool| {
            for (is_w, rows, tile_off, base_row, limit, ptr) in [
                (true, c.vocab_tile, 0, &it.v0, "%vocab", "%weights"),
                (
                    false,
                    c.batch_tile,
                    w_tile_bytes,
                    &it.b0,
                    "%batch",
                    "%hidden",
                ),
            ] {
                let n_chunks = rows * cpr;
                let nthr = c.block_threads();
                for u in 0..n_chunks.div_ceil(nthr) {
                    let i = f.add_u(&th.tid, &(u * nthr).to_string());
                    let body = |f: &mut Func| {
                        let row = f.v(format!("lshr i32 {i}, {}", cpr.trailing_zeros()));
                        let cc = f.v(format!("and i32 {i}, {}", cpr - 1));
                        // wgmma: W row `row` sits at shared row `at` of the warpgroup's
                        // m64 operands, swizzled by the 128-byte mode (`at & 7`).
                        let at = if is_w && c.uses_wgmma() { self.wgmma_smem_row(f, &row) } else { row.clone() };
                        let s = if is_w && !c.uses_wgmma() {
                            f.v(format!("lshr i32 {row}, 2"))
                        } else {
                            at.clone()
                        };
                        let s = f.v(format!("and i32 {s}, 7"));
                        let sw = f.v(format!("xor i32 {cc}, {s}"));
                        let ro = f.mul_u(&at, &row_bytes.to_string());
                        let so = f.v(format!("shl i32 {sw}, 4"));
                        let dst = f.add_u(&slot_off, &ro);
                        let dst = f.add_u(&dst, &so);
                        let dst = f.add_u(&dst, &tile_off.to_string());
                        let gr = f.add_u(base_row, &row);
                        let row_ok = f.ult_u(&gr, limit);
                        let c8 = f.v(format!("shl i32 {cc}, 3"));
                        let k = f.add_u(&kbase, &c8);
                        let gr64 = f.zext64_u(&gr);
                        let d64 = f.zext64_u("%dim");
                        let row_elem = f.v(format!("mul i64 {gr64}, {d64}"));
                        if asynchronous {
                            let k_ok = f.ult_u(&k, "%dim");
                            let ok = f.and1_u(&row_ok, &k_ok);
                            // The chunk's row pointer does not depend on the slice, so LLVM
                            // hoists it out of the k loop; a slice adds its byte offset (one
                            // 64-bit add per chunk) and only the final pointer is selected.
                            let c64 = f.zext64_u(&c8);
                            let e = f.v(format!("add i64 {row_elem}, {c64}"));
                            let row_ptr = f.gaddr_u(ptr, &e, 2);
                            let kb = f.zext64_u(&kbase);
                            let kb = f.v(format!("shl i64 {kb}, 1"));
                            let src = f.v(format!("getelementptr i8, ptr addrspace(1) {row_ptr}, i64 {kb}"));
                            let src = f.sel_u("ptr addrspace(1)", &ok, &src, ptr);
                            let d32 = f.shared_offset(smem, &i32v(&dst));
                            // src-size 0 zero-fills the chunk: rows past V or B, k past D.
                            let size = f.sel_u("i32", &ok, "16", "0");
                            ptx::cp_async_16(f, &d32, &Ptr::raw(src), &i32v(&size));
                        } else {
                            let mut halves = Vec::new();
                            for e in 0..8 {
                                let ke = f.add_u(&k, &e.to_string());
                                let k_ok = f.ult_u(&ke, "%dim");
                                let ok = f.and1_u(&row_ok, &k_ok);
                                let k64 = f.zext64_u(&ke);
                                let ix = f.v(format!("add i64 {row_elem}, {k64}"));
                                let ix = f.sel_u("i64", &ok, &ix, "0");
                                let a = f.gaddr_u(ptr, &ix, 2);
                                let v = f.v(format!("load i16, ptr addrspace(1) {a}, align 2"));
                                let v = f.sel_u("i16", &ok, &v, "0");
                                halves.push(f.v(format!("zext i16 {v} to i32")));
                            }
                            let mut vec = "undef".to_string();
                            for w in 0..4 {
                                let hi = f.v(format!("shl i32 {}, 16", halves[2 * w + 1]));
                                let word = f.v(format!("or i32 {}, {hi}", halves[2 * w]));
                                vec = f.v(format!(
                                    "insertelement <4 x i32> {vec}, i32 {word}, i32 {w}"
                                ));
                            }
                            let sa = f.saddr_u("@fs_smem", &dst);
                            f.s(format!(
                                "store <4 x i32> {vec}, ptr addrspace(3) {sa}, align 16"
                            ));
                        }
                    };
                    if (u + 1) * nthr > n_chunks {
                        let inr = f.ult_u(&i, &n_chunks.to_string());
                        f.if_then_u(&inr, body);
                    } else {
                        body(f);
                    }
                }
            }
        };
        let aligned = ring.aligned.as_ref().expect("the cp.async ring checks alignment");
        f.if_else_u(aligned.text(), |f| chunks(f, true), |f| chunks(f, false));
    }
}
