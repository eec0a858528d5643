//! Scoring given tokens (`target_logprob`) on the GPU: every row's target logprob against the
//! float64 reference on every schedule, from B = 1 to thousands of rows (prompt scoring), with
//! an excluded target scoring `-inf`.

use super::{fit_to_device, hopper_gpu};
use flashsample::{GpuConfig, Grid, GridKind, KernelConfig, Sampler, Schedule};
use flashsample_ir::{DType, Outputs, PipelineBuilder};
use flashsample_tests::Case;

#[test]
#[ignore = "needs a CUDA GPU"]
fn target_logprobs_match_the_reference_on_every_schedule() {
    let (device, dev) = hopper_gpu("the schedule sweep");
    let p = PipelineBuilder::new("Scorer", DType::BF16, DType::BF16)
        .logit_bias("logit_bias")
        .temperature_per_row("t")
        .mask("allowed")
        .argmax()
        .target_logprob("targets")
        .outputs(Outputs { score: false, logsumexp: true, logprob: false, top_logprobs: 5 })
        .build()
        .unwrap();
    let sampler = Sampler::new(p.clone(), &device).unwrap();
    // 3000 rows at V = 151936 pass the plan's chunk (1280 rows of scratch): three chunks.
    for (batch, dim, vocab) in [(1, 512, 32_771), (64, 1024, 151_936), (2048, 256, 32_768), (3000, 256, 151_936)] {
        let case = Case::random(&p, batch, dim, vocab, 77, 5.0);
        let rows: Vec<usize> = (0..batch).step_by((batch / 64).max(1)).collect();
        let got = case.run(&sampler).unwrap();
        assert!(got.target_logprobs.as_ref().unwrap().contains(&f32::NEG_INFINITY) || batch < 64);
        case.check(&p, &got, &rows).unwrap_or_else(|e| panic!("heuristic B={batch}: {e}"));
        let item = Grid::PerItem;
        for (vt, bt, warps, schedule) in [
            (128, 64, 4, Schedule::MmaSync { stages: 3, k_step: 64, grid: item }),
            (256, 64, 8, Schedule::Wgmma { stages: 4, drain: false, grid: item }),
            (256, 64, 8, Schedule::WgmmaTma { stages: 5, grid: GridKind::PerItem }),
            (128, 64, 4, Schedule::WgmmaTma { stages: 8, grid: GridKind::PingPong }),
        ] {
            let mut c = GpuConfig::new(vt, bt, warps, schedule);
            let Some(what) = fit_to_device(&mut c, &p, &dev, 3, format!("B={batch} D={dim} V={vocab}")) else { continue };
            let got = case.run_with(&sampler, &KernelConfig::Cuda(c)).unwrap();
            case.check(&p, &got, &rows).unwrap_or_else(|e| panic!("{what}: {e}"));
        }
    }
}

/// DESIGN.md step 7c on the GPU: every row's target rank within the float64 reference's range
/// in both logprob modes, on the heuristic's tile and on every schedule (the targets kernel's
/// thresholds have each schedule's bits), through many row chunks; the device API writes the same ranks
/// and logprobs as the host API; tied tokens share the larger rank and an excluded target ranks V.
#[test]
#[ignore = "needs a CUDA GPU"]
fn target_ranks_match_the_reference_on_every_schedule_and_both_apis() {
    use flashsample_ir::LogprobMode;
    use flashsample_tests::gpu::{DeviceCase, DeviceResults};
    let (device, dev) = hopper_gpu("the schedule sweep");
    for mode in [LogprobMode::Processed, LogprobMode::Raw] {
        let p = PipelineBuilder::new("Ranker", DType::BF16, DType::BF16)
            .logit_bias("logit_bias")
            .penalties("pen")
            .temperature_per_row("t")
            .mask("allowed")
            .argmax()
            .target_logprob_and_rank("targets")
            .outputs(Outputs { score: false, logsumexp: true, logprob: false, top_logprobs: 3 })
            .logprob_mode(mode)
            .build()
            .unwrap();
        let sampler = Sampler::new(p.clone(), &device).unwrap();
        for (batch, dim, vocab) in [(1, 512, 32_771), (64, 1024, 151_936), (3000, 256, 151_936)] {
            let mut case = Case::random(&p, batch, dim, vocab, 79, 5.0);
            let greedy = case.run(&sampler).unwrap().tokens;
            for r in (0..batch).step_by(5) {
                case.targets[r] = greedy[r];
            }
            let rows: Vec<usize> = (0..batch).step_by((batch / 64).max(1)).collect();
            let got = case.run(&sampler).unwrap();
            case.check(&p, &got, &rows).unwrap_or_else(|e| panic!("{mode:?} heuristic B={batch}: {e}"));
            if batch <= 64 {
                // The device API: the same ranks and logprobs as the host API.
                let cuda = sampler.cuda().expect("a CUDA sampler");
                let plan = cuda.plan(batch, dim, vocab).expect("plan");
                let params = case.params(&p);
                let inputs = DeviceCase::upload(cuda.device(), &p, &case, &params);
                let mut outputs = DeviceResults::alloc(cuda.device(), &p, batch);
                let stream = cuda.device().context().new_stream().expect("a caller stream");
                plan.launch(&stream, inputs.inputs(&stream), outputs.outputs(&stream)).expect("device launch");
                let d = outputs.read(&stream);
                assert_eq!(d.target_ranks.as_ref(), got.target_ranks.as_ref(), "{mode:?} B={batch}: device API ranks");
                assert_eq!(d.target_logprobs.as_ref(), got.target_logprobs.as_ref(), "{mode:?} B={batch}: device API logprobs");
            }
            if batch > 64 {
                continue;
            }
            let item = Grid::PerItem;
            for (vt, bt, warps, schedule) in [
                (128, 8, 4, Schedule::Simt { grid: item }),
                (128, 64, 4, Schedule::MmaSync { stages: 3, k_step: 64, grid: Grid::Persistent }),
                (256, 64, 8, Schedule::Wgmma { stages: 4, drain: false, grid: item }),
                (256, 64, 8, Schedule::WgmmaTma { stages: 5, grid: GridKind::PerItem }),
                (128, 64, 4, Schedule::WgmmaTma { stages: 8, grid: GridKind::PingPong }),
            ] {
                let mut c = GpuConfig::new(vt, bt, warps, schedule);
                let Some(what) = fit_to_device(&mut c, &p, &dev, 3, format!("{mode:?} B={batch} D={dim} V={vocab}")) else { continue };
                let sched = case.run_with(&sampler, &KernelConfig::Cuda(c)).unwrap();
                case.check(&p, &sched, &rows).unwrap_or_else(|e| panic!("{what}: {e}"));
            }
        }
    }
    // Ten tied top tokens and a masked target, on the heuristic's tile.
    let p = PipelineBuilder::new("Ties", DType::BF16, DType::BF16).mask("allowed").argmax().target_logprob_and_rank("targets").build().unwrap();
    let sampler = Sampler::new(p.clone(), &device).unwrap();
    let (dim, vocab) = (256, 32_768);
    let mut case = Case::random(&p, 2, dim, vocab, 7, 1.0);
    let mut w = case.weights.exact.clone();
    let top: Vec<f32> = case.hidden.exact[..dim].iter().map(|h| h.signum()).collect();
    for v in 1000..1010 {
        w[v * dim..][..dim].copy_from_slice(&top);
    }
    case.weights = flashsample_tests::MatrixData::from_f32(DType::BF16, vocab, dim, &w);
    let words = vocab.div_ceil(32);
    case.mask = vec![u32::MAX; 2 * words];
    case.mask[words + 20_000 / 32] &= !(1 << (20_000 % 32));
    case.targets = vec![1005, 20_000];
    let got = case.run(&sampler).unwrap();
    assert_eq!(got.target_ranks.as_deref(), Some(&[10, vocab as u32][..]));
}

/// The ranks on one small launch per logprob mode and schedule kind (SIMT, mma.sync, wgmma),
/// sized for compute-sanitizer (the sweep above outlasts memcheck's slowdown): ranks and
/// logprobs within the float64 reference's range, an odd vocabulary (a partial last tile), 5
/// rows (a partial group of 8 in `flashsample_target_logits`); and the target logprobs bit for
/// bit those of the same pipeline without ranks, whose stage one stores the targets' logits
/// itself (step 7b), so the targets kernel's logits are the tiles'.
#[test]
#[ignore = "needs a CUDA GPU"]
fn target_ranks_of_a_small_launch() {
    use flashsample_ir::LogprobMode;
    let (device, dev) = hopper_gpu("the wgmma tile");
    for mode in [LogprobMode::Processed, LogprobMode::Raw] {
        let scorer = |name: &str, rank: bool| {
            let b = PipelineBuilder::new(name, DType::BF16, DType::BF16).temperature_per_row("t").argmax();
            let b = if rank { b.target_logprob_and_rank("targets") } else { b.target_logprob("targets") };
            b.outputs(Outputs { score: false, logsumexp: true, logprob: false, top_logprobs: 0 }).logprob_mode(mode).build().unwrap()
        };
        let p = scorer("SmallRanker", true);
        let sampler = Sampler::new(p.clone(), &device).unwrap();
        let scorer = Sampler::new(scorer("SmallScorer", false), &device).unwrap();
        let (batch, dim, vocab) = (5, 256, 4099);
        let case = Case::random(&p, batch, dim, vocab, 83, 4.0);
        let rows: Vec<usize> = (0..batch).collect();
        let got = case.run(&sampler).unwrap();
        case.check(&p, &got, &rows).unwrap_or_else(|e| panic!("{mode:?} heuristic: {e}"));
        let bits = |v: &Option<Vec<f32>>| v.as_ref().map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        let same_logprobs = |ranked: &Option<Vec<f32>>, config: Option<&GpuConfig>, what: &str| {
            let plain = match config {
                None => case.run(&scorer),
                Some(c) => case.run_with(&scorer, &KernelConfig::Cuda(c.clone())),
            }
            .unwrap();
            assert!(ranked.is_some(), "{what}: target logprobs");
            assert_eq!(bits(ranked), bits(&plain.target_logprobs), "{what}: the ranking launch's target logprobs are the scorer's");
        };
        same_logprobs(&got.target_logprobs, None, &format!("{mode:?} heuristic"));
        let item = Grid::PerItem;
        for (vt, bt, warps, schedule) in [
            (128, 8, 4, Schedule::Simt { grid: item }),
            (128, 8, 4, Schedule::MmaSync { stages: 3, k_step: 64, grid: item }),
            (256, 64, 8, Schedule::Wgmma { stages: 4, drain: false, grid: item }),
        ] {
            let mut c = GpuConfig::new(vt, bt, warps, schedule);
            let Some(what) = fit_to_device(&mut c, &p, &dev, 3, format!("{mode:?} small")) else { continue };
            let sched = case.run_with(&sampler, &KernelConfig::Cuda(c.clone())).unwrap();
            case.check(&p, &sched, &rows).unwrap_or_else(|e| panic!("{what}: {e}"));
            same_logprobs(&sched.target_logprobs, Some(&c), &what);
        }
    }
}
