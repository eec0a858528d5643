//! Batch invariance on the CPU (DESIGN.md "Batch invariance"): each request's token, score,
//! logprob, logsumexp and top logprobs are the same bits alone and in any batch, next to any
//! neighbours, with any vocabulary tile, row block and thread count, per engine.

use flashsample::{CpuConfig, CpuEngine, Device, KernelConfig, Sampler};
use flashsample_ir::{DType, LogprobMode, Outputs, Pipeline, PipelineBuilder};
use flashsample_tests::invariance::{compositions, Pool};
use flashsample_tests::Case;

const ALL: Outputs = Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 4 };

fn pipelines() -> Vec<Pipeline> {
    let b = |name| PipelineBuilder::new(name, DType::BF16, DType::BF16);
    vec![
        b("Plain").temperature_per_row("t").bias("bias").mask("allowed").gumbel("seed", 2).outputs(ALL).build().unwrap(),
        b("Serving")
            .logit_bias("logit_bias")
            .penalties("pen")
            .temperature_per_row("t")
            .mask("allowed")
            .filter("filter", 8)
            .gumbel("seed", 1)
            .outputs(ALL)
            .build()
            .unwrap(),
        b("Greedy").mask("allowed").softcap(20.0).argmax().outputs(ALL).build().unwrap(),
        b("Scorer").logit_bias("logit_bias").temperature_per_row("t").mask("allowed").argmax().target_logprob_and_rank("targets").outputs(ALL).build().unwrap(),
        // Raw logprobs (DESIGN.md step 10): the second, raw logsumexp, the raw lists and the
        // drawn tokens' raw logits beside the filter's lists.
        b("Raw")
            .bias("bias")
            .logit_bias("logit_bias")
            .penalties("pen")
            .temperature_per_row("t")
            .mask("allowed")
            .filter("filter", 8)
            .gumbel("seed", 2)
            .target_logprob("targets")
            .outputs(ALL)
            .logprob_mode(LogprobMode::Raw)
            .build()
            .unwrap(),
    ]
}

fn engines() -> Vec<CpuEngine> {
    CpuEngine::ALL.into_iter().filter(|e| e.missing_host_feature().is_none()).collect()
}

#[test]
fn requests_get_the_same_bits_in_any_batch_and_config() {
    for p in pipelines() {
        // 12 requests over 2 975 tokens (not a multiple of any tile), logits spread enough
        // that the logsumexp spans several windows.
        let pool = Pool::new(Case::random(&p, 12, 96, 2975, 17, 6.0));
        for engine in engines() {
            for threads in [1, 2] {
                let device = Device::cpu_with_threads(threads).unwrap();
                let sampler = Sampler::new(p.clone(), &device).unwrap();
                let base = CpuConfig { engine, threads, ..CpuConfig::heuristic_for_engine(engine, 1, 96, 2975) };
                let alone = pool.alone(&sampler, Some(&KernelConfig::Cpu(base.clone()))).unwrap();
                for (vocab_tile, row_block) in [(base.vocab_tile, base.row_block), (64, 1), (260, 3), (1024, 8), (4096, 4)] {
                    let config = KernelConfig::Cpu(CpuConfig { vocab_tile, row_block, ..base.clone() });
                    let what = format!("{} {engine:?} threads {threads} tile {vocab_tile} block {row_block}", p.name);
                    pool.check(&sampler, &alone, &compositions(12), Some(&config), &what).unwrap_or_else(|e| panic!("{e}"));
                }
            }
        }
        // The sampler's own choice per batch (heuristic engine and tiles) against itself alone.
        let sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
        let alone = pool.alone(&sampler, None).unwrap();
        pool.check(&sampler, &alone, &compositions(12), None, &format!("{} heuristic", p.name)).unwrap_or_else(|e| panic!("{e}"));
    }
}

/// The comparison is not vacuous: another request's row, or another seed, changes the bits.
#[test]
fn the_check_sees_a_different_request() {
    let p = pipelines().remove(0);
    let pool = Pool::new(Case::random(&p, 4, 64, 999, 3, 4.0));
    let sampler = Sampler::new(p, &Device::cpu()).unwrap();
    let alone = pool.alone(&sampler, None).unwrap();
    let swapped = vec![alone[1].clone(), alone[0].clone(), alone[2].clone(), alone[3].clone()];
    assert!(pool.check(&sampler, &swapped, &[vec![0, 1, 2, 3]], None, "swapped").is_err());
    assert_ne!(alone[0].logsumexp, alone[1].logsumexp);
}
