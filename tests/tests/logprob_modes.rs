//! Raw logprobs on the CPU (DESIGN.md step 10): `logprob`, `logsumexp`, `top_logprobs` and
//! `target_logprob` of a raw-mode pipeline against the float64 reference's raw distribution,
//! on both CPU engines, with the request's transforms (logit bias, penalties, temperature,
//! masks) and a filter in the pipeline so raw and processed differ; the sample itself still
//! follows the processed distribution pathwise.

use flashsample::{CpuConfig, CpuEngine, Device, Error, KernelConfig, Sampler};
use flashsample_ir::{DType, LogprobMode, Outputs, PipelineBuilder};
use flashsample_tests::modes::{assert_modes_differ_only_in_logprobs, raw_variants, serving};
use flashsample_tests::Case;

fn engines() -> Vec<CpuEngine> {
    CpuEngine::ALL.into_iter().filter(|e| e.missing_host_feature().is_none()).collect()
}

fn config(engine: CpuEngine, batch: usize, dim: usize, vocab: usize) -> KernelConfig {
    KernelConfig::Cpu(CpuConfig { threads: 2, ..CpuConfig::heuristic_for_engine(engine, batch, dim, vocab) })
}

#[test]
fn raw_logprobs_match_the_reference_on_every_engine() {
    let raw = serving(LogprobMode::Raw);
    for p in std::iter::once(raw).chain(raw_variants()) {
        let sampler = Sampler::new(p.clone(), &Device::cpu_with_threads(2).unwrap()).unwrap();
        for engine in engines() {
            for (batch, dim, vocab, seed) in [(1, 64, 1001, 3), (29, 96, 2999, 7)] {
                let case = Case::random(&p, batch, dim, vocab, seed, 5.0);
                let got = case.run_with(&sampler, &config(engine, batch, dim, vocab)).unwrap();
                case.check(&p, &got, &(0..batch).collect::<Vec<_>>())
                    .unwrap_or_else(|e| panic!("{} on {engine} B={batch} V={vocab}: {e}", p.name));
            }
        }
    }
}

#[test]
fn raw_and_processed_logprobs_differ_and_the_samples_do_not() {
    // The same case under both modes: the same tokens and scores (sampling is processed in
    // both), different logprobs; checking the raw outputs as processed ones fails, so the
    // raw check above cannot pass by accident.
    let (raw, processed) = (serving(LogprobMode::Raw), serving(LogprobMode::Processed));
    let case = Case::random(&raw, 16, 64, 1500, 11, 5.0);
    let device = Device::cpu_with_threads(2).unwrap();
    let got_raw = case.run(&Sampler::new(raw.clone(), &device).unwrap()).unwrap();
    let got_processed = case.run(&Sampler::new(processed.clone(), &device).unwrap()).unwrap();
    assert_modes_differ_only_in_logprobs(&case, &got_raw, &got_processed);
    // Masked and banned tokens keep their raw mass: a raw top list names masked tokens.
    let words = case.vocab.div_ceil(32);
    let masked = |row: usize, v: u32| case.mask[row * words + v as usize / 32] >> (v % 32) & 1 == 0 || case.banned[row].contains(&v);
    let top = got_raw.top_logprobs.as_ref().unwrap();
    assert!((0..case.batch).any(|r| top[r].iter().any(|&(v, _)| masked(r, v))), "no raw top token is masked: {top:?}");
}

#[test]
fn raw_pipelines_are_refused_where_not_served() {
    let p = PipelineBuilder::new("S", DType::BF16, DType::BF16)
        .outputs(Outputs { logsumexp: true, ..Outputs::default() })
        .logprob_mode(LogprobMode::Raw)
        .build()
        .unwrap();
    let sharded = flashsample::ShardedSampler::new(p.clone(), &Device::cpu());
    assert!(matches!(sharded, Err(Error::Unsupported(m)) if m.contains("raw")));
    assert!(matches!(flashsample::tp::shard_pipeline(&p), Err(flashsample::tp::TpError::Unsupported(m)) if m.contains("raw")));
}

#[test]
fn raw_logprobs_of_nuclei_served_exactly() {
    // Flat logits and top-p 0.99: every row's nucleus outgrows the 8-entry lists. The launch
    // captures the first 8 rows' processed and raw logits and cuts them from the capture; the
    // other 3 are recomputed with whole-tile lists, their drawn token reading its raw logit
    // beside its list entry. Either way the reported logprob is the raw one.
    let p = serving(LogprobMode::Raw);
    let sampler = Sampler::new(p.clone(), &Device::cpu_with_threads(2).unwrap()).unwrap();
    let mut case = Case::random(&p, 11, 64, 700, 13, 0.5).with_filter(flashsample::RowFilter::top_p(0.99));
    // T = 0.5: the processed logit of a drawn token differs from its raw one.
    case.temperatures.iter_mut().for_each(|t| *t = 0.5);
    for row in 0..case.batch {
        assert!(case.kept_by_filter(&p, row) > 8, "row {row}'s nucleus fits the lists");
    }
    let got = case.run(&sampler).unwrap();
    case.check(&p, &got, &(0..case.batch).collect::<Vec<_>>()).unwrap();
}
