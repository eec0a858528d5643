//! The device API (`cuda::SamplingPlan`) on a GPU: launches on a caller's stream with device
//! buffers equal the host API, bad rows land in the status buffer without sinking the batch,
//! host-side checks name the culprit, the raw-pointer form works, and per-row steps are
//! pathwise equal to the float64 reference.
//!
//! Every test needs a CUDA GPU: they are ignored by default and fail without one. Run them with
//! `cargo test --release -p flashsample-tests --test gpu -- --include-ignored`.

use flashsample::cuda::{DeviceInputs, DeviceMatrix, DeviceOut, DeviceOutputs};
use rand::{rngs::StdRng, SeedableRng};
use flashsample::{Error, ListError, ParamError, RowError, RowFilter, RowStatusError, Sampler, SamplingParams};
use flashsample_abi::{RowStatus, INDEX_NONE};
use flashsample_ir::{DType, LogprobMode, Outputs, Pipeline, PipelineBuilder};
use flashsample_tests::gpu::{gpu, row_errors, DeviceCase, DeviceResults};
use flashsample_tests::{Case, MatrixData};

const ALL_OUTPUTS: Outputs = Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 0 };

fn pipelines() -> Vec<Pipeline> {
    let mut out = vec![
        PipelineBuilder::new("Plain", DType::BF16, DType::BF16).outputs(Outputs { score: true, logsumexp: false, logprob: false, top_logprobs: 0 }).build().unwrap(),
        PipelineBuilder::new("Qwen", DType::BF16, DType::BF16)
            .temperature_per_row("t")
            .bias("bias")
            .mask("allowed")
            .ban("banned")
            .softcap(30.0)
            .gumbel("seed", 2)
            .outputs(ALL_OUTPUTS)
            .build()
            .unwrap(),
        PipelineBuilder::new("Serving", DType::BF16, DType::BF16)
            .penalties("penalties")
            .temperature_per_row("t")
            .mask("allowed")
            .filter("filter", 8)
            .gumbel("seed", 2)
            .outputs(Outputs { top_logprobs: 5, ..ALL_OUTPUTS })
            .build()
            .unwrap(),
        PipelineBuilder::new("Const", DType::F16, DType::F16).temperature_const(0.7).outputs(ALL_OUTPUTS).build().unwrap(),
    ];
    // Raw logprobs (DESIGN.md step 10): "Serving" in the raw mode, for the plan's raw scratch,
    // the raw logsumexp in the caller's buffer and the finishing kernel's logprobs from it.
    let mut raw = out[2].clone();
    raw.name = "RawServing".into();
    raw.logprob_mode = LogprobMode::Raw;
    raw.validate().unwrap();
    out.push(raw);
    out
}

/// The logits' spread of a random case: wide enough with a filter that every top-p / min-p
/// nucleus fits the lists (`max_k = 8`), so the only failed rows are the ones a test makes
/// (`a_nucleus_past_the_lists_fails_alone_on_the_gpu` covers the other case).
fn logit_std(p: &Pipeline) -> f32 {
    if p.filter_max_k().is_some() {
        8.0
    } else {
        3.0
    }
}

/// One device launch of `case` with `params` on a fresh caller stream; the plan, and what it wrote.
fn device_launch(sampler: &Sampler, case: &Case, params: &SamplingParams<'_>, max_batch: usize) -> (flashsample::cuda::SamplingPlan, flashsample_tests::gpu::HostResults) {
    let cuda = sampler.cuda().expect("a CUDA sampler");
    let dev = cuda.device().clone();
    let p = sampler.pipeline();
    let plan = cuda.plan(max_batch, case.dim, case.vocab).expect("plan");
    let inputs = DeviceCase::upload(&dev, p, case, params);
    let mut outputs = DeviceResults::alloc(&dev, p, case.batch);
    let stream = dev.context().new_stream().expect("a caller stream");
    plan.launch(&stream, inputs.inputs(&stream), outputs.outputs(&stream)).expect("device launch");
    let got = outputs.read(&stream);
    (plan, got)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_launch_equals_the_host_api_and_the_reference() {
    let (device, _dev) = gpu();
    for p in pipelines() {
        let sampler = Sampler::new(p.clone(), &device).unwrap();
        for (batch, dim, vocab) in [(1usize, 64usize, 1003usize), (7, 256, 32_000), (64, 128, 50_257)] {
            let case = Case::random(&p, batch, dim, vocab, 5 + batch as u64, logit_std(&p));
            let params = case.params(&p);
            let what = format!("{} B={batch} D={dim} V={vocab}", p.name);
            let host = case.run(&sampler).unwrap_or_else(|e| panic!("{what}: host API: {e}"));
            // A plan for a larger batch serves this one too.
            let (plan, got) = device_launch(&sampler, &case, &params, batch + 3);
            assert!(row_errors(&plan, &got.status).iter().all(Option::is_none), "{what}: {:?}", got.status);
            assert_eq!(got.tokens, host.tokens, "{what}: tokens");
            if let Some(scores) = &host.scores {
                assert_eq!(&got.scores, scores, "{what}: scores");
            }
            if let (Some(a), Some(b)) = (&got.logprobs, &host.logprobs) {
                assert_eq!(a, b, "{what}: logprobs");
            }
            if let (Some(top), Some(want)) = (&got.top, &host.top_logprobs) {
                let n = p.outputs.top_logprobs as usize;
                for (row, want) in want.iter().enumerate() {
                    let row_top: Vec<(u32, f32)> =
                        top[row * n..][..n].iter().take_while(|s| s.index != INDEX_NONE).map(|s| (s.index, s.logit)).collect();
                    assert_eq!(&row_top, want, "{what}: top logprobs of row {row}");
                }
            }
            case.check(&p, &host, &(0..batch).collect::<Vec<_>>()).unwrap_or_else(|e| panic!("{what}: {e}"));
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_rows_land_in_the_status_buffer_and_the_others_are_sampled() {
    let (device, _dev) = gpu();
    let serving = &pipelines()[2];
    let sampler = Sampler::new(serving.clone(), &device).unwrap();
    let mut case = Case::random(serving, 64, 64, 20_000, 9, logit_std(serving));
    let mut h = case.hidden.exact.clone();
    h[5 * 64 + 3] = f32::NAN;
    case.hidden = MatrixData::from_f32(DType::BF16, 64, 64, &h);
    let words = case.vocab.div_ceil(32);
    case.mask[40 * words..41 * words].fill(0);
    let params = case.params(serving);
    let (plan, got) = device_launch(&sampler, &case, &params, 64);
    let errors = row_errors(&plan, &got.status);
    assert_eq!(got.status[5], RowStatus::NonFinite.code());
    assert_eq!(got.status[40], RowStatus::AllMasked.code());
    assert_eq!(errors[5], Some(RowStatusError::Row(RowError::NonFinite { row: 5 })));
    assert_eq!(errors[40], Some(RowStatusError::Row(RowError::AllMasked { row: 40 })));
    assert_eq!(errors.iter().flatten().count(), 2, "{:?}", got.status);
    let s = serving.samples_per_row() as usize;
    for bad in [5, 40] {
        assert!(got.tokens[bad * s..][..s].iter().all(|&t| t == INDEX_NONE), "row {bad}: {:?}", &got.tokens[bad * s..][..s]);
        assert!(got.logprobs.as_ref().unwrap()[bad * s].is_nan());
    }
    // The host API gives the same per-row outcome, and the good rows are the reference's.
    let host = case.run_rows(&sampler).unwrap();
    assert_eq!(host.tokens, got.tokens);
    assert_eq!(host.row_errors, errors);
    let good: Vec<usize> = (0..64).filter(|r| ![5, 40].contains(r)).collect();
    case.check(serving, &host, &good).unwrap();
}

/// A nucleus past the lists among top-k rows: both APIs serve it exactly, on the device (the
/// plan's nucleus kernels; every row equal to the reference and the two APIs equal); a plan
/// without nucleus rows reports it (status 4, the plan's capacity) and samples the others as
/// the host API does. `nucleus.rs` compares the kernels with the host cut bit for bit.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_nucleus_past_the_lists_is_served_on_both_apis() {
    let (device, _dev) = gpu();
    let serving = &pipelines()[2];
    let sampler = Sampler::new(serving.clone(), &device).unwrap();
    let mut case = Case::random(serving, 64, 16, 5000, 23, 1e-3);
    for (r, f) in case.filters.iter_mut().enumerate() {
        *f = if r == 63 { RowFilter::top_p(0.95) } else { RowFilter::top_k(5) };
    }
    let host = case.run_rows(&sampler).unwrap();
    assert!(host.is_complete(), "{:?}", host.row_errors);
    case.check(serving, &host, &(0..64).collect::<Vec<_>>()).unwrap();
    let (plan, got) = device_launch(&sampler, &case, &case.params(serving), 64);
    assert!(row_errors(&plan, &got.status).iter().all(Option::is_none), "{:?}", got.status);
    assert_eq!(got.tokens, host.tokens);
    assert_eq!(&got.scores, host.scores.as_ref().unwrap());
    assert_eq!(got.logprobs.as_ref(), host.logprobs.as_ref());

    let cuda = sampler.cuda().unwrap();
    let dev = cuda.device().clone();
    let plan = cuda.plan_with_nucleus_rows(64, 16, 5000, 0).unwrap();
    let inputs = DeviceCase::upload(&dev, serving, &case, &case.params(serving));
    let mut outputs = DeviceResults::alloc(&dev, serving, 64);
    let stream = dev.context().new_stream().unwrap();
    plan.launch(&stream, inputs.inputs(&stream), outputs.outputs(&stream)).unwrap();
    let got = outputs.read(&stream);
    let errors = row_errors(&plan, &got.status);
    assert_eq!(errors[63], Some(RowStatusError::List(ListError::NucleusTooLarge { row: 63, capacity: 8 })));
    assert_eq!(&got.tokens[..63 * 2], &host.tokens[..63 * 2]);
}

/// A device plan of a top-k 32 pipeline keeps the short tile lists: rows whose top-k overflows
/// them (three rows preferring 40 tokens of one tile) are served by the exact nucleus kernels,
/// the plan's first `R` per chunk, equal to the host API (which reruns with longer lists) and
/// the reference; a row past `R` reports the overflow, and a plan with `R` = 3 serves it too.
#[test]
#[ignore = "needs a CUDA GPU"]
fn rows_overflowing_short_lists_are_served_on_the_device() {
    let (device, _dev) = gpu();
    let p = PipelineBuilder::new("TopK32", DType::BF16, DType::BF16)
        .temperature_per_row("t")
        .filter("f", 32)
        .gumbel("seed", 4)
        .outputs(ALL_OUTPUTS)
        .build()
        .unwrap();
    let sampler = Sampler::new(p.clone(), &device).unwrap();
    let (batch, dim, vocab) = (12usize, 128usize, 20_000usize);
    let hot = Case::hot_tile(&p, batch, dim, vocab, 40).with_filter(RowFilter { top_k: 32, top_p: 0.95, min_p: 0.0 });
    // Rows 0, 1 and 5 prefer the hot tokens; the others are random.
    let mut case = Case::random(&p, batch, dim, vocab, 31, 2.0).with_filter(RowFilter { top_k: 32, top_p: 0.95, min_p: 0.0 });
    let mut rows = case.hidden.exact.clone();
    for r in [0, 1, 5] {
        rows[r * dim..][..dim].copy_from_slice(&hot.hidden.exact[r * dim..][..dim]);
    }
    case.hidden = MatrixData::from_f32(DType::BF16, batch, dim, &rows);
    case.weights = hot.weights;
    let host = case.run_rows(&sampler).unwrap();
    assert!(host.is_complete(), "{:?}", host.row_errors);
    case.check(&p, &host, &(0..batch).collect::<Vec<_>>()).unwrap();
    let (plan, got) = device_launch(&sampler, &case, &case.params(&p), batch);
    assert!(plan.configs().all(|(_, c)| c.list_per_tile < 32), "the plan keeps short lists");
    let errors = row_errors(&plan, &got.status);
    assert_eq!(errors[5], Some(RowStatusError::List(ListError::Overflow { row: 5 })), "{:?}", got.status);
    for r in (0..batch).filter(|&r| r != 5) {
        assert_eq!(errors[r], None, "row {r}");
        assert_eq!(got.tokens[r], host.tokens[r], "row {r}: token");
        assert_eq!(got.scores[r].to_bits(), host.scores.as_ref().unwrap()[r].to_bits(), "row {r}: score");
        assert_eq!(got.logprobs.as_ref().unwrap()[r].to_bits(), host.logprobs.as_ref().unwrap()[r].to_bits(), "row {r}: logprob");
    }
    let cuda = sampler.cuda().unwrap();
    let dev = cuda.device().clone();
    let plan = cuda.plan_with_nucleus_rows(batch, dim, vocab, 3).unwrap();
    let inputs = DeviceCase::upload(&dev, &p, &case, &case.params(&p));
    let mut outputs = DeviceResults::alloc(&dev, &p, batch);
    let stream = dev.context().new_stream().unwrap();
    plan.launch(&stream, inputs.inputs(&stream), outputs.outputs(&stream)).unwrap();
    let got = outputs.read(&stream);
    assert!(row_errors(&plan, &got.status).iter().all(Option::is_none), "{:?}", got.status);
    assert_eq!(got.tokens, host.tokens);
    assert_eq!(got.logprobs.as_ref(), host.logprobs.as_ref());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn launch_checks_name_the_culprit() {
    let (device, dev) = gpu();
    let qwen = &pipelines()[1];
    let sampler = Sampler::new(qwen.clone(), &device).unwrap();
    let case = Case::random(qwen, 8, 64, 1000, 1, 2.0);
    let plan = sampler.cuda().unwrap().plan(4, 64, 1000).unwrap();
    let d = DeviceCase::upload(&dev, qwen, &case, &case.params(qwen));
    let mut out = DeviceResults::alloc(&dev, qwen, 8);
    let stream = dev.stream().clone();
    // Batch 8 on a plan for 4.
    let e = plan.launch(&stream, d.inputs(&stream), out.outputs(&stream)).unwrap_err();
    assert!(matches!(e, Error::Shape(_)), "{e}");
    let plan = sampler.cuda().unwrap().plan(8, 64, 1000).unwrap();
    // No temperatures for a per-row-temperature pipeline.
    let mut inputs = d.inputs(&stream);
    inputs.temperatures = None;
    let e = plan.launch(&stream, inputs, out.outputs(&stream)).unwrap_err();
    assert!(matches!(e, Error::Param(ParamError::Missing("temperatures"))), "{e}");
    // A tokens buffer too short for B · S.
    let mut short = stream.alloc_zeros::<u32>(3).unwrap();
    let mut status = stream.alloc_zeros::<u32>(8).unwrap();
    let outputs = DeviceOutputs::new(DeviceOut::new(&mut short, &stream).unwrap(), DeviceOut::new(&mut status, &stream).unwrap());
    let e = plan.launch(&stream, d.inputs(&stream), outputs).unwrap_err();
    assert!(matches!(e, Error::Param(ParamError::Length { what: "tokens", .. })), "{e}");
    // Weights of the wrong dtype.
    let f16_weights = MatrixData::random(&mut StdRng::seed_from_u64(1), DType::F16, 1000, 64, 0.1).upload(&dev);
    let mut inputs = d.inputs(&stream);
    inputs.weights = DeviceMatrix::from_tensor(&f16_weights);
    let e = plan.launch(&stream, inputs, out.outputs(&stream)).unwrap_err();
    assert!(matches!(e, Error::DType { operand: "weights", .. }), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn raw_pointers_on_a_raw_stream_equal_the_typed_form() {
    let (device, dev) = gpu();
    let plain = &pipelines()[0];
    let sampler = Sampler::new(plain.clone(), &device).unwrap();
    let case = Case::random(plain, 16, 128, 4096, 3, 2.0);
    let params = case.params(plain);
    let (plan, typed) = device_launch(&sampler, &case, &params, 16);
    let d = DeviceCase::upload(&dev, plain, &case, &params);
    let out = DeviceResults::alloc(&dev, plain, 16);
    let stream = dev.context().new_stream().unwrap();
    let tokens = flashsample_tests::gpu::addr(&out.tokens, &stream);
    let status = flashsample_tests::gpu::addr(&out.status, &stream);
    // SAFETY: the buffers above hold these shapes and outlive the synchronized launch.
    unsafe {
        let inputs = DeviceInputs::new(
            DeviceMatrix::from_raw(d.hidden.device_address(), DType::BF16, 16, 128),
            DeviceMatrix::from_raw(d.weights.device_address(), DType::BF16, 4096, 128),
            d.seed,
        );
        let outputs = DeviceOutputs::new(DeviceOut::from_raw(tokens, 16), DeviceOut::from_raw(status, 16));
        plan.launch_on_raw_stream(stream.cu_stream(), inputs, outputs).unwrap();
    }
    let raw = out.read(&stream);
    assert_eq!(raw.tokens, typed.tokens);
    assert_eq!(raw.status, vec![0; 16]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn row_steps_are_pathwise_equal_to_the_reference_on_the_gpu() {
    let (device, _dev) = gpu();
    for p in [&pipelines()[1], &pipelines()[2]] {
        let sampler = Sampler::new(p.clone(), &device).unwrap();
        let case = Case::random(p, 12, 128, 20_000, 4, logit_std(p));
        let cpu = Sampler::new(p.clone(), &flashsample::Device::cpu()).unwrap();
        for step in [0u32, 1, 7, 1 << 20] {
            let steps: Vec<u32> = (0..12).map(|r| step + r % 2).collect();
            let params = SamplingParams { row_steps: Some(&steps), ..case.params(p) };
            let got = sampler.sample(case.hidden.tensor(), case.weights.tensor(), &params).unwrap_or_else(|e| panic!("{} step {step}: {e}", p.name));
            case.check_with(p, &params, &got, &(0..12).collect::<Vec<_>>()).unwrap_or_else(|e| panic!("{} step {step}: {e}", p.name));
            let on_cpu = cpu.sample(case.hidden.tensor(), case.weights.tensor(), &params).unwrap();
            assert_eq!(got.tokens, on_cpu.tokens, "{} step {step}: GPU and CPU differ", p.name);
            // The device API reads the steps from device memory.
            let (_, dev_got) = device_launch(&sampler, &case, &params, 12);
            assert_eq!(dev_got.tokens, got.tokens, "{} step {step}: device API", p.name);
        }
    }
}
