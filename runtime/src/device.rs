//! [`Device`]: where a sampler runs.

#[cfg(feature = "cuda")]
use crate::cuda::CudaDevice;
#[cfg(feature = "cuda")]
use std::sync::Arc;

/// Where a [`crate::Sampler`] runs.
#[derive(Clone, Debug)]
pub enum Device {
    /// Cranelift-JIT'd kernels on this machine's cores.
    Cpu {
        /// Worker threads of the kernel's pool.
        threads: usize,
    },
    /// An NVIDIA GPU (compute capability 8.0 or newer) through the CUDA driver.
    #[cfg(feature = "cuda")]
    Cuda(Arc<CudaDevice>),
}

impl Device {
    /// The CPU with one worker thread per available core.
    pub fn cpu() -> Device {
        Device::Cpu { threads: std::thread::available_parallelism().map_or(1, |n| n.get()) }
    }

    /// The CPU with `threads` worker threads (at least one).
    pub fn cpu_with_threads(threads: usize) -> Device {
        Device::Cpu { threads: threads.max(1) }
    }

    /// CUDA device `ordinal`: `Error::NoCudaDriver` without libcuda, `Error::NoCudaDevice`
    /// if there is no such device, `Error::UnsupportedGpu` below compute capability 8.0.
    /// Each ordinal is opened once per process; later calls share it (one stream, one cache).
    #[cfg(feature = "cuda")]
    pub fn cuda(ordinal: usize) -> crate::Result<Device> {
        CudaDevice::open(ordinal).map(Device::Cuda)
    }

    /// A short description for messages: `cpu (N threads)` or `cuda:N (...)`.
    pub fn describe(&self) -> String {
        match self {
            Device::Cpu { threads } => format!("cpu ({threads} threads)"),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => d.describe(),
        }
    }
}
