//! The stage-two kernel `flashsample_stage2`: one CTA of [`STAGE2_THREADS`] per batch row
//! reduces the row's candidates over tiles (max score, ties to the lower index; any
//! `INDEX_NONFINITE` tile → `RowStatus::NonFinite`; no candidate → `RowStatus::AllMasked`)
//! and sums the logsumexp partials exactly (`abi::LseSum`): the processed ones and, in the raw
//! logprob mode (DESIGN.md step 10), the raw logits' ones. As a launch's last stage it also
//! finishes the samples (`glue::finish_sample`), in place of `flashsample_finalize`.

use crate::config::STAGE2_THREADS;
use crate::entries::{beats, Candidate, CandidateVar, CANDIDATE_BYTES};
use crate::glue::finish_row;
use crate::ir::{i32c, Fcmp, Func, Global, Icmp, Int, Ptr, Shared, Var, F32, I1, I128, I32};
use crate::lse::{self, Partial};
use crate::params::{arg, STAGE2};
use flashsample_abi::lse::{EMPTY_WINDOW, KEPT_WINDOWS};
use flashsample_abi::{RowStatus, INDEX_NONE, INDEX_NONFINITE};

pub(crate) const NAME: &str = "flashsample_stage2";
const WARPS: u32 = STAGE2_THREADS / 32;

/// Static shared scratch: per warp score, index, logit, flag (4 × 8 words); and per warp its
/// logsumexp sum (window, then the three u128 sums, as four i128).
pub(crate) const SCRATCH_DECL: &str = "@fs_stage2_scratch = internal addrspace(3) global [32 x i32] undef, align 4
@fs_stage2_lse = internal addrspace(3) global [32 x i128] undef, align 16
";

/// The scratch arrays [`SCRATCH_DECL`] declares.
const SCRATCH: Ptr<Shared> = Ptr::named("@fs_stage2_scratch");
const LSE_SCRATCH: Ptr<Shared> = Ptr::named("@fs_stage2_lse");

/// Field `field` (0: window, 1..=3: sums) of warp `warp`'s logsumexp sum in the scratch.
fn lse_scratch(f: &mut Func, warp: &I32, field: u32) -> Ptr<Shared> {
    let i = f.mul(warp, &i32c(4));
    let i = f.add(&i, &i32c(field));
    f.element::<_, I128>(&LSE_SCRATCH, &i)
}

fn scratch(f: &mut Func, field: u32, warp: &I32) -> Ptr<Shared> {
    let i = f.add(warp, &i32c(field * WARPS));
    f.element::<_, I32>(&SCRATCH, &i)
}

pub(crate) fn emit() -> String {
    let mut f = Func::new();
    let row = f.sreg("ctaid.x");
    let tid = f.sreg("tid.x");
    let warp = f.lshr(&tid, &i32c(5));
    let lane = f.and(&tid, &i32c(31));
    let in_batch = f.icmp(Icmp::Ult, &row, &arg::BATCH);
    let none = i32c(INDEX_NONE as i32);
    let nonfinite = i32c(INDEX_NONFINITE as i32);


    // The grid is exactly `batch` CTAs; the guard keeps a larger grid harmless.
    f.if_then(&in_batch, |f| {
        let status = f.var(&i32c(RowStatus::Ok.code()));
        let lane0 = f.icmp(Icmp::Eq, &lane, &i32c(0));
        let tid0 = f.icmp(Icmp::Eq, &tid, &i32c(0));
        f.for_loop(&i32c(0), &arg::SAMPLES, &i32c(1), |f, s| {
            let best = CandidateVar::new(f, &Candidate::none());
            let flag = f.var(&i32c(0));
            let base = f.mul(&row, &arg::SAMPLES);
            let base = f.add(&base, s);
            let base = f.mul(&base, &arg::TILES);
            f.for_loop(&tid, &arg::TILES, &i32c(STAGE2_THREADS), |f, tile| {
                let slot = f.add(&base, tile);
                let s64 = f.zext(&slot);
                let a = f.gaddr(&arg::CANDIDATES, &s64, CANDIDATE_BYTES);
                let c = Candidate::load(f, &a);
                let is_none = f.icmp(Icmp::Eq, &c.index, &none);
                // A tile winner whose score is NaN or +inf (a transformed logit past f32) makes
                // the row non-finite, as `abi::StageTwo::reduce` says.
                let bad_score = f.fcmp(Fcmp::Uge, &c.score, &F32::POS_INF);
                let live = f.not(&is_none);
                let bad_score = f.and(&bad_score, &live);
                let is_nf = f.icmp(Icmp::Eq, &c.index, &nonfinite);
                let is_nf = f.or(&is_nf, &bad_score);
                let fl = f.get(&flag);
                let nf32 = f.zext(&is_nf);
                let fl = f.or(&fl, &nf32);
                f.set(&flag, &fl);
                let real = f.or(&is_nf, &is_none);
                let real = f.not(&real);
                let cur = best.get(f);
                let b = beats(f, &c.score, &c.index, &cur.score, &cur.index);
                let take = f.and(&real, &b);
                let v = f.sel(&take, &c.score, &cur.score);
                f.set(&best.score, &v);
                let v = f.sel(&take, &c.index, &cur.index);
                f.set(&best.index, &v);
                let v = f.sel(&take, &c.logit, &cur.logit);
                f.set(&best.logit, &v);
            });
            let mut lane_best = best.get(f);
            let mut fl = f.get(&flag);
            for sh in [16, 8, 4, 2, 1] {
                let other = Candidate { score: f.shfl_xor(&lane_best.score, sh), index: f.shfl_xor(&lane_best.index, sh), logit: f.shfl_xor(&lane_best.logit, sh) };
                let of = f.shfl_xor(&fl, sh);
                fl = f.or(&fl, &of);
                lane_best = lane_best.keep_best(f, &other);
            }
            f.if_then(&lane0, |f| {
                let a = scratch(f, 0, &warp);
                f.store(&lane_best.score, &a, 4);
                let a = scratch(f, 1, &warp);
                f.store(&lane_best.index, &a, 4);
                let a = scratch(f, 2, &warp);
                f.store(&lane_best.logit, &a, 4);
                let a = scratch(f, 3, &warp);
                f.store(&fl, &a, 4);
            });
            f.barrier();
            f.if_then(&tid0, |f| {
                let mut best = Candidate::none();
                let mut f2 = i32c(0);
                for w in 0..WARPS {
                    let w = i32c(w);
                    let a = scratch(f, 0, &w);
                    let score: F32 = f.load(&a, 4);
                    let a = scratch(f, 1, &w);
                    let index = f.load(&a, 4);
                    let a = scratch(f, 2, &w);
                    let logit = f.load(&a, 4);
                    let a = scratch(f, 3, &w);
                    let wf = f.load(&a, 4);
                    f2 = f.or(&f2, &wf);
                    best = best.keep_best(f, &Candidate { score, index, logit });
                }
                let out = f.mul(&row, &arg::SAMPLES);
                let out = f.add(&out, s);
                let o64 = f.zext(&out);
                best.store_sample(f, &o64);
                // Status: non-finite anywhere wins over an empty sample (the larger code).
                let nf = f.icmp(Icmp::Ne, &f2, &i32c(0));
                let empty = f.icmp(Icmp::Eq, &best.index, &none);
                let (ok, masked, nonfinite) = (RowStatus::Ok.code(), RowStatus::AllMasked.code(), RowStatus::NonFinite.code());
                let this = f.sel(&empty, &i32c(masked), &i32c(ok));
                let this = f.sel(&nf, &i32c(nonfinite), &this);
                let cur = f.get(&status);
                let hi = f.icmp(Icmp::Ugt, &this, &cur);
                let st = f.sel(&hi, &this, &cur);
                f.set(&status, &st);
            });
            // The next sample rewrites the scratch just read.
            f.barrier();
        });

        f.if_then(&tid0, |f| {
            let st = f.get(&status);
            let r64 = f.zext(&row);
            let a = f.gaddr(&arg::OUT_STATUS, &r64, 4);
            f.store(&st, &a, 4);
        });

        // The processed row logsumexp; the targets take the raw one when there is one.
        let raw_in = f.non_null(&arg::RAW_LSE);
        let proc_targets = f.not(&raw_in);
        let th = RowThreads { row: &row, tid: &tid, warp: &warp, lane0: &lane0, tid0: &tid0 };
        row_logsumexp(f, &th, &status, (&arg::LSE, &arg::OUT_LSE), &proc_targets);
        // DESIGN.md step 10: the raw row logsumexp, from the raw logits' partials.
        row_logsumexp(f, &th, &status, (&arg::RAW_LSE, &arg::OUT_RAW_LSE), &I1::TRUE);

        // The launch's last stage finishes its samples (`Stage2Args::finish`); thread 0 wrote
        // the status and the logsumexp it reads, so program order makes them visible.
        let finish = f.icmp(Icmp::Ne, &arg::FINISH, &i32c(0));
        let finish = f.and(&finish, &tid0);
        f.if_then(&finish, |f| {
            let st = f.get(&status);
            let failed = f.icmp(Icmp::Ne, &st, &i32c(RowStatus::Ok.code()));
            let reported = f.sel(&raw_in, &arg::OUT_RAW_LSE, &arg::OUT_LSE);
            finish_row(f, &row, &failed, &reported);
        });
    });
    f.ret_void();
    f.finish(&STAGE2.llvm_header(NAME, &format!("\"nvvm.maxntid\"=\"{STAGE2_THREADS}\"")))
}

/// The CTA's row and the thread's place in it.
struct RowThreads<'a> {
    row: &'a I32,
    tid: &'a I32,
    warp: &'a I32,
    lane0: &'a I1,
    tid0: &'a I1,
}

/// The row's logsumexp from the `(partials, out)` pair (both non-null, else nothing), and,
/// when `targets` (an i1) holds, the target's logit turned into its logprob with it (step 7b).
/// Uniform over the CTA (its barrier is safe).
fn row_logsumexp(f: &mut Func, th: &RowThreads<'_>, status: &Var<I32>, (partials, out): (&Ptr<Global>, &Ptr<Global>), targets: &I1) {
    let lse_in = f.non_null(partials);
    let lse_out = f.non_null(out);
    let both = f.and(&lse_in, &lse_out);
    // Uniform over the CTA, so the barrier inside is safe.
    f.if_then(&both, |f| {
        // abi::LseSum: each thread sums its tiles' partials in u128, then the lanes, then the
        // warps; the sum is exact, so its order does not matter.
        let w = f.var(&i32c(EMPTY_WINDOW));
        let sums: [Var<I128>; KEPT_WINDOWS] = std::array::from_fn(|_| f.var(&I128::c(0)));
        let base = f.mul(th.row, &arg::TILES);
        f.for_loop(th.tid, &arg::TILES, &i32c(STAGE2_THREADS), |f, tile| {
            let i = f.add(&base, tile);
            let i64v = f.zext(&i);
            let part = lse::load_partial_wide(f, partials, &i64v);
            let cur = Partial { window: f.get(&w), sums: sums.each_ref().map(|v| f.get(v)) };
            let merged = lse::merge_all(f, &[cur, part]);
            f.set(&w, &merged.window);
            for (v, x) in sums.iter().zip(&merged.sums) {
                f.set(v, x);
            }
        });
        let mine = Partial { window: f.get(&w), sums: sums.each_ref().map(|v| f.get(v)) };
        let warp_sum = lse::warp_merge(f, mine, &[16, 8, 4, 2, 1]);
        f.if_then(th.lane0, |f| {
            let a = lse_scratch(f, th.warp, 0);
            let wide: I128 = f.sext(&warp_sum.window);
            f.store(&wide, &a, 16);
            for (k, v) in warp_sum.sums.iter().enumerate() {
                let a = lse_scratch(f, th.warp, k as u32 + 1);
                f.store(v, &a, 16);
            }
        });
        f.barrier();
        f.if_then(th.tid0, |f| {
            let mut acc = Partial::<I128>::empty();
            for wi in 0..WARPS {
                let wi = i32c(wi);
                let a = lse_scratch(f, &wi, 0);
                let ww: I128 = f.load(&a, 16);
                let window = f.trunc(&ww);
                let sums = std::array::from_fn(|k| {
                    let a = lse_scratch(f, &wi, k as u32 + 1);
                    f.load(&a, 16)
                });
                acc = lse::merge_all(f, &[acc, Partial { window, sums }]);
            }
            let l = lse::finish_call(f, &acc);
            let r64 = f.zext(th.row);
            let a = f.gaddr(out, &r64, 4);
            f.store(&l, &a, 4);
            // Step 7b: the target's logit becomes its logprob (NaN for a failed row).
            let has_targets = f.non_null(&arg::TARGET_LOGPROBS);
            let has_targets = f.and(&has_targets, targets);
            f.if_then(&has_targets, |f| {
                let a = f.gaddr(&arg::TARGET_LOGPROBS, &r64, 4);
                let x = f.load(&a, 4);
                let lp = f.fsub(&x, &l);
                let st = f.get(status);
                let ok = f.icmp(Icmp::Eq, &st, &i32c(RowStatus::Ok.code()));
                let lp = f.sel(&ok, &lp, &F32::NAN);
                f.store(&lp, &a, 4);
                // Step 7c: a failed row's rank is 0.
                let has_ranks = f.non_null(&arg::TARGET_RANKS);
                let failed = f.not(&ok);
                let clear = f.and(&has_ranks, &failed);
                f.if_then(&clear, |f| {
                    let a = f.gaddr(&arg::TARGET_RANKS, &r64, 4);
                    f.store(&i32c(0), &a, 4);
                });
            });
        });
        // A second call rewrites the scratch thread 0 just read.
        f.barrier();
    });
}
