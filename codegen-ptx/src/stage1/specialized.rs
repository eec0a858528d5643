//! The warp-specialized schedules on the TMA ring: CUTLASS's ping-pong
//! ([`GridKind::PingPong`], two consumer sets) and cooperative ([`GridKind::Cooperative`] and
//! its 2-CTA clusters, [`GridKind::CooperativePair`], one; the pair's multicast and remote
//! releases are the ring's, its cluster barriers `stage1::emit`'s). Warps `sets·warps ..` are the producer warpgroup: lane 0 of its first warp streams
//! every slice of the CTA's items through [`Gen::tma_issue`], gated only by the empty
//! mbarriers, and the group gives its registers to the consumers (`setmaxnreg`). Consumer set
//! `s` (warps `s·warps ..`) takes the CTA's items `s, s + sets, ...`, each through the wgmma
//! mainloop and the epilogue, with its own epilogue area and named barrier `1 + s`. With two
//! sets the mainloops take turns (a mainloop-done mbarrier per set, as CUTLASS orders its math
//! warpgroups), so one set's epilogue runs while the other multiplies the next item; with
//! one, the producer streams the next item's first slices during the epilogue. Either way the
//! producer keeps the ring full and no consumer warp waits for another's release to load.
//!
//! [`GridKind::PingPong`]: crate::GridKind::PingPong
//! [`GridKind::Cooperative`]: crate::GridKind::Cooperative
//! [`GridKind::CooperativePair`]: crate::GridKind::CooperativePair

use super::ring::{PipelineState, Ring};
use super::{Gen, Items, Thread};
use crate::ir::{i32c, Func, Icmp};
use crate::ptx;

impl Gen<'_> {
    /// The whole CTA after the mbarriers' initialisation: producer or consumer set.
    pub(super) fn warp_specialized(&self, f: &mut Func, th: &Thread, ring: &Ring, items: &Items) {
        let c = self.c;
        let sets = c.consumer_sets();
        let (_, producer_regs, consumer_regs) = c.specialized_registers();
        let set = f.udiv(&th.warp, &i32c(c.warps));
        let producer = f.icmp(Icmp::Eq, &set, &i32c(sets));
        f.if_else(
            &producer,
            |f| {
                ptx::setmaxnreg(f, false, producer_regs);
                let first_warp = f.icmp(Icmp::Eq, &th.warp, &i32c(sets * c.warps));
                let lane0 = f.icmp(Icmp::Eq, &th.lane, &i32c(0));
                let issuer = f.and(&first_warp, &lane0);
                f.if_then(&issuer, |f| {
                    f.for_loop(&items.first, &items.count, &items.stride, |f, item| {
                        let it = items.item(self, f, item);
                        f.for_loop(&i32c(0), &ring.ktiles, &i32c(1), |f, kt| self.tma_issue(f, &it, ring, kt));
                    });
                });
            },
            |f| {
                ptx::setmaxnreg(f, true, consumer_regs);
                let threads = c.consumer_threads();
                let tid0 = f.mul(&set, &i32c(threads));
                let warp0 = f.mul(&set, &i32c(c.warps));
                let area = f.mul(&set, &i32c(c.smem_layout().epilogue_bytes));
                let local = Thread {
                    tid: f.sub(&th.tid, &tid0),
                    warp: f.sub(&th.warp, &warp0),
                    lane: th.lane.clone(),
                    g: th.g.clone(),
                    t: th.t.clone(),
                    scratch: f.add(&th.scratch, &area),
                };
                let id = f.add(&set, &i32c(1));
                let first = f.mul(&set, &items.stride);
                let first = f.add(&items.first, &first);
                let step = f.shl(&items.stride, &i32c(sets.trailing_zeros()));
                // Ping-pong only: the sets' mainloop-done barriers that order their mainloops.
                let turns = (sets == 2).then(|| {
                    let other = f.xor(&set, &i32c(1));
                    (self.mainloop_done(f, ring, &other), self.mainloop_done(f, ring, &set))
                });
                let lane0 = f.icmp(Icmp::Eq, &th.lane, &i32c(0));
                f.with_barrier_scope(&id, threads, |f| {
                    f.for_loop(&first, &items.count, &step, |f, item| {
                        let it = items.item(self, f, item);
                        if let Some((other_done, _)) = &turns {
                            // Mainloops run in item order: item q waits for the end of item
                            // q − 1's (the other set's mainloop number (q − 1) / 2). A slot's
                            // full barrier then has completed every earlier round, so its
                            // parity names this item's round and not one `stages` slices back.
                            let started = f.icmp(Icmp::Ugt, &it.seq, &i32c(0));
                            f.if_then(&started, |f| {
                                let prev = f.add(&it.seq, &i32c(-1));
                                let mainloop = f.lshr(&prev, &i32c(1));
                                let phase = PipelineState::full_phase(f, &mainloop);
                                ptx::mbarrier_wait(f, other_done, &phase);
                            });
                        }
                        let acc = self.wgmma_mainloop(f, &local, &it, ring, false);
                        if let Some((_, my_done)) = &turns {
                            f.if_then(&lane0, |f| ptx::mbarrier_arrive(f, my_done));
                        }
                        self.epilogue(f, &local, &it, &acc);
                        // The set's next epilogue rewrites the scratch this one read.
                        f.barrier();
                    });
                });
            },
        );
    }
}
