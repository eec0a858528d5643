//! The epilogue's noise skips (DESIGN.md "Noise is drawn only where it can change a winner"),
//! with the cross-tile row bound: on peaked logits (the first skip drops Philox for nearly
//! every token) and flat ones (the second skip drops the Gumbel transform), every schedule
//! samples what the float64 reference samples, and two launches of one batch agree on every
//! output bit although the tiles publish their bounds in a different order each time.

use super::{fit_to_device, hopper_gpu, ALL_OUTPUTS};
use flashsample::{GpuConfig, Grid, GridKind, KernelConfig, NoiseSkip, Sampler, Schedule};
use flashsample_ir::{DType, PipelineBuilder};
use flashsample_tests::Case;

const SKIPS: [NoiseSkip; 3] = [NoiseSkip::Never, NoiseSkip::InTile, NoiseSkip::CrossTile];

#[test]
#[ignore = "needs a CUDA GPU"]
fn skipped_noise_changes_no_sample_on_peaked_or_flat_rows() {
    let (device, dev) = hopper_gpu("the schedule sweep");
    let p = PipelineBuilder::new("Skips", DType::BF16, DType::BF16)
        .temperature_per_row("t")
        .gumbel("seed", 2)
        .outputs(ALL_OUTPUTS)
        .build()
        .unwrap();
    let sampler = Sampler::new(p.clone(), &device).unwrap();
    let item = Grid::PerItem;
    let schedules = [
        GpuConfig::new(128, 16, 4, Schedule::MmaSync { stages: 3, k_step: 64, grid: item }),
        GpuConfig::new(128, 64, 4, Schedule::MmaSync { stages: 4, k_step: 64, grid: Grid::Persistent }),
        GpuConfig::new(256, 64, 8, Schedule::Wgmma { stages: 4, drain: false, grid: item }),
        GpuConfig::new(128, 64, 4, Schedule::WgmmaTma { stages: 6, grid: GridKind::PingPong }),
        GpuConfig::new(256, 128, 8, Schedule::WgmmaTma { stages: 4, grid: GridKind::Cooperative }),
        GpuConfig::new(256, 128, 8, Schedule::WgmmaTma { stages: 4, grid: GridKind::CooperativePair }),
    ];
    for (logit_std, what) in [(40.0, "peaked"), (0.3, "flat"), (4.0, "moderate")] {
        // 2600 rows at V = 151936 run in chunks (DESIGN.md "Chunks"): the rows of the later
        // chunks must draw the noise of their launch rows. The heuristic runs every batch
        // with the row bounds; each schedule takes every `NoiseSkip` over the four batches.
        let shapes = [(3, 256, 151_936), (96, 512, 128_256), (256, 256, 32_768), (2600, 128, 151_936)];
        for (bi, (batch, dim, vocab)) in shapes.into_iter().enumerate() {
            let case = Case::random(&p, batch, dim, vocab, 91, logit_std);
            let rows: Vec<usize> = (0..batch).step_by((batch / 32).max(1)).collect();
            let first = case.run(&sampler).unwrap();
            case.check(&p, &first, &rows).unwrap_or_else(|e| panic!("{what} heuristic B={batch}: {e}"));
            let again = case.run(&sampler).unwrap();
            assert_eq!(first.tokens, again.tokens, "{what} B={batch}: tokens differ between two launches");
            for (a, b) in [(&first.scores, &again.scores), (&first.logprobs, &again.logprobs), (&first.logsumexp, &again.logsumexp)] {
                let bits = |v: &Option<Vec<f32>>| v.as_ref().map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
                assert_eq!(bits(a), bits(b), "{what} B={batch}: an output differs between two launches");
            }
            for (ci, c) in schedules.iter().enumerate() {
                let mut c = c.clone().with_noise_skip(SKIPS[(ci + bi) % SKIPS.len()]);
                let Some(at) = fit_to_device(&mut c, &p, &dev, 3, format!("{what} B={batch} D={dim} V={vocab}")) else { continue };
                let got = case.run_with(&sampler, &KernelConfig::Cuda(c)).unwrap();
                case.check(&p, &got, &rows).unwrap_or_else(|e| panic!("{at}: {e}"));
                assert_eq!(got.tokens, first.tokens, "{at}: tokens differ from the heuristic's");
            }
        }
    }
}
