//! Issue 26: every vocabulary size compiled a CPU kernel with its own thread pool that was
//! never freed (300 sizes gave 602 OS threads). Kernels now share one pool per thread count,
//! and a sampler keeps a bounded cache of kernels. Alone in its test binary, so the process's
//! thread count is this test's.

use flashsample::ir::{DType, PipelineBuilder};
use flashsample::{Device, Sampler, SamplingParams, Tensor};

#[cfg(target_os = "linux")]
fn os_threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

#[test]
#[cfg(target_os = "linux")]
fn fifty_vocab_sizes_do_not_grow_the_thread_count() {
    let threads = 3;
    let pipeline = PipelineBuilder::new("P", DType::F32, DType::F32).build().unwrap();
    let (batch, dim) = (2, 8);
    let hidden = vec![0.5f32; batch * dim];
    let sample = |sampler: &Sampler, vocab: usize| {
        let weights = vec![0.25f32; vocab * dim];
        let h = Tensor::host(&hidden, batch, dim).unwrap();
        let w = Tensor::host(&weights, vocab, dim).unwrap();
        sampler.sample(h, w, &SamplingParams::default()).unwrap();
    };
    let sampler = Sampler::new(pipeline.clone(), &Device::cpu_with_threads(threads).unwrap()).unwrap();
    sample(&sampler, 40);
    let baseline = os_threads();
    for i in 0..50 {
        sample(&sampler, 50 + 30 * i);
    }
    // A second sampler on the same device shares the pool too.
    let other = Sampler::new(pipeline, &Device::cpu_with_threads(threads).unwrap()).unwrap();
    sample(&other, 1000);
    let after = os_threads();
    assert!(after <= baseline, "{baseline} threads after the first launch, {after} after 50 more vocabulary sizes");
}
