//! [`Sampler`]: a validated pipeline bound to a device, dispatching each launch to its backend.

use crate::cpu::CpuBackend;
#[cfg(feature = "cuda")]
use crate::cuda::CudaSampler;
use crate::launch::{check_operands, KernelConfig, Samples, Shape};
#[cfg(feature = "cuda")]
use crate::Error;
use crate::{tuning::DeviceIdentity, Device, Result, Tensor, Verified};
use flashsample_abi::SamplingParams;
use flashsample_ir::Pipeline;
use std::sync::Arc;

enum Backend {
    Cpu(CpuBackend),
    #[cfg(feature = "cuda")]
    Cuda(Box<CudaSampler>),
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
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => Backend::Cuda(Box::new(CudaSampler::new(pipeline.clone(), dev.clone()))),
        };
        Ok(Sampler { pipeline, device: device.clone(), backend })
    }

    /// The validated pipeline this sampler runs.
    pub fn pipeline(&self) -> &Pipeline {
        &self.pipeline
    }

    /// The device this sampler runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The CUDA half of this sampler (device-side plans, timing and debug entry points);
    /// `None` on the CPU.
    #[cfg(feature = "cuda")]
    pub fn cuda(&self) -> Option<&CudaSampler> {
        match &self.backend {
            Backend::Cuda(c) => Some(c),
            Backend::Cpu(_) => None,
        }
    }

    /// Samples `pipeline.samples_per_row()` tokens for each row of `hidden` (`[B, D]`) against
    /// `weights` (`[V, D]`), with the tuned (or heuristic) config for this shape.
    ///
    /// Bad inputs fail the call; a row that only the kernels find unsamplable (all masked,
    /// non-finite logits) gets its error in
    /// [`Samples::row_errors`] while every other row is sampled ([`Samples::into_complete`]
    /// turns any such row into the call's error). A top-p / min-p nucleus larger than the
    /// candidate lists is served exactly over its whole vocabulary (DESIGN.md step 9; on CUDA by
    /// the plan's nucleus kernels, "Exact nucleus on the device").
    pub fn sample(&self, hidden: Tensor<'_>, weights: Tensor<'_>, params: &SamplingParams<'_>) -> Result<Samples> {
        if self.pipeline.verify.is_some() {
            return Err(crate::Error::Unsupported("a pipeline with `verify` runs through `Sampler::verify`".into()));
        }
        let shape = self.check(&hidden, &weights, params)?;
        let config = self.config_for(shape.batch, shape.dim, shape.vocab);
        self.launch(&hidden, &weights, params, shape, &config)
    }

    /// Verifies speculative drafts (a pipeline with `verify`, DESIGN.md "Speculative
    /// verification"): the `B` rows of `hidden` are `S` sequences of `k + 1` target positions
    /// (row `i·(k+1) + j` predicts draft `j` of sequence `i`, row `i·(k+1) + k` the bonus),
    /// `params.drafts` holds the `S·k` draft tokens and, for sampled drafts,
    /// `params.draft_probs` their `[S·k, V]` distributions. Bad drafts are typed errors
    /// (`ParamError::Draft`, naming sequence and position). `k = 0` is plain sampling.
    pub fn verify(&self, hidden: Tensor<'_>, weights: Tensor<'_>, params: &SamplingParams<'_>) -> Result<Verified> {
        if self.pipeline.verify.is_none() {
            return Err(crate::Error::Unsupported("`verify` needs a pipeline with `accept = verify(...)`".into()));
        }
        let shape = self.check(&hidden, &weights, params)?;
        let config = self.config_for(shape.batch, shape.dim, shape.vocab);
        match (&self.backend, config) {
            (Backend::Cpu(cpu), KernelConfig::Cpu(c)) => cpu.verify(&hidden, &weights, params, shape, &c),
            #[cfg(feature = "cuda")]
            (Backend::Cuda(cuda), KernelConfig::Cuda(c)) => cuda.verify(&hidden, &weights, params, shape, &c),
            #[cfg(feature = "cuda")]
            _ => Err(Error::ConfigBackend { sampler: self.device.describe() }),
        }
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
    /// every stage, inputs uploaded once before the timed launches.
    pub fn time_with(
        &self,
        hidden: Tensor<'_>,
        weights: Tensor<'_>,
        params: &SamplingParams<'_>,
        config: &KernelConfig,
        warmup: usize,
        reps: usize,
    ) -> Result<Vec<f64>> {
        #[cfg(feature = "cuda")]
        if let Backend::Cuda(cuda) = &self.backend {
            return cuda.time_fused(hidden, &[weights], params, Some(config), warmup, reps);
        }
        let shape = self.check(&hidden, &weights, params)?;
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
            #[cfg(feature = "cuda")]
            Backend::Cuda(cuda) => KernelConfig::Cuda(cuda.config_for(shape)),
        }
    }

    /// The backend's documented fallback heuristic for this shape.
    pub fn heuristic_config(&self, batch: usize, dim: usize, vocab: usize) -> KernelConfig {
        let shape = Shape { batch, dim, vocab };
        match &self.backend {
            Backend::Cpu(cpu) => KernelConfig::Cpu(cpu.heuristic(shape)),
            #[cfg(feature = "cuda")]
            Backend::Cuda(cuda) => KernelConfig::Cuda(cuda.heuristic(shape)),
        }
    }

    /// The identity tuning files key this sampler's device by.
    pub fn device_identity(&self) -> DeviceIdentity {
        match &self.backend {
            Backend::Cpu(cpu) => cpu.identity(),
            #[cfg(feature = "cuda")]
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
            #[cfg(feature = "cuda")]
            (Backend::Cuda(cuda), KernelConfig::Cuda(c)) => cuda.sample(hidden, weights, params, shape, c),
            #[cfg(feature = "cuda")]
            _ => Err(Error::ConfigBackend { sampler: self.device.describe() }),
        }
    }

    fn check(&self, hidden: &Tensor<'_>, weights: &Tensor<'_>, params: &SamplingParams<'_>) -> Result<Shape> {
        let shape = check_operands(&self.pipeline, hidden, weights)?;
        params.validate(&self.pipeline, shape.batch, shape.vocab)?;
        Ok(shape)
    }
}
