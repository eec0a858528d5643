//! The raw logprob mode's test pipelines (DESIGN.md step 10), shared by the CPU and GPU tests.

use crate::Case;
use flashsample::Samples;
use flashsample_ir::{DType, LogprobMode, Outputs, Pipeline, PipelineBuilder};

/// Every output, five top logprobs.
pub const ALL: Outputs = Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 5 };

/// A serving pipeline whose every request transform changes the processed logits, in `mode`.
pub fn serving(mode: LogprobMode) -> Pipeline {
    PipelineBuilder::new("RawServing", DType::BF16, DType::BF16)
        .softcap(30.0)
        .bias("bias")
        .logit_bias("logit_bias")
        .penalties("pen")
        .temperature_per_row("t")
        .mask("allowed")
        .ban("banned")
        .filter("filter", 8)
        .gumbel("seed", 2)
        .target_logprob("targets")
        .outputs(ALL)
        .logprob_mode(mode)
        .build()
        .unwrap()
}

/// Raw pipelines of other shapes: no filter (top logprobs from the raw lists only), scoring
/// alone, and a filter with no `logprob` output (no raw logits beside the lists).
pub fn raw_variants() -> Vec<Pipeline> {
    let b = |name| PipelineBuilder::new(name, DType::BF16, DType::BF16).logprob_mode(LogprobMode::Raw);
    vec![
        b("RawTopOnly").bias("bias").temperature_per_row("t").mask("allowed").outputs(Outputs { top_logprobs: 3, ..Outputs::default() }),
        b("RawScorer").logit_bias("logit_bias").temperature_per_row("t").mask("allowed").argmax().target_logprob("targets"),
        b("RawFilterLse").penalties("pen").temperature_per_row("t").filter("filter", 8).outputs(Outputs { logsumexp: true, ..Outputs::default() }),
    ]
    .into_iter()
    .map(|p| p.build().unwrap())
    .collect()
}

/// `case` sampled by [`serving`] in both modes on one backend: the same tokens and scores
/// (sampling is processed in both), different logsumexp, logprobs and target logprobs, and raw
/// outputs that fail the processed check (so a raw check cannot pass by accident), while the
/// processed outputs pass it. Panics naming what differs.
pub fn assert_modes_differ_only_in_logprobs(case: &Case, got_raw: &Samples, got_processed: &Samples) {
    let processed = serving(LogprobMode::Processed);
    assert_eq!(got_raw.tokens, got_processed.tokens, "sampling is processed in both modes");
    assert_eq!(got_raw.scores, got_processed.scores);
    assert_ne!(got_raw.logsumexp, got_processed.logsumexp);
    assert_ne!(got_raw.logprobs, got_processed.logprobs);
    assert_ne!(got_raw.target_logprobs, got_processed.target_logprobs);
    let rows: Vec<usize> = (0..case.batch).collect();
    assert!(case.check(&processed, got_raw, &rows).is_err(), "raw outputs must not pass as processed ones");
    case.check(&processed, got_processed, &rows).unwrap();
}
