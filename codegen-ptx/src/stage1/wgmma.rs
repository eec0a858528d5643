//! [`Schedule::Wgmma`](crate::Schedule::Wgmma) and
//! [`Schedule::WgmmaTma`](crate::Schedule::WgmmaTma): Hopper's warpgroup MMA straight from the
//! ring (`cp.async` or TMA feed, `ring.rs`). W rows sit at permuted shared rows
//! ([`Gen::wgmma_smem_row`]) so that wgmma's accumulator fragments are exactly mma.sync's and
//! the epilogue is shared.

use super::ring::Ring;
use super::{Gen, Item, Thread};
use crate::config::Schedule;
use crate::ir::{i32c, Func, Int, Var, F32, I32, I64};
use crate::ptx;
use flashsample_ir::DType;

impl Gen<'_> {
    /// Hopper: each warpgroup multiplies its `2·quads` m64 W operands by the H tile with
    /// `wgmma.mma_async` m64n{batch_tile}k16 straight from the ring slot (both operands
    /// K-major, 128-byte swizzle), one commit group per slice, fed by either ring.
    ///
    /// Slice kt's wgmmas are queued while slice kt − 1's still run (`wait_group 1` after the
    /// issue; `drain`: `wait_group 0`), so the tensor pipe does not drain at every slice. On
    /// the `cp.async` ring the refill then targets the slot of slice kt − 2, which every
    /// warpgroup finished before this iteration's barrier, so it runs `stages − 2` ahead
    /// (drained: `stages − 1`). On the TMA ring each warp releases slice kt − 1's slot after
    /// `wait_group 1` and thread 0 (or the ping-pong producer) refills it with slice
    /// kt + stages − 1.
    ///
    /// `own_prologue`: issue this item's prologue here (false when the previous item's
    /// epilogue already did, [`GpuConfig::overlaps_epilogue`](crate::GpuConfig::overlaps_epilogue),
    /// or a producer warp does).
    pub(super) fn wgmma_mainloop(&self, f: &mut Func, th: &Thread, it: &Item, ring: &Ring, own_prologue: bool) -> Vec<F32> {
        let c = self.c;
        let n = c.batch_tile;
        let per = n / 2; // f32 accumulators of one m64nN operand per thread
        let mtiles = self.quads * 2;
        let layout = c.smem_layout();
        let dtype = match self.p.weights.dtype {
            DType::F16 => "f16",
            _ => "bf16",
        };
        let acc: Vec<_> = (0..mtiles * per).map(|_| f.var(&F32::ZERO)).collect();
        if own_prologue {
            self.prologue(f, th, it, ring, None);
        }
        let grp = f.lshr(&th.warp, &i32c(2));
        // The warpgroup's first m64 operand, in descriptor units (16 bytes).
        let a_grp = f.mul(&grp, &i32c(mtiles * 64 * 128 / 16));
        let a_grp: I64 = f.zext(&a_grp);
        // Descriptor: start address >> 4 (bits 0-13), leading byte offset 1 (unused by
        // swizzled K-major), stride byte offset 1024 >> 4 (8-row atoms, bits 32-45),
        // 128-byte swizzle (bits 62-63).
        const DESC: u64 = (1 << 16) | (64 << 32) | (1 << 62);
        // Every accumulator through one asm, so LLVM cannot move their uses across it.
        let through_all = |f: &mut Func, op: &dyn Fn(&mut Func, &[F32]) -> Vec<F32>| {
            let vals: Vec<F32> = acc.iter().map(|a| f.get(a)).collect();
            for (a, v) in acc.iter().zip(op(f, &vals)) {
                f.set(a, &v);
            }
        };
        let item = self.begin_item(f, th, it, ring);
        let drain = matches!(c.schedule, Schedule::Wgmma { drain: true, .. });
        f.for_loop(&i32c(0), &ring.ktiles, &i32c(1), |f, kt| {
            let full = self.wait_full(f, ring, &item, kt);
            let slot = self.slot(f, full, kt);
            let slot_off = f.mul(&slot, &i32c(layout.slot_bytes));
            let slot_addr = f.shared_offset(&ring.smem, &slot_off);
            let s4 = f.lshr(&slot_addr.bits(), &i32c(4));
            let s4: I64 = f.zext(&s4);
            let desc0 = f.or(&s4, &I64::c(DESC));
            let a_desc0 = f.add(&desc0, &a_grp);
            through_all(f, &|f, acc| ptx::wgmma_fence(f, acc));
            for kk in 0..c.k_step() / 16 {
                let db = f.add(&desc0, &I64::c((layout.h_tile + kk * 32) >> 4));
                for mt in 0..mtiles {
                    let da = f.add(&a_desc0, &I64::c((mt * 64 * 128 + kk * 32) >> 4));
                    let range = (mt * per) as usize..((mt + 1) * per) as usize;
                    let vals: Vec<F32> = acc[range.clone()].iter().map(|a| f.get(a)).collect();
                    let out = ptx::wgmma_m64k16(f, n, dtype, &da, &db, &vals);
                    for (a, v) in acc[range].iter().zip(out) {
                        f.set(a, &v);
                    }
                }
            }
            ptx::wgmma_commit(f);
            // Slice kt − 1's group (drained: slice kt's) is done for this warpgroup.
            through_all(f, &|f, acc| ptx::wgmma_wait(f, if drain { 0 } else { 1 }, acc));
            self.release(f, ring, &item, kt);
            self.refill(f, th, it, ring, &item, kt);
        });
        through_all(f, &|f, acc| ptx::wgmma_wait(f, 0, acc));
        self.end_item(f, ring, &item);
        f.barrier();
        self.fragments_to_accumulators(f, &acc)
    }

    /// The shared-memory row (of a stage's W tile) that holds W tile row `r` on the wgmma
    /// path, so that wgmma's accumulator layout is the mma.sync path's (module doc).
    ///
    /// Warpgroup `G` (warps `4G..4G+4`) multiplies `2·quads` m64 operands of 64 rows each,
    /// the `mt`-th at shared rows `(G·2·quads + mt)·64`; in one, warp `k` of the group gets
    /// accumulator rows `16k + g` and `16k + g + 8`, which must hold the W rows the mma.sync
    /// path gives m tile `mt` of warp `4G + k`: `4g + 2(mt & 1)` (+1) of 32-row block `mt >> 1`.
    pub(super) fn wgmma_smem_row(&self, f: &mut Func, r: &I32) -> I32 {
        let wr = i32c(self.warp_rows());
        let mtiles = self.quads * 2;
        let w = f.udiv(r, &wr);
        let rem = f.urem(r, &wr);
        let k = f.and(&w, &i32c(3));
        let grp = f.lshr(&w, &i32c(2));
        let blk = f.lshr(&rem, &i32c(5));
        let q = f.and(&rem, &i32c(31));
        let g = f.lshr(&q, &i32c(2));
        let h = f.lshr(&q, &i32c(1));
        let h = f.and(&h, &i32c(1));
        let e = f.and(&q, &i32c(1));
        let mt = f.shl(&blk, &i32c(1));
        let mt = f.or(&mt, &h);
        let op = f.mul(&grp, &i32c(mtiles));
        let op = f.add(&op, &mt);
        let base = f.shl(&op, &i32c(6));
        let k16 = f.shl(&k, &i32c(4));
        let e8 = f.shl(&e, &i32c(3));
        let at = f.add(&base, &k16);
        let at = f.add(&at, &g);
        f.add(&at, &e8)
    }

    /// Fragment (m tile mt, n tile n, element i) → (quad, token, n tile, column); the same
    /// for mma.sync's m16n8 tiles and wgmma's m64nN operands (warp slices of 16 rows).
    pub(super) fn fragments_to_accumulators(&self, f: &mut Func, acc: &[Var<F32>]) -> Vec<F32> {
        let mut out = vec![F32::ZERO; self.acc_count()];
        for mt in 0..self.quads * 2 {
            for n in 0..self.ntiles {
                for i in 0..4u32 {
                    let v = f.get(&acc[((mt * self.ntiles + n) * 4 + i) as usize]);
                    out[self.acc_index(mt >> 1, 2 * (mt & 1) + (i >> 1), n, i & 1)] = v;
                }
            }
        }
        out
    }
}
