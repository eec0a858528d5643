//! `flashsample-autotune`: run once per deployment device. Benchmarks every pruned tile
//! config per shape bucket (after checking its samples against the float64 reference),
//! writes the winners to the tuning file the runtime reads, and prints the top configs.

use anyhow::{bail, Context, Result};
use clap::Parser;
use flashsample::{
    ir::{DType, Outputs, Pipeline, PipelineBuilder},
    tuning::{ShapeKey, TuningFile, TUNING_ENV},
    Device, GpuConfig, KernelConfig, Sampler,
};
use flashsample_autotune::{
    cpu_space::{self, CpuLimits},
    tune::{tune_shape, Effort, Outcome},
};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "flashsample-autotune", version, about = "Tune flashsample kernels for this device")]
struct Args {
    /// A built-in pipeline (`sampling`, `greedy`, `full`) or a path to an IR text file.
    #[arg(long, default_value = "sampling")]
    pipeline: String,
    /// Element type of both operands for built-in pipelines.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    #[arg(long, default_value_t = 151_936)]
    vocab: usize,
    #[arg(long, default_value_t = 4096)]
    hidden: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64,128,256")]
    batch: Vec<usize>,
    /// `cpu`, `cpu:THREADS` or `cuda:ORDINAL`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Tuning file to write (default: $FLASHSAMPLE_TUNING, else ~/.cache/flashsample/tuning.json).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Keep shapes already in the output file for this device instead of measuring them again.
    #[arg(long)]
    resume: bool,
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// Configs kept per shape in the file and the printed table.
    #[arg(long, default_value_t = 5)]
    top: usize,
}

fn builtin(name: &str, dtype: DType) -> Result<Pipeline> {
    let b = PipelineBuilder::new(name, dtype, dtype);
    let score = Outputs { score: true, ..Outputs::default() };
    Ok(match name {
        "sampling" => b.temperature_per_row("temperature").outputs(score).build()?,
        "greedy" => b.argmax().outputs(score).build()?,
        "full" => b
            .temperature_per_row("temperature")
            .bias("bias")
            .mask("allowed")
            .softcap(30.0)
            .outputs(Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 0 })
            .build()?,
        path => Pipeline::parse(&std::fs::read_to_string(path).with_context(|| format!("reading pipeline {path}"))?)?,
    })
}

fn default_out() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(TUNING_ENV) {
        return Ok(p.into());
    }
    let home = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .context("no $HOME or $XDG_CACHE_HOME; pass --out")?;
    Ok(home.join("flashsample").join("tuning.json"))
}

fn search_space(device: &Device, pipeline: &Pipeline, shape: &ShapeKey) -> Vec<KernelConfig> {
    match device {
        Device::Cpu { threads } => {
            let limits = CpuLimits { threads: *threads, ..CpuLimits::detect() };
            cpu_space::enumerate(shape.batch, shape.dim, shape.vocab, pipeline.weights.dtype.size_bytes(), &limits)
                .into_iter()
                .map(KernelConfig::Cpu)
                .collect()
        }
        // The PTX generator's own space, already pruned against this GPU's limits.
        Device::Cuda(gpu) => GpuConfig::enumerate(pipeline, gpu.limits())
            .into_iter()
            .filter(|c| c.validate(pipeline, gpu.limits()).is_ok())
            .map(KernelConfig::Cuda)
            .collect(),
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dtype = DType::from_name(&args.dtype).with_context(|| format!("unknown dtype {}", args.dtype))?;
    let pipeline = builtin(&args.pipeline, dtype)?;
    let device = match args.device.split_once(':') {
        None if args.device == "cpu" => Device::cpu(),
        Some(("cpu", n)) => Device::cpu_with_threads(n.parse().context("cpu:THREADS")?),
        Some(("cuda", n)) => Device::cuda(n.parse().context("cuda:ORDINAL")?)?,
        _ => bail!("unknown device `{}` (expected cpu, cpu:THREADS or cuda:ORDINAL)", args.device),
    };
    let sampler = Sampler::new(pipeline.clone(), &device)?;
    let identity = sampler.device_identity();
    let out = match args.out {
        Some(p) => p,
        None => default_out()?,
    };
    let mut file = match TuningFile::load(&out) {
        Ok(f) => f,
        Err(e) if out.exists() => bail!("{e} (move it away or pass another --out)"),
        Err(_) => TuningFile::default(),
    };
    let shapes: Vec<ShapeKey> =
        args.batch.iter().map(|&batch| ShapeKey { dtype: pipeline.weights.dtype, vocab: args.vocab, dim: args.hidden, batch }).collect();
    let done = |f: &TuningFile, s: &ShapeKey| f.device(&identity).is_some_and(|d| d.entries.iter().any(|e| &e.shape == s));
    let todo: Vec<ShapeKey> = shapes.iter().filter(|s| !(args.resume && done(&file, s))).copied().collect();
    println!("tuning `{}` on {identity}; {} of {} shapes to measure -> {}", pipeline.name, todo.len(), shapes.len(), out.display());

    let spaces: Vec<Vec<KernelConfig>> = todo.iter().map(|s| search_space(&device, &pipeline, s)).collect();
    let bar = ProgressBar::new(spaces.iter().map(|s| s.len() as u64).sum());
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} configs  {msg}").expect("static template"));
    let effort = Effort { warmup: args.warmup, reps: args.reps, top: args.top };
    for (shape, space) in todo.iter().zip(&spaces) {
        bar.set_message(format!("B={}", shape.batch));
        let entry = tune_shape(&sampler, *shape, space, effort, |config, outcome| {
            bar.inc(1);
            match outcome {
                Outcome::Timed(_) => {}
                Outcome::Failed(e) => bar.println(format!("B={} {config:?}: failed: {e}", shape.batch)),
                Outcome::Wrong(e) => bar.println(format!("B={} {config:?}: WRONG SAMPLES, discarded: {e}", shape.batch)),
            }
        })?;
        file.upsert(&identity, entry);
        // Saved after every shape so an interrupted run resumes where it stopped.
        file.save(&out)?;
    }
    bar.finish_and_clear();

    let Some(section) = file.device(&identity) else { bail!("no entries for {identity}") };
    println!("| B | rank | config | median us | vs heuristic |");
    println!("|---:|---:|---|---:|---:|");
    for shape in &shapes {
        if let Some(e) = section.entries.iter().find(|e| &e.shape == shape) {
            for (rank, m) in e.top.iter().enumerate() {
                println!(
                    "| {} | {} | `{}` | {:.1} | {:.2}x |",
                    shape.batch,
                    rank + 1,
                    m.config,
                    m.median_us,
                    e.heuristic.median_us / m.median_us
                );
            }
        }
    }
    Ok(())
}
