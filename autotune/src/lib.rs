//! The autotuner's search spaces and its measuring loop, as a library so they can be tested;
//! `src/main.rs` is the `flashsample-autotune` command.

pub mod cpu_space;
pub mod gpu_space;
pub mod tune;
