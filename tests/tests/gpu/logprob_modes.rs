//! Raw logprobs on the GPU (DESIGN.md step 10): `logprob`, `logsumexp`, `top_logprobs` and
//! `target_logprob` of raw-mode pipelines against the float64 reference's raw distribution on
//! the heuristic config and every schedule (the sample itself still follows the processed
//! distribution pathwise); the raw row logsumexp is the abi's merge of the raw partials, bit
//! for bit; nuclei larger than the lists report their drawn token's raw logit.

use super::{fit_to_device, hopper_gpu};
use flashsample::{GpuConfig, Grid, GridKind, KernelConfig, RowFilter, Sampler, Schedule};
use flashsample_ir::LogprobMode;
use flashsample_tests::modes::{assert_modes_differ_only_in_logprobs, raw_variants, serving};
use flashsample_tests::Case;

/// One config of each schedule (lists fitted per pipeline by `fit_to_device`).
fn schedules() -> Vec<GpuConfig> {
    let item = Grid::PerItem;
    [
        (128, 16, 4, Schedule::MmaSync { stages: 3, k_step: 64, grid: item }),
        (128, 64, 4, Schedule::MmaSync { stages: 4, k_step: 64, grid: Grid::Persistent }),
        (256, 64, 8, Schedule::Wgmma { stages: 4, drain: false, grid: item }),
        (256, 64, 8, Schedule::WgmmaTma { stages: 5, grid: GridKind::PerItem }),
        (128, 64, 4, Schedule::WgmmaTma { stages: 8, grid: GridKind::PingPong }),
        (256, 128, 8, Schedule::WgmmaTma { stages: 4, grid: GridKind::Cooperative }),
        (256, 128, 8, Schedule::WgmmaTma { stages: 4, grid: GridKind::CooperativePair }),
    ]
    .into_iter()
    .map(|(vt, bt, warps, s)| GpuConfig::new(vt, bt, warps, s))
    .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn raw_logprobs_match_the_reference_on_every_schedule() {
    let (device, dev) = hopper_gpu("the schedule sweep");
    for p in std::iter::once(serving(LogprobMode::Raw)).chain(raw_variants()) {
        let sampler = Sampler::new(p.clone(), &device).unwrap();
        for (batch, dim, vocab, seed) in [(1, 256, 32_771, 3), (40, 512, 50_016, 7)] {
            let case = Case::random(&p, batch, dim, vocab, seed, 5.0);
            let rows: Vec<usize> = (0..batch).collect();
            let got = case.run(&sampler).unwrap();
            case.check(&p, &got, &rows).unwrap_or_else(|e| panic!("{} heuristic B={batch} V={vocab}: {e}", p.name));
            for mut c in schedules() {
                let Some(what) = fit_to_device(&mut c, &p, &dev, 3, format!("B={batch} D={dim} V={vocab}")) else { continue };
                let got = case.run_with(&sampler, &KernelConfig::Cuda(c)).unwrap_or_else(|e| panic!("{what}: {e}"));
                case.check(&p, &got, &rows).unwrap_or_else(|e| panic!("{what}: {e}"));
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn raw_and_processed_logprobs_differ_and_the_samples_do_not() {
    let (device, _) = hopper_gpu("wgmma heuristic configs");
    let (raw, processed) = (serving(LogprobMode::Raw), serving(LogprobMode::Processed));
    let case = Case::random(&raw, 64, 256, 32_768, 11, 5.0);
    let got_raw = case.run(&Sampler::new(raw.clone(), &device).unwrap()).unwrap();
    let got_processed = case.run(&Sampler::new(processed.clone(), &device).unwrap()).unwrap();
    assert_modes_differ_only_in_logprobs(&case, &got_raw, &got_processed);
    case.check(&raw, &got_raw, &(0..case.batch).collect::<Vec<_>>()).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn raw_logsumexp_is_the_abi_merge_of_the_raw_partials() {
    // Every (row, tile) raw partial is written (poisoned first) and stage two's raw row
    // logsumexp is `abi::LseSum::logsumexp` of them, the bits the CPU's stage two computes
    // from the same partials.
    let (device, dev) = hopper_gpu("the schedule sweep");
    for p in std::iter::once(serving(LogprobMode::Raw)).chain(raw_variants()) {
        let sampler = Sampler::new(p.clone(), &device).unwrap();
        let case = Case::random(&p, 33, 256, 32_771, 5, 6.0);
        let params = case.params(&p);
        let mut configs: Vec<Option<KernelConfig>> = vec![None];
        for mut c in schedules() {
            if fit_to_device(&mut c, &p, &dev, 3, "B=33".into()).is_some() {
                configs.push(Some(KernelConfig::Cuda(c)));
            }
        }
        for config in &configs {
            let what = format!("{} {config:?}", p.name);
            let (layout, parts, lse) = sampler
                .cuda()
                .expect("a CUDA sampler")
                .debug_raw_partials(case.hidden.tensor(), case.weights.tensor(), &params, config.as_ref())
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(parts.len(), case.batch * layout.tiles);
            for (i, l) in parts.iter().enumerate() {
                let written = l.pad == 0 && l.window <= flashsample_abi::lse::WINDOW_LIMIT;
                assert!(written, "{what}: raw partial {i} never written: {l:?}");
            }
            for (r, g) in lse.iter().enumerate() {
                let h = layout.logsumexp(&parts, r);
                assert_eq!(h.to_bits(), g.to_bits(), "{what}: row {r} raw logsumexp host {h} gpu {g}");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn raw_logprobs_of_nuclei_served_exactly() {
    // Flat logits and top-p 0.99: every row's nucleus outgrows the 8-entry lists, so each is
    // recomputed with whole-tile lists (host API) and its drawn token reads its raw logit
    // beside them; T = 0.5 makes that differ from the processed logit.
    let (device, _) = hopper_gpu("wgmma heuristic configs");
    let p = serving(LogprobMode::Raw);
    let sampler = Sampler::new(p.clone(), &device).unwrap();
    let mut case = Case::random(&p, 6, 128, 4_000, 13, 0.5).with_filter(RowFilter::top_p(0.99));
    case.temperatures.iter_mut().for_each(|t| *t = 0.5);
    for row in 0..case.batch {
        assert!(case.kept_by_filter(&p, row) > 8, "row {row}'s nucleus fits the lists");
    }
    let got = case.run(&sampler).unwrap();
    case.check(&p, &got, &(0..case.batch).collect::<Vec<_>>()).unwrap();
}
