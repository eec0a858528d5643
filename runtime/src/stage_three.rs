//! Stage three on the host: top-k / min-p / top-p and top-n logprobs from stage one's per-tile
//! lists (`abi::filter`), after stage two's unfiltered reduction. The CPU backend runs it; the
//! CUDA backend runs the same steps in its `flashsample_filter` kernel. Rows whose nucleus
//! outgrew the lists are then served exactly from the launch's capture of their logits (CPU)
//! or from whole-tile lists of those rows alone ([`finish_exact`], both backends' host API).
//! Both host APIs start a launch on short lists and rerun the rows whose lists overflowed
//! ([`overflowed_rows`]) with lists that cannot ([`ShortListGate`] says when to skip the short
//! ones).

use flashsample_abi::filter::{better_draw, draw, merge_row, row_need, survivors, whole_row_with, KeptByToken};
use flashsample_abi::raw::raw_logit_of;
use flashsample_abi::{RowResult, RowStatus, SamplingParams, Scored, TopLists};
use flashsample_ir::Pipeline;
use rayon::prelude::*;
use std::borrow::Cow;
use std::ops::Range;
use std::sync::Mutex;

/// Launches that run longer lists once lists overflowed in two launches in a row: a workload
/// whose rows' top tokens crowd a tile (a BPE vocabulary gives its most frequent tokens the
/// lowest ids; a request whose mask leaves a run of digits) then pays two reruns per this
/// many launches and two more, not one on most of them.
pub(crate) const SHORT_LIST_HOLDOFF: u32 = 64;

/// The tile lists a host-API launch runs, shortest first: the backend's short lists (the
/// CPU's `LIST_PER_TILE`, the GPU config's `list_per_tile`), twice that, or lists that cannot
/// overflow (the capacity, or a whole tile).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ListLength {
    Short,
    Doubled,
    Exact,
}

impl ListLength {
    /// Entries a tile: `short`, `2·short` or `exact`, never more than `exact`.
    pub(crate) fn per_tile(self, short: usize, exact: usize) -> usize {
        match self {
            ListLength::Short => short.min(exact),
            ListLength::Doubled => (2 * short).min(exact),
            ListLength::Exact => exact,
        }
    }

    /// The next longer length.
    fn longer(self) -> ListLength {
        match self {
            ListLength::Short => ListLength::Doubled,
            ListLength::Doubled | ListLength::Exact => ListLength::Exact,
        }
    }
}

/// Which lists a host-API launch starts on. An isolated overflow reruns only its rows
/// ([`overflowed_rows`]) and changes nothing else: rows whose top tokens scatter overflow
/// short lists at random and rarely (≈ 10⁻⁶ a top-k 50 row on the GPU's lists of one entry
/// per 32 tokens, so two launches in a row almost never). An overflow in the launch right
/// after one says they recur (rows whose top tokens crowd a tile, launch after launch), and
/// the next [`SHORT_LIST_HOLDOFF`] launches run the next longer [`ListLength`]: twice the
/// short lists first, which a crowded row overflows far less often (a Poisson count of a row's
/// top tokens in a tile exceeds 2n much more rarely than n), then exact ones if overflows
/// recur on those too. The sampler thus pays the doubled lists' cost where its rows crowd
/// tiles, not the exact lists' (the capacity's entries, 50 for a top-k 50). Only speed
/// depends on it: every launch's samples are exact.
#[derive(Debug, Default)]
pub(crate) struct ShortListGate(Mutex<GateState>);

#[derive(Debug, Default)]
struct GateState {
    /// The running holdoff's lists and the launches it has left (at least 1).
    holdoff: Option<(ListLength, u32)>,
    /// Whether the launch before this one overflowed, and whether this one did.
    previous_overflowed: bool,
    overflowed: bool,
}

impl ShortListGate {
    /// Starts a launch: the lists it runs (counts down the holdoff).
    pub(crate) fn take(&self) -> ListLength {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        g.previous_overflowed = std::mem::take(&mut g.overflowed);
        let (lists, rest) = match g.holdoff {
            Some((lists, left)) => (lists, (left > 1).then_some((lists, left - 1))),
            None => (ListLength::Short, None),
        };
        g.holdoff = rest;
        lists
    }

    /// The launch's `lists` overflowed: if the previous launch's lists did too, the next
    /// [`SHORT_LIST_HOLDOFF`] launches run longer ones.
    pub(crate) fn overflowed(&self, lists: ListLength) {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        g.overflowed = true;
        if g.previous_overflowed {
            g.holdoff = Some((lists.longer(), SHORT_LIST_HOLDOFF));
        }
    }
}

/// The rows a launch whose short lists overflowed runs again on lists that cannot: the
/// consecutive rows from its first overflowed row to its last, `None` where none overflowed.
/// A range of a launch keeps its rows' noise streams ([`flashsample_abi::RowSubset`]), so
/// its samples are those the whole launch would draw on exact lists; one launch over the
/// range reads the weights once, where a launch per overflowed row would read them per row.
pub(crate) fn overflowed_rows(status: &[RowStatus]) -> Option<Range<usize>> {
    let overflowed = |s: &RowStatus| *s == RowStatus::ListOverflow;
    let first = status.iter().position(overflowed)?;
    let last = status.iter().rposition(overflowed)?;
    Some(first..last + 1)
}

/// Per row, (token, logprob) of its most likely tokens.
pub(crate) type TopLogprobs = Vec<Vec<(u32, f32)>>;

/// The raw logit beside each entry of stage one's processed lists (`abi::raw`, the lists'
/// layout), when the pipeline reports the drawn token's raw logprob (`Pipeline::lists_carry_raw`).
#[derive(Clone, Copy)]
pub(crate) struct ListRaws<'a>(pub &'a [f32]);

impl ListRaws<'_> {
    /// What a drawn entry of `row` carries as its logit: its raw logit from the companion.
    fn carried(&self, layout: TopLists, lists: &[Scored], row: usize, w: &Scored) -> f32 {
        let at = layout.slot(row, 0);
        let n = layout.tiles * layout.per_tile;
        // A drawn token came from these lists; NaN would only mark a broken companion.
        raw_logit_of(&lists[at..][..n], &self.0[at..][..n], w.index).unwrap_or(f32::NAN)
    }
}

/// Rewrites the filtered rows of `reduced` and returns the processed top logprobs if the
/// pipeline asks. Rows whose `status` is not ok are left alone (empty top logprobs); a row whose
/// lists cannot give its exact filtered sample gets the list status instead of a sample. With
/// `raws` a drawn token carries its raw logit (the raw logprob mode), else its transformed one.
#[allow(clippy::too_many_arguments)]
pub(crate) fn finish(
    pipeline: &Pipeline,
    params: &SamplingParams<'_>,
    layout: TopLists,
    lists: &[Scored],
    raws: Option<ListRaws<'_>>,
    reduced: &mut RowResult,
    status: &mut [RowStatus],
) -> Option<TopLogprobs> {
    // Lists at least as long as the capacity are merged to their own length: a longer list is
    // exact for a larger nucleus.
    let capacity = layout.per_tile.max(pipeline.list_capacity() as usize);
    let samples = pipeline.samples_per_row() as usize;
    // The raw mode's top logprobs come from the raw lists ([`raw_top_logprobs`]).
    let top_n = if pipeline.logprob_mode.is_processed() { pipeline.outputs.top_logprobs as usize } else { 0 };
    let mut top_logprobs = (top_n > 0).then(|| Vec::with_capacity(layout.batch));
    for row in 0..layout.batch {
        let filter = params.row_filter(row);
        let greedy = pipeline.is_greedy() || params.row_temperature(pipeline, row) == 0.0;
        let drawn = filter.is_drawn_in_stage_three(greedy) && pipeline.filter_max_k().is_some();
        let need = row_need(&filter, drawn, top_n, capacity);
        if status[row] != RowStatus::Ok || need == 0 {
            if let Some(out) = top_logprobs.as_mut() {
                out.push(Vec::new());
            }
            continue;
        }
        let top = match merge_row(layout.row(lists, row), layout.per_tile, need, row) {
            Ok(top) => top,
            Err(e) => {
                status[row] = RowStatus::from(e);
                if let Some(out) = top_logprobs.as_mut() {
                    out.push(Vec::new());
                }
                continue;
            }
        };
        let lse = reduced.logsumexp.as_ref().map_or(f32::NAN, |l| l[row]);
        if let Some(out) = top_logprobs.as_mut() {
            out.push(top.iter().take(top_n).map(|s| (s.index, s.logit - lse)).collect());
        }
        if !drawn {
            continue;
        }
        let kept = match survivors(&top, &filter, lse, top.len() < need, row) {
            Ok(k) => k,
            Err(e) => {
                status[row] = RowStatus::from(e);
                continue;
            }
        };
        let carried = |w: &Scored| raws.map_or(w.logit, |r| r.carried(layout, lists, row, w));
        draw_samples(params, row, &top[..kept], samples, carried, reduced, status);
    }
    top_logprobs
}

/// The raw mode's top logprobs (DESIGN.md step 10): per row the first `n` of its merged raw
/// lists as `(index, raw logit − raw lse)`; empty for a row that was not sampled. The CPU's
/// raw lists hold `per_tile >= n` entries, so the merge cannot overflow.
pub(crate) fn raw_top_logprobs(layout: TopLists, lists: &[Scored], n: usize, raw_lse: &[f32], status: &[RowStatus]) -> TopLogprobs {
    (0..layout.batch)
        .map(|row| match merge_row(layout.row(lists, row), layout.per_tile, n, row) {
            Ok(top) if status[row] == RowStatus::Ok => top.iter().map(|s| (s.index, s.logit - raw_lse[row])).collect(),
            _ => Vec::new(),
        })
        .collect()
}

/// Draws every sample of `row` from `kept` (stage one's noise, the row's own stream), replacing
/// stage two's token, score and logit (`carried` of the drawn entry); an empty set marks the
/// row all masked.
fn draw_samples(
    params: &SamplingParams<'_>,
    row: usize,
    kept: &[Scored],
    samples: usize,
    carried: impl Fn(&Scored) -> f32,
    reduced: &mut RowResult,
    status: &mut [RowStatus],
) {
    let (key, stream_row) = params.row_stream(row);
    let step = params.row_step(row);
    // A whole vocabulary's nucleus (100k+ tokens) is drawn in token order, one Philox call per
    // token quad, on the current rayon pool; lists draw in list order.
    let by_token = (kept.len() > LARGE_SET).then(|| {
        let vocab = kept.iter().map(|s| s.index as usize + 1).max().unwrap_or(0);
        KeptByToken::new(kept, vocab)
    });
    for s in 0..samples {
        let drawn = match &by_token {
            None => draw(kept, key, stream_row, step, s as u32, params.vocab_offset),
            Some(t) => (0..t.quads().div_ceil(QUADS_PER_TASK))
                .into_par_iter()
                .map(|c| t.draw(c * QUADS_PER_TASK..((c + 1) * QUADS_PER_TASK).min(t.quads()), key, stream_row, step, s as u32, params.vocab_offset))
                .reduce(|| None, |a, b| b.and_then(|c| better_draw(a, c)).or(a)),
        };
        let Some((w, score)) = drawn else {
            status[row] = RowStatus::AllMasked;
            return;
        };
        let i = row * samples + s;
        reduced.tokens[i] = w.index;
        reduced.scores[i] = score;
        reduced.logits[i] = carried(&w);
    }
}

/// Kept sets past this many tokens are drawn by [`KeptByToken`]: longer than any list, so only
/// the exact nucleus path's (its layout and quad scan cost ~V/4 steps, nothing next to 100k+
/// Philox calls).
const LARGE_SET: usize = flashsample_ir::MAX_LIST_CAPACITY as usize;
/// Token quads per task of a [`KeptByToken`] draw.
const QUADS_PER_TASK: usize = 4096;

/// The rows [`finish`] (or the GPU's stage three) left with a nucleus past the lists.
pub(crate) fn nucleus_rows(status: &[RowStatus]) -> Vec<usize> {
    (0..status.len()).filter(|&r| status[r] == RowStatus::NucleusTooLarge).collect()
}

/// The whole rows of logits a CPU launch kept (`codegen_cpu::Capture`): the first
/// [`CPU_CAPTURE_ROWS`] rows whose top-p / min-p nucleus may outgrow the lists, so that the exact
/// nucleus of such a row needs no second pass over the weights.
pub(crate) struct Captured {
    /// `[B]` each row's slot, or `codegen_cpu::CAPTURE_NONE`.
    pub slots: Vec<u32>,
    /// `[slots, stride]` eligible logits (`-inf` where excluded).
    pub logits: Vec<f32>,
    /// Parallel to `logits`, the raw logits, iff `Pipeline::lists_carry_raw`.
    pub raws: Option<Vec<f32>>,
    pub stride: usize,
}

/// Rows a CPU launch captures at most (600 KB each at V = 151936, twice in the raw mode);
/// later such rows are recomputed.
pub(crate) const CPU_CAPTURE_ROWS: usize = 8;

impl Captured {
    /// Buffers for the first [`CPU_CAPTURE_ROWS`] rows of `params` whose nucleus may outgrow the
    /// lists, or `None` when no row's may.
    pub fn buffers(pipeline: &Pipeline, params: &SamplingParams<'_>, batch: usize, vocab: usize) -> Option<Captured> {
        let filters = params.filter?;
        let mut slots = vec![flashsample_codegen_cpu::CAPTURE_NONE; batch];
        let mut n = 0;
        for (slot, f) in slots.iter_mut().zip(filters) {
            if n < CPU_CAPTURE_ROWS && f.may_outgrow_lists() {
                *slot = n as u32;
                n += 1;
            }
        }
        let stride = flashsample_codegen_cpu::capture_stride(vocab);
        (n > 0).then(|| Captured {
            slots,
            logits: vec![f32::NAN; n * stride],
            raws: pipeline.lists_carry_raw().then(|| vec![f32::NAN; n * stride]),
            stride,
        })
    }

    fn slot(&self, row: usize) -> Option<usize> {
        self.slots.get(row).filter(|&&s| s != flashsample_codegen_cpu::CAPTURE_NONE).map(|&s| s as usize)
    }

    /// Whether `row`'s logits were captured.
    pub fn holds(&self, row: usize) -> bool {
        self.slot(row).is_some()
    }

    /// The kernel's view of the buffers.
    pub fn launch(&mut self) -> flashsample_codegen_cpu::Capture<'_> {
        flashsample_codegen_cpu::Capture { slots: &self.slots, logits: &mut self.logits, raws: self.raws.as_deref_mut() }
    }
}

/// Where [`finish_exact`] finds each row's whole eligible vocabulary.
pub(crate) enum WholeRows<'a> {
    /// A stage one of the rows alone (`layout.batch == rows.len()`, entry `i` is `rows[i]`)
    /// with lists of whole tiles; `raws` as for [`finish`].
    Lists { layout: TopLists, lists: &'a [Scored], raws: Option<ListRaws<'a>> },
    /// The launch's own capture of every one of the rows.
    Captured(&'a Captured),
}

/// A drawn token's carried logit (its raw one in the raw mode).
type Carried<'a> = Box<dyn Fn(&Scored) -> f32 + 'a>;

impl WholeRows<'_> {
    /// Row `rows[i]`'s eligible tokens, unsorted (the lists' own entries, borrowed), and its
    /// [`Carried`] logits; `None` for a row the capture does not hold (it keeps its status).
    fn row(&self, i: usize, row: usize) -> Option<(Cow<'_, [Scored]>, Carried<'_>)> {
        match self {
            WholeRows::Lists { layout, lists, raws } => {
                let (layout, raws) = (*layout, *raws);
                let carried = move |w: &Scored| raws.map_or(w.logit, |r| r.carried(layout, lists, i, w));
                Some((Cow::Borrowed(layout.row(lists, i)), Box::new(carried)))
            }
            WholeRows::Captured(c) => {
                let at = c.slot(row)? * c.stride;
                let entries: Vec<Scored> = c.logits[at..][..c.stride]
                    .iter()
                    .enumerate()
                    .filter(|(_, x)| **x > f32::NEG_INFINITY)
                    .map(|(v, &logit)| Scored { index: v as u32, logit })
                    .collect();
                let raws = c.raws.as_deref();
                Some((Cow::Owned(entries), Box::new(move |w: &Scored| raws.map_or(w.logit, |r| r[at + w.index as usize]))))
            }
        }
    }
}

/// Serves `rows` of the launch exactly (DESIGN.md step 9 "Exact nucleus"). Each row's whole
/// eligible vocabulary comes from `whole`: sorted (in parallel, on the current rayon pool) it
/// is the `top` of [`survivors`] with `complete = true`, and [`draw`]'s winner over the cut is
/// drawn with the launch's own noise. `params`, `reduced` and `status` are the full launch's;
/// the row's logsumexp is stage two's.
pub(crate) fn finish_exact(
    pipeline: &Pipeline,
    params: &SamplingParams<'_>,
    rows: &[usize],
    whole: WholeRows<'_>,
    reduced: &mut RowResult,
    status: &mut [RowStatus],
) {
    let samples = pipeline.samples_per_row() as usize;
    for (i, &row) in rows.iter().enumerate() {
        let Some((entries, carried)) = whole.row(i, row) else { continue };
        let top = whole_row_with(&entries, |keyed| keyed.par_sort_unstable_by_key(|e| e.0));
        let lse = reduced.logsumexp.as_ref().map_or(f32::NAN, |l| l[row]);
        // A complete list bounds every filter, so this cannot fail; if it did, the row keeps
        // its list status rather than a sample.
        match survivors(&top, &params.row_filter(row), lse, true, row) {
            Ok(kept) => {
                status[row] = RowStatus::Ok;
                draw_samples(params, row, &top[..kept], samples, &carried, reduced, status);
            }
            Err(e) => status[row] = RowStatus::from(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashsample_abi::{RowFilter, TemperatureArg};
    use flashsample_ir::{DType, PipelineBuilder};

    /// Two rows whose best three tokens share tile 0 of two 2-entry lists: the top-k 2 row
    /// merges two (`row_need`) and is served from them; the top-k 3 row overflows.
    #[test]
    fn a_row_merges_its_own_top_k() {
        let p = PipelineBuilder::new("TopK", DType::BF16, DType::BF16).temperature_per_row("t").filter("f", 8).gumbel("seed", 1).build().unwrap();
        let sc = |logit, index| Scored { logit, index };
        let row = [sc(9.0, 0), sc(8.0, 1), sc(1.0, 5), sc(0.0, 6)];
        let lists: Vec<Scored> = row.iter().chain(&row).copied().collect();
        let layout = TopLists { batch: 2, tiles: 2, per_tile: 2 };
        let (filters, temperatures) = ([RowFilter::top_k(2), RowFilter::top_k(3)], [1.0f32; 2]);
        let params = SamplingParams { temperature: TemperatureArg::PerRow(&temperatures), filter: Some(&filters), seed: 3, ..Default::default() };
        let mut reduced = RowResult { tokens: vec![7; 2], scores: vec![0.0; 2], logits: vec![0.0; 2], logsumexp: Some(vec![9.5; 2]) };
        let mut status = vec![RowStatus::Ok; 2];
        finish(&p, &params, layout, &lists, None, &mut reduced, &mut status);
        assert_eq!(status, [RowStatus::Ok, RowStatus::ListOverflow]);
        assert!(reduced.tokens[0] < 2, "row 0 drew from its top 2: {}", reduced.tokens[0]);
    }

    /// Launch by launch: the lists the gate starts each on, and whether they overflow.
    #[test]
    fn only_overflows_in_launches_in_a_row_lengthen_the_lists() {
        use ListLength::{Doubled, Exact, Short};
        let holdoff = |lists| std::iter::repeat_n((lists, false), SHORT_LIST_HOLDOFF as usize);
        let launches = [(Short, false), (Short, true), (Short, false), (Short, true), (Short, false)]
            .into_iter()
            // Two in a row: the next 64 launches run doubled lists, then short ones again.
            .chain([(Short, true), (Short, true)])
            .chain(holdoff(Doubled))
            // The holdoff's last launch did not overflow: one more overflow is isolated.
            .chain([(Short, true), (Short, true), (Doubled, false), (Doubled, true), (Doubled, true)])
            // Doubled lists overflowing in a row: exact ones, then the gate starts over.
            .chain(holdoff(Exact))
            .chain([(Short, false)]);
        let gate = ShortListGate::default();
        for (launch, (want, overflows)) in launches.enumerate() {
            let lists = gate.take();
            assert_eq!(lists, want, "launch {launch}");
            if overflows {
                gate.overflowed(lists);
            }
        }
    }

    #[test]
    fn list_lengths_never_pass_the_exact_lists() {
        assert_eq!([ListLength::Short, ListLength::Doubled, ListLength::Exact].map(|l| l.per_tile(4, 50)), [4, 8, 50]);
        assert_eq!([ListLength::Short, ListLength::Doubled, ListLength::Exact].map(|l| l.per_tile(16, 20)), [16, 20, 20]);
    }

    #[test]
    fn the_rerun_covers_the_overflowed_rows_and_what_lies_between() {
        use RowStatus::{ListOverflow as O, NucleusTooLarge as N, Ok};
        assert_eq!(overflowed_rows(&[Ok, N, Ok]), None);
        assert_eq!(overflowed_rows(&[Ok, O, Ok]), Some(1..2));
        assert_eq!(overflowed_rows(&[Ok, O, N, Ok, O, Ok]), Some(1..5));
        assert_eq!(overflowed_rows(&[O]), Some(0..1));
    }
}
