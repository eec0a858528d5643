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
use crate::entries::{beats, Candidate};
use crate::ir::{i32c, Atomic, Func, Global, Icmp, Int, Ptr, Shared, F32, I32, I64};
use crate::math::{self, RowStream};
use crate::params::{arg, NUCLEUS_DRAW};
use flashsample_abi::{RowStatus, INDEX_NONE};

pub(crate) const NAME: &str = "flashsample_nucleus_draw";

/// The CTA's "am I the row's last CTA" flag ([`emit`] declares it).
const LAST: Ptr<Shared> = Ptr::named("@fs_nucleus_last");

/// Token `tok`'s score in sample `s`: `x + gumbel(noise)` (x of pick `j`).
fn score(f: &mut Func, x: &F32, tok: &I32, s: &I32, stream: &RowStream, word3: &I32) -> F32 {
    let g = f.add(tok, &arg::VOCAB_OFFSET);
    let bits = math::token_bits(f, &g, stream, s, word3);
    let gum = math::gumbel(f, &bits);
    f.fadd(x, &gum)
}

pub(super) fn emit() -> String {
    let mut f = Func::new();
    let tid = f.sreg("tid.x");
    let lane = f.and(&tid, &i32c(31));
    let lane0 = f.icmp(Icmp::Eq, &lane, &i32c(0));
    let tid0 = f.icmp(Icmp::Eq, &tid, &i32c(0));
    let none = i32c(INDEX_NONE as i32);
    let count = pick_count(&mut f);
    let j = f.sreg("ctaid.y");
    let live = f.icmp(Icmp::Ult, &j, &count);
    f.if_then(&live, |f| {
        let r = picked_row(f, &j);
        let r64 = f.zext(&r);
        let j64 = f.zext(&j);
        let ka = f.gaddr(&arg::KEPT, &j64, 4);
        let kept: I32 = f.load(&ka, 4);
        let has_rs = f.non_null(&arg::ROW_SEEDS);
        let stream = math::row_stream(f, &has_rs, &r, &r64);
        let word3 = math::token_word3(f, &r64);
        let tile = f.sreg("ctaid.x");
        let first = f.mul(&tile, &i32c(NUCLEUS_DRAW_TILE));
        let start = f.add(&first, &tid);
        let end = f.add(&first, &i32c(NUCLEUS_DRAW_TILE));
        let over = f.icmp(Icmp::Ugt, &end, &kept);
        let end = f.sel(&over, &kept, &end);
        let x_of = |f: &mut Func, tok: &I32, buf: &Ptr<Global>| -> F32 {
            let t64 = f.zext(tok);
            let at = row_elem(f, &j, &t64);
            let a = f.gaddr(buf, &at, 4);
            f.load(&a, 4)
        };
        f.for_loop(&i32c(0), &arg::SAMPLES, &i32c(1), |f, s| {
            let bs = f.var(&F32::NEG_INF);
            let bi = f.var(&none);
            f.for_loop(&start, &end, &i32c(NUCLEUS_THREADS), |f, e| {
                let e64 = f.zext(e);
                let at = row_elem(f, &j, &e64);
                let a = f.gaddr(&arg::VALS, &at, 4);
                let tok = f.load(&a, 4);
                let x = x_of(f, &tok, &arg::X);
                let sc = score(f, &x, &tok, s, &stream, &word3);
                let (s0, i0) = (f.get(&bs), f.get(&bi));
                let take = beats(f, &sc, &tok, &s0, &i0);
                let ns = f.sel(&take, &sc, &s0);
                let ni = f.sel(&take, &tok, &i0);
                f.set(&bs, &ns);
                f.set(&bi, &ni);
            });
            let best = Candidate { score: f.get(&bs), index: f.get(&bi), logit: F32::NEG_INF };
            let w = best.shfl_best(f, &[16, 8, 4, 2, 1]);
            let real = f.icmp(Icmp::Ne, &w.index, &none);
            let publish = f.and(&lane0, &real);
            f.if_then(&publish, |f| {
                let hi = f.order_key(&w.score);
                let hi: I64 = f.zext(&hi);
                let hi = f.shl(&hi, &I64::c(32));
                let lo = f.not(&w.index);
                let lo = f.zext(&lo);
                let k = f.or(&hi, &lo);
                let slot = f.mul(&j, &arg::SAMPLES);
                let slot = f.add(&slot, s);
                let s64 = f.zext(&slot);
                let a = f.gaddr(&arg::BEST, &s64, 8);
                f.atomic_update(Atomic::Umax, &a, &k, Some(8));
            });
        });
        // The last CTA of the row sees every CTA's maxima.
        fence_gpu(f);
        f.barrier();
        let last_at = f.element::<_, I32>(&LAST, &i32c(0));
        f.if_then(&tid0, |f| {
            let a = f.gaddr(&arg::DONE, &j64, 4);
            let prev = f.atomic(Atomic::Add, &a, &i32c(1), Some(4));
            let ctas = f.sreg("nctaid.x");
            let final_cta = f.sub(&ctas, &i32c(1));
            let last = f.icmp(Icmp::Eq, &prev, &final_cta);
            let last: I32 = f.zext(&last);
            f.store(&last, &last_at, 4);
        });
        f.barrier();
        let last = f.load(&last_at, 4);
        let last = f.icmp(Icmp::Ne, &last, &i32c(0));
        let write = f.and(&last, &tid0);
        f.if_then(&write, |f| {
            fence_gpu(f);
            let status = f.var(&i32c(RowStatus::Ok.code()));
            f.for_loop(&i32c(0), &arg::SAMPLES, &i32c(1), |f, s| {
                let slot = f.mul(&j, &arg::SAMPLES);
                let slot = f.add(&slot, s);
                let s64 = f.zext(&slot);
                let a = f.gaddr(&arg::BEST, &s64, 8);
                let k = f.atomic(Atomic::Or, &a, &I64::c(0), Some(8));
                let empty = f.icmp(Icmp::Eq, &k, &I64::c(0));
                f.if_else(
                    &empty,
                    |f| f.set(&status, &i32c(RowStatus::AllMasked.code())),
                    |f| {
                        let lo: I32 = f.trunc(&k);
                        let tok = f.not(&lo);
                        let x = x_of(f, &tok, &arg::X);
                        let sc = score(f, &x, &tok, s, &stream, &word3);
                        let logit = f.var(&x);
                        let has_raw = f.non_null(&arg::RAW);
                        f.if_then(&has_raw, |f| {
                            let rv = x_of(f, &tok, &arg::RAW);
                            f.set(&logit, &rv);
                        });
                        let logit = f.get(&logit);
                        let o = f.mul(&r, &arg::SAMPLES);
                        let o = f.add(&o, s);
                        let o64 = f.zext(&o);
                        Candidate { score: sc, index: tok, logit }.store_sample(f, &o64);
                    },
                );
            });
            let st = f.get(&status);
            let a = f.gaddr(&arg::OUT_STATUS, &r64, 4);
            f.store(&st, &a, 4);
        });
    });
    f.ret_void();
    let mut out = String::from("@fs_nucleus_last = internal addrspace(3) global [1 x i32] undef, align 4\n");
    out.push_str(&f.finish(&NUCLEUS_DRAW.llvm_header(NAME, &format!("\"nvvm.maxntid\"=\"{NUCLEUS_THREADS}\""))));
    out
}
