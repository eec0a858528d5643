//! GPU fixtures for the device-API tests and the decode-loop example: a [`Case`] in device
//! buffers (the device API's inputs and outputs), and a toy decode model whose next hidden
//! states are the embeddings of the last tokens, gathered on the device by a small PTX kernel.

use crate::{Case, MatrixData};
use crate::elementwise;
use flashsample::cuda::{
    DeviceDrafts, DeviceIn, DeviceInputs, DeviceLogitBias, DeviceMatrix, DeviceOut, DeviceOutputs, DevicePenalties, DeviceRowTokens,
    SamplingPlan, VerifyOutputs,
};
use flashsample::{bf16, f16, CudaDevice, Device, DeviceTensor, RowFilter, RowStatusError, SamplingParams};
use flashsample_abi::{RowTokens, Scored};
use flashsample_ir::{DType, Pipeline, Temperature, Transform};
use std::sync::Arc;
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, PushKernelArg};
use cudarc::nvrtc::Ptx;

/// `cuda:0`; panics without one (GPU tests are `#[ignore]`d and must fail, not pass, without a GPU).
pub fn gpu() -> (Device, Arc<CudaDevice>) {
    let d = Device::cuda(0).unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}"));
    let Device::Cuda(c) = &d else { unreachable!("Device::cuda returns a CUDA device") };
    let c = c.clone();
    (d, c)
}

impl MatrixData {
    /// This matrix on `dev` (in its dtype).
    pub fn upload(&self, dev: &Arc<CudaDevice>) -> DeviceTensor {
        let t = match self.dtype {
            DType::BF16 => dev.upload(&self.bf16, self.rows, self.cols),
            DType::F16 => dev.upload(&self.f16, self.rows, self.cols),
            DType::F32 => dev.upload(&self.exact, self.rows, self.cols),
        };
        t.expect("upload")
    }

    /// The bf16 elements (bf16 matrices only).
    pub fn bf16_elements(&self) -> &[bf16] {
        &self.bf16
    }

    /// The f16 elements (f16 matrices only).
    pub fn f16_elements(&self) -> &[f16] {
        &self.f16
    }
}

/// A host vector on the device; an empty one becomes one zero element (no zero-size buffers).
fn up<T: cudarc::driver::DeviceRepr + Copy + Default>(stream: &Arc<CudaStream>, v: &[T]) -> CudaSlice<T> {
    let v: Vec<T> = if v.is_empty() { vec![T::default()] } else { v.to_vec() };
    stream.clone_htod(&v).expect("cuMemcpyHtoD")
}

/// A [`Case`]'s launch in device buffers, as an engine would hold it.
pub struct DeviceCase {
    pub hidden: DeviceTensor,
    pub weights: DeviceTensor,
    pub seed: u64,
    pub vocab_offset: u32,
    pub temperatures: Option<CudaSlice<f32>>,
    pub bias: Option<CudaSlice<f32>>,
    pub allowed: Option<CudaSlice<u32>>,
    pub row_seeds: Option<CudaSlice<u64>>,
    pub row_steps: Option<CudaSlice<u32>>,
    /// `RowFilter`s as their three words each.
    pub filters: Option<CudaSlice<u32>>,
    pub penalties: Option<PenaltyBuffers>,
    pub logit_bias: Option<LogitBiasBuffers>,
    /// The tokens each row scores (`target_logprob`).
    pub targets: Option<CudaSlice<u32>>,
}

/// `abi::RowTokens` in device buffers.
pub struct RowTokenBuffers {
    pub bits: CudaSlice<u32>,
    pub offsets: CudaSlice<u32>,
    pub tokens: CudaSlice<u32>,
}

impl RowTokenBuffers {
    fn upload(s: &Arc<CudaStream>, t: &RowTokens) -> RowTokenBuffers {
        RowTokenBuffers { bits: up(s, &t.bits), offsets: up(s, &t.offsets), tokens: up(s, &t.tokens) }
    }

    fn inputs<'a>(&'a self, stream: &'a CudaStream) -> DeviceRowTokens<'a> {
        DeviceRowTokens {
            bits: DeviceIn::new(&self.bits, stream).expect("bits"),
            offsets: DeviceIn::new(&self.offsets, stream).expect("offsets"),
            tokens: DeviceIn::new(&self.tokens, stream).expect("tokens"),
        }
    }
}

/// `abi::PenaltyTable` in device buffers.
pub struct PenaltyBuffers {
    pub listed: RowTokenBuffers,
    pub subtract: CudaSlice<f32>,
    pub repetition: CudaSlice<f32>,
}

/// `abi::LogitBiasTable` in device buffers.
pub struct LogitBiasBuffers {
    pub listed: RowTokenBuffers,
    pub values: CudaSlice<f32>,
}

impl DeviceCase {
    /// Uploads `params` (a [`Case`]'s, possibly with row seeds or steps) as the device API takes them.
    pub fn upload(dev: &Arc<CudaDevice>, p: &Pipeline, case: &Case, params: &SamplingParams<'_>) -> DeviceCase {
        let s = dev.stream();
        let (b, v) = (case.batch, case.vocab);
        let run_time_t = matches!(p.temperature(), Some(Temperature::Scalar { .. } | Temperature::PerRow { .. }));
        let has_bias = p.transforms.iter().any(|t| matches!(t, Transform::Bias { .. }));
        let d = DeviceCase {
            hidden: case.hidden.upload(dev),
            weights: case.weights.upload(dev),
            seed: params.seed,
            vocab_offset: params.vocab_offset,
            temperatures: run_time_t.then(|| up(s, &params.row_temperatures(p, b))),
            bias: has_bias.then(|| up(s, params.bias.expect("bias"))),
            allowed: params.allowed_bitset(b, v).map(|a| up(s, &a)),
            row_seeds: params.row_seeds.map(|x| up(s, x)),
            row_steps: params.row_steps.map(|x| up(s, x)),
            filters: params.filter.map(|f| up(s, bytemuck::cast_slice::<RowFilter, u32>(f))),
            penalties: params
                .penalty_table(b, v)
                .map(|t| PenaltyBuffers {
                    listed: RowTokenBuffers::upload(s, &t.listed),
                    subtract: up(s, &t.subtract),
                    repetition: up(s, &t.repetition),
                }),
            logit_bias: params
                .logit_bias_table(b, v)
                .map(|t| LogitBiasBuffers { listed: RowTokenBuffers::upload(s, &t.listed), values: up(s, &t.values) }),
            targets: params.targets.map(|t| up(s, t)),
        };
        dev.synchronize().expect("uploads");
        d
    }

    /// The device API's inputs, read on `stream`.
    pub fn inputs<'a>(&'a self, stream: &'a CudaStream) -> DeviceInputs<'a> {
        let i = |b: &'a Option<CudaSlice<f32>>| b.as_ref().map(|b| DeviceIn::new(b, stream).expect("f32 buffer"));
        let mut inputs = DeviceInputs::new(DeviceMatrix::from_tensor(&self.hidden), DeviceMatrix::from_tensor(&self.weights), self.seed);
        inputs.vocab_offset = self.vocab_offset;
        inputs.temperatures = i(&self.temperatures);
        inputs.bias = i(&self.bias);
        inputs.allowed = self.allowed.as_ref().map(|b| DeviceIn::new(b, stream).expect("bitset"));
        inputs.row_seeds = self.row_seeds.as_ref().map(|b| DeviceIn::new(b, stream).expect("seeds"));
        inputs.row_steps = self.row_steps.as_ref().map(|b| DeviceIn::new(b, stream).expect("steps"));
        inputs.filters = self.filters.as_ref().map(|b| DeviceIn::new(b, stream).expect("filters"));
        inputs.penalties = self.penalties.as_ref().map(|t| DevicePenalties {
            listed: t.listed.inputs(stream),
            subtract: DeviceIn::new(&t.subtract, stream).expect("subtract"),
            repetition: DeviceIn::new(&t.repetition, stream).expect("repetition"),
        });
        inputs.logit_bias = self.logit_bias.as_ref().map(|t| DeviceLogitBias {
            listed: t.listed.inputs(stream),
            values: DeviceIn::new(&t.values, stream).expect("values"),
        });
        inputs.targets = self.targets.as_ref().map(|b| DeviceIn::new(b, stream).expect("targets"));
        inputs
    }
}

/// Device buffers for every output a pipeline can return.
pub struct DeviceResults {
    pub tokens: CudaSlice<u32>,
    pub status: CudaSlice<u32>,
    pub scores: CudaSlice<f32>,
    pub logsumexp: Option<CudaSlice<f32>>,
    pub logprobs: Option<CudaSlice<f32>>,
    /// `Scored` as two words each.
    pub top: Option<CudaSlice<u32>>,
    pub target_logprobs: Option<CudaSlice<f32>>,
    pub target_ranks: Option<CudaSlice<u32>>,
}

/// What a device launch wrote, copied back.
#[derive(Clone, Debug, PartialEq)]
pub struct HostResults {
    pub tokens: Vec<u32>,
    pub status: Vec<u32>,
    pub scores: Vec<f32>,
    pub logsumexp: Option<Vec<f32>>,
    pub logprobs: Option<Vec<f32>>,
    pub top: Option<Vec<Scored>>,
    pub target_logprobs: Option<Vec<f32>>,
    pub target_ranks: Option<Vec<u32>>,
}

impl DeviceResults {
    /// Outputs for `batch` rows of `p` (logsumexp and logprobs when the pipeline computes a
    /// logsumexp, top logprobs when it declares them).
    pub fn alloc(dev: &Arc<CudaDevice>, p: &Pipeline, batch: usize) -> DeviceResults {
        let s = dev.stream();
        let n = batch * p.samples_per_row() as usize;
        let lse = p.needs_logsumexp();
        let top_n = p.outputs.top_logprobs as usize;
        DeviceResults {
            tokens: s.alloc_zeros(n).expect("alloc"),
            status: s.alloc_zeros(batch).expect("alloc"),
            scores: s.alloc_zeros(n).expect("alloc"),
            logsumexp: lse.then(|| s.alloc_zeros(batch).expect("alloc")),
            logprobs: lse.then(|| s.alloc_zeros(n).expect("alloc")),
            top: (top_n > 0).then(|| s.alloc_zeros(batch * top_n * 2).expect("alloc")),
            target_logprobs: p.targets.is_some().then(|| s.alloc_zeros(batch).expect("alloc")),
            target_ranks: p.ranks_targets().then(|| s.alloc_zeros(batch).expect("alloc")),
        }
    }

    /// The device API's outputs, written on `stream`.
    pub fn outputs<'a>(&'a mut self, stream: &'a CudaStream) -> DeviceOutputs<'a> {
        let mut o = DeviceOutputs::new(DeviceOut::new(&mut self.tokens, stream).expect("tokens"), DeviceOut::new(&mut self.status, stream).expect("status"));
        o.scores = Some(DeviceOut::new(&mut self.scores, stream).expect("scores"));
        o.logsumexp = self.logsumexp.as_mut().map(|b| DeviceOut::new(b, stream).expect("lse"));
        o.logprobs = self.logprobs.as_mut().map(|b| DeviceOut::new(b, stream).expect("logprobs"));
        o.top_logprobs = self.top.as_mut().map(|b| DeviceOut::new(b, stream).expect("top"));
        o.target_logprobs = self.target_logprobs.as_mut().map(|b| DeviceOut::new(b, stream).expect("target logprobs"));
        o.target_ranks = self.target_ranks.as_mut().map(|b| DeviceOut::new(b, stream).expect("target ranks"));
        o
    }

    /// Copies everything back (synchronizes `stream`).
    pub fn read(&self, stream: &Arc<CudaStream>) -> HostResults {
        let get_u = |b: &CudaSlice<u32>| stream.clone_dtoh(b).expect("dtoh");
        let get_f = |b: &CudaSlice<f32>| stream.clone_dtoh(b).expect("dtoh");
        let out = HostResults {
            tokens: get_u(&self.tokens),
            status: get_u(&self.status),
            scores: get_f(&self.scores),
            logsumexp: self.logsumexp.as_ref().map(get_f),
            logprobs: self.logprobs.as_ref().map(get_f),
            top: self.top.as_ref().map(|b| bytemuck::cast_slice(&get_u(b)).to_vec()),
            target_logprobs: self.target_logprobs.as_ref().map(get_f),
            target_ranks: self.target_ranks.as_ref().map(get_u),
        };
        stream.synchronize().expect("sync");
        out
    }
}

/// The typed outcome of every row of a device launch's status buffer.
pub fn row_errors(plan: &SamplingPlan, status: &[u32]) -> Vec<Option<RowStatusError>> {
    plan.row_errors(status).expect("known status codes")
}

/// The toy decode model's kernels: the embedding gather and the step counter's increment.
fn toy_ptx() -> String {
    let gather = elementwise::entry(
        "fs_test_gather_16bit",
        &[".u64 table", ".u64 tokens", ".u64 hidden", ".u32 n", ".u32 dim", ".u32 vocab"],
        &[".pred %p<3>", ".b32 %r<12>", ".b16 %h1", ".b64 %rd<12>"],
        "G_DONE",
        r#"
    ld.param.u32 %r6, [dim];
    div.u32 %r7, %r4, %r6;
    rem.u32 %r8, %r4, %r6;
    ld.param.u64 %rd1, [tokens];
    cvta.to.global.u64 %rd1, %rd1;
    mul.wide.u32 %rd2, %r7, 4;
    add.s64 %rd3, %rd1, %rd2;
    ld.global.u32 %r9, [%rd3];
    ld.param.u32 %r10, [vocab];
    setp.ge.u32 %p2, %r9, %r10;
    mov.u16 %h1, 0;
    @%p2 bra G_STORE;
    ld.param.u64 %rd4, [table];
    cvta.to.global.u64 %rd4, %rd4;
    mul.wide.u32 %rd5, %r9, %r6;
    cvt.u64.u32 %rd6, %r8;
    add.s64 %rd5, %rd5, %rd6;
    shl.b64 %rd5, %rd5, 1;
    add.s64 %rd7, %rd4, %rd5;
    ld.global.u16 %h1, [%rd7];
G_STORE:
    ld.param.u64 %rd8, [hidden];
    cvta.to.global.u64 %rd8, %rd8;
    mul.wide.u32 %rd9, %r4, 2;
    add.s64 %rd10, %rd8, %rd9;
    st.global.u16 [%rd10], %h1;
"#,
    );
    let advance = elementwise::entry(
        "fs_test_advance_steps",
        &[".u64 steps", ".u32 n"],
        &[".pred %p1", ".b32 %r<8>", ".b64 %rd<4>"],
        "A_DONE",
        r#"
    ld.param.u64 %rd1, [steps];
    cvta.to.global.u64 %rd1, %rd1;
    mul.wide.u32 %rd2, %r4, 4;
    add.s64 %rd3, %rd1, %rd2;
    ld.global.u32 %r6, [%rd3];
    add.u32 %r6, %r6, 1;
    st.global.u32 [%rd3], %r6;
"#,
    );
    format!("{}\n{gather}\n{advance}", elementwise::MODULE_HEADER)
}

/// The toy decode loop's device kernels, loaded into the device's context.
pub struct ToyKernels {
    gather: CudaFunction,
    advance: CudaFunction,
    _module: Arc<CudaModule>,
}

impl ToyKernels {
    pub fn load(dev: &CudaDevice) -> ToyKernels {
        let module = dev.context().load_module(Ptx::from_src(toy_ptx())).expect("the toy kernels load");
        ToyKernels {
            gather: module.load_function("fs_test_gather_16bit").expect("gather"),
            advance: module.load_function("fs_test_advance_steps").expect("advance"),
            _module: module,
        }
    }

    /// `hidden[r, :] = table[tokens[r], :]` for `batch` rows of `dim` 16-bit elements (zeros
    /// for a token past `vocab`, as a failed row's `INDEX_NONE`).
    #[allow(clippy::too_many_arguments)]
    pub fn gather(&self, stream: &CudaStream, table: u64, tokens: u64, hidden: u64, batch: usize, dim: usize, vocab: usize) {
        let (n, d, v) = ((batch * dim) as u32, dim as u32, vocab as u32);
        let mut b = stream.launch_builder(&self.gather);
        b.arg(&table).arg(&tokens).arg(&hidden).arg(&n).arg(&d).arg(&v);
        // SAFETY: the signature above; the caller's buffers hold the shapes it names.
        unsafe { b.launch(elementwise::grid(n)) }.expect("gather launch");
    }

    /// `steps[r] += 1` for `n` rows.
    pub fn advance(&self, stream: &CudaStream, steps: u64, n: usize) {
        let n32 = n as u32;
        let mut b = stream.launch_builder(&self.advance);
        b.arg(&steps).arg(&n32);
        // SAFETY: the signature above; `steps` holds `n` u32.
        unsafe { b.launch(elementwise::grid(n32)) }.expect("advance launch");
    }
}

/// The address of a buffer of the device's context (flashsample turns its event tracking off,
/// so the guard records nothing).
pub fn addr<T>(b: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    b.device_ptr(stream).0
}

/// A toy decode model: the next hidden state of a row is the embedding (`table[token]`) of its
/// last token, then the LM head samples the next token. Tokens never need to leave the GPU.
pub struct ToyDecode {
    pub pipeline: Pipeline,
    pub batch: usize,
    pub dim: usize,
    pub vocab: usize,
    /// `[V, D]` bf16 embeddings.
    pub table: MatrixData,
    /// `[V, D]` bf16 LM head.
    pub weights: MatrixData,
    pub temperatures: Vec<f32>,
    pub row_seeds: Vec<u64>,
    /// Each row's token before step 0.
    pub first: Vec<u32>,
}

/// The device state of a [`ToyDecode`] loop: every step's tokens and statuses stay on the GPU.
pub struct DecodeBuffers {
    pub table: DeviceTensor,
    pub weights: DeviceTensor,
    /// `[B, D]` hidden states, rewritten by each step's gather.
    pub hidden: CudaSlice<bf16>,
    pub temperatures: CudaSlice<f32>,
    pub row_seeds: CudaSlice<u64>,
    /// `[B]` decode steps, advanced on the device after each step (when the loop uses steps).
    pub steps: CudaSlice<u32>,
    /// `[(steps + 1) · B]`: the first tokens, then each step's samples.
    pub history: CudaSlice<u32>,
    /// `[steps · B]` each step's row statuses.
    pub status: CudaSlice<u32>,
}

impl ToyDecode {
    /// A random model: per-row temperatures (row 1 greedy), a seed per request.
    pub fn new(batch: usize, dim: usize, vocab: usize, seed: u64) -> ToyDecode {
        use rand::{Rng, SeedableRng};
        let pipeline = flashsample_ir::PipelineBuilder::new("ToyDecode", DType::BF16, DType::BF16)
            .temperature_per_row("t")
            .build()
            .expect("a valid pipeline");
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let table = MatrixData::random(&mut rng, DType::BF16, vocab, dim, 1.0);
        let weights = MatrixData::random(&mut rng, DType::BF16, vocab, dim, 3.0 / (dim as f32).sqrt());
        ToyDecode {
            pipeline,
            batch,
            dim,
            vocab,
            table,
            weights,
            temperatures: (0..batch).map(|r| if r == 1 { 0.0 } else { rng.random_range(0.5..1.2) }).collect(),
            row_seeds: (0..batch).map(|_| rng.random()).collect(),
            first: (0..batch).map(|_| rng.random_range(0..vocab as u32)).collect(),
        }
    }

    /// The host API's parameters at `step` (`None`: the loop draws no per-step noise).
    pub fn params<'a>(&'a self, steps: Option<&'a [u32]>) -> SamplingParams<'a> {
        SamplingParams {
            temperature: flashsample::TemperatureArg::PerRow(&self.temperatures),
            row_seeds: Some(&self.row_seeds),
            row_steps: steps,
            ..Default::default()
        }
    }

    /// `steps` steps through the host API (hidden states gathered on the host, weights on the
    /// device): each step's tokens.
    pub fn host_loop(&self, sampler: &flashsample::Sampler, weights: &DeviceTensor, steps: usize, with_steps: bool) -> Vec<Vec<u32>> {
        let table = self.table.bf16_elements();
        let mut last = self.first.clone();
        let mut out = Vec::with_capacity(steps);
        for step in 0..steps {
            let hidden: Vec<bf16> = last.iter().flat_map(|&t| table[t as usize * self.dim..][..self.dim].iter().copied()).collect();
            let row_steps = vec![step as u32; self.batch];
            let params = self.params(with_steps.then_some(&row_steps[..]));
            let got = sampler
                .sample(flashsample::Tensor::host(&hidden, self.batch, self.dim).expect("shape"), flashsample::Tensor::device(weights), &params)
                .and_then(flashsample::Samples::into_complete)
                .expect("host step");
            last = got.tokens.clone();
            out.push(got.tokens);
        }
        out
    }

    /// The loop's device buffers for `steps` steps (steps counters at 0).
    pub fn buffers(&self, dev: &Arc<CudaDevice>, steps: usize) -> DecodeBuffers {
        let s = dev.stream();
        let mut history = s.alloc_zeros::<u32>((steps + 1) * self.batch).expect("alloc");
        s.memcpy_htod(&self.first, &mut history.slice_mut(0..self.batch)).expect("htod");
        let b = DecodeBuffers {
            table: self.table.upload(dev),
            weights: self.weights.upload(dev),
            hidden: s.alloc_zeros::<bf16>(self.batch * self.dim).expect("alloc"),
            temperatures: s.clone_htod(&self.temperatures).expect("htod"),
            row_seeds: s.clone_htod(&self.row_seeds).expect("htod"),
            steps: s.alloc_zeros::<u32>(self.batch).expect("alloc"),
            history,
            status: s.alloc_zeros::<u32>(steps.max(1) * self.batch).expect("alloc"),
        };
        dev.synchronize().expect("uploads");
        b
    }

    /// Queues one decode step on `stream`: gather the embeddings of step `step`'s input tokens,
    /// sample into history slot `step + 1`, and (with steps) advance the step counters.
    pub fn enqueue_step(&self, toy: &ToyKernels, plan: &SamplingPlan, stream: &CudaStream, b: &DecodeBuffers, step: usize, with_steps: bool) {
        let n = self.batch;
        let history = addr(&b.history, stream);
        let tokens_in = history + (step * n * 4) as u64;
        let tokens_out = history + ((step + 1) * n * 4) as u64;
        let status = addr(&b.status, stream) + (step * n * 4) as u64;
        toy.gather(stream, b.table.device_address(), tokens_in, addr(&b.hidden, stream), n, self.dim, self.vocab);
        let mut inputs = DeviceInputs::new(
            DeviceMatrix::new(&b.hidden, n, self.dim, stream).expect("hidden"),
            DeviceMatrix::from_tensor(&b.weights),
            0,
        );
        inputs.temperatures = Some(DeviceIn::new(&b.temperatures, stream).expect("temperatures"));
        inputs.row_seeds = Some(DeviceIn::new(&b.row_seeds, stream).expect("seeds"));
        if with_steps {
            inputs.row_steps = Some(DeviceIn::new(&b.steps, stream).expect("steps"));
        }
        // SAFETY: history slot `step + 1` and status slot `step` hold `n` u32 each, inside the
        // buffers `b` owns for the whole loop.
        let outputs = unsafe { DeviceOutputs::new(DeviceOut::from_raw(tokens_out, n), DeviceOut::from_raw(status, n)) };
        plan.launch(stream, inputs, outputs).expect("device launch");
        if with_steps {
            toy.advance(stream, addr(&b.steps, stream), n);
        }
    }

    /// Each step's tokens and statuses from the buffers (synchronizes `stream`).
    pub fn read(&self, stream: &Arc<CudaStream>, b: &DecodeBuffers, steps: usize) -> (Vec<Vec<u32>>, Vec<u32>) {
        let history = stream.clone_dtoh(&b.history).expect("dtoh");
        let status = stream.clone_dtoh(&b.status).expect("dtoh");
        stream.synchronize().expect("sync");
        (history[self.batch..].chunks(self.batch).take(steps).map(<[u32]>::to_vec).collect(), status)
    }
}

/// A verifying device launch's drafts and outputs (`SamplingPlan::launch_verify`) for `S`
/// sequences of `k` drafts.
pub struct DeviceVerify {
    /// `None` for `k = 0` (no drafts).
    pub drafts: Option<CudaSlice<u32>>,
    pub probs: Option<CudaSlice<f32>>,
    pub accepted: CudaSlice<u32>,
    pub tokens: CudaSlice<u32>,
    pub logprobs: Option<CudaSlice<f32>>,
    pub status: CudaSlice<u32>,
    pub row_status: CudaSlice<u32>,
}

/// What a verifying device launch wrote, copied back.
#[derive(Clone, Debug, PartialEq)]
pub struct VerifyResults {
    pub accepted: Vec<u32>,
    pub tokens: Vec<u32>,
    pub logprobs: Option<Vec<f32>>,
    pub status: Vec<u32>,
    pub row_status: Vec<u32>,
}

impl DeviceVerify {
    /// Uploads `drafts` (`[S·k]`) and `probs` (`[S·k, V]`, sampled drafts) and allocates the
    /// outputs (logprobs when `p` outputs them).
    pub fn new(dev: &Arc<CudaDevice>, p: &Pipeline, seqs: usize, k: usize, drafts: &[u32], probs: Option<&[f32]>) -> DeviceVerify {
        let s = dev.stream();
        let d = DeviceVerify {
            drafts: (!drafts.is_empty()).then(|| up(s, drafts)),
            probs: probs.map(|q| up(s, q)),
            accepted: s.alloc_zeros(seqs).expect("alloc"),
            tokens: s.alloc_zeros(seqs * (k + 1)).expect("alloc"),
            logprobs: p.outputs.logprob.then(|| s.alloc_zeros(seqs * (k + 1)).expect("alloc")),
            status: s.alloc_zeros(seqs).expect("alloc"),
            row_status: s.alloc_zeros(seqs * (k + 1)).expect("alloc"),
        };
        dev.synchronize().expect("uploads");
        d
    }

    /// The drafts, read on `stream`, and the outputs, written there.
    pub fn args<'a>(&'a mut self, stream: &'a CudaStream) -> (DeviceDrafts<'a>, VerifyOutputs<'a>) {
        let tokens = match &self.drafts {
            Some(d) => DeviceIn::new(d, stream).expect("drafts"),
            // SAFETY: no element is read.
            None => unsafe { DeviceIn::from_raw(0, 0) },
        };
        let drafts = DeviceDrafts { tokens, probs: self.probs.as_ref().map(|q| DeviceIn::new(q, stream).expect("draft probs")) };
        let outputs = VerifyOutputs {
            accepted: DeviceOut::new(&mut self.accepted, stream).expect("accepted"),
            tokens: DeviceOut::new(&mut self.tokens, stream).expect("tokens"),
            logprobs: self.logprobs.as_mut().map(|b| DeviceOut::new(b, stream).expect("logprobs")),
            status: DeviceOut::new(&mut self.status, stream).expect("status"),
            row_status: DeviceOut::new(&mut self.row_status, stream).expect("row status"),
        };
        (drafts, outputs)
    }

    /// Copies the outputs back (synchronizes `stream`).
    pub fn read(&self, stream: &Arc<CudaStream>) -> VerifyResults {
        let get_u = |b: &CudaSlice<u32>| stream.clone_dtoh(b).expect("dtoh");
        let out = VerifyResults {
            accepted: get_u(&self.accepted),
            tokens: get_u(&self.tokens),
            logprobs: self.logprobs.as_ref().map(|b| stream.clone_dtoh(b).expect("dtoh")),
            status: get_u(&self.status),
            row_status: get_u(&self.row_status),
        };
        stream.synchronize().expect("sync");
        out
    }
}
