//! The stage-three kernel `flashsample_filter` (DESIGN.md step 9): one CTA of
//! [`FILTER_THREADS`] per batch row merges the row's per-tile lists into its global top
//! `need`, detects lists that were too short (`RowStatus::ListOverflow`), applies the row's
//! `RowFilter` in one thread with exactly `abi::filter::survivors`' f32 steps
//! (`RowStatus::NucleusTooLarge` when the nucleus does not fit), draws each sample by Gumbel-max over the survivors with stage one's noise, and writes
//! the top-n logprobs. In the raw logprob mode (DESIGN.md step 10) the top logprobs come from
//! the raw lists, merged first, and a drawn token reports the raw logit stored beside its entry.
//! As a launch's last stage it also finishes every row's samples (`glue::finish_sample`), in
//! place of `flashsample_finalize`.
//!
//! Merge: the top `need` of `tiles · per_tile` sorted entries. Selecting them by `need`
//! rounds of block argmax over all entries costs `need · tiles · per_tile` reads, so first a
//! threshold is found: when at least `need` tiles have a live first entry, a two-level radix
//! select over the heads' order keys (`head_threshold`) gives a key `t` with at least `need`
//! heads at or above it, so the `need`-th best head, and with it every token of the row's
//! global top `need`, has a key ≥ `t`. Only entries with a key ≥ `t` are copied to shared
//! memory (each thread loading [`STAGE_UNROLL`] entries before their atomics; typically a
//! little more than `need` of them pass, at most [`CANDIDATES`] are kept) and
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
use crate::entries::{beats, Candidate, CandidateVar, Scored, SCORED_BYTES, SCORED_INDEX};
use crate::glue::finish_row;
use crate::ir::{f32c, i32c, Atomic, Fcmp, Func, Global, Icmp, Ptr, Shared, Var, F32, I1, I32, I64};
use crate::math;
use crate::params::{arg, FILTER};
use flashsample_abi::{RowStatus, INDEX_NONE};
use flashsample_ir::MAX_LIST_CAPACITY;
use std::mem::{offset_of, size_of};

pub(crate) const NAME: &str = "flashsample_filter";
const WARPS: u32 = FILTER_THREADS / 32;
/// Entries the merge may stage in shared memory (8 bytes each).
pub(crate) const CANDIDATES: u32 = 4096;
/// Staged candidates up to which the merge rank-sorts them (`cnt²` shared reads spread over
/// the CTA, no barriers); more run `need` rounds of block argmax over the staged entries.
const RANK_SORT_MAX: u32 = 2048;
/// Entries each thread loads per step of the merge's staging pass (before their atomics).
const STAGE_UNROLL: u32 = 4;
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

/// The shared arrays [`shared_decls`] declares.
const TOP: Ptr<Shared> = Ptr::named("@fs_filter_top");
const CAND: Ptr<Shared> = Ptr::named("@fs_filter_cand");
const RED: Ptr<Shared> = Ptr::named("@fs_filter_red");
const MISC: Ptr<Shared> = Ptr::named("@fs_filter_misc");
const HIST: Ptr<Shared> = Ptr::named("@fs_filter_hist");
const WSUM: Ptr<Shared> = Ptr::named("@fs_filter_wsum");
const EX: Ptr<Shared> = Ptr::named("@fs_filter_ex");

struct Ctx {
    tid: I32,
    warp: I32,
    lane0: I1,
    tid0: I1,
    /// Which half of the reduction scratch the next block reduction uses.
    parity: Var<I32>,
}

fn misc(f: &mut Func, i: u32) -> Ptr<Shared> {
    f.element::<_, I32>(&MISC, &i32c(i))
}

/// Address of entry `e` of a shared `Scored` array.
fn shared_entry(f: &mut Func, array: &Ptr<Shared>, e: &I32) -> Ptr<Shared> {
    f.element::<_, I64>(array, e)
}

fn load_shared_scored(f: &mut Func, array: &Ptr<Shared>, e: &I32) -> Scored {
    let a = shared_entry(f, array, e);
    let logit = f.load(&a, 8);
    let a1 = f.offset(&a, SCORED_INDEX);
    let index = f.load(&a1, 4);
    Scored { logit, index }
}

fn store_shared_scored(f: &mut Func, array: &Ptr<Shared>, e: &I32, entry: &Scored) {
    let a = shared_entry(f, array, e);
    f.store(&entry.logit, &a, 8);
    let a1 = f.offset(&a, SCORED_INDEX);
    f.store(&entry.index, &a1, 4);
}

/// `Scored` at global element `e64` of `base`.
fn load_global_scored(f: &mut Func, base: &Ptr<Global>, e64: &I64) -> Scored {
    let a = f.gaddr(base, e64, SCORED_BYTES);
    Scored::load(f, &a)
}

/// The CTA's best `(score, index, payload)` (higher score, ties to the lower index) over what
/// each thread's `scan` folds into its three variables (initially `(-inf, NONE, -inf)`).
/// Every thread gets the result. One barrier.
fn block_best(f: &mut Func, k: &Ctx, scan: impl FnOnce(&mut Func, &CandidateVar)) -> Candidate {
    let best = CandidateVar::new(f, &Candidate::none());
    scan(f, &best);
    let lane_best = best.get(f);
    let warp_best = lane_best.shfl_best(f, &[16, 8, 4, 2, 1]);
    let par = f.get(&k.parity);
    let half = f.mul(&par, &i32c(WARPS * 4));
    let slot = |f: &mut Func, w: &I32, field: u32| -> Ptr<Shared> {
        let w4 = f.shl(w, &i32c(2));
        let e = f.add(&half, &w4);
        let e = f.add(&e, &i32c(field));
        f.element::<_, I32>(&RED, &e)
    };
    f.if_then(&k.lane0, |f| {
        let a = slot(f, &k.warp, 0);
        f.store(&warp_best.score, &a, 4);
        let a = slot(f, &k.warp, 1);
        f.store(&warp_best.index, &a, 4);
        let a = slot(f, &k.warp, 2);
        f.store(&warp_best.logit, &a, 4);
    });
    // The other half is written by the next reduction; the one after that (same half) comes
    // after the next reduction's barrier, which every thread passes only once done reading.
    f.barrier();
    let mut best = Candidate::none();
    for w in 0..WARPS {
        let w = i32c(w);
        let a = slot(f, &w, 0);
        let score = f.load(&a, 4);
        let a = slot(f, &w, 1);
        let index = f.load(&a, 4);
        let a = slot(f, &w, 2);
        let logit = f.load(&a, 4);
        best = best.keep_best(f, &Candidate { score, index, logit });
    }
    let np = f.xor(&par, &i32c(1));
    f.set(&k.parity, &np);
    best
}

/// Up to `count` rounds of block argmax over entries `0..n` (`load` gives an entry's logit
/// and index; `EMPTY` and `-inf` entries never win), each winner ranking strictly after the
/// previous one. `on_winner(k, x, i)` runs in every thread; returns how many were found and
/// the last winner.
fn select_rounds(
    f: &mut Func,
    k: &Ctx,
    count: &I32,
    n: &I32,
    load: &dyn Fn(&mut Func, &I32) -> Scored,
    on_winner: &dyn Fn(&mut Func, &I32, &Scored),
) -> (I32, Scored) {
    let none = i32c(INDEX_NONE as i32);
    let px = f.var(&F32::NEG_INF);
    let pi = f.var(&none);
    let first = f.var(&I1::TRUE);
    let found = f.var(&i32c(0));
    let done = f.var(&I1::FALSE);
    f.while_loop(
        |f| {
            let (kv, d) = (f.get(&found), f.get(&done));
            let more = f.icmp(Icmp::Ult, &kv, count);
            let live = f.not(&d);
            f.and(&more, &live)
        },
        |f| {
            let (pxv, piv, fv) = (f.get(&px), f.get(&pi), f.get(&first));
            let winner = block_best(f, k, |f, best| {
                f.for_loop(&k.tid, n, &i32c(FILTER_THREADS), |f, e| {
                    let Scored { logit: x, index: i } = load(f, e);
                    let after = beats(f, &pxv, &piv, &x, &i);
                    let after = f.or(&fv, &after);
                    let live = f.fcmp(Fcmp::Ogt, &x, &F32::NEG_INF);
                    let real = f.icmp(Icmp::Ne, &i, &none);
                    let (s0, i0) = (f.get(&best.score), f.get(&best.index));
                    let better = beats(f, &x, &i, &s0, &i0);
                    let take = f.and(&after, &live);
                    let take = f.and(&take, &real);
                    let take = f.and(&take, &better);
                    let ns = f.sel(&take, &x, &s0);
                    let ni = f.sel(&take, &i, &i0);
                    f.set(&best.score, &ns);
                    f.set(&best.index, &ni);
                });
            });
            let empty = f.icmp(Icmp::Eq, &winner.index, &none);
            f.if_else(
                &empty,
                |f| f.set(&done, &I1::TRUE),
                |f| {
                    let kv = f.get(&found);
                    on_winner(f, &kv, &Scored { logit: winner.score.clone(), index: winner.index.clone() });
                    f.set(&px, &winner.score);
                    f.set(&pi, &winner.index);
                    f.set(&first, &I1::FALSE);
                    let nk = f.add(&kv, &i32c(1));
                    f.set(&found, &nk);
                },
            );
        },
    );
    let found = f.get(&found);
    (found, Scored { logit: f.get(&px), index: f.get(&pi) })
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
fn head_threshold(f: &mut Func, k: &Ctx, need: &I32, heads_load: &dyn Fn(&mut Func, &I32) -> Scored) -> (I1, I32) {
    let threads = i32c(FILTER_THREADS);
    let hist = |f: &mut Func, bin: &I32| f.element::<_, I32>(&HIST, bin);
    let wsum = |f: &mut Func, w: &I32| f.element::<_, I32>(&WSUM, w);
    let lane = f.and(&k.tid, &i32c(31));
    let prefix = f.var(&i32c(0));
    let want = f.var(need);
    let on = f.var(&I1::TRUE);
    for level in 0..2u32 {
        let shift = 24 - 8 * level;
        let ha = hist(f, &k.tid);
        f.store(&i32c(0), &ha, 4);
        f.barrier();
        let pre = f.get(&prefix);
        f.for_loop(&k.tid, &arg::TILES, &threads, |f, e| {
            let x = heads_load(f, e).logit;
            let key = f.order_key(&x);
            let live = f.icmp(Icmp::Ne, &key, &i32c(0));
            let inside = if level == 0 {
                live
            } else {
                let hi = f.lshr(&key, &i32c(shift + 8));
                let same = f.icmp(Icmp::Eq, &hi, &pre);
                f.and(&live, &same)
            };
            f.if_then(&inside, |f| {
                let bin = f.lshr(&key, &i32c(shift));
                let bin = f.and(&bin, &i32c(255));
                let a = hist(f, &bin);
                f.atomic_update(Atomic::Add, &a, &i32c(1), None);
            });
        });
        f.barrier();
        // Thread t owns bin t: s = Σ hist[t..] over its warp's bins, then the higher warps.
        let h: I32 = f.load(&ha, 4);
        let mut sfx = h.clone();
        for d in [1u32, 2, 4, 8, 16] {
            let o = f.shfl_down(&sfx, d);
            let l = f.add(&lane, &i32c(d));
            let inw = f.icmp(Icmp::Ult, &l, &i32c(32));
            let o = f.sel(&inw, &o, &i32c(0));
            sfx = f.add(&sfx, &o);
        }
        let lane0 = f.icmp(Icmp::Eq, &lane, &i32c(0));
        f.if_then(&lane0, |f| {
            let a = wsum(f, &k.warp);
            f.store(&sfx, &a, 4);
        });
        f.barrier();
        let (mut above, mut total) = (i32c(0), i32c(0));
        for w in 0..WARPS {
            let a = wsum(f, &i32c(w));
            let ws: I32 = f.load(&a, 4);
            let hi = f.icmp(Icmp::Ugt, &i32c(w), &k.warp);
            let add = f.sel(&hi, &ws, &i32c(0));
            above = f.add(&above, &add);
            total = f.add(&total, &ws);
        }
        let s_t = f.add(&sfx, &above);
        let s_next = f.sub(&s_t, &h);
        let wv = f.get(&want);
        let reach = f.icmp(Icmp::Uge, &s_t, &wv);
        let short = f.icmp(Icmp::Ult, &s_next, &wv);
        let pick = f.and(&reach, &short);
        let (bin_a, above_a) = (misc(f, 4), misc(f, 5));
        f.if_then(&pick, |f| {
            f.store(&k.tid, &bin_a, 4);
            f.store(&s_next, &above_a, 4);
        });
        f.barrier();
        if level == 0 {
            // Fewer than `need` live heads: no threshold (and level two is moot).
            let enough = f.icmp(Icmp::Uge, &total, &wv);
            f.set(&on, &enough);
        }
        let ov = f.get(&on);
        f.if_then(&ov, |f| {
            let bin = f.load(&bin_a, 4);
            let ab = f.load(&above_a, 4);
            let p0 = f.get(&prefix);
            let p1 = f.shl(&p0, &i32c(8));
            let p1 = f.or(&p1, &bin);
            f.set(&prefix, &p1);
            let w1 = f.sub(&wv, &ab);
            f.set(&want, &w1);
        });
        // The next level rewrites hist / wsum / misc only after its first two barriers,
        // which every thread passes after these reads.
    }
    let p = f.get(&prefix);
    let t = f.shl(&p, &i32c(16));
    (f.get(&on), t)
}

/// `abi::filter::survivors` in one thread over the shared top list of `found` entries:
/// returns `(k, error)`. The f32 steps and their order are the abi's.
fn survivors(f: &mut Func, found: &I32, need: &I32, filt: &RowFilter) -> (I32, I1) {
    let logit = |f: &mut Func, e: &I32| load_shared_scored(f, &TOP, e).logit;
    let n = f.var(found);
    let complete = f.icmp(Icmp::Ult, found, need);
    let bounded = f.var(&complete);
    let err = f.var(&I1::FALSE);
    // top_k > 0 && top_k <= n
    let nv = f.get(&n);
    let k_on = f.icmp(Icmp::Ne, &filt.top_k, &i32c(0));
    let k_fits = f.icmp(Icmp::Ule, &filt.top_k, &nv);
    let k_use = f.and(&k_on, &k_fits);
    f.if_then(&k_use, |f| {
        f.set(&n, &filt.top_k);
        f.set(&bounded, &I1::TRUE);
    });
    let mp_on = f.fcmp(Fcmp::Ogt, &filt.min_p, &F32::ZERO);
    f.if_then(&mp_on, |f| {
        let top0 = logit(f, &i32c(0));
        let ln = math::ln(f, &filt.min_p);
        let threshold = f.fadd(&top0, &ln);
        let passing = f.var(&i32c(0));
        let nv = f.get(&n);
        let stop = f.var(&I1::FALSE);
        f.while_loop(
            |f| {
                let pv = f.get(&passing);
                let more = f.icmp(Icmp::Ult, &pv, &nv);
                let st = f.get(&stop);
                let go = f.not(&st);
                f.and(&more, &go)
            },
            |f| {
                let pv = f.get(&passing);
                let l = logit(f, &pv);
                let ok = f.fcmp(Fcmp::Oge, &l, &threshold);
                f.if_else(
                    &ok,
                    |f| {
                        let np = f.add(&pv, &i32c(1));
                        f.set(&passing, &np);
                    },
                    |f| f.set(&stop, &I1::TRUE),
                );
            },
        );
        let pv = f.get(&passing);
        let b = f.get(&bounded);
        let all = f.icmp(Icmp::Eq, &pv, &nv);
        let nb = f.not(&b);
        let bad = f.and(&nb, &all);
        let e0 = f.get(&err);
        let e1 = f.or(&e0, &bad);
        f.set(&err, &e1);
        f.set(&n, &pv);
        f.set(&bounded, &I1::TRUE);
    });
    let tp_on = f.fcmp(Fcmp::Olt, &filt.top_p, &F32::ONE);
    let b = f.get(&bounded);
    f.if_else(
        &tp_on,
        |f| {
            let nv = f.get(&n);
            // exp(top[i] − shift) was computed by the CTA (`exp_terms`), same f32 steps.
            let ex_at = |f: &mut Func, i: &I32| -> F32 {
                let a = f.element::<_, F32>(&EX, i);
                f.load(&a, 4)
            };
            let cut = f.var(&filt.top_p);
            f.if_then(&b, |f| {
                let total = f.var(&F32::ZERO);
                f.for_loop(&i32c(0), &nv, &i32c(1), |f, i| {
                    let ex = ex_at(f, i);
                    let t0 = f.get(&total);
                    let t1 = f.fadd(&t0, &ex);
                    f.set(&total, &t1);
                });
                let t = f.get(&total);
                let c = f.fmul(&filt.top_p, &t);
                f.set(&cut, &c);
            });
            let cutv = f.get(&cut);
            let cum = f.var(&F32::ZERO);
            let kept = f.var(&i32c(0));
            let stop = f.var(&I1::FALSE);
            f.while_loop(
                |f| {
                    let kv = f.get(&kept);
                    let more = f.icmp(Icmp::Ult, &kv, &nv);
                    let st = f.get(&stop);
                    let go = f.not(&st);
                    f.and(&more, &go)
                },
                |f| {
                    let kv = f.get(&kept);
                    let cv = f.get(&cum);
                    let some = f.icmp(Icmp::Ne, &kv, &i32c(0));
                    let reached = f.fcmp(Fcmp::Oge, &cv, &cutv);
                    let brk = f.and(&some, &reached);
                    f.if_else(
                        &brk,
                        |f| f.set(&stop, &I1::TRUE),
                        |f| {
                            let ex = ex_at(f, &kv);
                            let c1 = f.fadd(&cv, &ex);
                            f.set(&cum, &c1);
                            let k1 = f.add(&kv, &i32c(1));
                            f.set(&kept, &k1);
                        },
                    );
                },
            );
            let kv = f.get(&kept);
            let cv = f.get(&cum);
            let all = f.icmp(Icmp::Eq, &kv, &nv);
            let short = f.fcmp(Fcmp::Olt, &cv, &filt.top_p);
            let nb = f.not(&b);
            let bad = f.and(&all, &short);
            let bad = f.and(&bad, &nb);
            let e0 = f.get(&err);
            let e1 = f.or(&e0, &bad);
            f.set(&err, &e1);
            f.set(&n, &kv);
        },
        |f| {
            // A row whose filter is off never gets here (it keeps stage two's result).
            let nb = f.not(&b);
            let e0 = f.get(&err);
            let e1 = f.or(&e0, &nb);
            f.set(&err, &e1);
        },
    );
    (f.get(&n), f.get(&err))
}

/// The first `n` entries of `@fs_filter_top` (`found` of them real) as `out_top[row]`'s top-n
/// logprobs `(index, logit − lse)`, EMPTY past the row's eligible tokens; nothing when `n` is 0
/// or there is no `out_top`.
fn write_top_logprobs(f: &mut Func, k: &Ctx, row: &I32, found: &I32, lse: &F32, n: &I32) {
    let none = i32c(INDEX_NONE as i32);
    let top_ok = f.non_null(&arg::OUT_TOP);
    let tn = f.icmp(Icmp::Ne, n, &i32c(0));
    let top_ok = f.and(&top_ok, &tn);
    f.if_then(&top_ok, |f| {
        f.for_loop(&k.tid, n, &i32c(FILTER_THREADS), |f, i| {
            let have = f.icmp(Icmp::Ult, i, found);
            let entry = load_shared_scored(f, &TOP, i);
            let lp = f.fsub(&entry.logit, lse);
            let logit = f.sel(&have, &lp, &F32::NEG_INF);
            let index = f.sel(&have, &entry.index, &none);
            let o = f.mul(row, &arg::TOP_N);
            let o = f.add(&o, i);
            let o64 = f.zext(&o);
            let a = f.gaddr(&arg::OUT_TOP, &o64, SCORED_BYTES);
            Scored { logit, index }.store(f, &a);
        });
    });
}

/// DESIGN.md step 10, when `has_raw` and `out_top` (uniform): the row's raw lists merged to their first
/// `top_n`, written as top logprobs against the raw row logsumexp (`%raw_lse`, NaN when 0).
/// Returns whether the row may go on (i1): false when a raw list may have dropped a top
/// token, and the row's status is then `ListOverflow`. Ends with a barrier (the merge below
/// reuses the shared top list).
fn raw_top_logprobs(f: &mut Func, k: &Ctx, row: &I32, r64: &I64, status_addr: &Ptr<Global>, has_raw: &I1, vocab_tile: u32) -> I1 {
    let ok = f.var(&I1::TRUE);
    let tn = f.icmp(Icmp::Ne, &arg::TOP_N, &i32c(0));
    let on = f.and(has_raw, &tn);
    // Without an output for them the raw lists are not merged (nor can they overflow).
    let out = f.non_null(&arg::OUT_TOP);
    let on = f.and(&on, &out);
    f.if_then(&on, |f| {
        let need = f.umin(&arg::TOP_N, &i32c(MAX_LIST_CAPACITY));
        let (found, overflow) = merge_lists(f, k, &arg::RAW_LISTS, r64, &need, vocab_tile);
        f.if_else(
            &overflow,
            |f| {
                f.set(&ok, &I1::FALSE);
                f.if_then(&k.tid0, |f| f.store(&i32c(RowStatus::ListOverflow.code()), status_addr, 4));
            },
            |f| {
                let lse = row_f32_or_nan(f, &arg::RAW_LSE, r64);
                write_top_logprobs(f, k, row, &found, &lse, &arg::TOP_N);
            },
        );
        f.barrier();
    });
    f.get(&ok)
}

/// A row's `abi::RowFilter` as values.
pub(crate) struct RowFilter {
    pub(crate) top_k: I32,
    pub(crate) top_p: F32,
    pub(crate) min_p: F32,
}

/// `abi::RowFilter`'s size and its fields' offsets (`top_k` first).
const ROW_FILTER_BYTES: u32 = size_of::<flashsample_abi::RowFilter>() as u32;
const ROW_FILTER_TOP_P: u32 = offset_of!(flashsample_abi::RowFilter, top_p) as u32;
const ROW_FILTER_MIN_P: u32 = offset_of!(flashsample_abi::RowFilter, min_p) as u32;
const _: () = assert!(offset_of!(flashsample_abi::RowFilter, top_k) == 0);

/// Row `r64`'s `abi::RowFilter` from `%filters`: the one reader of that layout every kernel
/// with filters calls.
pub(crate) fn load_row_filter(f: &mut Func, r64: &I64) -> RowFilter {
    let a = f.gaddr(&arg::FILTERS, r64, ROW_FILTER_BYTES);
    let top_k = f.load(&a, 4);
    let a1 = f.offset(&a, ROW_FILTER_TOP_P);
    let top_p = f.load(&a1, 4);
    let a2 = f.offset(&a, ROW_FILTER_MIN_P);
    let min_p = f.load(&a2, 4);
    RowFilter { top_k, top_p, min_p }
}

/// Row `r64`'s filter, or `RowFilter::OFF`'s fields where the launch has none (`%filters` 0).
pub(crate) fn row_filter_or_off(f: &mut Func, r64: &I64) -> RowFilter {
    let top_k = f.var(&i32c(0));
    let top_p = f.var(&F32::ONE);
    let min_p = f.var(&F32::ZERO);
    let has_filters = f.non_null(&arg::FILTERS);
    f.if_then(&has_filters, |f| {
        let rf = load_row_filter(f, r64);
        f.set(&top_k, &rf.top_k);
        f.set(&top_p, &rf.top_p);
        f.set(&min_p, &rf.min_p);
    });
    RowFilter { top_k: f.get(&top_k), top_p: f.get(&top_p), min_p: f.get(&min_p) }
}

/// `abi::RowFilter::is_drawn_in_stage_three`: a row that is not `greedy` and whose filter is
/// not `RowFilter::is_off` (`top_k == 0 && top_p >= 1 && min_p <= 0`).
pub(crate) fn drawn_in_stage_three(f: &mut Func, rf: &RowFilter, greedy: &I1) -> I1 {
    let k_off = f.icmp(Icmp::Eq, &rf.top_k, &i32c(0));
    let p_off = f.fcmp(Fcmp::Oge, &rf.top_p, &F32::ONE);
    let m_off = f.fcmp(Fcmp::Ole, &rf.min_p, &F32::ZERO);
    let off = f.and(&k_off, &p_off);
    let off = f.and(&off, &m_off);
    let skip = f.or(&off, greedy);
    f.not(&skip)
}

/// `abi::RowFilter::may_outgrow_lists`: no top-k, and a top-p below 1 or a min-p above 0.
pub(crate) fn may_outgrow_lists(f: &mut Func, rf: &RowFilter) -> I1 {
    let no_k = f.icmp(Icmp::Eq, &rf.top_k, &i32c(0));
    let p_on = f.fcmp(Fcmp::Olt, &rf.top_p, &f32c(1.0));
    let mp_on = f.fcmp(Fcmp::Ogt, &rf.min_p, &F32::ZERO);
    let cut = f.or(&p_on, &mp_on);
    f.and(&no_k, &cut)
}

/// `ptr[row]` of an optional `f32 [B]` parameter (a row logsumexp), NaN when `ptr` is 0.
fn row_f32_or_nan(f: &mut Func, ptr: &Ptr<Global>, r64: &I64) -> F32 {
    let out = f.var(&F32::NAN);
    let has = f.non_null(ptr);
    f.if_then(&has, |f| {
        let a = f.gaddr(ptr, r64, 4);
        let v = f.load(&a, 4);
        f.set(&out, &v);
    });
    f.get(&out)
}

/// `abi::filter::merge_row` of the row's `lists` (a `Scored [B, tiles, per_tile]` parameter):
/// the sorted best `need_r` into `@fs_filter_top`, how many were found, and whether a list
/// may have dropped one of them (i1; `ListError::Overflow`). Uniform over the CTA.
fn merge_lists(f: &mut Func, k: &Ctx, lists: &Ptr<Global>, r64: &I64, need_r: &I32, vocab_tile: u32) -> (I32, I1) {
    let none = i32c(INDEX_NONE as i32);
    let threads = i32c(FILTER_THREADS);
    let len = f.mul(&arg::TILES, &arg::PER_TILE);
    let len64 = f.zext(&len);
    let rbase = f.mul(r64, &len64);
    let per_tile64: I64 = f.zext(&arg::PER_TILE);
    let heads_load = |f: &mut Func, e: &I32| {
        let e64: I64 = f.zext(e);
        let off = f.mul(&e64, &per_tile64);
        let off = f.add(&rbase, &off);
        load_global_scored(f, lists, &off)
    };
    let all_load = |f: &mut Func, e: &I32| {
        let e64 = f.zext(e);
        let off = f.add(&rbase, &e64);
        load_global_scored(f, lists, &off)
    };
    // Threshold from the tile heads (see the module docs); none when too few.
    let tau_key = f.var(&i32c(0));
    let tau_on = f.var(&I1::FALSE);
    let enough = f.icmp(Icmp::Uge, &arg::TILES, need_r);
    f.if_then(&enough, |f| {
        let (on, key) = head_threshold(f, k, need_r, &heads_load);
        f.set(&tau_on, &on);
        f.set(&tau_key, &key);
    });
    let (tkey, ton) = (f.get(&tau_key), f.get(&tau_on));
    let cnt_a = misc(f, 0);
    let ovf_a = misc(f, 1);
    f.if_then(&k.tid0, |f| {
        f.store(&i32c(0), &cnt_a, 4);
        f.store(&i32c(0), &ovf_a, 4);
    });
    f.barrier();
    // Each step issues STAGE_UNROLL loads before any atomic: a load after the previous
    // entry's shared atomic would wait out its own latency alone, and a row's lists are
    // tiles · per_tile entries (thousands), so the staging is latency-bound, not bandwidth-bound.
    // Past the row's end a lane reloads the row's last entry (in bounds) and drops it.
    let last = f.sub(&len, &i32c(1));
    let step = i32c(FILTER_THREADS * STAGE_UNROLL);
    f.for_loop(&k.tid, &len, &step, |f, e| {
        let loaded: Vec<(Scored, I1)> = (0..STAGE_UNROLL)
            .map(|u| {
                let at = f.add(e, &i32c(u * FILTER_THREADS));
                let inside = f.icmp(Icmp::Ult, &at, &len);
                let at = f.umin(&at, &last);
                (all_load(f, &at), inside)
            })
            .collect();
        for (entry, inside) in &loaded {
            let real = f.icmp(Icmp::Ne, &entry.index, &none);
            // 0 unless x > -inf.
            let key = f.order_key(&entry.logit);
            let live = f.icmp(Icmp::Ne, &key, &i32c(0));
            let below = f.icmp(Icmp::Ult, &key, &tkey);
            let below = f.and(&ton, &below);
            let within = f.not(&below);
            let keep = f.and(&real, &live);
            let keep = f.and(&keep, &within);
            let keep = f.and(&keep, inside);
            f.if_then(&keep, |f| {
                let pos = f.atomic(Atomic::Add, &cnt_a, &i32c(1), None);
                let fits = f.icmp(Icmp::Ult, &pos, &i32c(CANDIDATES));
                f.if_then(&fits, |f| store_shared_scored(f, &CAND, &pos, entry));
            });
        }
    });
    f.barrier();
    let cnt: I32 = f.load(&cnt_a, 4);
    let staged = f.icmp(Icmp::Ule, &cnt, &i32c(CANDIDATES));
    let few = f.icmp(Icmp::Ule, &cnt, &i32c(RANK_SORT_MAX));
    let write_top = |f: &mut Func, kk: &I32, entry: &Scored| {
        f.if_then(&k.tid0, |f| store_shared_scored(f, &TOP, kk, entry));
    };
    let found = f.var(&i32c(0));
    let cand_load = |f: &mut Func, e: &I32| load_shared_scored(f, &CAND, e);
    f.if_else(
        &few,
        |f| {
            // Rank sort: entry e goes to top[rank(e)], rank = how many staged
            // entries beat it. The order is total (distinct indices), so the
            // ranks are distinct and top[..min(cnt, need)] is the sorted best.
            f.for_loop(&k.tid, &cnt, &threads, |f, e| {
                let entry = cand_load(f, e);
                let rank = f.var(&i32c(0));
                f.for_loop(&i32c(0), &cnt, &i32c(1), |f, j| {
                    let other = cand_load(f, j);
                    let b = beats(f, &other.logit, &other.index, &entry.logit, &entry.index);
                    let b = f.zext(&b);
                    let r0 = f.get(&rank);
                    let r1 = f.add(&r0, &b);
                    f.set(&rank, &r1);
                });
                let r = f.get(&rank);
                let in_top = f.icmp(Icmp::Ult, &r, need_r);
                f.if_then(&in_top, |f| store_shared_scored(f, &TOP, &r, &entry));
            });
            let n = f.umin(&cnt, need_r);
            f.set(&found, &n);
        },
        |f| {
            f.if_else(
                &staged,
                |f| {
                    let (n, _) = select_rounds(f, k, need_r, &cnt, &cand_load, &write_top);
                    f.set(&found, &n);
                },
                |f| {
                    let (n, _) = select_rounds(f, k, need_r, &len, &all_load, &write_top);
                    f.set(&found, &n);
                },
            );
        },
    );
    // The top list's writes are read below.
    f.barrier();
    let found = f.get(&found);

    // merge_row's overflow test: a full list (its last slot real) whose last entry ranks
    // before the last selected token, or any full list when fewer than `need` were found,
    // may have dropped one. Lists that hold whole tiles (per_tile >= vocab_tile) cannot have
    // dropped anything.
    let short = f.icmp(Icmp::Ult, &arg::PER_TILE, need_r);
    let partial = f.icmp(Icmp::Ult, &arg::PER_TILE, &i32c(vocab_tile));
    let any = f.icmp(Icmp::Ne, &found, &i32c(0));
    let lacking = f.icmp(Icmp::Ult, &found, need_r);
    let check = f.and(&short, &partial);
    let check = f.and(&check, &any);
    f.if_then(&check, |f| {
        let lastk = f.add(&found, &i32c(-1));
        let last = load_shared_scored(f, &TOP, &lastk);
        let pt1 = f.add(&arg::PER_TILE, &i32c(-1));
        f.for_loop(&k.tid, &arg::TILES, &threads, |f, t| {
            let e = f.mul(t, &arg::PER_TILE);
            let e = f.add(&e, &pt1);
            let entry = all_load(f, &e);
            let real = f.icmp(Icmp::Ne, &entry.index, &none);
            let before = beats(f, &entry.logit, &entry.index, &last.logit, &last.index);
            let before = f.or(&before, &lacking);
            let bad = f.and(&real, &before);
            f.if_then(&bad, |f| f.store(&i32c(1), &ovf_a, 4));
        });
    });
    f.barrier();
    let ovf = f.load(&ovf_a, 4);
    let overflow = f.icmp(Icmp::Ne, &ovf, &i32c(0));
    (found, overflow)
}

pub(crate) fn emit(c: &GpuConfig) -> String {
    let mut f = Func::new();
    let row = f.sreg("ctaid.x");
    let tid = f.sreg("tid.x");
    let warp = f.lshr(&tid, &i32c(5));
    let lane = f.and(&tid, &i32c(31));
    let lane0 = f.icmp(Icmp::Eq, &lane, &i32c(0));
    let tid0 = f.icmp(Icmp::Eq, &tid, &i32c(0));
    let parity = f.var(&i32c(0));
    let k = Ctx { tid, warp, lane0, tid0, parity };
    let vocab_tile = c.vocab_tile;

    let in_batch = f.icmp(Icmp::Ult, &row, &arg::BATCH);
    f.if_then(&in_batch, |f| {
        let r64 = f.zext(&row);
        // A verifying launch's survivors start as none (`FilterArgs::kept`); `draw_filtered`
        // writes them over this entry (thread 0 writes both, in order).
        let has_kept = f.non_null(&arg::KEPT);
        let mark = f.and(&has_kept, &k.tid0);
        f.if_then(&mark, |f| {
            let at = kept_slot(f, &r64, &i32c(0));
            store_empty(f, &at);
        });
        let sa = f.gaddr(&arg::OUT_STATUS, &r64, 4);
        let st: I32 = f.load(&sa, 4);
        let ok = f.icmp(Icmp::Eq, &st, &i32c(RowStatus::Ok.code()));
        // Rows stage two failed keep their status; everything below is uniform over the CTA.
        f.if_then(&ok, |f| {
            // A greedy row (temperature 0, or a greedy pipeline) takes its lists' best.
            let all_greedy = f.icmp(Icmp::Ne, &arg::ALL_GREEDY, &i32c(0));
            let greedy = f.var(&all_greedy);
            let has_temps = f.non_null(&arg::TEMPERATURES);
            f.if_then(&has_temps, |f| {
                let a = f.gaddr(&arg::TEMPERATURES, &r64, 4);
                let t: F32 = f.load(&a, 4);
                let zero = f.fcmp(Fcmp::Oeq, &t, &F32::ZERO);
                let g = f.get(&greedy);
                let g = f.or(&g, &zero);
                f.set(&greedy, &g);
            });
            let filt = row_filter_or_off(f, &r64);
            let g = f.get(&greedy);
            let filtered = drawn_in_stage_three(f, &filt, &g);
            // DESIGN.md step 10: raw top logprobs come from the raw lists, merged first; the
            // processed lists then serve the filter alone.
            let has_raw = f.non_null(&arg::RAW_LISTS);
            let raw_ok = raw_top_logprobs(f, &k, &row, &r64, &sa, &has_raw, vocab_tile);
            let top_n = f.sel(&has_raw, &i32c(0), &arg::TOP_N);
            // abi::filter::row_need: a drawn row's top-k (capped by NEED) when it has one,
            // else NEED; at least the top logprobs.
            let k_on = f.icmp(Icmp::Ne, &filt.top_k, &i32c(0));
            let k_need = f.umin(&filt.top_k, &arg::NEED);
            let filter_need = f.sel(&k_on, &k_need, &arg::NEED);
            let filter_need = f.sel(&filtered, &filter_need, &i32c(0));
            let need_r = f.umax(&filter_need, &top_n);
            let need_r = f.umin(&need_r, &i32c(MAX_LIST_CAPACITY));
            let any = f.icmp(Icmp::Ne, &need_r, &i32c(0));
            let any = f.and(&any, &raw_ok);
            f.if_then(&any, |f| {
                let (found, overflow) = merge_lists(f, &k, &arg::LISTS, &r64, &need_r, vocab_tile);
                f.if_else(
                    &overflow,
                    |f| f.if_then(&k.tid0, |f| f.store(&i32c(RowStatus::ListOverflow.code()), &sa, 4)),
                    |f| {
                        // lse = 0 (a launch without the logsumexp, CodegenOptions::
                        // skip_logsumexp): NaN. The runtime passes 0 only when no row reads it
                        // (no top logprobs, no lone top-p); a stray read poisons, never faults.
                        let lse = row_f32_or_nan(f, &arg::LSE, &r64);
                        write_top_logprobs(f, &k, &row, &found, &lse, &top_n);
                        f.if_then(&filtered, |f| draw_filtered(f, &k, &row, &r64, &sa, &found, &need_r, &filt, &lse));
                    },
                );
            });
        });

        // The launch's last stage finishes the row (`FilterArgs::finish`), once every thread's
        // writes of its samples and status are visible to thread 0 (the barrier is uniform:
        // the whole CTA has one row).
        let finish = f.icmp(Icmp::Ne, &arg::FINISH, &i32c(0));
        f.if_then(&finish, |f| {
            f.barrier();
            f.if_then(&k.tid0, |f| {
                let st: I32 = f.load(&sa, 4);
                let failed = f.icmp(Icmp::Ne, &st, &i32c(RowStatus::Ok.code()));
                let has_raw = f.non_null(&arg::RAW_LSE);
                let reported = f.sel(&has_raw, &arg::RAW_LSE, &arg::LSE);
                finish_row(f, &row, &failed, &reported);
            });
        });
    });
    f.ret_void();
    f.finish(&FILTER.llvm_header(NAME, &format!("\"nvvm.maxntid\"=\"{FILTER_THREADS}\"")))
}

/// The top-p terms `exp_f32(top[i] − shift)` for `i < found`, one per thread, into
/// `@fs_filter_ex`: `survivors` sums them in list order in one thread (the abi's sequential
/// f32 sums), so only the `exp`s, which are independent, run in parallel. `shift` is
/// `survivors`' choice: `top[0]` when the candidate set is bounded (complete lists, a
/// top-k that fits, or min-p), else the row's logsumexp. Ends with a barrier.
fn exp_terms(f: &mut Func, k: &Ctx, found: &I32, need: &I32, filt: &RowFilter, lse: &F32) {
    let complete = f.icmp(Icmp::Ult, found, need);
    let k_on = f.icmp(Icmp::Ne, &filt.top_k, &i32c(0));
    let k_fits = f.icmp(Icmp::Ule, &filt.top_k, found);
    let k_use = f.and(&k_on, &k_fits);
    let mp_on = f.fcmp(Fcmp::Ogt, &filt.min_p, &F32::ZERO);
    let b = f.or(&complete, &k_use);
    let b = f.or(&b, &mp_on);
    let top0 = load_shared_scored(f, &TOP, &i32c(0)).logit;
    let shift = f.sel(&b, &top0, lse);
    f.for_loop(&k.tid, found, &i32c(FILTER_THREADS), |f, i| {
        let l = load_shared_scored(f, &TOP, i).logit;
        let d = f.fsub(&l, &shift);
        let ex = math::exp(f, &d);
        let a = f.element::<_, F32>(&EX, i);
        f.store(&ex, &a, 4);
    });
    f.barrier();
}

/// Survivors (thread 0, broadcast through shared memory), then per sample the Gumbel-max
/// draw over them (`abi::filter::draw`), overwriting stage two's outputs. `found` of the
/// row's `need` (`abi::filter::row_need`) were merged.
#[allow(clippy::too_many_arguments)]
fn draw_filtered(f: &mut Func, k: &Ctx, row: &I32, r64: &I64, status_addr: &Ptr<Global>, found: &I32, need: &I32, filt: &RowFilter, lse: &F32) {
    let none = i32c(INDEX_NONE as i32);
    let kept_a = misc(f, 2);
    let err_a = misc(f, 3);
    exp_terms(f, k, found, need, filt, lse);
    f.if_then(&k.tid0, |f| {
        let (n, err) = survivors(f, found, need, filt);
        let e: I32 = f.zext(&err);
        f.store(&n, &kept_a, 4);
        f.store(&e, &err_a, 4);
    });
    f.barrier();
    let kept = f.load(&kept_a, 4);
    let err = f.load(&err_a, 4);
    let bad = f.icmp(Icmp::Ne, &err, &i32c(0));
    f.if_else(
        &bad,
        |f| f.if_then(&k.tid0, |f| f.store(&i32c(RowStatus::NucleusTooLarge.code()), status_addr, 4)),
        |f| {
            write_kept(f, k, r64, &kept);
            // SamplingParams::row_stream: (row_seeds[r], 0) or (seed, r).
            let has_rs = f.non_null(&arg::ROW_SEEDS);
            let stream = math::row_stream(f, &has_rs, row, r64);
            let word3 = math::token_word3(f, r64);
            f.for_loop(&i32c(0), &arg::SAMPLES, &i32c(1), |f, s| {
                let best = block_best(f, k, |f, best| {
                    f.for_loop(&k.tid, &kept, &i32c(FILTER_THREADS), |f, e| {
                        let entry = load_shared_scored(f, &TOP, e);
                        let g = f.add(&entry.index, &arg::VOCAB_OFFSET);
                        let bits = math::token_bits(f, &g, &stream, s, &word3);
                        let gum = math::gumbel(f, &bits);
                        let score = f.fadd(&entry.logit, &gum);
                        let cur = best.get(f);
                        let next = cur.keep_best(f, &Candidate { score, index: entry.index, logit: entry.logit });
                        best.set(f, &next);
                    });
                });
                let logit = drawn_raw_logit(f, k, r64, &best.index, &best.logit);
                let real = f.icmp(Icmp::Ne, &best.index, &none);
                let w = f.and(&k.tid0, &real);
                f.if_then(&w, |f| {
                    let o = f.mul(row, &arg::SAMPLES);
                    let o = f.add(&o, s);
                    let o64 = f.zext(&o);
                    Candidate { logit, ..best.clone() }.store_sample(f, &o64);
                });
            });
        },
    );
}

/// Entry `e` of row `r64`'s survivors in `%kept` (`[B, need]`).
fn kept_slot(f: &mut Func, r64: &I64, e: &I32) -> Ptr<Global> {
    let need64: I64 = f.zext(&arg::NEED);
    let base = f.mul(r64, &need64);
    let e64 = f.zext(e);
    let at = f.add(&base, &e64);
    f.gaddr(&arg::KEPT, &at, SCORED_BYTES)
}

/// `Scored::EMPTY` at `at`: no survivor (an unused entry, or a row without any when first).
fn store_empty(f: &mut Func, at: &Ptr<Global>) {
    Scored { logit: F32::NEG_INF, index: i32c(INDEX_NONE as i32) }.store(f, at);
}

/// With `%kept` (a verifying launch): the row's `kept` survivors, the first entries of the
/// shared top list, then `Scored::EMPTY` to `need`, for the decision (`FilterArgs::kept`).
fn write_kept(f: &mut Func, k: &Ctx, r64: &I64, kept: &I32) {
    let has_kept = f.non_null(&arg::KEPT);
    f.if_then(&has_kept, |f| {
        f.for_loop(&k.tid, &arg::NEED, &i32c(FILTER_THREADS), |f, e| {
            let at = kept_slot(f, r64, e);
            let live = f.icmp(Icmp::Ult, e, kept);
            f.if_else(
                &live,
                |f| {
                    let entry = load_shared_scored(f, &TOP, e);
                    entry.store(f, &at);
                },
                |f| store_empty(f, &at),
            );
        });
    });
}

/// DESIGN.md step 10 (`abi::raw::raw_logit_of`): with `%list_raws`, the raw logit stored beside
/// the drawn `token`'s entry in the row's processed lists (one entry holds it; NaN if none
/// does), else `logit`. `token` is uniform (a [`block_best`] result), so are the barriers.
fn drawn_raw_logit(f: &mut Func, k: &Ctx, r64: &I64, token: &I32, logit: &F32) -> F32 {
    let out = f.var(logit);
    let has = f.non_null(&arg::LIST_RAWS);
    f.if_then(&has, |f| {
        let slot = misc(f, 4);
        f.if_then(&k.tid0, |f| f.store(&F32::NAN, &slot, 4));
        f.barrier();
        let len = f.mul(&arg::TILES, &arg::PER_TILE);
        let len64 = f.zext(&len);
        let rbase = f.mul(r64, &len64);
        f.for_loop(&k.tid, &len, &i32c(FILTER_THREADS), |f, e| {
            let e64 = f.zext(e);
            let off = f.add(&rbase, &e64);
            let entry = load_global_scored(f, &arg::LISTS, &off);
            let hit = f.icmp(Icmp::Eq, &entry.index, token);
            f.if_then(&hit, |f| {
                let a = f.gaddr(&arg::LIST_RAWS, &off, 4);
                let r: F32 = f.load(&a, 4);
                f.store(&r, &slot, 4);
            });
        });
        f.barrier();
        let r = f.load(&slot, 4);
        f.set(&out, &r);
        // The next sample rewrites the slot.
        f.barrier();
    });
    f.get(&out)
}

