//! Build check: flashsample (through flashsample-candle) in the same build as candle-core's
//! `cudarc` feature, so with cudarc linked against CUDA rather than loading it at run time.
//! `cargo check --tests` of this crate runs cudarc's build script on the unified features and
//! type-checks flashsample's CUDA code in the linked mode. Its test links against the CUDA
//! libraries (libcuda, libnvrtc, libnccl, libcublas, libcublasLt, libcurand), so it runs only
//! where they are installed.

use candle_core::{Device, Tensor};
use flashsample_candle::flashsample::{self, ir};
use flashsample_candle::LmHeadSampler;

/// The greedy token of each row of `hidden` (`f32 [B, D]`) against `lm_head` (`f32 [V, D]`),
/// through the candle adapter on the CPU.
pub fn greedy_tokens(hidden: &Tensor, lm_head: &Tensor) -> flashsample_candle::Result<Vec<u32>> {
    let pipeline = ir::PipelineBuilder::new("Greedy", ir::DType::F32, ir::DType::F32).argmax().build().map_err(flashsample::Error::from)?;
    let sampler = LmHeadSampler::new(pipeline, &Device::Cpu)?;
    let out = sampler.sample(hidden, lm_head, &flashsample::SamplingParams::default())?;
    Ok(out.tokens.flatten_all()?.to_vec1::<u32>()?)
}

/// flashsample's CUDA device 0, through the linked libcuda.
pub fn open_gpu() -> flashsample::Result<flashsample::Device> {
    flashsample::Device::cuda(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_on_the_cpu_and_the_gpu_error_without_one() {
        let hidden = Tensor::new(&[[1f32, 0.0], [0.0, -1.0]], &Device::Cpu).unwrap();
        let lm_head = Tensor::new(&[[0f32, 1.0], [2.0, 0.0], [1.0, -3.0]], &Device::Cpu).unwrap();
        assert_eq!(greedy_tokens(&hidden, &lm_head).unwrap(), vec![1, 2]);
        match open_gpu() {
            Ok(dev) => println!("opened {}", dev.describe()),
            Err(e) => println!("no GPU: {e}"),
        }
    }
}
