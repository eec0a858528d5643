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
