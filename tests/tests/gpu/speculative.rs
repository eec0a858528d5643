//! Speculative verification on the GPU (`Sampler::verify` on CUDA, DESIGN.md "Speculative
//! verification"): stage one's residual lists and draft logits, read back and decided on the
//! host, pathwise the float64 reference and the CPU backend (greedy and sampled drafts, with
//! and without a filter, k = 0, 1, 3, 7), the recompute of rows whose residual bound fails,
//! and the device API's typed refusal.

use super::gpu;
use flashsample::{Device, Error, Sampler};
use flashsample_abi::speculative::DraftKind;
use flashsample_tests::spec::{VERIFIERS, close_drafts, compare, most_likely_every_other, random_drafts, verifier};
use flashsample_tests::Case;
use rand::{rngs::StdRng, SeedableRng};

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_verification_is_pathwise_the_reference_and_the_cpu() {
    let (device, _) = gpu();
    let mut rejected_from_lists = 0;
    for (kind, filtered, penalties) in VERIFIERS {
        let p = verifier(kind, filtered, penalties);
        let gpu_sampler = Sampler::new(p.clone(), &device).unwrap();
        let cpu_sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
        for (k, seqs, vocab, dim, seed) in [(3, 12, 5003, 64, 1), (1, 20, 1201, 32, 2), (0, 6, 300, 32, 3), (7, 4, 32_000, 128, 4), (3, 16, 151_936, 64, 5)] {
            let case = Case::random(&p, seqs * (k + 1), dim, vocab, seed, 4.0);
            let mut rng = StdRng::seed_from_u64(seed + 100);
            let (mut drafts, q) = random_drafts(&mut rng, seqs * k, vocab);
            if kind == DraftKind::Greedy {
                most_likely_every_other(&p, &case, k, &mut drafts, &q);
            }
            let q = (kind == DraftKind::Sampled).then_some(&q[..]);
            let on_gpu = compare(&gpu_sampler, &p, &case, k, &drafts, q);
            let on_cpu = compare(&cpu_sampler, &p, &case, k, &drafts, q);
            assert_eq!((&on_gpu.accepted, &on_gpu.tokens), (&on_cpu.accepted, &on_cpu.tokens), "{kind:?} filtered {filtered} k {k} V {vocab}");
            let (lg, lc) = (on_gpu.logprobs.as_ref().unwrap(), on_cpu.logprobs.as_ref().unwrap());
            for (g, c) in lg.iter().zip(lc) {
                assert!((g.is_nan() && c.is_nan()) || (g - c).abs() <= 1e-3 * (1.0 + c.abs()), "logprob {g} on the GPU, {c} on the CPU");
            }
            rejected_from_lists += (0..on_gpu.sequences()).filter(|&i| on_gpu.accepted[i] < k).count().saturating_sub(on_gpu.recomputed_rows);
        }
    }
    assert!(rejected_from_lists > 0, "no rejection was served from the GPU's residual lists");
}

/// Drafts close to the target: the residual bound fails and the GPU recomputes those rows
/// (stage one of the row alone with whole-tile residual lists), still pathwise the reference.
/// `ε = 1e-4`: with the CPU test's 3 % the GPU's 157 tiles of 128 held the bound for all 16
/// rejections (H200, 2026-12-05), since the largest of many tiles' eighth scores sits lower
/// than `ln 0.03` below the row's best listed score.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_failed_residual_bound_recomputes_the_row_on_the_gpu() {
    let (device, _) = gpu();
    let p = verifier(DraftKind::Sampled, false, false);
    let (k, seqs, vocab) = (2, 16, 20_011);
    let case = Case::random(&p, seqs * (k + 1), 64, vocab, 9, 0.5);
    let (drafts, q) = close_drafts(&p, &case, k, 1e-4, &mut StdRng::seed_from_u64(10));
    let got = compare(&Sampler::new(p.clone(), &device).unwrap(), &p, &case, k, &drafts, Some(&q));
    assert!(got.recomputed_rows > 0, "no row was recomputed: {got:?}");
}

/// The device API has no decision kernel yet: a verifying pipeline's plan is a typed refusal,
/// never a plan that would sample draft rows.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_device_api_refuses_verifying_pipelines() {
    let (device, _) = gpu();
    let p = verifier(DraftKind::Greedy, false, false);
    let sampler = Sampler::new(p.clone(), &device).unwrap();
    assert!(matches!(sampler.cuda().unwrap().plan(8, 64, 1000), Err(Error::Unsupported(_))));
    // A verifying pipeline does not sample on CUDA either.
    let case = Case::random(&p, 4, 64, 1000, 1, 1.0);
    assert!(matches!(sampler.sample(case.hidden.tensor(), case.weights.tensor(), &case.params(&p)), Err(Error::Unsupported(_))));
}
