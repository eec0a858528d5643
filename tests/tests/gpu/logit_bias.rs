//! Per-request logit bias on a GPU: every stage-one schedule that compiles it samples what the
//! float64 reference samples (pathwise, with rows with and without a bias, `-inf` bans and
//! biases that move the argmax in one batch), and the device API's launch equals the host
//! API's.

use super::{hopper_gpu, ALL_OUTPUTS};
use flashsample::{Device, Error, GpuConfig, ListError, RowStatusError, Grid, GridKind, KernelConfig, ParamError, Sampler, Schedule};
use flashsample_ir::{DType, Outputs, Pipeline, PipelineBuilder};
use flashsample_tests::gpu::{row_errors, DeviceCase, DeviceResults};
use flashsample_tests::Case;

/// vLLM's order: the model's softcap, the per-request logit bias, then penalties and
/// temperature, a filter and top logprobs (the lists see the biased logits).
fn request_bias(dtype: DType) -> Pipeline {
    PipelineBuilder::new("RequestBias", dtype, dtype)
        .softcap(30.0)
        .logit_bias("logit_bias")
        .bias("bias")
        .penalties("penalties")
        .temperature_per_row("t")
        .filter("filter", 8)
        .gumbel("seed", 2)
        .outputs(Outputs { top_logprobs: 3, ..ALL_OUTPUTS })
        .build()
        .unwrap()
}

/// One config of every schedule (the TMA ones need `D % 8 == 0` and `V % 32 == 0`, which the
/// shapes below keep), with lists fitted to the pipeline.
fn schedules(p: &Pipeline) -> Vec<(&'static str, GpuConfig)> {
    let item = Grid::PerItem;
    let mut out = vec![
        ("mma_sync", GpuConfig::new(128, 16, 4, Schedule::MmaSync { stages: 3, k_step: 64, grid: item })),
        ("mma_sync persistent", GpuConfig::new(128, 64, 4, Schedule::MmaSync { stages: 4, k_step: 64, grid: Grid::Persistent })),
        ("wgmma", GpuConfig::new(256, 64, 8, Schedule::Wgmma { stages: 4, drain: false, grid: item })),
        ("wgmma TMA", GpuConfig::new(256, 64, 8, Schedule::WgmmaTma { stages: 5, grid: GridKind::PerItem })),
        ("wgmma TMA ping-pong", GpuConfig::new(128, 64, 4, Schedule::WgmmaTma { stages: 4, grid: GridKind::PingPong })),
        ("wgmma TMA cooperative", GpuConfig::new(128, 64, 4, Schedule::WgmmaTma { stages: 4, grid: GridKind::Cooperative })),
        ("wgmma TMA cooperative pair", GpuConfig::new(256, 32, 8, Schedule::WgmmaTma { stages: 3, grid: GridKind::CooperativePair })),
    ];
    for (_, c) in &mut out {
        c.fit_lists(p);
    }
    out
}

/// The host API on `config` against the reference.
fn check_config(device: &Device, p: &Pipeline, config: &GpuConfig, what: &str) {
    let sampler = Sampler::new(p.clone(), device).unwrap();
    for (batch, dim, vocab, seed) in [(9usize, 256usize, 32_000usize, 3u64), (40, 128, 50_016, 4)] {
        let case = Case::random(p, batch, dim, vocab, seed, 8.0);
        assert!(case.logit_bias.iter().any(Vec::is_empty) && case.logit_bias.iter().any(|r| !r.is_empty()));
        let what = format!("{what} B={batch} D={dim} V={vocab}");
        let gpu = case.run_with(&sampler, &KernelConfig::Cuda(config.clone())).unwrap_or_else(|e| panic!("{what}: {e}"));
        case.check(p, &gpu, &(0..batch).collect::<Vec<_>>()).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
}

#[test]
#[ignore = "needs a compute capability 9.0 GPU"]
fn logit_bias_is_pathwise_equal_to_the_reference_on_every_schedule() {
    let (device, _dev) = hopper_gpu("wgmma and TMA schedules with a logit bias");
    let p = request_bias(DType::BF16);
    for (name, c) in schedules(&p) {
        check_config(&device, &p, &c, name);
    }
    // SIMT: f32 operands.
    let p32 = request_bias(DType::F32);
    let mut simt = GpuConfig::new(128, 8, 4, Schedule::Simt { grid: Grid::PerItem });
    simt.fit_lists(&p32);
    check_config(&device, &p32, &simt, "simt");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_api_logit_bias_equals_the_host_api() {
    let (device, dev) = super::gpu();
    let p = request_bias(DType::BF16);
    let sampler = Sampler::new(p.clone(), &device).unwrap();
    let case = Case::random(&p, 12, 128, 20_000, 8, 8.0);
    let params = case.params(&p);
    let host = case.run(&sampler).unwrap();
    case.check(&p, &host, &(0..12).collect::<Vec<_>>()).unwrap();
    let plan = sampler.cuda().unwrap().plan(16, case.dim, case.vocab).unwrap();
    let inputs = DeviceCase::upload(&dev, &p, &case, &params);
    let mut outputs = DeviceResults::alloc(&dev, &p, case.batch);
    let stream = dev.context().new_stream().unwrap();
    plan.launch(&stream, inputs.inputs(&stream), outputs.outputs(&stream)).unwrap();
    let got = outputs.read(&stream);
    // A lone top-p row whose nucleus outgrew the lists is served exactly by both APIs, by the
    // plan's nucleus kernels up to its R rows; the device API reports any past them as status 4
    // (DESIGN.md "Exact nucleus on the device"). Every sampled row must be the host API's, bit
    // for bit.
    let errors = row_errors(&plan, &got.status);
    let samples = got.tokens.len() / case.batch;
    let scores = host.scores.as_ref().expect("the pipeline outputs scores");
    let mut compared = 0;
    for (row, error) in errors.iter().enumerate() {
        let at = row * samples..(row + 1) * samples;
        match error {
            None => {
                assert_eq!(got.tokens[at.clone()], host.tokens[at.clone()], "row {row}");
                assert_eq!(got.scores[at.clone()], scores[at], "row {row}");
                compared += 1;
            }
            Some(RowStatusError::List(ListError::NucleusTooLarge { row: r, .. })) => {
                assert_eq!(*r, row);
                assert!(host.row_errors[row].is_none(), "row {row}: the host API must serve the nucleus exactly");
            }
            Some(e) => panic!("row {row}: {e}"),
        }
    }
    assert!(compared >= case.batch - 2, "only {compared} of {} rows compared: {:?}", case.batch, got.status);
    // A launch without the tables the pipeline declares is refused, naming them.
    let mut missing = inputs.inputs(&stream);
    missing.logit_bias = None;
    let e = plan.launch(&stream, missing, outputs.outputs(&stream)).unwrap_err();
    assert!(matches!(e, Error::Param(ParamError::Missing("logit_bias"))), "{e}");
}
