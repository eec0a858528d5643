//! The float64 reference of speculative verification (`Problem::verify`, DESIGN.md
//! "Speculative verification") is exact: over many seeds, the first token a sequence emits is
//! distributed as the target's row 0, and, given the first draft was accepted, the second as
//! row 1, whatever the draft distribution, for sampled and greedy drafts, with and without a
//! filter and at a greedy target row. These pin the algorithm and its noise keys before any
//! backend implements them.

use flashsample::{RowFilter, SamplingParams};
use flashsample_abi::speculative::{DraftKind, SpecError};
use flashsample_ir::{DType, Pipeline, PipelineBuilder};
use flashsample_reference::{SpecOutcome, SpecReferenceError};
use flashsample_tests::{chi_square, Case};
use flashsample_tests::spec::draw;
use rand::{rngs::StdRng, Rng, SeedableRng};

const TRIALS: u64 = 20_000;
const SIGNIFICANCE: f64 = 1e-3;
const V: usize = 8;
const K: usize = 2;

fn pipeline(filtered: bool) -> Pipeline {
    let b = PipelineBuilder::new("Target", DType::BF16, DType::BF16).temperature_per_row("t");
    let b = if filtered { b.filter("filter", 4) } else { b };
    b.gumbel("seed", 1).build().unwrap()
}

/// A draft distribution per position, far from the target's.
fn draft_distributions(rng: &mut StdRng) -> Vec<f32> {
    (0..K)
        .flat_map(|_| {
            let w: Vec<f32> = (0..V).map(|_| rng.random_range(0.05f32..1.0).powi(3)).collect();
            let s: f32 = w.iter().sum();
            w.into_iter().map(move |x| x / s)
        })
        .collect()
}

/// Counts of the first emitted token and, after an accepted first draft, of the second.
fn emitted(mut case: Case, p: &Pipeline, kind: DraftKind, temperatures: [f32; K + 1]) -> (Vec<u64>, Vec<u64>, Vec<f64>, Vec<f64>) {
    let mut rng = StdRng::seed_from_u64(5);
    let q = draft_distributions(&mut rng);
    case.temperatures = temperatures.to_vec();
    let (mut first, mut second) = (vec![0u64; V], vec![0u64; V]);
    let mut probs = None;
    for t in 0..TRIALS {
        let seeds: Vec<u64> = (0..=K as u64).map(|j| t * 7919 + j + 1).collect();
        let params = SamplingParams { row_seeds: Some(&seeds), ..case.params(p) };
        let problem = case.problem(p, &params);
        let drafts: Vec<u32> = match kind {
            DraftKind::Sampled => (0..K).map(|j| draw(&mut rng, &q[j * V..][..V])).collect(),
            DraftKind::Greedy => vec![3, 5],
        };
        let q_arg = (kind == DraftKind::Sampled).then_some(&q[..]);
        let [SpecOutcome { accepted, next }] = problem.verify(K, kind, &drafts, q_arg).unwrap()[..] else { panic!("one sequence") };
        let tokens: Vec<u32> = drafts[..accepted].iter().copied().chain([next]).collect();
        first[tokens[0] as usize] += 1;
        if accepted >= 1 {
            second[tokens[1] as usize] += 1;
        }
        probs.get_or_insert_with(|| (problem.target_distribution(0).unwrap(), problem.target_distribution(1).unwrap()));
    }
    let (p0, p1) = probs.unwrap();
    (first, second, p0, p1)
}

#[test]
fn emitted_tokens_follow_the_target() {
    for (filtered, kind, temperatures) in [
        (false, DraftKind::Sampled, [1.0, 0.8, 1.0]),
        (false, DraftKind::Greedy, [1.0, 1.3, 1.0]),
        (true, DraftKind::Sampled, [1.2, 1.0, 1.0]),
        // A greedy target row 1: the second token is its argmax whenever it is emitted.
        (false, DraftKind::Sampled, [1.0, 0.0, 1.0]),
    ] {
        let p = pipeline(filtered);
        let mut case = Case::random(&p, K + 1, 16, V, 11, 1.2);
        if filtered {
            case = case.with_filter(RowFilter::top_k(3));
        }
        let (first, second, p0, p1) = emitted(case, &p, kind, temperatures);
        for (what, counts, probs) in [("first", &first, &p0), ("second", &second, &p1)] {
            let (stat, pv) = chi_square(counts, probs);
            assert!(pv > SIGNIFICANCE, "{kind:?} filtered {filtered} T {temperatures:?}: {what} token: chi-square {stat:.1}, p = {pv:.2e}\ncounts {counts:?}\nprobs {probs:?}");
        }
        assert!(second.iter().sum::<u64>() > TRIALS / 20, "few accepted first drafts: {second:?}");
    }
}

/// Power check: a verifier that skips the residual (redraws from the target instead) is
/// detected by the same statistic.
#[test]
fn the_check_detects_a_biased_emission() {
    let p = pipeline(false);
    let case = Case::random(&p, K + 1, 16, V, 11, 1.2);
    let (first, _, p0, _) = emitted(case, &p, DraftKind::Greedy, [1.0, 1.0, 1.0]);
    // Moving a tenth of the mass of the greedy draft token 3 elsewhere must be rejected.
    let mut biased = p0.clone();
    let moved = biased[3] * 0.1;
    biased[3] -= moved;
    biased[(0..V).find(|&v| v != 3).unwrap()] += moved;
    let (_, pv) = chi_square(&first, &biased);
    assert!(pv < SIGNIFICANCE, "a biased distribution passed: p = {pv:.2e}");
}

#[test]
fn invalid_drafts_are_typed_errors() {
    let p = pipeline(false);
    let case = Case::random(&p, 2 * (K + 1), 16, V, 3, 1.0);
    let params = case.params(&p);
    let problem = case.problem(&p, &params);
    let mut q = vec![1.0 / V as f32; 2 * K * V];
    q[(2 * K - 1) * V + 6] = 0.0;
    match problem.verify(K, DraftKind::Sampled, &[0, 1, 2, 6], Some(&q)) {
        Err(SpecReferenceError::Draft(SpecError::DraftProbability { sequence: 1, position: 1, .. })) => {}
        other => panic!("{other:?}"),
    }
    match problem.verify(K, DraftKind::Greedy, &[0, 1, 9, 2], None) {
        Err(SpecReferenceError::Draft(SpecError::TokenOutOfRange { sequence: 1, position: 0, token: 9, .. })) => {}
        other => panic!("{other:?}"),
    }
    // k = 0: no drafts, every sequence's next token is its row's ordinary sample.
    let one = case.problem(&p, &params);
    let out = one.verify(0, DraftKind::Greedy, &[], None).unwrap();
    let (samples, _) = one.sample_all().unwrap();
    assert_eq!(out.iter().map(|o| o.next).collect::<Vec<_>>(), samples.iter().map(|s| s.token).collect::<Vec<_>>());
    assert!(out.iter().all(|o| o.accepted == 0));
}
