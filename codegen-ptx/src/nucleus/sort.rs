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

use super::{pick_count_u, popc_u, row_elem_u, NUCLEUS_SORT_TILE, NUCLEUS_THREADS};
use crate::ir::Func;
use crate::params::{NUCLEUS_HIST, NUCLEUS_SCATTER};

pub(crate) const HIST: &str = "flashsample_nucleus_hist";
pub(crate) const SCATTER: &str = "flashsample_nucleus_scatter";
const WARPS: u32 = NUCLEUS_THREADS / 32;
/// Entries per warp of a tile, walked 32 at a time.
const WARP_ENTRIES: u32 = NUCLEUS_SORT_TILE / WARPS;
const _: () = assert!(NUCLEUS_THREADS == 256, "one thread per digit");
/// Tiles' counts a scatter thread loads per iteration.
const TILE_UNROLL: u32 = 8;

/// The CTA's pick (`ctaid.y`), its tile's first entry, and whether the pick exists (uniform).
fn tile(f: &mut Func) -> (String, String, String) {
    let count = pick_count_u(f);
    let j = f.sreg_u("ctaid.y");
    let tile = f.sreg_u("ctaid.x");
    let first = f.mul_u(&tile, &NUCLEUS_SORT_TILE.to_string());
    let live = f.ult_u(&j, &count);
    (j, first, live)
}

/// Digit of `key` in this pass.
fn digit(f: &mut Func, key: &str) -> String {
    let d = f.v(format!("lshr i32 {key}, %shift"));
    f.v(format!("and i32 {d}, 255"))
}

fn shared(f: &mut Func, array: &str, i: &str) -> String {
    f.v(format!("getelementptr i32, ptr addrspace(3) {array}, i32 {i}"))
}

pub(super) fn emit_hist() -> String {
    let mut f = Func::new();
    let tid = f.sreg_u("tid.x");
    let (j, first, live) = tile(&mut f);
    f.if_then_u(&live, |f| {
        let h = shared(f, "@fs_nucleus_hist", &tid);
        f.s(format!("store i32 0, ptr addrspace(3) {h}, align 4"));
        f.barrier();
        // Every load of the tile first (independent, in flight together), then the counts.
        let digits: Vec<(String, String)> = (0..NUCLEUS_SORT_TILE / NUCLEUS_THREADS)
            .map(|step| {
                let e = f.add_u(&first, &(step * NUCLEUS_THREADS).to_string());
                let e = f.add_u(&e, &tid);
                let valid = f.ult_u(&e, "%vocab");
                let es = f.sel_u("i32", &valid, &e, "0");
                let e64 = f.zext64_u(&es);
                let at = row_elem_u(f, &j, &e64);
                let a = f.gaddr_u("%keys", &at, 4);
                let key = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
                (valid, digit(f, &key))
            })
            .collect();
        for (valid, d) in digits {
            f.if_then_u(&valid, |f| {
                let s = shared(f, "@fs_nucleus_hist", &d);
                f.s(format!("atomicrmw add ptr addrspace(3) {s}, i32 1 monotonic, align 4"));
            });
        }
        f.barrier();
        let n = f.v(format!("load i32, ptr addrspace(3) {h}, align 4"));
        let tiles = f.sreg_u("nctaid.x");
        let tile = f.sreg_u("ctaid.x");
        let slot = f.mul_u(&j, &tiles);
        let slot = f.add_u(&slot, &tile);
        let slot = f.v(format!("shl i32 {slot}, 8"));
        let slot = f.add_u(&slot, &tid);
        let s64 = f.zext64_u(&slot);
        let a = f.gaddr_u("%hist", &s64, 4);
        f.s(format!("store i32 {n}, ptr addrspace(1) {a}, align 4"));
    });
    f.s("ret void");
    let mut out = String::from("@fs_nucleus_hist = internal addrspace(3) global [256 x i32] undef, align 4\n");
    out.push_str(&f.finish(&NUCLEUS_HIST.llvm_header(HIST, &format!("\"nvvm.maxntid\"=\"{NUCLEUS_THREADS}\""))));
    out
}

pub(super) fn emit_scatter() -> String {
    let mut f = Func::new();
    let tid = f.sreg_u("tid.x");
    let warp = f.v(format!("lshr i32 {tid}, 5"));
    let lane = f.v(format!("and i32 {tid}, 31"));
    let lt = f.v(format!("shl i32 1, {lane}"));
    let lt = f.v(format!("sub i32 {lt}, 1"));
    let (j, first, live) = tile(&mut f);
    f.if_then_u(&live, |f| {
        // Thread d: digit d's count over the row and over the tiles before this one.
        let tiles = f.sreg_u("nctaid.x");
        let tile = f.sreg_u("ctaid.x");
        let total = f.var_u("i32", "0");
        let before = f.var_u("i32", "0");
        let row_hist = f.mul_u(&j, &tiles);
        // Eight tiles' counts per iteration, loaded together (independent loads in flight).
        f.for_loop_u("0", &tiles, &TILE_UNROLL.to_string(), |f, t0| {
            let counts: Vec<(String, String)> = (0..TILE_UNROLL)
                .map(|u| {
                    let t = f.add_u(t0, &u.to_string());
                    let inside = f.ult_u(&t, &tiles);
                    let ts = f.sel_u("i32", &inside, &t, "0");
                    let slot = f.add_u(&row_hist, &ts);
                    let slot = f.v(format!("shl i32 {slot}, 8"));
                    let slot = f.add_u(&slot, &tid);
                    let s64 = f.zext64_u(&slot);
                    let a = f.gaddr_u("%hist", &s64, 4);
                    let n = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
                    (t, f.sel_u("i32", &inside, &n, "0"))
                })
                .collect();
            for (t, n) in counts {
                let tv = f.get_u(&total);
                let tv = f.add_u(&tv, &n);
                f.set_u(&total, &tv);
                let earlier = f.ult_u(&t, &tile);
                let add = f.sel_u("i32", &earlier, &n, "0");
                let bv = f.get_u(&before);
                let bv = f.add_u(&bv, &add);
                f.set_u(&before, &bv);
            }
        });
        // Exclusive scan of the totals over the digits (Hillis–Steele in shared memory).
        let total = f.get_u(&total);
        let scan = shared(f, "@fs_nucleus_scan", &tid);
        f.s(format!("store i32 {total}, ptr addrspace(3) {scan}, align 4"));
        f.barrier();
        let mut off = 1;
        while off < NUCLEUS_THREADS {
            let has = f.v(format!("icmp uge i32 {tid}, {off}"));
            let other = f.v(format!("sub i32 {tid}, {off}"));
            let other = f.sel_u("i32", &has, &other, "0");
            let oa = shared(f, "@fs_nucleus_scan", &other);
            let ov = f.v(format!("load i32, ptr addrspace(3) {oa}, align 4"));
            let ov = f.sel_u("i32", &has, &ov, "0");
            f.barrier();
            let mine = f.v(format!("load i32, ptr addrspace(3) {scan}, align 4"));
            let sum = f.add_u(&mine, &ov);
            f.s(format!("store i32 {sum}, ptr addrspace(3) {scan}, align 4"));
            f.barrier();
            off *= 2;
        }
        let inclusive = f.v(format!("load i32, ptr addrspace(3) {scan}, align 4"));
        let below = f.v(format!("sub i32 {inclusive}, {total}"));
        let bv = f.get_u(&before);
        let start = f.add_u(&below, &bv);
        // Per (warp, digit) counts of this tile, then each warp's first slot per digit.
        for w in 0..WARPS {
            let i = f.add_u(&tid, &(w * 256).to_string());
            let a = shared(f, "@fs_nucleus_warp", &i);
            f.s(format!("store i32 0, ptr addrspace(3) {a}, align 4"));
        }
        f.barrier();
        let wfirst = f.mul_u(&warp, &WARP_ENTRIES.to_string());
        let wfirst = f.add_u(&first, &wfirst);
        let wslot = f.v(format!("shl i32 {warp}, 8"));
        let entry = |f: &mut Func, step: u32| {
            let e = f.add_u(&wfirst, &(step * 32).to_string());
            let e = f.add_u(&e, &lane);
            let valid = f.ult_u(&e, "%vocab");
            let es = f.sel_u("i32", &valid, &e, "0");
            let e64 = f.zext64_u(&es);
            let at = row_elem_u(f, &j, &e64);
            (valid, at)
        };
        // The warp's keys and tokens, all loaded up front (they stay in registers for the
        // scatter below): the count, then the stable scatter, 32 entries at a time.
        let entries: Vec<(String, String, String)> = (0..WARP_ENTRIES / 32)
            .map(|step| {
                let (valid, at) = entry(f, step);
                let a = f.gaddr_u("%keys", &at, 4);
                let key = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
                let a = f.gaddr_u("%vals", &at, 4);
                let val = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
                (valid, key, val)
            })
            .collect();
        for (valid, key, _) in &entries {
            f.if_then_u(valid, |f| {
                let d = digit(f, key);
                let i = f.add_u(&wslot, &d);
                let s = shared(f, "@fs_nucleus_warp", &i);
                f.s(format!("atomicrmw add ptr addrspace(3) {s}, i32 1 monotonic, align 4"));
            });
        }
        f.barrier();
        let run = f.var_u("i32", &start);
        for w in 0..WARPS {
            let i = f.add_u(&tid, &(w * 256).to_string());
            let a = shared(f, "@fs_nucleus_warp", &i);
            let n = f.v(format!("load i32, ptr addrspace(3) {a}, align 4"));
            let r = f.get_u(&run);
            f.s(format!("store i32 {r}, ptr addrspace(3) {a}, align 4"));
            let r1 = f.add_u(&r, &n);
            f.set_u(&run, &r1);
        }
        f.barrier();
        // The stable scatter, 32 entries of the warp at a time.
        for (valid, key, val) in entries {
            let d = digit(f, &key);
            // Lanes past the vocabulary (a suffix of the warp) share a digit no entry has.
            let d_or_none = f.sel_u("i32", &valid, &d, "256");
            let peers = f.v(format!("call i32 asm sideeffect \"match.any.sync.b32 $0, $1, -1;\", \"=r,r\"(i32 {d_or_none}) #1"));
            let below = f.v(format!("and i32 {peers}, {lt}"));
            let rank = popc_u(f, &below);
            let i = f.add_u(&wslot, &d);
            let s = shared(f, "@fs_nucleus_warp", &i);
            let base = f.v(format!("load i32, ptr addrspace(3) {s}, align 4"));
            f.if_then_u(&valid, |f| {
                let pos = f.add_u(&base, &rank);
                let p64 = f.zext64_u(&pos);
                let out = row_elem_u(f, &j, &p64);
                let a = f.gaddr_u("%keys_out", &out, 4);
                f.s(format!("store i32 {key}, ptr addrspace(1) {a}, align 4"));
                let a = f.gaddr_u("%vals_out", &out, 4);
                f.s(format!("store i32 {val}, ptr addrspace(1) {a}, align 4"));
            });
            // Every peer has read the running slot before its leader advances it.
            f.s("call void @llvm.nvvm.bar.warp.sync(i32 -1)");
            let leader = f.v(format!("icmp eq i32 {rank}, 0"));
            let lead = f.and1_u(&leader, &valid);
            f.if_then_u(&lead, |f| {
                let n = popc_u(f, &peers);
                let next = f.add_u(&base, &n);
                f.s(format!("store i32 {next}, ptr addrspace(3) {s}, align 4"));
            });
            f.s("call void @llvm.nvvm.bar.warp.sync(i32 -1)");
        }
    });
    f.s("ret void");
    let mut out = format!(
        "@fs_nucleus_scan = internal addrspace(3) global [256 x i32] undef, align 4\n\
         @fs_nucleus_warp = internal addrspace(3) global [{} x i32] undef, align 4\n",
        WARPS * 256
    );
    out.push_str(&f.finish(&NUCLEUS_SCATTER.llvm_header(SCATTER, &format!("\"nvvm.maxntid\"=\"{NUCLEUS_THREADS}\""))));
    out
}
