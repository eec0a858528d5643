//! [`Schedule::MmaSync`](crate::Schedule::MmaSync): tensor cores on sm_80+. Each k slice of the
//! `cp.async` ring is read into `ldmatrix` fragments and multiplied with
//! `mma.sync.m16n8k16` into f32 accumulators (the layout the epilogue reads directly).

use super::ring::Ring;
use super::{Gen, Item, Thread};
use crate::ir::{i32c, Func, F32, I32};
use crate::ptx;
use flashsample_ir::DType;

impl Gen<'_> {
    /// `own_prologue`: issue this item's prologue here (false when the previous item's
    /// epilogue already did, [`GpuConfig::overlaps_epilogue`]).
    pub(super) fn mma_sync_mainloop(&self, f: &mut Func, th: &Thread, it: &Item, ring: &Ring, own_prologue: bool) -> Vec<F32> {
        let c = self.c;
        let ks = c.k_step();
        let row_bytes = ks * 2;
        let w_tile_bytes = c.vocab_tile * row_bytes;
        let stage_bytes = c.smem_layout().slot_bytes;
        let mtiles = self.quads * 2;
        let smem = &ring.smem;

        let acc: Vec<_> = (0..mtiles * self.ntiles * 4).map(|_| f.var(&F32::ZERO)).collect();
        if own_prologue {
            self.prologue(f, th, it, ring, None);
        }
        let dtype = match self.p.weights.dtype {
            DType::F16 => "f16",
            _ => "bf16",
        };
        let m = f.and(&th.lane, &i32c(15));
        let m7 = f.and(&m, &i32c(7));
        let mhi = f.lshr(&m, &i32c(3));
        let khalf_a = f.lshr(&th.lane, &i32c(4));
        let l7 = f.and(&th.lane, &i32c(7));
        let khalf_b = f.lshr(&th.lane, &i32c(3));
        let khalf_b = f.and(&khalf_b, &i32c(1));
        let nsel = f.lshr(&th.lane, &i32c(4));
        let warp_row = f.mul(&th.warp, &i32c(self.warp_rows()));
        let m7x4 = f.shl(&m7, &i32c(2));
        let a_row_base = f.add(&warp_row, &m7x4);
        let a_row_base = f.add(&a_row_base, &mhi);

        let item = self.begin_item(f, th, it, ring);
        f.for_loop(&i32c(0), &ring.ktiles, &i32c(1), |f, kt| {
            // Slice kt has landed for every thread, and everyone is done reading the slot
            // the refill below overwrites (consumed at iteration kt − 1).
            let full = self.wait_full(f, ring, &item, kt);
            self.refill(f, th, it, ring, &item, kt);
            let slot = self.slot(f, full, kt);
            let slot_off = f.mul(&slot, &i32c(stage_bytes));
            let slot_addr = f.shared_offset(smem, &slot_off);
            let ldm = |f: &mut Func, x: u32, byte_off: &I32| -> Vec<I32> {
                let a = f.shared_offset(&slot_addr, byte_off);
                ptx::ldmatrix(f, x, &a)
            };
            // Fragments of k16 step kk (A per m tile, B per n tile).
            let frags = |f: &mut Func, kk: u32| -> (Vec<Vec<I32>>, Vec<Vec<I32>>) {
                // A fragments: lane l gives MMA row l & 15 of k half l >> 4.
                let mut a_frag = Vec::new();
                let ca = f.add(&khalf_a, &i32c(kk * 2));
                let swa = f.xor(&ca, &m7);
                let swa = f.shl(&swa, &i32c(4));
                for mt in 0..mtiles {
                    let row = f.add(&a_row_base, &i32c((mt >> 1) * 32 + 2 * (mt & 1)));
                    let ro = f.mul(&row, &i32c(row_bytes));
                    let off = f.add(&ro, &swa);
                    a_frag.push(ldm(f, 4, &off));
                }
                // B fragments: H rows n (batch), k contiguous = mma's col-major B.
                let cb = f.add(&khalf_b, &i32c(kk * 2));
                let swb = f.xor(&cb, &l7);
                let swb = f.shl(&swb, &i32c(4));
                let mut b_frag: Vec<Vec<I32>> = Vec::new();
                let mut n = 0;
                while n < self.ntiles {
                    let pair = n + 1 < self.ntiles;
                    let nrow = if pair {
                        let sel = f.add(&nsel, &i32c(n));
                        let s8 = f.shl(&sel, &i32c(3));
                        f.add(&s8, &l7)
                    } else {
                        f.add(&l7, &i32c(n * 8))
                    };
                    let ro = f.mul(&nrow, &i32c(row_bytes));
                    let off = f.add(&ro, &swb);
                    let off = f.add(&off, &i32c(w_tile_bytes));
                    let r = ldm(f, if pair { 4 } else { 2 }, &off);
                    b_frag.push(r[0..2].to_vec());
                    if pair {
                        b_frag.push(r[2..4].to_vec());
                    }
                    n += if pair { 2 } else { 1 };
                }
                (a_frag, b_frag)
            };
            // Step kk + 1's ldmatrix are issued before step kk's MMAs, so their shared-memory
            // latency hides behind the tensor pipe instead of stalling it.
            let mut next = Some(frags(f, 0));
            for kk in 0..ks / 16 {
                let (a_frag, b_frag) = next.take().unwrap_or_default();
                if kk + 1 < ks / 16 {
                    next = Some(frags(f, kk + 1));
                }
                for mt in 0..mtiles {
                    for n in 0..self.ntiles {
                        let base = ((mt * self.ntiles + n) * 4) as usize;
                        let cur: Vec<F32> = (0..4).map(|i| f.get(&acc[base + i])).collect();
                        let out = ptx::mma_m16n8k16(f, dtype, &a_frag[mt as usize], &b_frag[n as usize], &cur);
                        for (i, v) in out.iter().enumerate() {
                            f.set(&acc[base + i], v);
                        }
                    }
                }
            }
        });
        self.end_item(f, ring, &item);
        // Every warp is done reading the ring: the epilogue's scratch may alias it, or the
        // next item's prologue may refill it.
        f.barrier();

        self.fragments_to_accumulators(f, &acc)
    }
}
