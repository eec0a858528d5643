//! Speculative verification's decision on the device (DESIGN.md "Speculative verification"):
//! `flashsample_decide`, one CTA of [`DECIDE_THREADS`] per sequence, after stage three, op for
//! op as the host's `verify::decide` for unfiltered and greedy rows (f64 math from
//! [`crate::math64`], the abi's sequences); and `flashsample_spec_targets`, which spreads the
//! `[S·k]` drafts over the `[S·(k+1)]` rows as stage one's targets (the device API's launch
//! has no host to do it).
//!
//! Every thread runs a sequence's decisions redundantly (the same loads and arithmetic give
//! the same branch everywhere, so the CTA's barriers stay uniform); thread 0 writes. Only the
//! residual draw at a rejection is split: the threads stride over the row's tiles, first for
//! the best stored score (its token's exact residual score `T` prunes the scan) and the bound
//! `max_t ub(last listed score of t)`, then for the exact `ln(p − q) + gumbel_f64` of every
//! listed token whose upper bound `ub(stored score) = s − L + slack` reaches `T`. Skipping a
//! token whose bound is below `T` cannot change the argmax, so the winner is the host's
//! (`residual_draw` over every listed token); it is used iff its score beats the bound, else
//! the sequence gets `SpecStatus::Recompute`. A draft row with an active filter gets
//! `SpecStatus::Filtered` (its `p_j` lives on the filter's survivors, which only the host
//! rebuilds).

use crate::ir::{f32c_u, Func, Var, NEG_INF};
use crate::math::{row_stream_u, stream_word3_u, token_bits_u};
use crate::math64::{dadd, ddiv, dmul, dsub, f64c, uniform_f64};
use crate::params::{DECIDE, SPEC_TARGETS};
use flashsample_abi::rng::NoiseStream;
use flashsample_abi::speculative::{SpecStatus, RESIDUAL_BOUND_SLACK};
use flashsample_abi::{RowStatus, INDEX_NONE};

pub(crate) const NAME: &str = "flashsample_decide";
pub(crate) const TARGETS_NAME: &str = "flashsample_spec_targets";
/// Threads of one `flashsample_decide` CTA (one sequence) and of one
/// `flashsample_spec_targets` CTA (that many rows).
pub const DECIDE_THREADS: u32 = 128;
const WARPS: u32 = DECIDE_THREADS / 32;
const NAN: &str = "0x7FF8000000000000";

/// The block reduction's per-warp scratch (score, tie, payload) and `llvm.fabs.f64`.
pub(crate) fn shared_decls() -> String {
    format!(
        "@fs_decide_s = internal addrspace(3) global [{WARPS} x double] undef, align 8\n\
         @fs_decide_t = internal addrspace(3) global [{WARPS} x i32] undef, align 4\n\
         @fs_decide_x = internal addrspace(3) global [{WARPS} x float] undef, align 4\n\
         declare double @llvm.fabs.f64(double)\n"
    )
}

/// A candidate of the residual draw: f64 score, u32 tie-break (token or tile), f32 payload.
type Best = (String, String, String);

/// `other` where it beats `best` (higher score, ties to the lower tie-break), else `best`.
fn keep(f: &mut Func, best: Best, other: (&str, &str, &str)) -> Best {
    let gt = f.v(format!("fcmp ogt double {}, {}", other.0, best.0));
    let eq = f.v(format!("fcmp oeq double {}, {}", other.0, best.0));
    let lo = f.v(format!("icmp ult i32 {}, {}", other.1, best.1));
    let tie = f.and1_u(&eq, &lo);
    let take = f.v(format!("or i1 {gt}, {tie}"));
    (f.sel_u("double", &take, other.0, &best.0), f.sel_u("i32", &take, other.1, &best.1), f.sel_u("float", &take, other.2, &best.2))
}

fn shfl_f64(f: &mut Func, v: &str, mask: u32) -> String {
    let b = f.v(format!("bitcast double {v} to i64"));
    let lo = f.v(format!("trunc i64 {b} to i32"));
    let hi = f.v(format!("lshr i64 {b}, 32"));
    let hi = f.v(format!("trunc i64 {hi} to i32"));
    let lo = f.shfl_xor_i32_u(&lo, mask);
    let hi = f.shfl_xor_i32_u(&hi, mask);
    let lo = f.v(format!("zext i32 {lo} to i64"));
    let hi = f.v(format!("zext i32 {hi} to i64"));
    let hi = f.v(format!("shl i64 {hi}, 32"));
    let b = f.v(format!("or i64 {hi}, {lo}"));
    f.v(format!("bitcast i64 {b} to double"))
}

/// The CTA's best of every thread's `best`, in every thread (two barriers; uniform).
fn block_best(f: &mut Func, warp: &str, lane0: &str, best: Best) -> Best {
    let mut b = best;
    for sh in [16, 8, 4, 2, 1] {
        let os = shfl_f64(f, &b.0, sh);
        let ot = f.shfl_xor_i32_u(&b.1, sh);
        let ox = f.shfl_xor_f32_u(&b.2, sh);
        b = keep(f, b, (&os, &ot, &ox));
    }
    f.if_then_u(lane0, |f| {
        for (arr, ty, v) in [("@fs_decide_s", "double", &b.0), ("@fs_decide_t", "i32", &b.1), ("@fs_decide_x", "float", &b.2)] {
            let a = f.v(format!("getelementptr {ty}, ptr addrspace(3) {arr}, i32 {warp}"));
            f.s(format!("store {ty} {v}, ptr addrspace(3) {a}"));
        }
    });
    f.barrier();
    let mut acc: Best = (NEG_INF.into(), (INDEX_NONE as i32).to_string(), NEG_INF.into());
    for w in 0..WARPS {
        let ld = |f: &mut Func, arr: &str, ty: &str| {
            let a = f.v(format!("getelementptr {ty}, ptr addrspace(3) {arr}, i32 {w}"));
            f.v(format!("load {ty}, ptr addrspace(3) {a}"))
        };
        let (s, t, x) = (ld(f, "@fs_decide_s", "double"), ld(f, "@fs_decide_t", "i32"), ld(f, "@fs_decide_x", "float"));
        acc = keep(f, acc, (&s, &t, &x));
    }
    // The next reduction rewrites the scratch just read.
    f.barrier();
    acc
}

/// A residual-list entry `(score, index, logit)` at entry `slot` (i64).
fn load_candidate(f: &mut Func, slot: &str) -> (String, String, String) {
    let a = f.gaddr_u("%residual_lists", slot, 12);
    let s = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
    let a1 = f.v(format!("getelementptr i8, ptr addrspace(1) {a}, i64 4"));
    let i = f.v(format!("load i32, ptr addrspace(1) {a1}, align 4"));
    let a2 = f.v(format!("getelementptr i8, ptr addrspace(1) {a}, i64 8"));
    let x = f.v(format!("load float, ptr addrspace(1) {a2}, align 4"));
    (s, i, x)
}

/// `abi::speculative::residual_upper_bound(score, l)`.
fn upper_bound(f: &mut Func, score: &str, l: &str) -> String {
    let s = f.v(format!("fpext float {score} to double"));
    let a = dsub(f, &s, l);
    let abs = f.v(format!("call double @llvm.fabs.f64(double {s})"));
    let b = dadd(f, &f64c(1.0), &abs);
    let c = dmul(f, &f64c(RESIDUAL_BOUND_SLACK), &b);
    dadd(f, &a, &c)
}

/// What one draft row's decision reads besides its row index.
struct Row {
    /// The launch row as i64.
    r64: String,
    /// `%tiles` and `%per_tile` as i64 (the slot arithmetic's).
    tiles_wide: String,
    per_tile_wide: String,
    /// `%draft_probs`' first entry of this draft's distribution (i64), the draft token.
    q_base: String,
    draft: String,
    /// The row logsumexp as f64.
    l: String,
    /// The row's Philox key halves and counter row.
    key: (String, String),
    ctr: String,
}

/// `q_j(v)` as f64: the draft distribution's entry, or `[v = d_j]` for greedy drafts.
fn q_of(f: &mut Func, row: &Row, v: &str) -> String {
    let q = f.var_u("double", &f64c(0.0));
    let has = f.v("icmp ne ptr addrspace(1) %draft_probs, null");
    f.if_else_u(
        &has,
        |f| {
            let v64 = f.zext64_u(v);
            let at = f.v(format!("add i64 {}, {v64}", row.q_base));
            let a = f.gaddr_u("%draft_probs", &at, 4);
            let x = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
            let x = f.v(format!("fpext float {x} to double"));
            f.set_u(&q, &x);
        },
        |f| {
            let same = f.v(format!("icmp eq i32 {v}, {}", row.draft));
            let x = f.sel_u("double", &same, &f64c(1.0), &f64c(0.0));
            f.set_u(&q, &x);
        },
    );
    f.get_u(&q)
}

/// The exact residual score `ln(max(0, p − q)) + gumbel_f64(residual bits)` of the listed
/// token `v` with logit `x`: `-inf` when `p ≤ q` (the token is not eligible).
fn exact_score(f: &mut Func, row: &Row, w3: &str, v: &str, x: &str) -> String {
    let x64 = f.v(format!("fpext float {x} to double"));
    let d = dsub(f, &x64, &row.l);
    let p = f.v(format!("call double @fs_exp_f64(double {d})"));
    let q = q_of(f, row, v);
    let w = dsub(f, &p, &q);
    let score = f.var_u("double", NEG_INF);
    let pos = f.v(format!("fcmp ogt double {w}, {}", f64c(0.0)));
    f.if_then_u(&pos, |f| {
        // Keyed by the global token, as stage one's residual lists are.
        let g = f.add_u(v, "%vocab_offset");
        let bits = token_bits_u(f, &g, &row.ctr, "0", w3, (&row.key.0, &row.key.1));
        let gum = f.v(format!("call double @fs_gumbel_f64(i32 {bits})"));
        let lw = f.v(format!("call double @fs_ln_f64(double {w})"));
        let s = dadd(f, &lw, &gum);
        f.set_u(&score, &s);
    });
    f.get_u(&score)
}

/// The residual draw of a rejected unfiltered draft row: `(found, token, logit)`, `found`
/// iff some listed token has `p > q` and the best one's exact score beats every unlisted
/// token's bound (the host's `decide`, `Target::Full`). Uniform over the CTA.
fn residual_draw(f: &mut Func, tid: &str, warp: &str, lane0: &str, row: &Row) -> (String, String, String) {
    let w3 = stream_word3_u(f, &row.r64, NoiseStream::SpecResidual);
    let step = DECIDE_THREADS.to_string();
    let none = (INDEX_NONE as i32).to_string();
    let row_tiles = f.v(format!("mul i64 {}, {}", row.r64, row.tiles_wide));
    let slot = |f: &mut Func, tile: &str, e: &str| -> String {
        let t64 = f.zext64_u(tile);
        let rt = f.v(format!("add i64 {row_tiles}, {t64}"));
        let s = f.v(format!("mul i64 {rt}, {}", row.per_tile_wide));
        let e64 = f.zext64_u(e);
        f.v(format!("add i64 {s}, {e64}"))
    };
    // Pass one: the best stored score (ties to the lower tile) and the bound.
    let top = (f.var_u("double", NEG_INF), f.var_u("i32", &none));
    let bound = f.var_u("double", NEG_INF);
    let last_e = f.v("add i32 %per_tile, -1");
    f.for_loop_u(tid, "%tiles", &step, |f, t| {
        let first = slot(f, t, "0");
        let (s0, i0, _) = load_candidate(f, &first);
        let live = f.v(format!("icmp ne i32 {i0}, {none}"));
        let s0 = f.v(format!("fpext float {s0} to double"));
        let s0 = f.sel_u("double", &live, &s0, NEG_INF);
        let t0 = f.sel_u("i32", &live, t, &none);
        let cur = (f.get_u(&top.0), f.get_u(&top.1), f32c_u(0.0));
        let (bs, bt, _) = keep(f, cur, (&s0, &t0, &f32c_u(0.0)));
        f.set_u(&top.0, &bs);
        f.set_u(&top.1, &bt);
        let last = slot(f, t, &last_e);
        let (sl, il, _) = load_candidate(f, &last);
        let live = f.v(format!("icmp ne i32 {il}, {none}"));
        let ub = upper_bound(f, &sl, &row.l);
        let cur = f.get_u(&bound);
        let gt = f.v(format!("fcmp ogt double {ub}, {cur}"));
        let take = f.and1_u(&live, &gt);
        let nb = f.sel_u("double", &take, &ub, &cur);
        f.set_u(&bound, &nb);
    });
    let mine = (f.get_u(&top.0), f.get_u(&top.1), f32c_u(0.0));
    let (_, top_tile, _) = block_best(f, warp, lane0, mine);
    let mine = (f.get_u(&bound), "0".to_string(), f32c_u(0.0));
    let (bound, _, _) = block_best(f, warp, lane0, mine);
    // The top entry's exact score prunes the scan (every thread computes it alike).
    let threshold = f.var_u("double", NEG_INF);
    let has_top = f.v(format!("icmp ne i32 {top_tile}, {none}"));
    f.if_then_u(&has_top, |f| {
        let at = slot(f, &top_tile, "0");
        let (_, v, x) = load_candidate(f, &at);
        let s = exact_score(f, row, &w3, &v, &x);
        f.set_u(&threshold, &s);
    });
    let thr = f.get_u(&threshold);
    // Pass two: the exact scores of every listed token whose bound reaches the threshold.
    let best = (f.var_u("double", NEG_INF), f.var_u("i32", &none), f.var_u("float", NEG_INF));
    f.for_loop_u(tid, "%tiles", &step, |f, t| {
        f.for_loop_u("0", "%per_tile", "1", |f, e| {
            let at = slot(f, t, e);
            let (s, v, x) = load_candidate(f, &at);
            let live = f.v(format!("icmp ne i32 {v}, {none}"));
            let ub = upper_bound(f, &s, &row.l);
            let reach = f.v(format!("fcmp oge double {ub}, {thr}"));
            let go = f.and1_u(&live, &reach);
            f.if_then_u(&go, |f| {
                let es = exact_score(f, row, &w3, &v, &x);
                // A `-inf` score (p ≤ q) is not eligible: it never enters the argmax.
                let eligible = f.v(format!("fcmp ogt double {es}, {NEG_INF}"));
                f.if_then_u(&eligible, |f| {
                    let cur = (f.get_u(&best.0), f.get_u(&best.1), f.get_u(&best.2));
                    let (ns, nv, nx) = keep(f, cur, (&es, &v, &x));
                    f.set_u(&best.0, &ns);
                    f.set_u(&best.1, &nv);
                    f.set_u(&best.2, &nx);
                });
            });
        });
    });
    let mine = (f.get_u(&best.0), f.get_u(&best.1), f.get_u(&best.2));
    let (bs, bv, bx) = block_best(f, warp, lane0, mine);
    let listed = f.v(format!("icmp ne i32 {bv}, {none}"));
    let beats = f.v(format!("fcmp ogt double {bs}, {bound}"));
    let found = f.and1_u(&listed, &beats);
    (found, bv, bx)
}

/// `flashsample_decide` (see the module docs; parameters: `params::DECIDE`).
pub(crate) fn emit() -> String {
    let mut f = Func::new();
    let seq = f.sreg_u("ctaid.x");
    let tid = f.sreg_u("tid.x");
    let warp = f.v(format!("lshr i32 {tid}, 5"));
    let lane = f.v(format!("and i32 {tid}, 31"));
    let lane0 = f.v(format!("icmp eq i32 {lane}, 0"));
    let tid0 = f.v(format!("icmp eq i32 {tid}, 0"));
    let none = (INDEX_NONE as i32).to_string();
    let tiles_wide = f.v("zext i32 %tiles to i64");
    let per_tile_wide = f.v("zext i32 %per_tile to i64");
    let in_range = f.ult_u(&seq, "%sequences");
    f.if_then_u(&in_range, |f| {
        let period = f.add_u("%k", "1");
        let row0 = f.mul_u(&seq, &period);
        let has_lp = f.v("icmp ne ptr addrspace(1) %out_logprobs, null");
        let has_lse = f.v("icmp ne ptr addrspace(1) %lse, null");
        let has_rs = f.v("icmp ne ptr addrspace(1) %row_seeds, null");
        let has_filters = f.v("icmp ne ptr addrspace(1) %filters, null");
        // Writes the sequence's n-th emitted token (row row0 + n) and its logprob `x − lse`.
        let emit_token = |f: &mut Func, n: &str, token: &str, x: &str| {
            f.if_then_u(&tid0, |f| {
                let at = f.add_u(&row0, n);
                let at64 = f.zext64_u(&at);
                let a = f.gaddr_u("%out_tokens", &at64, 4);
                f.s(format!("store i32 {token}, ptr addrspace(1) {a}, align 4"));
                f.if_then_u(&has_lp, |f| {
                    let lp = f.var_u("float", NAN);
                    f.if_then_u(&has_lse, |f| {
                        let a = f.gaddr_u("%lse", &at64, 4);
                        let l = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
                        let d = f.fsub_u(x, &l);
                        f.set_u(&lp, &d);
                    });
                    let lp = f.get_u(&lp);
                    let a = f.gaddr_u("%out_logprobs", &at64, 4);
                    f.s(format!("store float {lp}, ptr addrspace(1) {a}, align 4"));
                });
            });
        };
        let clear = |f: &mut Func| {
            f.if_then_u(&tid0, |f| {
                f.for_loop_u("0", &period, "1", |f, n| {
                    let at = f.add_u(&row0, n);
                    let at64 = f.zext64_u(&at);
                    let a = f.gaddr_u("%out_tokens", &at64, 4);
                    f.s(format!("store i32 {none}, ptr addrspace(1) {a}, align 4"));
                    f.if_then_u(&has_lp, |f| {
                        let a = f.gaddr_u("%out_logprobs", &at64, 4);
                        f.s(format!("store float {NAN}, ptr addrspace(1) {a}, align 4"));
                    });
                });
            });
        };
        clear(f);
        // A failing row fails the sequence (`verify::sequence_failure`).
        let fail = f.var_u("i32", "0");
        f.for_loop_u("0", &period, "1", |f, n| {
            let r = f.add_u(&row0, n);
            let r64 = f.zext64_u(&r);
            let a = f.gaddr_u("%status", &r64, 4);
            let st = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
            let masked = f.v(format!("icmp eq i32 {st}, {}", RowStatus::AllMasked.code()));
            let nonfinite = f.v(format!("icmp eq i32 {st}, {}", RowStatus::NonFinite.code()));
            let bonus = f.v(format!("icmp eq i32 {n}, %k"));
            let not_ok = f.v(format!("icmp ne i32 {st}, {}", RowStatus::Ok.code()));
            let bad_bonus = f.and1_u(&bonus, &not_ok);
            let bad = f.v(format!("or i1 {masked}, {nonfinite}"));
            let bad = f.v(format!("or i1 {bad}, {bad_bonus}"));
            let bad = f.v(format!("zext i1 {bad} to i32"));
            let cur = f.get_u(&fail);
            let nf = f.v(format!("or i32 {cur}, {bad}"));
            f.set_u(&fail, &nf);
        });
        let outcome = f.var_u("i32", &SpecStatus::Ok.code().to_string());
        let accepted = f.var_u("i32", "0");
        let stop = f.var_u("i32", "0");
        let failed = f.get_u(&fail);
        let failed = f.v(format!("icmp ne i32 {failed}, 0"));
        f.if_else_u(
            &failed,
            |f| f.set_u(&outcome, &SpecStatus::RowFailed.code().to_string()),
            |f| {
                let j = f.var_u("i32", "0");
                f.while_loop_u(
                    |f| {
                        let jv = f.get_u(&j);
                        let more = f.v(format!("icmp ult i32 {jv}, %k"));
                        let st = f.get_u(&stop);
                        let running = f.v(format!("icmp eq i32 {st}, 0"));
                        f.and1_u(&more, &running)
                    },
                    |f| {
                        let jv = f.get_u(&j);
                        let c = DecideCtx {
                            tid: &tid,
                            warp: &warp,
                            lane0: &lane0,
                            seq: &seq,
                            row0: &row0,
                            has_lse: &has_lse,
                            has_rs: &has_rs,
                            has_filters: &has_filters,
                            tiles_wide: &tiles_wide,
                            per_tile_wide: &per_tile_wide,
                        };
                        decide_position(f, &c, &jv, &outcome, &accepted, &stop, &emit_token);
                        let nj = f.add_u(&jv, "1");
                        f.set_u(&j, &nj);
                    },
                );
                // Every draft accepted: the bonus is row k's ordinary sample.
                let st = f.get_u(&stop);
                let all = f.v(format!("icmp eq i32 {st}, 0"));
                f.if_then_u(&all, |f| {
                    let r = f.add_u(&row0, "%k");
                    let r64 = f.zext64_u(&r);
                    let a = f.gaddr_u("%row_tokens", &r64, 4);
                    let v = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
                    let a = f.gaddr_u("%row_logits", &r64, 4);
                    let x = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
                    emit_token(f, "%k", &v, &x);
                    f.set_u(&accepted, "%k");
                });
            },
        );
        let oc = f.get_u(&outcome);
        let undecided = f.v(format!("icmp ne i32 {oc}, {}", SpecStatus::Ok.code()));
        // Only a decided sequence carries tokens.
        f.if_then_u(&undecided, |f| {
            clear(f);
            f.set_u(&accepted, "0");
        });
        f.if_then_u(&tid0, |f| {
            let s64 = f.zext64_u(&seq);
            let oc = f.get_u(&outcome);
            let a = f.gaddr_u("%out_status", &s64, 4);
            f.s(format!("store i32 {oc}, ptr addrspace(1) {a}, align 4"));
            let acc = f.get_u(&accepted);
            let a = f.gaddr_u("%out_accepted", &s64, 4);
            f.s(format!("store i32 {acc}, ptr addrspace(1) {a}, align 4"));
        });
    });
    f.s("ret void");
    f.finish(&DECIDE.llvm_header(NAME, &format!("\"nvvm.maxntid\"=\"{DECIDE_THREADS}\"")))
}

/// The kernel-wide values one position's decision reads.
struct DecideCtx<'a> {
    tid: &'a str,
    warp: &'a str,
    lane0: &'a str,
    seq: &'a str,
    row0: &'a str,
    has_lse: &'a str,
    has_rs: &'a str,
    has_filters: &'a str,
    tiles_wide: &'a str,
    per_tile_wide: &'a str,
}

/// Draft position `j` of the sequence: filtered → `Filtered`; else accept (emit `d_j`) or
/// reject (emit the correction, or `Recompute`) and stop.
#[allow(clippy::too_many_arguments)]
fn decide_position(
    f: &mut Func,
    c: &DecideCtx<'_>,
    j: &str,
    outcome: &Var,
    accepted: &Var,
    stop: &Var,
    emit_token: &dyn Fn(&mut Func, &str, &str, &str),
) {
    let r = f.add_u(c.row0, j);
    let r64 = f.zext64_u(&r);
    let draft = f.mul_u(c.seq, "%k");
    let draft = f.add_u(&draft, j);
    let draft64 = f.zext64_u(&draft);
    let a = f.gaddr_u("%drafts", &draft64, 4);
    let d = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
    let l = f.var_u("double", NAN);
    f.if_then_u(c.has_lse, |f| {
        let a = f.gaddr_u("%lse", &r64, 4);
        let x = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
        let x = f.v(format!("fpext float {x} to double"));
        f.set_u(&l, &x);
    });
    let l = f.get_u(&l);
    let a = f.gaddr_u("%temperatures", &r64, 4);
    let t = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
    let cold = f.v(format!("fcmp oeq float {t}, 0.0"));
    let all = f.v("icmp ne i32 %all_greedy, 0");
    let greedy = f.v(format!("or i1 {all}, {cold}"));
    // `RowFilter::is_off`: top_k == 0 && top_p >= 1 && min_p <= 0.
    let filtered = f.var_u("i1", "false");
    let sampled = f.v(format!("xor i1 {greedy}, true"));
    let look = f.and1_u(c.has_filters, &sampled);
    f.if_then_u(&look, |f| {
        let (top_k, top_p, min_p) = crate::filter::load_row_filter_u(f, &r64);
        let k0 = f.v(format!("icmp eq i32 {top_k}, 0"));
        let p1 = f.v(format!("fcmp oge float {top_p}, {}", f32c_u(1.0)));
        let m0 = f.v(format!("fcmp ole float {min_p}, 0.0"));
        let off = f.and1_u(&k0, &p1);
        let off = f.and1_u(&off, &m0);
        let on = f.v(format!("xor i1 {off}, true"));
        f.set_u(&filtered, &on);
    });
    let filtered = f.get_u(&filtered);
    f.if_else_u(
        &filtered,
        |f| {
            f.set_u(outcome, &SpecStatus::Filtered.code().to_string());
            f.set_u(stop, "1");
        },
        |f| {
            let a = f.gaddr_u("%row_tokens", &r64, 4);
            let argmax = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
            let a = f.gaddr_u("%draft_logits", &r64, 4);
            let xd = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
            let hit = f.v(format!("icmp eq i32 {argmax}, {d}"));
            let p_greedy = f.sel_u("double", &hit, &f64c(1.0), &f64c(0.0));
            let xd64 = f.v(format!("fpext float {xd} to double"));
            let diff = dsub(f, &xd64, &l);
            let p_full = f.v(format!("call double @fs_exp_f64(double {diff})"));
            let p = f.sel_u("double", &greedy, &p_greedy, &p_full);
            let (k0, k1, ctr) = row_stream_u(f, c.has_rs, &r, &r64);
            let vocab64 = f.v("zext i32 %vocab to i64");
            let q_base = f.v(format!("mul i64 {draft64}, {vocab64}"));
            let row = Row {
                r64: r64.clone(),
                tiles_wide: c.tiles_wide.to_string(),
                per_tile_wide: c.per_tile_wide.to_string(),
                q_base,
                draft: d.clone(),
                l: l.clone(),
                key: (k0, k1),
                ctr,
            };
            let qd = q_of(f, &row, &d);
            let w3 = stream_word3_u(f, &r64, NoiseStream::SpecAccept);
            let ty = "{ i32, i32, i32, i32 }";
            let block = f.v(format!("call {ty} @fs_philox(i32 0, i32 {}, i32 0, i32 {w3}, i32 {}, i32 {})", row.ctr, row.key.0, row.key.1));
            let bits = f.v(format!("extractvalue {ty} {block}, 0"));
            let u = uniform_f64(f, &bits);
            let ratio = ddiv(f, &p, &qd);
            let accept = f.v(format!("fcmp olt double {u}, {ratio}"));
            f.if_else_u(
                &accept,
                |f| {
                    emit_token(f, j, &d, &xd);
                    let n = f.add_u(j, "1");
                    f.set_u(accepted, &n);
                },
                |f| {
                    f.set_u(stop, "1");
                    f.if_else_u(
                        &greedy,
                        |f| {
                            let a = f.gaddr_u("%row_logits", &r64, 4);
                            let x = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
                            emit_token(f, j, &argmax, &x);
                        },
                        |f| {
                            let (found, v, x) = residual_draw(f, c.tid, c.warp, c.lane0, &row);
                            f.if_else_u(
                                &found,
                                |f| emit_token(f, j, &v, &x),
                                |f| f.set_u(outcome, &SpecStatus::Recompute.code().to_string()),
                            );
                        },
                    );
                },
            );
        },
    );
}

/// `flashsample_spec_targets`: `targets[r] = drafts[(r / (k+1))·k + r mod (k+1)]` for a
/// draft row, 0 for a bonus row (unread), one thread per row.
pub(crate) fn emit_targets() -> String {
    let mut f = Func::new();
    let cta = f.sreg_u("ctaid.x");
    let tid = f.sreg_u("tid.x");
    let r = f.mul_u(&cta, &DECIDE_THREADS.to_string());
    let r = f.add_u(&r, &tid);
    let live = f.ult_u(&r, "%batch");
    f.if_then_u(&live, |f| {
        let period = f.add_u("%k", "1");
        let seq = f.v(format!("udiv i32 {r}, {period}"));
        let j = f.v(format!("urem i32 {r}, {period}"));
        let draft_row = f.v(format!("icmp ne i32 {j}, %k"));
        let token = f.var_u("i32", "0");
        f.if_then_u(&draft_row, |f| {
            let at = f.mul_u(&seq, "%k");
            let at = f.add_u(&at, &j);
            let at64 = f.zext64_u(&at);
            let a = f.gaddr_u("%drafts", &at64, 4);
            let d = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
            f.set_u(&token, &d);
        });
        let t = f.get_u(&token);
        let r64 = f.zext64_u(&r);
        let a = f.gaddr_u("%targets", &r64, 4);
        f.s(format!("store i32 {t}, ptr addrspace(1) {a}, align 4"));
    });
    f.s("ret void");
    f.finish(&SPEC_TARGETS.llvm_header(TARGETS_NAME, &format!("\"nvvm.maxntid\"=\"{DECIDE_THREADS}\"")))
}
