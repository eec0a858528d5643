//! CPU benchmark: the fused Cranelift kernel against an unfused baseline in this process
//! (multi-threaded portable Rust matmul writing `[B, V]` f32 logits, then softmax and
//! inverse-CDF sampling), and the memory floor (weight bytes / streaming bandwidth measured
//! here). Prints one markdown table. `--filter` benchmarks top-k 50 + top-p 0.9 instead,
//! the baseline then selecting the top 50 per row, renormalizing, cutting at 0.9 and drawing.

use clap::Parser;
use flashsample::{bf16, ir::PipelineBuilder, Device, RowFilter, Sampler, SamplingParams, Tensor};
use flashsample_abi::rng::{noise_bits, uniform_f64};
use flashsample_bench::{median_secs, print_table};
use flashsample_ir::DType;
use rand::{rngs::StdRng, Rng, SeedableRng};
use rayon::prelude::*;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 151_936)]
    vocab: usize,
    /// Hidden sizes to run (4096 is Qwen3-8B; use a reduced one for quick runs).
    #[arg(long, value_delimiter = ',', default_value = "4096")]
    dims: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    batches: Vec<usize>,
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Sample with top-k 50 and top-p 0.9 (both sides).
    #[arg(long)]
    filter: bool,
}

const TOP_K: usize = 50;
const TOP_P: f32 = 0.9;

/// Unfused stage 1: `[B, V]` f32 logits, 4 vocab rows at a time so each widened weight
/// vector is reused across the batch; 8 independent accumulators let LLVM vectorize.
fn unfused_logits(hidden: &[f32], weights: &[bf16], batch: usize, dim: usize, vocab: usize, logits: &mut [f32]) {
    const CHUNK: usize = 64;
    // Rows of `logitsᵀ` per task, then transposed into place, so tasks write disjoint memory.
    let blocks: Vec<(usize, Vec<f32>)> = (0..vocab.div_ceil(CHUNK))
        .into_par_iter()
        .map(|c| {
            let v0 = c * CHUNK;
            let n = CHUNK.min(vocab - v0);
            let mut out = vec![0.0f32; n * batch];
            let mut wrow = vec![0.0f32; dim];
            for i in 0..n {
                for (d, w) in wrow.iter_mut().zip(&weights[(v0 + i) * dim..][..dim]) {
                    *d = w.to_f32();
                }
                for b in 0..batch {
                    let h = &hidden[b * dim..][..dim];
                    let mut acc = [0.0f32; 8];
                    let mut hc = h.chunks_exact(8);
                    let mut wc = wrow.chunks_exact(8);
                    for (hh, ww) in (&mut hc).zip(&mut wc) {
                        for k in 0..8 {
                            acc[k] += hh[k] * ww[k];
                        }
                    }
                    let tail: f32 = hc.remainder().iter().zip(wc.remainder()).map(|(a, b)| a * b).sum();
                    out[i * batch + b] = acc.iter().sum::<f32>() + tail;
                }
            }
            (v0, out)
        })
        .collect();
    for (v0, out) in blocks {
        let n = out.len() / batch;
        for i in 0..n {
            for b in 0..batch {
                logits[b * vocab + v0 + i] = out[i * batch + b];
            }
        }
    }
}

/// Unfused stage 2: per row, softmax(logits / T) and an inverse-CDF draw.
fn unfused_sample(logits: &[f32], batch: usize, vocab: usize, temperature: f32, seed: u64) -> Vec<u32> {
    (0..batch)
        .into_par_iter()
        .map(|b| {
            let row = &logits[b * vocab..][..vocab];
            let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let probs: Vec<f32> = row.iter().map(|&x| ((x - m) / temperature).exp()).collect();
            let total: f32 = probs.iter().sum();
            let target = uniform_f64(noise_bits(seed, b as u32, 0, 0, 0)) as f32 * total;
            let mut acc = 0.0f32;
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= target {
                    return i as u32;
                }
            }
            (vocab - 1) as u32
        })
        .collect()
}

/// Unfused stage 2 with filtering: per row, the top 50 logits (selection, then a sort of
/// those 50), softmax over them at temperature T, the top-p 0.9 prefix, an inverse-CDF draw.
fn unfused_sample_filtered(logits: &[f32], batch: usize, vocab: usize, temperature: f32, seed: u64) -> Vec<u32> {
    (0..batch)
        .into_par_iter()
        .map(|b| {
            let row = &logits[b * vocab..][..vocab];
            let mut idx: Vec<u32> = (0..vocab as u32).collect();
            let k = TOP_K.min(vocab);
            idx.select_nth_unstable_by(k - 1, |&x, &y| row[y as usize].total_cmp(&row[x as usize]));
            idx.truncate(k);
            idx.sort_unstable_by(|&x, &y| row[y as usize].total_cmp(&row[x as usize]));
            let m = row[idx[0] as usize];
            let probs: Vec<f32> = idx.iter().map(|&i| ((row[i as usize] - m) / temperature).exp()).collect();
            let total: f32 = probs.iter().sum();
            let (mut cum, mut kept) = (0.0f32, 0);
            while kept < k && (kept == 0 || cum < TOP_P * total) {
                cum += probs[kept];
                kept += 1;
            }
            let target = uniform_f64(noise_bits(seed, b as u32, 0, 0, 0)) as f32 * cum;
            let mut acc = 0.0f32;
            for j in 0..kept {
                acc += probs[j];
                if acc >= target {
                    return idx[j];
                }
            }
            idx[kept - 1]
        })
        .collect()
}

/// Streaming read bandwidth of this machine (bytes/s), all threads, over a buffer of `bytes`.
fn read_bandwidth(bytes: usize) -> f64 {
    let words: Vec<u64> = (0..bytes as u64 / 8).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
    let secs = median_secs::<()>(1, 5, || {
        let s: u64 = words.par_chunks(1 << 16).map(|c| c.iter().fold(0u64, |a, &x| a ^ x)).reduce(|| 0, |a, b| a ^ b);
        std::hint::black_box(s);
        Ok(())
    })
    .unwrap_or(f64::NAN);
    (words.len() * 8) as f64 / secs
}

fn main() -> flashsample::Result<()> {
    let args = Args::parse();
    let device = Device::cpu();
    let mut pipeline = PipelineBuilder::new("Bench", DType::BF16, DType::BF16).temperature_const(0.7);
    if args.filter {
        pipeline = pipeline.filter("filter", 64);
    }
    let sampler = Sampler::new(pipeline.build()?, &device)?;
    println!(
        "device {}, V = {}{}",
        device.describe(),
        args.vocab,
        if args.filter { ", top-k 50 + top-p 0.9 on both sides" } else { "" }
    );
    let mut rng = StdRng::seed_from_u64(1);
    let mut rows = Vec::new();
    for &dim in &args.dims {
        let weights: Vec<bf16> = (0..args.vocab * dim).map(|_| bf16::from_f32(rng.random_range(-0.05..0.05))).collect();
        let w_bytes = weights.len() * 2;
        let bw = read_bandwidth(w_bytes);
        let floor = w_bytes as f64 / bw;
        for &batch in &args.batches {
            let hidden: Vec<bf16> = (0..batch * dim).map(|_| bf16::from_f32(rng.random_range(-1.0..1.0))).collect();
            let h = Tensor::host(&hidden, batch, dim)?;
            let w = Tensor::host(&weights, args.vocab, dim)?;
            let filters = vec![RowFilter { top_k: TOP_K as u32, top_p: TOP_P, min_p: 0.0 }; batch];
            let params = SamplingParams { seed: 7, filter: args.filter.then_some(&filters[..]), ..Default::default() };
            let fused = median_secs(1, args.reps, || sampler.sample(h, w, &params).map(|_| ()))?;

            let hidden_f32: Vec<f32> = hidden.iter().map(|x| x.to_f32()).collect();
            let mut logits = vec![0.0f32; batch * args.vocab];
            let unfused = median_secs::<()>(1, args.reps, || {
                unfused_logits(&hidden_f32, &weights, batch, dim, args.vocab, &mut logits);
                if args.filter {
                    std::hint::black_box(unfused_sample_filtered(&logits, batch, args.vocab, 0.7, 7));
                } else {
                    std::hint::black_box(unfused_sample(&logits, batch, args.vocab, 0.7, 7));
                }
                Ok(())
            })
            .unwrap_or(f64::NAN);
            rows.push(vec![
                dim.to_string(),
                batch.to_string(),
                format!("{:.2}", fused * 1e3),
                format!("{:.2}", unfused * 1e3),
                format!("{:.2}x", unfused / fused),
                format!("{:.2}", floor * 1e3),
                format!("{:.2}x", fused / floor),
                format!("{:.1}", bw / 1e9),
            ]);
        }
    }
    print_table(
        &["D", "B", "fused ms", "unfused ms", "unfused/fused", "floor ms", "fused/floor", "read GB/s"],
        &rows,
    );
    Ok(())
}
