//! `flashsample_nucleus_draw`: per sample, `abi::filter::draw` over the kept prefix of a
//! picked row's sorted tokens, then the row's outputs. Each CTA takes [`NUCLEUS_DRAW_TILE`]
//! entries: per entry `x + gumbel_f32(noise_bits(..))` with the row's token stream (stage
//! one's noise of that token), the best by (score, lower token) over the CTA's warps folded
//! into `best[pick, s]` by a 64-bit atomic max of (score's order key, `!token`), a total
//! order equal to `better_draw`'s. The last CTA of the row to finish (a counter the pick
//! kernel zeroed) writes each sample's token, score (recomputed from the winner, so exactly
//! the abi's f32 sum), logit (the raw one with `%raw`, step 10) and status 0; an empty kept
//! set (no eligible token) is status 1, as the host path's.

use super::{fence_gpu, pick_count_u, picked_row_u, row_elem_u, NUCLEUS_DRAW_TILE, NUCLEUS_THREADS};
use crate::ir::{Func, NEG_INF};
use crate::math;
use crate::params::NUCLEUS_DRAW;
use flashsample_abi::{RowStatus, INDEX_NONE};

pub(crate) const NAME: &str = "flashsample_nucleus_draw";

/// Token `tok`'s score in sample `s`: `x + gumbel(noise)` (x of pick `j`).
fn score(f: &mut Func, x: &str, tok: &str, s: &str, ctr_row: &str, word3: &str, key: (&str, &str)) -> String {
    let g = f.add_u(tok, "%vocab_offset");
    let bits = math::token_bits_u(f, &g, ctr_row, s, word3, key);
    let gum = f.v(format!("call float @fs_gumbel_f32(i32 {bits})"));
    f.fadd_u(x, &gum)
}

pub(super) fn emit() -> String {
    let mut f = Func::new();
    let tid = f.sreg_u("tid.x");
    let lane = f.v(format!("and i32 {tid}, 31"));
    let lane0 = f.v(format!("icmp eq i32 {lane}, 0"));
    let tid0 = f.v(format!("icmp eq i32 {tid}, 0"));
    let none = (INDEX_NONE as i32).to_string();
    let count = pick_count_u(&mut f);
    let j = f.sreg_u("ctaid.y");
    let live = f.ult_u(&j, &count);
    f.if_then_u(&live, |f| {
        let r = picked_row_u(f, &j);
        let r64 = f.zext64_u(&r);
        let j64 = f.zext64_u(&j);
        let ka = f.gaddr_u("%kept", &j64, 4);
        let kept = f.v(format!("load i32, ptr addrspace(1) {ka}, align 4"));
        let has_rs = f.v("icmp ne ptr addrspace(1) %row_seeds, null");
        let (key_lo, key_hi, ctr_row) = math::row_stream_u(f, &has_rs, &r, &r64);
        let word3 = math::token_word3_u(f, &r64);
        let key = (key_lo.as_str(), key_hi.as_str());
        let tile = f.sreg_u("ctaid.x");
        let first = f.mul_u(&tile, &NUCLEUS_DRAW_TILE.to_string());
        let start = f.add_u(&first, &tid);
        let end = f.add_u(&first, &NUCLEUS_DRAW_TILE.to_string());
        let over = f.v(format!("icmp ugt i32 {end}, {kept}"));
        let end = f.sel_u("i32", &over, &kept, &end);
        let x_of = |f: &mut Func, tok: &str, buf: &str| {
            let t64 = f.zext64_u(tok);
            let at = row_elem_u(f, &j, &t64);
            let a = f.gaddr_u(buf, &at, 4);
            f.v(format!("load float, ptr addrspace(1) {a}, align 4"))
        };
        f.for_loop_u("0", "%samples", "1", |f, s| {
            let bs = f.var_u("float", NEG_INF);
            let bi = f.var_u("i32", &none);
            f.for_loop_u(&start, &end, &NUCLEUS_THREADS.to_string(), |f, e| {
                let e64 = f.zext64_u(e);
                let at = row_elem_u(f, &j, &e64);
                let a = f.gaddr_u("%vals", &at, 4);
                let tok = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
                let x = x_of(f, &tok, "%x");
                let sc = score(f, &x, &tok, s, &ctr_row, &word3, key);
                let (s0, i0) = (f.get_u(&bs), f.get_u(&bi));
                let take = f.beats_u(&sc, &tok, &s0, &i0);
                let ns = f.sel_u("float", &take, &sc, &s0);
                let ni = f.sel_u("i32", &take, &tok, &i0);
                f.set_u(&bs, &ns);
                f.set_u(&bi, &ni);
            });
            let best = (f.get_u(&bs), f.get_u(&bi), NEG_INF.to_string());
            let (ws, wi, _) = f.shfl_best_u(best, &[16, 8, 4, 2, 1]);
            let real = f.v(format!("icmp ne i32 {wi}, {none}"));
            let publish = f.and1_u(&lane0, &real);
            f.if_then_u(&publish, |f| {
                let hi = f.order_key_u(&ws);
                let hi = f.v(format!("zext i32 {hi} to i64"));
                let hi = f.v(format!("shl i64 {hi}, 32"));
                let lo = f.v(format!("xor i32 {wi}, -1"));
                let lo = f.v(format!("zext i32 {lo} to i64"));
                let k = f.v(format!("or i64 {hi}, {lo}"));
                let slot = f.mul_u(&j, "%samples");
                let slot = f.add_u(&slot, s);
                let s64 = f.zext64_u(&slot);
                let a = f.gaddr_u("%best", &s64, 8);
                f.s(format!("atomicrmw umax ptr addrspace(1) {a}, i64 {k} monotonic, align 8"));
            });
        });
        // The last CTA of the row sees every CTA's maxima.
        fence_gpu(f);
        f.barrier();
        let last_at = f.v("getelementptr i32, ptr addrspace(3) @fs_nucleus_last, i32 0");
        f.if_then_u(&tid0, |f| {
            let a = f.gaddr_u("%done", &j64, 4);
            let prev = f.v(format!("atomicrmw add ptr addrspace(1) {a}, i32 1 monotonic, align 4"));
            let ctas = f.sreg_u("nctaid.x");
            let final_cta = f.v(format!("sub i32 {ctas}, 1"));
            let last = f.v(format!("icmp eq i32 {prev}, {final_cta}"));
            let last = f.v(format!("zext i1 {last} to i32"));
            f.s(format!("store i32 {last}, ptr addrspace(3) {last_at}, align 4"));
        });
        f.barrier();
        let last = f.v(format!("load i32, ptr addrspace(3) {last_at}, align 4"));
        let last = f.v(format!("icmp ne i32 {last}, 0"));
        let write = f.and1_u(&last, &tid0);
        f.if_then_u(&write, |f| {
            fence_gpu(f);
            let status = f.var_u("i32", &RowStatus::Ok.code().to_string());
            f.for_loop_u("0", "%samples", "1", |f, s| {
                let slot = f.mul_u(&j, "%samples");
                let slot = f.add_u(&slot, s);
                let s64 = f.zext64_u(&slot);
                let a = f.gaddr_u("%best", &s64, 8);
                let k = f.v(format!("atomicrmw or ptr addrspace(1) {a}, i64 0 monotonic, align 8"));
                let empty = f.v(format!("icmp eq i64 {k}, 0"));
                f.if_else_u(
                    &empty,
                    |f| f.set_u(&status, &RowStatus::AllMasked.code().to_string()),
                    |f| {
                        let lo = f.v(format!("trunc i64 {k} to i32"));
                        let tok = f.v(format!("xor i32 {lo}, -1"));
                        let x = x_of(f, &tok, "%x");
                        let sc = score(f, &x, &tok, s, &ctr_row, &word3, key);
                        let logit = f.var_u("float", &x);
                        let has_raw = f.v("icmp ne ptr addrspace(1) %raw, null");
                        f.if_then_u(&has_raw, |f| {
                            let rv = x_of(f, &tok, "%raw");
                            f.set_u(&logit, &rv);
                        });
                        let logit = f.get_u(&logit);
                        let o = f.mul_u(&r, "%samples");
                        let o = f.add_u(&o, s);
                        let o64 = f.zext64_u(&o);
                        for (ptr, ty, v) in [("%out_tokens", "i32", &tok), ("%out_scores", "float", &sc), ("%out_logits", "float", &logit)] {
                            let a = f.gaddr_u(ptr, &o64, 4);
                            f.s(format!("store {ty} {v}, ptr addrspace(1) {a}, align 4"));
                        }
                    },
                );
            });
            let st = f.get_u(&status);
            let a = f.gaddr_u("%out_status", &r64, 4);
            f.s(format!("store i32 {st}, ptr addrspace(1) {a}, align 4"));
        });
    });
    f.s("ret void");
    let mut out = String::from("@fs_nucleus_last = internal addrspace(3) global [1 x i32] undef, align 4\n");
    out.push_str(&f.finish(&NUCLEUS_DRAW.llvm_header(NAME, &format!("\"nvvm.maxntid\"=\"{NUCLEUS_THREADS}\""))));
    out
}
