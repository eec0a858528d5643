//! Tensor-parallel sampling benchmark (issue 6): the LM head split by vocabulary over TP GPUs
//! (`flashsample::TensorParallelSampler`, NCCL all-gather of per-row winners), for every
//! TP in `--tp` that this machine's GPU count allows (a single GPU measures TP = 1 only).
//!
//! Columns per (TP, B):
//! - `tp step`: wall clock of one complete `TensorParallelSampler::sample` (every rank's fused
//!   launch on its shard, read-back, the all-gather, the host merge): what a decode step waits for.
//! - `shard fused`: device time (CUDA events) of the fused kernels on one shard `[V/TP, D]`
//!   (rank 0's), i.e. the part that shrinks with TP.
//! - `1-GPU step` / `1-GPU fused`: the plain single-GPU sampler over the whole head, wall clock of
//!   `Sampler::sample` and device time.
//!
//! Needs libnccl loadable as `libnccl.so` (see `scripts/nccl-env.sh`).

use clap::Parser;
use flashsample::{
    bf16,
    ir::{Outputs, PipelineBuilder},
    tp::{shard_pipeline, shard_ranges},
    CudaDevice, Device, DeviceTensor, Sampler, SamplingParams, TemperatureArg, TensorParallelSampler, Tensor,
};
use flashsample_bench::print_table;
use flashsample_ir::DType;
use rayon::prelude::*;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 8192)]
    dim: usize,
    #[arg(long, default_value_t = 128_256)]
    vocab: usize,
    #[arg(long, value_delimiter = ',', default_value = "16,64,256")]
    batches: Vec<usize>,
    /// Tensor-parallel sizes to try; those above the GPU count are reported as skipped.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    tp: Vec<usize>,
    #[arg(long, default_value_t = 30)]
    reps: usize,
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Also write the rows as JSON here.
    #[arg(long)]
    json_out: Option<String>,
}

/// Deterministic pseudo-normal bf16 values (sum of 4 uniforms), scaled to `std`.
fn random_bf16(n: usize, std: f32, seed: u64) -> Vec<bf16> {
    let mut out = vec![bf16::ZERO; n];
    out.par_chunks_mut(1 << 16).enumerate().for_each(|(c, chunk)| {
        let mut s = seed ^ (c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for x in chunk.iter_mut() {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u: f32 = (0..4).map(|k| ((z >> (16 * k)) & 0xffff) as f32 / 65536.0).sum::<f32>() - 2.0;
            *x = bf16::from_f32(u * std * 1.732);
        }
    });
    out
}

fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn us(s: f64) -> String {
    format!("{:.1}", s * 1e6)
}

fn gpu_count() -> usize {
    (0..16).take_while(|&o| CudaDevice::open(o).is_ok()).count()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    let (dim, vocab) = (a.dim, a.vocab);
    let gpus = gpu_count();
    if gpus == 0 {
        return Err(format!("no CUDA device: {}", Device::cuda(0).err().map_or_else(String::new, |e| e.to_string())).into());
    }
    let (maj, min, patch) = flashsample::tp::nccl_version()?;
    eprintln!("tp_bench: {gpus} GPU(s), NCCL {maj}.{min}.{patch}, D={dim} V={vocab}");
    let pipeline = PipelineBuilder::new("tp", DType::BF16, DType::BF16)
        .temperature_per_row("temperature")
        .outputs(Outputs { score: true, ..Outputs::default() })
        .build()?;
    let weights = random_bf16(vocab * dim, 4.0 / (dim as f32).sqrt(), 1);
    let max_b = *a.batches.iter().max().ok_or("no batches")?;
    let hidden = random_bf16(max_b * dim, 1.0, 2);
    let temps: Vec<f32> = (0..max_b).map(|r| 0.6 + (r % 5) as f32 * 0.2).collect();

    // The single-GPU baseline over the whole head.
    let dev0 = CudaDevice::open(0)?;
    let full = dev0.upload(&weights, vocab, dim)?;
    let single = Sampler::new(pipeline.clone(), &Device::Cuda(dev0.clone()))?;
    let mut baseline = Vec::new();
    for &b in &a.batches {
        let h = Tensor::host(&hidden[..b * dim], b, dim)?;
        let params = SamplingParams { temperature: TemperatureArg::PerRow(&temps[..b]), seed: 7, ..Default::default() };
        let fused = median(single.cuda().expect("a CUDA sampler").time_fused(h, &[Tensor::device(&full)], &params, None, a.warmup, a.reps)?);
        let wall = flashsample_bench::median_secs(a.warmup, a.reps, || single.sample(h, Tensor::device(&full), &params).map(|_| ()))?;
        baseline.push((fused, wall));
    }
    drop(full);

    let header = ["TP", "B", "tp step us", "shard fused us", "1-GPU step us", "1-GPU fused us", "step vs 1-GPU"];
    let mut rows = Vec::new();
    let mut json = Vec::new();
    for &tp in &a.tp {
        if tp > gpus {
            eprintln!("TP={tp}: skipped, this machine has {gpus} GPU(s)");
            rows.push(vec![tp.to_string(), "-".into(), format!("skipped ({gpus} GPU)"), "-".into(), "-".into(), "-".into(), "-".into()]);
            continue;
        }
        let ordinals: Vec<usize> = (0..tp).collect();
        let sampler = TensorParallelSampler::from_host(pipeline.clone(), &ordinals, &weights, vocab, dim)?;
        // Rank 0's shard alone, for the device time of the part that shrinks with TP.
        let r0 = shard_ranges(vocab, tp, 128)?.remove(0);
        let shard: DeviceTensor = dev0.upload(&weights[r0.start * dim..r0.end * dim], r0.len(), dim)?;
        let local = Sampler::new(shard_pipeline(&pipeline)?, &Device::Cuda(dev0.clone()))?;
        for (i, &b) in a.batches.iter().enumerate() {
            let h = Tensor::host(&hidden[..b * dim], b, dim)?;
            let params = SamplingParams { temperature: TemperatureArg::PerRow(&temps[..b]), seed: 7, ..Default::default() };
            let step = median(sampler.time(&[h], &params, a.warmup, a.reps)?);
            let shard_fused = median(local.cuda().expect("a CUDA sampler").time_fused(h, &[Tensor::device(&shard)], &params, None, a.warmup, a.reps)?);
            let (fused1, wall1) = baseline[i];
            rows.push(vec![tp.to_string(), b.to_string(), us(step), us(shard_fused), us(wall1), us(fused1), format!("{:.2}x", wall1 / step)]);
            json.push(serde_json::json!({
                "tp": tp, "batch": b, "dim": dim, "vocab": vocab,
                "tp_step_us": step * 1e6, "shard_fused_us": shard_fused * 1e6,
                "single_step_us": wall1 * 1e6, "single_fused_us": fused1 * 1e6,
            }));
            eprintln!("TP={tp} B={b}: step {} us", us(step));
        }
    }
    println!("\nTensor-parallel sampling, bf16, D={dim}, V={vocab}, per-row temperature, medians of {} (us)\n", a.reps);
    print_table(&header, &rows);
    if let Some(path) = a.json_out {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    Ok(())
}
