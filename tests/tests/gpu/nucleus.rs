//! The exact nucleus on the device (DESIGN.md "Exact nucleus on the device"): a row whose
//! top-p / min-p nucleus outgrows the lists (status 4 from stage three) is sampled by the
//! plan's nucleus kernels, on the device API and the host API, inside a captured graph too.
//!
//! The host cut (`stage_three::finish_exact`, which serves rows past the plan's `R`) is the
//! yardstick: rows that hold one distribution and one noise stream (identical hidden rows,
//! parameters and row seed) must get bit-identical tokens, scores and logprobs whether the
//! kernels or the host cut served them, and every row must match the float64 reference
//! pathwise. Small shapes, so the whole file runs in seconds.
//!
//! Every test needs a CUDA GPU: they are ignored by default and fail without one. Run them with
//! `cargo test --release -p flashsample-tests --test gpu nucleus -- --include-ignored`.

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use flashsample::cuda::DEFAULT_NUCLEUS_ROWS;
use flashsample::{RowFilter, Sampler, Samples, SamplingParams};
use flashsample_abi::RowStatus;
use flashsample_ir::{DType, Outputs, Pipeline, PipelineBuilder};
use flashsample_tests::gpu::{gpu, DeviceCase, DeviceResults, HostResults};
use flashsample_tests::{Case, MatrixData};

/// Rows of the twin cases whose nucleus outgrows the lists: the first `DEFAULT_NUCLEUS_ROWS`
/// are the kernels', the last one is past `R` (the host cut on the host API, status 4 on the
/// device API).
const NUCLEUS_ROWS: [usize; 3] = [1, 4, 6];
const BATCH: usize = 8;

fn serving(dtype: DType) -> Pipeline {
    PipelineBuilder::new("NucleusServing", dtype, dtype)
        .penalties("penalties")
        .temperature_per_row("t")
        .mask("allowed")
        .filter("filter", 8)
        .gumbel("seed", 2)
        .outputs(Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 5 })
        .build()
        .unwrap()
}

/// `BATCH` identical rows (one hidden state, mask, bans, penalties) with flat logits; the
/// [`NUCLEUS_ROWS`] take `filter` at T = 2, the others a top-k of 5. With `ties`, the weights
/// repeat in groups of four tokens, so many logits tie and the sort's token order decides.
fn twin_case(p: &Pipeline, dim: usize, vocab: usize, filter: RowFilter, ties: bool) -> Case {
    let mut case = Case::identical_rows(p, BATCH, dim, vocab, 1e-3);
    if ties {
        let w = &case.weights.exact;
        let tied: Vec<f32> = (0..vocab).flat_map(|v| w[(v - v % 4) * dim..][..dim].to_vec()).collect();
        case.weights = MatrixData::from_f32(p.weights.dtype, vocab, dim, &tied);
    }
    for r in 0..BATCH {
        case.filters[r] = if NUCLEUS_ROWS.contains(&r) { filter } else { RowFilter::top_k(5) };
        if NUCLEUS_ROWS.contains(&r) {
            case.temperatures[r] = 2.0;
        }
    }
    case
}

/// The host API with one row seed for every row (so the twin rows share their noise).
fn host(sampler: &Sampler, case: &Case, params: &SamplingParams<'_>) -> Samples {
    sampler.sample(case.hidden.tensor(), case.weights.tensor(), params).expect("host API")
}

/// One device launch on a fresh stream with a plan serving `nucleus_rows` rows per chunk.
fn device(sampler: &Sampler, case: &Case, params: &SamplingParams<'_>, nucleus_rows: usize) -> HostResults {
    let cuda = sampler.cuda().expect("a CUDA sampler");
    let dev = cuda.device().clone();
    let p = sampler.pipeline();
    let plan = cuda.plan_with_nucleus_rows(case.batch, case.dim, case.vocab, nucleus_rows).expect("plan");
    assert_eq!(plan.nucleus_rows(), nucleus_rows);
    let inputs = DeviceCase::upload(&dev, p, case, params);
    let mut outputs = DeviceResults::alloc(&dev, p, case.batch);
    let stream = dev.context().new_stream().expect("a caller stream");
    plan.launch(&stream, inputs.inputs(&stream), outputs.outputs(&stream)).expect("device launch");
    outputs.read(&stream)
}

/// Row `r`'s samples of `s` per row: (tokens, score bits, logprob bits).
fn row_of(tokens: &[u32], scores: &[f32], logprobs: &[f32], r: usize, s: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let bits = |v: &[f32]| v[r * s..][..s].iter().map(|x| x.to_bits()).collect();
    (tokens[r * s..][..s].to_vec(), bits(scores), bits(logprobs))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_nucleus_past_the_lists_equals_the_host_cut_bit_for_bit() {
    let (device_handle, _dev) = gpu();
    let filters = [
        RowFilter::top_p(0.95),
        RowFilter { min_p: 0.001, ..RowFilter::OFF },
        RowFilter { top_k: 0, top_p: 0.9, min_p: 0.0005 },
    ];
    for (dtype, dim, vocab) in [(DType::BF16, 64usize, 5000usize), (DType::BF16, 256, 32_000), (DType::F32, 64, 5000)] {
        let p = serving(dtype);
        let sampler = Sampler::new(p.clone(), &device_handle).unwrap();
        let s = p.samples_per_row() as usize;
        for filter in filters {
            for ties in [false, true] {
                let what = format!("{dtype:?} D={dim} V={vocab} {filter:?} ties={ties}");
                let case = twin_case(&p, dim, vocab, filter, ties);
                for &r in &NUCLEUS_ROWS {
                    assert!(case.kept_by_filter(&p, r) > 8, "{what}: row {r}'s nucleus fits the lists");
                }
                let seeds = vec![0x5eed_u64; BATCH];
                let mut params = case.params(&p);
                params.row_seeds = Some(&seeds);
                let h = host(&sampler, &case, &params);
                assert!(h.is_complete(), "{what}: {:?}", h.row_errors);
                let (scores, logprobs) = (h.scores.as_ref().unwrap(), h.logprobs.as_ref().unwrap());
                let twin = |r| row_of(&h.tokens, scores, logprobs, r, s);
                // Rows 1 and 4 by the kernels, row 6 by the host cut: one distribution, one noise.
                assert_eq!(twin(NUCLEUS_ROWS[0]), twin(NUCLEUS_ROWS[2]), "{what}: kernels vs host cut");
                assert_eq!(twin(NUCLEUS_ROWS[1]), twin(NUCLEUS_ROWS[2]), "{what}: kernels vs host cut");
                case.check_with(&p, &params, &h, &(0..BATCH).collect::<Vec<_>>()).unwrap_or_else(|e| panic!("{what}: {e}"));

                // The device API: R rows served as the host API serves them, the next one reported.
                let got = device(&sampler, &case, &params, DEFAULT_NUCLEUS_ROWS);
                let last = NUCLEUS_ROWS[2];
                for r in 0..BATCH {
                    if r == last {
                        assert_eq!(got.status[r], RowStatus::NucleusTooLarge.code(), "{what}: row {r} is past R");
                        continue;
                    }
                    assert_eq!(got.status[r], RowStatus::Ok.code(), "{what}: row {r}");
                    let dev_row = row_of(&got.tokens, &got.scores, got.logprobs.as_ref().unwrap(), r, s);
                    assert_eq!(dev_row, twin(r), "{what}: device API row {r}");
                }
                // A plan of R = 3 serves the last one too; R = 0 serves none.
                let all = device(&sampler, &case, &params, NUCLEUS_ROWS.len());
                assert!(all.status.iter().all(|&c| c == RowStatus::Ok.code()), "{what}: {:?}", all.status);
                assert_eq!(all.tokens, h.tokens, "{what}: R = 3");
                let none = device(&sampler, &case, &params, 0);
                for &r in &NUCLEUS_ROWS {
                    assert_eq!(none.status[r], RowStatus::NucleusTooLarge.code(), "{what}: R = 0, row {r}");
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_nucleus_row_is_served_inside_a_captured_graph() {
    let (device_handle, _dev) = gpu();
    let p = serving(DType::BF16);
    let sampler = Sampler::new(p.clone(), &device_handle).unwrap();
    let case = twin_case(&p, 128, 20_000, RowFilter::top_p(0.95), false);
    let params = case.params(&p);
    let want = device(&sampler, &case, &params, NUCLEUS_ROWS.len());
    assert!(want.status.iter().all(|&c| c == RowStatus::Ok.code()), "{:?}", want.status);

    let cuda = sampler.cuda().unwrap();
    let dev = cuda.device().clone();
    let plan = cuda.plan_with_nucleus_rows(BATCH, case.dim, case.vocab, NUCLEUS_ROWS.len()).unwrap();
    let inputs = DeviceCase::upload(&dev, &p, &case, &params);
    let mut outputs = DeviceResults::alloc(&dev, &p, BATCH);
    let stream = dev.context().new_stream().unwrap();
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    plan.launch(&stream, inputs.inputs(&stream), outputs.outputs(&stream)).unwrap();
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("a captured graph");
    for replay in 0..3 {
        graph.launch().unwrap();
        let got = outputs.read(&stream);
        assert_eq!(got, want, "replay {replay}: the graph differs from the direct launch");
    }
}

/// More picked rows than the multiply's 8 columns: the logits kernel takes them 8 at a time.
/// Twelve twin rows on a lone top-p, a plan of R = 10: rows 0..10 by the kernels, 10 and 11
/// reported on the device API and served by the host cut on the host API; all equal.
#[test]
#[ignore = "needs a CUDA GPU"]
fn more_nucleus_rows_than_the_multiplys_columns() {
    let (device_handle, _dev) = gpu();
    let p = serving(DType::BF16);
    let sampler = Sampler::new(p.clone(), &device_handle).unwrap();
    let batch = 12;
    let mut case = Case::identical_rows(&p, batch, 64, 5000, 1e-3);
    case.filters.iter_mut().for_each(|f| *f = RowFilter::top_p(0.95));
    case.temperatures.iter_mut().for_each(|t| *t = 2.0);
    let seeds = vec![0x5eed_u64; batch];
    let mut params = case.params(&p);
    params.row_seeds = Some(&seeds);
    let h = host(&sampler, &case, &params);
    assert!(h.is_complete(), "{:?}", h.row_errors);
    let s = p.samples_per_row() as usize;
    let (scores, logprobs) = (h.scores.as_ref().unwrap(), h.logprobs.as_ref().unwrap());
    for r in 1..batch {
        assert_eq!(row_of(&h.tokens, scores, logprobs, r, s), row_of(&h.tokens, scores, logprobs, 0, s), "row {r}");
    }
    let got = device(&sampler, &case, &params, 10);
    for r in 0..batch {
        if r < 10 {
            assert_eq!(got.status[r], RowStatus::Ok.code(), "row {r}");
            assert_eq!(row_of(&got.tokens, &got.scores, got.logprobs.as_ref().unwrap(), r, s), row_of(&h.tokens, scores, logprobs, r, s), "row {r}");
        } else {
            assert_eq!(got.status[r], RowStatus::NucleusTooLarge.code(), "row {r}");
        }
    }
}
