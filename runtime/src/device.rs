/// Where a [`crate::Sampler`] runs.
#[derive(Clone, Debug)]
pub enum Device {
    /// Cranelift-JIT'd kernels on this machine's cores.
    Cpu { threads: usize },
}

impl Device {
    /// The CPU with one worker thread per available core.
    pub fn cpu() -> Device {
        Device::Cpu { threads: std::thread::available_parallelism().map_or(1, |n| n.get()) }
    }

    pub fn cpu_with_threads(threads: usize) -> Device {
        Device::Cpu { threads: threads.max(1) }
    }

    pub fn describe(&self) -> String {
        match self {
            Device::Cpu { threads } => format!("cpu ({threads} threads)"),
        }
    }
}
