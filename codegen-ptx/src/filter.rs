//! The stage-three kernel `flashsample_filter` (DESIGN.md step 9): one CTA of
//! [`FILTER_THREADS`] per batch row merges the row's per-tile lists into its global top
//! `need`, detects lists that were too short (`RowStatus::ListOverflow`), applies the row's
//! `RowFilter` in one thread with exactly `abi::filter::survivors`' f32 steps
//! (`RowStatus::NucleusTooLarge` when the nucleus does not fit), draws each sample by Gumbel-max over the survivors with stage one's noise, and writes
//! the top-n logprobs. In the raw logprob mode (DESIGN.md step 10) the top logprobs come from
//! the raw lists, merged first, and a drawn token reports the raw logit stored beside its entry.
//!
//! Merge: the top `need` of `tiles · per_tile` sorted entries. Selecting them by `need`
//! rounds of block argmax over all entries costs `need · tiles · per_tile` reads, so first a
//! threshold is found: when at least `need` tiles have a live first entry, a two-level radix
//! select over the heads' order keys (`head_threshold`) gives a key `t` with at least `need`
//! heads at or above it, so the `need`-th best head, and with it every token of the row's
//! global top `need`, has a key ≥ `t`. Only entries with a key ≥ `t` are copied to shared
//! memory (typically a little more than `need` of them, at most [`CANDIDATES`]) and
//! rank-sorted there (each entry's rank is the number of staged entries that beat it); past
//! [`RANK_SORT_MAX`] staged entries, `need` rounds of block argmax run over them instead,
//! and if more than [`CANDIDATES`] pass (heavy ties) the rounds run over all entries in
//! global memory: slower, same answer.
//!
//! Every round takes the best entry ranking strictly after the previous round's winner
//! (higher logit, ties to the lower index), so nothing is written back and the result is
//! sorted; the order of the per-thread scans and of the warp combination does not matter
//! because the order is total (indices are distinct).

use crate::config::{GpuConfig, FILTER_THREADS};
use crate::ir::{Func, Value, Var, NEG_INF};
use crate::params::FILTER;
use flashsample_abi::{RowStatus, INDEX_NONE};
use flashsample_ir::MAX_LIST_CAPACITY;

pub(crate) const NAME: &str = "flashsample_filter";
const WARPS: u32 = FILTER_THREADS / 32;
/// Entries the merge may stage in shared memory (8 bytes each).
pub(crate) const CANDIDATES: u32 = 4096;
/// Staged candidates up to which the merge rank-sorts them (`cnt²` shared reads spread over
/// the CTA, no barriers); more run `need` rounds of block argmax over the staged entries.
const RANK_SORT_MAX: u32 = 2048;
// The head threshold's histograms have one bin per thread.
const _: () = assert!(FILTER_THREADS == 256);

/// Static shared memory: the sorted top list, the staged candidates, a double-buffered
/// per-warp reduction scratch (score, index, payload, pad), eight counters / flags, the
/// head threshold's 256-bin histogram and per-warp sums, and the survivors' `exp` terms.
pub(crate) fn shared_decls() -> String {
    format!(
        "@fs_filter_top = internal addrspace(3) global [{} x i64] undef, align 8\n\
         @fs_filter_cand = internal addrspace(3) global [{CANDIDATES} x i64] undef, align 8\n\
         @fs_filter_red = internal addrspace(3) global [{} x i32] undef, align 16\n\
         @fs_filter_misc = internal addrspace(3) global [8 x i32] undef, align 4\n\
         @fs_filter_hist = internal addrspace(3) global [256 x i32] undef, align 4\n\
         @fs_filter_wsum = internal addrspace(3) global [{WARPS} x i32] undef, align 4\n\
         @fs_filter_ex = internal addrspace(3) global [{} x float] undef, align 4\n\
         declare i32 @llvm.umin.i32(i32, i32)\n",
        MAX_LIST_CAPACITY,
        2 * WARPS * 4,
        MAX_LIST_CAPACITY
    )
}

struct Ctx {
    tid: String,
    warp: String,
    lane0: String,
    tid0: String,
    /// Which half of the reduction scratch the next block reduction uses.
    parity: Var,
}

fn misc(f: &mut Func, i: u32) -> String {
    f.v(format!("getelementptr i32, ptr addrspace(3) @fs_filter_misc, i32 {i}"))
}

/// Address of entry `e` (i32) of a shared `Scored` array.
fn shared_entry(f: &mut Func, array: &str, e: &str) -> String {
    f.v(format!("getelementptr i64, ptr addrspace(3) {array}, i32 {e}"))
}

fn load_shared_scored(f: &mut Func, array: &str, e: &str) -> (String, String) {
    let a = shared_entry(f, array, e);
    let x = f.v(format!("load float, ptr addrspace(3) {a}, align 8"));
    let a1 = f.v(format!("getelementptr i8, ptr addrspace(3) {a}, i32 4"));
    let i = f.v(format!("load i32, ptr addrspace(3) {a1}, align 4"));
    (x, i)
}

fn store_shared_scored(f: &mut Func, array: &str, e: &str, x: &str, i: &str) {
    let a = shared_entry(f, array, e);
    f.s(format!("store float {x}, ptr addrspace(3) {a}, align 8"));
    let a1 = f.v(format!("getelementptr i8, ptr addrspace(3) {a}, i32 4"));
    f.s(format!("store i32 {i}, ptr addrspace(3) {a1}, align 4"));
}

/// `Scored` at global element `e64` (i64) of `base`.
fn load_global_scored(f: &mut Func, base: &str, e64: &str) -> (String, String) {
    let a = f.gaddr_u(base, e64, 8);
    let x = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
    let a1 = f.v(format!("getelementptr i8, ptr addrspace(1) {a}, i64 4"));
    let i = f.v(format!("load i32, ptr addrspace(1) {a1}, align 4"));
    (x, i)
}

/// The CTA's best `(score, index, payload)` (higher score, ties to the lower index) over what
/// each thread's `scan` folds into its three variables (initially `(-inf, NONE, -inf)`).
/// Every thread gets the result. One barrier.
fn block_best(f: &mut Func, k: &Ctx, scan: impl FnOnce(&mut Func, &Var, &Var, &Var)) -> (String, String, String) {
    let none = (INDEX_NONE as i32).to_string();
    let bs = f.var_u("float", NEG_INF);
    let bi = f.var_u("i32", &none);
    let bp = f.var_u("float", NEG_INF);
    scan(f, &bs, &bi, &bp);
    let lane_best = (f.get_u(&bs), f.get_u(&bi), f.get_u(&bp));
    let (s, i, p) = f.shfl_best_u(lane_best, &[16, 8, 4, 2, 1]);
    let par = f.get_u(&k.parity);
    let half = f.mul_u(&par, &(WARPS * 4).to_string());
    let slot = |f: &mut Func, w: &str, field: u32| -> String {
        let w4 = f.v(format!("shl i32 {w}, 2"));
        let e = f.add_u(&half, &w4);
        let e = f.add_u(&e, &field.to_string());
        f.v(format!("getelementptr i32, ptr addrspace(3) @fs_filter_red, i32 {e}"))
    };
    f.if_then_u(&k.lane0, |f| {
        for (field, ty, v) in [(0, "float", &s), (1, "i32", &i), (2, "float", &p)] {
            let a = slot(f, &k.warp, field);
            f.s(format!("store {ty} {v}, ptr addrspace(3) {a}, align 4"));
        }
    });
    // The other half is written by the next reduction; the one after that (same half) comes
    // after the next reduction's barrier, which every thread passes only once done reading.
    f.barrier();
    let mut best = (NEG_INF.to_string(), none.clone(), NEG_INF.to_string());
    for w in 0..WARPS {
        let w = w.to_string();
        let a = slot(f, &w, 0);
        let ws = f.v(format!("load float, ptr addrspace(3) {a}, align 4"));
        let a = slot(f, &w, 1);
        let wi = f.v(format!("load i32, ptr addrspace(3) {a}, align 4"));
        let a = slot(f, &w, 2);
        let wp = f.v(format!("load float, ptr addrspace(3) {a}, align 4"));
        best = f.keep_best_u(best, (&ws, &wi, &wp));
    }
    let np = f.v(format!("xor i32 {par}, 1"));
    f.set_u(&k.parity, &np);
    best
}

/// Up to `count` rounds of block argmax over entries `0..n` (`load` gives an entry's logit
/// and index; `EMPTY` and `-inf` entries never win), each winner ranking strictly after the
/// previous one. `on_winner(k, x, i)` runs in every thread; returns how many were found and
/// the last winner.
fn select_rounds(
    f: &mut Func,
    k: &Ctx,
    count: &str,
    n: &str,
    load: &dyn Fn(&mut Func, &str) -> (String, String),
    on_winner: &dyn Fn(&mut Func, &str, &str, &str),
) -> (String, String, String) {
    let none = (INDEX_NONE as i32).to_string();
    let px = f.var_u("float", NEG_INF);
    let pi = f.var_u("i32", &none);
    let first = f.var_u("i1", "true");
    let found = f.var_u("i32", "0");
    let done = f.var_u("i1", "false");
    f.while_loop_u(
        |f| {
            let (kv, d) = (f.get_u(&found), f.get_u(&done));
            let more = f.ult_u(&kv, count);
            let live = f.v(format!("xor i1 {d}, true"));
            f.and1_u(&more, &live)
        },
        |f| {
            let (pxv, piv, fv) = (f.get_u(&px), f.get_u(&pi), f.get_u(&first));
            let (bx, bi, _) = block_best(f, k, |f, bs, bi, _| {
                f.for_loop_u(&k.tid, n, &FILTER_THREADS.to_string(), |f, e| {
                    let (x, i) = load(f, e);
                    let after = f.beats_u(&pxv, &piv, &x, &i);
                    let after = f.v(format!("or i1 {fv}, {after}"));
                    let live = f.v(format!("fcmp ogt float {x}, {NEG_INF}"));
                    let real = f.v(format!("icmp ne i32 {i}, {none}"));
                    let (s0, i0) = (f.get_u(bs), f.get_u(bi));
                    let better = f.beats_u(&x, &i, &s0, &i0);
                    let take = f.and1_u(&after, &live);
                    let take = f.and1_u(&take, &real);
                    let take = f.and1_u(&take, &better);
                    let ns = f.sel_u("float", &take, &x, &s0);
                    let ni = f.sel_u("i32", &take, &i, &i0);
                    f.set_u(bs, &ns);
                    f.set_u(bi, &ni);
                });
            });
            let empty = f.v(format!("icmp eq i32 {bi}, {none}"));
            f.if_else_u(
                &empty,
                |f| f.set_u(&done, "true"),
                |f| {
                    let kv = f.get_u(&found);
                    on_winner(f, &kv, &bx, &bi);
                    f.set_u(&px, &bx);
                    f.set_u(&pi, &bi);
                    f.set_u(&first, "false");
                    let nk = f.add_u(&kv, "1");
                    f.set_u(&found, &nk);
                },
            );
        },
    );
    (f.get_u(&found), f.get_u(&px), f.get_u(&pi))
}

/// A threshold for the merge from the tile heads, by a two-level radix select over their
/// order keys ([`Func::order_key`]): level one histograms key bits 31..24 of the live heads,
/// finds the bin holding the `need`-th largest key (from the top, by a block suffix scan),
/// level two does the same on bits 23..16 inside that bin. Returns `(on, t)`: `on` iff at
/// least `need` heads are live, and then `t` = (bin₁ << 24 | bin₂ << 16) with at least `need`
/// heads of key ≥ t, so the `need`-th best head has a key ≥ t, and so does every token of
/// the row's global top `need` (each ranks at or before that head). Entries with a key below
/// `t` can be dropped. It replaces `need` rounds of block argmax over the heads (each a pass
/// over global memory and a barrier) by two passes; the bins are 2^-7 of an octave wide, so
/// few more than `need` entries pass. Every thread gets the result (uniform).
fn head_threshold(f: &mut Func, k: &Ctx, need: &str, heads_load: &dyn Fn(&mut Func, &str) -> (String, String)) -> (String, String) {
    let threads = FILTER_THREADS.to_string();
    let hist = |f: &mut Func, bin: &str| f.v(format!("getelementptr i32, ptr addrspace(3) @fs_filter_hist, i32 {bin}"));
    let wsum = |f: &mut Func, w: &str| f.v(format!("getelementptr i32, ptr addrspace(3) @fs_filter_wsum, i32 {w}"));
    let lane = f.v(format!("and i32 {}, 31", k.tid));
    let prefix = f.var_u("i32", "0");
    let want = f.var_u("i32", need);
    let on = f.var_u("i1", "true");
    for level in 0..2u32 {
        let shift = 24 - 8 * level;
        let ha = hist(f, &k.tid);
        f.s(format!("store i32 0, ptr addrspace(3) {ha}, align 4"));
        f.barrier();
        let pre = f.get_u(&prefix);
        f.for_loop_u(&k.tid, "%tiles", &threads, |f, e| {
            let (x, _) = heads_load(f, e);
            let key = f.order_key_u(&x);
            let live = f.v(format!("icmp ne i32 {key}, 0"));
            let inside = if level == 0 {
                live
            } else {
                let hi = f.v(format!("lshr i32 {key}, {}", shift + 8));
                let same = f.v(format!("icmp eq i32 {hi}, {pre}"));
                f.and1_u(&live, &same)
            };
            f.if_then_u(&inside, |f| {
                let bin = f.v(format!("lshr i32 {key}, {shift}"));
                let bin = f.v(format!("and i32 {bin}, 255"));
                let a = hist(f, &bin);
                f.s(format!("atomicrmw add ptr addrspace(3) {a}, i32 1 monotonic"));
            });
        });
        f.barrier();
        // Thread t owns bin t: s = Σ hist[t..] over its warp's bins, then the higher warps.
        let h = f.v(format!("load i32, ptr addrspace(3) {ha}, align 4"));
        let mut sfx = h.clone();
        for d in [1u32, 2, 4, 8, 16] {
            let o = f.shfl_down_i32_u(&sfx, d);
            let l = f.add_u(&lane, &d.to_string());
            let inw = f.ult_u(&l, "32");
            let o = f.sel_u("i32", &inw, &o, "0");
            sfx = f.add_u(&sfx, &o);
        }
        let lane0 = f.v(format!("icmp eq i32 {lane}, 0"));
        f.if_then_u(&lane0, |f| {
            let a = wsum(f, &k.warp);
            f.s(format!("store i32 {sfx}, ptr addrspace(3) {a}, align 4"));
        });
        f.barrier();
        let (mut above, mut total) = ("0".to_string(), "0".to_string());
        for w in 0..WARPS {
            let a = wsum(f, &w.to_string());
            let ws = f.v(format!("load i32, ptr addrspace(3) {a}, align 4"));
            let hi = f.v(format!("icmp ugt i32 {w}, {}", k.warp));
            let add = f.sel_u("i32", &hi, &ws, "0");
            above = f.add_u(&above, &add);
            total = f.add_u(&total, &ws);
        }
        let s_t = f.add_u(&sfx, &above);
        let s_next = f.v(format!("sub i32 {s_t}, {h}"));
        let wv = f.get_u(&want);
        let reach = f.v(format!("icmp uge i32 {s_t}, {wv}"));
        let short = f.ult_u(&s_next, &wv);
        let pick = f.and1_u(&reach, &short);
        let (bin_a, above_a) = (misc(f, 4), misc(f, 5));
        f.if_then_u(&pick, |f| {
            f.s(format!("store i32 {}, ptr addrspace(3) {bin_a}, align 4", k.tid));
            f.s(format!("store i32 {s_next}, ptr addrspace(3) {above_a}, align 4"));
        });
        f.barrier();
        if level == 0 {
            // Fewer than `need` live heads: no threshold (and level two is moot).
            let enough = f.v(format!("icmp uge i32 {total}, {wv}"));
            f.set_u(&on, &enough);
        }
        let ov = f.get_u(&on);
        f.if_then_u(&ov, |f| {
            let bin = f.v(format!("load i32, ptr addrspace(3) {bin_a}, align 4"));
            let ab = f.v(format!("load i32, ptr addrspace(3) {above_a}, align 4"));
            let p0 = f.get_u(&prefix);
            let p1 = f.v(format!("shl i32 {p0}, 8"));
            let p1 = f.v(format!("or i32 {p1}, {bin}"));
            f.set_u(&prefix, &p1);
            let w1 = f.v(format!("sub i32 {wv}, {ab}"));
            f.set_u(&want, &w1);
        });
        // The next level rewrites hist / wsum / misc only after its first two barriers,
        // which every thread passes after these reads.
    }
    let p = f.get_u(&prefix);
    let t = f.v(format!("shl i32 {p}, 16"));
    (f.get_u(&on), t)
}

/// `abi::filter::survivors` in one thread over the shared top list of `found` entries:
/// returns `(k, error)`. The f32 steps and their order are the abi's.
fn survivors(f: &mut Func, found: &str, need: &str, filt: (&str, &str, &str)) -> (String, String) {
    let (top_k, top_p, min_p) = filt;
    let logit = |f: &mut Func, e: &str| load_shared_scored(f, "@fs_filter_top", e).0;
    let n = f.var_u("i32", found);
    let complete = f.ult_u(found, need);
    let bounded = f.var_u("i1", &complete);
    let err = f.var_u("i1", "false");
    // top_k > 0 && top_k <= n
    let nv = f.get_u(&n);
    let k_on = f.v(format!("icmp ne i32 {top_k}, 0"));
    let k_fits = f.v(format!("icmp ule i32 {top_k}, {nv}"));
    let k_use = f.and1_u(&k_on, &k_fits);
    f.if_then_u(&k_use, |f| {
        f.set_u(&n, top_k);
        f.set_u(&bounded, "true");
    });
    let mp_on = f.v(format!("fcmp ogt float {min_p}, 0.0"));
    f.if_then_u(&mp_on, |f| {
        let top0 = logit(f, "0");
        let ln = f.v(format!("call float @fs_ln_f32(float {min_p})"));
        let threshold = f.fadd_u(&top0, &ln);
        let passing = f.var_u("i32", "0");
        let nv = f.get_u(&n);
        let stop = f.var_u("i1", "false");
        f.while_loop_u(
            |f| {
                let pv = f.get_u(&passing);
                let more = f.ult_u(&pv, &nv);
                let st = f.get_u(&stop);
                let go = f.v(format!("xor i1 {st}, true"));
                f.and1_u(&more, &go)
            },
            |f| {
                let pv = f.get_u(&passing);
                let l = logit(f, &pv);
                let ok = f.v(format!("fcmp oge float {l}, {threshold}"));
                f.if_else_u(
                    &ok,
                    |f| {
                        let np = f.add_u(&pv, "1");
                        f.set_u(&passing, &np);
                    },
                    |f| f.set_u(&stop, "true"),
                );
            },
        );
        let pv = f.get_u(&passing);
        let b = f.get_u(&bounded);
        let all = f.v(format!("icmp eq i32 {pv}, {nv}"));
        let nb = f.v(format!("xor i1 {b}, true"));
        let bad = f.and1_u(&nb, &all);
        let e0 = f.get_u(&err);
        let e1 = f.v(format!("or i1 {e0}, {bad}"));
        f.set_u(&err, &e1);
        f.set_u(&n, &pv);
        f.set_u(&bounded, "true");
    });
    let tp_on = f.v(format!("fcmp olt float {top_p}, 1.0"));
    let b = f.get_u(&bounded);
    f.if_else_u(
        &tp_on,
        |f| {
            let nv = f.get_u(&n);
            // exp(top[i] − shift) was computed by the CTA (`exp_terms`), same f32 steps.
            let ex_at = |f: &mut Func, i: &str| {
                let a = f.v(format!("getelementptr float, ptr addrspace(3) @fs_filter_ex, i32 {i}"));
                f.v(format!("load float, ptr addrspace(3) {a}, align 4"))
            };
            let cut = f.var_u("float", top_p);
            f.if_then_u(&b, |f| {
                let total = f.var_u("float", "0.0");
                f.for_loop_u("0", &nv, "1", |f, i| {
                    let ex = ex_at(f, i);
                    let t0 = f.get_u(&total);
                    let t1 = f.fadd_u(&t0, &ex);
                    f.set_u(&total, &t1);
                });
                let t = f.get_u(&total);
                let c = f.fmul_u(top_p, &t);
                f.set_u(&cut, &c);
            });
            let cutv = f.get_u(&cut);
            let cum = f.var_u("float", "0.0");
            let kept = f.var_u("i32", "0");
            let stop = f.var_u("i1", "false");
            f.while_loop_u(
                |f| {
                    let kv = f.get_u(&kept);
                    let more = f.ult_u(&kv, &nv);
                    let st = f.get_u(&stop);
                    let go = f.v(format!("xor i1 {st}, true"));
                    f.and1_u(&more, &go)
                },
                |f| {
                    let kv = f.get_u(&kept);
                    let cv = f.get_u(&cum);
                    let some = f.v(format!("icmp ne i32 {kv}, 0"));
                    let reached = f.v(format!("fcmp oge float {cv}, {cutv}"));
                    let brk = f.and1_u(&some, &reached);
                    f.if_else_u(
                        &brk,
                        |f| f.set_u(&stop, "true"),
                        |f| {
                            let ex = ex_at(f, &kv);
                            let c1 = f.fadd_u(&cv, &ex);
                            f.set_u(&cum, &c1);
                            let k1 = f.add_u(&kv, "1");
                            f.set_u(&kept, &k1);
                        },
                    );
                },
            );
            let kv = f.get_u(&kept);
            let cv = f.get_u(&cum);
            let all = f.v(format!("icmp eq i32 {kv}, {nv}"));
            let short = f.v(format!("fcmp olt float {cv}, {top_p}"));
            let nb = f.v(format!("xor i1 {b}, true"));
            let bad = f.and1_u(&all, &short);
            let bad = f.and1_u(&bad, &nb);
            let e0 = f.get_u(&err);
            let e1 = f.v(format!("or i1 {e0}, {bad}"));
            f.set_u(&err, &e1);
            f.set_u(&n, &kv);
        },
        |f| {
            // A row whose filter is off never gets here (it keeps stage two's result).
            let nb = f.v(format!("xor i1 {b}, true"));
            let e0 = f.get_u(&err);
            let e1 = f.v(format!("or i1 {e0}, {nb}"));
            f.set_u(&err, &e1);
        },
    );
    (f.get_u(&n), f.get_u(&err))
}

/// The first `n` entries of `@fs_filter_top` (`found` of them real) as `out_top[row]`'s top-n
/// logprobs `(index, logit − lse)`, EMPTY past the row's eligible tokens; nothing when `n` is 0
/// or there is no `out_top`.
fn write_top_logprobs(f: &mut Func, k: &Ctx, row: &str, found: &str, lse: &str, n: &str) {
    let none = (INDEX_NONE as i32).to_string();
    let top_ok = f.v("icmp ne ptr addrspace(1) %out_top, null");
    let tn = f.v(format!("icmp ne i32 {n}, 0"));
    let top_ok = f.and1_u(&top_ok, &tn);
    f.if_then_u(&top_ok, |f| {
        f.for_loop_u(&k.tid, n, &FILTER_THREADS.to_string(), |f, i| {
            let have = f.ult_u(i, found);
            let (x, idx) = load_shared_scored(f, "@fs_filter_top", i);
            let lp = f.fsub_u(&x, lse);
            let lp = f.sel_u("float", &have, &lp, NEG_INF);
            let idx = f.sel_u("i32", &have, &idx, &none);
            let o = f.mul_u(row, "%top_n");
            let o = f.add_u(&o, i);
            let o64 = f.zext64_u(&o);
            let a = f.gaddr_u("%out_top", &o64, 8);
            f.s(format!("store float {lp}, ptr addrspace(1) {a}, align 4"));
            let a1 = f.v(format!("getelementptr i8, ptr addrspace(1) {a}, i64 4"));
            f.s(format!("store i32 {idx}, ptr addrspace(1) {a1}, align 4"));
        });
    });
}

/// DESIGN.md step 10, when `has_raw` and `out_top` (uniform): the row's raw lists merged to their first
/// `top_n`, written as top logprobs against the raw row logsumexp (`%raw_lse`, NaN when 0).
/// Returns whether the row may go on (i1): false when a raw list may have dropped a top
/// token, and the row's status is then `ListOverflow`. Ends with a barrier (the merge below
/// reuses the shared top list).
fn raw_top_logprobs(f: &mut Func, k: &Ctx, row: &str, r64: &str, status_addr: &str, has_raw: &str, vocab_tile: u32) -> String {
    let ok = f.var_u("i1", "true");
    let tn = f.v("icmp ne i32 %top_n, 0");
    let on = f.and1_u(has_raw, &tn);
    // Without an output for them the raw lists are not merged (nor can they overflow).
    let out = f.v("icmp ne ptr addrspace(1) %out_top, null");
    let on = f.and1_u(&on, &out);
    f.if_then_u(&on, |f| {
        let need = f.v(format!("call i32 @llvm.umin.i32(i32 %top_n, i32 {MAX_LIST_CAPACITY})"));
        let (found, overflow) = merge_lists(f, k, "%raw_lists", r64, &need, vocab_tile);
        f.if_else_u(
            &overflow,
            |f| {
                f.set_u(&ok, "false");
                let t0 = k.tid0.clone();
                f.if_then_u(&t0, |f| f.s(format!("store i32 {}, ptr addrspace(1) {status_addr}, align 4", RowStatus::ListOverflow.code())));
            },
            |f| {
                let lse = row_f32_or_nan(f, "%raw_lse", r64);
                write_top_logprobs(f, k, row, &found, &lse, "%top_n");
            },
        );
        f.barrier();
    });
    f.get_u(&ok)
}

/// `ptr[row]` of an optional `f32 [B]` parameter (a row logsumexp), NaN when `ptr` is 0.
/// Row `r64`'s `abi::RowFilter` (`top_k` u32, `top_p` f32, `min_p` f32: 12 bytes) from
/// `%filters`: the one reader of that layout every kernel with filters calls.
pub(crate) fn load_row_filter(f: &mut Func, r64: &str) -> (String, String, String) {
    let a = f.gaddr_u("%filters", r64, 12);
    let top_k = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
    let a1 = f.v(format!("getelementptr i8, ptr addrspace(1) {a}, i64 4"));
    let top_p = f.v(format!("load float, ptr addrspace(1) {a1}, align 4"));
    let a2 = f.v(format!("getelementptr i8, ptr addrspace(1) {a}, i64 8"));
    let min_p = f.v(format!("load float, ptr addrspace(1) {a2}, align 4"));
    (top_k, top_p, min_p)
}

fn row_f32_or_nan(f: &mut Func, ptr: &str, r64: &str) -> String {
    let out = f.var_u("float", "0x7FF8000000000000");
    let has = f.v(format!("icmp ne ptr addrspace(1) {ptr}, null"));
    f.if_then_u(&has, |f| {
        let a = f.gaddr_u(ptr, r64, 4);
        let v = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
        f.set_u(&out, &v);
    });
    f.get_u(&out)
}

/// `abi::filter::merge_row` of the row's `lists` (a `Scored [B, tiles, per_tile]` parameter):
/// the sorted best `need_r` into `@fs_filter_top`, how many were found, and whether a list
/// may have dropped one of them (i1; `ListError::Overflow`). Uniform over the CTA.
fn merge_lists(f: &mut Func, k: &Ctx, lists: &str, r64: &str, need_r: &str, vocab_tile: u32) -> (String, String) {
    let none = (INDEX_NONE as i32).to_string();
    let threads = FILTER_THREADS.to_string();
    let len = f.mul_u("%tiles", "%per_tile");
    let len64 = f.zext64_u(&len);
    let rbase = f.v(format!("mul i64 {r64}, {len64}"));
    let per_tile64 = f.zext64_u("%per_tile");
    let heads_load = |f: &mut Func, e: &str| {
        let e64 = f.zext64_u(e);
        let off = f.v(format!("mul i64 {e64}, {per_tile64}"));
        let off = f.v(format!("add i64 {rbase}, {off}"));
        load_global_scored(f, lists, &off)
    };
    let all_load = |f: &mut Func, e: &str| {
        let e64 = f.zext64_u(e);
        let off = f.v(format!("add i64 {rbase}, {e64}"));
        load_global_scored(f, lists, &off)
    };
    // Threshold from the tile heads (see the module docs); none when too few.
    let tau_key = f.var_u("i32", "0");
    let tau_on = f.var_u("i1", "false");
    let enough = f.v(format!("icmp uge i32 %tiles, {need_r}"));
    f.if_then_u(&enough, |f| {
        let (on, key) = head_threshold(f, k, need_r, &heads_load);
        f.set_u(&tau_on, &on);
        f.set_u(&tau_key, &key);
    });
    let (tkey, ton) = (f.get_u(&tau_key), f.get_u(&tau_on));
    let cnt_a = misc(f, 0);
    let ovf_a = misc(f, 1);
    f.if_then_u(&k.tid0, |f| {
        f.s(format!("store i32 0, ptr addrspace(3) {cnt_a}, align 4"));
        f.s(format!("store i32 0, ptr addrspace(3) {ovf_a}, align 4"));
    });
    f.barrier();
    f.for_loop_u(&k.tid, &len, &threads, |f, e| {
        let (x, i) = all_load(f, e);
        let real = f.v(format!("icmp ne i32 {i}, {none}"));
        // 0 unless x > -inf.
        let key = f.order_key_u(&x);
        let live = f.v(format!("icmp ne i32 {key}, 0"));
        let below = f.ult_u(&key, &tkey);
        let below = f.and1_u(&ton, &below);
        let within = f.v(format!("xor i1 {below}, true"));
        let keep = f.and1_u(&real, &live);
        let keep = f.and1_u(&keep, &within);
        f.if_then_u(&keep, |f| {
            let pos = f.v(format!("atomicrmw add ptr addrspace(3) {cnt_a}, i32 1 monotonic"));
            let fits = f.ult_u(&pos, &CANDIDATES.to_string());
            f.if_then_u(&fits, |f| store_shared_scored(f, "@fs_filter_cand", &pos, &x, &i));
        });
    });
    f.barrier();
    let cnt = f.v(format!("load i32, ptr addrspace(3) {cnt_a}, align 4"));
    let staged = f.v(format!("icmp ule i32 {cnt}, {CANDIDATES}"));
    let few = f.v(format!("icmp ule i32 {cnt}, {RANK_SORT_MAX}"));
    let write_top = |f: &mut Func, kk: &str, x: &str, i: &str| {
        let t0 = k.tid0.clone();
        f.if_then_u(&t0, |f| store_shared_scored(f, "@fs_filter_top", kk, x, i));
    };
    let found = f.var_u("i32", "0");
    let cand_load = |f: &mut Func, e: &str| load_shared_scored(f, "@fs_filter_cand", e);
    f.if_else_u(
        &few,
        |f| {
            // Rank sort: entry e goes to top[rank(e)], rank = how many staged
            // entries beat it. The order is total (distinct indices), so the
            // ranks are distinct and top[..min(cnt, need)] is the sorted best.
            f.for_loop_u(&k.tid, &cnt, &threads, |f, e| {
                let (x, i) = cand_load(f, e);
                let rank = f.var_u("i32", "0");
                f.for_loop_u("0", &cnt, "1", |f, j| {
                    let (xj, ij) = cand_load(f, j);
                    let b = f.beats_u(&xj, &ij, &x, &i);
                    let b = f.v(format!("zext i1 {b} to i32"));
                    let r0 = f.get_u(&rank);
                    let r1 = f.add_u(&r0, &b);
                    f.set_u(&rank, &r1);
                });
                let r = f.get_u(&rank);
                let in_top = f.ult_u(&r, need_r);
                f.if_then_u(&in_top, |f| store_shared_scored(f, "@fs_filter_top", &r, &x, &i));
            });
            let n = f.v(format!("call i32 @llvm.umin.i32(i32 {cnt}, i32 {need_r})"));
            f.set_u(&found, &n);
        },
        |f| {
            f.if_else_u(
                &staged,
                |f| {
                    let (n, _, _) = select_rounds(f, k, need_r, &cnt, &cand_load, &write_top);
                    f.set_u(&found, &n);
                },
                |f| {
                    let (n, _, _) = select_rounds(f, k, need_r, &len, &all_load, &write_top);
                    f.set_u(&found, &n);
                },
            );
        },
    );
    // The top list's writes are read below.
    f.barrier();
    let found = f.get_u(&found);

    // merge_row's overflow test: a tile whose last entry ranks before the
    // `need`-th selected token may have dropped one. Lists that hold whole tiles
    // (per_tile >= vocab_tile) cannot have dropped anything.
    let short = f.ult_u("%per_tile", need_r);
    let partial = f.ult_u("%per_tile", &vocab_tile.to_string());
    let filled = f.v(format!("icmp eq i32 {found}, {need_r}"));
    let check = f.and1_u(&short, &partial);
    let check = f.and1_u(&check, &filled);
    f.if_then_u(&check, |f| {
        let lastk = f.add_u(need_r, "-1");
        let (lx, li) = load_shared_scored(f, "@fs_filter_top", &lastk);
        let pt1 = f.add_u("%per_tile", "-1");
        f.for_loop_u(&k.tid, "%tiles", &threads, |f, t| {
            let e = f.mul_u(t, "%per_tile");
            let e = f.add_u(&e, &pt1);
            let (x, i) = all_load(f, &e);
            let real = f.v(format!("icmp ne i32 {i}, {none}"));
            let before = f.beats_u(&x, &i, &lx, &li);
            let bad = f.and1_u(&real, &before);
            f.if_then_u(&bad, |f| f.s(format!("store i32 1, ptr addrspace(3) {ovf_a}, align 4")));
        });
    });
    f.barrier();
    let ovf = f.v(format!("load i32, ptr addrspace(3) {ovf_a}, align 4"));
    let overflow = f.v(format!("icmp ne i32 {ovf}, 0"));
    (found, overflow)
}

pub(crate) fn emit(c: &GpuConfig) -> String {
    let mut f = Func::new();
    let row = f.sreg_u("ctaid.x");
    let tid = f.sreg_u("tid.x");
    let warp = f.v(format!("lshr i32 {tid}, 5"));
    let lane = f.v(format!("and i32 {tid}, 31"));
    let lane0 = f.v(format!("icmp eq i32 {lane}, 0"));
    let tid0 = f.v(format!("icmp eq i32 {tid}, 0"));
    let parity = f.var_u("i32", "0");
    let k = Ctx { tid, warp, lane0, tid0, parity };
    let vocab_tile = c.vocab_tile;

    let in_batch = f.ult_u(&row, "%batch");
    f.if_then_u(&in_batch, |f| {
        let r64 = f.zext64_u(&row);
        let sa = f.gaddr_u("%out_status", &r64, 4);
        let st = f.v(format!("load i32, ptr addrspace(1) {sa}, align 4"));
        let ok = f.v(format!("icmp eq i32 {st}, {}", RowStatus::Ok.code()));
        // Rows stage two failed keep their status; everything below is uniform over the CTA.
        f.if_then_u(&ok, |f| {
            let greedy = f.var_u("i1", "false");
            let has_greedy = f.v("icmp ne ptr addrspace(1) %greedy, null");
            f.if_then_u(&has_greedy, |f| {
                let a = f.gaddr_u("%greedy", &r64, 4);
                let g = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
                let g = f.v(format!("icmp ne i32 {g}, 0"));
                f.set_u(&greedy, &g);
            });
            let top_k = f.var_u("i32", "0");
            let top_p = f.var_u("float", "1.0");
            let min_p = f.var_u("float", "0.0");
            let has_filters = f.v("icmp ne ptr addrspace(1) %filters, null");
            f.if_then_u(&has_filters, |f| {
                let (tk, tp, mp) = load_row_filter(f, &r64);
                f.set_u(&top_k, &tk);
                f.set_u(&top_p, &tp);
                f.set_u(&min_p, &mp);
            });
            let (tk, tp, mp) = (f.get_u(&top_k), f.get_u(&top_p), f.get_u(&min_p));
            // RowFilter::is_off: top_k == 0 && top_p >= 1 && min_p <= 0.
            let k_off = f.v(format!("icmp eq i32 {tk}, 0"));
            let p_off = f.v(format!("fcmp oge float {tp}, 1.0"));
            let m_off = f.v(format!("fcmp ole float {mp}, 0.0"));
            let off = f.and1_u(&k_off, &p_off);
            let off = f.and1_u(&off, &m_off);
            let g = f.get_u(&greedy);
            let skip = f.v(format!("or i1 {off}, {g}"));
            let filtered = f.v(format!("xor i1 {skip}, true"));
            // DESIGN.md step 10: raw top logprobs come from the raw lists, merged first; the
            // processed lists then serve the filter alone.
            let has_raw = f.v("icmp ne ptr addrspace(1) %raw_lists, null");
            let raw_ok = raw_top_logprobs(f, &k, &row, &r64, sa.text(), &has_raw, vocab_tile);
            let top_n = f.sel_u("i32", &has_raw, "0", "%top_n");
            let need_r = f.sel_u("i32", &filtered, "%need", &top_n);
            let need_r = f.v(format!(
                "call i32 @llvm.umin.i32(i32 {need_r}, i32 {})",
                MAX_LIST_CAPACITY
            ));
            let any = f.v(format!("icmp ne i32 {need_r}, 0"));
            let any = f.and1_u(&any, &raw_ok);
            f.if_then_u(&any, |f| {
                let (found, overflow) = merge_lists(f, &k, "%lists", &r64, &need_r, vocab_tile);
                f.if_else_u(
                    &overflow,
                    |f| {
                        let t0 = k.tid0.clone();
                        f.if_then_u(&t0, |f| f.s(format!("store i32 {}, ptr addrspace(1) {sa}, align 4", RowStatus::ListOverflow.code())));
                    },
                    |f| {
                        // lse = 0 (a launch without the logsumexp, CodegenOptions::
                        // skip_logsumexp): NaN. The runtime passes 0 only when no row reads it
                        // (no top logprobs, no lone top-p); a stray read poisons, never faults.
                        let lse = row_f32_or_nan(f, "%lse", &r64);
                        write_top_logprobs(f, &k, &row, &found, &lse, &top_n);
                        f.if_then_u(&filtered, |f| draw_filtered(f, &k, &row, &r64, sa.text(), &found, (&tk, &tp, &mp), &lse));
                    },
                );
            });
        });
    });
    f.s("ret void");
    f.finish(&FILTER.llvm_header(NAME, &format!("\"nvvm.maxntid\"=\"{FILTER_THREADS}\"")))
}

/// The top-p terms `exp_f32(top[i] − shift)` for `i < found`, one per thread, into
/// `@fs_filter_ex`: `survivors` sums them in list order in one thread (the abi's sequential
/// f32 sums), so only the `exp`s, which are independent, run in parallel. `shift` is
/// `survivors`' choice: `top[0]` when the candidate set is bounded (complete lists, a
/// top-k that fits, or min-p), else the row's logsumexp. Ends with a barrier.
fn exp_terms(f: &mut Func, k: &Ctx, found: &str, need: &str, filt: (&str, &str, &str), lse: &str) {
    let (top_k, _, min_p) = filt;
    let complete = f.ult_u(found, need);
    let k_on = f.v(format!("icmp ne i32 {top_k}, 0"));
    let k_fits = f.v(format!("icmp ule i32 {top_k}, {found}"));
    let k_use = f.and1_u(&k_on, &k_fits);
    let mp_on = f.v(format!("fcmp ogt float {min_p}, 0.0"));
    let b = f.v(format!("or i1 {complete}, {k_use}"));
    let b = f.v(format!("or i1 {b}, {mp_on}"));
    let (top0, _) = load_shared_scored(f, "@fs_filter_top", "0");
    let shift = f.sel_u("float", &b, &top0, lse);
    f.for_loop_u(&k.tid, found, &FILTER_THREADS.to_string(), |f, i| {
        let (l, _) = load_shared_scored(f, "@fs_filter_top", i);
        let d = f.fsub_u(&l, &shift);
        let ex = f.v(format!("call float @fs_exp_f32(float {d})"));
        let a = f.v(format!("getelementptr float, ptr addrspace(3) @fs_filter_ex, i32 {i}"));
        f.s(format!("store float {ex}, ptr addrspace(3) {a}, align 4"));
    });
    f.barrier();
}

/// Survivors (thread 0, broadcast through shared memory), then per sample the Gumbel-max
/// draw over them (`abi::filter::draw`), overwriting stage two's outputs.
#[allow(clippy::too_many_arguments)]
fn draw_filtered(
    f: &mut Func,
    k: &Ctx,
    row: &str,
    r64: &str,
    status_addr: &str,
    found: &str,
    filt: (&str, &str, &str),
    lse: &str,
) {
    let none = (INDEX_NONE as i32).to_string();
    let kept_a = misc(f, 2);
    let err_a = misc(f, 3);
    exp_terms(f, k, found, "%need", filt, lse);
    let t0 = k.tid0.clone();
    f.if_then_u(&t0, |f| {
        let (n, err) = survivors(f, found, "%need", filt);
        let e = f.v(format!("zext i1 {err} to i32"));
        f.s(format!("store i32 {n}, ptr addrspace(3) {kept_a}, align 4"));
        f.s(format!("store i32 {e}, ptr addrspace(3) {err_a}, align 4"));
    });
    f.barrier();
    let kept = f.v(format!("load i32, ptr addrspace(3) {kept_a}, align 4"));
    let err = f.v(format!("load i32, ptr addrspace(3) {err_a}, align 4"));
    let bad = f.v(format!("icmp ne i32 {err}, 0"));
    f.if_else_u(
        &bad,
        |f| {
            let t0 = k.tid0.clone();
            f.if_then_u(&t0, |f| f.s(format!("store i32 {}, ptr addrspace(1) {status_addr}, align 4", RowStatus::NucleusTooLarge.code())));
        },
        |f| {
            // SamplingParams::row_stream: (row_seeds[r], 0) or (seed, r).
            let has_rs = f.v("icmp ne ptr addrspace(1) %row_seeds, null");
            let (key_lo, key_hi, ctr_row) = crate::math::row_stream_u(f, &has_rs, row, r64);
            let word3 = crate::math::token_word3_u(f, r64);
            f.for_loop_u("0", "%samples", "1", |f, s| {
                let (bs, bi, bl) = block_best(f, k, |f, vs, vi, vp| {
                    f.for_loop_u(&k.tid, &kept, &FILTER_THREADS.to_string(), |f, e| {
                        let (x, i) = load_shared_scored(f, "@fs_filter_top", e);
                        let g = f.add_u(&i, "%vocab_offset");
                        let bits = crate::math::token_bits_u(f, &g, &ctr_row, s, &word3, (&key_lo, &key_hi));
                        let gum = f.v(format!("call float @fs_gumbel_f32(i32 {bits})"));
                        let score = f.fadd_u(&x, &gum);
                        let (s0, i0, p0) = (f.get_u(vs), f.get_u(vi), f.get_u(vp));
                        let take = f.beats_u(&score, &i, &s0, &i0);
                        let ns = f.sel_u("float", &take, &score, &s0);
                        let ni = f.sel_u("i32", &take, &i, &i0);
                        let np = f.sel_u("float", &take, &x, &p0);
                        f.set_u(vs, &ns);
                        f.set_u(vi, &ni);
                        f.set_u(vp, &np);
                    });
                });
                let bl = drawn_raw_logit(f, k, r64, &bi, &bl);
                let t0 = k.tid0.clone();
                let real = f.v(format!("icmp ne i32 {bi}, {none}"));
                let w = f.and1_u(&t0, &real);
                f.if_then_u(&w, |f| {
                    let o = f.mul_u(row, "%samples");
                    let o = f.add_u(&o, s);
                    let o64 = f.zext64_u(&o);
                    for (ptr, ty, v) in [("%out_tokens", "i32", &bi), ("%out_scores", "float", &bs), ("%out_logits", "float", &bl)] {
                        let a = f.gaddr_u(ptr, &o64, 4);
                        f.s(format!("store {ty} {v}, ptr addrspace(1) {a}, align 4"));
                    }
                });
            });
        },
    );
}

/// DESIGN.md step 10 (`abi::raw::raw_logit_of`): with `%list_raws`, the raw logit stored beside
/// the drawn `token`'s entry in the row's processed lists (one entry holds it; NaN if none
/// does), else `logit`. `token` is uniform (a [`block_best`] result), so are the barriers.
fn drawn_raw_logit(f: &mut Func, k: &Ctx, r64: &str, token: &str, logit: &str) -> String {
    let out = f.var_u("float", logit);
    let has = f.v("icmp ne ptr addrspace(1) %list_raws, null");
    f.if_then_u(&has, |f| {
        let slot = misc(f, 4);
        let t0 = k.tid0.clone();
        f.if_then_u(&t0, |f| f.s(format!("store float 0x7FF8000000000000, ptr addrspace(3) {slot}, align 4")));
        f.barrier();
        let len = f.mul_u("%tiles", "%per_tile");
        let len64 = f.zext64_u(&len);
        let rbase = f.v(format!("mul i64 {r64}, {len64}"));
        f.for_loop_u(&k.tid, &len, &FILTER_THREADS.to_string(), |f, e| {
            let e64 = f.zext64_u(e);
            let off = f.v(format!("add i64 {rbase}, {e64}"));
            let (_, i) = load_global_scored(f, "%lists", &off);
            let hit = f.v(format!("icmp eq i32 {i}, {token}"));
            f.if_then_u(&hit, |f| {
                let a = f.gaddr_u("%list_raws", &off, 4);
                let r = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
                f.s(format!("store float {r}, ptr addrspace(3) {slot}, align 4"));
            });
        });
        f.barrier();
        let r = f.v(format!("load float, ptr addrspace(3) {slot}, align 4"));
        f.set_u(&out, &r);
        // The next sample rewrites the slot.
        f.barrier();
    });
    f.get_u(&out)
}
