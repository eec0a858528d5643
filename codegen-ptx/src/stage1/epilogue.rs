//! DESIGN.md steps 2–7 on a thread's accumulators, in named phases that every schedule shares:
//!
//! 1. [`Gen::columns`]: per batch column the thread owns, the row's parameters (temperature,
//!    Philox key and counter row, penalty range).
//! 2. [`Gen::transform`]: raw logits → transformed logits `x` (−inf where excluded) and the
//!    non-finite flags (steps 2–4).
//! 3. `lists.rs` (step 6b), when the pipeline keeps lists.
//! 4. [`Gen::reduce_lse`]: non-finite flags and logsumexp partials over the lanes and warps of
//!    each column, stored per (row, tile) (step 7).
//! 5. [`Gen::select`]: per sample, the best token of each column by score (`x` + Gumbel noise),
//!    over the lanes and warps, stored as the tile's candidate (steps 5–6).
//!
//! Cross-warp values pass through the epilogue area's scratch ([`ScratchLayout`]).
//!
//! [`ScratchLayout`]: crate::ScratchLayout

use super::{Gen, Item, Thread};
use crate::{lse, math};
use crate::ir::{f32c_u, Func, Value, Var, F32, I32, NEG_INF, POS_INF};
use flashsample_abi::lse::{EMPTY_WINDOW, KEPT_WINDOWS};
use flashsample_abi::rng::gumbel_f32_upper_bound;
use flashsample_abi::{INDEX_NONE, INDEX_NONFINITE};
use flashsample_ir::{Pipeline, Transform};

/// A batch column `(n, j)` the thread owns and the row parameters its transforms read.
/// The noise parameters are [`ColNoise`], loaded per column pair where the selection needs
/// them: holding every column's for the whole epilogue cost registers the accumulators need
/// (ptxas spilled at batch tiles of 64 and 128).
struct Col {
    col: String,
    row: String,
    row_safe: String,
    /// The row's inputs of the transform chain (temperature, penalty and logit-bias ranges).
    tr: RowTransform,
}

/// A column's noise parameters (not for greedy pipelines).
struct ColNoise {
    /// Whether the column takes its argmax: temperature 0, or a draft row of a verifying
    /// pipeline (it reads its noise only through the residual lists).
    greedy: String,
    /// Philox key halves and counter row (`SamplingParams::row_stream`).
    key_lo: String,
    key_hi: String,
    ctr_row: String,
    /// Philox counter word 3: the row's decode step and the token stream.
    word3: String,
}

/// One row's inputs of DESIGN.md step 3's transform chain, loaded once per row and read by
/// [`transform_token`] for each of its tokens (stage one's columns, the exact nucleus's rows).
pub(crate) struct RowTransform {
    /// `1 / T` and whether `T == 0` (then the temperature leaves `x` alone).
    pub(crate) inv_t: String,
    pub(crate) t_zero: String,
    /// Penalty CSR range and repetition of the row.
    pub(crate) pen: Option<(String, String, String)>,
    /// Logit-bias CSR range of the row.
    pub(crate) lb: Option<(String, String)>,
}

impl RowTransform {
    /// Row `row_safe`'s `1 / T` and `T == 0` from `%temperatures` (`("", false)` without a
    /// temperature transform).
    pub(crate) fn temperature(f: &mut Func, p: &Pipeline, row_safe: &str) -> (String, String) {
        if p.temperature().is_none() {
            return (String::new(), "false".to_string());
        }
        let r64 = f.zext64_u(row_safe);
        let a = f.gaddr_u("%temperatures", &r64, 4);
        let tv: F32 = f.load(&a, 4);
        let z = f.v(format!("fcmp oeq float {tv}, 0.0"));
        (f.fdiv_u(&f32c_u(1.0), tv.text()), z)
    }

    /// Row `row_safe`'s penalty range and repetition (`%pen_offsets`, `%pen_repetition`) and
    /// logit-bias range (`%lb_offsets`), where the pipeline has them.
    #[allow(clippy::type_complexity)]
    pub(crate) fn tables(f: &mut Func, p: &Pipeline, row_safe: &str) -> (Option<(String, String, String)>, Option<(String, String)>) {
        let pen = p.has_penalties().then(|| {
            let r64 = f.zext64_u(row_safe);
            let (lo, hi) = csr_range(f, "%pen_offsets", &r64);
            let a = f.gaddr_u("%pen_repetition", &r64, 4);
            let rep = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
            (lo, hi, rep)
        });
        let lb = p.has_logit_bias().then(|| {
            let r64 = f.zext64_u(row_safe);
            csr_range(f, "%lb_offsets", &r64)
        });
        (pen, lb)
    }
}

/// One token's place in the per-row bitsets: `v`, `bit = v % 32`, whether `v < V`, and the
/// row's words of the penalized- and biased-token bitsets that hold `v` (where the pipeline
/// has those tables).
pub(crate) struct TokenBits<'a> {
    pub(crate) v: &'a str,
    pub(crate) bit: &'a str,
    pub(crate) v_ok: &'a str,
    pub(crate) pen_word: Option<&'a str>,
    pub(crate) lb_word: Option<&'a str>,
}

/// DESIGN.md step 3: the transform chain on one token's matmul value `raw` for a row, in
/// pipeline order and in f32 (`bias`: the token's global bias, loaded when the pipeline has
/// one). Masks are not applied here (step 4). The one emitter of the chain: stage one's
/// epilogue and the exact nucleus's logits kernel both call it, so their `x` are the same bits.
pub(crate) fn transform_token(f: &mut Func, transforms: &[Transform], row: &RowTransform, raw: &str, bias: &str, t: &TokenBits<'_>) -> String {
    let v = t.v;
    let mut xv = raw.to_string();
    for tr in transforms {
        match tr {
            Transform::Temperature(_) => {
                let scaled = f.fmul_u(&xv, &row.inv_t);
                xv = f.sel_u("float", &row.t_zero, &xv, &scaled);
            }
            Transform::Bias { .. } => xv = f.fadd_u(&xv, bias),
            Transform::Softcap { cap } => {
                xv = f.v(format!(
                    "call float @fs_softcap_f32(float {xv}, float {})",
                    f32c_u(cap.get())
                ))
            }
            Transform::Penalties { .. } => {
                let (Some((lo, hi, rep)), Some(word)) = (&row.pen, t.pen_word) else { continue };
                xv = listed_call(f, word, t.bit, t.v_ok, &xv, &format!(
                    "call float @fs_penalize_token(float {xv}, i32 {v}, i32 {lo}, i32 {hi}, \
                     ptr addrspace(1) %pen_tokens, ptr addrspace(1) %pen_subtract, float {rep})"
                ));
            }
            Transform::LogitBias { .. } => {
                let (Some((lo, hi)), Some(word)) = (&row.lb, t.lb_word) else { continue };
                xv = listed_call(f, word, t.bit, t.v_ok, &xv, &format!(
                    "call float @fs_logit_bias_token(float {xv}, i32 {v}, i32 {lo}, i32 {hi}, \
                     ptr addrspace(1) %lb_tokens, ptr addrspace(1) %lb_values)"
                ));
            }
            // Exclusion is the caller's `ok` test (step 4); the filter acts on the lists
            // (step 6b) and in stage three.
            Transform::Mask { .. } | Transform::Ban { .. } | Transform::Filter { .. } => {}
        }
    }
    xv
}

/// The transformed logits of the thread's accumulators (same indices), the non-finite flag
/// per column and the first token of each of its quads.
struct Transformed {
    x: Vec<String>,
    /// The raw logits (DESIGN.md step 10: the model's transforms only, `-inf` past the
    /// vocabulary), same indices; only in the raw logprob mode.
    raw: Option<Vec<String>>,
    nonfinite: Vec<String>,
    quad_base: Vec<String>,
}

/// Predicates the reduction phases share: the lanes that hold a column's warp result, and
/// the threads that combine one column over the warps.
struct Reducers {
    lane_lt4: String,
    tid_lt_bt: String,
}

impl Gen<'_> {
    /// Steps 2–7 on the thread's accumulators (`acc`, by [`Gen::acc_index`]).
    pub(super) fn epilogue(&self, f: &mut Func, th: &Thread, it: &Item, acc: &[F32]) {
        let warp_base = f.mul_u(&th.warp, &self.warp_rows().to_string());
        let g4 = f.v(format!("shl i32 {}, 2", th.g));
        let t2 = f.v(format!("shl i32 {}, 1", th.t));
        let cols = self.columns(f, it, &t2);
        let t = self.transform(f, it, &cols, acc, &warp_base, &g4);
        // What the targets and the candidates carry: the raw logits in the raw mode.
        let carried = t.raw.as_ref().unwrap_or(&t.x);
        // A verifying pipeline's targets are the draft tokens (each draft row's logit at its
        // draft); it is never in the raw mode (IrError::VerifyWithRawLogprobs).
        if self.p.targets.is_some() || self.p.verify.is_some() {
            self.store_targets(f, it, &cols, &t.quad_base, carried);
        }
        // A raw pipeline's config may hold lists for its raw top logprobs alone.
        let processed_lists = self.c.list_per_tile > 0 && (self.p.logprob_mode.is_processed() || self.p.list_capacity() > 0);
        if processed_lists {
            self.list_epilogue(f, th, it, &t.x, "%lists");
            if self.p.lists_carry_raw() {
                self.list_raws_epilogue(f, th, it, carried);
            }
        }
        if self.c.list_per_tile > 0 && self.p.raw_list_capacity() > 0 {
            // Every warp is done reading the tile of the lists before.
            f.barrier();
            self.list_epilogue(f, th, it, carried, "%raw_lists");
        }
        if self.c.residual_per_tile > 0 {
            self.residual_epilogue(f, th, it, &t.x);
        }
        // Where nothing after the list epilogue rewrote its tile, the later phases read the
        // thread's logits back from it: the selection rounds then run without them live
        // (ptxas spilled there at batch tiles of 64 and more).
        let reread = processed_lists
            && t.raw.is_none()
            && !self.p.lists_carry_raw()
            && self.p.raw_list_capacity() == 0
            && self.c.residual_per_tile == 0;
        let t = if reread { Transformed { x: self.load_list_tile(f, th), ..t } } else { t };
        let carried = t.raw.as_ref().unwrap_or(&t.x);
        let reducers = self.reduce_lse(f, th, it, &cols, &t.x, Some(&t.nonfinite), self.lse, "%lse");
        if let Some(raw) = &t.raw {
            // Step 10: every token of the vocabulary counts, allowed or not.
            self.reduce_lse(f, th, it, &cols, raw, None, true, "%raw_lse");
        }
        self.select(f, th, it, &cols, &t, carried, &reducers);
    }

    /// Phase 1: the thread's columns `8n + 2t + j` and their rows' parameters.
    fn columns(&self, f: &mut Func, it: &Item, t2: &str) -> Vec<Col> {
        let p = self.p;
        let mut cols = Vec::new();
        for n in 0..self.ntiles {
            for j in 0..2 {
                let col = f.add_u(t2, &(n * 8 + j).to_string());
                let row = f.add_u(&it.b0, &col);
                let ok = f.ult_u(&row, "%batch");
                let row_safe = f.sel_u("i32", &ok, &row, "0");
                let (inv_t, t_zero) = RowTransform::temperature(f, p, &row_safe);
                let (pen, lb) = RowTransform::tables(f, p, &row_safe);
                cols.push(Col { col, row, row_safe, tr: RowTransform { inv_t, t_zero, pen, lb } });
            }
        }
        cols
    }

    /// Column `cl`'s noise parameters, loaded where a column pair's selection starts.
    fn col_noise(&self, f: &mut Func, cl: &Col) -> ColNoise {
        // Only `T == 0` is read: LLVM drops the unused `1 / T`.
        let (_, t_zero) = RowTransform::temperature(f, self.p, &cl.row_safe);
        let greedy = if self.c.residual_per_tile > 0 {
            // A draft row's candidate is its argmax: verification reads its noise only
            // through the residual lists.
            let draft = self.is_draft_row(f, &cl.row);
            f.v(format!("or i1 {t_zero}, {draft}"))
        } else {
            t_zero
        };
        let has_rs = f.v("icmp ne ptr addrspace(1) %row_seeds, null");
        let r64 = f.zext64_u(&cl.row_safe);
        let (key_lo, key_hi, ctr_row) = math::row_stream_u(f, &has_rs, &cl.row, &r64);
        let word3 = math::token_word3_u(f, &r64);
        ColNoise { greedy, key_lo, key_hi, ctr_row, word3 }
    }

    /// Phase 2 (steps 2–4): transformed logits and non-finite flags.
    fn transform(&self, f: &mut Func, it: &Item, cols: &[Col], acc: &[F32], warp_base: &str, g4: &str) -> Transformed {
        let p = self.p;
        let has_bias = p.has_bias();
        let has_mask = p.has_mask();
        let has_pen = p.has_penalties();
        let has_lb = p.has_logit_bias();
        let words = f.add_u("%vocab", "31");
        let words = f.v(format!("lshr i32 {words}, 5"));

        // Transformed logits x (−inf when excluded) and the non-finite flag per column.
        let mut x = vec![String::new(); self.acc_count()];
        let mut raw_x = p.needs_raw_logsumexp().then(|| vec![String::new(); self.acc_count()]);
        let mut nonfinite = vec!["false".to_string(); cols.len()];
        let mut quad_base = Vec::new();
        for q in 0..self.quads {
            let qb = f.add_u(&it.v0, warp_base);
            let qb = f.add_u(&qb, &(q * 32).to_string());
            let qb = f.add_u(&qb, g4);
            // A quad never straddles a bitset word, so one word per column (row) serves it:
            // of the allowed-token bitset and of the penalized- and biased-token bitsets.
            let quad_words = |f: &mut Func, table: &str| -> Vec<String> {
                let qok = f.ult_u(&qb, "%vocab");
                let qs = f.sel_u("i32", &qok, &qb, "0");
                let wcol = f.v(format!("lshr i32 {qs}, 5"));
                cols.iter()
                    .map(|cl| {
                        let wi = f.mul_u(&cl.row_safe, &words);
                        let wi = f.add_u(&wi, &wcol);
                        let wi = f.zext64_u(&wi);
                        let a = f.gaddr_u(table, &wi, 4);
                        f.v(format!("load i32, ptr addrspace(1) {a}, align 4"))
                    })
                    .collect()
            };
            let mask_words = if has_mask { quad_words(f, "%allowed") } else { Vec::new() };
            let pen_words = if has_pen { quad_words(f, "%pen_bits") } else { Vec::new() };
            let lb_words = if has_lb { quad_words(f, "%lb_bits") } else { Vec::new() };
            for o in 0..4 {
                let v = f.add_u(&qb, &o.to_string());
                let v_ok = f.ult_u(&v, "%vocab");
                let bias = if has_bias {
                    let vs = f.sel_u("i32", &v_ok, &v, "0");
                    let v64 = f.zext64_u(&vs);
                    let a = f.gaddr_u("%bias", &v64, 4);
                    f.v(format!("load float, ptr addrspace(1) {a}, align 4"))
                } else {
                    String::new()
                };
                let bit = f.v(format!("and i32 {v}, 31"));
                for (ci, cl) in cols.iter().enumerate() {
                    let (n, j) = (ci as u32 / 2, ci as u32 % 2);
                    let idx = self.acc_index(q, o, n, j);
                    let raw = acc[idx].clone();
                    let abs = f.v(format!("call float @llvm.fabs.f32(float {raw})"));
                    let bad = f.v(format!("fcmp ueq float {abs}, 0x7FF0000000000000"));
                    let bad = f.and1_u(&bad, &v_ok);
                    nonfinite[ci] = f.v(format!("or i1 {}, {bad}", nonfinite[ci]));
                    if let Some(rx) = &mut raw_x {
                        rx[idx] = model_logit(f, &p.transforms, &raw, &bias, &v_ok);
                    }
                    let bits = TokenBits {
                        v: &v,
                        bit: &bit,
                        v_ok: &v_ok,
                        pen_word: pen_words.get(ci).map(String::as_str),
                        lb_word: lb_words.get(ci).map(String::as_str),
                    };
                    let xv = transform_token(f, &p.transforms, &cl.tr, &raw, &bias, &bits);
                    let mut ok = v_ok.clone();
                    if has_mask {
                        let sh = f.v(format!("lshr i32 {}, {bit}", mask_words[ci]));
                        let b = f.v(format!("trunc i32 {sh} to i1"));
                        ok = f.and1_u(&ok, &b);
                    }
                    x[idx] = f.sel_u("float", &ok, &xv, NEG_INF);
                }
            }
            quad_base.push(qb);
        }

        Transformed { x, raw: raw_x, nonfinite, quad_base }
    }

    /// Step 7b: the thread holding a row's target token stores its logit `x` (transformed, or
    /// raw in the raw mode; `-inf` when excluded) at `target_logprobs[row]`; one thread of the
    /// launch holds each.
    fn store_targets(&self, f: &mut Func, it: &Item, cols: &[Col], quad_base: &[String], x: &[String]) {
        let has = f.v("icmp ne ptr addrspace(1) %targets, null");
        for (ci, cl) in cols.iter().enumerate() {
            let (n, j) = (ci as u32 / 2, ci as u32 % 2);
            let row = f.add_u(&it.b0, &cl.col);
            let row_ok = f.ult_u(&row, "%batch");
            let ok = f.and1_u(&row_ok, &has);
            f.if_then_u(&ok, |f| {
                let r64 = f.zext64_u(&row);
                let a = f.gaddr_u("%targets", &r64, 4);
                let target = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
                let mut found = "false".to_string();
                let mut value = NEG_INF.to_string();
                for q in 0..self.quads {
                    for o in 0..4 {
                        let v = f.add_u(&quad_base[q as usize], &o.to_string());
                        let hit = f.v(format!("icmp eq i32 {v}, {target}"));
                        value = f.sel_u("float", &hit, &x[self.acc_index(q, o, n, j)], &value);
                        found = f.v(format!("or i1 {found}, {hit}"));
                    }
                }
                f.if_then_u(&found, |f| {
                    let live = f.v(format!("fcmp ogt float {value}, {NEG_INF}"));
                    let value = f.sel_u("float", &live, &value, NEG_INF);
                    let a = f.gaddr_u("%target_logprobs", &r64, 4);
                    f.s(format!("store float {value}, ptr addrspace(1) {a}, align 4"));
                });
            });
        }
    }

    /// Byte offset of scratch entry (`warp`, `col`) within a scratch field.
    fn scratch_slot(&self, f: &mut Func, warp: &str, col: &str) -> String {
        let s = f.mul_u(warp, &self.c.batch_tile.to_string());
        let s = f.add_u(&s, col);
        f.v(format!("shl i32 {s}, 2"))
    }

    /// Stores `v` (`ty`) at `slot4` of the scratch field at `field` of this thread's area.
    fn st_scratch(&self, f: &mut Func, th: &Thread, ty: &str, field: u32, slot4: &str, v: &str) {
        let off = f.add_u(slot4, &field.to_string());
        let off = f.add_u(&off, &th.scratch);
        let a = f.saddr_u("@fs_smem", &off);
        f.s(format!("store {ty} {v}, ptr addrspace(3) {a}, align 4"));
    }

    /// Loads the `ty` at `slot4` of the scratch field at `field` of this thread's area.
    fn ld_scratch(&self, f: &mut Func, th: &Thread, ty: &str, field: u32, slot4: &str) -> String {
        let off = f.add_u(slot4, &field.to_string());
        let off = f.add_u(&off, &th.scratch);
        let a = f.saddr_u("@fs_smem", &off);
        f.v(format!("load {ty}, ptr addrspace(3) {a}, align 4"))
    }

    /// Phase 4 (step 7): non-finite flags (when `nonfinite` is given) and logsumexp partials
    /// of `x` per column (when `lse`, stored at the partials `dest`), reduced over the 8 lanes
    /// sharing t (xor 4, 8, 16), written per warp, combined over the warps. The flags go to
    /// their own scratch field, which a second call (the raw partials) leaves alone.
    #[allow(clippy::too_many_arguments)]
    fn reduce_lse(
        &self,
        f: &mut Func,
        th: &Thread,
        it: &Item,
        cols: &[Col],
        x: &[String],
        nonfinite: Option<&[String]>,
        lse: bool,
        dest: &str,
    ) -> Reducers {
        let c = self.c;
        let bt = c.batch_tile;
        let sc = c.smem_layout().scratch;
        let lane_lt4 = f.ult_u(&th.lane, "4");
        // Each column's flag and partial (window and its three sums) go to the scratch as soon
        // as they are known, so no column's partial stays live past its own merge.
        let mut flags = Vec::new();
        for (ci, cl) in cols.iter().enumerate() {
            let flag = nonfinite.map(|nf| {
                let mut flag = f.v(format!("zext i1 {} to i32", nf[ci]));
                for sh in [4, 8, 16] {
                    let o = f.shfl_xor_i32_u(&flag, sh);
                    flag = f.v(format!("or i32 {flag}, {o}"));
                }
                flag
            });
            let mut part = None;
            if lse {
                let (n, j) = (ci as u32 / 2, ci as u32 % 2);
                let xs: Vec<&String> =
                    (0..self.quads).flat_map(|q| (0..4).map(move |o| (q, o))).map(|(q, o)| &x[self.acc_index(q, o, n, j)]).collect();
                let own = lse::sum_logits_u(f, &xs);
                part = Some(lse::warp_merge_u(f, false, own, &[4, 8, 16]));
            }
            if let Some((w, sums)) = &part {
                f.if_then_u(&lane_lt4, |f| {
                    let slot = self.scratch_slot(f, &th.warp, &cl.col);
                    if let Some(flag) = &flag {
                        self.st_scratch(f, th, "i32", sc.nonfinite, &slot, flag);
                    }
                    self.st_scratch(f, th, "i32", sc.lse_window, &slot, w);
                    let slot8 = f.v(format!("shl i32 {slot}, 1"));
                    for (field, v) in sc.lse_sums.iter().zip(sums) {
                        self.st_scratch(f, th, "i64", *field, &slot8, v);
                    }
                });
            }
            flags.extend(flag);
        }
        if !lse && !flags.is_empty() {
            // Without a logsumexp only the flags cross warps: one block stores them all.
            f.if_then_u(&lane_lt4, |f| {
                for (cl, flag) in cols.iter().zip(&flags) {
                    let slot = self.scratch_slot(f, &th.warp, &cl.col);
                    self.st_scratch(f, th, "i32", sc.nonfinite, &slot, flag);
                }
            });
        }
        f.barrier();
        let tid_lt_bt = f.ult_u(&th.tid, &bt.to_string());
        if lse {
            // The column's sum over the warps (exact: the merge order does not matter).
            f.if_then_u(&tid_lt_bt, |f| {
                let mut acc = (EMPTY_WINDOW.to_string(), std::array::from_fn::<String, KEPT_WINDOWS, _>(|_| "0".to_string()));
                for w in 0..c.warps {
                    let slot = self.scratch_slot(f, &w.to_string(), &th.tid);
                    let ww = self.ld_scratch(f, th, "i32", sc.lse_window, &slot);
                    let slot8 = f.v(format!("shl i32 {slot}, 1"));
                    let sums = sc.lse_sums.map(|field| self.ld_scratch(f, th, "i64", field, &slot8));
                    acc = lse::merge_call_u(f, false, &acc, &(ww, sums));
                }
                let row = f.add_u(&it.b0, &th.tid);
                let row_ok = f.ult_u(&row, "%batch");
                let lse_ok = f.v(format!("icmp ne ptr addrspace(1) {dest}, null"));
                let ok = f.and1_u(&row_ok, &lse_ok);
                f.if_then_u(&ok, |f| {
                    let i = f.mul_u(&row, &it.vtiles);
                    let i = f.add_u(&i, &it.vtile);
                    let i64v = f.zext64_u(&i);
                    lse::store_partial_u(f, dest, &i64v, &acc.0, &acc.1);
                });
            });
            // The selection phase writes the score, index and logit fields the sums alias.
            f.barrier();
        }

        Reducers { lane_lt4, tid_lt_bt }
    }

    /// Phase 5 (steps 5–6), per sample: the thread's best token per column (ascending v,
    /// strict >, so ties keep the lower index), then the 8 lanes of the column, then the
    /// warps; the tile's candidate per (row, sample).
    /// Each candidate carries `carried` of its token as its logit (the raw logit in the raw
    /// mode, DESIGN.md step 10); the winner is chosen by the transformed score either way.
    #[allow(clippy::too_many_arguments)]
    fn select(&self, f: &mut Func, th: &Thread, it: &Item, cols: &[Col], t: &Transformed, carried: &[String], r: &Reducers) {
        let c = self.c;
        let p = self.p;
        let samples = p.samples_per_row();
        let sc = c.smem_layout().scratch;
        let (x, quad_base) = (&t.x, &t.quad_base);
        let (lane_lt4, tid_lt_bt) = (&r.lane_lt4, &r.tid_lt_bt);
        let none = INDEX_NONE as i32;
        f.for_loop_u("0", &samples.to_string(), "1", |f, s| {
            // Columns come in pairs (j = 0, 1 of an n tile): one noise call serves both.
            for (n, pair) in cols.chunks(2).enumerate() {
                // An n tile past the batch (rows 8n.. of a partly filled batch tile) is skipped
                // whole: the test is uniform over the CTA, and the noise is most of the
                // epilogue's work. Its columns report NONE, which no live row reads.
                let outs: Vec<[Var; 3]> = pair
                    .iter()
                    .map(|_| [f.var_u("float", NEG_INF), f.var_u("i32", &none.to_string()), f.var_u("float", NEG_INF)])
                    .collect();
                let first_row = f.add_u(&it.b0, &(n as u32 * 8).to_string());
                let live = f.ult_u(&first_row, "%batch");
                f.if_then_u(&live, |f| {
                    let mut acc_best: Vec<(String, String, String)> =
                        vec![(NEG_INF.to_string(), none.to_string(), NEG_INF.to_string()); pair.len()];
                    // A score each row's winner reaches (other tiles' candidates so far), or NaN.
                    let bounds: Vec<String> = if p.is_greedy() {
                        Vec::new()
                    } else {
                        pair.iter().map(|cl| self.load_row_bound(f, cl, s)).collect()
                    };
                    let pair_noise: Vec<ColNoise> = if p.is_greedy() { Vec::new() } else { pair.iter().map(|cl| self.col_noise(f, cl)).collect() };
                    for q in 0..self.quads {
                        let noise: Vec<String> = if p.is_greedy() {
                            Vec::new()
                        } else {
                            self.quad_noise(f, q, n as u32, &pair_noise, &acc_best, &bounds, &quad_base[q as usize], s, x)
                        };
                        for pj in 0..pair.len() {
                            let (n, j) = (n as u32, pj as u32);
                            let (bs, bi, bl) = &mut acc_best[pj];
                            for o in 0..4 {
                                let xv = &x[self.acc_index(q, o, n, j)];
                                let score = if p.is_greedy() {
                                    xv.clone()
                                } else {
                                    let noisy = f.fadd_u(xv, &noise[pj * 4 + o as usize]);
                                    f.sel_u("float", &pair_noise[pj].greedy, xv, &noisy)
                                };
                                let v = f.add_u(&quad_base[q as usize], &o.to_string());
                                let better = f.v(format!("fcmp ogt float {score}, {bs}"));
                                *bs = f.sel_u("float", &better, &score, bs);
                                *bi = f.sel_u("i32", &better, &v, bi);
                                *bl = f.sel_u("float", &better, &carried[self.acc_index(q, o, n, j)], bl);
                            }
                        }
                    }
                    for (best, out) in acc_best.into_iter().zip(&outs) {
                        let (bs, bi, bl) = f.shfl_best_u(best, &[4, 8, 16]);
                        for (slot, v) in out.iter().zip([bs, bi, bl]) {
                            f.set_u(slot, &v);
                        }
                    }
                });
                // The pair's warp results go to the scratch at once, so no column's best
                // stays live while the next pairs are selected.
                let best: Vec<(String, String, String)> = outs.iter().map(|[bs, bi, bl]| (f.get_u(bs), f.get_u(bi), f.get_u(bl))).collect();
                f.if_then_u(lane_lt4, |f| {
                    for (cl, (bs, bi, bl)) in pair.iter().zip(&best) {
                        let slot = self.scratch_slot(f, &th.warp, &cl.col);
                        self.st_scratch(f, th, "float", sc.score, &slot, bs);
                        self.st_scratch(f, th, "i32", sc.index, &slot, bi);
                        self.st_scratch(f, th, "float", sc.logit, &slot, bl);
                    }
                });
            }
            f.barrier();
            f.if_then_u(tid_lt_bt, |f| {
                let mut best = (NEG_INF.to_string(), none.to_string(), NEG_INF.to_string());
                let mut flag = "0".to_string();
                for w in 0..c.warps {
                    let slot = self.scratch_slot(f, &w.to_string(), &th.tid);
                    let ws = self.ld_scratch(f, th, "float", sc.score, &slot);
                    let wi = self.ld_scratch(f, th, "i32", sc.index, &slot);
                    let wl = self.ld_scratch(f, th, "float", sc.logit, &slot);
                    let wf = self.ld_scratch(f, th, "i32", sc.nonfinite, &slot);
                    flag = f.v(format!("or i32 {flag}, {wf}"));
                    best = f.keep_best_u(best, (&ws, &wi, &wl));
                }
                let (bs, bi, bl) = best;
                let nf = f.v(format!("icmp ne i32 {flag}, 0"));
                let index = f.sel_u("i32", &nf, &(INDEX_NONFINITE as i32).to_string(), &bi);
                let row = f.add_u(&it.b0, &th.tid);
                let row_ok = f.ult_u(&row, "%batch");
                f.if_then_u(&row_ok, |f| {
                    let slot = f.mul_u(&row, &samples.to_string());
                    let slot = f.add_u(&slot, s);
                    let slot = f.mul_u(&slot, &it.vtiles);
                    let slot = f.add_u(&slot, &it.vtile);
                    let s64 = f.zext64_u(&slot);
                    let a = f.gaddr_u("%candidates", &s64, 12);
                    // abi::Candidate { score, index, logit }.
                    f.store(&F32::raw(bs.clone()), &a, 4);
                    let a1 = f.offset(&a, 4);
                    f.store(&I32::raw(index), &a1, 4);
                    let a2 = f.offset(&a, 8);
                    f.store(&F32::raw(bl), &a2, 4);
                    if !p.is_greedy() {
                        self.publish_row_bound(f, &row, s, &bs);
                    }
                });
            });
            // The next sample rewrites the scratch just read.
            f.barrier();
        });
    }
}

impl Gen<'_> {
    /// `row_bounds[row · S + s]` decoded: the best score another tile of this launch has
    /// published for (row, sample), a score the row's winner reaches; NaN when none has (the
    /// buffer starts at 0 each launch) or the kernel has no `row_bounds`. Decodes
    /// [`Func::order_key`]: keys with the top bit set are non-negative floats, the rest inverted.
    fn load_row_bound(&self, f: &mut Func, cl: &Col, s: &str) -> String {
        let key = f.var_u("i32", "0");
        let has = f.v("icmp ne ptr addrspace(1) %row_bounds, null");
        f.if_then_u(&has, |f| {
            let a = self.row_bound_addr(f, &cl.row_safe, s);
            let k = f.v(format!("load volatile i32, ptr addrspace(1) {a}, align 4"));
            f.set_u(&key, &k);
        });
        let k = f.get_u(&key);
        let negative = f.v(format!("icmp sge i32 {k}, 0"));
        let inverted = f.v(format!("xor i32 {k}, -1"));
        let cleared = f.v(format!("and i32 {k}, 2147483647"));
        let bits = f.sel_u("i32", &negative, &inverted, &cleared);
        f.v(format!("bitcast i32 {bits} to float"))
    }

    /// Publishes a tile's best score of (row, sample) with an atomic max on its order key, so
    /// later tiles of the row skip noise that cannot beat it. Any published value is the score
    /// of a token of this launch, so it never exceeds the winner's: the skips stay exact
    /// whatever order the tiles run in.
    fn publish_row_bound(&self, f: &mut Func, row: &str, s: &str, score: &str) {
        let has = f.v("icmp ne ptr addrspace(1) %row_bounds, null");
        f.if_then_u(&has, |f| {
            let a = self.row_bound_addr(f, row, s);
            let k = f.order_key_u(score);
            f.s(format!("atomicrmw umax ptr addrspace(1) {a}, i32 {k} monotonic, align 4"));
        });
    }

    fn row_bound_addr(&self, f: &mut Func, row: &str, s: &str) -> String {
        let slot = f.mul_u(row, &self.p.samples_per_row().to_string());
        let slot = f.add_u(&slot, s);
        let s64 = f.zext64_u(&slot);
        f.gaddr_u("%row_bounds", &s64, 4).to_string()
    }

    /// Quad `q`'s Gumbel noise for the column pair `pair` of n tile `n` (`-inf` where skipped),
    /// with both noise skips of DESIGN.md: a column whose best transformed logit of the quad
    /// plus `abi::rng::gumbel_f32_upper_bound()` is below `thr` (the larger of its running best
    /// and its row bound) cannot win, and a greedy column reads no noise; when neither column
    /// needs noise the Philox call is skipped. Otherwise `@fs_noise_pair` applies the second
    /// skip per column once the uniforms are known. The comparisons are strict, so a skipped
    /// token's score stays below a score some token reaches: no tie with the winner either.
    #[allow(clippy::too_many_arguments)]
    fn quad_noise(
        &self,
        f: &mut Func,
        q: u32,
        n: u32,
        pair: &[ColNoise],
        acc_best: &[(String, String, String)],
        bounds: &[String],
        quad_base: &str,
        s: &str,
        x: &[String],
    ) -> Vec<String> {
        let up = f32c_u(gumbel_f32_upper_bound());
        let mut xmax = Vec::new();
        let mut thr = Vec::new();
        let mut need = "false".to_string();
        for (pj, cl) in pair.iter().enumerate() {
            let mut m = x[self.acc_index(q, 0, n, pj as u32)].clone();
            for o in 1..4 {
                let xo = &x[self.acc_index(q, o, n, pj as u32)];
                m = f.v(format!("call float @llvm.maxnum.f32(float {m}, float {xo})"));
            }
            let bs = &acc_best[pj].0;
            let bound_higher = f.v(format!("fcmp ogt float {}, {bs}", bounds[pj]));
            let t = f.sel_u("float", &bound_higher, &bounds[pj], bs);
            // A greedy column reads no noise: a threshold of +inf skips its transform.
            let t = f.sel_u("float", &cl.greedy, POS_INF, &t);
            let reach = f.fadd_u(&m, &up);
            let beaten = f.v(format!("fcmp olt float {reach}, {t}"));
            let needed = f.v(format!("xor i1 {beaten}, true"));
            need = f.v(format!("or i1 {need}, {needed}"));
            xmax.push(m);
            thr.push(t);
        }
        let noise: Vec<Var> = (0..pair.len() * 4).map(|_| f.var_u("float", NEG_INF)).collect();
        f.if_then_u(&need, |f| {
            // Global index g = v + vocab_offset (a multiple of 4: same quads).
            let g = f.add_u(quad_base, "%vocab_offset");
            let ctr = f.v(format!("lshr i32 {g}, 2"));
            let (a, b) = (&pair[0], &pair[pair.len() - 1]);
            let (ia, ib) = (0, pair.len() - 1);
            let ty = crate::math::NOISE_PAIR_TY;
            let r = f.v(format!(
                "call {ty} @fs_noise_pair(i32 {ctr}, i32 {s}, i32 {}, i32 {}, i32 {}, i32 {}, i32 {}, i32 {}, i32 {}, i32 {}, \
                 float {}, float {}, float {}, float {})",
                a.ctr_row, a.key_lo, a.key_hi, a.word3, b.ctr_row, b.key_lo, b.key_hi, b.word3, xmax[ia], thr[ia], xmax[ib], thr[ib]
            ));
            for (w, slot) in noise.iter().enumerate() {
                let v = f.v(format!("extractvalue {ty} {r}, {w}"));
                f.set_u(slot, &v);
            }
        });
        noise.iter().map(|v| f.get_u(v)).collect()
    }
}

/// DESIGN.md step 10's raw logit of a token: the matmul value `raw` with only the model's
/// transforms (`Transform::is_model`) in pipeline order, in the same f32 ops as
/// [`Gen::transform`]; `-inf` past the vocabulary (`v_ok` false). `bias` is the token's global
/// bias (loaded when the pipeline has one).
pub(crate) fn model_logit(f: &mut Func, transforms: &[Transform], raw: &str, bias: &str, v_ok: &str) -> String {
    let mut xv = raw.to_string();
    for tr in transforms.iter().filter(|t| t.is_model()) {
        match tr {
            Transform::Bias { .. } => xv = f.fadd_u(&xv, bias),
            Transform::Softcap { cap } => {
                xv = f.v(format!("call float @fs_softcap_f32(float {xv}, float {})", f32c_u(cap.get())))
            }
            _ => {}
        }
    }
    f.sel_u("float", v_ok, &xv, NEG_INF)
}

/// The CSR range `[offsets[row], offsets[row + 1])` of a per-row token table (`r64`: the row, as i64).
fn csr_range(f: &mut Func, offsets: &str, r64: &str) -> (String, String) {
    let a = f.gaddr_u(offsets, r64, 4);
    let lo = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
    let a1 = f.v(format!("getelementptr i8, ptr addrspace(1) {a}, i64 4"));
    let hi = f.v(format!("load i32, ptr addrspace(1) {a1}, align 4"));
    (lo, hi)
}

/// `x` after a per-row token table's out-of-line `call` (which yields the new float), taken
/// only when the token's bit is set in the quad's bitset word `word` (and the token exists).
fn listed_call(f: &mut Func, word: &str, bit: &str, v_ok: &str, x: &str, call: &str) -> String {
    let sh = f.v(format!("lshr i32 {word}, {bit}"));
    let b = f.v(format!("trunc i32 {sh} to i1"));
    let b = f.and1_u(&b, v_ok);
    let out = f.var_u("float", x);
    f.if_then_u(&b, |f| {
        let r = f.v(call);
        f.set_u(&out, &r);
    });
    f.get_u(&out)
}

/// `abi::RowTokens::find` inside a helper whose parameters include `%v`, `%lo`, `%hi` and
/// `%tokens`: binary search of `v` in the row's sorted `tokens[lo..hi]`. Returns whether it
/// was found and its entry index (an index inside the row's range either way, so loads at it
/// are safe).
fn find_token(f: &mut Func) -> (String, String) {
    let lo = f.var_u("i32", "%lo");
    let hi = f.var_u("i32", "%hi");
    f.while_loop_u(
        |f| {
            let (l, h) = (f.get_u(&lo), f.get_u(&hi));
            f.ult_u(&l, &h)
        },
        |f| {
            let (l, h) = (f.get_u(&lo), f.get_u(&hi));
            let sum = f.add_u(&l, &h);
            let mid = f.v(format!("lshr i32 {sum}, 1"));
            let m64 = f.zext64_u(&mid);
            let a = f.gaddr_u("%tokens", &m64, 4);
            let t = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
            let less = f.ult_u(&t, "%v");
            let up = f.add_u(&mid, "1");
            let nl = f.sel_u("i32", &less, &up, &l);
            let nh = f.sel_u("i32", &less, &h, &mid);
            f.set_u(&lo, &nl);
            f.set_u(&hi, &nh);
        },
    );
    let at = f.get_u(&lo);
    let inside = f.ult_u(&at, "%hi");
    // Never read past the row's entries (the bitset says `v` is listed, but stay safe).
    let safe = f.sel_u("i32", &inside, &at, "%lo");
    let s64 = f.zext64_u(&safe);
    let a = f.gaddr_u("%tokens", &s64, 4);
    let t = f.v(format!("load i32, ptr addrspace(1) {a}, align 4"));
    let hit = f.v(format!("icmp eq i32 {t}, %v"));
    (f.and1_u(&inside, &hit), s64)
}

/// DESIGN.md step 3, penalties, for a token whose bit is set: [`find_token`], then
/// `abi::penalize_f32` with that entry's subtraction. Out of line (rarely taken, and it holds
/// a loop), so the unrolled epilogue stays small.
pub(super) fn penalize_token() -> String {
    let mut f = Func::new();
    let (found, entry) = find_token(&mut f);
    let a = f.gaddr_u("%subtract", &entry, 4);
    let sub = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
    let pos = f.v("fcmp ogt float %x, 0.0");
    let q = f.fdiv_u("%x", "%rep");
    let m = f.fmul_u("%x", "%rep");
    let y = f.sel_u("float", &pos, &q, &m);
    let y = f.fsub_u(&y, &sub);
    let r = f.sel_u("float", &found, &y, "%x");
    f.s(format!("ret float {r}"));
    f.finish(
        "define internal float @fs_penalize_token(float %x, i32 %v, i32 %lo, i32 %hi, \
         ptr addrspace(1) %tokens, ptr addrspace(1) %subtract, float %rep) #2",
    )
}

/// DESIGN.md step 3, per-request logit bias, for a token whose bit is set: [`find_token`],
/// then `x + values[entry]` (`-inf` bans the token). Out of line like [`penalize_token`].
pub(super) fn logit_bias_token() -> String {
    let mut f = Func::new();
    let (found, entry) = find_token(&mut f);
    let a = f.gaddr_u("%values", &entry, 4);
    let bias = f.v(format!("load float, ptr addrspace(1) {a}, align 4"));
    let y = f.fadd_u("%x", &bias);
    let r = f.sel_u("float", &found, &y, "%x");
    f.s(format!("ret float {r}"));
    f.finish(
        "define internal float @fs_logit_bias_token(float %x, i32 %v, i32 %lo, i32 %hi, \
         ptr addrspace(1) %tokens, ptr addrspace(1) %values) #2",
    )
}
