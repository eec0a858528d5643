//! CUDA devices and device-resident tensors.

use super::runtime_kernels::AuxKernels;
use super::ptx;
use crate::{Element, Error, Result};
use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DevicePtr, DriverError};
use flashsample_codegen_ptx::{Arch, GpuLimits};
use flashsample_ir::DType;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// `Error::Cuda` naming the driver call that failed, with the driver's own name and text.
pub(crate) fn drv(call: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::Cuda(format!("{call}: {}", driver_error_text(&e)))
}

pub(crate) fn driver_error_text(e: &DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    match e.error_string() {
        Ok(s) => format!("{name} ({})", s.to_string_lossy()),
        Err(_) => name,
    }
}

/// One opened GPU: its context (the device's primary context), the one stream every
/// flashsample launch on it is ordered on, and the limits the code generator sizes tiles by.
pub struct CudaDevice {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    compute_capability: (u32, u32),
    sm_count: u32,
    arch: Arch,
    limits: GpuLimits,
    /// Held for the whole of one host-API launch (argument upload, the stages, read-back):
    /// host launches share the stream and the per-sampler buffers, so they must not interleave.
    pub(crate) launch_lock: Mutex<()>,
    /// The runtime's own small kernels, loaded on first use.
    aux: Mutex<Option<Arc<AuxKernels>>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("compute_capability", &self.compute_capability)
            .field("sm_count", &self.sm_count)
            .field("arch", &self.arch)
            .finish()
    }
}

/// Devices opened so far, by ordinal: one context wrapper and one stream per GPU per process,
/// so the in-process kernel cache (modules belong to a context) is keyed by ordinal alone.
fn opened() -> &'static Mutex<HashMap<usize, Arc<CudaDevice>>> {
    static OPENED: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
    OPENED.get_or_init(|| Mutex::new(HashMap::new()))
}

impl CudaDevice {
    /// Opens GPU `ordinal` (or returns the already opened one).
    pub fn open(ordinal: usize) -> Result<Arc<CudaDevice>> {
        let mut map = opened().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let dev = Arc::new(Self::open_uncached(ordinal)?);
        map.insert(ordinal, dev.clone());
        Ok(dev)
    }

    fn open_uncached(ordinal: usize) -> Result<CudaDevice> {
        // cudarc panics on the first driver call when libcuda cannot be loaded: look first.
        // (Linked builds, `dynamic-linking`, cannot start without libcuda.)
        // SAFETY: only tries to dlopen the library; nothing is called through it.
        #[cfg(feature = "dynamic-loading")]
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::NoCudaDriver);
        }
        let count = match CudaContext::device_count() {
            Ok(n) => n.max(0) as usize,
            // A driver without any usable GPU (a container without devices passed in).
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => 0,
            Err(e) => return Err(drv("cuInit / cuDeviceGetCount")(e)),
        };
        if ordinal >= count {
            return Err(Error::NoCudaDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(drv("cuDevicePrimaryCtxRetain"))?;
        let name = ctx.name().map_err(drv("cuDeviceGetName"))?;
        let attr = |a: sys::CUdevice_attribute, what: &'static str| -> Result<u32> {
            ctx.attribute(a).map(|v| v.max(0) as u32).map_err(drv(what))
        };
        use sys::CUdevice_attribute::*;
        let cc = (
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)")?,
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)")?,
        );
        let sm_count = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)")?;
        let attrs = ptx::DeviceAttributes {
            compute_capability: cc,
            sm_count,
            max_smem_per_block_optin: attr(
                CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                "cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)",
            )?,
            max_threads_per_block: attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, "cuDeviceGetAttribute(MAX_THREADS_PER_BLOCK)")?,
            max_regs_per_block: attr(CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK, "cuDeviceGetAttribute(MAX_REGISTERS_PER_BLOCK)")?,
        };
        let arch = match ptx::arch_for(cc) {
            Some(a) => a,
            None => {
                return Err(Error::UnsupportedGpu {
                    name,
                    compute_capability: cc,
                    reason: "flashsample's GPU kernels need compute capability 8.0 or newer (sm_80 / sm_90 class: \
                             mma.sync, ldmatrix, cp.async)"
                        .into(),
                })
            }
        };
        let limits = ptx::limits_from(&attrs);
        let stream = ctx.new_stream().map_err(drv("cuStreamCreate"))?;
        // Every buffer and launch of this device is ordered on `stream`, so cudarc's
        // per-allocation cross-stream events would only add driver calls to every launch.
        // SAFETY: no flashsample buffer is ever used on another stream.
        unsafe { ctx.disable_event_tracking() };
        Ok(CudaDevice {
            ordinal,
            ctx,
            stream,
            name,
            compute_capability: cc,
            sm_count,
            arch,
            limits,
            launch_lock: Mutex::new(()),
            aux: Mutex::new(None),
        })
    }

    /// The device's CUDA ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    /// The device's name as the driver reports it.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// `(major, minor)` compute capability.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.compute_capability
    }
    /// Streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }
    /// The PTX target kernels for this device are generated for.
    pub fn arch(&self) -> Arch {
        self.arch
    }
    /// Limits read from the device's attributes (what `GpuConfig::validate` checks against).
    pub fn limits(&self) -> &GpuLimits {
        &self.limits
    }
    /// The device's primary context (every stream a plan launches on must belong to it).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The stream all flashsample work on this device is ordered on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// `cuda:N (name, sm_XY, N SMs)`.
    pub fn describe(&self) -> String {
        let (a, b) = self.compute_capability;
        format!("cuda:{} ({}, sm_{a}{b}, {} SMs)", self.ordinal, self.name, self.sm_count)
    }

    /// The runtime's small kernels (`cuda::runtime_kernels`), loaded into this device's context once.
    pub(crate) fn aux_kernels(&self) -> Result<Arc<AuxKernels>> {
        let mut aux = self.aux.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = aux.as_ref() {
            return Ok(a.clone());
        }
        let a = Arc::new(AuxKernels::load(self)?);
        *aux = Some(a.clone());
        Ok(a)
    }

    /// Waits for everything queued on this device's stream.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(drv("cuStreamSynchronize"))
    }

    /// Copies a row-major `rows × cols` host matrix to this GPU. Upload LM-head weights once
    /// and pass the [`DeviceTensor`] to every `sample` call: host tensors given to a CUDA
    /// sampler are uploaded again on every call.
    pub fn upload<T: Element>(self: &Arc<Self>, data: &[T], rows: usize, cols: usize) -> Result<DeviceTensor> {
        if rows.checked_mul(cols) != Some(data.len()) {
            return Err(Error::Length("matrix", data.len(), rows, cols));
        }
        let t = self.upload_bytes(T::DTYPE, bytemuck::cast_slice(data), rows, cols)?;
        // The copy may still read `data` (pageable memory is staged); the caller gets it back
        // as soon as we return, so wait here.
        self.synchronize()?;
        Ok(t)
    }

    /// Queues a copy of raw element bytes; the caller keeps `bytes` alive until the stream
    /// is synchronized.
    pub(crate) fn upload_bytes(self: &Arc<Self>, dtype: DType, bytes: &[u8], rows: usize, cols: usize) -> Result<DeviceTensor> {
        let buf = self.alloc_bytes(bytes.len())?;
        let mut buf = buf;
        if !bytes.is_empty() {
            self.stream.memcpy_htod(bytes, &mut buf).map_err(drv("cuMemcpyHtoDAsync"))?;
        }
        Ok(DeviceTensor { device: self.clone(), dtype, rows, cols, buf })
    }

    /// An uninitialized device buffer of at least one byte (a zero-byte allocation has no
    /// address to pass; kernels never read past the logical length).
    pub(crate) fn alloc_bytes(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        // SAFETY: every buffer is either fully written (uploads, stage outputs) before it is
        // read, or poisoned explicitly by the debug hooks.
        unsafe { self.stream.alloc::<u8>(bytes.max(1)) }.map_err(drv("cuMemAllocAsync"))
    }
}

/// A row-major matrix in GPU memory, made by [`CudaDevice::upload`]. Pass it to a CUDA
/// sampler with `Tensor::device` or `Matrix::on_device`.
pub struct DeviceTensor {
    device: Arc<CudaDevice>,
    dtype: DType,
    rows: usize,
    cols: usize,
    buf: CudaSlice<u8>,
}

impl std::fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceTensor({} {:?} [{}, {}])", self.location(), self.dtype, self.rows, self.cols)
    }
}

impl DeviceTensor {
    /// The elements' dtype.
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
    /// The device it lives on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.rows * self.cols * self.dtype.size_bytes()
    }
    pub(crate) fn location(&self) -> String {
        format!("cuda:{}", self.device.ordinal)
    }
    /// The buffer's device address (for interop: copies, other libraries' kernels). Valid
    /// while `self` lives; work on it should be ordered on [`CudaDevice::stream`].
    pub fn device_address(&self) -> u64 {
        // Event tracking is off (one stream), so the returned guard records nothing.
        let (ptr, _guard) = self.buf.device_ptr(&self.device.stream);
        ptr
    }

    /// Copies the raw element bytes back to the host.
    pub fn to_host_bytes(&self) -> Result<Vec<u8>> {
        let mut out = self.device.stream.clone_dtoh(&self.buf).map_err(drv("cuMemcpyDtoHAsync"))?;
        self.device.synchronize()?;
        out.truncate(self.bytes());
        Ok(out)
    }
}
