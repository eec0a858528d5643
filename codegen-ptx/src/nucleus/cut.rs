//! `flashsample_nucleus_cut` (one CTA per picked row): `abi::filter::survivors` over the row's
//! sorted eligible tokens with `complete = true`, the same f32 steps in the same order.
//!
//! - `n`: the eligible tokens (live keys sort first; a dead key is all ones), then top-k.
//! - min-p: a binary search for the last entry with `x ≥ x₀ + ln_f32(min_p)` (sorted, so
//!   the passing entries are a prefix).
//! - top-p in `BlockedMass`'s order: the masses `exp_f32(x − x₀)` in parallel; one thread per
//!   1024-entry block sums its block in order from `+0`; one thread adds the full blocks'
//!   sums in order (each block's `done`) and forms `total` and `cut = top_p · total`; then
//!   each block thread finds its first entry whose prefix `done + block` reaches the cut. The
//!   smallest such count is `k` (else `n`): the abi's sequential loop, bit for bit.

use super::{decode_key, pick_count, picked_row, row_elem, MAX_MASS_BLOCKS, NUCLEUS_CUT_THREADS};
use crate::filter::load_row_filter;
use crate::ir::{i32c, Atomic, Fcmp, Func, Global, Icmp, Ptr, Shared, F32, I1, I32, I64};
use crate::math;
use crate::params::{arg, NUCLEUS_CUT};

pub(crate) const NAME: &str = "flashsample_nucleus_cut";
/// Masses per thread and iteration of the mass pass.
const MASS_UNROLL: u32 = 4;
/// Masses a block thread loads together before adding them in order.
const SUM_UNROLL: u32 = 16;
const _: () = assert!(NUCLEUS_CUT_THREADS >= MAX_MASS_BLOCKS, "one pass over the blocks");

/// The shared arrays [`emit`] declares: four counters, the blocks' mass sums and their prefixes.
const MISC: Ptr<Shared> = Ptr::named("@fs_nucleus_misc");
const BSUM: Ptr<Shared> = Ptr::named("@fs_nucleus_bsum");
const DONE: Ptr<Shared> = Ptr::named("@fs_nucleus_done");

fn misc(f: &mut Func, i: u32) -> Ptr<Shared> {
    f.element::<_, I32>(&MISC, &i32c(i))
}

fn block_slot(f: &mut Func, array: &Ptr<Shared>, b: &I32) -> Ptr<Shared> {
    f.element::<_, F32>(array, b)
}

/// Logit of sorted entry `i` of pick `j`.
fn logit_at(f: &mut Func, j: &I32, i: &I32) -> F32 {
    let i64 = f.zext(i);
    let at = row_elem(f, j, &i64);
    let a = f.gaddr(&arg::KEYS, &at, 4);
    let k = f.load(&a, 4);
    decode_key(f, &k)
}

/// Binary search over `[0, hi)` for the first entry where `pred` fails (`pred` holds on a
/// prefix): the length of that prefix.
fn prefix_len(f: &mut Func, hi: &I32, pred: impl Fn(&mut Func, &I32) -> I1) -> I32 {
    let lo = f.var(&i32c(0));
    let up = f.var(hi);
    f.while_loop(
        |f| {
            let (l, h) = (f.get(&lo), f.get(&up));
            f.icmp(Icmp::Ult, &l, &h)
        },
        |f| {
            let (l, h) = (f.get(&lo), f.get(&up));
            let sum = f.add(&l, &h);
            let mid = f.lshr(&sum, &i32c(1));
            let holds = pred(f, &mid);
            let next = f.add(&mid, &i32c(1));
            let nl = f.sel(&holds, &next, &l);
            let nh = f.sel(&holds, &h, &mid);
            f.set(&lo, &nl);
            f.set(&up, &nh);
        },
    );
    f.get(&lo)
}

pub(super) fn emit() -> String {
    let mut f = Func::new();
    let tid = f.sreg("tid.x");
    let tid0 = f.icmp(Icmp::Eq, &tid, &i32c(0));
    let count = pick_count(&mut f);
    let j = f.sreg("ctaid.x");
    let live = f.icmp(Icmp::Ult, &j, &count);
    f.if_then(&live, |f| {
        let r = picked_row(f, &j);
        let r64 = f.zext(&r);
        let rf = load_row_filter(f, &r64);
        let (n_at, kept_at, x0_at, cut_at) = (misc(f, 0), misc(f, 1), misc(f, 2), misc(f, 3));
        f.if_then(&tid0, |f| {
            let n = prefix_len(f, &arg::VOCAB, |f, i| {
                let i64 = f.zext(i);
                let at = row_elem(f, &j, &i64);
                let a = f.gaddr(&arg::KEYS, &at, 4);
                let k = f.load(&a, 4);
                f.icmp(Icmp::Ne, &k, &i32c(-1))
            });
            let k_on = f.icmp(Icmp::Ne, &rf.top_k, &i32c(0));
            let k_fits = f.icmp(Icmp::Ule, &rf.top_k, &n);
            let k_use = f.and(&k_on, &k_fits);
            let n = f.sel(&k_use, &rf.top_k, &n);
            let x0 = logit_at(f, &j, &i32c(0));
            let mp_on = f.fcmp(Fcmp::Ogt, &rf.min_p, &F32::ZERO);
            let n_var = f.var(&n);
            f.if_then(&mp_on, |f| {
                let ln = math::ln(f, &rf.min_p);
                let threshold = f.fadd(&x0, &ln);
                let passing = prefix_len(f, &n, |f, i| {
                    let x = logit_at(f, &j, i);
                    f.fcmp(Fcmp::Oge, &x, &threshold)
                });
                f.set(&n_var, &passing);
            });
            let n = f.get(&n_var);
            let xb: I32 = f.bitcast(&x0);
            for (at, v) in [(&n_at, &n), (&kept_at, &n), (&x0_at, &xb)] {
                f.store(v, at, 4);
            }
        });
        f.barrier();
        let n: I32 = f.load(&n_at, 4);
        let xb: I32 = f.load(&x0_at, 4);
        let x0: F32 = f.bitcast(&xb);
        let tp_on = f.fcmp(Fcmp::Olt, &rf.top_p, &F32::ONE);
        let some = f.icmp(Icmp::Ne, &n, &i32c(0));
        let tp_on = f.and(&tp_on, &some);
        let threads = i32c(NUCLEUS_CUT_THREADS);
        f.if_then(&tp_on, |f| {
            let mass_at = |f: &mut Func, i: &I32| -> Ptr<Global> {
                let i64: I64 = f.zext(i);
                let at = row_elem(f, &j, &i64);
                f.gaddr(&arg::MASSES, &at, 4)
            };
            // The masses, MASS_UNROLL entries per thread and iteration (loads first).
            let stride = i32c(NUCLEUS_CUT_THREADS * MASS_UNROLL);
            f.for_loop(&tid, &n, &stride, |f, i0| {
                let xs: Vec<(I1, I32, F32)> = (0..MASS_UNROLL)
                    .map(|u| {
                        let i = f.add(i0, &i32c(u * NUCLEUS_CUT_THREADS));
                        let ok = f.icmp(Icmp::Ult, &i, &n);
                        let is = f.sel(&ok, &i, &i32c(0));
                        let x = logit_at(f, &j, &is);
                        (ok, i, x)
                    })
                    .collect();
                for (ok, i, x) in xs {
                    f.if_then(&ok, |f| {
                        let d = f.fsub(&x, &x0);
                        let m = math::exp(f, &d);
                        let a = mass_at(f, &i);
                        f.store(&m, &a, 4);
                    });
                }
            });
            f.barrier();
            let nb = f.add(&n, &i32c(1023));
            let nb = f.lshr(&nb, &i32c(10));
            // Entries of block b: min(1024, n − 1024 b).
            let block_len = |f: &mut Func, b: &I32| {
                let first = f.shl(b, &i32c(10));
                let left = f.sub(&n, &first);
                let full = f.icmp(Icmp::Ugt, &left, &i32c(1024));
                (first.clone(), f.sel(&full, &i32c(1024), &left))
            };
            // Block b's masses `i0 .. i0 + SUM_UNROLL`, loaded together: +0 past the block (an
            // exact no-op on the non-negative running sum), and whether each is inside.
            let chunk = |f: &mut Func, first: &I32, len: &I32, i0: &I32| -> Vec<(I1, F32)> {
                (0..SUM_UNROLL)
                    .map(|u| {
                        let i = f.add(i0, &i32c(u));
                        let ok = f.icmp(Icmp::Ult, &i, len);
                        let is = f.sel(&ok, &i, &i32c(0));
                        let e = f.add(first, &is);
                        let a = mass_at(f, &e);
                        let m = f.load(&a, 4);
                        (ok.clone(), f.sel(&ok, &m, &F32::ZERO))
                    })
                    .collect()
            };
            f.for_loop(&tid, &nb, &threads, |f, b| {
                let (first, len) = block_len(f, b);
                let s = f.var(&F32::ZERO);
                f.for_loop(&i32c(0), &len, &i32c(SUM_UNROLL), |f, i0| {
                    for (_, m) in chunk(f, &first, &len, i0) {
                        let sv = f.get(&s);
                        let sv = f.fadd(&sv, &m);
                        f.set(&s, &sv);
                    }
                });
                let sv = f.get(&s);
                let at = block_slot(f, &BSUM, b);
                f.store(&sv, &at, 4);
            });
            f.barrier();
            f.if_then(&tid0, |f| {
                // BlockedMass: `done` adds each full block's sum in order; the total adds the
                // partial last block (or +0).
                let full = f.lshr(&n, &i32c(10));
                let d = f.var(&F32::ZERO);
                f.for_loop(&i32c(0), &full, &i32c(1), |f, b| {
                    let dv = f.get(&d);
                    let at = block_slot(f, &DONE, b);
                    f.store(&dv, &at, 4);
                    let bs = block_slot(f, &BSUM, b);
                    let bv = f.load(&bs, 4);
                    let dv = f.fadd(&dv, &bv);
                    f.set(&d, &dv);
                });
                let dv = f.get(&d);
                let partial = f.icmp(Icmp::Ult, &full, &nb);
                let last = f.var(&F32::ZERO);
                f.if_then(&partial, |f| {
                    let at = block_slot(f, &DONE, &full);
                    f.store(&dv, &at, 4);
                    let bs = block_slot(f, &BSUM, &full);
                    let bv = f.load(&bs, 4);
                    f.set(&last, &bv);
                });
                let lv = f.get(&last);
                let total = f.fadd(&dv, &lv);
                let cut = f.fmul(&rf.top_p, &total);
                let cb: I32 = f.bitcast(&cut);
                f.store(&cb, &cut_at, 4);
            });
            f.barrier();
            let cb: I32 = f.load(&cut_at, 4);
            let cut: F32 = f.bitcast(&cb);
            // The prefix `done + block` never decreases (non-negative masses, rounding is
            // monotone) and ends block b at `done[b] + bsum[b]`, so the first entry reaching
            // the cut lies in the first block whose end reaches it: only that block's thread
            // walks its entries.
            let reaches = |f: &mut Func, b: &I32| {
                let d = block_slot(f, &DONE, b);
                let d = f.load(&d, 4);
                let bs = block_slot(f, &BSUM, b);
                let bs = f.load(&bs, 4);
                let end = f.fadd(&d, &bs);
                f.fcmp(Fcmp::Oge, &end, &cut)
            };
            f.for_loop(&tid, &nb, &threads, |f, b| {
                let here = reaches(f, b);
                let has_prev = f.icmp(Icmp::Ne, b, &i32c(0));
                let pb = f.sub(b, &i32c(1));
                let pb = f.sel(&has_prev, &pb, &i32c(0));
                let before = reaches(f, &pb);
                let before = f.and(&has_prev, &before);
                let not_before = f.not(&before);
                let first_block = f.and(&here, &not_before);
                f.if_then(&first_block, |f| {
                    let (first, len) = block_len(f, b);
                    let at = block_slot(f, &DONE, b);
                    let done: F32 = f.load(&at, 4);
                    let s = f.var(&F32::ZERO);
                    let i = f.var(&i32c(0));
                    let found = f.var(&I1::FALSE);
                    let k = f.var(&arg::VOCAB);
                    f.while_loop(
                        |f| {
                            let iv = f.get(&i);
                            let more = f.icmp(Icmp::Ult, &iv, &len);
                            let fv = f.get(&found);
                            let go = f.not(&fv);
                            f.and(&more, &go)
                        },
                        |f| {
                            let i0 = f.get(&i);
                            for (u, (ok, m)) in chunk(f, &first, &len, &i0).into_iter().enumerate() {
                                let sv = f.get(&s);
                                let sv = f.fadd(&sv, &m);
                                f.set(&s, &sv);
                                let prefix = f.fadd(&done, &sv);
                                let reached = f.fcmp(Fcmp::Oge, &prefix, &cut);
                                let fv = f.get(&found);
                                let fresh = f.not(&fv);
                                let hit = f.and(&reached, &ok);
                                let hit = f.and(&hit, &fresh);
                                let count = f.add(&first, &i0);
                                let count = f.add(&count, &i32c(u as u32 + 1));
                                let kv = f.get(&k);
                                let kv = f.sel(&hit, &count, &kv);
                                f.set(&k, &kv);
                                let fv = f.or(&fv, &hit);
                                f.set(&found, &fv);
                            }
                            let next = f.add(&i0, &i32c(SUM_UNROLL));
                            f.set(&i, &next);
                        },
                    );
                    let kv = f.get(&k);
                    f.atomic_update(Atomic::Umin, &kept_at, &kv, Some(4));
                });
            });
            f.barrier();
        });
        f.if_then(&tid0, |f| {
            let k: I32 = f.load(&kept_at, 4);
            let j64 = f.zext(&j);
            let a = f.gaddr(&arg::KEPT, &j64, 4);
            f.store(&k, &a, 4);
        });
    });
    f.ret_void();
    let mut out = format!(
        "@fs_nucleus_misc = internal addrspace(3) global [4 x i32] undef, align 4\n\
         @fs_nucleus_bsum = internal addrspace(3) global [{MAX_MASS_BLOCKS} x float] undef, align 4\n\
         @fs_nucleus_done = internal addrspace(3) global [{MAX_MASS_BLOCKS} x float] undef, align 4\n"
    );
    out.push_str(&f.finish(&NUCLEUS_CUT.llvm_header(NAME, &format!("\"nvvm.maxntid\"=\"{NUCLEUS_CUT_THREADS}\""))));
    out
}
