use crate::{cpu::CpuBackend, cuda::CudaBackend, tuning::DeviceIdentity, Device, Error, Result, Tensor};
use flashsample_codegen_ptx::GpuConfig;
use flashsample_codegen_cpu::CpuConfig;
use flashsample_abi::{RowResult, SamplingParams};
use flashsample_ir::Pipeline;
use std::sync::Arc;

/// Shapes of one launch, checked against each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Shape {
    pub batch: usize,
    pub dim: usize,
    pub vocab: usize,
}

/// Sampled tokens of one launch, row-major `[batch, samples_per_row]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Samples {
    pub batch: usize,
    pub samples_per_row: usize,
    pub tokens: Vec<u32>,
    /// Winning perturbed score of each sample, if the pipeline declares `outputs(score)`.
    pub scores: Option<Vec<f32>>,
    /// Per-row logsumexp of the transformed logits, if declared.
    pub logsumexp: Option<Vec<f32>>,
    /// Log-probability of each sampled token under the full (unfiltered) distribution, if declared.
    pub logprobs: Option<Vec<f32>>,
    /// Per row, the `top_logprobs` most likely tokens and their log-probabilities (most likely
    /// first; shorter for a row with fewer eligible tokens), if declared.
    pub top_logprobs: Option<Vec<Vec<(u32, f32)>>>,
}

impl Samples {
    /// The samples of one row.
    pub fn row(&self, row: usize) -> &[u32] {
        &self.tokens[row * self.samples_per_row..][..self.samples_per_row]
    }

    pub(crate) fn from_reduced(pipeline: &Pipeline, batch: usize, r: RowResult) -> Samples {
        let s = pipeline.samples_per_row() as usize;
        let logprobs = match (&r.logsumexp, pipeline.outputs.logprob) {
            (Some(lse), true) => Some(r.logits.iter().enumerate().map(|(i, l)| l - lse[i / s]).collect()),
            _ => None,
        };
        Samples {
            batch,
            samples_per_row: s,
            tokens: r.tokens,
            scores: pipeline.outputs.score.then_some(r.scores),
            logsumexp: if pipeline.outputs.logsumexp { r.logsumexp } else { None },
            logprobs,
            top_logprobs: None,
        }
    }
}

/// A backend's tile config: what the autotuner searches and the tuning file stores.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "backend", rename_all = "lowercase")]
pub enum KernelConfig {
    Cpu(CpuConfig),
    Cuda(GpuConfig),
}

pub(crate) enum Backend {
    Cpu(CpuBackend),
    Cuda(Box<CudaBackend>),
}

/// A compiled pipeline bound to a device: validates inputs, launches, reduces.
pub struct Sampler {
    pipeline: Arc<Pipeline>,
    device: Device,
    backend: Backend,
}

impl Sampler {
    /// Validates `pipeline` and prepares it for `device` (kernels compile lazily per shape).
    pub fn new(pipeline: Pipeline, device: &Device) -> Result<Sampler> {
        pipeline.validate()?;
        let pipeline = Arc::new(pipeline);
        let backend = match device {
            Device::Cpu { threads } => Backend::Cpu(CpuBackend::new(pipeline.clone(), *threads)),
            Device::Cuda(dev) => Backend::Cuda(Box::new(CudaBackend::new(pipeline.clone(), dev.clone()))),
        };
        Ok(Sampler { pipeline, device: device.clone(), backend })
    }

    pub fn pipeline(&self) -> &Pipeline {
        &self.pipeline
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Samples `pipeline.samples_per_row()` tokens for each row of `hidden` (`[B, D]`) against
    /// `weights` (`[V, D]`), with the tuned (or heuristic) config for this shape.
    pub fn sample(&self, hidden: Tensor<'_>, weights: Tensor<'_>, params: &SamplingParams<'_>) -> Result<Samples> {
        let shape = self.check(&hidden, &weights, params)?;
        let config = self.config_for(shape.batch, shape.dim, shape.vocab);
        self.launch(&hidden, &weights, params, shape, &config)
    }

    /// [`Sampler::sample`] with an explicit config (the autotuner's entry point).
    pub fn sample_with(
        &self,
        hidden: Tensor<'_>,
        weights: Tensor<'_>,
        params: &SamplingParams<'_>,
        config: &KernelConfig,
    ) -> Result<Samples> {
        let shape = self.check(&hidden, &weights, params)?;
        self.launch(&hidden, &weights, params, shape, config)
    }

    /// Median-free raw timings (seconds) of `reps` launches with `config` after `warmup`:
    /// wall clock around each complete launch on the CPU; on CUDA, device time (events) of
    /// stage one + stage two only, inputs uploaded once before the timed launches.
    pub fn time_with(
        &self,
        hidden: Tensor<'_>,
        weights: Tensor<'_>,
        params: &SamplingParams<'_>,
        config: &KernelConfig,
        warmup: usize,
        reps: usize,
    ) -> Result<Vec<f64>> {
        let shape = self.check(&hidden, &weights, params)?;
        if let (Backend::Cuda(cuda), KernelConfig::Cuda(c)) = (&self.backend, config) {
            return cuda.time(&hidden, &[weights], params, shape, c, warmup, reps);
        }
        for _ in 0..warmup {
            self.launch(&hidden, &weights, params, shape, config)?;
        }
        (0..reps)
            .map(|_| {
                let t = std::time::Instant::now();
                self.launch(&hidden, &weights, params, shape, config).map(|_| t.elapsed().as_secs_f64())
            })
            .collect()
    }

    /// The config [`Sampler::sample`] uses for this shape: the tuning file's nearest entry for
    /// this device, else the backend heuristic.
    pub fn config_for(&self, batch: usize, dim: usize, vocab: usize) -> KernelConfig {
        let shape = Shape { batch, dim, vocab };
        match &self.backend {
            Backend::Cpu(cpu) => KernelConfig::Cpu(cpu.config_for(shape)),
            Backend::Cuda(cuda) => KernelConfig::Cuda(cuda.config_for(shape)),
        }
    }

    /// The backend's documented fallback heuristic for this shape.
    pub fn heuristic_config(&self, batch: usize, dim: usize, vocab: usize) -> KernelConfig {
        let shape = Shape { batch, dim, vocab };
        match &self.backend {
            Backend::Cpu(cpu) => KernelConfig::Cpu(cpu.heuristic(shape)),
            Backend::Cuda(cuda) => KernelConfig::Cuda(cuda.heuristic(shape)),
        }
    }

    /// The identity tuning files key this sampler's device by.
    pub fn device_identity(&self) -> DeviceIdentity {
        match &self.backend {
            Backend::Cpu(cpu) => cpu.identity(),
            Backend::Cuda(cuda) => cuda.identity(),
        }
    }

    fn launch(
        &self,
        hidden: &Tensor<'_>,
        weights: &Tensor<'_>,
        params: &SamplingParams<'_>,
        shape: Shape,
        config: &KernelConfig,
    ) -> Result<Samples> {
        match (&self.backend, config) {
            (Backend::Cpu(cpu), KernelConfig::Cpu(c)) => cpu.sample(hidden, weights, params, shape, c),
            (Backend::Cuda(cuda), KernelConfig::Cuda(c)) => cuda.sample(hidden, weights, params, shape, c),
            _ => Err(Error::ConfigBackend { sampler: self.device.describe() }),
        }
    }

    /// The CUDA backend, for the `cuda` module's benchmark and debug entry points.
    pub(crate) fn cuda_backend(&self) -> Option<&CudaBackend> {
        match &self.backend {
            Backend::Cuda(c) => Some(c),
            Backend::Cpu(_) => None,
        }
    }

    /// Validates inputs against the pipeline; the shape of the launch.
    pub(crate) fn check_inputs(&self, hidden: &Tensor<'_>, weights: &Tensor<'_>, params: &SamplingParams<'_>) -> Result<Shape> {
        self.check(hidden, weights, params)
    }

    fn check(&self, hidden: &Tensor<'_>, weights: &Tensor<'_>, params: &SamplingParams<'_>) -> Result<Shape> {
        let shape = check_operands(&self.pipeline, hidden, weights)?;
        params.validate(&self.pipeline, shape.batch, shape.vocab)?;
        Ok(shape)
    }
}

/// Checks the two matmul operands against the pipeline and each other.
pub(crate) fn check_operands(p: &Pipeline, hidden: &Tensor<'_>, weights: &Tensor<'_>) -> Result<Shape> {
    for (t, op, name) in [(hidden, &p.hidden, "hidden"), (weights, &p.weights, "weights")] {
        if t.dtype != op.dtype {
            return Err(Error::DType { operand: name, expected: op.dtype, got: t.dtype });
        }
    }
    if hidden.rows == 0 {
        return Err(Error::EmptyBatch);
    }
    if hidden.cols == 0 {
        return Err(Error::EmptyOperand("hidden dimension"));
    }
    if weights.rows == 0 {
        return Err(Error::EmptyOperand("vocabulary"));
    }
    if hidden.cols != weights.cols {
        return Err(Error::Shape(format!(
            "matmul contracts hidden [{}, {}] with weights [{}, {}]: {} != {}",
            hidden.rows, hidden.cols, weights.rows, weights.cols, hidden.cols, weights.cols
        )));
    }
    if weights.rows >= INDEX_LIMIT {
        return Err(Error::Shape(format!("vocabulary of {} tokens exceeds the supported {INDEX_LIMIT}", weights.rows)));
    }
    Ok(Shape { batch: hidden.rows, dim: hidden.cols, vocab: weights.rows })
}

/// Token ids must stay below the candidate sentinels (`abi::INDEX_NONFINITE`).
const INDEX_LIMIT: usize = (u32::MAX - 1) as usize;
