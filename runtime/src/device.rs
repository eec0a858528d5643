//! [`Device`]: where a sampler runs.

#[cfg(feature = "cuda")]
use crate::cuda::CudaDevice;
#[cfg(feature = "cuda")]
use std::sync::Arc;
use flashsample_codegen_cpu::MAX_THREADS;

/// Where a [`crate::Sampler`] runs.
#[derive(Clone, Debug)]
pub enum Device {
    /// Cranelift-JIT'd kernels on this machine's cores.
    Cpu {
        /// Worker threads of the kernel's pool, in `1..=`[`flashsample_codegen_cpu::MAX_THREADS`]
        /// ([`Device::cpu_with_threads`] checks it; a launch rejects a device built with another count).
        threads: usize,
    },
    /// An NVIDIA GPU (compute capability 8.0 or newer) through the CUDA driver.
    #[cfg(feature = "cuda")]
    Cuda(Arc<CudaDevice>),
}

impl Device {
    /// The CPU with one worker thread per available core (at most
    /// [`flashsample_codegen_cpu::MAX_THREADS`]).
    pub fn cpu() -> Device {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Device::Cpu { threads: cores.min(MAX_THREADS) }
    }

    /// The CPU with `threads` worker threads: `Error::CpuThreads` unless `threads` is in
    /// `1..=`[`flashsample_codegen_cpu::MAX_THREADS`].
    pub fn cpu_with_threads(threads: usize) -> crate::Result<Device> {
        if !(1..=MAX_THREADS).contains(&threads) {
            return Err(crate::Error::CpuThreads { threads, max: MAX_THREADS });
        }
        Ok(Device::Cpu { threads })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_thread_counts_are_checked_at_construction() {
        for bad in [0, MAX_THREADS + 1, 5000] {
            match Device::cpu_with_threads(bad) {
                Err(crate::Error::CpuThreads { threads, max: MAX_THREADS }) => assert_eq!(threads, bad),
                other => panic!("{bad} threads: {other:?}"),
            }
        }
        assert!(matches!(Device::cpu_with_threads(1), Ok(Device::Cpu { threads: 1 })));
        assert!(matches!(Device::cpu_with_threads(MAX_THREADS), Ok(Device::Cpu { threads: MAX_THREADS })));
        assert!(matches!(Device::cpu(), Device::Cpu { threads } if (1..=MAX_THREADS).contains(&threads)));
    }
}
