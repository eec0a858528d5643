//! Tensor-parallel sampling (issue 6): vocabulary shards with `vocab_offset`, merged by
//! `flashsample::tp::merge_summaries`, sample the same tokens as one unsharded launch.
//!
//! - CPU (runs everywhere): N CPU samplers on shards, merged on the host, against TP = 1, for
//!   N in {1, 2, 4, 8}, pathwise (tokens and scores bit-equal).
//! - GPU: `TensorParallelSampler` (NCCL) with world size 1 on cuda:0, and over every GPU of
//!   the machine when there are more, against the plain single-GPU sampler. They are
//!   `#[ignore]`d (reported as ignored where there is no GPU) and fail, naming what is
//!   missing, when run without a driver, a GPU or libnccl.

use flashsample::{
    tp::{merge_summaries, shard_pipeline, shard_ranges, summarize_shard, RankSummary},
    CudaDevice, Device, Error, RowError, Sampler, Samples, SamplingParams, TensorParallelSampler, Tensor, TpError,
};
use flashsample_ir::{DType, Outputs, Pipeline, PipelineBuilder};
use flashsample_tests::{Case, MatrixData};

const ALL_OUTPUTS: Outputs = Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 0 };
const SCORE: Outputs = Outputs { score: true, logsumexp: false, logprob: false, top_logprobs: 0 };

fn pipelines(dtype: DType) -> Vec<Pipeline> {
    let b = |name| PipelineBuilder::new(name, dtype, dtype);
    vec![
        b("Plain").gumbel("seed", 2).outputs(SCORE).build().unwrap(),
        b("Qwen")
            .temperature_per_row("temperature")
            .bias("bias")
            .mask("allowed")
            .ban("banned")
            .softcap(30.0)
            .gumbel("seed", 3)
            .outputs(ALL_OUTPUTS)
            .build()
            .unwrap(),
        b("Greedy").bias("bias").argmax().outputs(ALL_OUTPUTS).build().unwrap(),
        b("Penalized").temperature_per_row("temperature").penalties("pen").mask("allowed").outputs(ALL_OUTPUTS).build().unwrap(),
        b("RequestBias")
            .logit_bias("logit_bias")
            .penalties("pen")
            .temperature_per_row("temperature")
            .mask("allowed")
            .outputs(ALL_OUTPUTS)
            .build()
            .unwrap(),
    ]
}

/// Rows `range` of `m` as their own matrix (values are already rounded to the dtype).
fn rows(m: &MatrixData, range: std::ops::Range<usize>) -> MatrixData {
    MatrixData::from_f32(m.dtype, range.len(), m.cols, &m.exact[range.start * m.cols..range.end * m.cols])
}

/// Simulated TP on the CPU: one CPU sampler per shard, merged by the pure host function.
fn simulated_tp(pipeline: &Pipeline, case: &Case, params: &SamplingParams<'_>, world: usize) -> flashsample::Result<Samples> {
    let device = Device::cpu_with_threads(2).unwrap();
    let local = Sampler::new(shard_pipeline(pipeline).expect("no list pipelines here"), &device)?;
    let mut summaries: Vec<RankSummary> = Vec::new();
    for r in shard_ranges(case.vocab, world, 4).expect("vocab splits") {
        let shard = rows(&case.weights, r.clone());
        summaries.push(summarize_shard(&local, case.hidden.tensor(), shard.tensor(), params, r.start, case.vocab)?);
    }
    Ok(merge_summaries(&summaries, case.batch, pipeline.samples_per_row() as usize, &pipeline.outputs)?)
}

/// Tokens and scores bit-equal; logsumexp and logprobs to f32 rounding of the merge.
fn assert_same(what: &str, tp1: &Samples, tpn: &Samples) {
    assert_eq!(tp1.tokens, tpn.tokens, "{what}: tokens");
    assert_eq!(tp1.scores, tpn.scores, "{what}: scores");
    for (name, a, b) in [("logsumexp", &tp1.logsumexp, &tpn.logsumexp), ("logprobs", &tp1.logprobs, &tpn.logprobs)] {
        assert_eq!(a.is_some(), b.is_some(), "{what}: {name} presence");
        if let (Some(a), Some(b)) = (a, b) {
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= 1e-5 * x.abs().max(1.0), "{what}: {name} {x} vs {y}");
            }
        }
    }
}

#[test]
fn cpu_simulated_tp_equals_tp1_pathwise() {
    for dtype in [DType::BF16, DType::F32] {
        for p in pipelines(dtype) {
            for (vocab, dim, batch) in [(3001usize, 48usize, 9usize), (1024, 64, 3)] {
                let case = Case::random(&p, batch, dim, vocab, vocab as u64 * 7 + dim as u64, 4.0);
                let params = case.params(&p);
                let tp1 = Sampler::new(p.clone(), &Device::cpu_with_threads(2).unwrap()).unwrap();
                let want = tp1.sample(case.hidden.tensor(), case.weights.tensor(), &params).unwrap();
                for world in [1usize, 2, 4, 8] {
                    let got = simulated_tp(&p, &case, &params, world).unwrap();
                    assert_same(&format!("{} {dtype:?} V={vocab} TP={world}", p.name), &want, &got);
                }
            }
        }
    }
}

#[test]
fn cpu_simulated_tp_with_per_row_seeds_and_a_global_offset() {
    let p = &pipelines(DType::BF16)[1];
    let case = Case::random(p, 6, 32, 2050, 5, 4.0);
    let seeds: Vec<u64> = (0..6).map(|r| 1000 + r * 17).collect();
    let params = SamplingParams { row_seeds: Some(&seeds), vocab_offset: 4096, ..case.params(p) };
    let want = Sampler::new(p.clone(), &Device::cpu_with_threads(2).unwrap()).unwrap().sample(case.hidden.tensor(), case.weights.tensor(), &params).unwrap();
    for world in [2usize, 4, 8] {
        assert_same(&format!("row seeds TP={world}"), &want, &simulated_tp(p, &case, &params, world).unwrap());
    }
}

/// Rows whose allowed tokens all live on one shard, and a shard that the bias removes for
/// every row: the other ranks report "nothing here" and the merge still matches TP = 1.
#[test]
fn cpu_simulated_tp_rows_confined_to_one_shard() {
    let p = &pipelines(DType::BF16)[1];
    let (vocab, batch) = (4000usize, 5usize);
    let mut case = Case::random(p, batch, 32, vocab, 9, 4.0);
    let words = vocab.div_ceil(32);
    let ranges = shard_ranges(vocab, 4, 4).unwrap();
    // Row 1: only tokens of the last shard; row 2: a single token of shard 1.
    case.mask[words..2 * words].fill(0);
    for t in ranges[3].clone() {
        case.mask[words + t / 32] |= 1 << (t % 32);
    }
    let only = ranges[1].start + 5;
    case.mask[2 * words..3 * words].fill(0);
    case.mask[2 * words + only / 32] |= 1 << (only % 32);
    case.bias[only] = 0.0;
    case.banned[2].retain(|&t| t as usize != only);
    // Shard 2 banned by the bias for everyone.
    case.bias[ranges[2].clone()].fill(f32::NEG_INFINITY);
    let params = case.params(p);
    let want = Sampler::new(p.clone(), &Device::cpu_with_threads(2).unwrap()).unwrap().sample(case.hidden.tensor(), case.weights.tensor(), &params).unwrap();
    assert!(want.row(2).iter().all(|&t| t as usize == only));
    for world in [2usize, 4, 8] {
        assert_same(&format!("confined rows TP={world}"), &want, &simulated_tp(p, &case, &params, world).unwrap());
    }
    // A row with nothing allowed anywhere is an error naming it, as without TP.
    case.mask[4 * words..5 * words].fill(0);
    let params = case.params(p);
    match simulated_tp(p, &case, &params, 4) {
        Err(Error::Row(RowError::AllMasked { row: 4 })) => {}
        other => panic!("expected AllMasked for row 4, got {other:?}"),
    }
}

/// Rows whose per-request logit bias bans every token outside one shard: the other ranks find
/// nothing for them (their launch must not fail the batch) and the merge matches TP = 1.
#[test]
fn cpu_simulated_tp_rows_confined_by_their_logit_bias() {
    let p = &pipelines(DType::BF16)[4];
    let (vocab, batch) = (4000usize, 4usize);
    let mut case = Case::random(p, batch, 32, vocab, 13, 4.0);
    case.mask.fill(u32::MAX);
    let ranges = shard_ranges(vocab, 4, 4).unwrap();
    let ban_outside = |keep: std::ops::Range<usize>| -> Vec<(u32, f32)> {
        (0..vocab).filter(|t| !keep.contains(t)).map(|t| (t as u32, f32::NEG_INFINITY)).collect()
    };
    case.logit_bias[0] = ban_outside(ranges[3].clone());
    case.logit_bias[2] = ban_outside(ranges[1].start + 7..ranges[1].start + 8);
    let params = case.params(p);
    let want = Sampler::new(p.clone(), &Device::cpu_with_threads(2).unwrap()).unwrap().sample(case.hidden.tensor(), case.weights.tensor(), &params).unwrap();
    assert!(want.row(0).iter().all(|&t| ranges[3].contains(&(t as usize))));
    assert_eq!(want.row(2), [ranges[1].start as u32 + 7]);
    for world in [2usize, 4, 8] {
        assert_same(&format!("logit-bias confined rows TP={world}"), &want, &simulated_tp(p, &case, &params, world).unwrap());
    }
}

#[test]
fn list_pipelines_are_refused_with_a_typed_error() {
    let p = PipelineBuilder::new("TopK", DType::BF16, DType::BF16).filter("f", 8).build().unwrap();
    assert!(matches!(shard_pipeline(&p), Err(TpError::Unsupported(_))));
}

// ---------------------------------------------------------------------------------- GPU

/// The number of usable GPUs; panics naming what is missing (these tests are ignored where
/// there is no GPU, so running them means one was expected).
fn gpus_with_nccl() -> usize {
    let count = match Device::cuda(0) {
        Ok(_) => (1..16).take_while(|&o| CudaDevice::open(o).is_ok()).count() + 1,
        Err(e) => panic!("tensor-parallel GPU tests need cuda:0: {e}"),
    };
    match flashsample::tp::nccl_version() {
        Ok(v) => {
            eprintln!("tp: NCCL {}.{}.{}, {count} GPU(s)", v.0, v.1, v.2);
            count
        }
        Err(e) => panic!("tensor-parallel GPU tests need NCCL: {e}"),
    }
}

fn upload(dev: &std::sync::Arc<CudaDevice>, m: &MatrixData) -> flashsample::DeviceTensor {
    match m.dtype {
        DType::BF16 => dev.upload(&m.exact.iter().map(|&x| flashsample::bf16::from_f32(x)).collect::<Vec<_>>(), m.rows, m.cols),
        DType::F16 => dev.upload(&m.exact.iter().map(|&x| flashsample::f16::from_f32(x)).collect::<Vec<_>>(), m.rows, m.cols),
        DType::F32 => dev.upload(&m.exact, m.rows, m.cols),
    }
    .expect("upload")
}

/// TP over `world` GPUs against the plain sampler on cuda:0, pathwise.
fn gpu_tp_matches_single_gpu(world: usize, vocab: usize, dim: usize, batches: &[usize]) {
    for p in pipelines(DType::BF16) {
        let max_b = *batches.iter().max().unwrap();
        let case = Case::random(&p, max_b, dim, vocab, 77 + world as u64, 4.0);
        let dev0 = CudaDevice::open(0).unwrap();
        let full = upload(&dev0, &case.weights);
        let single = Sampler::new(p.clone(), &Device::Cuda(dev0.clone())).unwrap();
        let shards = shard_ranges(vocab, world, 128)
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(k, r)| upload(&CudaDevice::open(k).unwrap(), &rows(&case.weights, r)))
            .collect();
        let tp = TensorParallelSampler::new(p.clone(), shards).unwrap_or_else(|e| panic!("TP={world}: {e}"));
        for &b in batches {
            let sub = case.prefix(b);
            let params = sub.params(&p);
            let want = single.sample(sub.hidden.tensor(), Tensor::device(&full), &params).unwrap();
            let got = tp.sample(&[sub.hidden.tensor()], &params).unwrap_or_else(|e| panic!("{} TP={world} B={b}: {e}", p.name));
            assert_same(&format!("{} TP={world} B={b} V={vocab} D={dim}", p.name), &want, &got);
        }
        eprintln!("ok: {} TP={world} V={vocab} D={dim} B={batches:?}", p.name);
    }
}

#[test]
#[ignore = "needs a CUDA GPU and NCCL"]
fn gpu_tp_world_1_equals_the_single_gpu_sampler() {
    gpus_with_nccl();
    gpu_tp_matches_single_gpu(1, 128_256, 1024, &[1, 16, 64]);
}

#[test]
#[ignore = "needs two or more CUDA GPUs and NCCL"]
fn gpu_tp_over_every_gpu_equals_the_single_gpu_sampler() {
    let n = gpus_with_nccl();
    assert!(n >= 2, "TP over several GPUs: this machine has {n} GPU");
    for world in [2usize, 4, 8].into_iter().filter(|&w| w <= n) {
        gpu_tp_matches_single_gpu(world, 128_256, 1024, &[1, 16, 64]);
    }
}

#[test]
#[ignore = "needs a CUDA GPU and NCCL"]
fn gpu_tp_reports_typed_errors() {
    gpus_with_nccl();
    let p = &pipelines(DType::BF16)[1];
    let mut case = Case::random(p, 3, 256, 5000, 3, 4.0);
    let words = case.vocab.div_ceil(32);
    let tp = TensorParallelSampler::new(p.clone(), vec![upload(&CudaDevice::open(0).unwrap(), &case.weights)]).unwrap();
    case.mask[words..2 * words].fill(0);
    let params = case.params(p);
    match tp.sample(&[case.hidden.tensor()], &params) {
        Err(TpError::Rank { rank: 0, source: Error::Row(RowError::AllMasked { row: 1 }) })
        | Err(TpError::Runtime(Error::Row(RowError::AllMasked { row: 1 }))) => {}
        other => panic!("expected AllMasked for row 1, got {other:?}"),
    }
    // Wrong hidden size: refused before any collective.
    let bad = MatrixData::from_f32(DType::BF16, 3, 128, &vec![0.0; 3 * 128]);
    assert!(matches!(tp.sample(&[bad.tensor()], &params), Err(TpError::Runtime(Error::Shape(_)))));
    // And the sampler still works afterwards (no rank left waiting in a collective).
    let ok = Case::random(p, 3, 256, 5000, 4, 4.0);
    tp.sample(&[ok.hidden.tensor()], &ok.params(p)).unwrap();
}

#[test]
fn missing_nccl_is_a_typed_error_not_a_panic() {
    match flashsample::tp::nccl_version() {
        Ok(v) => eprintln!("NCCL {v:?} loadable here"),
        Err(TpError::NoNccl { searched }) => assert!(searched.iter().any(|s| s == "libnccl.so"), "{searched:?}"),
        Err(e) => panic!("unexpected: {e}"),
    }
}
