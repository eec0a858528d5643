use crate::{Error, Result};
use flashsample_ir::DType;
use std::marker::PhantomData;

/// A matmul element type: bf16, f16 or f32.
pub trait Element: bytemuck::Pod + Send + Sync {
    /// The IR dtype of this element type.
    const DTYPE: DType;
    /// The element's exact value as f32.
    fn to_f32(self) -> f32;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
}

/// Where a tensor's elements are.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Storage<'a> {
    Host(&'a [u8]),
    /// Already on a GPU (`CudaDevice::upload`).
    #[cfg(feature = "cuda")]
    Device(&'a crate::DeviceTensor),
}

/// An untyped row-major matrix argument: dtype, shape and storage.
#[derive(Clone, Copy, Debug)]
pub struct Tensor<'a> {
    pub(crate) dtype: DType,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) storage: Storage<'a>,
}

impl<'a> Tensor<'a> {
    /// A host matrix of `rows × cols` elements.
    pub fn host<T: Element>(data: &'a [T], rows: usize, cols: usize) -> Result<Self> {
        Ok(Matrix::new(data, rows, cols)?.into())
    }
    /// A matrix already on a GPU; its dtype and shape are the upload's.
    #[cfg(feature = "cuda")]
    pub fn device(t: &'a crate::DeviceTensor) -> Self {
        Tensor { dtype: t.dtype(), rows: t.rows(), cols: t.cols(), storage: Storage::Device(t) }
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
    /// The host bytes, if this tensor lives on the host.
    pub(crate) fn host_bytes(&self) -> Option<&'a [u8]> {
        match self.storage {
            Storage::Host(b) => Some(b),
            #[cfg(feature = "cuda")]
            Storage::Device(_) => None,
        }
    }
    pub(crate) fn location(&self) -> String {
        match self.storage {
            Storage::Host(_) => "the host".to_string(),
            #[cfg(feature = "cuda")]
            Storage::Device(t) => t.location(),
        }
    }
}

/// A typed row-major matrix argument, as `flashsample!`-generated `sample` methods take it.
#[derive(Clone, Copy, Debug)]
pub struct Matrix<'a, T> {
    tensor: Tensor<'a>,
    _element: PhantomData<T>,
}

impl<'a, T: Element> Matrix<'a, T> {
    /// Views `data` as a `rows × cols` row-major host matrix.
    pub fn new(data: &'a [T], rows: usize, cols: usize) -> Result<Self> {
        if rows.checked_mul(cols) != Some(data.len()) {
            return Err(Error::Length("matrix", data.len(), rows, cols));
        }
        Ok(Matrix {
            tensor: Tensor { dtype: T::DTYPE, rows, cols, storage: Storage::Host(bytemuck::cast_slice(data)) },
            _element: PhantomData,
        })
    }

    /// Views a GPU tensor as a typed matrix; fails if it was uploaded as another dtype.
    #[cfg(feature = "cuda")]
    pub fn on_device(t: &'a crate::DeviceTensor) -> Result<Self> {
        if t.dtype() != T::DTYPE {
            return Err(Error::DType { operand: "device tensor", expected: T::DTYPE, got: t.dtype() });
        }
        Ok(Matrix { tensor: Tensor::device(t), _element: PhantomData })
    }
}

impl<'a, T> From<Matrix<'a, T>> for Tensor<'a> {
    fn from(m: Matrix<'a, T>) -> Tensor<'a> {
        m.tensor
    }
}

/// Widens a host tensor's elements to f32.
pub(crate) fn widen_to_f32(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    fn widen<T: Element>(bytes: &[u8]) -> Vec<f32> {
        // Host bytes come from a `&[T]`, so they are aligned for `T`; copy if a caller's are not.
        match bytemuck::try_cast_slice::<u8, T>(bytes) {
            Ok(xs) => xs.iter().map(|x| x.to_f32()).collect(),
            Err(_) => bytemuck::pod_collect_to_vec::<u8, T>(bytes).into_iter().map(T::to_f32).collect(),
        }
    }
    match dtype {
        DType::BF16 => widen::<half::bf16>(bytes),
        DType::F16 => widen::<half::f16>(bytes),
        DType::F32 => widen::<f32>(bytes),
    }
}
