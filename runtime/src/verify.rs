//! Speculative verification (DESIGN.md "Speculative verification"): one stage-one pass over
//! the `S·(k+1)` target rows on the CPU or the GPU (draft rows draw the residual stream and
//! keep residual lists), then per sequence the acceptance decisions and the next token on the
//! host ([`decide`], shared by both backends). A draft
//! row is recomputed over its whole vocabulary only when its residual bound fails or its
//! nucleus outgrew the lists; the `[S·(k+1), V]` logits are never written.

use crate::cpu::{host_f32, CpuBackend, Pass, ResidualPlan};
use crate::{launch::Shape, stage_three, Error, Result, Tensor};
use flashsample_abi::filter::{merge_row, row_need, survivors, whole_row, Scored};
use flashsample_abi::rng::{gumbel_f64, uniform_f64, NoiseStream};
use flashsample_abi::math::{exp_f64, ln_f64};
use flashsample_abi::speculative::{accept_bits, draft_of_row, drafts_per_sequence, residual_bits, residual_upper_bound, RESIDUAL_PER_TILE};
use flashsample_abi::filter::TopLists;
use flashsample_abi::{Candidate, RowResult, RowStatus, RowStatusError, SamplingParams, INDEX_NONE};
use flashsample_codegen_cpu::CpuConfig;
use flashsample_ir::Pipeline;

/// The outcome of verifying `S` sequences of `k` drafts (`Sampler::verify`).
///
/// A sequence whose target rows the kernels could not sample (every token masked, a
/// non-finite logit) gets its error in [`Verified::errors`], emits nothing, and does not fail
/// the others.
#[derive(Clone, Debug, PartialEq)]
pub struct Verified {
    /// Drafts per sequence.
    pub k: usize,
    /// `[S]` drafts accepted, `0..=k`.
    pub accepted: Vec<usize>,
    /// `[S, k + 1]` the emitted tokens of each sequence: its accepted drafts, then the next
    /// token (the residual draw at the first rejection, or the bonus token); `INDEX_NONE`
    /// after them and for a failed sequence.
    pub tokens: Vec<u32>,
    /// `[S, k + 1]` each emitted token's log-probability under its target row's transformed,
    /// unfiltered distribution (`x − logsumexp`, like `Samples::logprobs`), NaN where no token
    /// was emitted; iff the pipeline declares `outputs(logprob)`.
    pub logprobs: Option<Vec<f32>>,
    /// Per sequence: `None` when it was verified, else its first failed row's error.
    pub errors: Vec<Option<RowStatusError>>,
    /// Draft rows recomputed over their whole vocabulary (a residual bound that did not hold,
    /// or a nucleus past the lists): the fused plan's worst case, counted for benches and tests.
    pub recomputed_rows: usize,
}

impl Verified {
    /// Sequences verified.
    pub fn sequences(&self) -> usize {
        self.accepted.len()
    }

    /// The tokens sequence `i` emits (its accepted drafts, then the next token); empty for a
    /// failed sequence.
    pub fn emitted(&self, i: usize) -> &[u32] {
        let n = if self.errors[i].is_some() { 0 } else { self.accepted[i] + 1 };
        &self.tokens[i * (self.k + 1)..][..n]
    }

    /// The token after sequence `i`'s accepted drafts (`INDEX_NONE` for a failed sequence).
    pub fn next(&self, i: usize) -> u32 {
        self.tokens[i * (self.k + 1) + self.accepted[i]]
    }
}

/// How stage one left a draft row's target distribution `p_j`.
enum Target {
    /// A greedy row: a point mass on its argmax.
    Greedy(u32),
    /// A filtered row: `p_j` lives on these tokens, `exp(x − mass)`.
    Kept(Vec<Scored>, f64),
    /// An unfiltered sampled row: `p_j(v) = exp(x_v − L)` over the whole vocabulary.
    Full,
}

/// A filtered row's log-mass over its survivors `kept` (sorted, best first):
/// `top + ln_f64(Σ exp_f64(x − top))`, summed in list order from 0, as the device's decision
/// sums them (`codegen-ptx` `decide::kept_target`), so both see the same `p_j` bit for bit.
fn kept_mass(kept: &[Scored]) -> f64 {
    let top = kept.first().map_or(0.0, |s| f64::from(s.logit));
    top + ln_f64(kept.iter().fold(0.0, |sum, s| sum + exp_f64(f64::from(s.logit) - top)))
}

/// The drafts of one launch and their distributions: `q_j(v)` of draft `i·k + j`.
pub(crate) struct DraftProbs<'a> {
    /// `[S·k]` the draft tokens.
    pub drafts: &'a [u32],
    /// `[S·k, V]` sampled drafts' distributions; `None` for greedy drafts (`δ(d_j)`).
    pub probs: Option<&'a [f32]>,
    pub vocab: usize,
}

impl<'a> DraftProbs<'a> {
    /// A launch's drafts (`params.drafts`, `params.draft_probs`) over `vocab` tokens.
    pub(crate) fn of(params: &SamplingParams<'a>, vocab: usize) -> Self {
        DraftProbs { drafts: params.drafts.unwrap_or(&[]), probs: params.draft_probs, vocab }
    }

    fn q(&self, draft: usize, v: u32) -> f64 {
        match self.probs {
            Some(q) => f64::from(q[draft * self.vocab + v as usize]),
            None => f64::from(u8::from(v == self.drafts[draft])),
        }
    }
}

/// One token the residual draw considers: its target probability `p`, its transformed logit,
/// and an upper bound on its residual score `ln(w) + G_res` (`+∞` where none is known).
#[derive(Clone, Copy)]
struct ResidualEntry {
    token: u32,
    p: f64,
    logit: f32,
    upper: f64,
}

impl ResidualEntry {
    /// An entry without a score bound (the filter's survivors, a recomputed row).
    fn unbounded(token: u32, p: f64, logit: f32) -> Self {
        ResidualEntry { token, p, logit, upper: f64::INFINITY }
    }
}

/// The residual draw `argmax ln(w_v) + G_res(v)` over `entries` with `w = max(0, p − q)`, or
/// `w = p` when no token has `p > q` (ties to the lower token): the winner's token, logit and
/// score, and whether it fell back to `p`. Entries are scored in decreasing `upper` and the
/// walk stops at the first whose bound is below the best exact score, so only the handful of
/// tokens that can still win pay for their Philox draw; the winner is the full argmax's
/// (an entry with `upper ≥ best` is always scored, ties included).
fn residual_draw(entries: &[ResidualEntry], q: impl Fn(u32) -> f64, noise: impl Fn(u32) -> f64) -> (Option<(u32, f32, f64)>, bool) {
    let residual = |e: &ResidualEntry| (e.p - q(e.token)).max(0.0);
    let use_p = !entries.iter().any(|e| residual(e) > 0.0);
    let mut order: Vec<&ResidualEntry> = entries.iter().collect();
    order.sort_by(|a, b| b.upper.total_cmp(&a.upper));
    let mut best: Option<(u32, f32, f64)> = None;
    for e in order {
        if best.is_some_and(|(_, _, bs)| e.upper < bs) {
            break;
        }
        let w = if use_p { e.p } else { residual(e) };
        if w > 0.0 {
            let s = ln_f64(w) + noise(e.token);
            if best.is_none_or(|(bv, _, bs)| s > bs || (s == bs && e.token < bv)) {
                best = Some((e.token, e.logit, s));
            }
        }
    }
    (best, use_p)
}

/// A verifying launch's target tokens (each draft row's draft; bonus rows 0, unread) and its
/// drafts per sequence `k`.
pub(crate) fn draft_targets(params: &SamplingParams<'_>, batch: usize) -> Result<(usize, Vec<u32>)> {
    let drafts = params.drafts.unwrap_or(&[]);
    let k = drafts_per_sequence(batch, drafts.len()).map_err(flashsample_abi::ParamError::from)?;
    let targets = (0..batch).map(|r| draft_of_row(r, k).map_or(0, |d| drafts[d])).collect();
    Ok((k, targets))
}

/// What the kernels of a verifying launch left, on any backend: each row's status and result
/// (a greedy draft row's token is its argmax; a bonus row's its sample, nuclei past the lists
/// already served), the filter's lists, each draft row's transformed logit at its draft token
/// and the residual lists.
pub(crate) struct VerifyRun<'a> {
    pub status: &'a [RowStatus],
    pub reduced: &'a RowResult,
    pub lists: Option<(TopLists, &'a [Scored])>,
    pub target_logits: &'a [f32],
    pub residual: (TopLists, &'a [Candidate]),
}

/// The error of sequence rows `rows`' first row that fails the sequence: a row all masked or
/// non-finite, or the bonus row with any status but ok (the device decision's
/// `SpecStatus::RowFailed` tests the same rows in the same order).
pub(crate) fn sequence_failure(status: &[RowStatus], rows: std::ops::Range<usize>, k: usize, capacity: usize) -> Option<RowStatusError> {
    rows.clone().find_map(|r| match status[r] {
        RowStatus::AllMasked | RowStatus::NonFinite => status[r].error(r, capacity),
        _ if draft_of_row(r, k).is_none() => status[r].error(r, capacity),
        _ => None,
    })
}

/// Decides every sequence of a verifying launch (DESIGN.md "Speculative verification"), in
/// order, on the host: acceptance from the exact logsumexp and the draft logit, the residual
/// draw from the residual lists when the bound holds; `whole_row` gives every eligible token
/// of a row with its logit (stage one of that row alone with whole-tile lists), for the rows
/// the lists cannot serve. `inner`: the launch's parameters with the drafts as targets.
pub(crate) fn decide(
    pipeline: &Pipeline,
    inner: &SamplingParams<'_>,
    q: &DraftProbs<'_>,
    k: usize,
    run: &VerifyRun<'_>,
    whole_row: &mut dyn FnMut(usize) -> Result<Vec<Scored>>,
) -> Result<Verified> {
    let batch = run.status.len();
    let seqs = batch / (k + 1);
    let capacity = pipeline.list_capacity() as usize;
    let status = run.status;
    let reduced = run.reduced;
    let lse = reduced.logsumexp.clone().unwrap_or_else(|| vec![f32::NAN; batch]);
    let target_logits = run.target_logits;
    let (res_layout, res_lists) = run.residual;
    let drafts = q.drafts;
    let mut recomputed_rows = 0;
    let mut whole_row_of = |row: usize| -> Result<Vec<Scored>> {
        recomputed_rows += 1;
        whole_row(row)
    };
    let mut out = Verified {
        k,
        accepted: vec![0; seqs],
        tokens: vec![INDEX_NONE; seqs * (k + 1)],
        logprobs: pipeline.outputs.logprob.then(|| vec![f32::NAN; seqs * (k + 1)]),
        errors: vec![None; seqs],
        recomputed_rows: 0,
    };
    for i in 0..seqs {
        let rows = i * (k + 1)..(i + 1) * (k + 1);
        let failed = sequence_failure(status, rows.clone(), k, capacity);
        if let Some(e) = failed {
            out.errors[i] = Some(e);
            continue;
        }
        let mut emitted: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
        let mut rejected = false;
        for j in 0..k {
            let r = rows.start + j;
            let draft = i * k + j;
            let d = drafts[draft];
            let l = f64::from(lse[r]);
            let greedy = pipeline.is_greedy() || inner.row_temperature(pipeline, r) == 0.0;
            let filter = inner.row_filter(r);
            let target = if greedy {
                Target::Greedy(reduced.tokens[r])
            } else if pipeline.filter_max_k().is_some() && !filter.is_off() {
                let (layout, lists) = run.lists.ok_or_else(|| Error::Unsupported("a filter pipeline's launch keeps lists".into()))?;
                let need = row_need(&filter, true, 0, layout.per_tile.max(capacity));
                let listed = merge_row(layout.row(lists, r), layout.per_tile, need, r)
                    .ok()
                    .and_then(|top| survivors(&top, &filter, lse[r], top.len() < need, r).ok().map(|n| top[..n].to_vec()));
                let kept = match listed {
                    Some(kept) => kept,
                    None => {
                        let top = whole_row_of(r)?;
                        let n = survivors(&top, &filter, lse[r], true, r)?;
                        top[..n].to_vec()
                    }
                };
                let mass = kept_mass(&kept);
                Target::Kept(kept, mass)
            } else {
                Target::Full
            };
            let p_draft = match &target {
                Target::Greedy(a) => f64::from(u8::from(*a == d)),
                Target::Kept(kept, mass) => kept.iter().find(|s| s.index == d).map_or(0.0, |s| exp_f64(f64::from(s.logit) - mass)),
                Target::Full => exp_f64(f64::from(target_logits[r]) - l),
            };
            let (seed, ctr) = inner.row_stream(r);
            let step = inner.row_step(r);
            if uniform_f64(accept_bits(seed, ctr, step)) < p_draft / q.q(draft, d) {
                emitted.push((d, target_logits[r]));
                continue;
            }
            // Keyed by the global token, as the kernels' residual lists are.
            let noise = |v: u32| gumbel_f64(residual_bits(seed, ctr, v + inner.vocab_offset, step));
            let next = match target {
                Target::Greedy(a) => (a, reduced.logits[r]),
                Target::Kept(kept, mass) => {
                    let entries: Vec<ResidualEntry> =
                        kept.iter().map(|s| ResidualEntry::unbounded(s.index, exp_f64(f64::from(s.logit) - mass), s.logit)).collect();
                    residual_draw(&entries, |v| q.q(draft, v), noise).0.map_or((INDEX_NONE, f32::NAN), |(v, x, _)| (v, x))
                }
                Target::Full => {
                    // The listed tokens' exact residual scores; every unlisted token of
                    // tile t scores at most its `x + G − L ≤ (last listed score of t) − L`,
                    // and a listed one at most its own stored `x + G − L` (`ln w ≤ x − L`).
                    let mut entries = Vec::new();
                    let mut bound = f64::NEG_INFINITY;
                    for t in 0..res_layout.tiles {
                        let list = &res_lists[res_layout.slot(r, t)..][..res_layout.per_tile];
                        entries.extend(list.iter().filter(|c| c.index != INDEX_NONE).map(|c| ResidualEntry {
                            token: c.index,
                            p: exp_f64(f64::from(c.logit) - l),
                            logit: c.logit,
                            upper: residual_upper_bound(c.score, l),
                        }));
                        if let Some(last) = list.last().filter(|c| c.index != INDEX_NONE) {
                            bound = bound.max(residual_upper_bound(last.score, l));
                        }
                    }
                    // Exact when some listed token has residual mass and the best listed
                    // score beats every unlisted token's bound.
                    let listed = match residual_draw(&entries, |v| q.q(draft, v), noise) {
                        (Some(w), false) if w.2 > bound => Some(w),
                        _ => None,
                    };
                    match listed {
                        Some((v, x, _)) => (v, x),
                        None => {
                            let all: Vec<ResidualEntry> = whole_row_of(r)?
                                .iter()
                                .map(|s| ResidualEntry::unbounded(s.index, exp_f64(f64::from(s.logit) - l), s.logit))
                                .collect();
                            residual_draw(&all, |v| q.q(draft, v), noise).0.map_or((INDEX_NONE, f32::NAN), |(v, x, _)| (v, x))
                        }
                    }
                }
            };
            emitted.push(next);
            rejected = true;
            break;
        }
        if !rejected {
            // Every draft accepted: the bonus is row k's ordinary sample.
            let r = rows.end - 1;
            emitted.push((reduced.tokens[r], reduced.logits[r]));
        }
        out.accepted[i] = emitted.len() - 1;
        for (n, &(v, x)) in emitted.iter().enumerate() {
            let r = rows.start + n;
            out.tokens[r] = v;
            if let Some(lp) = out.logprobs.as_mut() {
                lp[r] = x - lse[r];
            }
        }
    }
    out.recomputed_rows = recomputed_rows;
    Ok(out)
}

impl CpuBackend {
    /// Verifies `params.drafts` against the rows of `hidden` (`Sampler::verify` checked the
    /// operands and parameters).
    pub(crate) fn verify(
        &self,
        hidden: &Tensor<'_>,
        weights: &Tensor<'_>,
        params: &SamplingParams<'_>,
        shape: Shape,
        config: &CpuConfig,
    ) -> Result<Verified> {
        let pipeline: &Pipeline = &self.pipeline;
        let (k, targets) = draft_targets(params, shape.batch)?;
        let streams: Vec<NoiseStream> =
            (0..shape.batch).map(|r| if draft_of_row(r, k).is_some() { NoiseStream::SpecResidual } else { NoiseStream::Token }).collect();
        let inner = SamplingParams { targets: Some(&targets), drafts: None, draft_probs: None, ..*params };
        let hidden_f32 = host_f32(hidden)?;
        let allowed = inner.allowed_bitset(shape.batch, shape.vocab);
        let capacity = pipeline.list_capacity() as usize;
        let plan = ResidualPlan { streams: &streams, per_tile: RESIDUAL_PER_TILE };
        let one = self.stage_one_with_lists(&hidden_f32, weights, &inner, allowed.as_deref(), shape, config, capacity, Pass::Verify(plan))?;
        let (mut reduced, mut status) = one.layout.reduce_rows(&one.candidates, one.lse.as_deref());
        if let Some((layout, lists)) = &one.lists {
            stage_three::finish(pipeline, &inner, *layout, lists, None, &mut reduced, &mut status);
        }
        // Bonus rows are ordinary samples: a nucleus past the lists is served as `sample` does.
        let bonus_nuclei: Vec<usize> = stage_three::nucleus_rows(&status).into_iter().filter(|&r| draft_of_row(r, k).is_none()).collect();
        if !bonus_nuclei.is_empty() {
            self.serve_exact(&hidden_f32, weights, &inner, shape, &bonus_nuclei, None, &mut reduced, &mut status)?;
        }
        let (res_layout, res_lists) = one.residual_lists.as_ref().ok_or_else(|| Error::Unsupported("a verifying launch keeps residual lists".into()))?;
        let run = VerifyRun {
            status: &status,
            reduced: &reduced,
            lists: one.lists.as_ref().map(|(l, lists)| (*l, lists.as_slice())),
            target_logits: one.target_logits.as_deref().unwrap_or(&[]),
            residual: (*res_layout, res_lists),
        };
        // Every eligible token of `row` with its logit: stage one again for that row alone,
        // its residual lists holding whole tiles.
        let mut whole_row_of = |row: usize| -> Result<Vec<Scored>> {
            let subset = inner.select_rows(&[row], shape.vocab);
            let sub = subset.params();
            let sub_shape = Shape { batch: 1, ..shape };
            let config = self.whole_tile_config(sub_shape);
            let token = [NoiseStream::Token];
            let plan = ResidualPlan { streams: &token, per_tile: config.vocab_tile as usize };
            let sub_allowed = sub.allowed_bitset(1, shape.vocab);
            let h = &hidden_f32[row * shape.dim..][..shape.dim];
            let one = self.stage_one_with_lists(h, weights, &sub, sub_allowed.as_deref(), sub_shape, &config, capacity, Pass::Verify(plan))?;
            let (_, lists) = one.residual_lists.ok_or_else(|| Error::Unsupported("a verifying launch keeps residual lists".into()))?;
            Ok(whole_row_entries(&lists))
        };
        decide(pipeline, &inner, &DraftProbs::of(params, shape.vocab), k, &run, &mut whole_row_of)
    }
}

/// A whole-tile residual list's eligible tokens with their logits, as `whole_row` sorts them.
pub(crate) fn whole_row_entries(lists: &[Candidate]) -> Vec<Scored> {
    let entries: Vec<Scored> = lists.iter().filter(|c| c.index != INDEX_NONE).map(|c| Scored { logit: c.logit, index: c.index }).collect();
    whole_row(&entries)
}
