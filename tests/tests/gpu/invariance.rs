//! Batch invariance on the GPU (DESIGN.md "Batch invariance"): every request's token, score,
//! logprob, logsumexp and top logprobs are the same bits as when it is sampled alone, for the
//! config the heuristic (or the shipped tuning file) picks at every B from 1 to 512 and for
//! each schedule, with and without filters, penalties and masks, in both logprob modes.

use super::{fit_to_device, hopper_gpu};
use flashsample::{GpuConfig, Grid, GridKind, KernelConfig, Sampler, Schedule};
use flashsample_ir::{DType, LogprobMode, Outputs, Pipeline, PipelineBuilder};
use flashsample_tests::invariance::Pool;
use flashsample_tests::modes::serving;
use flashsample_tests::Case;

const ALL: Outputs = Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 4 };

fn pipelines() -> Vec<Pipeline> {
    let b = |name| PipelineBuilder::new(name, DType::BF16, DType::BF16);
    vec![
        b("Plain").temperature_per_row("t").bias("bias").mask("allowed").gumbel("seed", 2).outputs(ALL).build().unwrap(),
        b("Scorer").logit_bias("logit_bias").temperature_per_row("t").mask("allowed").argmax().target_logprob("targets").outputs(ALL).build().unwrap(),
        b("Serving").logit_bias("logit_bias").penalties("pen").temperature_per_row("t").mask("allowed").filter("filter", 8).gumbel("seed", 1).outputs(ALL).build().unwrap(),
        // DESIGN.md step 10: raw partials, raw lists and the raw logits beside the lists.
        serving(LogprobMode::Raw),
    ]
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn requests_get_the_same_bits_at_every_batch_and_schedule() {
    let (device, dev) = hopper_gpu("the schedule sweep");
    let (dim, vocab) = (256, 32_771);
    for p in pipelines() {
        let pool = Pool::new(Case::random(&p, 512, dim, vocab, 29, 6.0));
        let sampler = Sampler::new(p.clone(), &device).unwrap();
        let alone = pool.alone(&sampler, None).unwrap();
        // The sampler's own config (tuning file, else heuristic) at every batch size.
        for b in [2, 7, 8, 33, 64, 100, 128, 192, 256, 384, 512] {
            let ids: Vec<usize> = (0..b).map(|i| (i * 37 + 11) % 512).collect();
            pool.check(&sampler, &alone, &[ids], None, &format!("{} B={b}", p.name)).unwrap_or_else(|e| panic!("{e}"));
        }
        // Each schedule at B = 64 and 256, against the same B = 1 launches.
        let item = Grid::PerItem;
        for (vt, bt, warps, schedule) in [
            (128, 64, 4, Schedule::MmaSync { stages: 3, k_step: 64, grid: item }),
            (128, 64, 4, Schedule::MmaSync { stages: 3, k_step: 64, grid: Grid::Persistent }),
            // A 128-element k slice (the small-batch sweep's best at B <= 8).
            (256, 8, 8, Schedule::MmaSync { stages: 3, k_step: 128, grid: item }),
            (256, 64, 8, Schedule::Wgmma { stages: 4, drain: false, grid: item }),
            (128, 64, 4, Schedule::Wgmma { stages: 4, drain: true, grid: item }),
            (256, 64, 8, Schedule::WgmmaTma { stages: 5, grid: GridKind::PerItem }),
            // The heuristic's tile for lists from B = 192.
            (256, 128, 8, Schedule::WgmmaTma { stages: 4, grid: GridKind::PerItem }),
            (128, 64, 4, Schedule::WgmmaTma { stages: 8, grid: GridKind::PingPong }),
            (128, 128, 4, Schedule::WgmmaTma { stages: 6, grid: GridKind::PingPong }),
            (256, 128, 8, Schedule::WgmmaTma { stages: 4, grid: GridKind::Cooperative }),
            (256, 128, 8, Schedule::WgmmaTma { stages: 4, grid: GridKind::CooperativePair }),
        ] {
            let mut c = GpuConfig::new(vt, bt, warps, schedule);
            let Some(what) = fit_to_device(&mut c, &p, &dev, 3, format!("D={dim} V={vocab}")) else { continue };
            for b in [64, 256] {
                let ids: Vec<usize> = (0..b).map(|i| (i * 101 + 5) % 512).collect();
                pool.check(&sampler, &alone, &[ids], Some(&KernelConfig::Cuda(c.clone())), &format!("{what} B={b}")).unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }
}
