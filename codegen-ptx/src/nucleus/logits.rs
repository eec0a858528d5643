//! `flashsample_nucleus_logits`: the picked rows' transformed logits `x` over the whole
//! vocabulary, bit-identical to stage one's. Per (row, token) the multiply runs stage one's
//! f32 order: on tensor cores (16-bit operands) `mma.sync.m16n8k16` steps over k in ascending
//! order into one accumulator, zero-filled past D (every stage-one tensor schedule's order,
//! DESIGN.md "Batch invariance"); on the SIMT schedule one `fma` per k in ascending order.
//! Then the transform chain through stage one's own emitter (`token_x`), the allowed
//! bit, and per token its ascending sort key and index for the sort.
//!
//! Tensor-core path: each warp multiplies 16 W rows (the MMA's m) by up to 8 picked rows (its
//! n, picked row `g` in column `g`), loading the fragments straight from global memory (each
//! 32-bit pair once; L1 serves the other half of each sector). Memory-bound like a small
//! batch's stage one: one read of W.

use super::{pick_count, picked_row, row_elem};
use crate::config::GpuConfig;
use crate::ir::{i32c, Func, Global, Icmp, Int, Ptr, F32, I1, I16, I32, I64};
use crate::params::{arg, NUCLEUS_LOGITS};
use crate::ptx;
use crate::stage1::{load_elem, model_logit, token_x};
use flashsample_ir::{DType, Pipeline};

pub(crate) const NAME: &str = "flashsample_nucleus_logits";

pub(super) fn emit(p: &Pipeline, c: &GpuConfig) -> String {
    let mut f = Func::new();
    let tid = f.sreg("tid.x");
    let count = pick_count(&mut f);
    let any = f.icmp(Icmp::Ne, &count, &i32c(0));
    f.if_then(&any, |f| {
        let cta = f.sreg("ctaid.x");
        let v0 = f.mul(&cta, &i32c(super::NUCLEUS_LOGITS_TOKENS));
        let lane = f.and(&tid, &i32c(31));
        let captured = all_captured(f, &lane, &count);
        f.if_else(
            &captured,
            |f| copy_captured(f, &tid, &lane, &v0, &count),
            |f| {
                if c.is_tensor() {
                    tensor(f, p, c.k_step(), &tid, &v0, &count);
                } else {
                    simt(f, p, &tid, &v0, &count);
                }
            },
        );
    });
    f.ret_void();
    f.finish(&NUCLEUS_LOGITS.llvm_header(NAME, &format!("\"nvvm.maxntid\"=\"{}\"", super::NUCLEUS_THREADS)))
}

/// Whether stage one captured every picked row's logits ([`super::capture_slot`]); uniform
/// over the grid. Then W is not read again.
fn all_captured(f: &mut Func, lane: &I32, count: &I32) -> I1 {
    let all = f.var(&I1::TRUE);
    f.for_loop(&i32c(0), count, &i32c(1), |f, j| {
        let r = picked_row(f, j);
        let (kept, _) = super::capture_slot(f, lane, &r);
        let a = f.get(&all);
        let a = f.and(&a, &kept);
        f.set(&all, &a);
    });
    f.get(&all)
}

/// Every picked row's `x` from stage one's capture, in the SIMT layout (thread `tid` owns token
/// `v0 + tid % 128` of picked rows `tid / 128, + 2, ..`).
fn copy_captured(f: &mut Func, tid: &I32, lane: &I32, v0: &I32, count: &I32) {
    let lo = f.and(tid, &i32c(super::NUCLEUS_LOGITS_TOKENS - 1));
    let half = f.lshr(tid, &i32c(super::NUCLEUS_LOGITS_TOKENS.trailing_zeros()));
    let v = f.add(v0, &lo);
    let v_ok = f.icmp(Icmp::Ult, &v, &arg::VOCAB);
    let step = i32c(super::NUCLEUS_THREADS / super::NUCLEUS_LOGITS_TOKENS);
    let v64: I64 = f.zext(&v);
    let vocab64: I64 = f.zext(&arg::VOCAB);
    // The slot search is a warp ballot: every lane runs it, whichever tokens it owns.
    f.for_loop(&half, count, &step, |f, j| {
        let r = picked_row(f, j);
        let (_, slot) = super::capture_slot(f, lane, &r);
        f.if_then(&v_ok, |f| {
            let s64: I64 = f.zext(&slot);
            let e = f.mul(&s64, &vocab64);
            let e = f.add(&e, &v64);
            let a = f.gaddr(&arg::CAPTURE, &e, 4);
            let x: F32 = f.load(&a, 4);
            store_x(f, &v, &v64, j, &x);
        });
    });
}

/// The tensor-core multiply: warp `w` owns tokens `v0 + 16w ..`, lane `4g + t` the
/// accumulators of tokens `16w + g` and `16w + g + 8` for picked rows `2t` and `2t + 1` of each
/// group of 8 ([`mma_over_k`]).
fn tensor(f: &mut Func, p: &Pipeline, k_step: u32, tid: &I32, v0: &I32, count: &I32) {
    let ptx::MmaLane { warp, g, t, .. } = ptx::MmaLane::of(f, tid);
    let w16 = f.shl(&warp, &i32c(4));
    let m0 = f.add(v0, &w16);
    let va = f.add(&m0, &g);
    let vb = f.add(&va, &i32c(8));
    let dim64: I64 = f.zext(&arg::DIM);
    let row_start = |f: &mut Func, v: &I32| {
        let ok = f.icmp(Icmp::Ult, v, &arg::VOCAB);
        let vs = f.sel(&ok, v, &i32c(0));
        let v64 = f.zext(&vs);
        f.mul(&v64, &dim64)
    };
    let wa = row_start(f, &va);
    let wb = row_start(f, &vb);
    let t2 = f.shl(&t, &i32c(1));
    // Up to 8 picked rows per pass (the MMA's n): column g multiplies picked row `first + g`;
    // columns past the count repeat row 0 (unused).
    f.for_loop(&i32c(0), count, &i32c(8), |f, first| {
        let jg = f.add(first, &g);
        let has_col = f.icmp(Icmp::Ult, &jg, count);
        let jcol = f.sel(&has_col, &jg, &i32c(0));
        let hrow = picked_row(f, &jcol);
        let h64 = f.zext(&hrow);
        let hb = f.mul(&h64, &dim64);
        let acc = mma_over_k(f, p, k_step, &t, &wa, &wb, &hb);
        let j0 = f.add(first, &t2);
        let j1 = f.add(&j0, &i32c(1));
        for (raw, (v, j)) in acc.iter().zip([(&va, &j0), (&va, &j1), (&vb, &j0), (&vb, &j1)]) {
            store_logit(f, p, v, j, count, raw);
        }
    });
}

/// One m16n8 tile over the whole of D from global memory, lane `4g + t`'s accumulators
/// `D[g][2t], D[g][2t + 1], D[g + 8][2t], D[g + 8][2t + 1]`: A rows `g`, `g + 8` are the W rows
/// starting at elements `wa`, `wb`, B column `g` the hidden row at `hb` (each lane passes its
/// own). K runs in slices of stage one's `k_step` (every 16-wide step's loads of a slice issued
/// before its MMAs), zero-padded to a whole slice as stage one's ring pads it: the same MMA
/// steps in the same order as every stage-one tensor schedule, so a (row, token)'s sum has
/// stage one's bits, even an exact zero's sign.
pub(crate) fn mma_over_k(f: &mut Func, p: &Pipeline, k_step: u32, t: &I32, wa: &I64, wb: &I64, hb: &I64) -> Vec<F32> {
    let dtype = match p.weights.dtype {
        DType::F16 => "f16",
        _ => "bf16",
    };
    // 32-bit pair loads need an even D and 4-byte aligned operands; else two 16-bit loads.
    let odd = f.and(&arg::DIM, &i32c(1));
    let wp: I64 = f.ptrtoint(&arg::WEIGHTS);
    let hp: I64 = f.ptrtoint(&arg::HIDDEN);
    let ptrs = f.or(&wp, &hp);
    let ptrs = f.and(&ptrs, &I64::c(3));
    let ptrs: I32 = f.trunc(&ptrs);
    let mis = f.or(&odd, &ptrs);
    let aligned = f.icmp(Icmp::Eq, &mis, &i32c(0));
    let t2 = f.shl(t, &i32c(1));
    let acc: Vec<_> = (0..4).map(|_| f.var(&F32::ZERO)).collect();
    let kloop = |f: &mut Func, aligned: bool| {
        f.for_loop(&i32c(0), &arg::DIM, &i32c(k_step), |f, k| {
            let mut steps = Vec::new();
            for step in 0..k_step / 16 {
                let k0 = f.add(k, &i32c(16 * step));
                let ka = f.add(&k0, &t2);
                let kb = f.add(&ka, &i32c(8));
                let a = [
                    pair(f, aligned, &arg::WEIGHTS, wa, &ka),
                    pair(f, aligned, &arg::WEIGHTS, wb, &ka),
                    pair(f, aligned, &arg::WEIGHTS, wa, &kb),
                    pair(f, aligned, &arg::WEIGHTS, wb, &kb),
                ];
                let b = [pair(f, aligned, &arg::HIDDEN, hb, &ka), pair(f, aligned, &arg::HIDDEN, hb, &kb)];
                steps.push((a, b));
            }
            for (a, b) in steps {
                let cur: Vec<F32> = acc.iter().map(|v| f.get(v)).collect();
                let out = ptx::mma_m16n8k16(f, dtype, &a, &b, &cur);
                for (slot, v) in acc.iter().zip(out.iter()) {
                    f.set(slot, v);
                }
            }
        });
    };
    f.if_else(&aligned, |f| kloop(f, true), |f| kloop(f, false));
    acc.iter().map(|v| f.get(v)).collect()
}

/// Elements `k, k + 1` of the 16-bit matrix `ptr` from element `base` (i64) as one 32-bit
/// MMA operand register (element `k` in the low half), zero past D.
fn pair(f: &mut Func, aligned: bool, ptr: &Ptr<Global>, base: &I64, k: &I32) -> I32 {
    let elem = |f: &mut Func, k: &I32| {
        let ok = f.icmp(Icmp::Ult, k, &arg::DIM);
        let ks = f.sel(&ok, k, &i32c(0));
        let k64 = f.zext(&ks);
        let i = f.add(base, &k64);
        (ok, i)
    };
    if aligned {
        // D is even and k is even: k < D covers k + 1.
        let (ok, i) = elem(f, k);
        let a = f.gaddr(ptr, &i, 2);
        let v = f.load(&a, 4);
        f.sel(&ok, &v, &i32c(0))
    } else {
        let mut halves = Vec::new();
        for o in 0..2 {
            let kk = f.add(k, &i32c(o));
            let (ok, i) = elem(f, &kk);
            let a = f.gaddr(ptr, &i, 2);
            let h: I16 = f.load(&a, 2);
            let h = f.zext(&h);
            halves.push(f.sel(&ok, &h, &i32c(0)));
        }
        let hi = f.shl(&halves[1], &i32c(16));
        f.or(&hi, &halves[0])
    }
}

/// The SIMT schedule's multiply: thread `tid` owns token `v0 + tid % 128` of picked rows
/// `tid / 128, + 2, ..`, one `fma` per k in ascending order as `simt.rs`.
fn simt(f: &mut Func, p: &Pipeline, tid: &I32, v0: &I32, count: &I32) {
    let lo = f.and(tid, &i32c(super::NUCLEUS_LOGITS_TOKENS - 1));
    let half = f.lshr(tid, &i32c(super::NUCLEUS_LOGITS_TOKENS.trailing_zeros()));
    let v = f.add(v0, &lo);
    let ok = f.icmp(Icmp::Ult, &v, &arg::VOCAB);
    let vs = f.sel(&ok, &v, &i32c(0));
    let dim64: I64 = f.zext(&arg::DIM);
    let v64 = f.zext(&vs);
    let wrow = f.mul(&v64, &dim64);
    let step = i32c(super::NUCLEUS_THREADS / super::NUCLEUS_LOGITS_TOKENS);
    f.for_loop(&half, count, &step, |f, j| {
        let r = picked_row(f, j);
        let r64 = f.zext(&r);
        let hrow = f.mul(&r64, &dim64);
        let raw = fma_over_k(f, p, &wrow, &hrow);
        store_logit(f, p, &v, j, count, &raw);
    });
}

/// The SIMT schedule's multiply of one (row, token): the W row at element `wrow` by the hidden
/// row at `hrow`, one `fma` per k in ascending order into one f32 accumulator, as
/// `stage1/simt.rs` walks it.
pub(crate) fn fma_over_k(f: &mut Func, p: &Pipeline, wrow: &I64, hrow: &I64) -> F32 {
    let (wd, hd) = (p.weights.dtype, p.hidden.dtype);
    let acc = f.var(&F32::ZERO);
    f.for_loop(&i32c(0), &arg::DIM, &i32c(1), |f, k| {
        let k64 = f.zext(k);
        let wi = f.add(wrow, &k64);
        let w = load_elem(f, &arg::WEIGHTS, &wi, wd);
        let hi = f.add(hrow, &k64);
        let h = load_elem(f, &arg::HIDDEN, &hi, hd);
        let cur = f.get(&acc);
        let nv = f.call("@llvm.fma.f32", &[&w, &h, &cur]);
        f.set(&acc, &nv);
    });
    f.get(&acc)
}

/// Token `v` of picked row `j` (when both exist): DESIGN.md steps 3–4 on its matmul value
/// `raw` with the row's parameters, then `x`, its sort key and its index into the pick's
/// buffers, and with `%raw` its raw logit (step 10).
fn store_logit(f: &mut Func, p: &Pipeline, v: &I32, j: &I32, count: &I32, raw: &F32) {
    let v_ok = f.icmp(Icmp::Ult, v, &arg::VOCAB);
    let j_ok = f.icmp(Icmp::Ult, j, count);
    let ok = f.and(&v_ok, &j_ok);
    f.if_then(&ok, |f| {
        let r = picked_row(f, j);
        let (x, bias) = token_x(f, p, &r, v, raw);
        let v64 = f.zext(v);
        let e = store_x(f, v, &v64, j, &x);
        let has_raw = f.non_null(&arg::RAW);
        f.if_then(&has_raw, |f| {
            let rv = model_logit(f, &p.transforms, raw, bias.as_ref(), &I1::TRUE);
            let a = f.gaddr(&arg::RAW, &e, 4);
            f.store(&rv, &a, 4);
        });
    });
}

/// Token `v`'s `x` of picked row `j` into the pick's buffers with its ascending sort key and
/// index; returns the element index.
fn store_x(f: &mut Func, v: &I32, v64: &I64, j: &I32, x: &F32) -> I64 {
    let e = row_elem(f, j, v64);
    let a = f.gaddr(&arg::X, &e, 4);
    f.store(x, &a, 4);
    let key = f.order_key(x);
    let key = f.not(&key);
    let a = f.gaddr(&arg::KEYS, &e, 4);
    f.store(&key, &a, 4);
    let a = f.gaddr(&arg::VALS, &e, 4);
    f.store(v, &a, 4);
    e
}
