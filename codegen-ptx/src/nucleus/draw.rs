//! `flashsample_nucleus_draw`: per sample, `abi::filter::draw` over the kept prefix of a
//! picked row's sorted tokens, then the row's outputs. Each CTA takes [`NUCLEUS_DRAW_TILE`]
//! entries: per entry `x + gumbel_f32(noise_bits(..))` with the row's token stream (stage
//! one's noise of that token), the best by (score, lower token) over the CTA's warps folded
//! into `best[pick, s]` by a 64-bit atomic max of (score's order key, `!token`), a total
//! order equal to `better_draw`'s. The last CTA of the row to finish (a counter the pick
//! kernel zeroed) writes each sample's token, score (recomputed from the winner, so exactly
//! the abi's f32 sum), logit (the raw one with `%raw`, step 10) and status 0; an empty kept
//! set (no eligible token) is status 1, as the host path's.

use super::{fence_gpu, pick_count, picked_row, row_elem, NUCLEUS_DRAW_TILE, NUCLEUS_THREADS};
use crate::ir::{Func, NEG_INF};
use crate::math;
use crate::params::NUCLEUS_DRAW;
use flashsample_abi::{RowStatus, INDEX_NONE};

pub(crate) const NAME: &str = "flashsample_nucleus_draw";

/// Token `tok`'s score in sample `s`: `x + gumbel(noise)` (x of pick `j`).
fn score(f: &mut Func, x: &str, tok: &str, s: &str, ctr_row: &str, word3: &str, key: (&str, &str)) -> String {
    let g = f.add(tok, "%vocab_offset");
    let bits = math::token_bits(f, &g, ctr_row, s, word3, key);
    let gum = f.v(format!("call float @fs_gumbel_f32(i32 {bits})"));
    f.fadd(x, &gum)
}

pub(super) fn emit() -> String {
    let mut f = Func::new();
    let tid = f.sreg("tid.x");
    let lane = f.v(format!("and i32 {tid}, 31"));
    let lane0 = f.v(format!("icmp eq i32 {lane}, 0"));
    let tid0 = f.v(format!("icmp eq i32 {tid}, 0"));
    let none = (INDEX_NONE as i32).to_string();
    let count = pick_count(&mut f);
    let j = f.sreg("ctaid.y");
    let live = f.ult(&j, &count);
    f.if_then(&live, |f| {
        let r = picked_row(f, &j);
        let r64 = f.zext64(&r);
        let j64 = f.zext64(&j);
        let ka = f.gaddr("%kept", &j64, 4);
        let kept = f.v(format!("load i32, ptr addrspace(1) {ka}, align 4"));
        let has_rs = f.v("icmp ne ptr addrspace(1) %row_seeds, null");
        let (key_lo, key_hi, ctr_row) = math::row_stream(f, &has_rs, &r, &r64);
        let word3 = math::token_word3(f, &r64);
        let key = (key_lo.as_str(), key_hi.as_str());
        let tile = f.sreg("ctaid.x");
        let first = f.mul(&tile, &NUCLEUS_DRAW_TILE.to_string());
        let start = f.add(&first, &tid);
        let end = f.add(&first, &NUCLEUS_DRAW_TILE.to_string());
        let over = f.v(format!("icmp ugt i32 {end}, {kept}"));
        let end = f.sel("i32", &over, &kept, &end);
        let x_of = |f: &mut Func, tok: &str, buf: &str| {
            let t64 = f.zext64(tok);
            let at = row_elem(f, &j, &t64);
            let a = f.gaddr(buf, &at, 4);
            f.v(format!("load float, ptr addrspace(1) {a}, align 4"))
        };
        f.for_loop("0", "%samples", "1", |f, s| {
            let bs = f.var("float", NEG_INF);
            let bi = f.var("i32", &none);
            f.for_loop(&start, &end, &NUCLEUS_THREADS.to_string(), |f, e| {
                let e64 = f.zext64(e);
                let at = row_elem(f, &j, &e64);
                let a = f.gaddr("%vals", &at, 4);
                let tok = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
                let x = x_of(f, &tok, "%x");
                let sc = score(f, &x, &tok, s, &ctr_row, &word3, key);
                let (s0, i0) = (f.get(&bs), f.get(&bi));
                let take = f.beats(&sc, &tok, &s0, &i0);
                let ns = f.sel("float", &take, &sc, &s0);
                let ni = f.sel("i32", &take, &tok, &i0);
                f.set(&bs, &ns);
                f.set(&bi, &ni);
            });
            let best = (f.get(&bs), f.get(&bi), NEG_INF.to_string());
            let (ws, wi, _) = f.shfl_best(best, &[16, 8, 4, 2, 1]);
            let real = f.v(format!("icmp ne i32 {wi}, {none}"));
            let publish = f.and1(&lane0, &real);
            f.if_then(&publish, |f| {
                let hi = f.order_key(&ws);
                let hi = f.v(format!("zext i32 {hi} to i64"));
                let hi = f.v(format!("shl i64 {hi}, 32"));
                let lo = f.v(format!("xor i32 {wi}, -1"));
                let lo = f.v(format!("zext i32 {lo} to i64"));
                let k = f.v(format!("or i64 {hi}, {lo}"));
                let slot = f.mul(&j, "%samples");
                let slot = f.add(&slot, s);
                let s64 = f.zext64(&slot);
                let a = f.gaddr("%best", &s64, 8);
                f.s(format!("atomicrmw umax ptr addrspace(1) {a}, i64 {k} monotonic, align 8"));
            });
        });
        // The last CTA of the row sees every CTA's maxima.
        fence_gpu(f);
        f.barrier();
        let last_at = f.v("getelementptr i32, ptr addrspace(3) @fs_nucleus_last, i32 0");
        f.if_then(&tid0, |f| {
            let a = f.gaddr("%done", &j64, 4);
            let prev = f.v(format!("atomicrmw add ptr addrspace(1) {a}, i32 1 monotonic, align 4"));
            let ctas = f.sreg("nctaid.x");
            let final_cta = f.v(format!("sub i32 {ctas}, 1"));
            let last = f.v(format!("icmp eq i32 {prev}, {final_cta}"));
            let last = f.v(format!("zext i1 {last} to i32"));
            f.s(format!("store i32 {last}, ptr addrspace(3) {last_at}, align 4"));
        });
        f.barrier();
        let last = f.v(format!("load i32, ptr addrspace(3) {last_at}, align 4"));
        let last = f.v(format!("icmp ne i32 {last}, 0"));
        let write = f.and1(&last, &tid0);
        f.if_then(&write, |f| {
            fence_gpu(f);
            let status = f.var("i32", &RowStatus::Ok.code().to_string());
            f.for_loop("0", "%samples", "1", |f, s| {
                let slot = f.mul(&j, "%samples");
                let slot = f.add(&slot, s);
                let s64 = f.zext64(&slot);
                let a = f.gaddr("%best", &s64, 8);
                let k = f.v(format!("atomicrmw or ptr addrspace(1) {a}, i64 0 monotonic, align 8"));
                let empty = f.v(format!("icmp eq i64 {k}, 0"));
                f.if_else(
                    &empty,
                    |f| f.set(&status, &RowStatus::AllMasked.code().to_string()),
                    |f| {
                        let lo = f.v(format!("trunc i64 {k} to i32"));
                        let tok = f.v(format!("xor i32 {lo}, -1"));
                        let x = x_of(f, &tok, "%x");
                        let sc = score(f, &x, &tok, s, &ctr_row, &word3, key);
                        let logit = f.var("float", &x);
                        let has_raw = f.v("icmp ne ptr addrspace(1) %raw, null");
                        f.if_then(&has_raw, |f| {
                            let rv = x_of(f, &tok, "%raw");
                            f.set(&logit, &rv);
                        });
                        let logit = f.get(&logit);
                        let o = f.mul(&r, "%samples");
                        let o = f.add(&o, s);
                        let o64 = f.zext64(&o);
                        for (ptr, ty, v) in [("%out_tokens", "i32", &tok), ("%out_scores", "float", &sc), ("%out_logits", "float", &logit)] {
                            let a = f.gaddr(ptr, &o64, 4);
                            f.s(format!("store {ty} {v}, ptr addrspace(1) {a}, align 4"));
                        }
                    },
                );
            });
            let st = f.get(&status);
            let a = f.gaddr("%out_status", &r64, 4);
            f.s(format!("store i32 {st}, ptr addrspace(1) {a}, align 4"));
        });
    });
    f.s("ret void");
    let mut out = String::from("@fs_nucleus_last = internal addrspace(3) global [1 x i32] undef, align 4\n");
    out.push_str(&f.finish(&NUCLEUS_DRAW.llvm_header(NAME, &format!("\"nvvm.maxntid\"=\"{NUCLEUS_THREADS}\""))));
    out
}
