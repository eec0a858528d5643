//! The GPU's f32 noise and logarithm are `abi`'s bits on every input they can take
//! (`flashsample_math_probe`): every 24-bit uniform index of `gumbel_f32` and every reduced
//! mantissa of `ln_f32`. The kernels divide by `div.rn`'s fast path there (no slow-path
//! branch), which only the hardware can check; CPU samples equal GPU samples only if this holds.
//! The same holds for the epilogue's `1 / T` (`math::reciprocals`) over its fast path's range,
//! checked on the GPU against `div.rn` (IEEE division, as the CPU's `1.0 / t`).

use super::gpu;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use flashsample_abi::{math::ln_f32, rng::gumbel_f32};
use flashsample_codegen_ptx::{compile_math_probe, MATH_PROBE_GUMBEL_INPUTS, MATH_PROBE_KERNEL, MATH_PROBE_LN_FIRST_BITS, MATH_PROBE_LN_INPUTS, MATH_PROBE_RECIP_WORDS, MATH_PROBE_THREADS};

/// Indices where `got` differs from `want(i)` (the first few, and how many).
fn mismatches(got: &[u32], want: impl Fn(u32) -> u32) -> (usize, Vec<(u32, u32, u32)>) {
    let bad: Vec<(u32, u32, u32)> = got.iter().enumerate().filter_map(|(i, &g)| {
        let w = want(i as u32);
        (g != w).then_some((i as u32, g, w))
    }).collect();
    (bad.len(), bad.into_iter().take(8).collect())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_noise_and_ln_are_abi_bits_on_every_input() {
    let (_device, dev) = gpu();
    let ptx = compile_math_probe().expect("the probe module compiles");
    let module = dev.context().load_module(Ptx::from_src(ptx)).expect("the probe module loads");
    let kernel = module.load_function(MATH_PROBE_KERNEL).expect("the probe kernel");
    let stream = dev.stream();
    let mut gumbel = stream.alloc_zeros::<u32>(MATH_PROBE_GUMBEL_INPUTS as usize).unwrap();
    let mut ln = stream.alloc_zeros::<u32>(MATH_PROBE_LN_INPUTS as usize).unwrap();
    let cfg = LaunchConfig { grid_dim: (MATH_PROBE_GUMBEL_INPUTS / MATH_PROBE_THREADS, 1, 1), block_dim: (MATH_PROBE_THREADS, 1, 1), shared_mem_bytes: 0 };
    let mut recip = stream.alloc_zeros::<u32>(MATH_PROBE_RECIP_WORDS).unwrap();
    let mut b = stream.launch_builder(&kernel);
    b.arg(&mut gumbel).arg(&mut ln).arg(&mut recip);
    unsafe { b.launch(cfg) }.expect("the probe launches");
    let gumbel = stream.clone_dtoh(&gumbel).unwrap();
    let ln = stream.clone_dtoh(&ln).unwrap();
    let recip = stream.clone_dtoh(&recip).unwrap();
    assert_eq!(recip[0], 0, "1 / t by div.rn's fast path differs from IEEE division on {} inputs; the largest: {:e}", recip[0], f32::from_bits(recip[1]));
    let (n, first) = mismatches(&gumbel, |k| gumbel_f32(k << 8).to_bits());
    assert_eq!(n, 0, "gumbel_f32 differs on {n} of 2^24 inputs; first (k, gpu bits, abi bits): {first:x?}");
    let (n, first) = mismatches(&ln, |i| ln_f32(f32::from_bits(MATH_PROBE_LN_FIRST_BITS + i)).to_bits());
    assert_eq!(n, 0, "ln_f32 differs on {n} of 2^23 mantissas; first (i, gpu bits, abi bits): {first:x?}");
}
