//! `flashsample sample`: the main job. Builds a random LM head shaped like Qwen3-8B's
//! (V = 151936; D reduced from 4096 by default so it runs in seconds on a laptop CPU),
//! samples tokens with the fused kernel, checks the first rows (up to 8) against the float64
//! reference and reports time and the logits bytes the fused kernel never wrote.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use flashsample::{bf16, ir::Pipeline, Device, RowFilter, Sampler, SamplingParams, TemperatureArg, Tensor};
use rand::{rngs::StdRng, SeedableRng};
use rand_distr::{Distribution, Normal};
use std::process::ExitCode;
use std::time::Instant;

/// Rows the `sample` command checks against the float64 reference.
const CHECKED_ROWS: usize = 8;

/// The embedded default pipeline: what a serving stack asks of a Qwen3 head: per-row
/// temperature, per-row top-k / top-p / min-p (up to k = 64), Gumbel-max sampling, the
/// sampled token's logprob and the top 5 logprobs.
const DEFAULT_PIPELINE: &str = "\
pipeline Qwen3Sampler
  hidden: bf16[B, D]
  weights: bf16[V, D]
  logits = matmul(hidden, weights)
  logits = temperature(logits, per_row temperature)
  logits = filter(logits, filter, max_k=64)
  sample = gumbel_max(logits, seed, samples=1)
  outputs(score, logprob, top_logprobs=5)
";

/// The command line.
#[derive(Parser)]
#[command(name = "flashsample", version, about = "Fused LM-head sampling kernels")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// A count that must be at least 1 (a batch, a dimension, repetitions).
fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

#[derive(Subcommand)]
enum Command {
    /// Sample tokens from a random Qwen3-8B-shaped LM head.
    Sample {
        /// Rows sampled in one launch.
        #[arg(long, default_value_t = 4, value_parser = positive)]
        batch: usize,
        /// Hidden size (Qwen3-8B: 4096; reduced by default for a quick CPU run).
        #[arg(long, default_value_t = 512, value_parser = positive)]
        dim: usize,
        /// Vocabulary size (Qwen3-8B: 151936).
        #[arg(long, default_value_t = 151_936, value_parser = positive)]
        vocab: usize,
        /// Temperature of every row (0 = greedy).
        #[arg(long, default_value_t = 0.7, allow_negative_numbers = true)]
        temperature: f32,
        /// Top-k of every row, if the pipeline has a filter (0 = off).
        #[arg(long, default_value_t = 50)]
        top_k: u32,
        /// Top-p of every row, if the pipeline has a filter (1 = off).
        #[arg(long, default_value_t = 0.9)]
        top_p: f32,
        /// Min-p of every row, if the pipeline has a filter (0 = off).
        #[arg(long, default_value_t = 0.0)]
        min_p: f32,
        /// Philox seed of the noise (and of the random LM head).
        #[arg(long, default_value_t = 2026)]
        seed: u64,
        /// Timed repetitions (the median is reported).
        #[arg(long, default_value_t = 5, value_parser = positive)]
        reps: usize,
        /// `cpu`, `cpu:THREADS` or `cuda:ORDINAL` (host weights are uploaded on every call).
        #[arg(long, default_value = "cpu")]
        device: String,
        /// A pipeline in IR text form instead of the embedded one (bf16 operands; its
        /// declared temperature, if any, is fed --temperature).
        #[arg(long)]
        pipeline: Option<std::path::PathBuf>,
        /// Skip the float64 reference check of the first rows (up to 8).
        #[arg(long)]
        no_check: bool,
    },
    /// Print the embedded pipeline's IR text (the format `--pipeline` reads; see the
    /// `flashsample_ir::text` docs).
    Ir,
}

fn parse_device(s: &str) -> Result<Device> {
    match s.split_once(':') {
        None if s == "cpu" => Ok(Device::cpu()),
        Some(("cpu", n)) => Ok(Device::cpu_with_threads(n.parse().context("cpu:THREADS")?)?),
        Some(("cuda", n)) => Ok(Device::cuda(n.parse().context("cuda:ORDINAL")?)?),
        _ => bail!("unknown device `{s}` (expected cpu, cpu:THREADS or cuda:ORDINAL)"),
    }
}

/// `rows × cols` Gaussian bf16 entries of standard deviation `std`: an error, not an abort,
/// when the matrix does not fit in memory.
fn random_bf16(rng: &mut StdRng, rows: usize, cols: usize, std: f32) -> Result<Vec<bf16>> {
    let normal = Normal::new(0.0f32, std).with_context(|| format!("standard deviation {std}"))?;
    let n = rows.checked_mul(cols).with_context(|| format!("a {rows} x {cols} matrix has more elements than memory can address"))?;
    let mut out = Vec::new();
    out.try_reserve_exact(n).with_context(|| format!("cannot allocate a {rows} x {cols} bf16 matrix"))?;
    out.extend((0..n).map(|_| bf16::from_f32(normal.sample(rng))));
    Ok(out)
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", flashsample::error_line(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    match Cli::parse().command {
        Command::Ir => print!("{DEFAULT_PIPELINE}"),
        Command::Sample { batch, dim, vocab, temperature, top_k, top_p, min_p, seed, reps, device, pipeline, no_check } => {
            let text = match &pipeline {
                Some(path) => std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
                None => DEFAULT_PIPELINE.to_string(),
            };
            let pipeline = Pipeline::parse(&text)?;
            let device = parse_device(&device)?;
            println!("{pipeline}");
            println!("device {}   B = {batch}, D = {dim}, V = {vocab}", device.describe());

            let temperatures = vec![temperature; batch];
            let filters = vec![RowFilter { top_k, top_p, min_p }; batch];
            let params = SamplingParams {
                filter: pipeline.filter_max_k().map(|_| &filters[..]),
                temperature: match pipeline.temperature() {
                    Some(flashsample::ir::Temperature::PerRow { .. }) => TemperatureArg::PerRow(&temperatures),
                    Some(flashsample::ir::Temperature::Scalar { .. }) => TemperatureArg::Scalar(temperature),
                    _ => TemperatureArg::None,
                },
                seed,
                ..Default::default()
            };
            // Bad parameters fail before the (large) LM head is built.
            params.validate(&pipeline, batch, vocab)?;
            let sampler = Sampler::new(pipeline.clone(), &device)?;

            let started = Instant::now();
            let mut rng = StdRng::seed_from_u64(seed);
            let hidden = random_bf16(&mut rng, batch, dim, 1.0)?;
            // Logit standard deviation ~4, about what LM heads produce.
            let weights = random_bf16(&mut rng, vocab, dim, 4.0 / (dim as f32).sqrt())?;
            println!("built a random LM head in {:.2} s", started.elapsed().as_secs_f64());
            let (h, w) = (Tensor::host(&hidden, batch, dim)?, Tensor::host(&weights, vocab, dim)?);
            let first = Instant::now();
            let samples = sampler.sample(h, w, &params)?;
            let first = first.elapsed().as_secs_f64();
            let mut times: Vec<f64> = (0..reps)
                .map(|_| {
                    let t = Instant::now();
                    sampler.sample(h, w, &params).map(|_| t.elapsed().as_secs_f64())
                })
                .collect::<flashsample::Result<_>>()?;
            times.sort_by(f64::total_cmp);
            let median = times.get(times.len() / 2).copied().unwrap_or(first);

            for row in 0..batch {
                let logprob = samples.logprobs.as_ref().map(|l| format!("  logprob {:.3}", l[row * samples.samples_per_row]));
                println!("row {row:>3}: tokens {:?}{}", samples.row(row), logprob.unwrap_or_default());
            }
            if let Some(top) = &samples.top_logprobs {
                let shown: Vec<String> = top[0].iter().map(|(t, lp)| format!("{t} ({lp:.3})")).collect();
                println!("row   0: top logprobs {}", shown.join(", "));
            }
            let w_bytes = (vocab * dim * 2) as f64;
            println!(
                "first call (includes JIT compile) {:.1} ms; median of {reps} {:.2} ms ({:.1} GB/s of weights)",
                first * 1e3,
                median * 1e3,
                w_bytes / median / 1e9
            );
            println!(
                "logits never written: {} bytes ({:.1} MB of [{batch}, {vocab}] f32)",
                batch * vocab * 4,
                (batch * vocab * 4) as f64 / 1e6
            );
            if !no_check {
                let hidden_f32: Vec<f32> = hidden.iter().map(|x| x.to_f32()).collect();
                let weights_f32: Vec<f32> = weights.iter().map(|x| x.to_f32()).collect();
                let problem = flashsample_reference::Problem {
                    pipeline: &pipeline,
                    hidden: &hidden_f32,
                    weights: &weights_f32,
                    batch,
                    dim,
                    vocab,
                    params: &params,
                };
                let rows: Vec<usize> = (0..batch.min(CHECKED_ROWS)).collect();
                let (refs, _) = problem.sample_rows(&rows)?;
                let per_row = samples.samples_per_row;
                let mut edges = 0;
                for (i, r) in refs.iter().enumerate() {
                    // A filter cut that f32 rounding could move admits any token such a cut keeps.
                    edges += usize::from(r.ambiguous);
                    let (row, k) = (i / per_row, i % per_row);
                    let slot = row * per_row + k;
                    let score = samples.scores.as_ref().map_or(r.score as f32, |s| s[slot]);
                    if let Err(e) = flashsample_reference::check_pathwise(r, samples.tokens[slot], score) {
                        bail!("row {row} disagrees with the float64 reference: {e}");
                    }
                }
                let edge_note = match edges {
                    0 => String::new(),
                    n => format!(
                        "; for {n} of them f32 rounding could move the top-k / top-p / min-p cut, so any token a cut within rounding keeps was accepted"
                    ),
                };
                println!(
                    "{} samples of rows 0..{} match the float64 reference pathwise{edge_note}",
                    refs.len(),
                    rows.len()
                );
            }
        }
    }
    Ok(())
}
