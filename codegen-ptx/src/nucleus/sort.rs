//! One pass of the picked rows' stable LSD radix sort (DESIGN.md "Exact nucleus on the
//! device", step 3): 8-bit digits of the ascending keys, the tokens as payload. The logits
//! kernel lays each row out in token order, so after the four passes equal keys stay in token
//! order: `Scored::ranks_before`'s order, `abi::filter::whole_row`'s.
//!
//! A pass is two kernels over the same tiles of [`NUCLEUS_SORT_TILE`] entries: the histogram
//! (each tile's digit counts) and the scatter. A scatter CTA finds each digit's first output
//! slot from the whole histogram (the digits below it, then the same digit in the tiles before
//! it), splits it over its warps by their own counts, and each warp walks its 512 entries in
//! order, 32 at a time: a lane's slot is its warp's running slot for its digit plus the lanes
//! below it with the same digit (`match.any`), so the scatter is stable.

use super::{pick_count, popc, row_elem, NUCLEUS_SORT_TILE, NUCLEUS_THREADS};
use crate::ir::{i32c, Atomic, Func, Icmp, Ptr, Shared, I1, I32, I64};
use crate::params::{arg, NUCLEUS_HIST, NUCLEUS_SCATTER};
use crate::ptx;

pub(crate) const HIST: &str = "flashsample_nucleus_hist";
pub(crate) const SCATTER: &str = "flashsample_nucleus_scatter";
const WARPS: u32 = NUCLEUS_THREADS / 32;
/// Entries per warp of a tile, walked 32 at a time.
const WARP_ENTRIES: u32 = NUCLEUS_SORT_TILE / WARPS;
const _: () = assert!(NUCLEUS_THREADS == 256, "one thread per digit");
/// Tiles' counts a scatter thread loads per iteration.
const TILE_UNROLL: u32 = 8;

/// The shared arrays the kernels declare: the histogram, the digits' scan, the per-warp counts.
const HIST_COUNTS: Ptr<Shared> = Ptr::named("@fs_nucleus_hist");
const SCAN: Ptr<Shared> = Ptr::named("@fs_nucleus_scan");
const WARP_COUNTS: Ptr<Shared> = Ptr::named("@fs_nucleus_warp");

/// The CTA's pick (`ctaid.y`), its tile's first entry, and whether the pick exists (uniform).
fn tile(f: &mut Func) -> (I32, I32, I1) {
    let count = pick_count(f);
    let j = f.sreg("ctaid.y");
    let tile = f.sreg("ctaid.x");
    let first = f.mul(&tile, &i32c(NUCLEUS_SORT_TILE));
    let live = f.icmp(Icmp::Ult, &j, &count);
    (j, first, live)
}

/// Digit of `key` in this pass.
fn digit(f: &mut Func, key: &I32) -> I32 {
    let d = f.lshr(key, &arg::SHIFT);
    f.and(&d, &i32c(255))
}

fn shared(f: &mut Func, array: &Ptr<Shared>, i: &I32) -> Ptr<Shared> {
    f.element::<_, I32>(array, i)
}

/// All lanes of the warp wait here (their shared-memory accesses before it are done).
fn warp_sync(f: &mut Func) {
    f.call_void("@llvm.nvvm.bar.warp.sync", &[&i32c(-1)]);
}

pub(super) fn emit_hist() -> String {
    let mut f = Func::new();
    let tid = f.sreg("tid.x");
    let (j, first, live) = tile(&mut f);
    f.if_then(&live, |f| {
        let h = shared(f, &HIST_COUNTS, &tid);
        f.store(&i32c(0), &h, 4);
        f.barrier();
        // Every load of the tile first (independent, in flight together), then the counts.
        let digits: Vec<(I1, I32)> = (0..NUCLEUS_SORT_TILE / NUCLEUS_THREADS)
            .map(|step| {
                let e = f.add(&first, &i32c(step * NUCLEUS_THREADS));
                let e = f.add(&e, &tid);
                let valid = f.icmp(Icmp::Ult, &e, &arg::VOCAB);
                let es = f.sel(&valid, &e, &i32c(0));
                let e64: I64 = f.zext(&es);
                let at = row_elem(f, &j, &e64);
                let a = f.gaddr(&arg::KEYS, &at, 4);
                let key = f.load(&a, 4);
                (valid, digit(f, &key))
            })
            .collect();
        for (valid, d) in digits {
            f.if_then(&valid, |f| {
                let s = shared(f, &HIST_COUNTS, &d);
                f.atomic_update(Atomic::Add, &s, &i32c(1), Some(4));
            });
        }
        f.barrier();
        let n: I32 = f.load(&h, 4);
        let tiles = f.sreg("nctaid.x");
        let tile = f.sreg("ctaid.x");
        let slot = f.mul(&j, &tiles);
        let slot = f.add(&slot, &tile);
        let slot = f.shl(&slot, &i32c(8));
        let slot = f.add(&slot, &tid);
        let s64 = f.zext(&slot);
        let a = f.gaddr(&arg::HIST, &s64, 4);
        f.store(&n, &a, 4);
    });
    f.ret_void();
    let mut out = String::from("@fs_nucleus_hist = internal addrspace(3) global [256 x i32] undef, align 4\n");
    out.push_str(&f.finish(&NUCLEUS_HIST.llvm_header(HIST, &format!("\"nvvm.maxntid\"=\"{NUCLEUS_THREADS}\""))));
    out
}

pub(super) fn emit_scatter() -> String {
    let mut f = Func::new();
    let tid = f.sreg("tid.x");
    let warp = f.lshr(&tid, &i32c(5));
    let lane = f.and(&tid, &i32c(31));
    let lt = f.shl(&i32c(1), &lane);
    let lt = f.sub(&lt, &i32c(1));
    let (j, first, live) = tile(&mut f);
    f.if_then(&live, |f| {
        // Thread d: digit d's count over the row and over the tiles before this one.
        let tiles = f.sreg("nctaid.x");
        let tile = f.sreg("ctaid.x");
        let total = f.var(&i32c(0));
        let before = f.var(&i32c(0));
        let row_hist = f.mul(&j, &tiles);
        // Eight tiles' counts per iteration, loaded together (independent loads in flight).
        f.for_loop(&i32c(0), &tiles, &i32c(TILE_UNROLL), |f, t0| {
            let counts: Vec<(I32, I32)> = (0..TILE_UNROLL)
                .map(|u| {
                    let t = f.add(t0, &i32c(u));
                    let inside = f.icmp(Icmp::Ult, &t, &tiles);
                    let ts = f.sel(&inside, &t, &i32c(0));
                    let slot = f.add(&row_hist, &ts);
                    let slot = f.shl(&slot, &i32c(8));
                    let slot = f.add(&slot, &tid);
                    let s64 = f.zext(&slot);
                    let a = f.gaddr(&arg::HIST, &s64, 4);
                    let n = f.load(&a, 4);
                    (t, f.sel(&inside, &n, &i32c(0)))
                })
                .collect();
            for (t, n) in counts {
                let tv = f.get(&total);
                let tv = f.add(&tv, &n);
                f.set(&total, &tv);
                let earlier = f.icmp(Icmp::Ult, &t, &tile);
                let add = f.sel(&earlier, &n, &i32c(0));
                let bv = f.get(&before);
                let bv = f.add(&bv, &add);
                f.set(&before, &bv);
            }
        });
        // Exclusive scan of the totals over the digits (Hillis–Steele in shared memory).
        let total = f.get(&total);
        let scan = shared(f, &SCAN, &tid);
        f.store(&total, &scan, 4);
        f.barrier();
        let mut off = 1;
        while off < NUCLEUS_THREADS {
            let has = f.icmp(Icmp::Uge, &tid, &i32c(off));
            let other = f.sub(&tid, &i32c(off));
            let other = f.sel(&has, &other, &i32c(0));
            let oa = shared(f, &SCAN, &other);
            let ov = f.load(&oa, 4);
            let ov = f.sel(&has, &ov, &i32c(0));
            f.barrier();
            let mine = f.load(&scan, 4);
            let sum = f.add(&mine, &ov);
            f.store(&sum, &scan, 4);
            f.barrier();
            off *= 2;
        }
        let inclusive = f.load(&scan, 4);
        let below = f.sub(&inclusive, &total);
        let bv = f.get(&before);
        let start = f.add(&below, &bv);
        // Per (warp, digit) counts of this tile, then each warp's first slot per digit.
        for w in 0..WARPS {
            let i = f.add(&tid, &i32c(w * 256));
            let a = shared(f, &WARP_COUNTS, &i);
            f.store(&i32c(0), &a, 4);
        }
        f.barrier();
        let wfirst = f.mul(&warp, &i32c(WARP_ENTRIES));
        let wfirst = f.add(&first, &wfirst);
        let wslot = f.shl(&warp, &i32c(8));
        let entry = |f: &mut Func, step: u32| {
            let e = f.add(&wfirst, &i32c(step * 32));
            let e = f.add(&e, &lane);
            let valid = f.icmp(Icmp::Ult, &e, &arg::VOCAB);
            let es = f.sel(&valid, &e, &i32c(0));
            let e64 = f.zext(&es);
            let at = row_elem(f, &j, &e64);
            (valid, at)
        };
        // The warp's keys and tokens, all loaded up front (they stay in registers for the
        // scatter below): the count, then the stable scatter, 32 entries at a time.
        let entries: Vec<(I1, I32, I32)> = (0..WARP_ENTRIES / 32)
            .map(|step| {
                let (valid, at) = entry(f, step);
                let a = f.gaddr(&arg::KEYS, &at, 4);
                let key = f.load(&a, 4);
                let a = f.gaddr(&arg::VALS, &at, 4);
                let val = f.load(&a, 4);
                (valid, key, val)
            })
            .collect();
        for (valid, key, _) in &entries {
            f.if_then(valid, |f| {
                let d = digit(f, key);
                let i = f.add(&wslot, &d);
                let s = shared(f, &WARP_COUNTS, &i);
                f.atomic_update(Atomic::Add, &s, &i32c(1), Some(4));
            });
        }
        f.barrier();
        let run = f.var(&start);
        for w in 0..WARPS {
            let i = f.add(&tid, &i32c(w * 256));
            let a = shared(f, &WARP_COUNTS, &i);
            let n = f.load(&a, 4);
            let r = f.get(&run);
            f.store(&r, &a, 4);
            let r1 = f.add(&r, &n);
            f.set(&run, &r1);
        }
        f.barrier();
        // The stable scatter, 32 entries of the warp at a time.
        for (valid, key, val) in entries {
            let d = digit(f, &key);
            // Lanes past the vocabulary (a suffix of the warp) share a digit no entry has.
            let d_or_none = f.sel(&valid, &d, &i32c(256));
            let peers = ptx::match_any(f, &d_or_none);
            let below = f.and(&peers, &lt);
            let rank = popc(f, &below);
            let i = f.add(&wslot, &d);
            let s = shared(f, &WARP_COUNTS, &i);
            let base = f.load(&s, 4);
            f.if_then(&valid, |f| {
                let pos = f.add(&base, &rank);
                let p64 = f.zext(&pos);
                let out = row_elem(f, &j, &p64);
                let a = f.gaddr(&arg::KEYS_OUT, &out, 4);
                f.store(&key, &a, 4);
                let a = f.gaddr(&arg::VALS_OUT, &out, 4);
                f.store(&val, &a, 4);
            });
            // Every peer has read the running slot before its leader advances it.
            warp_sync(f);
            let leader = f.icmp(Icmp::Eq, &rank, &i32c(0));
            let lead = f.and(&leader, &valid);
            f.if_then(&lead, |f| {
                let n = popc(f, &peers);
                let next = f.add(&base, &n);
                f.store(&next, &s, 4);
            });
            warp_sync(f);
        }
    });
    f.ret_void();
    let mut out = format!(
        "@fs_nucleus_scan = internal addrspace(3) global [256 x i32] undef, align 4\n\
         @fs_nucleus_warp = internal addrspace(3) global [{} x i32] undef, align 4\n",
        WARPS * 256
    );
    out.push_str(&f.finish(&NUCLEUS_SCATTER.llvm_header(SCATTER, &format!("\"nvvm.maxntid\"=\"{NUCLEUS_THREADS}\""))));
    out
}
