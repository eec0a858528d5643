//! Speculative verification fixtures shared by the CPU and GPU tests: verifying pipelines,
//! random drafts, and the check that a backend's `Verified` is pathwise the reference's.

use crate::Case;
use flashsample::{Sampler, SamplingParams, Verified};
use flashsample_abi::speculative::DraftKind;
use flashsample_ir::{DType, Outputs, Pipeline, PipelineBuilder};
use flashsample_reference::SpecOutcome;
use rand::{rngs::StdRng, Rng};

/// A verifying bf16 pipeline with per-row temperatures, a mask, a logprob output and
/// optionally a top-k/top-p filter (capacity 8) and penalties.
pub fn verifier(kind: DraftKind, filtered: bool, penalties: bool) -> Pipeline {
    let mut b = PipelineBuilder::new("Verifier", DType::BF16, DType::BF16);
    if penalties {
        b = b.penalties("pen");
    }
    b = b.temperature_per_row("t").mask("allowed");
    if filtered {
        b = b.filter("filter", 8);
    }
    b = match kind {
        DraftKind::Greedy => b.verify_greedy("drafts"),
        DraftKind::Sampled => b.verify_sampled("drafts", "q"),
    };
    b.outputs(Outputs { logprob: true, ..Outputs::default() }).build().unwrap()
}

/// A filtered verification whose rows' top 12 tokens share vocabulary tile 0 ([`Case::hot_tile`]),
/// each row on top-k 8: 8 sequences of k = 3 drafts (32 rows, D 64, V 20000). Lists shorter
/// than 8 entries a tile overflow (the GPU's 4), and the verification must still be the
/// reference's; returns the pipeline, the case and k.
pub fn hot_tile_verification(kind: DraftKind) -> (Pipeline, Case, usize) {
    let p = verifier(kind, true, false);
    let k = 3;
    let case = Case::hot_tile(&p, 8 * (k + 1), 64, 20_000, 12).with_filter(flashsample::RowFilter::top_k(8));
    (p, case, k)
}

/// The verifying pipelines the pathwise tests run: (draft kind, filtered, penalties).
pub const VERIFIERS: [(DraftKind, bool, bool); 4] =
    [(DraftKind::Sampled, false, true), (DraftKind::Sampled, true, false), (DraftKind::Greedy, false, false), (DraftKind::Greedy, true, true)];

/// Random draft distributions `[n, V]`, far from the target's, and drafts drawn from them.
pub fn random_drafts(rng: &mut StdRng, n: usize, vocab: usize) -> (Vec<u32>, Vec<f32>) {
    let mut q = Vec::with_capacity(n * vocab);
    let mut drafts = Vec::with_capacity(n);
    for _ in 0..n {
        let w: Vec<f32> = (0..vocab).map(|_| rng.random_range(0.05f32..1.0).powi(4)).collect();
        let s: f32 = w.iter().sum();
        let row: Vec<f32> = w.iter().map(|x| x / s).collect();
        drafts.push(draw(rng, &row));
        q.extend(row);
    }
    (drafts, q)
}

/// A token drawn from the distribution `q`.
pub fn draw(rng: &mut StdRng, q: &[f32]) -> u32 {
    let mut u = rng.random_range(0.0f32..1.0);
    for (v, &p) in q.iter().enumerate() {
        if u < p {
            return v as u32;
        }
        u -= p;
    }
    (q.len() - 1) as u32
}

/// Placeholder drafts that pass validation, for reading the reference's target distributions
/// before the real drafts exist.
pub fn placeholder<'a>(p: &Pipeline, case: &'a Case, drafts: &'a [u32], q: &'a [f32]) -> SamplingParams<'a> {
    let sampled = p.verify.as_ref().unwrap().kind() == DraftKind::Sampled;
    SamplingParams { drafts: Some(drafts), draft_probs: sampled.then_some(q), ..case.params(p) }
}

/// Makes every other draft of `drafts` (`S·k`) its target row's most likely token, so that
/// greedy drafts are sometimes accepted.
pub fn most_likely_every_other(p: &Pipeline, case: &Case, k: usize, drafts: &mut [u32], q: &[f32]) {
    let vocab = case.weights.rows;
    let zeros = vec![0; drafts.len()];
    let params = placeholder(p, case, &zeros, q);
    let problem = case.problem(p, &params);
    for (n, d) in drafts.iter_mut().enumerate().filter(|(n, _)| n % 2 == 0) {
        let dist = problem.target_distribution(n / k * (k + 1) + n % k).unwrap();
        *d = (0..vocab).fold(0, |b, v| if dist[v] > dist[b] { v } else { b }) as u32;
    }
}

/// The pathwise tests' drafts of `case` (`S·k`, from `StdRng(seed + 100)`) and their
/// distributions: random, and for greedy drafts every other one its row's most likely token,
/// so that some are accepted.
pub fn case_drafts(p: &Pipeline, case: &Case, k: usize, seed: u64) -> (Vec<u32>, Vec<f32>) {
    let seqs = case.batch / (k + 1);
    let mut rng = <StdRng as rand::SeedableRng>::seed_from_u64(seed + 100);
    let (mut drafts, q) = random_drafts(&mut rng, seqs * k, case.weights.rows);
    if p.verify.as_ref().unwrap().kind() == DraftKind::Greedy {
        most_likely_every_other(p, case, k, &mut drafts, &q);
    }
    (drafts, q)
}

/// Drafts close to the target (`q = (1 − ε)·p + ε·δ(d)`, `d` uniform): the residual is `ε·p`
/// spread over the vocabulary, so every listed token's residual score sits `ln ε` below its
/// stored score and, for small enough `ε`, under some tile's bound: rows are recomputed. How
/// small depends on the backend's tiles (more and larger tiles raise the largest bound).
pub fn close_drafts(p: &Pipeline, case: &Case, k: usize, epsilon: f64, rng: &mut StdRng) -> (Vec<u32>, Vec<f32>) {
    let (seqs, vocab) = (case.batch / (k + 1), case.weights.rows);
    let (zeros, uniform) = (vec![0; seqs * k], vec![1.0 / vocab as f32; seqs * k * vocab]);
    let params = placeholder(p, case, &zeros, &uniform);
    let problem = case.problem(p, &params);
    let (mut drafts, mut q) = (vec![0; seqs * k], vec![0f32; seqs * k * vocab]);
    for n in 0..seqs * k {
        let target = problem.target_distribution(n / k * (k + 1) + n % k).unwrap();
        let d = rng.random_range(0..vocab);
        drafts[n] = d as u32;
        for v in 0..vocab {
            q[n * vocab + v] = ((1.0 - epsilon) * target[v] + if v == d { epsilon } else { 0.0 }) as f32;
        }
    }
    (drafts, q)
}

/// Runs `sampler` (any backend) on one case and asserts it agrees with the reference
/// (`Problem::verify`) per sequence: accepted count, next token, emitted drafts, and logprobs
/// present exactly for the emitted tokens.
pub fn compare(sampler: &Sampler, p: &Pipeline, case: &Case, k: usize, drafts: &[u32], q: Option<&[f32]>) -> Verified {
    let params = SamplingParams { drafts: Some(drafts), draft_probs: q, ..case.params(p) };
    let got = sampler.verify(case.hidden.tensor(), case.weights.tensor(), &params).unwrap();
    let kind = p.verify.as_ref().unwrap().kind();
    let want = case.problem(p, &params).verify(k, kind, drafts, q).unwrap();
    assert_eq!(got.sequences(), want.len());
    for (i, w) in want.iter().enumerate() {
        assert_eq!(got.errors[i], None, "sequence {i}");
        assert_eq!(SpecOutcome { accepted: got.accepted[i], next: got.next(i) }, *w, "sequence {i} of {} (k = {k})", want.len());
        assert_eq!(&got.emitted(i)[..w.accepted], &drafts[i * k..][..w.accepted]);
        let lp = &got.logprobs.as_ref().unwrap()[i * (k + 1)..][..k + 1];
        assert!(lp[..=w.accepted].iter().all(|&l| l <= 1e-6), "{lp:?}");
        assert!(lp[w.accepted + 1..].iter().all(|l| l.is_nan()), "{lp:?}");
    }
    got
}
