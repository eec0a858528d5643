//! The CUDA backend on a real GPU against the float64 reference and the CPU backend.
//!
//! Every test is `#[ignore]`d (`needs a CUDA GPU`, or `needs a compute capability 9.0 GPU` for
//! wgmma and the TMA), so a machine without one reports them as ignored; run them with
//! `--include-ignored` (`bench/gpu_run.sh` does). Run without a GPU they fail: a test that
//! cannot see a GPU never passes. On a GPU: pathwise checks at the Qwen3-8B LM-head shape and odd shapes, bf16 and f16,
//! every transform; tokens identical to the CPU backend on small shapes; chi-square against
//! softmax; every stage-one candidate slot written (poisoned buffer); typed row errors.
//!
//! One binary for every GPU test (one to build, carry and run on the GPU machine): this file's
//! schedule and backend tests, the device API (`device_api`), CUDA graphs and the device decode
//! loop (`graphs`), per-request logit bias on every schedule (`logit_bias`), the noise's bits on
//! every input (`noise_bits`), extreme parameter
//! values (`robust`), batch invariance (`invariance`), scoring given tokens (`scoring`) and raw
//! logprobs (`logprob_modes`).

mod device_api;
mod graphs;
mod invariance;
mod logit_bias;
mod logprob_modes;
mod noise_bits;
mod noise_skip;
mod nucleus;
mod robust;
mod scoring;
mod speculative;

use flashsample::{
    bf16, cuda, f16, CudaDevice, Device, DeviceTensor, Error, GpuConfig, Grid, GridKind, KernelConfig, Matrix, RowError, RowFilter,
    Samples, Sampler, SamplingParams, Schedule, Tensor,
};
use flashsample_abi::{Candidate, INDEX_NONE, INDEX_NONFINITE};
use flashsample_ir::{DType, Outputs, Pipeline, PipelineBuilder};
use flashsample_tests::{chi_square, chi_square_filter_cases, chi_square_filtered, chi_square_pipelines, Case, MatrixData};
use std::sync::{Arc, Mutex};

const ALL_OUTPUTS: Outputs = Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 0 };
const SCORE: Outputs = Outputs { score: true, logsumexp: false, logprob: false, top_logprobs: 0 };

/// The GPU; panics (the test fails) where there is none.
fn gpu() -> (Device, Arc<CudaDevice>) {
    match Device::cuda(0) {
        Ok(d) => {
            let Device::Cuda(c) = &d else { unreachable!("Device::cuda returns a CUDA device") };
            let c = c.clone();
            (d, c)
        }
        Err(e) => panic!("this test needs a CUDA GPU (run it with --include-ignored on one): opening cuda:0 failed: {e}"),
    }
}

/// The GPU, which must be of compute capability 9.0 (sm_90a: wgmma, the TMA): `what` needs it.
fn hopper_gpu(what: &str) -> (Device, Arc<CudaDevice>) {
    let (device, dev) = gpu();
    let cc = dev.limits().compute_capability;
    assert_eq!(cc, (9, 0), "{what} needs a compute capability 9.0 GPU, this one is {cc:?}");
    (device, dev)
}

/// Big shapes use most of the GPU's memory bandwidth and the host's cores for the reference;
/// running two at once only slows both (and doubles host memory), so they take turns.
static BIG: Mutex<()> = Mutex::new(());

fn upload(dev: &Arc<CudaDevice>, m: &MatrixData) -> DeviceTensor {
    // `exact` holds values already rounded to the dtype, so converting back is lossless.
    let t = match m.dtype {
        DType::BF16 => dev.upload(&m.exact.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(), m.rows, m.cols),
        DType::F16 => dev.upload(&m.exact.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(), m.rows, m.cols),
        DType::F32 => dev.upload(&m.exact, m.rows, m.cols),
    };
    t.expect("upload")
}

/// A few rows of a batch: first, last, and a greedy one (temperature 0 every 7th row from 3).
fn rows_to_check(b: usize) -> Vec<usize> {
    let mut rows = vec![0, b - 1];
    if b > 3 {
        rows.push(3);
    }
    rows.sort();
    rows.dedup();
    rows
}

/// Samples every batch size with device-resident weights and checks a few rows pathwise.
fn pathwise_batches(pipeline: &Pipeline, vocab: usize, dim: usize, batches: &[usize], seed: u64) {
    pathwise_batches_std(pipeline, vocab, dim, batches, seed, 4.0)
}

/// [`pathwise_batches`] with logits of standard deviation `logit_std`.
fn pathwise_batches_std(pipeline: &Pipeline, vocab: usize, dim: usize, batches: &[usize], seed: u64, logit_std: f32) {
    let (device, dev) = gpu();
    let _big = BIG.lock().unwrap_or_else(|e| e.into_inner());
    let max_b = *batches.iter().max().unwrap();
    let mut big = Case::random(pipeline, max_b, dim, vocab, seed, logit_std);
    let weights = upload(&dev, &big.weights);
    let sampler = Sampler::new(pipeline.clone(), &device).unwrap();
    for &b in batches {
        // Weights left empty: swap `big.weights` in for reference checks.
        let mut sub = big.prefix(b);
        let params = sub.params(pipeline);
        let samples = sampler
            .sample(sub.hidden.tensor(), Tensor::device(&weights), &params)
            .unwrap_or_else(|e| panic!("{} B={b} V={vocab} D={dim}: {e}", pipeline.name));
        assert_eq!(samples.tokens.len(), b * pipeline.samples_per_row() as usize);
        std::mem::swap(&mut sub.weights, &mut big.weights);
        let checked = sub.check(pipeline, &samples, &rows_to_check(b));
        std::mem::swap(&mut sub.weights, &mut big.weights);
        if let Err(e) = checked {
            panic!("{} B={b} V={vocab} D={dim}: {e}", pipeline.name);
        }
        eprintln!("ok: {} B={b} V={vocab} D={dim} config {:?}", pipeline.name, sampler.config_for(b, dim, vocab));
    }
}

fn qwen(dtype: DType, samples: u32) -> Pipeline {
    PipelineBuilder::new("Qwen", dtype, dtype)
        .temperature_per_row("temperature")
        .bias("bias")
        .mask("allowed")
        .ban("banned")
        .softcap(30.0)
        .gumbel("seed", samples)
        .outputs(ALL_OUTPUTS)
        .build()
        .unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pathwise_qwen3_lm_head_bf16() {
    // The Qwen3-8B LM head: V = 151936, D = 4096, every transform, 4 samples, logsumexp.
    pathwise_batches(&qwen(DType::BF16, 4), 151_936, 4096, &[1, 3, 8, 17, 64, 256], 11);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pathwise_plain_bf16_qwen_shape() {
    let p = PipelineBuilder::new("Plain", DType::BF16, DType::BF16).outputs(SCORE).build().unwrap();
    pathwise_batches(&p, 151_936, 4096, &[1, 64, 256], 12);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pathwise_f16_gpt2_vocab() {
    // An odd vocabulary (GPT-2's 50257) in f16, Gemma-style softcap and scalar temperature.
    let p = PipelineBuilder::new("Gemma", DType::F16, DType::F16)
        .softcap(3.0)
        .temperature_scalar("t")
        .outputs(ALL_OUTPUTS)
        .build()
        .unwrap();
    pathwise_batches(&p, 50_257, 4096, &[1, 3, 17, 64], 13);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pathwise_f16_qwen_shape_all_transforms() {
    pathwise_batches(&qwen(DType::F16, 1), 151_936, 4096, &[8, 256], 14);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pathwise_odd_shapes() {
    // Vocabularies that are no multiple of any tile, a million-token one, a 1-token one,
    // and small hidden sizes.
    let pipelines = [
        qwen(DType::BF16, 4),
        PipelineBuilder::new("Greedy", DType::BF16, DType::BF16).bias("bias").argmax().outputs(ALL_OUTPUTS).build().unwrap(),
        PipelineBuilder::new("Mask", DType::F16, DType::F16).mask("m").gumbel("seed", 2).outputs(SCORE).build().unwrap(),
    ];
    let shapes = [(1usize, 64usize), (7, 64), (1000, 128), (1003, 256), (50_257, 512), (1_000_003, 256), (131_071, 1024)];
    for p in &pipelines {
        for &(vocab, dim) in &shapes {
            pathwise_batches(p, vocab, dim, &[1, 5, 33], vocab as u64 ^ dim as u64);
        }
    }
}

/// The CPU and GPU backends draw from the same Philox noise, so on small problems whose
/// logits both compute to the same f32 values they sample the same tokens. Where f32
/// rounding of the two accumulation orders may differ, only a near-tie (per the reference
/// bound) may change the token.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_tokens_match_cpu_tokens() {
    let (device, _dev) = gpu();
    let pipelines = [
        qwen(DType::BF16, 3),
        PipelineBuilder::new("Plain", DType::BF16, DType::BF16).gumbel("seed", 2).outputs(SCORE).build().unwrap(),
        PipelineBuilder::new("Gemma", DType::F16, DType::F16).softcap(3.0).temperature_scalar("t").outputs(ALL_OUTPUTS).build().unwrap(),
        PipelineBuilder::new("Greedy", DType::BF16, DType::BF16).bias("bias").argmax().outputs(ALL_OUTPUTS).build().unwrap(),
    ];
    let (mut total, mut differ) = (0usize, 0usize);
    for p in &pipelines {
        let cpu = Sampler::new(p.clone(), &Device::cpu()).unwrap();
        let gpu = Sampler::new(p.clone(), &device).unwrap();
        for (i, &(batch, dim, vocab)) in [(1usize, 16usize, 10usize), (5, 64, 1000), (17, 128, 4099), (64, 64, 20_000), (3, 256, 151_936)].iter().enumerate() {
            let case = Case::random(p, batch, dim, vocab, 100 + i as u64, 3.0);
            let c = case.run(&cpu).unwrap_or_else(|e| panic!("cpu {}: {e}", p.name));
            let g = case.run(&gpu).unwrap_or_else(|e| panic!("gpu {} B={batch} D={dim} V={vocab}: {e}", p.name));
            total += c.tokens.len();
            let mismatched: Vec<usize> = (0..c.tokens.len()).filter(|&k| c.tokens[k] != g.tokens[k]).collect();
            if !mismatched.is_empty() {
                differ += mismatched.len();
                let rows: Vec<usize> = mismatched.iter().map(|k| k / c.samples_per_row).collect();
                // Each differing token must be a near-tie that both backends resolve legally.
                case.check(p, &g, &rows).unwrap_or_else(|e| panic!("{} B={batch} D={dim} V={vocab}: gpu {e}", p.name));
                case.check(p, &c, &rows).unwrap_or_else(|e| panic!("{} B={batch} D={dim} V={vocab}: cpu {e}", p.name));
            }
            if let (Some(cs), Some(gs)) = (&c.scores, &g.scores) {
                for k in 0..cs.len() {
                    if c.tokens[k] == g.tokens[k] {
                        let tol = 1e-4 * cs[k].abs().max(1.0);
                        assert!((cs[k] - gs[k]).abs() <= tol, "{} slot {k}: cpu score {} gpu {}", p.name, cs[k], gs[k]);
                    }
                }
            }
        }
    }
    eprintln!("{differ} of {total} tokens differ between CPU and GPU (near-ties only)");
    assert!(differ * 100 <= total, "{differ} of {total} tokens differ: more than near-ties explain");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn chi_square_for_every_transform() {
    let (device, _dev) = gpu();
    for pipeline in &chi_square_pipelines() {
        let sampler = Sampler::new(pipeline.clone(), &device).unwrap();
        let mut case = Case::identical_rows(pipeline, 2000, 64, 12, 1.5);
        let counts = case.draw_counts(&sampler, 5).unwrap();
        let probs = case.probabilities(pipeline, 0);
        let (stat, p) = chi_square(&counts, &probs);
        assert!(p > 1e-3, "{}: chi-square {stat:.1}, p = {p:.2e}\ncounts {counts:?}\nprobs {probs:?}", pipeline.name);
        eprintln!("ok: chi-square {} p = {p:.3}", pipeline.name);
    }
}

const POISON_INDEX: u32 = 0xDEAD_BEEF;

/// Stage one must write every (row, sample, tile) slot and every LSE partial: run it into a
/// NaN-poisoned buffer, then check each slot and that reducing the slots on the host gives
/// what the full GPU launch returns.
#[test]
#[ignore = "needs a CUDA GPU"]
fn stage_one_writes_every_candidate_slot() {
    let (device, dev) = gpu();
    let poison = Candidate { score: f32::NAN, index: POISON_INDEX, logit: f32::NAN };
    let plain = || PipelineBuilder::new("Plain", DType::BF16, DType::BF16).outputs(SCORE).build().unwrap();
    // The cooperative schedules on a compute capability 9.0 GPU (small enough for the
    // sanitizers): partial batch tiles, fewer k slices than stages.
    let hopper = |grid| (dev.compute_capability() == (9, 0)).then(|| KernelConfig::Cuda(GpuConfig::new(256, 128, 8, Schedule::WgmmaTma { stages: 4, grid })));
    let (cooperative, pair) = (hopper(GridKind::Cooperative), hopper(GridKind::CooperativePair));
    for (p, batch, dim, vocab, config) in [
        (qwen(DType::BF16, 4), 3usize, 64usize, 1003usize, None),
        (qwen(DType::BF16, 4), 17, 256, 151_936, None),
        // The heuristic's TMA tile of B = 9..16 (on a compute capability 9.0 GPU).
        (plain(), 12, 256, 151_936, None),
        (qwen(DType::F16, 1), 64, 128, 50_257, None),
        (plain(), 256, 128, 32_001, None),
        (plain(), 1, 64, 7, None),
        (plain(), 200, 128, 32_000, cooperative.as_ref()),
        // Three batch tiles: the pair of the third is an empty tile.
        (plain(), 300, 128, 32_000, pair.as_ref()),
    ] {
        let sampler = Sampler::new(p.clone(), &device).unwrap();
        let case = Case::random(&p, batch, dim, vocab, 77, 3.0);
        let params = case.params(&p);
        let what = format!("{} B={batch} D={dim} V={vocab} {config:?}", p.name);
        let (layout, cands, lse) =
            sampler.cuda().expect("a CUDA sampler").debug_stage1_candidates(case.hidden.tensor(), case.weights.tensor(), &params, config, poison)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(layout.candidate_count(), cands.len());
        for row in 0..batch {
            for s in 0..layout.samples {
                for tile in 0..layout.tiles {
                    let c = cands[layout.slot(row, s, tile)];
                    let at = format!("{what}: slot (row {row}, sample {s}, tile {tile} of {})", layout.tiles);
                    assert_ne!(c.index, POISON_INDEX, "{at} never written");
                    match c.index {
                        INDEX_NONE | INDEX_NONFINITE => {}
                        v => {
                            assert!((v as usize) < vocab, "{at}: index {v} outside the vocabulary");
                            assert!(!c.score.is_nan() && !c.logit.is_nan(), "{at}: index {v} with NaN score/logit {c:?}");
                        }
                    }
                }
            }
        }
        if let Some(lse) = &lse {
            assert_eq!(lse.len(), batch * layout.tiles);
            for (i, l) in lse.iter().enumerate() {
                let written = l.pad == 0 && l.window <= flashsample_abi::lse::WINDOW_LIMIT;
                assert!(written, "{what}: LSE partial {i} (row {}, tile {}) never written: {l:?}", i / layout.tiles, i % layout.tiles);
            }
        }
        let host = layout.reduce(&cands, lse.as_deref()).unwrap_or_else(|e| panic!("{what}: host reduce: {e}"));
        let full = case.run(&sampler).unwrap();
        assert_eq!(host.tokens, full.tokens, "{what}: stage two on the GPU disagrees with the host reduction of stage one");
        if let (Some(h), Some(g)) = (&host.logsumexp, &full.logsumexp) {
            // The GPU's stage two computes abi::LseSum::logsumexp op for op: the same bits.
            for r in 0..batch {
                assert_eq!(h[r].to_bits(), g[r].to_bits(), "{what}: row {r} logsumexp host {} gpu {}", h[r], g[r]);
            }
        }
        eprintln!("ok: every slot written, {what}, {} tiles", layout.tiles);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fully_masked_row_is_an_error_naming_the_row() {
    let (device, _dev) = gpu();
    let p = PipelineBuilder::new("M", DType::BF16, DType::BF16).mask("m").build().unwrap();
    let mut case = Case::random(&p, 4, 64, 1000, 5, 2.0);
    let words = 1000usize.div_ceil(32);
    case.mask[2 * words..3 * words].iter_mut().for_each(|w| *w = 0);
    match case.run(&Sampler::new(p, &device).unwrap()) {
        Err(Error::Row(RowError::AllMasked { row: 2 })) => {}
        other => panic!("expected AllMasked for row 2, got {other:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn all_but_one_token_masked() {
    let (device, _dev) = gpu();
    let p = PipelineBuilder::new("M", DType::BF16, DType::BF16).mask("m").build().unwrap();
    let vocab = 151_936usize;
    let mut case = Case::random(&p, 3, 64, vocab, 5, 2.0);
    case.mask.iter_mut().for_each(|w| *w = 0);
    let words = vocab.div_ceil(32);
    for (row, keep) in [(0usize, vocab - 1), (1, 0), (2, 77_777)] {
        case.mask[row * words + keep / 32] |= 1 << (keep % 32);
    }
    let s = case.run(&Sampler::new(p, &device).unwrap()).unwrap();
    assert_eq!(s.tokens, vec![vocab as u32 - 1, 0, 77_777]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nan_hidden_state_is_an_error_naming_the_row() {
    let (device, _dev) = gpu();
    let p = PipelineBuilder::new("P", DType::BF16, DType::BF16).outputs(SCORE).build().unwrap();
    let mut case = Case::random(&p, 3, 64, 1000, 5, 2.0);
    let mut h = case.hidden.exact.clone();
    h[64 + 3] = f32::NAN;
    case.hidden = MatrixData::from_f32(DType::BF16, 3, 64, &h);
    match case.run(&Sampler::new(p, &device).unwrap()) {
        Err(Error::Row(RowError::NonFinite { row: 1 })) => {}
        other => panic!("expected NonFinite for row 1, got {other:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn infinite_weight_is_an_error() {
    let (device, _dev) = gpu();
    let p = PipelineBuilder::new("P", DType::F16, DType::F16).build().unwrap();
    let mut case = Case::random(&p, 2, 64, 500, 5, 2.0);
    let mut w = case.weights.exact.clone();
    w[123 * 64] = f32::INFINITY;
    case.weights = MatrixData::from_f32(DType::F16, 500, 64, &w);
    match case.run(&Sampler::new(p, &device).unwrap()) {
        Err(Error::Row(RowError::NonFinite { row: 0 })) => {}
        other => panic!("expected NonFinite for row 0, got {other:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn mixed_dtypes_are_sampled_or_rejected_clearly() {
    let (device, _dev) = gpu();
    // Tensor cores need one 16-bit dtype for both operands; f32 × bf16 either runs (a SIMT
    // path) and is correct, or fails with a PTX codegen error that says why.
    let p = PipelineBuilder::new("Mixed", DType::F32, DType::BF16).bias("bias").argmax().outputs(ALL_OUTPUTS).build().unwrap();
    let sampler = Sampler::new(p.clone(), &device).unwrap();
    let case = Case::random(&p, 3, 64, 999, 5, 2.0);
    match case.run(&sampler) {
        Ok(s) => case.check(&p, &s, &[0, 1, 2]).unwrap(),
        Err(e @ (Error::PtxCodegen(_) | Error::Unsupported(_))) => {
            let msg = e.to_string();
            eprintln!("f32 x bf16 rejected: {msg}");
            assert!(msg.contains("f32") || msg.contains("dtype") || msg.contains("F32"), "unclear error: {msg}");
        }
        Err(e) => panic!("f32 x bf16 gave an unexpected error: {e}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_tensors_match_host_tensors_and_stay_on_their_device() {
    let (device, dev) = gpu();
    let p = qwen(DType::BF16, 2);
    let case = Case::random(&p, 9, 128, 30_000, 21, 3.0);
    let sampler = Sampler::new(p.clone(), &device).unwrap();
    let params = case.params(&p);
    let host = sampler.sample(case.hidden.tensor(), case.weights.tensor(), &params).unwrap();
    let (h, w) = (upload(&dev, &case.hidden), upload(&dev, &case.weights));
    let on_device = sampler.sample(Tensor::device(&h), Tensor::device(&w), &params).unwrap();
    assert_eq!(host, on_device);
    let typed = Matrix::<bf16>::on_device(&w).unwrap();
    assert_eq!(sampler.sample(Tensor::device(&h), typed.into(), &params).unwrap(), host);
    assert!(matches!(Matrix::<f16>::on_device(&w), Err(Error::DType { .. })));
    // A CPU sampler cannot read GPU memory.
    let cpu = Sampler::new(p.clone(), &Device::cpu()).unwrap();
    assert!(matches!(cpu.sample(Tensor::device(&h), Tensor::device(&w), &params), Err(Error::WrongDevice { .. })));
    // Round trip of the bytes.
    let back = w.to_host_bytes().unwrap();
    let want: Vec<bf16> = case.weights.exact.iter().map(|&x| bf16::from_f32(x)).collect();
    assert_eq!(back, bytemuck_bytes(&want));
    // Same seed, same samples; another seed, other samples.
    assert_eq!(sampler.sample(case.hidden.tensor(), Tensor::device(&w), &params).unwrap(), host);
    let other = SamplingParams { seed: params.seed ^ 1, ..params };
    assert_ne!(sampler.sample(case.hidden.tensor(), Tensor::device(&w), &other).unwrap().tokens, host.tokens);
}

fn bytemuck_bytes(xs: &[bf16]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_reports_itself() {
    let (device, dev) = gpu();
    let (major, _) = dev.compute_capability();
    assert!(major >= 8, "opened a GPU below sm_80: {}", device.describe());
    assert!(dev.sm_count() > 0);
    eprintln!("device: {} limits {:?}", device.describe(), dev.limits());
    // Opening the same ordinal again shares the device (one stream, one kernel cache).
    let Device::Cuda(again) = Device::cuda(0).unwrap() else { unreachable!() };
    assert!(Arc::ptr_eq(&dev, &again));
    match Device::cuda(4096) {
        Err(Error::NoCudaDevice { ordinal: 4096, count }) => assert!(count >= 1),
        other => panic!("expected NoCudaDevice for ordinal 4096, got {other:?}"),
    }
}

/// The on-disk PTX cache: after any launch the kernel's PTX is in `cuda::cache_dir()`. When
/// `FLASHSAMPLE_EXPECT_DISK_CACHE=1` (a second run of this test in a fresh process), the
/// kernel must come from that file rather than from the compiler.
#[test]
#[ignore = "needs a CUDA GPU"]
fn ptx_disk_cache() {
    let (device, _dev) = gpu();
    let p = PipelineBuilder::new("DiskCache", DType::BF16, DType::BF16).gumbel("seed", 1).outputs(SCORE).build().unwrap();
    let sampler = Sampler::new(p.clone(), &device).unwrap();
    let case = Case::random(&p, 2, 64, 1000, 3, 2.0);
    case.run(&sampler).unwrap();
    let config: KernelConfig = sampler.config_for(2, 64, 1000);
    let from_disk = sampler.cuda().expect("a CUDA sampler").debug_kernel_from_disk(&config).unwrap();
    if std::env::var("FLASHSAMPLE_EXPECT_DISK_CACHE").as_deref() == Ok("1") {
        assert!(from_disk, "the second process compiled the kernel again instead of loading the cached PTX");
    }
    let Some(dir) = cuda::cache_dir() else { return };
    let files: Vec<_> = std::fs::read_dir(dir.join("ptx")).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    let ours = format!("{:016x}", p.fingerprint());
    assert!(
        files.iter().any(|f| f.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&ours))),
        "no cached PTX for fingerprint {ours} in {}: {files:?}",
        dir.display()
    );
    eprintln!("ok: PTX cache in {} (this process loaded it from disk: {from_disk})", dir.display());
}

// ---- filter (top-k / top-p / min-p), penalties, top logprobs, per-row seeds, vocab offset ----

/// Logit spread of the filter tests: at the fixtures' temperatures (up to 1.5) a narrower one
/// makes top-p 0.9 nuclei of thousands of tokens at V = 151936, which take the exact nucleus
/// path (the plan's nucleus kernels); `large_nuclei_are_served_exactly` and `nucleus.rs` cover it.
const FILTER_LOGIT_STD: f32 = 8.0;

/// What a serving stack runs (as the CPU suite's): penalties, per-row temperature, a grammar
/// mask, per-row top-k / top-p / min-p, two samples per row, logprobs and the top 5 logprobs.
fn serving() -> Pipeline {
    PipelineBuilder::new("Serving", DType::BF16, DType::BF16)
        .penalties("penalties")
        .temperature_per_row("temperature")
        .mask("allowed")
        .filter("filter", 8)
        .gumbel("seed", 2)
        .outputs(Outputs { top_logprobs: 5, ..ALL_OUTPUTS })
        .build()
        .unwrap()
}

/// Checks every listed row of `samples` pathwise against the reference under `params`
/// (which may carry row seeds and a vocab offset, unlike `Case::params`).
fn check_with_params(case: &Case, pipeline: &Pipeline, params: &SamplingParams<'_>, samples: &flashsample::Samples, rows: &[usize]) {
    let problem = case.problem(pipeline, params);
    let (refs, _) = problem.sample_rows(rows).expect("reference");
    let s = samples.samples_per_row;
    for (i, &row) in rows.iter().enumerate() {
        for k in 0..s {
            let slot = row * s + k;
            let score = samples.scores.as_ref().map_or(refs[i * s + k].score as f32, |sc| sc[slot]);
            flashsample_reference::check_pathwise(&refs[i * s + k], samples.tokens[slot], score)
                .unwrap_or_else(|e| panic!("{} B={} V={}: row {row} sample {k}: {e}", pipeline.name, case.batch, case.vocab));
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pathwise_serving_qwen3_lm_head() {
    // Filter + penalties + mask + top logprobs at the Qwen3-8B LM-head shape; Case::check
    // also checks the top-5 logprobs against the reference.
    pathwise_batches_std(&serving(), 151_936, 4096, &[1, 17, 64, 256], 21, FILTER_LOGIT_STD);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pathwise_serving_odd_shapes() {
    for &(vocab, dim) in &[(7usize, 64usize), (1003, 256), (50_257, 512), (131_071, 128)] {
        pathwise_batches_std(&serving(), vocab, dim, &[1, 5, 33], 77 ^ vocab as u64, FILTER_LOGIT_STD);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn row_seeds_and_vocab_offset_pathwise_and_equal_to_cpu() {
    let (device, dev) = gpu();
    let _big = BIG.lock().unwrap_or_else(|e| e.into_inner());
    let p = serving();
    let gpu = Sampler::new(p.clone(), &device).unwrap();
    let cpu = Sampler::new(p.clone(), &Device::cpu()).unwrap();
    for &(batch, dim, vocab, offset) in &[(16usize, 4096usize, 151_936usize, 4 * 40_000u32), (33, 256, 50_257, 12), (9, 64, 1003, 1 << 20)] {
        let case = Case::random(&p, batch, dim, vocab, 5 + vocab as u64, FILTER_LOGIT_STD);
        let seeds: Vec<u64> = (0..batch as u64).map(|r| 0x5eed_0000 + 977 * r).collect();
        let params = SamplingParams { row_seeds: Some(&seeds), vocab_offset: offset, ..case.params(&p) };
        let weights = upload(&dev, &case.weights);
        let g = gpu.sample(case.hidden.tensor(), Tensor::device(&weights), &params).unwrap();
        let rows: Vec<usize> = (0..batch).collect();
        check_with_params(&case, &p, &params, &g, &rows);
        // Per-row seeds: a row's tokens do not depend on its position in the batch.
        let rev_hidden: Vec<f32> = (0..batch).rev().flat_map(|r| case.hidden.exact[r * dim..][..dim].to_vec()).collect();
        let rev = MatrixData::from_f32(DType::BF16, batch, dim, &rev_hidden);
        let flip = |v: &[f32]| v.iter().rev().cloned().collect::<Vec<f32>>();
        let (t, rep, pres, freq) = (flip(&case.temperatures), flip(&case.repetition), flip(&case.presence), flip(&case.frequency));
        let words = vocab.div_ceil(32);
        let mask: Vec<u32> = (0..batch).rev().flat_map(|r| case.mask[r * words..][..words].to_vec()).collect();
        let hist: Vec<Vec<(u32, u32)>> = case.history.iter().rev().cloned().collect();
        let filt: Vec<RowFilter> = case.filters.iter().rev().cloned().collect();
        let rseeds: Vec<u64> = seeds.iter().rev().cloned().collect();
        let rparams = SamplingParams {
            temperature: flashsample::TemperatureArg::PerRow(&t),
            mask: Some(&mask),
            filter: Some(&filt),
            row_seeds: Some(&rseeds),
            penalties: Some(flashsample::PenaltyArg { repetition: &rep, presence: &pres, frequency: &freq, history: &hist }),
            ..params
        };
        let r = gpu.sample(rev.tensor(), Tensor::device(&weights), &rparams).unwrap();
        for row in 0..batch {
            assert_eq!(g.row(row), r.row(batch - 1 - row), "V={vocab} row {row} moved and changed its tokens");
        }
        if dim <= 256 {
            let c = cpu.sample(case.hidden.tensor(), case.weights.tensor(), &params).unwrap();
            let differ = (0..c.tokens.len()).filter(|&k| c.tokens[k] != g.tokens[k]).count();
            assert!(differ * 50 <= c.tokens.len(), "V={vocab}: {differ} of {} tokens differ from the CPU", c.tokens.len());
            let (ct, gt) = (c.top_logprobs.unwrap(), g.top_logprobs.as_ref().unwrap().clone());
            for row in 0..batch {
                assert_eq!(ct[row].len(), gt[row].len(), "row {row}");
                for (a, b) in ct[row].iter().zip(&gt[row]) {
                    assert!((a.1 - b.1).abs() <= 1e-3, "row {row}: cpu top logprob {a:?} gpu {b:?}");
                }
            }
        }
        // Without them the noise differs.
        let plain = gpu.sample(case.hidden.tensor(), Tensor::device(&weights), &case.params(&p)).unwrap();
        assert_ne!(plain.tokens, g.tokens, "V={vocab}: row seeds / offset changed nothing");
        eprintln!("ok: row seeds + vocab_offset {offset} B={batch} D={dim} V={vocab}");
    }
}

/// A case whose rows need more of one tile's tokens than the heuristic's lists hold (`longer`
/// than `list_per_tile`), run on the GPU: the lists overflow, the launch reruns with lists that
/// cannot, and `check` (pathwise the reference, the expected top logprobs) holds; the tokens
/// equal the CPU's.
fn short_lists_rerun_exactly(p: &Pipeline, case: &Case, longer: u32, check: impl Fn(&Samples) -> Result<(), String>) {
    let (device, _dev) = gpu();
    let gpu = Sampler::new(p.clone(), &device).unwrap();
    let KernelConfig::Cuda(config) = gpu.config_for(case.batch, case.dim, case.vocab) else { panic!("a CUDA config") };
    assert!(config.list_per_tile < longer, "the heuristic's lists are shorter than {longer}: {config:?}");
    let g = case.run(&gpu).unwrap();
    check(&g).unwrap();
    let c = case.run(&Sampler::new(p.clone(), &Device::cpu()).unwrap()).unwrap();
    assert_eq!(c.tokens, g.tokens);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn short_lists_overflow_and_rerun_exactly() {
    let (p, case) = Case::hot_tile_top_k();
    short_lists_rerun_exactly(&p, &case, 32, |g| case.check_hot_tile_top_k(&p, g));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_mask_of_clustered_tokens_overflows_the_lists_and_reruns_exactly() {
    let masked: Vec<usize> = (0..8).collect();
    let (p, case) = Case::clustered_mask_top_k(&masked);
    short_lists_rerun_exactly(&p, &case, 20, |g| case.check_clustered_mask_top_k(&p, g, &masked));
}

/// Rows 2 and 5 of 8 overflow: rows 2..6 run again alone, with the whole launch's noise
/// streams (pathwise the reference, the CPU's tokens). Four launches of one sampler
/// (`stage_three::ShortListGate`): the first reruns the rows; the second's overflow recurs,
/// reruns them and doubles the lists; the third's doubled lists (shorter than the masked rows'
/// 20 tokens in one tile) overflow again and rerun; the fourth runs exact lists from the
/// start. All four are the same.
#[test]
#[ignore = "needs a CUDA GPU"]
fn rows_overflowing_mid_batch_rerun_alone_exactly() {
    let masked = [2, 5];
    let (p, case) = Case::clustered_mask_top_k(&masked);
    short_lists_rerun_exactly(&p, &case, 20, |g| case.check_clustered_mask_top_k(&p, g, &masked));
    let (device, _dev) = gpu();
    let gpu = Sampler::new(p.clone(), &device).unwrap();
    // Rows 2..6 at least (an unmasked row's random top 32 may crowd a tile too), none on
    // exact lists.
    let first = case.run(&gpu).unwrap();
    assert!(first.list_reruns >= 4, "{} rows rerun", first.list_reruns);
    for launch in 1..4 {
        let again = case.run(&gpu).unwrap();
        case.check_clustered_mask_top_k(&p, &again, &masked).unwrap_or_else(|e| panic!("launch {launch}: {e}"));
        assert_eq!(again.tokens, first.tokens, "launch {launch}");
        assert_eq!(again.list_reruns >= 4, launch < 3, "launch {launch}: {} rows rerun", again.list_reruns);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn large_nuclei_are_served_exactly() {
    let (device, _dev) = gpu();
    let p = serving();
    let sampler = Sampler::new(p.clone(), &device).unwrap();
    // Flat over 5000 tokens: the 0.9-nucleus holds thousands (past 1024), the 0.01 one ~50
    // (past max_k = 8): both served exactly, as with a top-k.
    for filter in [RowFilter::top_p(0.9), RowFilter::top_p(0.01), RowFilter { top_k: 8, top_p: 0.9, min_p: 0.0 }] {
        let case = Case::random(&p, 3, 16, 5000, 2, 1e-3).with_filter(filter);
        case.check(&p, &case.run(&sampler).unwrap(), &[0, 1, 2]).unwrap_or_else(|e| panic!("{filter:?}: {e}"));
    }
    // Issue 26's batch: 63 rows on top-k 50 and one lone top-p 0.95 at T = 2 at V = 151936,
    // plus a min-p row: every row sampled and equal to the reference.
    let p = PipelineBuilder::new("Serving50", DType::BF16, DType::BF16)
        .temperature_per_row("temperature")
        .mask("allowed")
        .filter("filter", 50)
        .gumbel("seed", 2)
        .outputs(Outputs { top_logprobs: 5, ..ALL_OUTPUTS })
        .build()
        .unwrap();
    let sampler = Sampler::new(p.clone(), &device).unwrap();
    let mut case = Case::random(&p, 64, 64, 151_936, 26, 3.0);
    for (r, f) in case.filters.iter_mut().enumerate() {
        *f = match r {
            62 => RowFilter { min_p: 0.01, ..RowFilter::OFF },
            63 => RowFilter::top_p(0.95),
            _ => RowFilter::top_k(50),
        };
    }
    case.temperatures[62] = 2.0;
    case.temperatures[63] = 2.0;
    for row in [62, 63] {
        assert!(case.kept_by_filter(&p, row) > 1024, "row {row}: the nucleus fits the lists");
    }
    let got = case.run_rows(&sampler).unwrap();
    assert!(got.is_complete(), "{:?}", got.row_errors);
    case.check(&p, &got, &(0..64).collect::<Vec<_>>()).unwrap();
}

/// DESIGN.md step 6b's list bounds on the throughput tile: at B = 256 and V = 151936 most
/// tiles run after the row's bounds are up (nine waves of the one-CTA-per-item grid), so most
/// lists are cut short; every row (top-k 50, top-k 50 with top-p 0.9, min-p) and its top
/// logprobs must still be the reference's.
#[test]
#[ignore = "needs a CUDA GPU"]
fn list_bounds_keep_every_filtered_row_of_a_throughput_batch_exact() {
    let (device, _dev) = gpu();
    let p = PipelineBuilder::new("Bounded", DType::BF16, DType::BF16)
        .temperature_per_row("temperature")
        .filter("filter", 50)
        .gumbel("seed", 2)
        .outputs(Outputs { top_logprobs: 5, ..ALL_OUTPUTS })
        .build()
        .unwrap();
    let sampler = Sampler::new(p.clone(), &device).unwrap();
    let (batch, dim, vocab) = (256usize, 64usize, 151_936usize);
    let KernelConfig::Cuda(config) = sampler.config_for(batch, dim, vocab) else { panic!("a CUDA config") };
    assert!(flashsample_codegen_ptx::list_bound_groups(&p, &config).is_some(), "the heuristic's tile reads list bounds: {config:?}");
    let mut case = Case::random(&p, batch, dim, vocab, 28, FILTER_LOGIT_STD);
    for (r, f) in case.filters.iter_mut().enumerate() {
        *f = match r % 3 {
            0 => RowFilter::top_k(50),
            1 => RowFilter { top_k: 50, top_p: 0.9, min_p: 0.0 },
            _ => RowFilter { min_p: 0.05, ..RowFilter::OFF },
        };
    }
    let got = case.run_rows(&sampler).unwrap();
    assert!(got.is_complete(), "{:?}", got.row_errors);
    case.check(&p, &got, &(0..batch).collect::<Vec<_>>()).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn filtered_gpu_tokens_match_cpu_tokens() {
    let (device, _dev) = gpu();
    let p = serving();
    let cpu = Sampler::new(p.clone(), &Device::cpu()).unwrap();
    let gpu = Sampler::new(p.clone(), &device).unwrap();
    let (mut total, mut differ) = (0usize, 0usize);
    for (i, &(batch, dim, vocab)) in [(1usize, 16usize, 10usize), (5, 64, 1000), (17, 128, 4099), (64, 64, 20_000), (3, 256, 151_936)].iter().enumerate() {
        let case = Case::random(&p, batch, dim, vocab, 300 + i as u64, FILTER_LOGIT_STD);
        let c = case.run(&cpu).unwrap();
        let g = case.run(&gpu).unwrap_or_else(|e| panic!("gpu B={batch} D={dim} V={vocab}: {e}"));
        total += c.tokens.len();
        let rows: Vec<usize> = (0..c.tokens.len()).filter(|&k| c.tokens[k] != g.tokens[k]).map(|k| k / c.samples_per_row).collect();
        differ += rows.len();
        if !rows.is_empty() {
            case.check(&p, &g, &rows).unwrap_or_else(|e| panic!("B={batch} D={dim} V={vocab}: gpu {e}"));
        }
    }
    eprintln!("{differ} of {total} filtered tokens differ between CPU and GPU (near-ties only)");
    assert!(differ * 100 <= total, "{differ} of {total} tokens differ");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn chi_square_for_every_filter_and_the_penalties() {
    let (device, _dev) = gpu();
    for (pipeline, filter) in &chi_square_filter_cases() {
        let sampler = Sampler::new(pipeline.clone(), &device).unwrap();
        let pv = chi_square_filtered(&sampler, *filter, 64).unwrap();
        eprintln!("ok: chi-square {} {filter:?} p = {pv:.3}", pipeline.name);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bounded_filter_skips_the_logsumexp_without_changing_a_token() {
    // Rows bounded by top-k (or min-p) need no row logsumexp: the lean pipeline's launch runs
    // stage one without it (lse = 0 to every stage); a logprob output forces the variant with
    // it. Tokens, scores and logits must not notice. A lone top-p row puts the lean pipeline
    // back on the logsumexp variant, also unchanged.
    let (device, _dev) = gpu();
    let build = |outputs| {
        PipelineBuilder::new("BoundedGpu", DType::BF16, DType::BF16)
            .temperature_per_row("t")
            .filter("f", 16)
            .gumbel("seed", 2)
            .outputs(outputs)
            .build()
            .unwrap()
    };
    let lean = build(SCORE);
    let full = build(Outputs { logprob: true, ..SCORE });
    let (a_s, b_s) = (Sampler::new(lean.clone(), &device).unwrap(), Sampler::new(full.clone(), &device).unwrap());
    let case = || Case::random(&lean, 12, 64, 5000, 8, FILTER_LOGIT_STD).with_filter(RowFilter { top_k: 10, top_p: 0.8, min_p: 0.0 });
    let bounded = case();
    let mut mixed = case();
    mixed.filters[1] = RowFilter { top_k: 0, top_p: 1.0, min_p: 0.05 };
    let mut lone = case();
    lone.filters[1] = mixed.filters[1];
    lone.filters[2] = RowFilter::top_p(0.5);
    for (name, case, lean_needs) in [("top-k", &bounded, false), ("top-k + min-p", &mixed, false), ("with a lone top-p", &lone, true)] {
        assert_eq!(case.params(&lean).needs_logsumexp(&lean, case.batch), lean_needs, "{name}");
        let a = case.run(&a_s).unwrap_or_else(|e| panic!("{name} lean: {e}"));
        let b = case.run(&b_s).unwrap_or_else(|e| panic!("{name} logprob: {e}"));
        assert_eq!((&a.tokens, &a.scores), (&b.tokens, &b.scores), "{name}");
        assert!(a.logprobs.is_none() && b.logprobs.is_some(), "{name}");
        case.check(&lean, &a, &(0..case.batch).collect::<Vec<_>>()).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

/// Sizes `c`'s lists for `p`, then drops stages (down to `min_stages`) until it fits the
/// device, since lists take shared memory on top of the ring. Returns the case's name, or
/// `None` after printing why a config that still does not fit is not run.
fn fit_to_device(c: &mut GpuConfig, p: &Pipeline, dev: &CudaDevice, min_stages: u32, shape: String) -> Option<String> {
    c.fit_lists(p);
    while c.stages() > min_stages && c.validate(p, dev.limits()).is_err() {
        c.schedule = c.schedule.with_stages(c.stages() - 1);
    }
    let what = format!("{} {shape} {c:?}", p.name);
    match c.validate(p, dev.limits()) {
        Ok(()) => Some(what),
        Err(e) => {
            eprintln!("not run (does not fit this GPU): {what}: {e}");
            None
        }
    }
}

/// `got`, the samples of `config`, must match the reference pathwise, and a stage one of
/// `config` over poisoned candidates must write every slot.
fn check_pathwise_and_every_slot(sampler: &Sampler, case: &Case, p: &Pipeline, config: &KernelConfig, got: &flashsample::Samples, what: &str) {
    case.check(p, got, &rows_to_check(case.batch)).unwrap_or_else(|e| panic!("{what}: {e}"));
    let poison = Candidate { score: f32::NAN, index: POISON_INDEX, logit: f32::NAN };
    let params = case.params(p);
    let (layout, cands, _) = sampler.cuda().expect("a CUDA sampler").debug_stage1_candidates(case.hidden.tensor(), case.weights.tensor(), &params, Some(config), poison)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(cands.iter().all(|c| c.index != POISON_INDEX), "{what}: a candidate slot of {} was never written", layout.candidate_count());
    eprintln!("ok: {what}");
}

/// `variant` changes how stage one schedules its work, not what it computes: its samples must
/// equal `baseline`'s exactly, match the reference pathwise, and write every candidate slot.
fn variant_equals_baseline(
    sampler: &Sampler,
    case: &Case,
    p: &Pipeline,
    baseline: &GpuConfig,
    variant: &GpuConfig,
    what: &str,
    baseline_name: &str,
) {
    let (baseline, variant) = (KernelConfig::Cuda(baseline.clone()), KernelConfig::Cuda(variant.clone()));
    let a = case.run_with(sampler, &baseline).unwrap_or_else(|e| panic!("{what}, {baseline_name}: {e}"));
    let b = case.run_with(sampler, &variant).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(a, b, "{what}: differs from the {baseline_name}");
    check_pathwise_and_every_slot(sampler, case, p, &variant, &b, what);
}

/// A shape a tile test runs: pipeline, batch, D, V and the logits' standard deviation.
type TileShape = (Pipeline, usize, usize, usize, f32);

/// For each of `shapes` (a sampler and a random case of seed `seed + batch`), runs `check` on
/// each config of `tiles(vocab)` that [`fit_to_device`] fits (at `min_stages` stages or more),
/// with the config's name.
fn each_fitted_tile(
    device: &Device,
    dev: &CudaDevice,
    shapes: Vec<TileShape>,
    seed: u64,
    min_stages: u32,
    tiles: impl Fn(usize) -> Vec<GpuConfig>,
    mut check: impl FnMut(&Sampler, &Case, &Pipeline, &GpuConfig, &str),
) {
    for (p, batch, dim, vocab, std) in shapes {
        let sampler = Sampler::new(p.clone(), device).unwrap();
        let case = Case::random(&p, batch, dim, vocab, seed + batch as u64, std);
        for mut c in tiles(vocab) {
            let Some(what) = fit_to_device(&mut c, &p, dev, min_stages, format!("B={batch} D={dim} V={vocab}")) else { continue };
            check(&sampler, &case, &p, &c, &what);
        }
    }
}

/// Persistent tensor-path CTAs issue the next item's first slices before this item's
/// epilogue (the scratch then sits after the ring): the tokens, scores, logsumexp and top
/// logprobs must be exactly those of the same tile config with one CTA per item (same MMA
/// order, same noise), pathwise against the reference, and every candidate slot written.
#[test]
#[ignore = "needs a CUDA GPU"]
fn persistent_overlapped_epilogue_equals_one_cta_per_item() {
    let (device, dev) = gpu();
    let _big = BIG.lock().unwrap_or_else(|e| e.into_inner());
    let tile = |vocab_tile, batch_tile, warps, stages| GpuConfig::new(vocab_tile, batch_tile, warps, Schedule::MmaSync { stages, k_step: 64, grid: Grid::Persistent });
    let shapes = vec![
        (qwen(DType::BF16, 2), 64usize, 4096usize, 151_936usize, 4.0f32),
        (qwen(DType::F16, 1), 17, 200, 1003, 4.0),
        (serving(), 64, 4096, 151_936, FILTER_LOGIT_STD),
        (serving(), 33, 128, 50_257, FILTER_LOGIT_STD),
    ];
    // 256 × 128 with lists: ring + scratch + lists exceed shared memory even at 2 stages.
    let tiles = |_| vec![tile(256, 64, 8, 4), tile(128, 64, 4, 3), tile(256, 16, 8, 4), tile(512, 32, 8, 2), tile(256, 128, 8, 3)];
    each_fitted_tile(&device, &dev, shapes, 91, 2, tiles, |sampler, case, p, c, what| {
        variant_equals_baseline(sampler, case, p, &c.one_cta_per_item(), c, what, "one CTA per item");
    });
}

/// The grid of a persistent or one-CTA-per-item tile.
fn grid(persistent: bool) -> Grid {
    if persistent {
        Grid::Persistent
    } else {
        Grid::PerItem
    }
}

/// A wgmma tile config (no lists until `fit_to_device`), on the TMA ring or not.
fn wgmma_tile(vocab_tile: u32, batch_tile: u32, warps: u32, stages: u32, persistent: bool, tma: bool) -> GpuConfig {
    let schedule = if tma {
        Schedule::WgmmaTma { stages, grid: grid(persistent).into() }
    } else {
        Schedule::Wgmma { stages, drain: false, grid: grid(persistent) }
    };
    GpuConfig::new(vocab_tile, batch_tile, warps, schedule)
}

/// The wgmma main loop (sm_90a: warpgroup MMA straight from the swizzled ring) must give
/// the samples the reference gives, pathwise, for one and two warpgroups, 2 to 8 m64
/// operands per group, batch tiles 8 to 128, 3 to 5 stages, D not a multiple of the slice or of 8 (zero-
/// filled and unaligned slices), persistent or not, with lists; every candidate slot is
/// written. It runs on compute capability 9.0 only and says so elsewhere.
#[test]
#[ignore = "needs a compute capability 9.0 GPU"]
fn wgmma_mainloop_pathwise() {
    let (device, dev) = hopper_gpu("wgmma");
    let _big = BIG.lock().unwrap_or_else(|e| e.into_inner());
    let tile = |vocab_tile, batch_tile, warps, stages, persistent| wgmma_tile(vocab_tile, batch_tile, warps, stages, persistent, false);
    let shapes = vec![
        (qwen(DType::BF16, 2), 64usize, 4096usize, 151_936usize, 4.0f32),
        (qwen(DType::F16, 1), 17, 200, 1003, 4.0),
        (qwen(DType::BF16, 1), 5, 203, 1003, 4.0),
        (serving(), 64, 4096, 151_936, FILTER_LOGIT_STD),
        (serving(), 33, 128, 50_257, FILTER_LOGIT_STD),
    ];
    // The f64 reference of the big shapes costs seconds per check: fewer tiles there.
    let tiles = |vocab| {
        if vocab > 100_000 {
            vec![tile(256, 64, 8, 5, false), tile(256, 64, 8, 4, true), tile(256, 128, 8, 3, false)]
        } else {
            vec![
                tile(256, 64, 8, 4, false),
                tile(256, 64, 8, 4, true),
                tile(128, 64, 4, 4, false),
                tile(256, 8, 8, 4, false),
                tile(128, 16, 4, 3, true),
                tile(512, 32, 8, 3, false),
                tile(256, 128, 8, 3, false),
            ]
        }
    };
    each_fitted_tile(&device, &dev, shapes, 57, 3, tiles, |sampler, case, p, c, what| {
        let wgmma = KernelConfig::Cuda(c.clone());
        let got = case.run_with(sampler, &wgmma).unwrap_or_else(|e| panic!("{what}: {e}"));
        check_pathwise_and_every_slot(sampler, case, p, &wgmma, &got, what);
    });
}

/// `wgmma_drain` (each slice's MMAs finish before the next barrier, the ring one slice
/// deeper) and `stagger_us` (the first wave's second CTA per SM starts late) change when
/// slots are refilled and when CTAs start, not what is multiplied: the samples must equal
/// the plain wgmma ring's exactly and the reference's pathwise, with every candidate slot
/// written. Two CTAs per SM (128 × 64, the B = 64 tuning), one (256 × 64), persistent CTAs,
/// fewer k slices than stages (D = 128) and unaligned D.
#[test]
#[ignore = "needs a compute capability 9.0 GPU"]
fn drained_staggered_wgmma_equals_plain_ring() {
    let (device, dev) = hopper_gpu("wgmma");
    let _big = BIG.lock().unwrap_or_else(|e| e.into_inner());
    let tile = |vocab_tile, batch_tile, warps, stages, persistent, stagger_us| {
        GpuConfig::new(vocab_tile, batch_tile, warps, Schedule::Wgmma { stages, drain: true, grid: grid(persistent) }).with_stagger(stagger_us)
    };
    let shapes = vec![
        (qwen(DType::BF16, 2), 64usize, 4096usize, 151_936usize, 4.0f32),
        (qwen(DType::BF16, 1), 5, 203, 1003, 4.0),
        (serving(), 33, 128, 50_257, FILTER_LOGIT_STD),
    ];
    let tiles = |vocab| {
        if vocab > 100_000 {
            vec![tile(128, 64, 4, 4, false, 40), tile(256, 64, 8, 5, false, 0)]
        } else {
            vec![tile(128, 64, 4, 4, false, 20), tile(128, 64, 4, 3, true, 5), tile(256, 8, 8, 4, false, 0), tile(256, 128, 8, 3, false, 10)]
        }
    };
    each_fitted_tile(&device, &dev, shapes, 77, 3, tiles, |sampler, case, p, c, what| {
        let plain = c.clone().with_stagger(0).with_schedule(Schedule::Wgmma { stages: c.stages(), drain: false, grid: grid(c.is_persistent()) });
        variant_equals_baseline(sampler, case, p, &plain, c, what, "plain ring");
    });
}

/// The shapes of the TMA tests: V a multiple of 32 and D of 8 (the maps describe them) and
/// one of neither (which runs the cp.async ring).
fn tma_shapes() -> Vec<TileShape> {
    vec![
        (qwen(DType::BF16, 2), 64, 4096, 151_936, 4.0),
        (qwen(DType::F16, 1), 17, 200, 1056, 4.0),
        (qwen(DType::BF16, 1), 5, 203, 1003, 4.0),
        (serving(), 33, 128, 50_240, FILTER_LOGIT_STD),
        // Lists from B = 192 on (the heuristic's 256 × 128 tile there, one CTA per item).
        (serving(), 200, 128, 50_240, FILTER_LOGIT_STD),
    ]
}

/// The TMA ring (`tma`: tensor maps, `cp.async.bulk.tensor` boxes in wgmma row order,
/// full/empty mbarriers instead of a CTA barrier per slice) feeds the same wgmmas the
/// same bytes, so its samples must equal the `cp.async` wgmma path's exactly and the
/// reference's pathwise: one and two warpgroups, batch tiles 8 to 128, fewer k slices
/// than the ring is deep (D = 128), partial vocab and batch tiles, persistent CTAs that
/// carry the mbarrier phases across several items, and every candidate slot written.
/// Shapes the maps cannot describe (V % 32 != 0, D % 8 != 0) run the cp.async ring.
#[test]
#[ignore = "needs a compute capability 9.0 GPU"]
fn tma_ring_equals_cp_async_ring() {
    let (device, dev) = hopper_gpu("TMA + wgmma");
    let _big = BIG.lock().unwrap_or_else(|e| e.into_inner());
    let tile = |vocab_tile, batch_tile, warps, stages, persistent| wgmma_tile(vocab_tile, batch_tile, warps, stages, persistent, true);
    let shapes = tma_shapes();
    let tiles = |vocab| {
        if vocab > 100_000 {
            // 256 × 16: the heuristic's tile for B = 9..16.
            vec![tile(256, 64, 8, 5, false), tile(256, 64, 8, 5, true), tile(256, 128, 8, 4, false), tile(256, 16, 8, 4, false)]
        } else {
            vec![
                tile(256, 64, 8, 5, false),
                tile(256, 8, 8, 4, true),
                tile(128, 64, 4, 4, false),
                tile(128, 16, 4, 3, true),
                tile(256, 128, 8, 3, false),
                // The heuristic's tile for lists from B = 192: scratch and lists alias the ring.
                tile(256, 128, 8, 4, false),
            ]
        }
    };
    each_fitted_tile(&device, &dev, shapes, 23, 3, tiles, |sampler, case, p, c, what| {
        let ring = c.clone().with_schedule(Schedule::Wgmma { stages: c.stages(), drain: false, grid: grid(c.is_persistent()) });
        variant_equals_baseline(sampler, case, p, &ring, c, what, "cp.async ring");
    });
}

/// The ping-pong schedule (`pingpong`: a producer warp streams the CTA's items through the
/// TMA ring, two consumer sets take alternate items, each with its own scratch and named
/// barrier) multiplies the same slices in the same order as one consumer on the TMA ring, so
/// its samples must equal that ring's exactly and the reference's pathwise, with every
/// candidate slot written: one and two warpgroups per set, batch tiles 16 to 128, 4 to 8
/// stages, fewer k slices than stages (D = 128), partial vocab and batch tiles, lists (one and
/// four batch tiles), CTAs with an odd number of items (one set does one more), and shapes the
/// maps cannot describe (D = 203, V = 1003), which run the persistent cp.async ring instead.
#[test]
#[ignore = "needs a compute capability 9.0 GPU"]
fn pingpong_equals_tma_ring() {
    warp_specialized_equals_tma_ring(GridKind::PingPong, "ping-pong TMA + wgmma", (128, 64, 4, 8), &[(128, 16, 4, 4), (256, 64, 8, 4), (128, 128, 4, 6)]);
}

/// The cooperative schedule (`cooperative`: the producer warpgroup streams the CTA's items,
/// one consumer set multiplies and reduces each) likewise equals one consumer on the TMA ring
/// and the reference, on the same shapes: the 256 × 128 tile cuBLAS runs at B = 256, one
/// and two warpgroups, batch tiles 16 to 128.
#[test]
#[ignore = "needs a compute capability 9.0 GPU"]
fn cooperative_equals_tma_ring() {
    warp_specialized_equals_tma_ring(GridKind::Cooperative, "cooperative TMA + wgmma", (128, 64, 4, 8), &[(256, 128, 8, 4), (128, 16, 4, 4), (256, 64, 8, 4)]);
}

/// The cooperative pair (`CooperativePair`: 2-CTA clusters whose producers multicast one W
/// box each into both CTAs) equals one consumer on the TMA ring and the reference: batch
/// tiles 16 to 128, odd batch-tile counts (the last pairs with an empty tile), fewer k slices
/// than stages.
#[test]
#[ignore = "needs a compute capability 9.0 GPU"]
fn cooperative_pair_equals_tma_ring() {
    warp_specialized_equals_tma_ring(GridKind::CooperativePair, "cooperative pair TMA + wgmma", (256, 128, 8, 4), &[(256, 16, 8, 4), (256, 64, 8, 4)]);
}

/// `grid`'s tiles (`(vocab tile, batch tile, warps, stages)`: `large` at every vocabulary,
/// `small` too below 100k) against the persistent TMA ring of the same tile: equal samples,
/// every slot written.
fn warp_specialized_equals_tma_ring(grid: GridKind, what: &str, large: (u32, u32, u32, u32), small: &[(u32, u32, u32, u32)]) {
    let (device, dev) = hopper_gpu(what);
    let _big = BIG.lock().unwrap_or_else(|e| e.into_inner());
    let tile = |vocab_tile, batch_tile, warps, stages| GpuConfig::new(vocab_tile, batch_tile, warps, Schedule::WgmmaTma { stages, grid });
    let shapes = tma_shapes();
    let tiles = |vocab| {
        let mut out = vec![tile(large.0, large.1, large.2, large.3)];
        if vocab <= 100_000 {
            out.extend(small.iter().map(|&(vt, bt, w, s)| tile(vt, bt, w, s)));
        }
        out
    };
    each_fitted_tile(&device, &dev, shapes, 31, 3, tiles, |sampler, case, p, c, what| {
        let ring = c.clone().with_schedule(Schedule::WgmmaTma { stages: c.stages(), grid: GridKind::Persistent });
        variant_equals_baseline(sampler, case, p, &ring, c, what, "TMA ring");
    });
}

/// `SamplingParams::row_offset` on the GPU: a range of a batch launched on its own with its
/// first row as the offset gives every row the bits of the whole launch (rows without their
/// own seed draw by their launch row), and the float64 reference's tokens.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_range_with_its_row_offset_samples_what_the_whole_launch_does() {
    let (device, _) = gpu();
    let p = serving();
    let gpu = Sampler::new(p.clone(), &device).unwrap();
    let (batch, vocab) = (40, 5003);
    let case = Case::random(&p, batch, 64, vocab, 31, FILTER_LOGIT_STD);
    let all = gpu.sample(case.hidden.tensor(), case.weights.tensor(), &case.params(&p)).unwrap();
    let rows: Vec<usize> = (17..40).collect();
    let part = case.rows(&rows);
    let params = SamplingParams { row_offset: 17, ..part.params(&p) };
    let alone = gpu.sample(part.hidden.tensor(), case.weights.tensor(), &params).unwrap();
    for (i, &r) in rows.iter().enumerate() {
        assert_eq!(all.row(r), alone.row(i), "row {r}");
    }
    let renumbered = gpu.sample(part.hidden.tensor(), case.weights.tensor(), &part.params(&p)).unwrap();
    assert_ne!(renumbered.tokens, alone.tokens, "the offset must matter");
    check_with_params(&case, &p, &case.params(&p), &all, &[0, 17, 39]);
}
