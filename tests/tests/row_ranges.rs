//! Row ranges (`SamplingParams::row_offset`): a sampling launch of many rows runs on the CPU
//! in row chunks of bounded scratch, and every row draws the noise it draws in one launch, so
//! its token and outputs are the bits of a launch of its own range with that offset — and
//! the float64 reference's.

use flashsample::{CpuConfig, Device, KernelConfig, Sampler, SamplingParams};
use flashsample_ir::{DType, Outputs, Pipeline, PipelineBuilder};
use flashsample_tests::Case;

/// Gumbel sampling through a top-k/top-p/min-p filter with large lists (so a row's scratch is
/// large and the CPU's chunks hold a few hundred rows) and logprob outputs; no row seeds, so
/// every row draws by its launch row.
fn sampler_pipeline() -> Pipeline {
    PipelineBuilder::new("Ranges", DType::BF16, DType::BF16)
        .temperature_per_row("t")
        .mask("allowed")
        .filter("filter", 256)
        .gumbel("seed", 1)
        .outputs(Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 3 })
        .build()
        .unwrap()
}

#[test]
fn a_chunked_sampling_launch_gives_each_row_the_bits_of_its_own_range() {
    let p = sampler_pipeline();
    let sampler = Sampler::new(p.clone(), &Device::cpu()).unwrap();
    let (batch, vocab) = (1000, 20_011);
    let case = Case::random(&p, batch, 32, vocab, 21, 3.0);
    // 64-token tiles: ~313 tiles of 64-entry lists per row, so a 64 MiB chunk holds a few
    // hundred rows and the 1000 rows are several launches (runtime `cpu.rs` `chunk_rows`).
    let small_tiles = |b| match sampler.config_for(b, 32, vocab) {
        KernelConfig::Cpu(c) => KernelConfig::Cpu(CpuConfig { vocab_tile: 64, ..c }),
        other => other,
    };
    let all = case.run_with(&sampler, &small_tiles(batch)).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for rows in [0..30, 377..407, 970..1000] {
        let first = rows.start;
        let rows: Vec<usize> = rows.collect();
        let part = case.rows(&rows);
        let params = SamplingParams { row_offset: first as u32, ..part.params(&p) };
        let alone = sampler.sample_with(part.hidden.tensor(), case.weights.tensor(), &params, &small_tiles(rows.len())).unwrap();
        for (i, &r) in rows.iter().enumerate() {
            assert_eq!((all.tokens[r], &all.row_errors[r]), (alone.tokens[i], &alone.row_errors[i]), "row {r}");
            for (what, a, b) in [("score", &all.scores, &alone.scores), ("logprob", &all.logprobs, &alone.logprobs), ("logsumexp", &all.logsumexp, &alone.logsumexp)] {
                assert_eq!(bits(&a.as_ref().unwrap()[r..=r]), bits(&b.as_ref().unwrap()[i..=i]), "row {r} {what}");
            }
            assert_eq!(all.top_logprobs.as_ref().unwrap()[r], alone.top_logprobs.as_ref().unwrap()[i], "row {r} top logprobs");
        }
        // Without the offset the range draws other noise: the test can tell.
        let renumbered = sampler.sample_with(part.hidden.tensor(), case.weights.tensor(), &part.params(&p), &small_tiles(rows.len())).unwrap();
        if first > 0 {
            assert_ne!(renumbered.tokens, alone.tokens, "rows {first}..: the offset must matter");
        }
    }
    case.check(&p, &all, &[0, 401, 999]).unwrap();
}
