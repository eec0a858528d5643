//! flashsample-candle: flashsample's fused LM-head sampling as an op on candle tensors.
//!
//! [`LmHeadSampler::sample`] takes a model's final hidden states `[B, D]` and its LM-head
//! weight `[V, D]` as candle tensors and returns the sampled tokens, `U32 [B, S]` (the next
//! step's input ids when `S = 1`), and the outputs the pipeline declares, as candle tensors,
//! without ever writing the `[B, V]` logits. On candle's CPU device it runs flashsample's
//! Cranelift kernel and reads the LM head in place from candle's storage: the weights are
//! borrowed, never copied (a contiguous row range such as `lm_head.narrow(0, lo, n)`, a
//! vocabulary shard, is borrowed just the same).
//!
//! Tensors on a GPU are a typed error: the CUDA half (flashsample's device API on candle's
//! stream) is not built yet.

pub use flashsample;

use candle_core::{CpuStorage, DType, Device, DeviceLocation, Layout, Storage, Tensor};
use flashsample::{bf16, f16, ir::Pipeline, Samples, Sampler, SamplingParams};

/// The op's two operands, named in errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operand {
    /// The final hidden states, `[B, D]`.
    Hidden,
    /// The LM-head weight, `[V, D]`.
    LmHead,
}

impl std::fmt::Display for Operand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Operand::Hidden => "hidden",
            Operand::LmHead => "lm_head",
        })
    }
}

/// Everything that can go wrong between candle tensors and their samples.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// flashsample rejected the launch (shapes against each other, dtypes against the
    /// pipeline, parameters) or a row could not be sampled.
    #[error(transparent)]
    Flashsample(#[from] flashsample::Error),
    /// candle failed (reading a tensor, building an output).
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// An operand that is not the matrix it should be.
    #[error("`{operand}` has shape {dims:?}; expected a matrix {expected}")]
    Rank {
        /// The operand.
        operand: Operand,
        /// Its shape.
        dims: Vec<usize>,
        /// The matrix it should be.
        expected: &'static str,
    },
    /// An operand of a dtype flashsample does not read.
    #[error("`{operand}` has dtype {dtype:?}; flashsample reads bf16, f16 or f32")]
    DType {
        /// The operand.
        operand: Operand,
        /// Its dtype.
        dtype: DType,
    },
    /// An operand that is not contiguous (the LM head is read in place).
    #[error(
        "`{operand}` is not contiguous (shape {dims:?}, strides {stride:?}): the LM head is read in \
         place, never copied per call; make it contiguous once, when the model is loaded"
    )]
    NotContiguous {
        /// The operand.
        operand: Operand,
        /// Its shape.
        dims: Vec<usize>,
        /// Its strides.
        stride: Vec<usize>,
    },
    /// An operand on another device than the sampler's.
    #[error("`{operand}` lives on {location:?}, but this sampler runs on candle's CPU device")]
    WrongDevice {
        /// The operand.
        operand: Operand,
        /// Where it lives.
        location: DeviceLocation,
    },
    /// A candle device the sampler does not run on.
    #[error("flashsample-candle runs on candle's CPU device; {location:?} is not supported yet")]
    UnsupportedDevice {
        /// The device asked for.
        location: DeviceLocation,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One launch's samples as candle tensors on the sampler's device.
#[derive(Clone, Debug)]
pub struct SampledTensors {
    /// `U32 [B, S]`: `S` samples per row, in the pipeline's order.
    pub tokens: Tensor,
    /// `F32 [B, S]`: each sample's winning perturbed score, if the pipeline declares `score`.
    pub scores: Option<Tensor>,
    /// `F32 [B, S]`: each sampled token's log-probability under the full (unfiltered)
    /// distribution, if the pipeline declares `logprob`.
    pub logprobs: Option<Tensor>,
    /// `F32 [B]`: each row's logsumexp of the transformed logits, if declared.
    pub logsumexp: Option<Tensor>,
    /// Per row, its `top_logprobs` most likely tokens and their log-probabilities (most likely
    /// first; shorter for a row with fewer eligible tokens), if declared.
    pub top_logprobs: Option<Vec<Vec<(u32, f32)>>>,
    /// `F32 [B]`: each row's log-probability of its scored token (`SamplingParams::targets`),
    /// if the pipeline scores them (`score = target_logprob(logits, targets[B]);`).
    pub target_logprobs: Option<Tensor>,
    /// `U32 [B]`: each scored token's rank, if the pipeline ranks them
    /// (`target_logprob(logits, targets[B], rank)`).
    pub target_ranks: Option<Tensor>,
    /// Rows the launch ran again because short tile lists overflowed (`Samples::list_reruns`).
    pub list_reruns: usize,
}

impl SampledTensors {
    /// flashsample's host samples as tensors on `device`.
    fn from_samples(samples: Samples, device: &Device) -> Result<Self> {
        let rows = (samples.batch, samples.samples_per_row);
        let per_sample = |v: Option<Vec<f32>>| v.map(|v| Tensor::from_vec(v, rows, device)).transpose();
        Ok(SampledTensors {
            tokens: Tensor::from_vec(samples.tokens, rows, device)?,
            scores: per_sample(samples.scores)?,
            logprobs: per_sample(samples.logprobs)?,
            logsumexp: samples.logsumexp.map(|v| Tensor::from_vec(v, samples.batch, device)).transpose()?,
            top_logprobs: samples.top_logprobs,
            target_logprobs: samples.target_logprobs.map(|v| Tensor::from_vec(v, samples.batch, device)).transpose()?,
            target_ranks: samples.target_ranks.map(|v| Tensor::from_vec(v, samples.batch, device)).transpose()?,
            list_reruns: samples.list_reruns,
        })
    }
}

/// A compiled flashsample pipeline used as a candle model's LM head and sampler.
pub struct LmHeadSampler {
    sampler: Sampler,
}

impl LmHeadSampler {
    /// Validates `pipeline` (from `flashsample!`'s `Name::pipeline()` or a builder) and prepares
    /// it for candle's `device`; kernels compile on first use, per shape.
    pub fn new(pipeline: Pipeline, device: &Device) -> Result<Self> {
        match device {
            Device::Cpu => Ok(LmHeadSampler { sampler: Sampler::new(pipeline, &flashsample::Device::cpu())? }),
            other => Err(Error::UnsupportedDevice { location: other.location() }),
        }
    }

    /// The flashsample sampler underneath (its pipeline, tile configs, device).
    pub fn sampler(&self) -> &Sampler {
        &self.sampler
    }

    /// Samples the pipeline's `S` tokens per row from `hidden` (`[B, D]`, any layout) against
    /// `lm_head` (`[V, D]`, contiguous: borrowed in place), with `params` as for
    /// [`Sampler::sample`]. Dtypes must be the pipeline's.
    pub fn sample(&self, hidden: &Tensor, lm_head: &Tensor, params: &SamplingParams<'_>) -> Result<SampledTensors> {
        // The CPU kernel widens the hidden states to f32 anyway; a strided `[B, D]` view (the
        // last position of a `[B, T, D]` batch) costs one small copy here.
        let hidden = hidden.contiguous()?;
        check_host_matrix(&hidden, Operand::Hidden, "[batch, hidden]")?;
        check_host_matrix(lm_head, Operand::LmHead, "[vocab, hidden]")?;
        let (h_storage, h_layout) = hidden.storage_and_layout();
        let (w_storage, w_layout) = lm_head.storage_and_layout();
        let h = HostSlice::borrow(&h_storage, h_layout, Operand::Hidden)?;
        let w = HostSlice::borrow(&w_storage, w_layout, Operand::LmHead)?;
        let samples = self.sampler.sample(h.matrix(h_layout)?, w.matrix(w_layout)?, params)?;
        SampledTensors::from_samples(samples, &Device::Cpu)
    }
}

/// Checks what can be checked before locking the storage: device, rank, contiguity.
fn check_host_matrix(t: &Tensor, operand: Operand, expected: &'static str) -> Result<()> {
    if !t.device().is_cpu() {
        return Err(Error::WrongDevice { operand, location: t.device().location() });
    }
    if t.rank() != 2 {
        return Err(Error::Rank { operand, dims: t.dims().to_vec(), expected });
    }
    if !t.is_contiguous() {
        return Err(Error::NotContiguous { operand, dims: t.dims().to_vec(), stride: t.stride().to_vec() });
    }
    Ok(())
}

/// A contiguous matrix's elements, borrowed from candle's CPU storage.
#[derive(Clone, Copy, Debug)]
enum HostSlice<'a> {
    BF16(&'a [bf16]),
    F16(&'a [f16]),
    F32(&'a [f32]),
}

impl<'a> HostSlice<'a> {
    /// The elements `layout` covers in `storage`: a subslice, no copy.
    fn borrow(storage: &'a Storage, layout: &Layout, operand: Operand) -> Result<Self> {
        let Storage::Cpu(cpu) = storage else {
            // `check_host_matrix` ran first; a tensor's storage is on its device.
            return Err(Error::WrongDevice { operand, location: storage.device().location() });
        };
        let (start, end) = layout.contiguous_offsets().ok_or_else(|| Error::NotContiguous {
            operand,
            dims: layout.dims().to_vec(),
            stride: layout.stride().to_vec(),
        })?;
        Ok(match cpu {
            CpuStorage::BF16(v) => HostSlice::BF16(&v[start..end]),
            CpuStorage::F16(v) => HostSlice::F16(&v[start..end]),
            CpuStorage::F32(v) => HostSlice::F32(&v[start..end]),
            _ => return Err(Error::DType { operand, dtype: storage.dtype() }),
        })
    }

    /// flashsample's view of the slice as the `[rows, cols]` matrix of `layout`.
    fn matrix(self, layout: &Layout) -> Result<flashsample::Tensor<'a>> {
        let (rows, cols) = layout.shape().dims2()?;
        Ok(match self {
            HostSlice::BF16(s) => flashsample::Tensor::host(s, rows, cols),
            HostSlice::F16(s) => flashsample::Tensor::host(s, rows, cols),
            HostSlice::F32(s) => flashsample::Tensor::host(s, rows, cols),
        }?)
    }

    #[cfg(test)]
    fn as_ptr(self) -> *const u8 {
        match self {
            HostSlice::BF16(s) => s.as_ptr().cast(),
            HostSlice::F16(s) => s.as_ptr().cast(),
            HostSlice::F32(s) => s.as_ptr().cast(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashsample::ir::{DType as IrDType, PipelineBuilder};

    fn greedy(dtype: IrDType) -> Pipeline {
        PipelineBuilder::new("Greedy", dtype, dtype).argmax().build().unwrap()
    }

    /// `[rows, cols]` f32 with entry `(r, c)` = `r * cols + c`.
    fn iota(rows: usize, cols: usize) -> Tensor {
        Tensor::arange(0f32, (rows * cols) as f32, &Device::Cpu).unwrap().reshape((rows, cols)).unwrap()
    }

    #[test]
    fn the_lm_head_is_borrowed_in_place_with_its_offset() {
        let w = iota(10, 4).to_dtype(DType::BF16).unwrap();
        let shard = w.narrow(0, 3, 5).unwrap();
        let (storage, layout) = shard.storage_and_layout();
        let Storage::Cpu(CpuStorage::BF16(all)) = &*storage else { panic!("bf16 CPU storage") };
        let slice = HostSlice::borrow(&storage, layout, Operand::LmHead).unwrap();
        assert_eq!(slice.as_ptr(), all[3 * 4..].as_ptr().cast());
        let HostSlice::BF16(s) = slice else { panic!("bf16 slice") };
        assert_eq!(s.len(), 5 * 4);
    }

    #[test]
    fn greedy_picks_the_largest_logit_of_a_shard() {
        // Logits of row 0 ([1, 0, 0, 0]) are column 0 of the weights: the last row wins.
        let sampler = LmHeadSampler::new(greedy(IrDType::F32), &Device::Cpu).unwrap();
        let hidden = Tensor::new(&[[1f32, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, -1.0]], &Device::Cpu).unwrap();
        let w = iota(10, 4);
        let out = sampler.sample(&hidden, &w, &SamplingParams::default()).unwrap();
        assert_eq!(out.tokens.dims(), &[2, 1]);
        assert_eq!(out.tokens.to_vec2::<u32>().unwrap(), vec![vec![9], vec![0]]);
        let out = sampler.sample(&hidden, &w.narrow(0, 2, 5).unwrap(), &SamplingParams::default()).unwrap();
        assert_eq!(out.tokens.to_vec2::<u32>().unwrap(), vec![vec![4], vec![0]]);
    }

    #[test]
    fn a_strided_hidden_view_is_accepted() {
        let sampler = LmHeadSampler::new(greedy(IrDType::F32), &Device::Cpu).unwrap();
        // Column 0 of `[4, 2]`ᵀ: a non-contiguous `[2, 4]` view.
        let hidden = Tensor::new(&[[1f32, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, -1.0]], &Device::Cpu).unwrap().t().unwrap();
        assert!(!hidden.is_contiguous());
        let out = sampler.sample(&hidden, &iota(10, 4), &SamplingParams::default()).unwrap();
        assert_eq!(out.tokens.to_vec2::<u32>().unwrap(), vec![vec![9], vec![0]]);
    }

    #[test]
    fn bad_operands_are_typed_errors_naming_the_operand() {
        let sampler = LmHeadSampler::new(greedy(IrDType::F32), &Device::Cpu).unwrap();
        let hidden = iota(2, 4);
        let params = SamplingParams::default();
        let transposed = iota(4, 10).t().unwrap();
        assert!(matches!(
            sampler.sample(&hidden, &transposed, &params),
            Err(Error::NotContiguous { operand: Operand::LmHead, .. })
        ));
        let ints = iota(10, 4).to_dtype(DType::U32).unwrap();
        assert!(matches!(
            sampler.sample(&hidden, &ints, &params),
            Err(Error::DType { operand: Operand::LmHead, dtype: DType::U32 })
        ));
        let cube = iota(2, 4).reshape((2, 1, 4)).unwrap();
        assert!(matches!(sampler.sample(&cube, &iota(10, 4), &params), Err(Error::Rank { operand: Operand::Hidden, .. })));
        let bf = iota(10, 4).to_dtype(DType::BF16).unwrap();
        assert!(matches!(
            sampler.sample(&hidden, &bf, &params),
            Err(Error::Flashsample(flashsample::Error::DType { operand: "weights", .. }))
        ));
        assert!(matches!(
            sampler.sample(&hidden, &iota(10, 3), &params),
            Err(Error::Flashsample(flashsample::Error::Shape(_)))
        ));
    }
}
