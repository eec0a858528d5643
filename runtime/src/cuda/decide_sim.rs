//! Tests of the device decision without a GPU: `flashsample_decide`'s LLVM IR, as codegen
//! emits it, interpreted on the host ([`super::ir_sim`]) decides every sequence as the host's
//! `verify::decide` does, bit for bit, and its f64 helpers compute the abi's `ln_f64`,
//! `exp_f64` and `gumbel_f64` bit for bit.

use super::ir_sim::{Memory, Module};
use crate::verify::{decide, DraftProbs, Verified, VerifyRun};
use flashsample_abi::filter::{merge_row, row_need, survivors, Scored, TopLists};
use flashsample_abi::rng::gumbel_f32;
use flashsample_abi::speculative::{residual_bits, SpecStatus};
use flashsample_abi::{Candidate, RowFilter, RowResult, RowStatus, SamplingParams, TemperatureArg, INDEX_NONE};
use flashsample_codegen_ptx::{GpuConfig, Grid, Schedule, DECIDE, DECIDE_SHARED};
use flashsample_ir::{DType, Outputs, Pipeline, PipelineBuilder};
use std::cell::RefCell;
use std::collections::HashMap;

/// A random verifying launch (stage one's outputs as the decision reads them) and the
/// host's and the interpreted kernel's decisions of it.
#[derive(Clone)]
struct Scenario {
    pipeline: Pipeline,
    k: usize,
    vocab: usize,
    tiles: usize,
    per_tile: usize,
    /// `[B, V]` transformed logits.
    x: Vec<f32>,
    temperatures: Vec<f32>,
    filters: Option<Vec<RowFilter>>,
    row_seeds: Option<Vec<u64>>,
    row_steps: Vec<u32>,
    status: Vec<RowStatus>,
    drafts: Vec<u32>,
    probs: Option<Vec<f32>>,
    seed: u64,
    vocab_offset: u32,
}

/// A small xorshift generator (the scenario needs no statistics).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

impl Scenario {
    fn new(sampled: bool, filtered: bool, k: usize, seqs: usize, seed: u64) -> Scenario {
        let mut b = PipelineBuilder::new("Verify", DType::BF16, DType::BF16).temperature_per_row("t");
        if filtered {
            b = b.filter("filter", 8);
        }
        b = if sampled { b.verify_sampled("drafts", "q") } else { b.verify_greedy("drafts") };
        let pipeline = b.outputs(Outputs { logprob: true, ..Outputs::default() }).build().unwrap();
        let (vocab, tiles, per_tile) = (64, 4, 4);
        let rows = seqs * (k + 1);
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let x: Vec<f32> = (0..rows * vocab).map(|_| (rng.unit() - 0.5) * 8.0).collect();
        let temperatures: Vec<f32> = (0..rows).map(|_| if rng.below(6) == 0 { 0.0 } else { 1.0 }).collect();
        let status: Vec<RowStatus> = (0..rows)
            .map(|_| match rng.below(40) {
                0 => RowStatus::AllMasked,
                1 => RowStatus::NonFinite,
                _ => RowStatus::Ok,
            })
            .collect();
        let filters = filtered.then(|| {
            (0..rows)
                .map(|_| match rng.below(8) {
                    0..3 => RowFilter::top_k(4),
                    3..5 => RowFilter { top_k: 6, top_p: 0.7, min_p: 0.0 },
                    // A nucleus that may outgrow the lists (the row then needs a recompute).
                    5 => RowFilter { top_k: 0, top_p: 0.8, min_p: 0.0 },
                    _ => RowFilter::OFF,
                })
                .collect()
        });
        let row_seeds = seed.is_multiple_of(2).then(|| (0..rows).map(|_| rng.next()).collect());
        let row_steps = (0..rows).map(|_| rng.below(5) as u32).collect();
        let mut drafts = Vec::new();
        let mut probs = Vec::new();
        for i in 0..seqs {
            for j in 0..k {
                let r = i * (k + 1) + j;
                let row = &x[r * vocab..][..vocab];
                // Drafts far from the target, or close to it (the residual bound then fails).
                let close = rng.below(4) == 0;
                let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let p: Vec<f64> = row.iter().map(|&v| f64::from(v - m).exp()).collect();
                let total: f64 = p.iter().sum();
                // With filters, half the drafts are among the row's best four tokens under a
                // draft spread over its best three, so `p_j(d)` (the survivors' mass) decides.
                let mut order: Vec<usize> = (0..vocab).collect();
                order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
                let near = filtered && rng.below(2) == 0;
                let d = if near {
                    order[rng.below(4)]
                } else if rng.below(3) == 0 {
                    order[0]
                } else {
                    rng.below(vocab)
                };
                let q: Vec<f32> = if near {
                    (0..vocab).map(|v| if order[..3].contains(&v) { 0.99 / 3.0 } else { 0.01 / (vocab - 3) as f32 }).collect()
                } else if close {
                    (0..vocab).map(|v| (0.97 * p[v] / total + if v == d { 0.03 } else { 0.0 }) as f32).collect()
                } else {
                    let w: Vec<f32> = (0..vocab).map(|_| rng.unit().powi(4) + 1e-3).collect();
                    let s: f32 = w.iter().sum();
                    w.iter().map(|w| w / s).collect()
                };
                drafts.push(d as u32);
                probs.extend(q);
            }
        }
        Scenario {
            pipeline,
            k,
            vocab,
            tiles,
            per_tile,
            x,
            temperatures,
            filters,
            row_seeds,
            row_steps,
            status,
            drafts,
            probs: sampled.then_some(probs),
            seed: 11 + seed,
            vocab_offset: 8,
        }
    }

    fn rows(&self) -> usize {
        self.temperatures.len()
    }

    fn params(&self) -> SamplingParams<'_> {
        SamplingParams {
            temperature: TemperatureArg::PerRow(&self.temperatures),
            seed: self.seed,
            row_seeds: self.row_seeds.as_deref(),
            row_steps: Some(&self.row_steps),
            filter: self.filters.as_deref(),
            vocab_offset: self.vocab_offset,
            ..Default::default()
        }
    }

    /// Stage one's and two's outputs: residual lists (each tile's best `per_tile` tokens by
    /// `x + gumbel_f32(residual bits)`), row tokens (a draft row's argmax, a bonus row's
    /// best token), their logits, the row logsumexps and the draft logits.
    fn stage_outputs(&self) -> (Vec<Candidate>, RowResult, Vec<f32>) {
        let params = self.params();
        let (rows, v) = (self.rows(), self.vocab);
        let tile = v / self.tiles;
        let mut lists = Vec::new();
        let (mut tokens, mut logits, mut lse, mut draft_logits) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for r in 0..rows {
            let row = &self.x[r * v..][..v];
            let (key, ctr) = params.row_stream(r);
            let step = params.row_step(r);
            for t in 0..self.tiles {
                let mut list = vec![flashsample_abi::speculative::RESIDUAL_EMPTY; self.per_tile];
                for (tok, &xv) in row.iter().enumerate().skip(t * tile).take(tile) {
                    let g = gumbel_f32(residual_bits(key, ctr, tok as u32 + self.vocab_offset, step));
                    flashsample_abi::speculative::insert_residual(&mut list, Candidate { score: xv + g, index: tok as u32, logit: xv });
                }
                lists.extend(list);
            }
            let best = row.iter().enumerate().fold(0, |b, (i, &xv)| if xv > row[b] { i } else { b });
            tokens.push(best as u32);
            logits.push(row[best]);
            let m = f64::from(row[best]);
            lse.push((m + row.iter().map(|&xv| (f64::from(xv) - m).exp()).sum::<f64>().ln()) as f32);
            let is_draft = r % (self.k + 1) != self.k;
            draft_logits.push(if is_draft { row[self.drafts[r / (self.k + 1) * self.k + r % (self.k + 1)] as usize] } else { 0.0 });
        }
        (lists, RowResult { tokens, scores: logits.clone(), logits, logsumexp: Some(lse) }, draft_logits)
    }
}

/// Entries per (row, tile) of the filter's lists: fewer than the capacity (8), so a row whose
/// top tokens cluster in one tile overflows them.
const FILTER_PER_TILE: usize = 6;

impl Scenario {
    /// Whether stage three draws row `r` (`RowFilter::is_drawn_in_stage_three`).
    fn drawn_in_stage_three(&self, r: usize) -> bool {
        let greedy = self.pipeline.is_greedy() || self.temperatures[r] == 0.0;
        self.filters.as_ref().is_some_and(|f| f[r].is_drawn_in_stage_three(greedy))
    }

    /// The filter's lists (each tile's best [`FILTER_PER_TILE`] tokens by logit) and what
    /// stage three keeps of them for the decision (`FilterArgs::kept`, `Scored [B, need]`):
    /// each drawn, ok row's survivors (`merge_row` of its `row_need` + `survivors`), `EMPTY` after them, and an
    /// `EMPTY` first entry for every other row.
    fn filter_outputs(&self, lse: &[f32]) -> (Vec<Scored>, Vec<Scored>) {
        let need = self.pipeline.list_capacity() as usize;
        let tile = self.vocab / self.tiles;
        let mut lists = Vec::new();
        for r in 0..self.rows() {
            for t in 0..self.tiles {
                let entries: Vec<Scored> = (t * tile..(t + 1) * tile).map(|v| Scored { logit: self.x[r * self.vocab + v], index: v as u32 }).collect();
                let best = flashsample_abi::filter::whole_row(&entries);
                lists.extend(best.into_iter().chain(std::iter::repeat(Scored::EMPTY)).take(FILTER_PER_TILE));
            }
        }
        let layout = TopLists { batch: self.rows(), tiles: self.tiles, per_tile: FILTER_PER_TILE };
        let mut kept = vec![Scored::EMPTY; self.rows() * need];
        for r in 0..self.rows() {
            if !self.drawn_in_stage_three(r) || self.status[r] != RowStatus::Ok {
                continue;
            }
            let filter = self.filters.as_ref().unwrap()[r];
            let row_need = row_need(&filter, true, 0, need);
            let top = merge_row(layout.row(&lists, r), FILTER_PER_TILE, row_need, r).ok();
            if let Some(n) = top.as_ref().and_then(|top| survivors(top, &filter, lse[r], top.len() < row_need, r).ok()) {
                kept[r * need..][..n].copy_from_slice(&top.unwrap()[..n]);
            }
        }
        (lists, kept)
    }
}

impl Scenario {
    /// The host's decision (`verify::decide`) from stage one's outputs and, with filters, the
    /// filter's lists ([`FILTER_PER_TILE`] per tile); and the rows it recomputed over the
    /// whole vocabulary (each row's every token, from `x`).
    fn host_decision(&self, lists: &[Candidate], reduced: &RowResult, draft_logits: &[f32], filter_lists: Option<&[Scored]>) -> (Verified, Vec<usize>) {
        let recomputed = RefCell::new(Vec::new());
        let mut whole_row = |row: usize| -> crate::Result<Vec<Scored>> {
            recomputed.borrow_mut().push(row);
            let x = &self.x[row * self.vocab..][..self.vocab];
            Ok(flashsample_abi::filter::whole_row(&x.iter().enumerate().map(|(v, &l)| Scored { logit: l, index: v as u32 }).collect::<Vec<_>>()))
        };
        let layout = TopLists { batch: self.rows(), tiles: self.tiles, per_tile: self.per_tile };
        let filter_layout = TopLists { per_tile: FILTER_PER_TILE, ..layout };
        let run = VerifyRun {
            status: &self.status,
            reduced,
            lists: filter_lists.map(|l| (filter_layout, l)),
            target_logits: draft_logits,
            residual: (layout, lists),
        };
        let q = DraftProbs { drafts: &self.drafts, probs: self.probs.as_deref(), vocab: self.vocab };
        let host = decide(&self.pipeline, &self.params(), &q, self.k, &run, &mut whole_row).unwrap();
        (host, recomputed.into_inner())
    }
}

/// The decision kernel of `pipeline` and its helpers, parsed, with the shared-memory scratch.
fn kernel(pipeline: &Pipeline, mem: &mut Memory) -> (Module, &'static str) {
    let mut c = GpuConfig::new(128, 8, 4, Schedule::MmaSync { stages: 2, k_step: 64, grid: Grid::PerItem });
    c.fit_lists(pipeline);
    let ir = flashsample_codegen_ptx::llvm_ir(pipeline, &c).unwrap();
    let mut globals = HashMap::new();
    for (name, _, bytes, n) in DECIDE_SHARED {
        globals.insert(name.to_string(), mem.add(vec![0; bytes * n]));
    }
    (Module::with_callees(&ir, &[DECIDE.kernel, "fs_ln_f64", "fs_exp_f64", "fs_gumbel_f64"], &globals), DECIDE.kernel)
}

/// What the interpreted kernel wrote: accepted, tokens, logprobs, status.
type Outcome = (Vec<u32>, Vec<u32>, Vec<f32>, Vec<u32>);

fn run_kernel(s: &Scenario, lists: &[Candidate], reduced: &RowResult, draft_logits: &[f32], kept: &[Scored]) -> Outcome {
    let mut mem = Memory { bufs: Vec::new() };
    let (module, name) = kernel(&s.pipeline, &mut mem);
    let f = &module.funcs[name];
    let rows = s.rows();
    let seqs = rows / (s.k + 1);
    let bytes = |v: &[u8]| v.to_vec();
    let u32s = |v: &[u32]| bytes(bytemuck::cast_slice(v));
    let f32s = |v: &[f32]| bytes(bytemuck::cast_slice(v));
    let status: Vec<u32> = s.status.iter().map(|st| st.code()).collect();
    let mut at: HashMap<&str, u64> = HashMap::new();
    at.insert("status", mem.add(u32s(&status)));
    at.insert("row_tokens", mem.add(u32s(&reduced.tokens)));
    at.insert("row_logits", mem.add(f32s(&reduced.logits)));
    at.insert("lse", mem.add(f32s(reduced.logsumexp.as_ref().unwrap())));
    at.insert("draft_logits", mem.add(f32s(draft_logits)));
    at.insert("residual_lists", mem.add(bytes(bytemuck::cast_slice(lists))));
    at.insert("tiles", s.tiles as u64);
    at.insert("per_tile", s.per_tile as u64);
    at.insert("drafts", mem.add(u32s(&s.drafts)));
    at.insert("draft_probs", s.probs.as_ref().map_or(0, |q| mem.add(f32s(q))));
    at.insert("vocab", s.vocab as u64);
    at.insert("k", s.k as u64);
    at.insert("sequences", seqs as u64);
    at.insert("temperatures", mem.add(f32s(&s.temperatures)));
    at.insert("all_greedy", u64::from(s.pipeline.is_greedy()));
    at.insert("filters", s.filters.as_ref().map_or(0, |f| mem.add(bytes(bytemuck::cast_slice(f)))));
    at.insert("kept", if kept.is_empty() { 0 } else { mem.add(bytes(bytemuck::cast_slice(kept))) });
    at.insert("kept_width", u64::from(s.pipeline.list_capacity()));
    at.insert("seed", s.seed);
    at.insert("row_seeds", s.row_seeds.as_ref().map_or(0, |x| mem.add(bytes(bytemuck::cast_slice(x)))));
    at.insert("row_steps", mem.add(u32s(&s.row_steps)));
    at.insert("row_base", 0);
    at.insert("vocab_offset", u64::from(s.vocab_offset));
    let (accepted, tokens, logprobs, out_status) =
        (mem.add(vec![0xab; seqs * 4]), mem.add(vec![0xab; rows * 4]), mem.add(vec![0xab; rows * 4]), mem.add(vec![0xab; seqs * 4]));
    at.insert("out_accepted", accepted);
    at.insert("out_tokens", tokens);
    at.insert("out_logprobs", logprobs);
    at.insert("out_status", out_status);
    let params: Vec<u64> = f.params.iter().map(|p| at[p.trim_start_matches('%')]).collect();
    for cta in 0..seqs as u64 {
        module.run_cta(f, &params, cta, &mut mem);
    }
    let read = |mem: &mut Memory, a: u64, n: usize| -> Vec<u32> { (0..n).map(|i| mem.load(a + 4 * i as u64, 4) as u32).collect() };
    let lp = read(&mut mem, logprobs, rows).into_iter().map(f32::from_bits).collect();
    (read(&mut mem, accepted, seqs), read(&mut mem, tokens, rows), lp, read(&mut mem, out_status, seqs))
}

/// Runs one scenario through the kernel and the host; returns (decided, recomputed, decided
/// with a filtered first draft row, rejections served from the lists).
fn compare(s: &Scenario) -> [usize; 4] {
    let (lists, reduced, draft_logits) = s.stage_outputs();
    let (filter_lists, kept) = if s.filters.is_some() { s.filter_outputs(reduced.logsumexp.as_ref().unwrap()) } else { (Vec::new(), Vec::new()) };
    let (accepted, tokens, logprobs, status) = run_kernel(s, &lists, &reduced, &draft_logits, &kept);
    let rows = s.rows();
    let k = s.k;
    let filter_lists = s.filters.as_ref().map(|_| filter_lists.as_slice());
    let (host, recomputed) = s.host_decision(&lists, &reduced, &draft_logits, filter_lists);
    let mut counts = [0; 4];
    for i in 0..rows / (k + 1) {
        let span = i * (k + 1)..(i + 1) * (k + 1);
        let what = format!("k {k}, sequence {i}: kernel status {}, accepted {} tokens {:?}; host {:?} {:?}", status[i], accepted[i], &tokens[span.clone()], host.accepted[i], &host.tokens[span.clone()]);
        match SpecStatus::from_code(status[i]) {
            Some(SpecStatus::Ok) => {
                assert_eq!(host.errors[i], None, "{what}");
                assert!(!recomputed.iter().any(|r| span.contains(r)), "{what}: the host recomputed a row the kernel decided");
                assert_eq!(accepted[i] as usize, host.accepted[i], "{what}");
                assert_eq!(&tokens[span.clone()], &host.tokens[span.clone()], "{what}");
                let lh = &host.logprobs.as_ref().unwrap()[span.clone()];
                assert!(logprobs[span.clone()].iter().zip(lh).all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())), "{what}: logprobs {:?} {lh:?}", &logprobs[span]);
                counts[0] += 1;
                if host.accepted[i] < k && s.temperatures[i * (k + 1) + host.accepted[i]] != 0.0 {
                    counts[3] += 1;
                }
                if k > 0 && s.drawn_in_stage_three(i * (k + 1)) {
                    counts[2] += 1;
                }
            }
            Some(SpecStatus::RowFailed) => assert!(host.errors[i].is_some(), "{what}"),
            Some(SpecStatus::Recompute) => {
                assert!(recomputed.iter().any(|r| span.contains(r)), "{what}: the kernel recomputes, the host did not");
                assert!(tokens[span].iter().all(|&t| t == INDEX_NONE), "{what}");
                counts[1] += 1;
            }
            other => panic!("{what}: {other:?}"),
        }
    }
    counts
}

#[test]
fn the_interpreted_decision_kernel_decides_as_the_host() {
    let mut totals = [0; 4];
    for (n, (sampled, k, seqs)) in [(true, 3, 10), (false, 3, 10), (true, 1, 12), (true, 0, 6), (false, 7, 4), (true, 7, 4)].into_iter().enumerate() {
        for seed in 0..2 {
            let c = compare(&Scenario::new(sampled, false, k, seqs, (n * 2 + seed) as u64));
            for (t, c) in totals.iter_mut().zip(c) {
                *t += c;
            }
        }
    }
    let [decided, recomputed, _, from_lists] = totals;
    assert!(decided > 60 && from_lists > 10 && recomputed > 0, "decided {decided}, recomputed {recomputed}, rejections from the lists {from_lists}");
}

#[test]
fn the_interpreted_decision_kernel_decides_filtered_rows_as_the_host() {
    let mut totals = [0; 4];
    for (n, (sampled, k, seqs)) in [(true, 3, 8), (false, 3, 8), (true, 1, 10), (true, 7, 3)].into_iter().enumerate() {
        for seed in 0..2 {
            let c = compare(&Scenario::new(sampled, true, k, seqs, (100 + n * 2 + seed) as u64));
            for (t, c) in totals.iter_mut().zip(c) {
                *t += c;
            }
        }
    }
    let [decided, recomputed, filtered, from_lists] = totals;
    assert!(filtered > 10 && decided > 30 && from_lists > 5 && recomputed > 0, "decided {decided} ({filtered} from a filtered first row), recomputed {recomputed}, rejections from the lists {from_lists}");
}

/// Drafts the device API did not check: a token past `V` or a draft probability of its token
/// that is 0, NaN or infinite faults the sequence at the first such position (before any
/// decision), and so does a NaN entry the residual draw reads (at the rejected position);
/// the fault's position comes back in `accepted`, and the other sequences are decided as the
/// host decides them.
#[test]
fn the_interpreted_decision_kernel_reports_bad_drafts() {
    use flashsample_abi::speculative::SequenceError;
    let mut faulted_in_residual = 0;
    for seed in 0..4 {
        let clean = Scenario::new(true, false, 3, 10, 200 + seed);
        let k = clean.k;
        let (lists, reduced, draft_logits) = clean.stage_outputs();
        let (host, _) = clean.host_decision(&lists, &reduced, &draft_logits, None);
        let mut bad = clean.clone();
        let v = bad.vocab;
        let probs = bad.probs.as_mut().unwrap();
        bad.drafts[k + 2] = (v + 5) as u32;
        probs[(2 * k + 1) * v + bad.drafts[2 * k + 1] as usize] = 0.0;
        probs[3 * k * v + bad.drafts[3 * k] as usize] = f32::NAN;
        probs[(4 * k + 2) * v + bad.drafts[4 * k + 2] as usize] = f32::INFINITY;
        for j in 0..k {
            let d = bad.drafts[5 * k + j] as usize;
            probs[(5 * k + j) * v..][..v].iter_mut().enumerate().filter(|(t, _)| *t != d).for_each(|(_, q)| *q = f32::NAN);
        }
        let (accepted, tokens, _, status) = run_kernel(&bad, &lists, &reduced, &draft_logits, &[]);
        let fault = |i: usize| (SpecStatus::from_code(status[i]), accepted[i]);
        let what = format!("seed {seed}: status {status:?} accepted {accepted:?}");
        let failed_row = |i: usize| crate::verify::sequence_failure(&bad.status, i * (k + 1)..(i + 1) * (k + 1), k, 0).is_some();
        // The draft checks come before the rows' own failures.
        assert_eq!(fault(1), (Some(SpecStatus::DraftToken), 2), "{what}");
        assert_eq!(fault(2), (Some(SpecStatus::DraftProbability), 1), "{what}");
        assert_eq!(fault(3), (Some(SpecStatus::DraftProbability), 0), "{what}");
        assert_eq!(fault(4), (Some(SpecStatus::DraftProbability), 2), "{what}");
        // Sequence 5 reads its NaN entries only in a residual draw of a sampled row.
        let rejected_at = host.accepted[5];
        let sampled_rejection = host.errors[5].is_none() && rejected_at < k && bad.temperatures[5 * (k + 1) + rejected_at] != 0.0;
        if failed_row(5) {
            assert_eq!(fault(5).0, Some(SpecStatus::RowFailed), "{what}");
        } else if sampled_rejection {
            assert_eq!(fault(5), (Some(SpecStatus::DraftProbability), rejected_at as u32), "{what}");
            faulted_in_residual += 1;
        } else {
            assert_eq!(fault(5).0, Some(SpecStatus::Ok), "{what}");
        }
        for i in [1, 2, 3, 4] {
            assert!(tokens[i * (k + 1)..][..k + 1].iter().all(|&t| t == INDEX_NONE), "{what}: a faulted sequence carries tokens");
        }
        for i in (0..10).filter(|i| ![1, 2, 3, 4, 5].contains(i)) {
            if SpecStatus::from_code(status[i]) == Some(SpecStatus::Ok) {
                let span = i * (k + 1)..(i + 1) * (k + 1);
                assert_eq!((accepted[i] as usize, &tokens[span.clone()]), (host.accepted[i], &host.tokens[span]), "{what}: sequence {i}");
            }
        }
        let e = SequenceError::DraftToken { sequence: 1, position: 2 };
        assert!(e.to_string().contains("sequence 1, draft 2"), "{e}");
    }
    assert!(faulted_in_residual > 0, "no residual draw read a NaN entry");
}

#[test]
fn the_decision_f64_helpers_are_the_abis_bit_for_bit() {
    use flashsample_abi::math::{exp_f64, ln_f64};
    use flashsample_abi::rng::gumbel_f64;
    let mut mem = Memory { bufs: Vec::new() };
    let (module, _) = kernel(&Scenario::new(true, false, 1, 1, 0).pipeline, &mut mem);
    let mut call = |name: &str, bits: u64| module.call(name, &[[bits, 0, 0, 0, 0, 0, 0, 0]], &mut mem)[0];
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    for i in 0..20_000 {
        // ln over normal positives of every magnitude, and near 1 (fdlibm's other branch).
        let x = if i % 2 == 0 {
            f64::from_bits(rng.next() % (0x7fe0_0000_0000_0000 - 0x0010_0000_0000_0000) + 0x0010_0000_0000_0000)
        } else {
            1.0 + (rng.below(2_000_001) as f64 - 1e6) * 1e-7
        };
        assert_eq!(call("fs_ln_f64", x.to_bits()), ln_f64(x).to_bits(), "ln {x:e}");
        // exp over the decision's domain (x − L ≤ ~0) and past its ends.
        let y = rng.below(1_000_000) as f64 * -7.2e-4 + 2.0;
        assert_eq!(call("fs_exp_f64", y.to_bits()), exp_f64(y).to_bits(), "exp {y}");
        let bits = rng.next() as u32;
        assert_eq!(call("fs_gumbel_f64", u64::from(bits)), gumbel_f64(bits).to_bits(), "gumbel {bits:#x}");
    }
    for y in [0.0, -708.0, -708.5, -1e300, f64::NEG_INFINITY, f64::NAN, 1e-300, -1e-300] {
        assert_eq!(call("fs_exp_f64", y.to_bits()), exp_f64(y).to_bits(), "exp {y}");
    }
    for bits in [0, u32::MAX, 0xff, 0x100, 0x8000_0000] {
        assert_eq!(call("fs_gumbel_f64", u64::from(bits)), gumbel_f64(bits).to_bits(), "gumbel {bits:#x}");
    }
}
