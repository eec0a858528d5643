//! The device API's arguments: borrowed views of the caller's device buffers.
//!
//! Every argument is an address, a length and a borrow: [`DeviceIn`] (read by the kernels),
//! [`DeviceOut`] (written), [`DeviceMatrix`] (a matmul operand with its dtype and shape). They
//! are made from cudarc buffers (`CudaSlice`, `CudaView`, `CudaViewMut`: the borrow keeps the
//! buffer alive, and cudarc's stream-ordering events, when its context tracks them, order the
//! launch after the buffer's last write), or, for engines not on cudarc, from raw addresses
//! with `unsafe` constructors.

use crate::{DeviceTensor, Element, Error, Result};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use flashsample_abi::{RowFilter, Scored};
use flashsample_ir::DType;
use std::marker::PhantomData;

/// A caller's device buffer of `len` elements of `T` that a launch reads.
pub struct DeviceIn<'a, T> {
    ptr: u64,
    len: usize,
    _sync: Option<SyncOnDrop<'a>>,
    _elements: PhantomData<&'a [T]>,
}

/// A caller's device buffer of `len` elements of `T` that a launch writes.
pub struct DeviceOut<'a, T> {
    ptr: u64,
    len: usize,
    _sync: Option<SyncOnDrop<'a>>,
    _elements: PhantomData<&'a mut [T]>,
}

/// Elements of `T` in `bytes`, or an error naming the buffer.
fn elements<T>(what: &'static str, bytes: usize) -> Result<usize> {
    let size = std::mem::size_of::<T>();
    if !bytes.is_multiple_of(size) {
        return Err(Error::Shape(format!("{what}: {bytes} bytes is not a whole number of {size}-byte elements")));
    }
    Ok(bytes / size)
}

/// The accessors a device buffer view ([`DeviceIn`], [`DeviceOut`]) has.
macro_rules! view_accessors {
    ($view:ident) => {
        impl<T: bytemuck::Pod> $view<'_, T> {
            /// Elements in the buffer.
            pub fn len(&self) -> usize {
                self.len
            }

            /// Whether the buffer has no elements.
            pub fn is_empty(&self) -> bool {
                self.len == 0
            }

            /// The device address.
            pub fn address(&self) -> u64 {
                self.ptr
            }
        }
    };
}

view_accessors!(DeviceIn);
view_accessors!(DeviceOut);

impl<'a, T: bytemuck::Pod> DeviceIn<'a, T> {
    /// Views a cudarc buffer of any element type whose bytes are `T`s (a `CudaSlice<u32>` of
    /// `3·B` words for `B` [`RowFilter`]s, say), read on `stream`.
    pub fn new<U, S: DevicePtr<U>>(buf: &'a S, stream: &'a CudaStream) -> Result<Self> {
        let len = elements::<T>("device input", buf.num_bytes())?;
        let (ptr, sync) = buf.device_ptr(stream);
        Ok(DeviceIn { ptr, len, _sync: Some(sync), _elements: PhantomData })
    }

    /// Views `len` elements at device address `ptr`.
    ///
    /// # Safety
    /// `ptr` must be a device address of the plan's device (in its primary context) holding
    /// `len` initialized elements of `T`, readable until the launch has run, and the caller
    /// orders the launch's stream after the buffer's writes.
    pub unsafe fn from_raw(ptr: u64, len: usize) -> Self {
        DeviceIn { ptr, len, _sync: None, _elements: PhantomData }
    }
}

impl<'a, T: bytemuck::Pod> DeviceOut<'a, T> {
    /// Views a cudarc buffer whose bytes are `T`s, written on `stream`.
    pub fn new<U, S: DevicePtrMut<U>>(buf: &'a mut S, stream: &'a CudaStream) -> Result<Self> {
        let len = elements::<T>("device output", buf.num_bytes())?;
        let (ptr, sync) = buf.device_ptr_mut(stream);
        Ok(DeviceOut { ptr, len, _sync: Some(sync), _elements: PhantomData })
    }

    /// Views `len` elements at device address `ptr`.
    ///
    /// # Safety
    /// `ptr` must be a device address of the plan's device (in its primary context) with room
    /// for `len` elements of `T`, writable until the launch has run and not read or written by
    /// other work until then (the caller orders its streams).
    pub unsafe fn from_raw(ptr: u64, len: usize) -> Self {
        DeviceOut { ptr, len, _sync: None, _elements: PhantomData }
    }
}

/// A row-major matmul operand in device memory: dtype, shape and address.
pub struct DeviceMatrix<'a> {
    pub(crate) dtype: DType,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) ptr: u64,
    _sync: Option<SyncOnDrop<'a>>,
    _borrow: PhantomData<&'a [u8]>,
}

impl<'a> DeviceMatrix<'a> {
    /// Views a cudarc buffer of `rows × cols` elements of `T` (`bf16`, `f16` or `f32`), read on `stream`.
    pub fn new<T: Element, S: DevicePtr<T>>(buf: &'a S, rows: usize, cols: usize, stream: &'a CudaStream) -> Result<Self> {
        if rows.checked_mul(cols) != Some(buf.len()) {
            return Err(Error::Length("device matrix", buf.len(), rows, cols));
        }
        let (ptr, sync) = buf.device_ptr(stream);
        Ok(DeviceMatrix { dtype: T::DTYPE, rows, cols, ptr, _sync: Some(sync), _borrow: PhantomData })
    }

    /// Views a matrix uploaded with [`crate::CudaDevice::upload`].
    pub fn from_tensor(t: &'a DeviceTensor) -> Self {
        DeviceMatrix { dtype: t.dtype(), rows: t.rows(), cols: t.cols(), ptr: t.device_address(), _sync: None, _borrow: PhantomData }
    }

    /// Views `rows × cols` elements of `dtype` at device address `ptr`.
    ///
    /// # Safety
    /// As [`DeviceIn::from_raw`], for `rows · cols` elements of `dtype`, 16-byte aligned.
    pub unsafe fn from_raw(ptr: u64, dtype: DType, rows: usize, cols: usize) -> Self {
        DeviceMatrix { dtype, rows, cols, ptr, _sync: None, _borrow: PhantomData }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
}

/// A per-row token table's tokens in device memory, laid out as `abi::RowTokens` (the
/// bitset every logit tests, then a binary search of the row's sorted CSR list).
pub struct DeviceRowTokens<'a> {
    /// `[B, ceil(V/32)]` bitset of the listed tokens (padding bits past `V` clear).
    pub bits: DeviceIn<'a, u32>,
    /// `[B + 1]` CSR offsets into `tokens` and the table's per-entry values.
    pub offsets: DeviceIn<'a, u32>,
    /// Listed tokens, sorted and distinct within each row.
    pub tokens: DeviceIn<'a, u32>,
}

impl DeviceRowTokens<'_> {
    /// The `[bits, offsets, tokens]` addresses after checking that the buffers hold `batch`
    /// rows of `words` bitset words and that the table's `values` cover every token; `names`
    /// name the bitset, the offsets and the values in errors.
    pub(crate) fn resolve(&self, names: [&'static str; 3], batch: usize, words: usize, values: usize) -> Result<[u64; 3]> {
        let [bits, offsets, values_name] = names;
        for (what, got, expected) in
            [(bits, self.bits.len(), batch * words), (offsets, self.offsets.len(), batch + 1), (values_name, values, self.tokens.len())]
        {
            if got < expected {
                return Err(flashsample_abi::ParamError::Length { what, expected, got }.into());
            }
        }
        Ok([self.bits.address(), self.offsets.address(), self.tokens.address()])
    }
}

/// The penalty tables of a launch in device memory, laid out as `abi::PenaltyTable`
/// (`SamplingParams::penalty_table` builds them on the host; DESIGN.md step 3).
pub struct DevicePenalties<'a> {
    /// The penalized tokens of each row.
    pub listed: DeviceRowTokens<'a>,
    /// Per penalized token, `frequency · count + presence`.
    pub subtract: DeviceIn<'a, f32>,
    /// `[B]` repetition penalties.
    pub repetition: DeviceIn<'a, f32>,
}

/// The per-request logit biases of a launch in device memory, laid out as
/// `abi::LogitBiasTable` (`SamplingParams::logit_bias_table` builds them on the host).
pub struct DeviceLogitBias<'a> {
    /// The biased tokens of each row.
    pub listed: DeviceRowTokens<'a>,
    /// Per biased token, the bias (finite or `-inf`).
    pub values: DeviceIn<'a, f32>,
}

/// Everything one device launch reads besides the plan's scratch.
///
/// Per-row buffers hold `B` entries (`B` = the launch's batch ≤ the plan's `max_batch`) and
/// must satisfy what `SamplingParams::validate` checks on the host (finite temperatures ≥ 0,
/// filters with `top_k ≤ max_k`, `top_p` in (0, 1], `min_p` in [0, 1], finite penalties, logit
/// biases finite or `-inf`) and be laid out as the `abi` tables are (each row's tokens sorted and
/// distinct): the device API does not read device memory back to check them.
pub struct DeviceInputs<'a> {
    /// `[B, D]` hidden states.
    pub hidden: DeviceMatrix<'a>,
    /// `[V, D]` LM-head weights.
    pub weights: DeviceMatrix<'a>,
    /// The Philox key of rows without their own seed.
    pub seed: u64,
    /// Global vocabulary index of token 0 (a multiple of 4), as `SamplingParams::vocab_offset`.
    pub vocab_offset: u32,
    /// Launch row of row 0, as `SamplingParams::row_offset` (a row without its own seed draws
    /// counter row `row_offset + r`); 0 for a whole batch.
    pub row_offset: u32,
    /// `[B]` temperatures (0 = greedy row), iff the pipeline takes a run-time temperature
    /// (scalar pipelines: the scalar in every row).
    pub temperatures: Option<DeviceIn<'a, f32>>,
    /// `[V]` additive bias, iff the pipeline has `bias`.
    pub bias: Option<DeviceIn<'a, f32>>,
    /// `[B, ceil(V/32)]` allowed-token bitset (mask and bans folded, padding bits clear:
    /// `SamplingParams::allowed_bitset`), iff the pipeline has `mask` or `ban`.
    pub allowed: Option<DeviceIn<'a, u32>>,
    /// `[B]` per-row seeds (`SamplingParams::row_seeds`).
    pub row_seeds: Option<DeviceIn<'a, u64>>,
    /// `[B]` per-row decode steps (`SamplingParams::row_steps`): a decode loop increments them
    /// on the device, so a captured graph draws fresh noise on every replay.
    pub row_steps: Option<DeviceIn<'a, u32>>,
    /// `[B]` top-k / top-p / min-p, iff the pipeline has a filter.
    pub filters: Option<DeviceIn<'a, RowFilter>>,
    /// The penalty tables, iff the pipeline has `penalties`.
    pub penalties: Option<DevicePenalties<'a>>,
    /// The per-request logit biases, iff the pipeline has `logit_bias`.
    pub logit_bias: Option<DeviceLogitBias<'a>>,
    /// `[B]` the token each row scores (each `< V`), iff the pipeline has `target_logprob`.
    pub targets: Option<DeviceIn<'a, u32>>,
}

impl<'a> DeviceInputs<'a> {
    /// The operands and seed; every per-row buffer absent (set the fields the pipeline needs).
    pub fn new(hidden: DeviceMatrix<'a>, weights: DeviceMatrix<'a>, seed: u64) -> Self {
        DeviceInputs {
            hidden,
            weights,
            seed,
            vocab_offset: 0,
            row_offset: 0,
            temperatures: None,
            bias: None,
            allowed: None,
            row_seeds: None,
            row_steps: None,
            filters: None,
            penalties: None,
            logit_bias: None,
            targets: None,
        }
    }
}

/// Where a device launch writes. `tokens` and `status` are required; each optional output is
/// written only when given (and the pipeline computes it).
pub struct DeviceOutputs<'a> {
    /// `[B · S]` sampled tokens, row-major; `abi::INDEX_NONE` for the samples of a row whose
    /// status is not ok.
    pub tokens: DeviceOut<'a, u32>,
    /// `[B]` `abi::RowStatus` codes; read it when you choose and turn it into typed errors
    /// with [`crate::cuda::SamplingPlan::row_errors`].
    pub status: DeviceOut<'a, u32>,
    /// `[B · S]` winning perturbed scores.
    pub scores: Option<DeviceOut<'a, f32>>,
    /// `[B · S]` transformed logits of the sampled tokens.
    pub logits: Option<DeviceOut<'a, f32>>,
    /// `[B]` row logsumexps (pipelines with a logsumexp, logprob or top-logprobs output).
    pub logsumexp: Option<DeviceOut<'a, f32>>,
    /// `[B · S]` logprobs of the sampled tokens (as `logsumexp`).
    pub logprobs: Option<DeviceOut<'a, f32>>,
    /// `[B, top_logprobs]` most likely tokens per row as `Scored { logit: logprob, index }`,
    /// padded with `index = abi::INDEX_NONE` (pipelines with `top_logprobs`).
    pub top_logprobs: Option<DeviceOut<'a, Scored>>,
    /// `[B]` each row's target logprob (`-inf` for an excluded target; NaN for a row stage two
    /// fails, unspecified for a row whose status is not ok); required iff the pipeline has
    /// `target_logprob`.
    pub target_logprobs: Option<DeviceOut<'a, f32>>,
    /// `[B]` each row's target rank (DESIGN.md step 7c; 0 for a row stage two fails,
    /// unspecified for a row whose status is not ok); required iff the pipeline ranks its
    /// targets (`target_logprob(logits, targets, rank)`).
    pub target_ranks: Option<DeviceOut<'a, u32>>,
}

impl<'a> DeviceOutputs<'a> {
    /// Tokens and status only.
    pub fn new(tokens: DeviceOut<'a, u32>, status: DeviceOut<'a, u32>) -> Self {
        DeviceOutputs { tokens, status, scores: None, logits: None, logsumexp: None, logprobs: None, top_logprobs: None, target_logprobs: None, target_ranks: None }
    }
}
