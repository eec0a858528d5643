//! [`GridKind::PingPong`](crate::GridKind::PingPong): the CUTLASS ping-pong schedule on the TMA
//! ring. Warps `2·warps ..` are the producer warpgroup: lane 0 of its first warp streams every
//! slice of the CTA's items through [`Gen::tma_issue`], gated only by the empty mbarriers, and
//! the group gives its registers to the consumers (`setmaxnreg`). Consumer set `s` (warps
//! `s·warps ..`) takes the CTA's items `s, s + 2, ...`, each through the wgmma mainloop and the
//! epilogue, with its own epilogue area and named barrier `1 + s`. Mainloops take turns (a
//! mainloop-done mbarrier per set, as CUTLASS orders its math warpgroups), so one set's
//! epilogue runs while the other multiplies the next item, and the producer keeps the ring
//! full throughout.

use super::ring::{PipelineState, Ring};
use super::{i32v, Gen, Items, Thread};
use crate::ir::{Func, Value};
use crate::ptx;

impl Gen<'_> {
    /// The whole CTA after the mbarriers' initialisation: producer or consumer set.
    pub(super) fn pingpong(&self, f: &mut Func, th: &Thread, ring: &Ring, items: &Items) {
        let c = self.c;
        let (_, producer_regs, consumer_regs) = c.pingpong_registers();
        let set = f.v(format!("udiv i32 {}, {}", th.warp, c.warps));
        let producer = f.v(format!("icmp eq i32 {set}, 2"));
        f.if_else_u(
            &producer,
            |f| {
                ptx::setmaxnreg(f, false, producer_regs);
                let first_warp = f.v(format!("icmp eq i32 {}, {}", th.warp, 2 * c.warps));
                let lane0 = f.v(format!("icmp eq i32 {}, 0", th.lane));
                let issuer = f.and1_u(&first_warp, &lane0);
                f.if_then_u(&issuer, |f| {
                    f.for_loop_u(&items.first, &items.count, &items.stride, |f, item| {
                        let it = items.item(self, f, item);
                        f.for_loop_u("0", ring.ktiles.text(), "1", |f, kt| self.tma_issue(f, &it, ring, kt));
                    });
                });
            },
            |f| {
                ptx::setmaxnreg(f, true, consumer_regs);
                let threads = c.consumer_threads();
                let tid0 = f.mul_u(&set, &threads.to_string());
                let warp0 = f.mul_u(&set, &c.warps.to_string());
                let area = f.mul_u(&set, &c.smem_layout().epilogue_bytes.to_string());
                let local = Thread {
                    tid: f.v(format!("sub i32 {}, {tid0}", th.tid)),
                    warp: f.v(format!("sub i32 {}, {warp0}", th.warp)),
                    lane: th.lane.clone(),
                    g: th.g.clone(),
                    t: th.t.clone(),
                    scratch: f.add_u(&th.scratch, &area),
                };
                let id = f.add_u(&set, "1");
                let first = f.mul_u(&set, &items.stride);
                let first = f.add_u(&items.first, &first);
                let step = f.v(format!("shl i32 {}, 1", items.stride));
                let other = f.v(format!("xor i32 {set}, 1"));
                let other_done = self.mainloop_done(f, ring, &other);
                let my_done = self.mainloop_done(f, ring, &set);
                let lane0 = f.v(format!("icmp eq i32 {}, 0", th.lane));
                f.with_barrier_scope_u(&id, threads, |f| {
                    f.for_loop_u(&first, &items.count, &step, |f, item| {
                        let it = items.item(self, f, item);
                        // Mainloops run in item order: item q waits for the end of item
                        // q − 1's (the other set's mainloop number (q − 1) / 2). A slot's full
                        // barrier then has completed every earlier round, so its parity names
                        // this item's round and not one `stages` slices back.
                        let started = f.v(format!("icmp ugt i32 {}, 0", it.seq));
                        f.if_then_u(&started, |f| {
                            let prev = f.v(format!("add i32 {}, -1", it.seq));
                            let mainloop = f.v(format!("lshr i32 {prev}, 1"));
                            let phase = PipelineState::full_phase(f, &i32v(&mainloop));
                            ptx::mbarrier_wait(f, &other_done, &phase);
                        });
                        let acc = self.wgmma_mainloop(f, &local, &it, ring, false);
                        f.if_then_u(&lane0, |f| ptx::mbarrier_arrive(f, &my_done));
                        self.epilogue(f, &local, &it, &acc);
                        // The set's next epilogue rewrites the scratch this one read.
                        f.barrier();
                    });
                });
            },
        );
    }
}
