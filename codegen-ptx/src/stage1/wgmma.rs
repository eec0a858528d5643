//! [`Schedule::Wgmma`](crate::Schedule::Wgmma) and
//! [`Schedule::WgmmaTma`](crate::Schedule::WgmmaTma): Hopper's warpgroup MMA straight from the
//! ring (`cp.async` or TMA feed, `ring.rs`). W rows sit at permuted shared rows
//! ([`Gen::wgmma_smem_row`]) so that wgmma's accumulator fragments are exactly mma.sync's and
//! the epilogue is shared.

use super::ring::Ring;
use super::{Gen, Item, Thread};
use crate::config::Schedule;
use crate::ir::{i32c, Func, Value, Var, F32, I64};
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
    pub(super) fn wgmma_mainloop(&self, f: &mut Func, th: &Thread, it: &Item, ring: &Ring, own_prologue: bool) -> Vec<String> {
        let c = self.c;
        let n = c.batch_tile;
        let per = n / 2; // f32 accumulators of one m64nN operand per thread
        let mtiles = self.quads * 2;
        let layout = c.smem_layout();
        let dtype = match self.p.weights.dtype {
            DType::F16 => "f16",
            _ => "bf16",
        };
        let acc: Vec<Var> = (0..mtiles * per).map(|_| f.var_u("float", "0.0")).collect();
        if own_prologue {
            self.prologue(f, th, it, ring, None);
        }
        let grp = f.v(format!("lshr i32 {}, 2", th.warp));
        // The warpgroup's first m64 operand, in descriptor units (16 bytes).
        let a_grp = f.mul_u(&grp, &(mtiles * 64 * 128 / 16).to_string());
        let a_grp = f.zext64_u(&a_grp);
        // Descriptor: start address >> 4 (bits 0-13), leading byte offset 1 (unused by
        // swizzled K-major), stride byte offset 1024 >> 4 (8-row atoms, bits 32-45),
        // 128-byte swizzle (bits 62-63).
        const DESC: u64 = (1 << 16) | (64 << 32) | (1 << 62);
        // Every accumulator through one asm, so LLVM cannot move their uses across it.
        let through_all = |f: &mut Func, op: &dyn Fn(&mut Func, &[F32]) -> Vec<F32>| {
            let vals: Vec<F32> = acc.iter().map(|a| F32::raw(f.get_u(a))).collect();
            for (a, v) in acc.iter().zip(op(f, &vals)) {
                f.set_u(a, v.text());
            }
        };
        let item = self.begin_item(f, th, it, ring);
        let drain = matches!(c.schedule, Schedule::Wgmma { drain: true, .. });
        f.for_loop_u("0", ring.ktiles.text(), "1", |f, kt| {
            let full = self.wait_full(f, ring, &item, kt);
            let slot = self.slot(f, full, kt);
            let slot_off = f.mul(&slot, &i32c(layout.slot_bytes));
            let slot_addr = f.shared_offset(&ring.smem, &slot_off);
            let s4 = f.v(format!("lshr i32 {slot_addr}, 4"));
            let s4 = f.zext64_u(&s4);
            let desc0 = f.v(format!("or i64 {s4}, {DESC}"));
            let a_desc0 = f.v(format!("add i64 {desc0}, {a_grp}"));
            through_all(f, &|f, acc| ptx::wgmma_fence(f, acc));
            for kk in 0..c.k_step() / 16 {
                let db = f.typed::<I64>(format!("add i64 {desc0}, {}", (layout.h_tile + kk * 32) >> 4));
                for mt in 0..mtiles {
                    let da = f.typed::<I64>(format!("add i64 {a_desc0}, {}", (mt * 64 * 128 + kk * 32) >> 4));
                    let range = (mt * per) as usize..((mt + 1) * per) as usize;
                    let vals: Vec<F32> = acc[range.clone()].iter().map(|a| F32::raw(f.get_u(a))).collect();
                    let out = ptx::wgmma_m64k16(f, n, dtype, &da, &db, &vals);
                    for (a, v) in acc[range].iter().zip(out) {
                        f.set_u(a, v.text());
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
    pub(super) fn wgmma_smem_row(&self, f: &mut Func, r: &str) -> String {
        let wr = self.warp_rows();
        let mtiles = self.quads * 2;
        let w = f.v(format!("udiv i32 {r}, {wr}"));
        let rem = f.v(format!("urem i32 {r}, {wr}"));
        let k = f.v(format!("and i32 {w}, 3"));
        let grp = f.v(format!("lshr i32 {w}, 2"));
        let blk = f.v(format!("lshr i32 {rem}, 5"));
        let q = f.v(format!("and i32 {rem}, 31"));
        let g = f.v(format!("lshr i32 {q}, 2"));
        let h = f.v(format!("lshr i32 {q}, 1"));
        let h = f.v(format!("and i32 {h}, 1"));
        let e = f.v(format!("and i32 {q}, 1"));
        let mt = f.v(format!("shl i32 {blk}, 1"));
        let mt = f.v(format!("or i32 {mt}, {h}"));
        let op = f.mul_u(&grp, &mtiles.to_string());
        let op = f.add_u(&op, &mt);
        let base = f.v(format!("shl i32 {op}, 6"));
        let k16 = f.v(format!("shl i32 {k}, 4"));
        let e8 = f.v(format!("shl i32 {e}, 3"));
        let at = f.add_u(&base, &k16);
        let at = f.add_u(&at, &g);
        f.add_u(&at, &e8)
    }

    /// Fragment (m tile mt, n tile n, element i) → (quad, token, n tile, column); the same
    /// for mma.sync's m16n8 tiles and wgmma's m64nN operands (warp slices of 16 rows).
    pub(super) fn fragments_to_accumulators(&self, f: &mut Func, acc: &[Var]) -> Vec<String> {
        let mut out = vec![String::new(); self.acc_count()];
        for mt in 0..self.quads * 2 {
            for n in 0..self.ntiles {
                for i in 0..4u32 {
                    let v = f.get_u(&acc[((mt * self.ntiles + n) * 4 + i) as usize]);
                    out[self.acc_index(mt >> 1, 2 * (mt & 1) + (i >> 1), n, i & 1)] = v;
                }
            }
        }
        out
    }
}
