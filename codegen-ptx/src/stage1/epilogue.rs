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
//! Where lists or residual lists put the tile's `x` in shared memory, phases 4 and 5 read each
//! column back from there where they use it ([`Logits`]). A launch that ranks its targets
//! counts them ([`Gen::count_ranks`], step 7c) where another stores their logits (step 7b).
//! Cross-warp values pass through the epilogue area's scratch ([`ScratchLayout`]).
//!
//! [`ScratchLayout`]: crate::ScratchLayout

use super::{Gen, Item, Thread, SMEM};
use super::lists::ListKind;
use crate::entries::{Candidate, CandidateVar, CANDIDATE_BYTES};
use crate::config::NoiseSkip;
use crate::ir::{f32c, i32c, Atomic, Fcmp, Func, Global, Icmp, Operand, Ptr, Value, Var, F32, I1, I32, I64, SCATTER_ITEMS, X4};
use crate::lse::{self, Partial};
use crate::math::{self, RowStream};
use crate::params::arg;
use crate::stage1::residual::is_draft_row;
use flashsample_abi::rng::gumbel_f32_upper_bound;
use flashsample_abi::INDEX_NONFINITE;
use flashsample_ir::{Pipeline, Transform};

/// A batch column `(n, j)` the thread owns and its row. The row's inputs of the transform
/// chain are a [`RowTransform`] per column, read by the transform phase alone. The noise
/// parameters are [`ColNoise`], loaded per column pair where the selection needs them:
/// holding every column's for the whole epilogue cost registers the accumulators need (ptxas
/// spilled at batch tiles of 64 and 128; loading each pair's one pair ahead, or the first
/// pair's before the transforms, spilled more there and gained under 1 % at B = 16:
/// BENCHMARKS.md, 2026-12-05 fifth session).
struct Col {
    col: I32,
    /// `8n + j`: the column is `2t +` this.
    offset: u32,
    row: I32,
    row_safe: I32,
}

/// A column's noise parameters (not for greedy pipelines).
struct ColNoise {
    /// Whether the column takes its argmax: temperature 0, or a draft row of a verifying
    /// pipeline (it reads its noise only through the residual lists).
    greedy: I1,
    /// The noise of a token whose draw a skip left out: `-inf` (it cannot win), or `-0` for a
    /// greedy column, whose score `x + -0` is then `x` bit for bit with no select per token.
    miss: F32,
    /// Philox key and counter row (`SamplingParams::row_stream`).
    stream: RowStream,
    /// Philox counter word 3: the row's decode step and the token stream.
    word3: I32,
}

/// A row's temperature as the transform chain reads it.
pub(crate) struct RowTemperature {
    /// What the transform multiplies `x` by: `1 / T`, or 1 where `T == 0`, which leaves `x`
    /// alone (`x · 1 = x` bit for bit for every `x` the chain holds; a signalling NaN, the one
    /// exception, never reaches it, as every `x` is an arithmetic result). One select per row
    /// instead of one per token.
    pub(crate) scale: F32,
    /// Whether `T == 0`.
    zero: I1,
}

impl RowTemperature {
    /// `scale` from the row's `1 / T`.
    fn set_reciprocal(&mut self, f: &mut Func, inv_t: &F32) {
        self.scale = f.sel(&self.zero, &f32c(1.0), inv_t);
    }
}

/// A row's entries `[lo, hi)` of a per-row token table (CSR offsets).
pub(crate) struct TokenRange {
    pub(crate) lo: I32,
    pub(crate) hi: I32,
}

/// One row's inputs of DESIGN.md step 3's transform chain, loaded once per row and read by
/// [`transform_token`] for each of its tokens (stage one's columns, the exact nucleus's rows).
pub(crate) struct RowTransform {
    /// The row's temperature, where the pipeline has one.
    pub(crate) temperature: Option<RowTemperature>,
    /// Penalty CSR range and repetition of the row.
    pub(crate) pen: Option<(TokenRange, F32)>,
    /// Logit-bias CSR range of the row.
    pub(crate) lb: Option<TokenRange>,
}

impl RowTransform {
    /// Row `row_safe`'s inputs of the chain: [`RowTransform::temperature`], then its penalty
    /// range and repetition (`%pen_offsets`, `%pen_repetition`) and logit-bias range
    /// (`%lb_offsets`), where the pipeline has them.
    pub(crate) fn load(f: &mut Func, p: &Pipeline, row_safe: &I32) -> RowTransform {
        let (mut tr, t) = RowTransform::load_deferred(f, p, row_safe);
        if let (Some(temp), Some(t)) = (&mut tr.temperature, t) {
            let inv_t = f.fdiv(&f32c(1.0), &t);
            temp.set_reciprocal(f, &inv_t);
        }
        tr
    }

    /// [`RowTransform::load`] with the temperature's `1 / T` left to the caller
    /// ([`RowTemperature::set_reciprocal`]): the row's inputs (`scale` a placeholder) and its
    /// `T`, where the pipeline has one.
    fn load_deferred(f: &mut Func, p: &Pipeline, row_safe: &I32) -> (RowTransform, Option<F32>) {
        let t = RowTransform::load_temperature(f, p, row_safe);
        let temperature = t.as_ref().map(|t| RowTemperature { scale: F32::NAN, zero: f.fcmp(Fcmp::Oeq, t, &F32::ZERO) });
        let pen = p.has_penalties().then(|| {
            let r64 = f.zext(row_safe);
            let range = csr_range(f, &arg::PEN_OFFSETS, &r64);
            let a = f.gaddr(&arg::PEN_REPETITION, &r64, 4);
            (range, f.load(&a, 4))
        });
        let lb = p.has_logit_bias().then(|| {
            let r64 = f.zext(row_safe);
            csr_range(f, &arg::LB_OFFSETS, &r64)
        });
        (RowTransform { temperature, pen, lb }, t)
    }

    /// Row `row_safe`'s `T` from `%temperatures` (none without a temperature transform).
    fn load_temperature(f: &mut Func, p: &Pipeline, row_safe: &I32) -> Option<F32> {
        p.temperature()?;
        let r64 = f.zext(row_safe);
        let a = f.gaddr(&arg::TEMPERATURES, &r64, 4);
        Some(f.load(&a, 4))
    }

    /// Row `row_safe`'s `T == 0` (false without a temperature transform).
    pub(crate) fn temperature_is_zero(f: &mut Func, p: &Pipeline, row_safe: &I32) -> I1 {
        match RowTransform::load_temperature(f, p, row_safe) {
            Some(t) => f.fcmp(Fcmp::Oeq, &t, &F32::ZERO),
            None => I1::FALSE,
        }
    }
}

/// One token's place in the per-row bitsets: `v`, `bit = v % 32`, whether `v < V`, and the
/// row's words of the penalized- and biased-token bitsets that hold `v` (where the pipeline
/// has those tables).
pub(crate) struct TokenBits<'a> {
    pub(crate) v: &'a I32,
    pub(crate) bit: &'a I32,
    pub(crate) v_ok: &'a I1,
    pub(crate) pen_word: Option<&'a I32>,
    pub(crate) lb_word: Option<&'a I32>,
}

/// DESIGN.md step 3: the transform chain on one token's matmul value `raw` for a row, in
/// pipeline order and in f32 (`bias`: the token's global bias, loaded when the pipeline has
/// one). Masks are not applied here (step 4). The one emitter of the chain: stage one's
/// epilogue and the exact nucleus's logits kernel both call it, so their `x` are the same bits.
pub(crate) fn transform_token(f: &mut Func, transforms: &[Transform], row: &RowTransform, raw: &F32, bias: Option<&F32>, t: &TokenBits<'_>) -> F32 {
    let mut xv = raw.clone();
    for tr in transforms {
        match tr {
            Transform::Temperature(_) => {
                let Some(temp) = &row.temperature else { continue };
                xv = f.fmul(&xv, &temp.scale);
            }
            Transform::Bias { .. } => {
                let Some(bias) = bias else { continue };
                xv = f.fadd(&xv, bias);
            }
            Transform::Softcap { cap } => xv = math::softcap(f, &xv, cap.get()),
            Transform::Penalties { .. } => {
                let (Some((range, rep)), Some(word)) = (&row.pen, t.pen_word) else { continue };
                xv = listed_call(f, word, t, &xv, |f, x| {
                    f.call("@fs_penalize_token", &[x, t.v, &range.lo, &range.hi, &arg::PEN_TOKENS, &arg::PEN_SUBTRACT, rep])
                });
            }
            Transform::LogitBias { .. } => {
                let (Some(range), Some(word)) = (&row.lb, t.lb_word) else { continue };
                xv = listed_call(f, word, t, &xv, |f, x| {
                    f.call("@fs_logit_bias_token", &[x, t.v, &range.lo, &range.hi, &arg::LB_TOKENS, &arg::LB_VALUES])
                });
            }
            // Exclusion is the caller's `ok` test (step 4); the filter acts on the lists
            // (step 6b) and in stage three.
            Transform::Mask { .. } | Transform::Ban { .. } | Transform::Filter { .. } => {}
        }
    }
    xv
}

/// One token of row `r` outside a tile (`v < V`, `r` inside the batch), from its matmul value
/// `raw`: its `x` (DESIGN.md steps 3–4: the transform chain, `-inf` where the row's mask
/// excludes it) and its global bias (loaded where the pipeline has one, for the raw logit of
/// step 10, [`model_logit`]). The kernels that recompute a token's logit (the exact nucleus's,
/// the targets') take it here, from the tile epilogue's own emitters, so their bits are stage
/// one's.
pub(crate) fn token_x(f: &mut Func, p: &Pipeline, r: &I32, v: &I32, raw: &F32) -> (F32, Option<F32>) {
    let row = RowTransform::load(f, p, r);
    let words = f.add(&arg::VOCAB, &i32c(31));
    let words = f.lshr(&words, &i32c(5));
    let wi = f.mul(r, &words);
    let wcol = f.lshr(v, &i32c(5));
    let wi = f.add(&wi, &wcol);
    let wi64 = f.zext(&wi);
    let word = |f: &mut Func, table: &Ptr<Global>| -> I32 {
        let a = f.gaddr(table, &wi64, 4);
        f.load(&a, 4)
    };
    let pen_word = p.has_penalties().then(|| word(f, &arg::PEN_BITS));
    let lb_word = p.has_logit_bias().then(|| word(f, &arg::LB_BITS));
    let mask_word = p.has_mask().then(|| word(f, &arg::ALLOWED));
    let v64 = f.zext(v);
    let bias = p.has_bias().then(|| {
        let a = f.gaddr(&arg::BIAS, &v64, 4);
        f.load(&a, 4)
    });
    let bit = f.and(v, &i32c(31));
    let bits = TokenBits { v, bit: &bit, v_ok: &I1::TRUE, pen_word: pen_word.as_ref(), lb_word: lb_word.as_ref() };
    let xv = transform_token(f, &p.transforms, &row, raw, bias.as_ref(), &bits);
    let x = match &mask_word {
        Some(w) => {
            let sh = f.lshr(w, &bit);
            let allowed = f.trunc(&sh);
            f.sel(&allowed, &xv, &F32::NEG_INF)
        }
        None => xv,
    };
    (x, bias)
}

/// The transformed logits of the thread's accumulators (same indices), the non-finite flag
/// per column and the first token of each of its quads.
struct Transformed {
    x: Vec<F32>,
    /// The raw logits (DESIGN.md step 10: the model's transforms only, `-inf` past the
    /// vocabulary), same indices; only in the raw logprob mode.
    raw: Option<Vec<F32>>,
    nonfinite: Vec<I1>,
    quad_base: Vec<I32>,
}

/// Where the phases after the lists read the thread's logits.
enum Logits<'a> {
    /// In registers, same indices as the accumulators: `x`, and what the candidates carry
    /// (the raw logits in the raw mode).
    Regs { x: &'a [F32], carried: &'a [F32] },
    /// In the list tile ([`Gen::store_list_tile`]), which nothing rewrote since: each column's
    /// are loaded where it is used ([`Gen::column`]), so no more than a pair's stay live
    /// through the logsumexp and the selection (whole tiles of them spilled at 128 × 128).
    /// The candidates carry `x`.
    ListTile,
}

/// Predicates the reduction phases share: the lanes that hold a column's warp result, and
/// the threads that combine one column over the warps.
struct Reducers {
    lane_lt4: I1,
    tid_lt_bt: I1,
}

impl Gen<'_> {
    /// Steps 2–7 on the thread's accumulators (`acc`, by [`Gen::acc_index`]).
    pub(super) fn epilogue(&self, f: &mut Func, th: &Thread, it: &Item, acc: &[F32]) {
        let warp_base = f.mul(&th.warp, &i32c(self.warp_rows()));
        let g4 = f.shl(&th.g, &i32c(2));
        let t2 = f.shl(&th.t, &i32c(1));
        let (cols, trs) = self.columns_and_transforms(f, it, &t2);
        let t = self.transform(f, it, &cols, &trs, acc, &warp_base, &g4);
        self.finish_epilogue(f, th, it, &cols, t);
    }

    /// Steps 6b–7 after the transforms: the targets' logits, the lists, the logsumexp
    /// partials and the selection.
    fn finish_epilogue(&self, f: &mut Func, th: &Thread, it: &Item, cols: &[Col], t: Transformed) {
        let carried = t.raw.as_ref().unwrap_or(&t.x);
        self.store_nonfinite(f, th, cols, &t.nonfinite);
        // A verifying pipeline's targets are the draft tokens (each draft row's logit at its
        // draft); it is never in the raw mode (IrError::VerifyWithRawLogprobs).
        if self.p.ranks_targets() {
            // Step 7c: a launch that ranks took its targets' logits from
            // `flashsample_target_logits` before this kernel, and counts against them here; one
            // that does not stores them (7b). Both count and store what the target logprob
            // describes: the raw logits in the raw mode.
            let ranking = f.non_null(&arg::TARGET_RANKS);
            f.if_else(
                &ranking,
                |f| self.count_ranks(f, th, it, cols, &t.quad_base, carried),
                |f| self.store_targets(f, it, cols, &t.quad_base, carried),
            );
        } else if self.p.targets.is_some() || self.p.verify.is_some() {
            self.store_targets(f, it, cols, &t.quad_base, carried);
        }
        // A raw pipeline's config may hold lists for its raw top logprobs alone.
        let processed_lists = self.c.list_per_tile > 0 && (self.p.logprob_mode.is_processed() || self.p.list_capacity() > 0);
        if processed_lists {
            self.list_epilogue(f, th, it, &t.x, ListKind::Processed);
            if self.p.lists_carry_raw() {
                self.list_raws_epilogue(f, th, it, carried);
            }
        }
        if self.c.list_per_tile > 0 && self.p.raw_list_capacity() > 0 {
            // Every warp is done reading the tile of the lists before.
            f.barrier();
            self.list_epilogue(f, th, it, carried, ListKind::Raw);
        }
        if self.c.residual_per_tile > 0 {
            self.residual_epilogue(f, th, it, &t.x);
        }
        // After a list epilogue the columns (their offsets and rows) are computed again rather
        // than held through it: its selection and the residual noise need the registers
        // (ptxas 12.9 spilled 332 B at 256 × 128 for a verifier, 16 B for a filter; 140 and 0
        // this way). `opaque` keeps LLVM from reusing the first computation.
        let reloaded;
        let cols = if self.c.list_per_tile > 0 || self.c.residual_per_tile > 0 {
            let t2 = f.shl(&th.t, &i32c(1));
            let t2 = crate::ptx::opaque(f, &t2);
            reloaded = self.columns(f, it, &t2);
            &reloaded[..]
        } else {
            cols
        };
        // Where the list tile holds the logits (the list epilogue, or the residual lists,
        // stored them; nothing rewrote them since), the later phases read the thread's
        // logits back from it: the selection rounds then run without them live (ptxas
        // spilled there at batch tiles of 64 and more).
        let reread = (processed_lists || self.c.residual_per_tile > 0)
            && t.raw.is_none()
            && !self.p.lists_carry_raw()
            && self.p.raw_list_capacity() == 0;
        let src = if reread { Logits::ListTile } else { Logits::Regs { x: &t.x, carried: t.raw.as_ref().unwrap_or(&t.x) } };
        let reducers = self.reduce_lse(f, th, it, cols, &src, self.lse, &arg::LSE);
        if let Some(raw) = &t.raw {
            // Step 10: every token of the vocabulary counts, allowed or not.
            self.reduce_lse(f, th, it, cols, &Logits::Regs { x: raw, carried: raw }, true, &arg::RAW_LSE);
        }
        self.select(f, th, it, cols, &src, &t.quad_base, &reducers);
    }

    /// Column `(n, j)`'s logits `x` and what its candidates carry, by `q · 4 + o`: copies of
    /// the registers, or loaded from the list tile here, where the column is used.
    fn column(&self, f: &mut Func, th: &Thread, src: &Logits<'_>, n: u32, j: u32) -> (Vec<F32>, Vec<F32>) {
        match src {
            Logits::Regs { x, carried } => {
                let pick = |v: &[F32]| (0..self.quads).flat_map(|q| (0..4).map(move |o| (q, o))).map(|(q, o)| v[self.acc_index(q, o, n, j)].clone()).collect();
                (pick(x), pick(carried))
            }
            Logits::ListTile => {
                let x: Vec<F32> = (0..self.quads)
                    .flat_map(|q| {
                        let a = self.list_tile_quad(f, th, (q, n, j));
                        let vec: X4<F32> = f.load(&a, 16);
                        (0..4).map(|o| f.extract_lane(&vec, o)).collect::<Vec<_>>()
                    })
                    .collect();
                (x.clone(), x)
            }
        }
    }

    /// Phase 1: the thread's columns `8n + 2t + j` and their rows, each column's `per_column`
    /// emitted right after it.
    fn columns_with<T>(&self, f: &mut Func, it: &Item, t2: &I32, mut per_column: impl FnMut(&mut Func, &Col) -> T) -> (Vec<Col>, Vec<T>) {
        let (mut cols, mut out) = (Vec::new(), Vec::new());
        for n in 0..self.ntiles {
            for j in 0..2 {
                let col = f.add(t2, &i32c(n * 8 + j));
                let row = f.add(&it.b0, &col);
                let ok = f.icmp(Icmp::Ult, &row, &arg::BATCH);
                let row_safe = f.sel(&ok, &row, &i32c(0));
                let cl = Col { col, offset: n * 8 + j, row, row_safe };
                out.push(per_column(f, &cl));
                cols.push(cl);
            }
        }
        (cols, out)
    }

    /// The thread's columns ([`Gen::columns_with`]).
    fn columns(&self, f: &mut Func, it: &Item, t2: &I32) -> Vec<Col> {
        self.columns_with(f, it, t2, |_, _| ()).0
    }

    /// The thread's columns and each one's inputs of the transform chain, loaded beside it
    /// (every column's `1 / T` at once: [`math::reciprocals`]).
    fn columns_and_transforms(&self, f: &mut Func, it: &Item, t2: &I32) -> (Vec<Col>, Vec<RowTransform>) {
        let (cols, loaded) = self.columns_with(f, it, t2, |f, cl| RowTransform::load_deferred(f, self.p, &cl.row_safe));
        let (mut trs, temps): (Vec<RowTransform>, Vec<Option<F32>>) = loaded.into_iter().unzip();
        let temps: Vec<F32> = temps.into_iter().flatten().collect();
        if !temps.is_empty() {
            let inv = math::reciprocals(f, &temps);
            for (tr, inv_t) in trs.iter_mut().zip(inv) {
                if let Some(t) = &mut tr.temperature {
                    t.set_reciprocal(f, &inv_t);
                }
            }
        }
        (cols, trs)
    }

    /// A column pair's noise parameters, loaded where its selection starts (none for greedy
    /// pipelines).
    fn pair_noise(&self, f: &mut Func, pair: &[Col]) -> Vec<ColNoise> {
        if self.p.is_greedy() {
            return Vec::new();
        }
        pair.iter().map(|cl| self.col_noise(f, cl)).collect()
    }

    /// Column `cl`'s noise parameters.
    fn col_noise(&self, f: &mut Func, cl: &Col) -> ColNoise {
        let t_zero = RowTransform::temperature_is_zero(f, self.p, &cl.row_safe);
        let r64 = f.zext(&cl.row_safe);
        let mut greedy = t_zero.clone();
        if self.c.residual_per_tile > 0 {
            // A draft row's candidate is its argmax: verification reads its noise only
            // through the residual lists.
            let draft = is_draft_row(f, &cl.row);
            greedy = f.or(&greedy, &draft);
        }
        if self.p.filter_max_k().is_some() {
            // So is the candidate of a row that stage three draws (DESIGN.md step 5): stage
            // two's result for it is replaced.
            let rf = crate::filter::row_filter_or_off(f, &r64);
            let drawn = crate::filter::drawn_in_stage_three(f, &rf, &t_zero);
            greedy = f.or(&greedy, &drawn);
        }
        let has_rs = f.non_null(&arg::ROW_SEEDS);
        let stream = math::row_stream(f, &has_rs, &cl.row, &r64);
        let word3 = math::token_word3(f, &r64);
        let miss = f.sel(&greedy, &F32::NEG_ZERO, &F32::NEG_INF);
        ColNoise { greedy, stream, word3, miss }
    }

    /// Phase 2 (steps 2–4): transformed logits and non-finite flags.
    #[allow(clippy::too_many_arguments)]
    fn transform(&self, f: &mut Func, it: &Item, cols: &[Col], trs: &[RowTransform], acc: &[F32], warp_base: &I32, g4: &I32) -> Transformed {
        let p = self.p;
        let has_mask = p.has_mask();
        let words = f.add(&arg::VOCAB, &i32c(31));
        let words = f.lshr(&words, &i32c(5));

        // Transformed logits x (−inf when excluded) and the non-finite flag per column; every
        // entry of `x` (and `raw_x`) is written below.
        let mut x = vec![F32::NEG_INF; self.acc_count()];
        let mut raw_x = p.needs_raw_logsumexp().then(|| vec![F32::NEG_INF; self.acc_count()]);
        let mut nonfinite = vec![I1::FALSE; cols.len()];
        let mut quad_base = Vec::new();
        for q in 0..self.quads {
            let qb = f.add(&it.v0, warp_base);
            let qb = f.add(&qb, &i32c(q * 32));
            let qb = f.add(&qb, g4);
            // A quad never straddles a bitset word, so one word per column (row) serves it:
            // of the allowed-token bitset and of the penalized- and biased-token bitsets.
            let quad_words = |f: &mut Func, table: &Ptr<Global>| -> Vec<I32> {
                let qok = f.icmp(Icmp::Ult, &qb, &arg::VOCAB);
                let qs = f.sel(&qok, &qb, &i32c(0));
                let wcol = f.lshr(&qs, &i32c(5));
                cols.iter()
                    .map(|cl| {
                        let wi = f.mul(&cl.row_safe, &words);
                        let wi = f.add(&wi, &wcol);
                        let wi = f.zext(&wi);
                        let a = f.gaddr(table, &wi, 4);
                        f.load(&a, 4)
                    })
                    .collect()
            };
            let mask_words = if has_mask { quad_words(f, &arg::ALLOWED) } else { Vec::new() };
            let pen_words = if p.has_penalties() { quad_words(f, &arg::PEN_BITS) } else { Vec::new() };
            let lb_words = if p.has_logit_bias() { quad_words(f, &arg::LB_BITS) } else { Vec::new() };
            for o in 0..4 {
                let v = f.add(&qb, &i32c(o));
                let v_ok = f.icmp(Icmp::Ult, &v, &arg::VOCAB);
                let bias = p.has_bias().then(|| {
                    let vs = f.sel(&v_ok, &v, &i32c(0));
                    let v64 = f.zext(&vs);
                    let a = f.gaddr(&arg::BIAS, &v64, 4);
                    f.load(&a, 4)
                });
                let bit = f.and(&v, &i32c(31));
                for (ci, tr) in trs.iter().enumerate() {
                    let (n, j) = (ci as u32 / 2, ci as u32 % 2);
                    let idx = self.acc_index(q, o, n, j);
                    let raw = &acc[idx];
                    let abs = f.fabs(raw);
                    let bad = f.fcmp(Fcmp::Ueq, &abs, &F32::POS_INF);
                    let bad = f.and(&bad, &v_ok);
                    nonfinite[ci] = f.or(&nonfinite[ci], &bad);
                    if let Some(rx) = &mut raw_x {
                        rx[idx] = model_logit(f, &p.transforms, raw, bias.as_ref(), &v_ok);
                    }
                    let bits = TokenBits { v: &v, bit: &bit, v_ok: &v_ok, pen_word: pen_words.get(ci), lb_word: lb_words.get(ci) };
                    let xv = transform_token(f, &p.transforms, tr, raw, bias.as_ref(), &bits);
                    let mut ok = v_ok.clone();
                    if has_mask {
                        let sh = f.lshr(&mask_words[ci], &bit);
                        let b = f.trunc(&sh);
                        ok = f.and(&ok, &b);
                    }
                    x[idx] = f.sel(&ok, &xv, &F32::NEG_INF);
                }
            }
            quad_base.push(qb);
        }

        Transformed { x, raw: raw_x, nonfinite, quad_base }
    }

    /// Step 7b: the thread holding a row's target token stores its logit `x` (transformed, or
    /// raw in the raw mode; `-inf` when excluded) at `target_logprobs[row]`; one thread of the
    /// launch holds each.
    fn store_targets(&self, f: &mut Func, it: &Item, cols: &[Col], quad_base: &[I32], x: &[F32]) {
        let has = f.non_null(&arg::TARGETS);
        for (ci, cl) in cols.iter().enumerate() {
            let (n, j) = (ci as u32 / 2, ci as u32 % 2);
            let row = f.add(&it.b0, &cl.col);
            let row_ok = f.icmp(Icmp::Ult, &row, &arg::BATCH);
            let ok = f.and(&row_ok, &has);
            f.if_then(&ok, |f| {
                let r64 = f.zext(&row);
                let a = f.gaddr(&arg::TARGETS, &r64, 4);
                let target: I32 = f.load(&a, 4);
                let mut found = I1::FALSE;
                let mut value = F32::NEG_INF;
                for q in 0..self.quads {
                    for o in 0..4 {
                        let v = f.add(&quad_base[q as usize], &i32c(o));
                        let hit = f.icmp(Icmp::Eq, &v, &target);
                        value = f.sel(&hit, &x[self.acc_index(q, o, n, j)], &value);
                        found = f.or(&found, &hit);
                    }
                }
                f.if_then(&found, |f| {
                    let live = f.fcmp(Fcmp::Ogt, &value, &F32::NEG_INF);
                    let value = f.sel(&live, &value, &F32::NEG_INF);
                    let a = f.gaddr(&arg::TARGET_LOGPROBS, &r64, 4);
                    f.store(&value, &a, 4);
                });
            });
        }
    }

    /// Step 7c, the rank: per column, the thread's tokens (`< V`) whose logit (`-inf` when
    /// excluded or NaN, as the target's is stored) is at least the row's target logit
    /// `target_logprobs[row]` (`flashsample_target_logits`' value, read, not written, here),
    /// summed over the 8 lanes sharing the column (xor 4, 8, 16) and added to
    /// `target_ranks[row]` by one lane per warp. Integer adds: any order gives the same count.
    fn count_ranks(&self, f: &mut Func, th: &Thread, it: &Item, cols: &[Col], quad_base: &[I32], x: &[F32]) {
        let first_of_column = f.icmp(Icmp::Ult, &th.lane, &i32c(4));
        for (ci, cl) in cols.iter().enumerate() {
            let (n, j) = (ci as u32 / 2, ci as u32 % 2);
            let row = f.add(&it.b0, &cl.col);
            let row_ok = f.icmp(Icmp::Ult, &row, &arg::BATCH);
            let r64 = f.zext(&cl.row_safe);
            let a = f.gaddr(&arg::TARGET_LOGPROBS, &r64, 4);
            let threshold: F32 = f.load(&a, 4);
            let mut count = i32c(0);
            for q in 0..self.quads {
                for o in 0..4 {
                    let v = f.add(&quad_base[q as usize], &i32c(o));
                    let v_ok = f.icmp(Icmp::Ult, &v, &arg::VOCAB);
                    let y = &x[self.acc_index(q, o, n, j)];
                    let live = f.fcmp(Fcmp::Ogt, y, &F32::NEG_INF);
                    let y = f.sel(&live, y, &F32::NEG_INF);
                    let at_least = f.fcmp(Fcmp::Oge, &y, &threshold);
                    let hit = f.and(&at_least, &v_ok);
                    let one: I32 = f.zext(&hit);
                    count = f.add(&count, &one);
                }
            }
            for mask in [4, 8, 16] {
                let other = f.shfl_xor(&count, mask);
                count = f.add(&count, &other);
            }
            let nonzero = f.icmp(Icmp::Ne, &count, &i32c(0));
            let add = f.and(&first_of_column, &row_ok);
            let add = f.and(&add, &nonzero);
            f.if_then(&add, |f| {
                let r64 = f.zext(&row);
                let a = f.gaddr(&arg::TARGET_RANKS, &r64, 4);
                f.atomic_update(Atomic::Add, &a, &count, Some(4));
            });
        }
    }

    /// Byte offset of this warp's scratch entry of column `cl` within a scratch field: the
    /// thread's own offset plus a constant per column, so every column's access is one
    /// register and an immediate (per-column offsets computed from `2t + 8n + j` were hoisted
    /// out of the persistent item loop, held across the mainloop, and spilled).
    fn column_slot(&self, f: &mut Func, th: &Thread, cl: &Col) -> I32 {
        let t2 = f.shl(&th.t, &i32c(1));
        let own = self.scratch_slot(f, &th.warp, &t2);
        // With a list tile the per-column sums still became `or`s and spilled (filtered
        // 128 × 128 ping-pong: 468 B, 4 B with the opaque base); without one the base alone
        // costs instructions and saves no spill.
        let own = if self.c.smem_layout().list_tile_bytes > 0 { crate::ptx::opaque(f, &own) } else { own };
        f.add(&own, &i32c(cl.offset * 4))
    }

    /// The scratch slot of the column a reduce-scatter over 8 columns leaves this lane with
    /// (the 4 n tiles ending with `last_n`, `j` = 0, 1 in that order): lane `g = lane >> 2`
    /// holds n tile `last_n − 3 + g / 2`, `j = g % 2`, at column offset `8n + j` ([`Col::offset`]).
    fn scattered_column_slot(&self, f: &mut Func, th: &Thread, last_n: u32) -> I32 {
        let first_n = last_n + 1 - SCATTER_ITEMS as u32 / 2;
        let g = f.lshr(&th.lane, &i32c(2));
        let pair = f.lshr(&g, &i32c(1));
        let j = f.and(&g, &i32c(1));
        let off = f.shl(&pair, &i32c(3));
        let off = f.add(&off, &j);
        let off = f.add(&off, &i32c(8 * first_n));
        let off4 = f.shl(&off, &i32c(2));
        let t2 = f.shl(&th.t, &i32c(1));
        let own = self.scratch_slot(f, &th.warp, &t2);
        f.add(&own, &off4)
    }

    /// Byte offset of scratch entry (`warp`, `col`) within a scratch field.
    fn scratch_slot(&self, f: &mut Func, warp: &I32, col: &I32) -> I32 {
        let s = f.mul(warp, &i32c(self.c.batch_tile));
        let s = f.add(&s, col);
        f.shl(&s, &i32c(2))
    }

    /// The address of `slot4` of the scratch field at `field` of this thread's area.
    fn scratch_addr(&self, f: &mut Func, th: &Thread, field: u32, slot4: &I32) -> Ptr<crate::ir::Shared> {
        let off = f.add(slot4, &i32c(field));
        let off = f.add(&off, &th.scratch);
        f.saddr(&SMEM, &off)
    }

    /// Stores `v` at `slot4` of the scratch field at `field` of this thread's area.
    fn st_scratch<T: Value>(&self, f: &mut Func, th: &Thread, field: u32, slot4: &I32, v: &T) {
        let a = self.scratch_addr(f, th, field, slot4);
        f.store(v, &a, 4);
    }

    /// Loads the value at `slot4` of the scratch field at `field` of this thread's area.
    fn ld_scratch<T: Value>(&self, f: &mut Func, th: &Thread, field: u32, slot4: &I32) -> T {
        let a = self.scratch_addr(f, th, field, slot4);
        f.load(&a, 4)
    }

    /// Stores a column's logsumexp partial at its scratch `slot` (the sums' fields are 8-byte).
    fn st_partial(&self, f: &mut Func, th: &Thread, slot: &I32, part: &Partial<I64>) {
        let sc = self.c.smem_layout().scratch;
        self.st_scratch(f, th, sc.lse_window, slot, &part.window);
        let slot8 = f.shl(slot, &i32c(1));
        for (field, v) in sc.lse_sums.iter().zip(&part.sums) {
            self.st_scratch(f, th, *field, &slot8, v);
        }
    }

    /// Phase 4a (step 2's flag): each column's non-finite flag, ORed over the 8 lanes sharing
    /// t, at the column's slot of the scratch's `nonfinite` field, which the selection reads
    /// after [`Gen::reduce_lse`]'s barrier. Stored before the list epilogues, so the flags are
    /// not held through them (ptxas spilled them at 256 × 128 for a verifier).
    fn store_nonfinite(&self, f: &mut Func, th: &Thread, cols: &[Col], nonfinite: &[I1]) {
        let sc = self.c.smem_layout().scratch;
        // A column's lanes are the 8 with its `lane & 3` (the butterflies' xor 4, 8, 16): one
        // ballot ORs its flag over them, where three shuffles and ors did.
        let t = f.and(&th.lane, &i32c(3));
        let column_lanes = f.shl(&i32c(0x1111_1111), &t);
        let flags: Vec<I32> = nonfinite
            .iter()
            .map(|nf| {
                let votes = f.ballot(nf);
                let mine = f.and(&votes, &column_lanes);
                let any = f.icmp(Icmp::Ne, &mine, &i32c(0));
                f.zext::<I1, I32>(&any)
            })
            .collect();
        let lane_lt4 = f.icmp(Icmp::Ult, &th.lane, &i32c(4));
        f.if_then(&lane_lt4, |f| {
            for (cl, flag) in cols.iter().zip(&flags) {
                let slot = self.column_slot(f, th, cl);
                self.st_scratch(f, th, sc.nonfinite, &slot, flag);
            }
        });
    }

    /// Phase 4 (step 7): logsumexp partials of `x` per column (when `lse`, stored at the
    /// partials `dest`), reduced over the 8 lanes sharing t (xor 4, 8, 16), written per warp,
    /// combined over the warps; the barrier after the per-warp stores also orders
    /// [`Gen::store_nonfinite`]'s flags before the selection reads them.
    #[allow(clippy::too_many_arguments)]
    fn reduce_lse(&self, f: &mut Func, th: &Thread, it: &Item, cols: &[Col], src: &Logits<'_>, lse: bool, dest: &Ptr<Global>) -> Reducers {
        let c = self.c;
        let bt = c.batch_tile;
        let sc = c.smem_layout().scratch;
        let lane_lt4 = f.icmp(Icmp::Ult, &th.lane, &i32c(4));
        // Each column's partial (window and its three sums) goes to the scratch as soon as it
        // is known, so no column's partial stays live past its own merge.
        // Whole groups of 8 columns reduce their partials across the lanes together
        // ([`lse::scatter_partial`]), each lane storing one column's; otherwise each column's
        // partial is reduced on its own and stored by the first lanes.
        let scatter = lse && cols.len().is_multiple_of(SCATTER_ITEMS);
        let mut group: Vec<Vec<F32>> = Vec::new();
        for (ci, cl) in cols.iter().enumerate() {
            let mut part = None;
            if lse {
                let (n, j) = (ci as u32 / 2, ci as u32 % 2);
                let (column, _) = self.column(f, th, src, n, j);
                if scatter {
                    group.push(column);
                    if group.len() == SCATTER_ITEMS {
                        let p = lse::scatter_partial(f, &th.lane, &group);
                        group.clear();
                        // The group's 4 pairs end with this column's.
                        let slot = self.scattered_column_slot(f, th, n);
                        self.st_partial(f, th, &slot, &p);
                    }
                } else {
                    let xs: Vec<&F32> = column.iter().collect();
                    part = Some(lse::column_partial(f, &xs));
                }
            }
            if let Some(part) = &part {
                f.if_then(&lane_lt4, |f| {
                    let slot = self.column_slot(f, th, cl);
                    self.st_partial(f, th, &slot, part);
                });
            }
        }
        f.barrier();
        let tid_lt_bt = f.icmp(Icmp::Ult, &th.tid, &i32c(bt));
        if lse {
            // The column's sum over the warps (exact: the merge order does not matter).
            f.if_then(&tid_lt_bt, |f| {
                let parts: Vec<Partial<I64>> = (0..c.warps)
                    .map(|w| {
                        let slot = self.scratch_slot(f, &i32c(w), &th.tid);
                        let window = self.ld_scratch(f, th, sc.lse_window, &slot);
                        let slot8 = f.shl(&slot, &i32c(1));
                        let sums = sc.lse_sums.map(|field| self.ld_scratch(f, th, field, &slot8));
                        Partial { window, sums }
                    })
                    .collect();
                let acc = lse::merge_all(f, &parts);
                let row = f.add(&it.b0, &th.tid);
                let row_ok = f.icmp(Icmp::Ult, &row, &arg::BATCH);
                let lse_ok = f.non_null(dest);
                let ok = f.and(&row_ok, &lse_ok);
                f.if_then(&ok, |f| {
                    let i = f.mul(&row, &it.vtiles);
                    let i = f.add(&i, &it.vtile);
                    let i64v = f.zext(&i);
                    lse::store_partial(f, dest, &i64v, &acc);
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
    fn select(&self, f: &mut Func, th: &Thread, it: &Item, cols: &[Col], src: &Logits<'_>, quad_base: &[I32], r: &Reducers) {
        let c = self.c;
        let p = self.p;
        let samples = p.samples_per_row();
        let sc = c.smem_layout().scratch;
        let (lane_lt4, tid_lt_bt) = (&r.lane_lt4, &r.tid_lt_bt);
        // Whole groups of 4 pairs reduce their columns across the lanes together
        // ([`Gen::scatter_columns`]); otherwise each pair's columns are reduced on their own.
        let scatter = cols.len().is_multiple_of(SCATTER_ITEMS);
        let cross_tile = !p.is_greedy() && c.noise_skip == NoiseSkip::CrossTile;
        f.for_loop(&i32c(0), &i32c(samples), &i32c(1), |f, s| {
            // The row bounds' loads go one pair ahead of their use: each is a volatile load
            // from L2 whose result the pair's first noise test needs, and issued there its
            // latency stalled the warp at every pair.
            let pairs: Vec<&[Col]> = cols.chunks(2).collect();
            let mut next_keys: Vec<I32> = if cross_tile { pairs[0].iter().map(|cl| self.row_bound_key(f, cl, s)).collect() } else { Vec::new() };
            let mut group: Vec<CandidateVar> = Vec::new();
            // Columns come in pairs (j = 0, 1 of an n tile): one noise call serves both.
            for (n, &pair) in pairs.iter().enumerate() {
                let keys = std::mem::take(&mut next_keys);
                if cross_tile {
                    if let Some(next) = pairs.get(n + 1) {
                        next_keys = next.iter().map(|cl| self.row_bound_key(f, cl, s)).collect();
                    }
                }
                // An n tile past the batch (rows 8n.. of a partly filled batch tile) is skipped
                // whole: the test is uniform over the CTA, and the noise is most of the
                // epilogue's work. Its columns report NONE, which no live row reads.
                let outs: Vec<CandidateVar> = pair.iter().map(|_| CandidateVar::new(f, &Candidate::none())).collect();
                // Which lane of a column writes its warp result: the one holding the winner
                // (the lanes reduce score and index only); `none` from the first lane.
                let holds: Vec<Var<I1>> = pair.iter().map(|_| f.var(lane_lt4)).collect();
                let first_row = f.add(&it.b0, &i32c(n as u32 * 8));
                let live = f.icmp(Icmp::Ult, &first_row, &arg::BATCH);
                f.if_then(&live, |f| {
                    let mut acc_best: Vec<Candidate> = vec![Candidate::none(); pair.len()];
                    // A score each row's winner reaches (other tiles' candidates so far), or NaN.
                    let bounds: Vec<F32> = match c.noise_skip {
                        _ if p.is_greedy() => Vec::new(),
                        NoiseSkip::CrossTile => keys.iter().map(|k| f.key_value(k)).collect(),
                        NoiseSkip::InTile | NoiseSkip::Never => vec![F32::NAN; pair.len()],
                    };
                    let pair_noise = self.pair_noise(f, pair);
                    let (xs, carried): (Vec<Vec<F32>>, Vec<Vec<F32>>) = (0..pair.len() as u32).map(|j| self.column(f, th, src, n as u32, j)).unzip();
                    for q in 0..self.quads {
                        let noise: Vec<F32> = if p.is_greedy() {
                            Vec::new()
                        } else {
                            self.quad_noise(f, q, &pair_noise, &acc_best, &bounds, &quad_base[q as usize], s, &xs)
                        };
                        for pj in 0..pair.len() {
                            let best = &mut acc_best[pj];
                            for o in 0..4 {
                                let k = (q * 4 + o) as usize;
                                let xv = &xs[pj][k];
                                let score = if p.is_greedy() {
                                    xv.clone()
                                } else if c.noise_skip.tests_bounds() {
                                    // A greedy column's noise is -0: `x + -0 = x` bit for bit.
                                    f.fadd(xv, &noise[pj * 4 + o as usize])
                                } else {
                                    let noisy = f.fadd(xv, &noise[pj * 4 + o as usize]);
                                    f.sel(&pair_noise[pj].greedy, xv, &noisy)
                                };
                                let v = f.add(&quad_base[q as usize], &i32c(o));
                                let better = f.fcmp(Fcmp::Ogt, &score, &best.score);
                                best.score = f.sel(&better, &score, &best.score);
                                best.index = f.sel(&better, &v, &best.index);
                                best.logit = f.sel(&better, &carried[pj][k], &best.logit);
                            }
                        }
                    }
                    for ((best, out), hold) in acc_best.into_iter().zip(&outs).zip(&holds) {
                        if scatter {
                            // Reduced with the group's other columns below.
                            out.set(f, &best);
                        } else {
                            let (best, held) = best.shfl_best_held(f, &[4, 8, 16]);
                            out.set(f, &best);
                            f.set(hold, &held);
                        }
                    }
                });
                if scatter {
                    group.extend(outs);
                    if group.len() == SCATTER_ITEMS {
                        let lane_bests: Vec<Candidate> = group.drain(..).map(|v| v.get(f)).collect();
                        // The group's 4 pairs end with this one.
                        self.scatter_columns(f, th, lane_bests, n as u32);
                    }
                    continue;
                }
                // The pair's warp results go to the scratch at once, so no column's best
                // stays live while the next pairs are selected.
                for ((cl, out), hold) in pair.iter().zip(&outs).zip(&holds) {
                    let b = out.get(f);
                    let held = f.get(hold);
                    f.if_then(&held, |f| {
                        let slot = self.column_slot(f, th, cl);
                        self.st_scratch(f, th, sc.score, &slot, &b.score);
                        self.st_scratch(f, th, sc.index, &slot, &b.index);
                        self.st_scratch(f, th, sc.logit, &slot, &b.logit);
                    });
                }
            }
            f.barrier();
            f.if_then(tid_lt_bt, |f| {
                let mut best = Candidate::none();
                let mut flag = i32c(0);
                for w in 0..c.warps {
                    let slot = self.scratch_slot(f, &i32c(w), &th.tid);
                    let score = self.ld_scratch(f, th, sc.score, &slot);
                    let index = self.ld_scratch(f, th, sc.index, &slot);
                    let logit = self.ld_scratch(f, th, sc.logit, &slot);
                    let wf = self.ld_scratch(f, th, sc.nonfinite, &slot);
                    flag = f.or(&flag, &wf);
                    best = best.keep_best(f, &Candidate { score, index, logit });
                }
                let nf = f.icmp(Icmp::Ne, &flag, &i32c(0));
                let index = f.sel(&nf, &i32c(INDEX_NONFINITE as i32), &best.index);
                let row = f.add(&it.b0, &th.tid);
                let row_ok = f.icmp(Icmp::Ult, &row, &arg::BATCH);
                f.if_then(&row_ok, |f| {
                    let slot = f.mul(&row, &i32c(samples));
                    let slot = f.add(&slot, s);
                    let slot = f.mul(&slot, &it.vtiles);
                    let slot = f.add(&slot, &it.vtile);
                    let s64 = f.zext(&slot);
                    let a = f.gaddr(&arg::CANDIDATES, &s64, CANDIDATE_BYTES);
                    Candidate { index, ..best.clone() }.store(f, &a);
                    if !p.is_greedy() && c.noise_skip.uses_row_bounds() {
                        self.publish_row_bound(f, &row, s, &best.score);
                    }
                });
            });
            // The next sample rewrites the scratch just read.
            f.barrier();
        });
    }
}

impl Gen<'_> {
    /// The warp's best candidate of each of 8 columns (the 4 n tiles ending with `last_n`,
    /// `j` = 0, 1; `lane_bests` in that order, each lane's own best) to the scratch, by
    /// [`Func::reduce_scatter`] over the 8 lanes that share the columns (`lane & 3`): lane
    /// `g = lane >> 2` ends with column `g`'s best and writes it. 21 shuffles for 8 columns
    /// where a butterfly per column takes 48, and no column's chain waits for the next pair's.
    /// Any merge order gives the same candidate ([`Candidate::keep_best`] is a total order on
    /// (score, index)).
    fn scatter_columns(&self, f: &mut Func, th: &Thread, lane_bests: Vec<Candidate>, last_n: u32) {
        let sc = self.c.smem_layout().scratch;
        let best = f.reduce_scatter(
            &th.lane,
            lane_bests,
            Candidate::select,
            |f, b, mask| b.shfl_xor(f, mask),
            |f, keep, got| keep.keep_best(f, &got),
        );
        let slot = self.scattered_column_slot(f, th, last_n);
        self.st_scratch(f, th, sc.score, &slot, &best.score);
        self.st_scratch(f, th, sc.index, &slot, &best.index);
        self.st_scratch(f, th, sc.logit, &slot, &best.logit);
    }

    /// `row_bounds[row · S + s]`: the order key of the best score another tile of this launch
    /// has published for (row, sample), a score the row's winner reaches ([`Func::key_value`]
    /// decodes it); 0 (NaN decoded) when none has (the buffer starts at 0 each launch) or the
    /// kernel has no `row_bounds`.
    fn row_bound_key(&self, f: &mut Func, cl: &Col, s: &I32) -> I32 {
        let key = f.var(&i32c(0));
        let has = f.non_null(&arg::ROW_BOUNDS);
        f.if_then(&has, |f| {
            let a = self.row_bound_addr(f, &cl.row_safe, s);
            let k = crate::ptx::ld_relaxed_gpu(f, &a);
            f.set(&key, &k);
        });
        f.get(&key)
    }

    /// Publishes a tile's best score of (row, sample) with an atomic max on its order key, so
    /// later tiles of the row skip noise that cannot beat it. Any published value is the score
    /// of a token of this launch, so it never exceeds the winner's: the skips stay exact
    /// whatever order the tiles run in.
    fn publish_row_bound(&self, f: &mut Func, row: &I32, s: &I32, score: &F32) {
        let has = f.non_null(&arg::ROW_BOUNDS);
        f.if_then(&has, |f| {
            let a = self.row_bound_addr(f, row, s);
            let k = f.order_key(score);
            f.atomic_update(Atomic::Umax, &a, &k, Some(4));
        });
    }

    fn row_bound_addr(&self, f: &mut Func, row: &I32, s: &I32) -> Ptr<Global> {
        let slot = f.mul(row, &i32c(self.p.samples_per_row()));
        let slot = f.add(&slot, s);
        let s64 = f.zext(&slot);
        f.gaddr(&arg::ROW_BOUNDS, &s64, 4)
    }

    /// Quad `q`'s Gumbel noise for the column pair `pair` of n tile `n`: every token's with
    /// [`NoiseSkip::Never`]; otherwise (`-inf` where skipped) with both noise skips of
    /// DESIGN.md: a column whose best transformed logit of the quad
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
        pair: &[ColNoise],
        acc_best: &[Candidate],
        bounds: &[F32],
        quad_base: &I32,
        s: &I32,
        xs: &[Vec<F32>],
    ) -> Vec<F32> {
        // Global index g = v + vocab_offset (a multiple of 4: same quads).
        let g = f.add(quad_base, &arg::VOCAB_OFFSET);
        let ctr = f.lshr(&g, &i32c(2));
        let (a, b) = (&pair[0], &pair[pair.len() - 1]);
        let (ia, ib) = (0, pair.len() - 1);
        let rows: Vec<&dyn Operand> = vec![&ctr, s, &a.stream.ctr_row, &a.stream.key.lo, &a.stream.key.hi, &a.word3, &b.stream.ctr_row, &b.stream.key.lo, &b.stream.key.hi, &b.word3];
        if !self.c.noise_skip.tests_bounds() {
            let r = f.call_agg(math::NOISE_PAIR_TY, "@fs_noise_pair_all", &rows);
            return (0..pair.len() * 4).map(|w| f.extract(&r, w)).collect();
        }
        let up = f32c(gumbel_f32_upper_bound());
        let mut xmax = Vec::new();
        let mut thr = Vec::new();
        let mut need = I1::FALSE;
        for (pj, cl) in pair.iter().enumerate() {
            let k = (q * 4) as usize;
            let mut m = xs[pj][k].clone();
            for o in 1..4 {
                m = f.maxnum(&m, &xs[pj][k + o]);
            }
            // A greedy column reads no noise: its quad maximum counts as -inf against a
            // threshold of +inf, so both skips hold whatever its logits (+inf and NaN too),
            // and its tokens get their miss value, -0.
            let m = f.sel(&cl.greedy, &F32::NEG_INF, &m);
            let bs = &acc_best[pj].score;
            let bound_higher = f.fcmp(Fcmp::Ogt, &bounds[pj], bs);
            let t = f.sel(&bound_higher, &bounds[pj], bs);
            let t = f.sel(&cl.greedy, &F32::POS_INF, &t);
            let reach = f.fadd(&m, &up);
            let beaten = f.fcmp(Fcmp::Olt, &reach, &t);
            let needed = f.not(&beaten);
            need = f.or(&need, &needed);
            xmax.push(m);
            thr.push(t);
        }
        let noise: Vec<Var<F32>> = (0..pair.len() * 4).map(|w| f.var(&pair[w / 4].miss)).collect();
        f.if_then(&need, |f| {
            let mut args = rows.clone();
            args.extend([&xmax[ia] as &dyn Operand, &thr[ia], &pair[ia].miss, &xmax[ib], &thr[ib], &pair[ib].miss]);
            let r = f.call_agg(math::NOISE_PAIR_TY, "@fs_noise_pair", &args);
            for (w, slot) in noise.iter().enumerate() {
                let v = f.extract(&r, w);
                f.set(slot, &v);
            }
        });
        noise.iter().map(|v| f.get(v)).collect()
    }
}

/// DESIGN.md step 10's raw logit of a token: the matmul value `raw` with only the model's
/// transforms (`Transform::is_model`) in pipeline order, in the same f32 ops as
/// [`Gen::transform`]; `-inf` past the vocabulary (`v_ok` false). `bias` is the token's global
/// bias (loaded when the pipeline has one).
pub(crate) fn model_logit(f: &mut Func, transforms: &[Transform], raw: &F32, bias: Option<&F32>, v_ok: &I1) -> F32 {
    let mut xv = raw.clone();
    for tr in transforms.iter().filter(|t| t.is_model()) {
        match tr {
            Transform::Bias { .. } => {
                if let Some(bias) = bias {
                    xv = f.fadd(&xv, bias);
                }
            }
            Transform::Softcap { cap } => xv = math::softcap(f, &xv, cap.get()),
            _ => {}
        }
    }
    f.sel(v_ok, &xv, &F32::NEG_INF)
}

/// The CSR range `[offsets[row], offsets[row + 1])` of a per-row token table (`r64`: the row, as i64).
fn csr_range(f: &mut Func, offsets: &Ptr<Global>, r64: &I64) -> TokenRange {
    let a = f.gaddr(offsets, r64, 4);
    let lo = f.load(&a, 4);
    let a1 = f.offset(&a, 4);
    let hi = f.load(&a1, 4);
    TokenRange { lo, hi }
}

/// `x` after a per-row token table's out-of-line `call` (which yields the new float from
/// `x`), taken only when the token's bit is set in the quad's bitset word `word` (and the
/// token exists).
fn listed_call(f: &mut Func, word: &I32, t: &TokenBits<'_>, x: &F32, call: impl FnOnce(&mut Func, &F32) -> F32) -> F32 {
    let sh = f.lshr(word, t.bit);
    let b: I1 = f.trunc(&sh);
    let b = f.and(&b, t.v_ok);
    let out = f.var(x);
    f.if_then(&b, |f| {
        let r = call(f, x);
        f.set(&out, &r);
    });
    f.get(&out)
}

/// The parameters of the out-of-line per-row token-table helpers.
const X: F32 = F32::named("%x");
const V: I32 = I32::named("%v");
const LO: I32 = I32::named("%lo");
const HI: I32 = I32::named("%hi");
const TOKENS: Ptr<Global> = Ptr::named("%tokens");

/// `abi::RowTokens::find` inside a helper whose parameters include `%v`, `%lo`, `%hi` and
/// `%tokens`: binary search of `v` in the row's sorted `tokens[lo..hi]`. Returns whether it
/// was found and its entry index (an index inside the row's range either way, so loads at it
/// are safe).
fn find_token(f: &mut Func) -> (I1, I64) {
    let lo = f.var(&LO);
    let hi = f.var(&HI);
    f.while_loop(
        |f| {
            let (l, h) = (f.get(&lo), f.get(&hi));
            f.icmp(Icmp::Ult, &l, &h)
        },
        |f| {
            let (l, h) = (f.get(&lo), f.get(&hi));
            let sum = f.add(&l, &h);
            let mid = f.lshr(&sum, &i32c(1));
            let m64 = f.zext(&mid);
            let a = f.gaddr(&TOKENS, &m64, 4);
            let t: I32 = f.load(&a, 4);
            let less = f.icmp(Icmp::Ult, &t, &V);
            let up = f.add(&mid, &i32c(1));
            let nl = f.sel(&less, &up, &l);
            let nh = f.sel(&less, &h, &mid);
            f.set(&lo, &nl);
            f.set(&hi, &nh);
        },
    );
    let at = f.get(&lo);
    let inside = f.icmp(Icmp::Ult, &at, &HI);
    // Never read past the row's entries (the bitset says `v` is listed, but stay safe).
    let safe = f.sel(&inside, &at, &LO);
    let s64 = f.zext(&safe);
    let a = f.gaddr(&TOKENS, &s64, 4);
    let t: I32 = f.load(&a, 4);
    let hit = f.icmp(Icmp::Eq, &t, &V);
    (f.and(&inside, &hit), s64)
}

/// DESIGN.md step 3, penalties, for a token whose bit is set: [`find_token`], then
/// `abi::penalize_f32` with that entry's subtraction. Out of line (rarely taken, and it holds
/// a loop), so the unrolled epilogue stays small.
pub(super) fn penalize_token() -> String {
    let mut f = Func::new();
    let (found, entry) = find_token(&mut f);
    let a = f.gaddr(&Ptr::named("%subtract"), &entry, 4);
    let sub = f.load(&a, 4);
    let pos = f.fcmp(Fcmp::Ogt, &X, &F32::ZERO);
    let rep = F32::named("%rep");
    let q = f.fdiv(&X, &rep);
    let m = f.fmul(&X, &rep);
    let y = f.sel(&pos, &q, &m);
    let y = f.fsub(&y, &sub);
    let r = f.sel(&found, &y, &X);
    f.ret(&r);
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
    let a = f.gaddr(&Ptr::named("%values"), &entry, 4);
    let bias = f.load(&a, 4);
    let y = f.fadd(&X, &bias);
    let r = f.sel(&found, &y, &X);
    f.ret(&r);
    f.finish(
        "define internal float @fs_logit_bias_token(float %x, i32 %v, i32 %lo, i32 %hi, \
         ptr addrspace(1) %tokens, ptr addrspace(1) %values) #2",
    )
}
