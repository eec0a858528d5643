//! Speculative verification through the CPU backend (`Sampler::verify`, DESIGN.md
//! "Speculative verification"): pathwise equal to the float64 reference (`Problem::verify`)
//! under the shared Philox noise, greedy and sampled drafts, with and without filters and
//! penalties; the joint output follows the target by chi-square; edge cases; typed errors; and
//! the residual bound's failure path (a row recomputed over its vocabulary) stays exact.

use flashsample::{Device, Error, ParamError, RowFilter, Sampler, SamplingParams, Verified};
use flashsample_abi::speculative::{DraftKind, SpecError};
use flashsample_ir::{DType, Pipeline, PipelineBuilder};
use flashsample_tests::spec::{VERIFIERS, self, close_drafts, draw, placeholder, random_drafts, verifier};
use flashsample_tests::{chi_square, Case, MatrixData};
use rand::{rngs::StdRng, SeedableRng};

/// [`spec::compare`] through the CPU backend.
fn compare(p: &Pipeline, case: &Case, k: usize, drafts: &[u32], q: Option<&[f32]>) -> Verified {
    spec::compare(&Sampler::new(p.clone(), &Device::cpu()).unwrap(), p, case, k, drafts, q)
}

#[test]
fn cpu_verification_is_pathwise_the_reference() {
    let mut rejected_from_lists = 0;
    for (kind, filtered, penalties) in VERIFIERS {
        let p = verifier(kind, filtered, penalties);
        for (k, seqs, vocab, seed) in [(3, 12, 509, 1), (1, 20, 1201, 2), (0, 6, 300, 3), (7, 4, 777, 4), (2, 40, 8, 5)] {
            let case = Case::random(&p, seqs * (k + 1), 32, vocab, seed, 4.0);
            let (drafts, q) = spec::case_drafts(&p, &case, k, seed);
            let q = (kind == DraftKind::Sampled).then_some(&q[..]);
            let got = compare(&p, &case, k, &drafts, q);
            rejected_from_lists += (0..got.sequences()).filter(|&i| got.accepted[i] < k).count().saturating_sub(got.recomputed_rows);
        }
    }
    assert!(rejected_from_lists > 0, "no rejection was served from the residual lists");
}

/// [`spec::hot_tile_verification`] on the CPU (whose lists hold the capacity here): the
/// fixture the GPU's overflow test shares is pathwise the reference.
#[test]
fn a_verification_of_rows_crowding_one_tile_is_exact() {
    for kind in [DraftKind::Sampled, DraftKind::Greedy] {
        let (p, case, k) = spec::hot_tile_verification(kind);
        let (drafts, q) = spec::case_drafts(&p, &case, k, 7);
        compare(&p, &case, k, &drafts, (kind == DraftKind::Sampled).then_some(&q[..]));
    }
}

/// Drafts close to the target (`q = 0.97·p + 0.03·δ(d)`): the residual is 3 % of `p`
/// spread over the vocabulary, the listed scores rarely beat the tiles' bounds, and the rows
/// are recomputed over their vocabulary, still pathwise the reference.
#[test]
fn a_failed_residual_bound_recomputes_the_row_exactly() {
    let p = verifier(DraftKind::Sampled, false, false);
    let (k, seqs, vocab) = (2, 16, 2003);
    let case = Case::random(&p, seqs * (k + 1), 32, vocab, 9, 0.5);
    let (drafts, q) = close_drafts(&p, &case, k, 0.03, &mut StdRng::seed_from_u64(10));
    let got = compare(&p, &case, k, &drafts, Some(&q));
    assert!(got.recomputed_rows > 0, "no row was recomputed: {got:?}");
}

#[test]
fn edge_cases() {
    let p = verifier(DraftKind::Greedy, true, false);
    let sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
    let (k, vocab) = (3, 257);
    let mut case = Case::random(&p, 2 * (k + 1), 32, vocab, 21, 4.0);
    // Sequence 0: greedy target rows and their argmax as drafts: all accepted, then the bonus.
    // Sequence 1: a top-1 filter on its first row and a draft it removes: rejected first.
    for j in 0..=k {
        case.temperatures[j] = 0.0;
        case.temperatures[k + 1 + j] = 0.8;
        case.filters[j] = RowFilter::OFF;
        case.filters[k + 1 + j] = RowFilter::OFF;
    }
    case.filters[k + 1] = RowFilter::top_k(1);
    let zeros = [0; 6];
    let params = placeholder(&p, &case, &zeros, &[]);
    let problem = case.problem(&p, &params);
    let argmax = |r: usize| {
        let d = problem.target_distribution(r).unwrap();
        (0..vocab).find(|&v| d[v] == 1.0).unwrap() as u32
    };
    let (top0, top1) = (argmax(0), argmax(k + 1));
    let not_top = (top1 + 1) % vocab as u32;
    let drafts = [argmax(0), argmax(1), argmax(2), not_top, not_top, not_top];
    let got = compare(&p, &case, k, &drafts, None);
    assert_eq!(got.accepted, [k, 0]);
    assert_eq!(got.emitted(0)[..k], drafts[..k]);
    assert_eq!(got.emitted(1), [top1], "the correction of a rejected first draft is the top-1 token");
    let _ = top0;

    // k = 0: plain sampling, token for token.
    let plain = PipelineBuilder::new("Verifier", DType::BF16, DType::BF16).temperature_per_row("t").mask("allowed").filter("filter", 8).build().unwrap();
    let samples = case.run(&Sampler::new(plain, &Device::cpu()).unwrap()).unwrap();
    let none = sampler.verify(case.hidden.tensor(), case.weights.tensor(), &SamplingParams { drafts: Some(&[]), ..case.params(&p) }).unwrap();
    assert_eq!(none.k, 0);
    assert_eq!(none.tokens, samples.tokens);
    assert!(none.accepted.iter().all(|&a| a == 0));
}

#[test]
fn bad_drafts_are_typed_errors() {
    let p = verifier(DraftKind::Sampled, false, false);
    let sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
    let (k, vocab) = (2, 64);
    let case = Case::random(&p, 2 * (k + 1), 16, vocab, 5, 2.0);
    let run = |drafts: &[u32], q: Option<&[f32]>| {
        sampler.verify(case.hidden.tensor(), case.weights.tensor(), &SamplingParams { drafts: Some(drafts), draft_probs: q, ..case.params(&p) })
    };
    let q = vec![1.0 / vocab as f32; 2 * k * vocab];
    let mut zero = q.clone();
    zero[3 * vocab + 7] = 0.0;
    let mut nan = q.clone();
    nan[vocab + 1] = f32::NAN;
    match run(&[0, 1, 2, 7], Some(&zero)) {
        Err(Error::Param(ParamError::Draft(SpecError::DraftProbability { sequence: 1, position: 1, .. }))) => {}
        other => panic!("{other:?}"),
    }
    match run(&[0, 1, 2, 7], Some(&nan)) {
        Err(Error::Param(ParamError::Draft(SpecError::DraftProbability { sequence: 0, position: 1, .. }))) => {}
        other => panic!("{other:?}"),
    }
    match run(&[0, 64, 2, 7], Some(&q)) {
        Err(Error::Param(ParamError::Draft(SpecError::TokenOutOfRange { sequence: 0, position: 1, token: 64, .. }))) => {}
        other => panic!("{other:?}"),
    }
    match run(&[0, 1], Some(&q[..2 * vocab])) {
        Err(Error::Param(ParamError::Draft(SpecError::Sequences { rows: 6, drafts: 2 }))) => {}
        other => panic!("{other:?}"),
    }
    assert!(matches!(run(&[0, 1, 2, 7], None), Err(Error::Param(ParamError::Missing("draft_probs")))));
    assert!(matches!(run(&[0, 1, 2, 7], Some(&q[1..])), Err(Error::Param(ParamError::Draft(SpecError::Length { .. })))));
    // A verifying pipeline does not sample, and a plain one does not verify.
    assert!(matches!(sampler.sample(case.hidden.tensor(), case.weights.tensor(), &case.params(&p)), Err(Error::Unsupported(_))));
}

const SEQUENCES: usize = 20_000;
const SIGNIFICANCE: f64 = 1e-3;

/// Counts of the first emitted token and, after an accepted first draft, of the second, over
/// `SEQUENCES` sequences with the same target rows and their own seeds, in one launch.
fn emitted_counts(p: &Pipeline, filter: RowFilter, temperatures: [f32; 3]) -> ([Vec<u64>; 2], [Vec<f64>; 2]) {
    const K: usize = 2;
    const V: usize = 8;
    let mut base = Case::random(p, K + 1, 16, V, 11, 1.2).with_filter(filter);
    base.mask.iter_mut().for_each(|w| *w = u32::MAX);
    base.temperatures = temperatures.to_vec();
    let mut case = Case::random(p, SEQUENCES * (K + 1), 16, V, 11, 1.2).with_filter(filter);
    let rows: Vec<f32> = (0..SEQUENCES).flat_map(|_| base.hidden.exact.iter().copied()).collect();
    case.hidden = MatrixData::from_f32(p.hidden.dtype, case.batch, 16, &rows);
    case.weights = MatrixData::from_f32(p.weights.dtype, V, 16, &base.weights.exact);
    case.mask.iter_mut().for_each(|w| *w = u32::MAX);
    case.temperatures = (0..case.batch).map(|r| temperatures[r % (K + 1)]).collect();
    let seeds: Vec<u64> = (0..case.batch as u64).map(|r| r * 7919 + 1).collect();
    let mut rng = StdRng::seed_from_u64(5);
    let (_, q_one) = random_drafts(&mut rng, K, V);
    let kind = p.verify.as_ref().unwrap().kind();
    let sampled = kind == DraftKind::Sampled;
    let targets = {
        let params = placeholder(p, &base, &[0; K], &q_one);
        let problem = base.problem(p, &params);
        [problem.target_distribution(0).unwrap(), problem.target_distribution(1).unwrap()]
    };
    // Greedy drafts: each position's most likely target token, so many are accepted.
    let argmax = |d: &[f64]| (0..V).fold(0, |b, v| if d[v] > d[b] { v } else { b }) as u32;
    let greedy = [argmax(&targets[0]), argmax(&targets[1])];
    let q: Vec<f32> = (0..SEQUENCES).flat_map(|_| q_one.iter().copied()).collect();
    let drafts: Vec<u32> =
        (0..SEQUENCES * K).map(|n| if sampled { draw(&mut rng, &q_one[(n % K) * V..][..V]) } else { greedy[n % K] }).collect();
    let params = SamplingParams { drafts: Some(&drafts), draft_probs: sampled.then_some(&q[..]), row_seeds: Some(&seeds), ..case.params(p) };
    let got = Sampler::new(p.clone(), &Device::cpu()).unwrap().verify(case.hidden.tensor(), case.weights.tensor(), &params).unwrap();
    let mut counts = [vec![0u64; V], vec![0u64; V]];
    for i in 0..SEQUENCES {
        let e = got.emitted(i);
        counts[0][e[0] as usize] += 1;
        if got.accepted[i] >= 1 {
            counts[1][e[1] as usize] += 1;
        }
    }
    (counts, targets)
}

#[test]
fn emitted_tokens_follow_the_target_through_the_cpu_backend() {
    for (kind, filter, temperatures) in [
        (DraftKind::Sampled, RowFilter::OFF, [1.0, 0.8, 1.0]),
        (DraftKind::Greedy, RowFilter::OFF, [1.0, 1.3, 1.0]),
        (DraftKind::Sampled, RowFilter::top_k(3), [1.2, 1.0, 1.0]),
        (DraftKind::Greedy, RowFilter::top_p(0.8), [0.9, 1.1, 1.0]),
    ] {
        let p = verifier(kind, true, false);
        let (counts, probs) = emitted_counts(&p, filter, temperatures);
        for (what, c, pr) in [("first", &counts[0], &probs[0]), ("second", &counts[1], &probs[1])] {
            let (stat, pv) = chi_square(c, pr);
            assert!(pv > SIGNIFICANCE, "{kind:?} {filter:?}: {what} token: chi-square {stat:.1}, p = {pv:.2e}\ncounts {c:?}\nprobs {pr:?}");
        }
        assert!(counts[1].iter().sum::<u64>() > SEQUENCES as u64 / 20, "few accepted first drafts: {:?}", counts[1]);
    }
}
