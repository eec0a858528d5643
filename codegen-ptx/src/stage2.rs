//! The stage-two kernel `flashsample_stage2`: one CTA of [`STAGE2_THREADS`] per batch row
//! reduces the row's candidates over tiles (max score, ties to the lower index; any
//! `INDEX_NONFINITE` tile → `RowStatus::NonFinite`; no candidate → `RowStatus::AllMasked`)
//! and sums the logsumexp partials exactly (`abi::LseSum`): the processed ones and, in the raw
//! logprob mode (DESIGN.md step 10), the raw logits' ones.

use crate::config::STAGE2_THREADS;
use crate::ir::{Func, Var, NEG_INF};
use crate::lse;
use crate::params::STAGE2;
use flashsample_abi::lse::{EMPTY_WINDOW, KEPT_WINDOWS};
use flashsample_abi::{RowStatus, INDEX_NONE, INDEX_NONFINITE};

pub(crate) const NAME: &str = "flashsample_stage2";
const WARPS: u32 = STAGE2_THREADS / 32;

/// Static shared scratch: per warp score, index, logit, flag (4 × 8 words); and per warp its
/// logsumexp sum (window, then the three u128 sums, as four i128).
pub(crate) const SCRATCH_DECL: &str = "@fs_stage2_scratch = internal addrspace(3) global [32 x i32] undef, align 4
@fs_stage2_lse = internal addrspace(3) global [32 x i128] undef, align 16
";

/// Field `field` (0: window, 1..=3: sums) of warp `warp`'s logsumexp sum in the scratch.
fn lse_scratch(f: &mut Func, warp: &str, field: u32) -> String {
    let i = f.mul_u(warp, "4");
    let i = f.add_u(&i, &field.to_string());
    f.v(format!("getelementptr i128, ptr addrspace(3) @fs_stage2_lse, i32 {i}"))
}

fn scratch(f: &mut Func, field: u32, warp: &str) -> String {
    let i = f.add_u(warp, &(field * WARPS).to_string());
    f.v(format!(
        "getelementptr i32, ptr addrspace(3) @fs_stage2_scratch, i32 {i}"
    ))
}

pub(crate) fn emit() -> String {
    let mut f = Func::new();
    let row = f.sreg_u("ctaid.x");
    let tid = f.sreg_u("tid.x");
    let warp = f.v(format!("lshr i32 {tid}, 5"));
    let lane = f.v(format!("and i32 {tid}, 31"));
    let in_batch = f.ult_u(&row, "%batch");
    let none = INDEX_NONE as i32;
    let nonfinite = INDEX_NONFINITE as i32;


    // The grid is exactly `batch` CTAs; the guard keeps a larger grid harmless.
    f.if_then_u(&in_batch, |f| {
        let status = f.var_u("i32", &RowStatus::Ok.code().to_string());
        let lane0 = f.v(format!("icmp eq i32 {lane}, 0"));
        let tid0 = f.v(format!("icmp eq i32 {tid}, 0"));
        f.for_loop_u("0", "%samples", "1", |f, s| {
            let bs = f.var_u("float", NEG_INF);
            let bi = f.var_u("i32", &none.to_string());
            let bl = f.var_u("float", NEG_INF);
            let flag = f.var_u("i32", "0");
            let base = f.mul_u(&row, "%samples");
            let base = f.add_u(&base, s);
            let base = f.mul_u(&base, "%tiles");
            f.for_loop_u(&tid, "%tiles", &STAGE2_THREADS.to_string(), |f, tile| {
                let slot = f.add_u(&base, tile);
                let s64 = f.zext64_u(&slot);
                let a = f.gaddr_u("%candidates", &s64, 12);
                let cs = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
                let a1 = f.v(format!("getelementptr i8, ptr addrspace(1) {a}, i64 4"));
                let ci = f.v(format!("load i32, ptr addrspace(1) {a1}, align 4"));
                let a2 = f.v(format!("getelementptr i8, ptr addrspace(1) {a}, i64 8"));
                let cl = f.v(format!("load float, ptr addrspace(1) {a2}, align 4"));
                let is_none = f.v(format!("icmp eq i32 {ci}, {none}"));
                // A tile winner whose score is NaN or +inf (a transformed logit past f32) makes
                // the row non-finite, as `abi::StageTwo::reduce` says.
                let bad_score = f.v(format!("fcmp uge float {cs}, 0x7FF0000000000000"));
                let live = f.v(format!("xor i1 {is_none}, true"));
                let bad_score = f.and1_u(&bad_score, &live);
                let is_nf = f.v(format!("icmp eq i32 {ci}, {nonfinite}"));
                let is_nf = f.v(format!("or i1 {is_nf}, {bad_score}"));
                let fl = f.get_u(&flag);
                let nf32 = f.v(format!("zext i1 {is_nf} to i32"));
                let fl = f.v(format!("or i32 {fl}, {nf32}"));
                f.set_u(&flag, &fl);
                let real = f.v(format!("or i1 {is_nf}, {is_none}"));
                let real = f.v(format!("xor i1 {real}, true"));
                let (s0, i0, l0) = (f.get_u(&bs), f.get_u(&bi), f.get_u(&bl));
                let b = f.beats_u(&cs, &ci, &s0, &i0);
                let take = f.and1_u(&real, &b);
                let v = f.sel_u("float", &take, &cs, &s0);
                f.set_u(&bs, &v);
                let v = f.sel_u("i32", &take, &ci, &i0);
                f.set_u(&bi, &v);
                let v = f.sel_u("float", &take, &cl, &l0);
                f.set_u(&bl, &v);
            });
            let mut lane_best = (f.get_u(&bs), f.get_u(&bi), f.get_u(&bl));
            let mut fl = f.get_u(&flag);
            for sh in [16, 8, 4, 2, 1] {
                let os = f.shfl_xor_f32_u(&lane_best.0, sh);
                let oi = f.shfl_xor_i32_u(&lane_best.1, sh);
                let ol = f.shfl_xor_f32_u(&lane_best.2, sh);
                let of = f.shfl_xor_i32_u(&fl, sh);
                fl = f.v(format!("or i32 {fl}, {of}"));
                lane_best = f.keep_best_u(lane_best, (&os, &oi, &ol));
            }
            let (s1, i1, l1) = lane_best;
            f.if_then_u(&lane0, |f| {
                for (field, ty, v) in [
                    (0, "float", &s1),
                    (1, "i32", &i1),
                    (2, "float", &l1),
                    (3, "i32", &fl),
                ] {
                    let a = scratch(f, field, &warp);
                    f.s(format!("store {ty} {v}, ptr addrspace(3) {a}, align 4"));
                }
            });
            f.barrier();
            f.if_then_u(&tid0, |f| {
                let mut best = (NEG_INF.to_string(), none.to_string(), NEG_INF.to_string());
                let mut f2 = "0".to_string();
                for w in 0..WARPS {
                    let w = w.to_string();
                    let ld = |f: &mut Func, field: u32, ty: &str| {
                        let a = scratch(f, field, &w);
                        f.v(format!("load {ty}, ptr addrspace(3) {a}, align 4"))
                    };
                    let (ws, wi, wl, wf) = (
                        ld(f, 0, "float"),
                        ld(f, 1, "i32"),
                        ld(f, 2, "float"),
                        ld(f, 3, "i32"),
                    );
                    f2 = f.v(format!("or i32 {f2}, {wf}"));
                    best = f.keep_best_u(best, (&ws, &wi, &wl));
                }
                let (s2, i2, l2) = best;
                let out = f.mul_u(&row, "%samples");
                let out = f.add_u(&out, s);
                let o64 = f.zext64_u(&out);
                for (ptr, ty, v) in [
                    ("%out_tokens", "i32", &i2),
                    ("%out_scores", "float", &s2),
                    ("%out_logits", "float", &l2),
                ] {
                    let a = f.gaddr_u(ptr, &o64, 4);
                    f.s(format!("store {ty} {v}, ptr addrspace(1) {a}, align 4"));
                }
                // Status: non-finite anywhere wins over an empty sample (the larger code).
                let nf = f.v(format!("icmp ne i32 {f2}, 0"));
                let empty = f.v(format!("icmp eq i32 {i2}, {none}"));
                let (ok, masked, nonfinite) = (RowStatus::Ok.code(), RowStatus::AllMasked.code(), RowStatus::NonFinite.code());
                let this = f.sel_u("i32", &empty, &masked.to_string(), &ok.to_string());
                let this = f.sel_u("i32", &nf, &nonfinite.to_string(), &this);
                let cur = f.get_u(&status);
                let hi = f.v(format!("icmp ugt i32 {this}, {cur}"));
                let st = f.sel_u("i32", &hi, &this, &cur);
                f.set_u(&status, &st);
            });
            // The next sample rewrites the scratch just read.
            f.barrier();
        });

        f.if_then_u(&tid0, |f| {
            let st = f.get_u(&status);
            let r64 = f.zext64_u(&row);
            let a = f.gaddr_u("%out_status", &r64, 4);
            f.s(format!("store i32 {st}, ptr addrspace(1) {a}, align 4"));
        });

        // The processed row logsumexp; the targets take the raw one when there is one.
        let raw_in = f.v("icmp ne ptr addrspace(1) %raw_lse, null");
        let proc_targets = f.v(format!("xor i1 {raw_in}, true"));
        row_logsumexp(f, &row, &tid, &warp, &lane0, &tid0, &status, ("%lse", "%out_lse"), &proc_targets);
        // DESIGN.md step 10: the raw row logsumexp, from the raw logits' partials.
        row_logsumexp(f, &row, &tid, &warp, &lane0, &tid0, &status, ("%raw_lse", "%out_raw_lse"), "true");
    });
    f.s("ret void");
    f.finish(&STAGE2.llvm_header(NAME, &format!("\"nvvm.maxntid\"=\"{STAGE2_THREADS}\"")))
}

/// The row's logsumexp from the `(partials, out)` pair (both non-null, else nothing), and,
/// when `targets` (an i1) holds, the target's logit turned into its logprob with it (step 7b).
/// Uniform over the CTA (its barrier is safe).
#[allow(clippy::too_many_arguments)]
fn row_logsumexp(f: &mut Func, row: &str, tid: &str, warp: &str, lane0: &str, tid0: &str, status: &Var, (partials, out): (&str, &str), targets: &str) {
    let lse_in = f.v(format!("icmp ne ptr addrspace(1) {partials}, null"));
    let lse_out = f.v(format!("icmp ne ptr addrspace(1) {out}, null"));
    let both = f.and1_u(&lse_in, &lse_out);
    // Uniform over the CTA, so the barrier inside is safe.
    f.if_then_u(&both, |f| {
        // abi::LseSum: each thread sums its tiles' partials in u128, then the lanes, then the
        // warps; the sum is exact, so its order does not matter.
        let w = f.var_u("i32", &EMPTY_WINDOW.to_string());
        let sums: [Var; KEPT_WINDOWS] = std::array::from_fn(|_| f.var_u("i128", "0"));
        let base = f.mul_u(row, "%tiles");
        f.for_loop_u(tid, "%tiles", &STAGE2_THREADS.to_string(), |f, tile| {
            let i = f.add_u(&base, tile);
            let i64v = f.zext64_u(&i);
            let part = lse::load_partial_wide_u(f, partials, &i64v);
            let cur = (f.get_u(&w), sums.each_ref().map(|v| f.get_u(v)));
            let (nw, ns) = lse::merge_call_u(f, true, &cur, &part);
            f.set_u(&w, &nw);
            for (v, x) in sums.iter().zip(&ns) {
                f.set_u(v, x);
            }
        });
        let mine = (f.get_u(&w), sums.each_ref().map(|v| f.get_u(v)));
        let warp_sum = lse::warp_merge_u(f, true, mine, &[16, 8, 4, 2, 1]);
        f.if_then_u(lane0, |f| {
            let a = lse_scratch(f, warp, 0);
            let wide = f.v(format!("sext i32 {} to i128", warp_sum.0));
            f.s(format!("store i128 {wide}, ptr addrspace(3) {a}, align 16"));
            for (k, v) in warp_sum.1.iter().enumerate() {
                let a = lse_scratch(f, warp, k as u32 + 1);
                f.s(format!("store i128 {v}, ptr addrspace(3) {a}, align 16"));
            }
        });
        f.barrier();
        f.if_then_u(tid0, |f| {
            let mut acc = (EMPTY_WINDOW.to_string(), std::array::from_fn(|_| "0".to_string()));
            for wi in 0..WARPS {
                let wi = wi.to_string();
                let a = lse_scratch(f, &wi, 0);
                let ww = f.v(format!("load i128, ptr addrspace(3) {a}, align 16"));
                let ww = f.v(format!("trunc i128 {ww} to i32"));
                let ws = std::array::from_fn(|k| {
                    let a = lse_scratch(f, &wi, k as u32 + 1);
                    f.v(format!("load i128, ptr addrspace(3) {a}, align 16"))
                });
                acc = lse::merge_call_u(f, true, &acc, &(ww, ws));
            }
            let l = f.v(format!(
                "call float @fs_lse_finish(i32 {}, i128 {}, i128 {}, i128 {})",
                acc.0, acc.1[0], acc.1[1], acc.1[2]
            ));
            let r64 = f.zext64_u(row);
            let a = f.gaddr_u(out, &r64, 4);
            f.s(format!("store float {l}, ptr addrspace(1) {a}, align 4"));
            // Step 7b: the target's logit becomes its logprob (NaN for a failed row).
            let has_targets = f.v("icmp ne ptr addrspace(1) %target_logprobs, null");
            let has_targets = f.and1_u(&has_targets, targets);
            f.if_then_u(&has_targets, |f| {
                let a = f.gaddr_u("%target_logprobs", &r64, 4);
                let x = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
                let lp = f.fsub_u(&x, &l);
                let st = f.get_u(status);
                let ok = f.v(format!("icmp eq i32 {st}, {}", RowStatus::Ok.code()));
                let lp = f.sel_u("float", &ok, &lp, "0x7FF8000000000000");
                f.s(format!("store float {lp}, ptr addrspace(1) {a}, align 4"));
            });
        });
        // A second call rewrites the scratch thread 0 just read.
        f.barrier();
    });
}
