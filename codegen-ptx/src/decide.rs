//! Speculative verification's decision on the device (DESIGN.md "Speculative verification"):
//! `flashsample_decide`, one CTA of [`DECIDE_THREADS`] per sequence, after stage three, op for
//! op as the host's `verify::decide` for unfiltered and greedy rows (f64 math from
//! [`crate::math64`], the abi's sequences); and `flashsample_spec_targets`, which spreads the
//! `[S·k]` drafts over the `[S·(k+1)]` rows as stage one's targets (the device API's launch
//! has no host to do it).
//!
//! Every thread runs a sequence's decisions redundantly (the same loads and arithmetic give
//! the same branch everywhere, so the CTA's barriers stay uniform); thread 0 writes. Only the
//! residual draw at a rejection is split: the threads stride over the row's tiles for the best
//! stored score (its token's exact residual score `T` prunes the scan) and the bound
//! `max_t ub(last listed score of t)`, then over the row's entries for the exact
//! `ln(p − q) + gumbel_f64` of every listed token whose upper bound `ub(stored score) = s − L
//! + slack` reaches `T`. The scans are chains of dependent global loads, so the CTA is wide
//! (512 threads: a row of ~600–1200 tiles is one to three loads deep per thread). Skipping a
//! token whose bound is below `T` cannot change the argmax, so the winner is the host's
//! (`residual_draw` over every listed token); it is used iff its score beats the bound, else
//! the sequence gets `SpecStatus::Recompute`. A draft row with an active filter reads its
//! survivors as stage three left them (`%kept`): their mass `top + ln Σ exp(x − top)` in list
//! order (the terms in parallel, the sum in every thread in order), `p_j(d)` at the draft
//! token, and at a rejection the residual over them, split over the CTA; a row without
//! survivors (its lists overflowed or its nucleus outgrew them) gets `Recompute`.

use crate::entries::{Candidate, CandidateVar, Scored, CANDIDATE_BYTES, SCORED_BYTES};
use crate::filter::{drawn_in_stage_three, row_filter_or_off};
use crate::ir::{f32c, f64c, i32c, Atomic, Fcmp, Func, Icmp, Ptr, Shared, Var, F32, F64, I1, I32, I64};
use crate::math::{philox_block, row_stream, stream_word3, token_bits, RowStream};
use crate::math64::{self, uniform_f64};
use crate::params::{arg, DECIDE, SPEC_TARGETS};
use flashsample_abi::rng::NoiseStream;
use flashsample_abi::speculative::{SpecStatus, RESIDUAL_BOUND_SLACK};
use flashsample_abi::{RowStatus, INDEX_NONE};
use flashsample_ir::MAX_LIST_CAPACITY;

pub(crate) const NAME: &str = "flashsample_decide";
pub(crate) const TARGETS_NAME: &str = "flashsample_spec_targets";
/// Threads of one `flashsample_decide` CTA (one sequence) and of one
/// `flashsample_spec_targets` CTA (that many rows).
pub const DECIDE_THREADS: u32 = 512;
const WARPS: u32 = DECIDE_THREADS / 32;
/// Residual-list entries a thread loads at once in the residual draw's exact-score scan.
const SCAN_UNROLL: u32 = 4;

/// The decision kernel's shared arrays: name, LLVM element type, element bytes and count. The
/// block reduction's per-warp scratch (score, tie, payload), a filtered row's survivor terms,
/// and three counters (its survivor count, the draft token's entry, and the flag of an invalid
/// draft-distribution entry the residual draw read). The IR interpreter allocates them from
/// this table too.
pub const DECIDE_SHARED: [(&str, &str, usize, usize); 5] = [
    ("@fs_decide_s", "double", 8, WARPS as usize),
    ("@fs_decide_t", "i32", 4, WARPS as usize),
    ("@fs_decide_x", "float", 4, WARPS as usize),
    ("@fs_decide_terms", "double", 8, MAX_LIST_CAPACITY as usize),
    ("@fs_decide_misc", "i32", 4, 3),
];

/// [`DECIDE_SHARED`]'s declarations, and `llvm.fabs.f64`.
pub(crate) fn shared_decls() -> String {
    let mut s: String = DECIDE_SHARED
        .iter()
        .map(|(name, ty, bytes, n)| format!("{name} = internal addrspace(3) global [{n} x {ty}] undef, align {bytes}\n"))
        .collect();
    s.push_str("declare double @llvm.fabs.f64(double)\n");
    s
}

/// The arrays [`shared_decls`] declares.
const SCORES: Ptr<Shared> = Ptr::named("@fs_decide_s");
const TIES: Ptr<Shared> = Ptr::named("@fs_decide_t");
const PAYLOADS: Ptr<Shared> = Ptr::named("@fs_decide_x");
const TERMS: Ptr<Shared> = Ptr::named("@fs_decide_terms");
const MISC: Ptr<Shared> = Ptr::named("@fs_decide_misc");

/// A candidate of the residual draw: f64 score, u32 tie-break (token or tile), f32 payload.
type Best = Candidate<F64>;

/// The CTA's best of every thread's `best`, in every thread (two barriers; uniform).
fn block_best(f: &mut Func, warp: &I32, lane0: &I1, best: Best) -> Best {
    let b = best.shfl_best(f, &[16, 8, 4, 2, 1]);
    f.if_then(lane0, |f| {
        let a = f.element::<_, F64>(&SCORES, warp);
        f.store_natural(&b.score, &a);
        let a = f.element::<_, I32>(&TIES, warp);
        f.store_natural(&b.index, &a);
        let a = f.element::<_, F32>(&PAYLOADS, warp);
        f.store_natural(&b.logit, &a);
    });
    f.barrier();
    let mut acc = Best::none();
    for w in 0..WARPS {
        let w = i32c(w);
        let a = f.element::<_, F64>(&SCORES, &w);
        let score = f.load_natural(&a);
        let a = f.element::<_, I32>(&TIES, &w);
        let index = f.load_natural(&a);
        let a = f.element::<_, F32>(&PAYLOADS, &w);
        let logit = f.load_natural(&a);
        acc = acc.keep_best(f, &Candidate { score, index, logit });
    }
    // The next reduction rewrites the scratch just read.
    f.barrier();
    acc
}

/// A residual-list entry `(score, index, logit)` at entry `slot` (i64).
fn load_candidate(f: &mut Func, slot: &I64) -> Candidate {
    let a = f.gaddr(&arg::RESIDUAL_LISTS, slot, CANDIDATE_BYTES);
    Candidate::load(f, &a)
}

/// `abi::speculative::residual_upper_bound(score, l)`.
fn upper_bound(f: &mut Func, score: &F32, l: &F64) -> F64 {
    let s: F64 = f.fpext(score);
    let a = f.fsub(&s, l);
    let abs: F64 = f.call("@llvm.fabs.f64", &[&s]);
    let b = f.fadd(&f64c(1.0), &abs);
    let c = f.fmul(&f64c(RESIDUAL_BOUND_SLACK), &b);
    f.fadd(&a, &c)
}

/// What one draft row's decision reads besides its row index.
struct Row {
    /// The launch row as i64.
    r64: I64,
    /// `%tiles` and `%per_tile` as i64 (the slot arithmetic's).
    tiles_wide: I64,
    per_tile_wide: I64,
    /// `%draft_probs`' first entry of this draft's distribution (i64), the draft token.
    q_base: I64,
    draft: I32,
    /// The row logsumexp as f64.
    l: F64,
    /// The row's Philox key and counter row.
    stream: RowStream,
}

/// `q_j(v)` as f64: the draft distribution's entry, or `[v = d_j]` for greedy drafts.
fn q_of(f: &mut Func, row: &Row, v: &I32) -> F64 {
    let q = f.var(&f64c(0.0));
    let has = f.non_null(&arg::DRAFT_PROBS);
    f.if_else(
        &has,
        |f| {
            let v64 = f.zext(v);
            let at = f.add(&row.q_base, &v64);
            let a = f.gaddr(&arg::DRAFT_PROBS, &at, 4);
            let x: F32 = f.load(&a, 4);
            let x = f.fpext(&x);
            f.set(&q, &x);
        },
        |f| {
            let same = f.icmp(Icmp::Eq, v, &row.draft);
            let x = f.sel(&same, &f64c(1.0), &f64c(0.0));
            f.set(&q, &x);
        },
    );
    f.get(&q)
}

/// The flag a residual draw raises on reading an invalid draft-distribution entry.
fn bad_q_flag(f: &mut Func) -> Ptr<Shared> {
    f.element::<_, I32>(&MISC, &i32c(2))
}

/// [`q_of`] at a residual candidate `v`, raising [`bad_q_flag`] when the entry is negative,
/// NaN or infinite (`SpecStatus::DraftProbability`).
fn q_checked(f: &mut Func, row: &Row, v: &I32) -> F64 {
    let q = q_of(f, row, v);
    let nonneg = f.fcmp(Fcmp::Oge, &q, &f64c(0.0));
    let finite = f.fcmp(Fcmp::Olt, &q, &F64::POS_INF);
    let valid = f.and(&nonneg, &finite);
    let bad = f.not(&valid);
    f.if_then(&bad, |f| {
        let flag = bad_q_flag(f);
        f.atomic_update(Atomic::Or, &flag, &i32c(1), Some(4));
    });
    q
}

/// The exact residual score `ln(max(0, p − q)) + gumbel_f64(residual bits)` of the listed
/// token `v` with logit `x`: `-inf` when `p ≤ q` (the token is not eligible).
fn exact_score(f: &mut Func, row: &Row, w3: &I32, v: &I32, x: &F32) -> F64 {
    let x64: F64 = f.fpext(x);
    let d = f.fsub(&x64, &row.l);
    let p = math64::exp(f, &d);
    let q = q_checked(f, row, v);
    let w = f.fsub(&p, &q);
    let score = f.var(&F64::NEG_INF);
    let pos = f.fcmp(Fcmp::Ogt, &w, &f64c(0.0));
    f.if_then(&pos, |f| {
        // Keyed by the global token, as stage one's residual lists are.
        let g = f.add(v, &arg::VOCAB_OFFSET);
        let bits = token_bits(f, &g, &row.stream, &i32c(0), w3);
        let gum = math64::gumbel(f, &bits);
        let lw = math64::ln(f, &w);
        let s = f.fadd(&lw, &gum);
        f.set(&score, &s);
    });
    f.get(&score)
}

/// The residual draw of a rejected unfiltered draft row: `(found, token, logit)`, `found`
/// iff some listed token has `p > q` and the best one's exact score beats every unlisted
/// token's bound (the host's `decide`, `Target::Full`). Uniform over the CTA.
fn residual_draw(f: &mut Func, tid: &I32, warp: &I32, lane0: &I1, row: &Row) -> (I1, I32, F32) {
    let w3 = stream_word3(f, &row.r64, NoiseStream::SpecResidual);
    let step = i32c(DECIDE_THREADS);
    let none = i32c(INDEX_NONE as i32);
    let row_tiles = f.mul(&row.r64, &row.tiles_wide);
    let slot = |f: &mut Func, tile: &I32, e: &I32| -> I64 {
        let t64 = f.zext(tile);
        let rt = f.add(&row_tiles, &t64);
        let s = f.mul(&rt, &row.per_tile_wide);
        let e64 = f.zext(e);
        f.add(&s, &e64)
    };
    // Pass one: the best stored score (ties to the lower tile) and the bound.
    let top = (f.var(&F64::NEG_INF), f.var(&none));
    let bound = f.var(&F64::NEG_INF);
    let last_e = f.add(&arg::PER_TILE, &i32c(-1));
    f.for_loop(tid, &arg::TILES, &step, |f, t| {
        let first = slot(f, t, &i32c(0));
        let head = load_candidate(f, &first);
        let live = f.icmp(Icmp::Ne, &head.index, &none);
        let s0: F64 = f.fpext(&head.score);
        let s0 = f.sel(&live, &s0, &F64::NEG_INF);
        let t0 = f.sel(&live, t, &none);
        let cur = Candidate { score: f.get(&top.0), index: f.get(&top.1), logit: f32c(0.0) };
        let best = cur.keep_best(f, &Candidate { score: s0, index: t0, logit: f32c(0.0) });
        f.set(&top.0, &best.score);
        f.set(&top.1, &best.index);
        let last = slot(f, t, &last_e);
        let tail = load_candidate(f, &last);
        let live = f.icmp(Icmp::Ne, &tail.index, &none);
        let ub = upper_bound(f, &tail.score, &row.l);
        let cur = f.get(&bound);
        let gt = f.fcmp(Fcmp::Ogt, &ub, &cur);
        let take = f.and(&live, &gt);
        let nb = f.sel(&take, &ub, &cur);
        f.set(&bound, &nb);
    });
    let mine = Candidate { score: f.get(&top.0), index: f.get(&top.1), logit: f32c(0.0) };
    let top_tile = block_best(f, warp, lane0, mine).index;
    let mine = Candidate { score: f.get(&bound), index: i32c(0), logit: f32c(0.0) };
    let bound = block_best(f, warp, lane0, mine).score;
    // The top entry's exact score prunes the scan (every thread computes it alike).
    let threshold = f.var(&F64::NEG_INF);
    let has_top = f.icmp(Icmp::Ne, &top_tile, &none);
    f.if_then(&has_top, |f| {
        let at = slot(f, &top_tile, &i32c(0));
        let c = load_candidate(f, &at);
        let s = exact_score(f, row, &w3, &c.index, &c.logit);
        f.set(&threshold, &s);
    });
    let thr = f.get(&threshold);
    // Pass two: the exact scores of every listed token whose bound reaches the threshold,
    // striding over the row's entries (not its tiles) so that neighbouring threads read
    // neighbouring entries, [`SCAN_UNROLL`] entries a step with their loads issued together (an
    // entry past the row reloads the last one and is dropped), so a thread waits on global
    // memory once per step.
    let best = CandidateVar::new(f, &Best::none());
    let entries = f.mul(&arg::TILES, &arg::PER_TILE);
    let last_entry = f.add(&entries, &i32c(-1));
    let row_first = f.mul(&row_tiles, &row.per_tile_wide);
    f.for_loop(tid, &entries, &i32c(DECIDE_THREADS * SCAN_UNROLL), |f, e0| {
        let loaded: Vec<(I1, Candidate)> = (0..SCAN_UNROLL)
            .map(|u| {
                let e = f.add(e0, &i32c(u * DECIDE_THREADS));
                let inside = f.icmp(Icmp::Ult, &e, &entries);
                let e = f.umin(&e, &last_entry);
                let e64 = f.zext(&e);
                let at = f.add(&row_first, &e64);
                (inside, load_candidate(f, &at))
            })
            .collect();
        for (inside, c) in loaded {
            let listed = f.icmp(Icmp::Ne, &c.index, &none);
            let live = f.and(&inside, &listed);
            let ub = upper_bound(f, &c.score, &row.l);
            let reach = f.fcmp(Fcmp::Oge, &ub, &thr);
            let go = f.and(&live, &reach);
            f.if_then(&go, |f| {
                let es = exact_score(f, row, &w3, &c.index, &c.logit);
                // A `-inf` score (p ≤ q) is not eligible: it never enters the argmax.
                let eligible = f.fcmp(Fcmp::Ogt, &es, &F64::NEG_INF);
                f.if_then(&eligible, |f| {
                    let cur = best.get(f);
                    let next = cur.keep_best(f, &Candidate { score: es, index: c.index.clone(), logit: c.logit.clone() });
                    best.set(f, &next);
                });
            });
        }
    });
    let mine = best.get(f);
    let b = block_best(f, warp, lane0, mine);
    let listed = f.icmp(Icmp::Ne, &b.index, &none);
    let beats = f.fcmp(Fcmp::Ogt, &b.score, &bound);
    let found = f.and(&listed, &beats);
    (found, b.index, b.logit)
}

/// `flashsample_decide` (see the module docs; parameters: `params::DECIDE`).
pub(crate) fn emit() -> String {
    let mut f = Func::new();
    let seq = f.sreg("ctaid.x");
    let tid = f.sreg("tid.x");
    let warp = f.lshr(&tid, &i32c(5));
    let lane = f.and(&tid, &i32c(31));
    let lane0 = f.icmp(Icmp::Eq, &lane, &i32c(0));
    let tid0 = f.icmp(Icmp::Eq, &tid, &i32c(0));
    let none = i32c(INDEX_NONE as i32);
    let tiles_wide = f.zext(&arg::TILES);
    let per_tile_wide = f.zext(&arg::PER_TILE);
    let in_range = f.icmp(Icmp::Ult, &seq, &arg::SEQUENCES);
    f.if_then(&in_range, |f| {
        let period = f.add(&arg::K, &i32c(1));
        let row0 = f.mul(&seq, &period);
        let has_lp = f.non_null(&arg::OUT_LOGPROBS);
        let has_lse = f.non_null(&arg::LSE);
        let has_rs = f.non_null(&arg::ROW_SEEDS);
        // Writes the sequence's n-th emitted token (row row0 + n) and its logprob `x − lse`.
        let emit_token = |f: &mut Func, n: &I32, token: &I32, x: &F32| {
            f.if_then(&tid0, |f| {
                let at = f.add(&row0, n);
                let at64 = f.zext(&at);
                let a = f.gaddr(&arg::OUT_TOKENS, &at64, 4);
                f.store(token, &a, 4);
                f.if_then(&has_lp, |f| {
                    let lp = f.var(&F32::NAN);
                    f.if_then(&has_lse, |f| {
                        let a = f.gaddr(&arg::LSE, &at64, 4);
                        let l = f.load(&a, 4);
                        let d = f.fsub(x, &l);
                        f.set(&lp, &d);
                    });
                    let lp = f.get(&lp);
                    let a = f.gaddr(&arg::OUT_LOGPROBS, &at64, 4);
                    f.store(&lp, &a, 4);
                });
            });
        };
        let clear = |f: &mut Func| {
            f.if_then(&tid0, |f| {
                f.for_loop(&i32c(0), &period, &i32c(1), |f, n| {
                    let at = f.add(&row0, n);
                    let at64 = f.zext(&at);
                    let a = f.gaddr(&arg::OUT_TOKENS, &at64, 4);
                    f.store(&none, &a, 4);
                    f.if_then(&has_lp, |f| {
                        let a = f.gaddr(&arg::OUT_LOGPROBS, &at64, 4);
                        f.store(&F32::NAN, &a, 4);
                    });
                });
            });
        };
        clear(f);
        // The drafts first (the device API's are not checked on the host): the first position
        // whose token is not below V, or whose sampled probability of its token is not
        // positive and finite, faults the sequence; `accepted` then names the position.
        let outcome = f.var(&i32c(SpecStatus::Ok.code()));
        let fault_at = f.var(&i32c(0));
        let has_q = f.non_null(&arg::DRAFT_PROBS);
        f.for_loop(&i32c(0), &arg::K, &i32c(1), |f, j| {
            let oc = f.get(&outcome);
            let clean = f.icmp(Icmp::Eq, &oc, &i32c(SpecStatus::Ok.code()));
            f.if_then(&clean, |f| {
                let draft = f.mul(&seq, &arg::K);
                let draft = f.add(&draft, j);
                let draft64 = f.zext(&draft);
                let a = f.gaddr(&arg::DRAFTS, &draft64, 4);
                let d: I32 = f.load(&a, 4);
                let outside = f.icmp(Icmp::Uge, &d, &arg::VOCAB);
                f.if_else(
                    &outside,
                    |f| {
                        f.set(&outcome, &i32c(SpecStatus::DraftToken.code()));
                        f.set(&fault_at, j);
                    },
                    |f| {
                        f.if_then(&has_q, |f| {
                            let vocab64 = f.zext(&arg::VOCAB);
                            let at = f.mul(&draft64, &vocab64);
                            let d64 = f.zext(&d);
                            let at = f.add(&at, &d64);
                            let a = f.gaddr(&arg::DRAFT_PROBS, &at, 4);
                            let q: F32 = f.load(&a, 4);
                            let positive = f.fcmp(Fcmp::Ogt, &q, &F32::ZERO);
                            let finite = f.fcmp(Fcmp::Olt, &q, &F32::POS_INF);
                            let valid = f.and(&positive, &finite);
                            let bad = f.not(&valid);
                            f.if_then(&bad, |f| {
                                f.set(&outcome, &i32c(SpecStatus::DraftProbability.code()));
                                f.set(&fault_at, j);
                            });
                        });
                    },
                );
            });
        });
        let oc = f.get(&outcome);
        let drafts_ok = f.icmp(Icmp::Eq, &oc, &i32c(SpecStatus::Ok.code()));
        // A failing row fails the sequence (`verify::sequence_failure`).
        let fail = f.var(&i32c(0));
        f.for_loop(&i32c(0), &period, &i32c(1), |f, n| {
            let r = f.add(&row0, n);
            let r64 = f.zext(&r);
            let a = f.gaddr(&arg::STATUS, &r64, 4);
            let st: I32 = f.load(&a, 4);
            let masked = f.icmp(Icmp::Eq, &st, &i32c(RowStatus::AllMasked.code()));
            let nonfinite = f.icmp(Icmp::Eq, &st, &i32c(RowStatus::NonFinite.code()));
            let bonus = f.icmp(Icmp::Eq, n, &arg::K);
            let not_ok = f.icmp(Icmp::Ne, &st, &i32c(RowStatus::Ok.code()));
            let bad_bonus = f.and(&bonus, &not_ok);
            let bad = f.or(&masked, &nonfinite);
            let bad = f.or(&bad, &bad_bonus);
            let bad = f.zext(&bad);
            let cur = f.get(&fail);
            let nf = f.or(&cur, &bad);
            f.set(&fail, &nf);
        });
        let accepted = f.var(&i32c(0));
        let stop = f.var(&i32c(0));
        let failed = f.get(&fail);
        let failed = f.icmp(Icmp::Ne, &failed, &i32c(0));
        let row_failed = f.and(&drafts_ok, &failed);
        let go = f.not(&failed);
        let go = f.and(&drafts_ok, &go);
        f.if_then(&row_failed, |f| f.set(&outcome, &i32c(SpecStatus::RowFailed.code())));
        f.if_then(
            &go,
            |f| {
                let j = f.var(&i32c(0));
                f.while_loop(
                    |f| {
                        let jv = f.get(&j);
                        let more = f.icmp(Icmp::Ult, &jv, &arg::K);
                        let st = f.get(&stop);
                        let running = f.icmp(Icmp::Eq, &st, &i32c(0));
                        f.and(&more, &running)
                    },
                    |f| {
                        let jv = f.get(&j);
                        let c = DecideCtx {
                            tid: &tid,
                            warp: &warp,
                            lane0: &lane0,
                            seq: &seq,
                            row0: &row0,
                            has_lse: &has_lse,
                            has_rs: &has_rs,
                            tiles_wide: &tiles_wide,
                            per_tile_wide: &per_tile_wide,
                        };
                        let out = Outcome { outcome: &outcome, accepted: &accepted, stop: &stop, fault_at: &fault_at };
                        decide_position(f, &c, &jv, &out, &emit_token);
                        let nj = f.add(&jv, &i32c(1));
                        f.set(&j, &nj);
                    },
                );
                // Every draft accepted: the bonus is row k's ordinary sample.
                let st = f.get(&stop);
                let all = f.icmp(Icmp::Eq, &st, &i32c(0));
                f.if_then(&all, |f| {
                    let r = f.add(&row0, &arg::K);
                    let r64 = f.zext(&r);
                    let a = f.gaddr(&arg::ROW_TOKENS, &r64, 4);
                    let v = f.load(&a, 4);
                    let a = f.gaddr(&arg::ROW_LOGITS, &r64, 4);
                    let x = f.load(&a, 4);
                    emit_token(f, &arg::K, &v, &x);
                    f.set(&accepted, &arg::K);
                });
            },
        );
        let oc = f.get(&outcome);
        let undecided = f.icmp(Icmp::Ne, &oc, &i32c(SpecStatus::Ok.code()));
        // Only a decided sequence carries tokens; a draft fault's `accepted` is its position.
        let token_fault = f.icmp(Icmp::Eq, &oc, &i32c(SpecStatus::DraftToken.code()));
        let prob_fault = f.icmp(Icmp::Eq, &oc, &i32c(SpecStatus::DraftProbability.code()));
        let draft_fault = f.or(&token_fault, &prob_fault);
        f.if_then(&undecided, |f| {
            clear(f);
            let at = f.get(&fault_at);
            let n = f.sel(&draft_fault, &at, &i32c(0));
            f.set(&accepted, &n);
        });
        f.if_then(&tid0, |f| {
            let s64 = f.zext(&seq);
            let oc = f.get(&outcome);
            let a = f.gaddr(&arg::OUT_STATUS, &s64, 4);
            f.store(&oc, &a, 4);
            let acc = f.get(&accepted);
            let a = f.gaddr(&arg::OUT_ACCEPTED, &s64, 4);
            f.store(&acc, &a, 4);
        });
    });
    f.ret_void();
    f.finish(&DECIDE.llvm_header(NAME, &format!("\"nvvm.maxntid\"=\"{DECIDE_THREADS}\"")))
}

/// The kernel-wide values one position's decision reads.
struct DecideCtx<'a> {
    tid: &'a I32,
    warp: &'a I32,
    lane0: &'a I1,
    seq: &'a I32,
    row0: &'a I32,
    has_lse: &'a I1,
    has_rs: &'a I1,
    tiles_wide: &'a I64,
    per_tile_wide: &'a I64,
}

/// What the positions' decisions write: the sequence's `SpecStatus` code, its accepted
/// drafts, whether a position stopped the walk (`i32` flags), and a draft fault's position.
struct Outcome<'a> {
    outcome: &'a Var<I32>,
    accepted: &'a Var<I32>,
    stop: &'a Var<I32>,
    fault_at: &'a Var<I32>,
}

/// Draft position `j` of the sequence: accept (emit `d_j`) or reject (emit the correction,
/// or `Recompute`) and stop. `p_j(d)` by the row's kind: a greedy row's point mass on its
/// argmax, a filtered row's survivors (`Recompute` when it has none), else `exp(x_d − L)`.
fn decide_position(f: &mut Func, c: &DecideCtx<'_>, j: &I32, out: &Outcome<'_>, emit_token: &dyn Fn(&mut Func, &I32, &I32, &F32)) {
    // Only a rejecting position, the walk's last, reads the flag, after the barriers of its
    // residual draw; the first of them orders this store before every thread's update.
    let tid0 = f.icmp(Icmp::Eq, c.tid, &i32c(0));
    f.if_then(&tid0, |f| {
        let flag = bad_q_flag(f);
        f.store(&i32c(0), &flag, 4);
    });
    let r = f.add(c.row0, j);
    let r64 = f.zext(&r);
    let draft = f.mul(c.seq, &arg::K);
    let draft = f.add(&draft, j);
    let draft64 = f.zext(&draft);
    let a = f.gaddr(&arg::DRAFTS, &draft64, 4);
    let d: I32 = f.load(&a, 4);
    let l = f.var(&F64::NAN);
    f.if_then(c.has_lse, |f| {
        let a = f.gaddr(&arg::LSE, &r64, 4);
        let x: F32 = f.load(&a, 4);
        let x = f.fpext(&x);
        f.set(&l, &x);
    });
    let l = f.get(&l);
    let a = f.gaddr(&arg::TEMPERATURES, &r64, 4);
    let t = f.load(&a, 4);
    let cold = f.fcmp(Fcmp::Oeq, &t, &F32::ZERO);
    let all = f.icmp(Icmp::Ne, &arg::ALL_GREEDY, &i32c(0));
    let greedy = f.or(&all, &cold);
    let rf = row_filter_or_off(f, &r64);
    let filtered = drawn_in_stage_three(f, &rf, &greedy);
    let a = f.gaddr(&arg::ROW_TOKENS, &r64, 4);
    let argmax: I32 = f.load(&a, 4);
    let a = f.gaddr(&arg::DRAFT_LOGITS, &r64, 4);
    let xd: F32 = f.load(&a, 4);
    let stream = row_stream(f, c.has_rs, &r, &r64);
    let vocab64 = f.zext(&arg::VOCAB);
    let q_base = f.mul(&draft64, &vocab64);
    let row = Row {
        r64: r64.clone(),
        tiles_wide: c.tiles_wide.clone(),
        per_tile_wide: c.per_tile_wide.clone(),
        q_base,
        draft: d.clone(),
        l: l.clone(),
        stream,
    };
    let width64: I64 = f.zext(&arg::KEPT_WIDTH);
    let kept_base = f.mul(&r64, &width64);
    let p = f.var(&f64c(0.0));
    let avail = f.var(&I1::TRUE);
    let kept_n = f.var(&i32c(0));
    let kept_mass = f.var(&F64::NAN);
    f.if_else(
        &filtered,
        |f| {
            let (has, n, mass, pd) = kept_target(f, c.tid, &kept_base, &d);
            f.set(&avail, &has);
            f.set(&kept_n, &n);
            f.set(&kept_mass, &mass);
            f.set(&p, &pd);
        },
        |f| {
            let hit = f.icmp(Icmp::Eq, &argmax, &d);
            let p_greedy = f.sel(&hit, &f64c(1.0), &f64c(0.0));
            let xd64: F64 = f.fpext(&xd);
            let diff = f.fsub(&xd64, &l);
            let p_full = math64::exp(f, &diff);
            let pv = f.sel(&greedy, &p_greedy, &p_full);
            f.set(&p, &pv);
        },
    );
    let kept = Kept { base: kept_base, n: f.get(&kept_n), mass: f.get(&kept_mass) };
    let avail = f.get(&avail);
    let p = f.get(&p);
    let qd = q_of(f, &row, &d);
    let w3 = stream_word3(f, &r64, NoiseStream::SpecAccept);
    let block = philox_block(f, [&i32c(0), &row.stream.ctr_row, &i32c(0), &w3], &row.stream.key);
    let bits = f.extract(&block, 0);
    let u = uniform_f64(f, &bits);
    let ratio = f.fdiv(&p, &qd);
    let accept = f.fcmp(Fcmp::Olt, &u, &ratio);
    let missing = f.not(&avail);
    f.if_else(
        &missing,
        |f| {
            f.set(out.outcome, &i32c(SpecStatus::Recompute.code()));
            f.set(out.stop, &i32c(1));
        },
        |f| {
            f.if_else(
                &accept,
                |f| {
                    emit_token(f, j, &d, &xd);
                    let n = f.add(j, &i32c(1));
                    f.set(out.accepted, &n);
                },
                |f| {
                    f.set(out.stop, &i32c(1));
                    f.if_else(
                        &greedy,
                        |f| {
                            let a = f.gaddr(&arg::ROW_LOGITS, &r64, 4);
                            let x = f.load(&a, 4);
                            emit_token(f, j, &argmax, &x);
                        },
                        |f| {
                            f.if_else(
                                &filtered,
                                |f| {
                                    let (v, x) = kept_residual(f, c, &row, &kept);
                                    emit_token(f, j, &v, &x);
                                },
                                |f| {
                                    let (found, v, x) = residual_draw(f, c.tid, c.warp, c.lane0, &row);
                                    f.if_else(
                                        &found,
                                        |f| emit_token(f, j, &v, &x),
                                        |f| f.set(out.outcome, &i32c(SpecStatus::Recompute.code())),
                                    );
                                },
                            );
                            // Both draws end with a block reduction: every update is in.
                            let flag = bad_q_flag(f);
                            let raised: I32 = f.load(&flag, 4);
                            let bad = f.icmp(Icmp::Ne, &raised, &i32c(0));
                            f.if_then(&bad, |f| {
                                f.set(out.outcome, &i32c(SpecStatus::DraftProbability.code()));
                                f.set(out.fault_at, j);
                            });
                        },
                    );
                },
            );
        },
    );
}

/// A filtered draft row's survivors as stage three left them in `%kept`.
struct Kept {
    /// The row's first entry (i64).
    base: I64,
    /// How many survive.
    n: I32,
    /// Their log-mass `top + ln_f64(Σ exp_f64(x − top))`, summed in list order.
    mass: F64,
}

/// Entry `e` of the survivors starting at `base`.
fn kept_entry(f: &mut Func, base: &I64, e: &I32) -> Scored {
    let e64 = f.zext(e);
    let at = f.add(base, &e64);
    let a = f.gaddr(&arg::KEPT, &at, SCORED_BYTES);
    Scored::load(f, &a)
}

/// A filtered draft row's target (`Target::Kept` of the host's `verify::decide`): whether it
/// has survivors (i1), how many, their log-mass, and `p_j(d) = exp_f64(x_d − mass)` (0 when
/// the draft token did not survive). The `exp` terms run one per thread into shared memory;
/// every thread then sums them in list order, as the host does. Uniform; barriers only where
/// the row has survivors (a uniform condition).
fn kept_target(f: &mut Func, tid: &I32, base: &I64, d: &I32) -> (I1, I32, F64, F64) {
    let none = i32c(INDEX_NONE as i32);
    let avail = f.var(&I1::FALSE);
    let n = f.var(&i32c(0));
    let mass = f.var(&F64::NAN);
    let p = f.var(&f64c(0.0));
    let has = f.non_null(&arg::KEPT);
    f.if_then(&has, |f| {
        let first = kept_entry(f, base, &i32c(0));
        let some = f.icmp(Icmp::Ne, &first.index, &none);
        f.if_then(&some, |f| {
            let count_at = f.element::<_, I32>(&MISC, &i32c(0));
            let hit_at = f.element::<_, I32>(&MISC, &i32c(1));
            let tid0 = f.icmp(Icmp::Eq, tid, &i32c(0));
            // Stage three keeps at most MAX_LIST_CAPACITY survivors (the terms' size), so a
            // full row's count is its width up to that.
            let full = f.umin(&arg::KEPT_WIDTH, &i32c(MAX_LIST_CAPACITY));
            f.if_then(&tid0, |f| {
                f.store(&full, &count_at, 4);
                f.store(&none, &hit_at, 4);
            });
            f.barrier();
            let top: F64 = f.fpext(&first.logit);
            f.for_loop(tid, &arg::KEPT_WIDTH, &i32c(DECIDE_THREADS), |f, e| {
                let entry = kept_entry(f, base, e);
                let real = f.icmp(Icmp::Ne, &entry.index, &none);
                f.if_else(
                    &real,
                    |f| {
                        let x: F64 = f.fpext(&entry.logit);
                        let dx = f.fsub(&x, &top);
                        let term = math64::exp(f, &dx);
                        let fits = f.icmp(Icmp::Ult, e, &i32c(MAX_LIST_CAPACITY));
                        f.if_then(&fits, |f| {
                            let a = f.element::<_, F64>(&TERMS, e);
                            f.store_natural(&term, &a);
                        });
                        let is_d = f.icmp(Icmp::Eq, &entry.index, d);
                        f.if_then(&is_d, |f| f.store(e, &hit_at, 4));
                    },
                    |f| {
                        // The survivors are a prefix (entry 0 is one): the first EMPTY entry
                        // counts them.
                        let prev = f.add(e, &i32c(-1));
                        let before = kept_entry(f, base, &prev);
                        let edge = f.icmp(Icmp::Ne, &before.index, &none);
                        f.if_then(&edge, |f| f.store(e, &count_at, 4));
                    },
                );
            });
            f.barrier();
            let count: I32 = f.load(&count_at, 4);
            let hit: I32 = f.load(&hit_at, 4);
            let sum = f.var(&f64c(0.0));
            f.for_loop(&i32c(0), &count, &i32c(1), |f, e| {
                let a = f.element::<_, F64>(&TERMS, e);
                let term = f.load_natural(&a);
                let s0 = f.get(&sum);
                let s1 = f.fadd(&s0, &term);
                f.set(&sum, &s1);
            });
            let s = f.get(&sum);
            let ls = math64::ln(f, &s);
            let m = f.fadd(&top, &ls);
            let found = f.icmp(Icmp::Ne, &hit, &none);
            f.if_then(&found, |f| {
                let entry = kept_entry(f, base, &hit);
                let x: F64 = f.fpext(&entry.logit);
                let dx = f.fsub(&x, &m);
                let pd = math64::exp(f, &dx);
                f.set(&p, &pd);
            });
            // A later position rewrites the terms and counters just read.
            f.barrier();
            f.set(&avail, &I1::TRUE);
            f.set(&n, &count);
            f.set(&mass, &m);
        });
    });
    (f.get(&avail), f.get(&n), f.get(&mass), f.get(&p))
}

/// The residual draw of a rejected filtered draft row over its survivors (the host's
/// `residual_draw`, every entry scored): the best `ln(p − q) + G_res` over survivors with
/// `p > q`, or, when none has, the best `ln p + G_res`; ties to the lower token. Returns
/// `(token, logit)`, `(INDEX_NONE, NaN)` when no survivor has `p > 0`. Uniform.
fn kept_residual(f: &mut Func, c: &DecideCtx<'_>, row: &Row, kept: &Kept) -> (I32, F32) {
    let none = i32c(INDEX_NONE as i32);
    let w3 = stream_word3(f, &row.r64, NoiseStream::SpecResidual);
    let by_w = CandidateVar::new(f, &Best::none());
    let by_p = CandidateVar::new(f, &Best::none());
    f.for_loop(c.tid, &kept.n, &i32c(DECIDE_THREADS), |f, e| {
        let entry = kept_entry(f, &kept.base, e);
        let x: F64 = f.fpext(&entry.logit);
        let dx = f.fsub(&x, &kept.mass);
        let p = math64::exp(f, &dx);
        let positive = f.fcmp(Fcmp::Ogt, &p, &f64c(0.0));
        f.if_then(&positive, |f| {
            // Keyed by the global token, as stage one's residual lists are.
            let g = f.add(&entry.index, &arg::VOCAB_OFFSET);
            let bits = token_bits(f, &g, &row.stream, &i32c(0), &w3);
            let gum = math64::gumbel(f, &bits);
            let lp = math64::ln(f, &p);
            let score = f.fadd(&lp, &gum);
            let cur = by_p.get(f);
            let next = cur.keep_best(f, &Candidate { score, index: entry.index.clone(), logit: entry.logit.clone() });
            by_p.set(f, &next);
            let q = q_checked(f, row, &entry.index);
            let w = f.fsub(&p, &q);
            let residual = f.fcmp(Fcmp::Ogt, &w, &f64c(0.0));
            f.if_then(&residual, |f| {
                let lw = math64::ln(f, &w);
                let score = f.fadd(&lw, &gum);
                let cur = by_w.get(f);
                let next = cur.keep_best(f, &Candidate { score, index: entry.index.clone(), logit: entry.logit.clone() });
                by_w.set(f, &next);
            });
        });
    });
    let mine = by_w.get(f);
    let bw = block_best(f, c.warp, c.lane0, mine);
    let mine = by_p.get(f);
    let bp = block_best(f, c.warp, c.lane0, mine);
    let has_w = f.icmp(Icmp::Ne, &bw.index, &none);
    let token = f.sel(&has_w, &bw.index, &bp.index);
    let logit = f.sel(&has_w, &bw.logit, &bp.logit);
    let real = f.icmp(Icmp::Ne, &token, &none);
    let logit = f.sel(&real, &logit, &F32::NAN);
    (token, logit)
}

/// `flashsample_spec_targets`: `targets[r] = drafts[(r / (k+1))·k + r mod (k+1)]` for a
/// draft row, 0 for a bonus row (unread), one thread per row.
pub(crate) fn emit_targets() -> String {
    let mut f = Func::new();
    let cta = f.sreg("ctaid.x");
    let tid = f.sreg("tid.x");
    let r = f.mul(&cta, &i32c(DECIDE_THREADS));
    let r = f.add(&r, &tid);
    let live = f.icmp(Icmp::Ult, &r, &arg::BATCH);
    f.if_then(&live, |f| {
        let period = f.add(&arg::K, &i32c(1));
        let seq = f.udiv(&r, &period);
        let j = f.urem(&r, &period);
        let draft_row = f.icmp(Icmp::Ne, &j, &arg::K);
        let token = f.var(&i32c(0));
        f.if_then(&draft_row, |f| {
            let at = f.mul(&seq, &arg::K);
            let at = f.add(&at, &j);
            let at64 = f.zext(&at);
            let a = f.gaddr(&arg::DRAFTS, &at64, 4);
            let d = f.load(&a, 4);
            f.set(&token, &d);
        });
        let t = f.get(&token);
        let r64 = f.zext(&r);
        let a = f.gaddr(&arg::TARGETS, &r64, 4);
        f.store(&t, &a, 4);
    });
    f.ret_void();
    f.finish(&SPEC_TARGETS.llvm_header(TARGETS_NAME, &format!("\"nvvm.maxntid\"=\"{DECIDE_THREADS}\"")))
}
