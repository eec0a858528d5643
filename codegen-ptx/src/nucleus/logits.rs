//! `flashsample_nucleus_logits`: the picked rows' transformed logits `x` over the whole
//! vocabulary, bit-identical to stage one's. Per (row, token) the multiply runs stage one's
//! f32 order: on tensor cores (16-bit operands) `mma.sync.m16n8k16` steps over k in ascending
//! order into one accumulator, zero-filled past D (every stage-one tensor schedule's order,
//! DESIGN.md "Batch invariance"); on the SIMT schedule one `fma` per k in ascending order.
//! Then the transform chain through stage one's own emitter (`transform_token`), the allowed
//! bit, and per token its ascending sort key and index for the sort.
//!
//! Tensor-core path: each warp multiplies 16 W rows (the MMA's m) by up to 8 picked rows (its
//! n, picked row `g` in column `g`), loading the fragments straight from global memory (each
//! 32-bit pair once; L1 serves the other half of each sector). Memory-bound like a small
//! batch's stage one: one read of W.

use super::{pick_count, picked_row, row_elem};
use crate::config::GpuConfig;
use crate::ir::{Func, Value, F32, I32, NEG_INF};
use crate::params::NUCLEUS_LOGITS;
use crate::ptx;
use crate::stage1::{load_elem, model_logit, transform_token, RowTransform, TokenBits};
use flashsample_ir::{DType, Pipeline};

pub(crate) const NAME: &str = "flashsample_nucleus_logits";

pub(super) fn emit(p: &Pipeline, c: &GpuConfig) -> String {
    let mut f = Func::new();
    let tid = f.sreg_u("tid.x");
    let count = pick_count(&mut f);
    let any = f.v(format!("icmp ne i32 {count}, 0"));
    f.if_then_u(&any, |f| {
        let cta = f.sreg_u("ctaid.x");
        let v0 = f.mul_u(&cta, &super::NUCLEUS_LOGITS_TOKENS.to_string());
        if c.is_tensor() {
            tensor(f, p, c.k_step(), &tid, &v0, &count);
        } else {
            simt(f, p, &tid, &v0, &count);
        }
    });
    f.s("ret void");
    f.finish(&NUCLEUS_LOGITS.llvm_header(NAME, &format!("\"nvvm.maxntid\"=\"{}\"", super::NUCLEUS_THREADS)))
}

/// The tensor-core multiply: warp `w` owns tokens `v0 + 16w ..`, lane `4g + t` the
/// accumulators of tokens `16w + g` and `16w + g + 8` for picked rows `2t` and `2t + 1` of each
/// group of 8. K runs
/// in slices of stage one's `k_step` (every 16-wide step's loads of a slice issued before its
/// MMAs), zero-padded to a whole slice as stage one's ring pads it: the same MMA steps, so even
/// an exact zero sum keeps its sign.
fn tensor(f: &mut Func, p: &Pipeline, k_step: u32, tid: &str, v0: &str, count: &str) {
    let warp = f.v(format!("lshr i32 {tid}, 5"));
    let lane = f.v(format!("and i32 {tid}, 31"));
    let g = f.v(format!("lshr i32 {lane}, 2"));
    let t = f.v(format!("and i32 {lane}, 3"));
    let w16 = f.v(format!("shl i32 {warp}, 4"));
    let m0 = f.add_u(v0, &w16);
    let va = f.add_u(&m0, &g);
    let vb = f.add_u(&va, "8");
    let dim64 = f.zext64_u("%dim");
    let row_start = |f: &mut Func, v: &str| {
        let ok = f.ult_u(v, "%vocab");
        let vs = f.sel_u("i32", &ok, v, "0");
        let v64 = f.zext64_u(&vs);
        f.v(format!("mul i64 {v64}, {dim64}"))
    };
    let wa = row_start(f, &va);
    let wb = row_start(f, &vb);
    let dtype = match p.weights.dtype {
        DType::F16 => "f16",
        _ => "bf16",
    };
    // 32-bit pair loads need an even D and 4-byte aligned operands; else two 16-bit loads.
    let odd = f.v("and i32 %dim, 1");
    let wp = f.v("ptrtoint ptr addrspace(1) %weights to i64");
    let hp = f.v("ptrtoint ptr addrspace(1) %hidden to i64");
    let ptrs = f.v(format!("or i64 {wp}, {hp}"));
    let ptrs = f.v(format!("and i64 {ptrs}, 3"));
    let ptrs = f.v(format!("trunc i64 {ptrs} to i32"));
    let mis = f.v(format!("or i32 {odd}, {ptrs}"));
    let aligned = f.v(format!("icmp eq i32 {mis}, 0"));
    let t2 = f.v(format!("shl i32 {t}, 1"));
    // Up to 8 picked rows per pass (the MMA's n): column g multiplies picked row `first + g`;
    // columns past the count repeat row 0 (unused).
    f.for_loop_u("0", count, "8", |f, first| {
        let jg = f.add_u(first, &g);
        let has_col = f.ult_u(&jg, count);
        let jcol = f.sel_u("i32", &has_col, &jg, "0");
        let hrow = picked_row(f, &jcol);
        let h64 = f.zext64_u(&hrow);
        let hb = f.v(format!("mul i64 {h64}, {dim64}"));
        let acc: Vec<_> = (0..4).map(|_| f.var_u("float", "0.0")).collect();
        let kloop = |f: &mut Func, aligned: bool| {
            f.for_loop_u("0", "%dim", &k_step.to_string(), |f, k| {
                let mut steps = Vec::new();
                for step in 0..k_step / 16 {
                    let k0 = f.add_u(k, &(16 * step).to_string());
                    let ka = f.add_u(&k0, &t2);
                    let kb = f.add_u(&ka, "8");
                    let a = [
                        pair(f, aligned, "%weights", &wa, &ka),
                        pair(f, aligned, "%weights", &wb, &ka),
                        pair(f, aligned, "%weights", &wa, &kb),
                        pair(f, aligned, "%weights", &wb, &kb),
                    ];
                    let b = [pair(f, aligned, "%hidden", &hb, &ka), pair(f, aligned, "%hidden", &hb, &kb)];
                    steps.push((a, b));
                }
                for (a, b) in steps {
                    let cur: Vec<F32> = acc.iter().map(|v| F32::raw(f.get_u(v))).collect();
                    let out = ptx::mma_m16n8k16(f, dtype, &a, &b, &cur);
                    for (slot, v) in acc.iter().zip(out.iter()) {
                        f.set_u(slot, v.text());
                    }
                }
            });
        };
        f.if_else_u(&aligned, |f| kloop(f, true), |f| kloop(f, false));
        let j0 = f.add_u(first, &t2);
        let j1 = f.add_u(&j0, "1");
        for (i, (v, j)) in [(&va, &j0), (&va, &j1), (&vb, &j0), (&vb, &j1)].into_iter().enumerate() {
            let raw = f.get_u(&acc[i]);
            store_logit(f, p, v, j, count, &raw);
        }
    });
}

/// Elements `k, k + 1` of the 16-bit matrix `ptr` from element `base` (i64) as one 32-bit
/// MMA operand register (element `k` in the low half), zero past D.
fn pair(f: &mut Func, aligned: bool, ptr: &str, base: &str, k: &str) -> I32 {
    let elem = |f: &mut Func, k: &str| {
        let ok = f.ult_u(k, "%dim");
        let ks = f.sel_u("i32", &ok, k, "0");
        let k64 = f.zext64_u(&ks);
        let i = f.v(format!("add i64 {base}, {k64}"));
        (ok, i)
    };
    if aligned {
        // D is even and k is even: k < D covers k + 1.
        let (ok, i) = elem(f, k);
        let a = f.gaddr_u(ptr, &i, 2);
        let v = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
        I32::raw(f.sel_u("i32", &ok, &v, "0"))
    } else {
        let mut halves = Vec::new();
        for o in 0..2 {
            let kk = f.add_u(k, &o.to_string());
            let (ok, i) = elem(f, &kk);
            let a = f.gaddr_u(ptr, &i, 2);
            let h = f.v(format!("load i16, ptr addrspace(1) {a}, align 2"));
            let h = f.v(format!("zext i16 {h} to i32"));
            halves.push(f.sel_u("i32", &ok, &h, "0"));
        }
        let hi = f.v(format!("shl i32 {}, 16", halves[1]));
        I32::raw(f.v(format!("or i32 {hi}, {}", halves[0])))
    }
}

/// The SIMT schedule's multiply: thread `tid` owns token `v0 + tid % 128` of picked rows
/// `tid / 128, + 2, ..`, one `fma` per k in ascending order as `simt.rs`.
fn simt(f: &mut Func, p: &Pipeline, tid: &str, v0: &str, count: &str) {
    let lo = f.v(format!("and i32 {tid}, {}", super::NUCLEUS_LOGITS_TOKENS - 1));
    let half = f.v(format!("lshr i32 {tid}, {}", super::NUCLEUS_LOGITS_TOKENS.trailing_zeros()));
    let v = f.add_u(v0, &lo);
    let ok = f.ult_u(&v, "%vocab");
    let vs = f.sel_u("i32", &ok, &v, "0");
    let dim64 = f.zext64_u("%dim");
    let v64 = f.zext64_u(&vs);
    let wrow = f.v(format!("mul i64 {v64}, {dim64}"));
    let step = (super::NUCLEUS_THREADS / super::NUCLEUS_LOGITS_TOKENS).to_string();
    let (wd, hd) = (p.weights.dtype, p.hidden.dtype);
    f.for_loop_u(&half, count, &step, |f, j| {
        let r = picked_row(f, j);
        let r64 = f.zext64_u(&r);
        let hrow = f.v(format!("mul i64 {r64}, {dim64}"));
        let acc = f.var_u("float", "0.0");
        f.for_loop_u("0", "%dim", "1", |f, k| {
            let k64 = f.zext64_u(k);
            let wi = f.v(format!("add i64 {wrow}, {k64}"));
            let w = load_elem(f, &crate::params::arg::WEIGHTS, &crate::ir::I64::raw(wi), wd);
            let hi = f.v(format!("add i64 {hrow}, {k64}"));
            let h = load_elem(f, &crate::params::arg::HIDDEN, &crate::ir::I64::raw(hi), hd);
            let cur = f.get_u(&acc);
            let nv = f.v(format!("call float @llvm.fma.f32(float {w}, float {h}, float {cur})"));
            f.set_u(&acc, &nv);
        });
        let raw = f.get_u(&acc);
        store_logit(f, p, &v, j, count, &raw);
    });
}

/// Token `v` of picked row `j` (when both exist): DESIGN.md steps 3–4 on its matmul value
/// `raw` with the row's parameters, then `x`, its sort key and its index into the pick's
/// buffers, and with `%raw` its raw logit (step 10).
fn store_logit(f: &mut Func, p: &Pipeline, v: &str, j: &str, count: &str, raw: &str) {
    let v_ok = f.ult_u(v, "%vocab");
    let j_ok = f.ult_u(j, count);
    let ok = f.and1_u(&v_ok, &j_ok);
    f.if_then_u(&ok, |f| {
        let r = picked_row(f, j);
        let (inv_t, t_zero) = RowTransform::temperature(f, p, &r);
        let (pen, lb) = RowTransform::tables(f, p, &r);
        let row = RowTransform { inv_t, t_zero, pen, lb };
        let words = f.add_u("%vocab", "31");
        let words = f.v(format!("lshr i32 {words}, 5"));
        let wi = f.mul_u(&r, &words);
        let wcol = f.v(format!("lshr i32 {v}, 5"));
        let wi = f.add_u(&wi, &wcol);
        let wi64 = f.zext64_u(&wi);
        let word = |f: &mut Func, table: &str| {
            let a = f.gaddr_u(table, &wi64, 4);
            f.v(format!("load i32, ptr addrspace(1) {a}, align 4"))
        };
        let pen_word = p.has_penalties().then(|| word(f, "%pen_bits"));
        let lb_word = p.has_logit_bias().then(|| word(f, "%lb_bits"));
        let mask_word = p.has_mask().then(|| word(f, "%allowed"));
        let v64 = f.zext64_u(v);
        let bias = if p.has_bias() {
            let a = f.gaddr_u("%bias", &v64, 4);
            f.v(format!("load float, ptr addrspace(1) {a}, align 4"))
        } else {
            String::new()
        };
        let bit = f.v(format!("and i32 {v}, 31"));
        let bits = TokenBits { v, bit: &bit, v_ok: "true", pen_word: pen_word.as_deref(), lb_word: lb_word.as_deref() };
        let xv = transform_token(f, &p.transforms, &row, raw, &bias, &bits);
        let x = match &mask_word {
            Some(w) => {
                let sh = f.v(format!("lshr i32 {w}, {bit}"));
                let allowed = f.v(format!("trunc i32 {sh} to i1"));
                f.sel_u("float", &allowed, &xv, NEG_INF)
            }
            None => xv,
        };
        let e = row_elem(f, j, &v64);
        let a = f.gaddr_u("%x", &e, 4);
        f.s(format!("store float {x}, ptr addrspace(1) {a}, align 4"));
        let key = f.order_key_u(&x);
        let key = f.v(format!("xor i32 {key}, -1"));
        let a = f.gaddr_u("%keys", &e, 4);
        f.s(format!("store i32 {key}, ptr addrspace(1) {a}, align 4"));
        let a = f.gaddr_u("%vals", &e, 4);
        f.s(format!("store i32 {v}, ptr addrspace(1) {a}, align 4"));
        let has_raw = f.v("icmp ne ptr addrspace(1) %raw, null");
        f.if_then_u(&has_raw, |f| {
            let rv = model_logit(f, &p.transforms, raw, &bias, "true");
            let a = f.gaddr_u("%raw", &e, 4);
            f.s(format!("store float {rv}, ptr addrspace(1) {a}, align 4"));
        });
    });
}
