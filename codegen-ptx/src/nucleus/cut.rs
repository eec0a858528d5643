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

use super::{decode_key_u, pick_count_u, picked_row_u, row_elem_u, MAX_MASS_BLOCKS, NUCLEUS_CUT_THREADS};
use crate::ir::Func;
use crate::params::NUCLEUS_CUT;

pub(crate) const NAME: &str = "flashsample_nucleus_cut";
/// Masses per thread and iteration of the mass pass.
const MASS_UNROLL: u32 = 4;
/// Masses a block thread loads together before adding them in order.
const SUM_UNROLL: u32 = 16;
const _: () = assert!(NUCLEUS_CUT_THREADS >= MAX_MASS_BLOCKS, "one pass over the blocks");

fn misc(f: &mut Func, i: u32) -> String {
    f.v(format!("getelementptr i32, ptr addrspace(3) @fs_nucleus_misc, i32 {i}"))
}

fn block_slot(f: &mut Func, array: &str, b: &str) -> String {
    f.v(format!("getelementptr float, ptr addrspace(3) {array}, i32 {b}"))
}

/// Logit of sorted entry `i` (i32) of pick `j`.
fn logit_at(f: &mut Func, j: &str, i: &str) -> String {
    let i64 = f.zext64_u(i);
    let at = row_elem_u(f, j, &i64);
    let a = f.gaddr_u("%keys", &at, 4);
    let k = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
    decode_key_u(f, &k)
}

/// Binary search over `[0, hi)` for the first entry where `pred` fails (`pred` holds on a
/// prefix): the length of that prefix.
fn prefix_len(f: &mut Func, hi: &str, pred: impl Fn(&mut Func, &str) -> String) -> String {
    let lo = f.var_u("i32", "0");
    let up = f.var_u("i32", hi);
    f.while_loop_u(
        |f| {
            let (l, h) = (f.get_u(&lo), f.get_u(&up));
            f.ult_u(&l, &h)
        },
        |f| {
            let (l, h) = (f.get_u(&lo), f.get_u(&up));
            let sum = f.add_u(&l, &h);
            let mid = f.v(format!("lshr i32 {sum}, 1"));
            let holds = pred(f, &mid);
            let next = f.add_u(&mid, "1");
            let nl = f.sel_u("i32", &holds, &next, &l);
            let nh = f.sel_u("i32", &holds, &h, &mid);
            f.set_u(&lo, &nl);
            f.set_u(&up, &nh);
        },
    );
    f.get_u(&lo)
}

pub(super) fn emit() -> String {
    let mut f = Func::new();
    let tid = f.sreg_u("tid.x");
    let tid0 = f.v(format!("icmp eq i32 {tid}, 0"));
    let count = pick_count_u(&mut f);
    let j = f.sreg_u("ctaid.x");
    let live = f.ult_u(&j, &count);
    f.if_then_u(&live, |f| {
        let r = picked_row_u(f, &j);
        let r64 = f.zext64_u(&r);
        let (top_k, top_p, min_p) = crate::filter::load_row_filter_u(f, &r64);
        let (n_at, kept_at, x0_at, cut_at) = (misc(f, 0), misc(f, 1), misc(f, 2), misc(f, 3));
        f.if_then_u(&tid0, |f| {
            let n = prefix_len(f, "%vocab", |f, i| {
                let i64 = f.zext64_u(i);
                let at = row_elem_u(f, &j, &i64);
                let a = f.gaddr_u("%keys", &at, 4);
                let k = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
                f.v(format!("icmp ne i32 {k}, -1"))
            });
            let k_on = f.v(format!("icmp ne i32 {top_k}, 0"));
            let k_fits = f.v(format!("icmp ule i32 {top_k}, {n}"));
            let k_use = f.and1_u(&k_on, &k_fits);
            let n = f.sel_u("i32", &k_use, &top_k, &n);
            let x0 = logit_at(f, &j, "0");
            let mp_on = f.v(format!("fcmp ogt float {min_p}, 0.0"));
            let n_var = f.var_u("i32", &n);
            f.if_then_u(&mp_on, |f| {
                let ln = f.v(format!("call float @fs_ln_f32(float {min_p})"));
                let threshold = f.fadd_u(&x0, &ln);
                let passing = prefix_len(f, &n, |f, i| {
                    let x = logit_at(f, &j, i);
                    f.v(format!("fcmp oge float {x}, {threshold}"))
                });
                f.set_u(&n_var, &passing);
            });
            let n = f.get_u(&n_var);
            let xb = f.v(format!("bitcast float {x0} to i32"));
            for (at, v) in [(&n_at, &n), (&kept_at, &n), (&x0_at, &xb)] {
                f.s(format!("store i32 {v}, ptr addrspace(3) {at}, align 4"));
            }
        });
        f.barrier();
        let n = f.v(format!("load i32, ptr addrspace(3) {n_at}, align 4"));
        let xb = f.v(format!("load i32, ptr addrspace(3) {x0_at}, align 4"));
        let x0 = f.v(format!("bitcast i32 {xb} to float"));
        let tp_on = f.v(format!("fcmp olt float {top_p}, 1.0"));
        let some = f.v(format!("icmp ne i32 {n}, 0"));
        let tp_on = f.and1_u(&tp_on, &some);
        let threads = NUCLEUS_CUT_THREADS.to_string();
        f.if_then_u(&tp_on, |f| {
            let mass_at = |f: &mut Func, i: &str| {
                let i64 = f.zext64_u(i);
                let at = row_elem_u(f, &j, &i64);
                f.gaddr_u("%masses", &at, 4)
            };
            // The masses, MASS_UNROLL entries per thread and iteration (loads first).
            let stride = (NUCLEUS_CUT_THREADS * MASS_UNROLL).to_string();
            f.for_loop_u(&tid, &n, &stride, |f, i0| {
                let xs: Vec<(String, String, String)> = (0..MASS_UNROLL)
                    .map(|u| {
                        let i = f.add_u(i0, &(u * NUCLEUS_CUT_THREADS).to_string());
                        let ok = f.ult_u(&i, &n);
                        let is = f.sel_u("i32", &ok, &i, "0");
                        let x = logit_at(f, &j, &is);
                        (ok, i, x)
                    })
                    .collect();
                for (ok, i, x) in xs {
                    f.if_then_u(&ok, |f| {
                        let d = f.fsub_u(&x, &x0);
                        let m = f.v(format!("call float @fs_exp_f32(float {d})"));
                        let a = mass_at(f, &i);
                        f.s(format!("store float {m}, ptr addrspace(1) {a}, align 4"));
                    });
                }
            });
            f.barrier();
            let nb = f.add_u(&n, "1023");
            let nb = f.v(format!("lshr i32 {nb}, 10"));
            // Entries of block b: min(1024, n − 1024 b).
            let block_len = |f: &mut Func, b: &str| {
                let first = f.v(format!("shl i32 {b}, 10"));
                let left = f.v(format!("sub i32 {n}, {first}"));
                let full = f.v(format!("icmp ugt i32 {left}, 1024"));
                (first.clone(), f.sel_u("i32", &full, "1024", &left))
            };
            // Block b's masses `i0 .. i0 + SUM_UNROLL`, loaded together: +0 past the block (an
            // exact no-op on the non-negative running sum), and whether each is inside.
            let chunk = |f: &mut Func, first: &str, len: &str, i0: &str| -> Vec<(String, String)> {
                (0..SUM_UNROLL)
                    .map(|u| {
                        let i = f.add_u(i0, &u.to_string());
                        let ok = f.ult_u(&i, len);
                        let is = f.sel_u("i32", &ok, &i, "0");
                        let e = f.add_u(first, &is);
                        let a = mass_at(f, &e);
                        let m = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
                        (ok.clone(), f.sel_u("float", &ok, &m, "0.0"))
                    })
                    .collect()
            };
            f.for_loop_u(&tid, &nb, &threads, |f, b| {
                let (first, len) = block_len(f, b);
                let s = f.var_u("float", "0.0");
                f.for_loop_u("0", &len, &SUM_UNROLL.to_string(), |f, i0| {
                    for (_, m) in chunk(f, &first, &len, i0) {
                        let sv = f.get_u(&s);
                        let sv = f.fadd_u(&sv, &m);
                        f.set_u(&s, &sv);
                    }
                });
                let sv = f.get_u(&s);
                let at = block_slot(f, "@fs_nucleus_bsum", b);
                f.s(format!("store float {sv}, ptr addrspace(3) {at}, align 4"));
            });
            f.barrier();
            f.if_then_u(&tid0, |f| {
                // BlockedMass: `done` adds each full block's sum in order; the total adds the
                // partial last block (or +0).
                let full = f.v(format!("lshr i32 {n}, 10"));
                let d = f.var_u("float", "0.0");
                f.for_loop_u("0", &full, "1", |f, b| {
                    let dv = f.get_u(&d);
                    let at = block_slot(f, "@fs_nucleus_done", b);
                    f.s(format!("store float {dv}, ptr addrspace(3) {at}, align 4"));
                    let bs = block_slot(f, "@fs_nucleus_bsum", b);
                    let bv = f.v(format!("load float, ptr addrspace(3) {bs}, align 4"));
                    let dv = f.fadd_u(&dv, &bv);
                    f.set_u(&d, &dv);
                });
                let dv = f.get_u(&d);
                let partial = f.v(format!("icmp ult i32 {full}, {nb}"));
                let last = f.var_u("float", "0.0");
                f.if_then_u(&partial, |f| {
                    let at = block_slot(f, "@fs_nucleus_done", &full);
                    f.s(format!("store float {dv}, ptr addrspace(3) {at}, align 4"));
                    let bs = block_slot(f, "@fs_nucleus_bsum", &full);
                    let bv = f.v(format!("load float, ptr addrspace(3) {bs}, align 4"));
                    f.set_u(&last, &bv);
                });
                let lv = f.get_u(&last);
                let total = f.fadd_u(&dv, &lv);
                let cut = f.fmul_u(&top_p, &total);
                let cb = f.v(format!("bitcast float {cut} to i32"));
                f.s(format!("store i32 {cb}, ptr addrspace(3) {cut_at}, align 4"));
            });
            f.barrier();
            let cb = f.v(format!("load i32, ptr addrspace(3) {cut_at}, align 4"));
            let cut = f.v(format!("bitcast i32 {cb} to float"));
            // The prefix `done + block` never decreases (non-negative masses, rounding is
            // monotone) and ends block b at `done[b] + bsum[b]`, so the first entry reaching
            // the cut lies in the first block whose end reaches it: only that block's thread
            // walks its entries.
            let reaches = |f: &mut Func, b: &str| {
                let d = block_slot(f, "@fs_nucleus_done", b);
                let d = f.v(format!("load float, ptr addrspace(3) {d}, align 4"));
                let bs = block_slot(f, "@fs_nucleus_bsum", b);
                let bs = f.v(format!("load float, ptr addrspace(3) {bs}, align 4"));
                let end = f.fadd_u(&d, &bs);
                f.v(format!("fcmp oge float {end}, {cut}"))
            };
            f.for_loop_u(&tid, &nb, &threads, |f, b| {
                let here = reaches(f, b);
                let has_prev = f.v(format!("icmp ne i32 {b}, 0"));
                let pb = f.v(format!("sub i32 {b}, 1"));
                let pb = f.sel_u("i32", &has_prev, &pb, "0");
                let before = reaches(f, &pb);
                let before = f.and1_u(&has_prev, &before);
                let not_before = f.v(format!("xor i1 {before}, true"));
                let first_block = f.and1_u(&here, &not_before);
                f.if_then_u(&first_block, |f| {
                    let (first, len) = block_len(f, b);
                    let at = block_slot(f, "@fs_nucleus_done", b);
                    let done = f.v(format!("load float, ptr addrspace(3) {at}, align 4"));
                    let s = f.var_u("float", "0.0");
                    let i = f.var_u("i32", "0");
                    let found = f.var_u("i1", "false");
                    let k = f.var_u("i32", "%vocab");
                    f.while_loop_u(
                        |f| {
                            let iv = f.get_u(&i);
                            let more = f.ult_u(&iv, &len);
                            let fv = f.get_u(&found);
                            let go = f.v(format!("xor i1 {fv}, true"));
                            f.and1_u(&more, &go)
                        },
                        |f| {
                            let i0 = f.get_u(&i);
                            for (u, (ok, m)) in chunk(f, &first, &len, &i0).into_iter().enumerate() {
                                let sv = f.get_u(&s);
                                let sv = f.fadd_u(&sv, &m);
                                f.set_u(&s, &sv);
                                let prefix = f.fadd_u(&done, &sv);
                                let reached = f.v(format!("fcmp oge float {prefix}, {cut}"));
                                let fv = f.get_u(&found);
                                let fresh = f.v(format!("xor i1 {fv}, true"));
                                let hit = f.and1_u(&reached, &ok);
                                let hit = f.and1_u(&hit, &fresh);
                                let count = f.add_u(&first, &i0);
                                let count = f.add_u(&count, &(u + 1).to_string());
                                let kv = f.get_u(&k);
                                let kv = f.sel_u("i32", &hit, &count, &kv);
                                f.set_u(&k, &kv);
                                let fv = f.v(format!("or i1 {fv}, {hit}"));
                                f.set_u(&found, &fv);
                            }
                            let next = f.add_u(&i0, &SUM_UNROLL.to_string());
                            f.set_u(&i, &next);
                        },
                    );
                    let kv = f.get_u(&k);
                    f.s(format!("atomicrmw umin ptr addrspace(3) {kept_at}, i32 {kv} monotonic, align 4"));
                });
            });
            f.barrier();
        });
        f.if_then_u(&tid0, |f| {
            let k = f.v(format!("load i32, ptr addrspace(3) {kept_at}, align 4"));
            let j64 = f.zext64_u(&j);
            let a = f.gaddr_u("%kept", &j64, 4);
            f.s(format!("store i32 {k}, ptr addrspace(1) {a}, align 4"));
        });
    });
    f.s("ret void");
    let mut out = format!(
        "@fs_nucleus_misc = internal addrspace(3) global [4 x i32] undef, align 4\n\
         @fs_nucleus_bsum = internal addrspace(3) global [{MAX_MASS_BLOCKS} x float] undef, align 4\n\
         @fs_nucleus_done = internal addrspace(3) global [{MAX_MASS_BLOCKS} x float] undef, align 4\n"
    );
    out.push_str(&f.finish(&NUCLEUS_CUT.llvm_header(NAME, &format!("\"nvvm.maxntid\"=\"{NUCLEUS_CUT_THREADS}\""))));
    out
}
