//! `flashsample-autotune`: run once per deployment device. Benchmarks every pruned tile
//! config per shape bucket (after checking its samples against the float64 reference),
//! writes the winners to the tuning file the runtime reads, and prints the top configs.
//!
//! Short searches (a GPU lent for minutes): `--budget-s N` spreads N seconds over the shapes
//! and times configs in a quick pass (`--quick-reps` launches, heuristic first, then in the
//! order of the cost model `gpu_space::rank` on CUDA / enumeration order on the CPU) until
//! each shape's share is spent, then times the `--finalists` fastest fully;
//! `--top-heuristic K` keeps only the heuristic and the K best configs of that order. Either
//! flag turns the quick pass on. Weights are generated and uploaded once per (D, V), the
//! float64 reference computed once per shape.

use anyhow::{bail, Context, Result};
use clap::Parser;
use flashsample::{
    ir::{DType, Outputs, Pipeline, PipelineBuilder},
    tuning::{ShapeKey, TuningFile, TUNING_ENV},
    Device, GpuConfig, KernelConfig, Sampler,
};
use flashsample_autotune::{
    cpu_space::{self, CpuLimits},
    gpu_space,
    tune::{tune_shape, Effort, HeadInputs, Outcome, ShapeInputs},
};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::time::{Duration, Instant};

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
    /// Several heads in one run, as `D:V` pairs (overrides --hidden / --vocab), sharing --budget-s.
    #[arg(long, value_delimiter = ',')]
    shapes: Vec<String>,
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
    /// Wall-clock budget in seconds for the whole run (weights, references, compiles,
    /// timing), shared evenly by the shapes still to measure; turns the quick pass on.
    #[arg(long)]
    budget_s: Option<f64>,
    /// Measure only the heuristic and the K best configs by the cost model (CUDA) or
    /// enumeration order (CPU); turns the quick pass on.
    #[arg(long)]
    top_heuristic: Option<usize>,
    /// Launches per config in the quick pass.
    #[arg(long, default_value_t = 3)]
    quick_reps: usize,
    /// Configs of the quick pass timed again with --warmup / --reps.
    #[arg(long, default_value_t = 3)]
    finalists: usize,
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

/// The configs to measure for `shape`, in preference order: the heuristic's first (always
/// measured, so the file can say how much tuning gained), then the rest; `top_heuristic`
/// keeps the first K after the heuristic.
fn search_space(sampler: &Sampler, device: &Device, pipeline: &Pipeline, shape: &ShapeKey, top_heuristic: Option<usize>) -> Vec<KernelConfig> {
    let mut space: Vec<KernelConfig> = match device {
        Device::Cpu { threads } => {
            let limits = CpuLimits { threads: *threads, ..CpuLimits::detect() };
            cpu_space::enumerate(pipeline, shape.batch, shape.dim, shape.vocab, &limits)
                .into_iter()
                .map(KernelConfig::Cpu)
                .collect()
        }
        // The PTX generator's own space, already pruned against this GPU's limits, ranked
        // by the cost model.
        Device::Cuda(gpu) => {
            let valid = GpuConfig::enumerate(pipeline, gpu.limits())
                .into_iter()
                .filter(|c| c.validate(pipeline, gpu.limits()).is_ok())
                .collect();
            gpu_space::rank(valid, pipeline, gpu.limits(), shape.batch, shape.dim, shape.vocab)
                .into_iter()
                .map(KernelConfig::Cuda)
                .collect()
        }
    };
    let heuristic = sampler.heuristic_config(shape.batch, shape.dim, shape.vocab);
    space.retain(|c| *c != heuristic);
    if let Some(k) = top_heuristic {
        space.truncate(k);
    }
    space.insert(0, heuristic);
    space
}

fn parse_heads(args: &Args) -> Result<Vec<(usize, usize)>> {
    if args.shapes.is_empty() {
        return Ok(vec![(args.hidden, args.vocab)]);
    }
    args.shapes
        .iter()
        .map(|s| {
            let (d, v) = s.split_once(':').with_context(|| format!("--shapes entry `{s}` is not D:V"))?;
            Ok((d.parse().context("D in --shapes")?, v.parse().context("V in --shapes")?))
        })
        .collect()
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
    let out = match args.out.clone() {
        Some(p) => p,
        None => default_out()?,
    };
    let mut file = match TuningFile::load(&out) {
        Ok(f) => f,
        Err(e) if out.exists() => bail!("{e} (move it away or pass another --out)"),
        Err(_) => TuningFile::default(),
    };
    let started = Instant::now();
    let heads = parse_heads(&args)?;
    let shapes: Vec<ShapeKey> = heads
        .iter()
        .flat_map(|&(dim, vocab)| args.batch.iter().map(move |&batch| ShapeKey { dtype: pipeline.weights.dtype, vocab, dim, batch }))
        .collect();
    let done = |f: &TuningFile, s: &ShapeKey| f.device(&identity).is_some_and(|d| d.entries.iter().any(|e| &e.shape == s));
    let todo: Vec<ShapeKey> = shapes.iter().filter(|s| !(args.resume && done(&file, s))).copied().collect();
    println!("tuning `{}` on {identity}; {} of {} shapes to measure -> {}", pipeline.name, todo.len(), shapes.len(), out.display());

    let pruned = args.budget_s.is_some() || args.top_heuristic.is_some();
    let effort = Effort {
        warmup: args.warmup,
        reps: args.reps,
        top: args.top,
        quick_reps: if pruned { args.quick_reps.max(1) } else { 0 },
        finalists: args.finalists.max(1),
    };
    let end = args.budget_s.map(|s| started + Duration::from_secs_f64(s));
    let spaces: Vec<Vec<KernelConfig>> = todo.iter().map(|s| search_space(&sampler, &device, &pipeline, s, args.top_heuristic)).collect();
    let bar = ProgressBar::new(spaces.iter().map(|s| s.len() as u64).sum());
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} configs  {msg}").expect("static template"));
    let mut measured = 0usize;
    let mut head_prep: Option<Duration> = None;
    for &(dim, vocab) in &heads {
        let of_head: Vec<usize> = (0..todo.len()).filter(|&i| (todo[i].dim, todo[i].vocab) == (dim, vocab)).collect();
        let Some(max_b) = of_head.iter().map(|&i| todo[i].batch).max() else { continue };
        let t = Instant::now();
        bar.set_message(format!("D={dim} V={vocab}: inputs"));
        let head = HeadInputs::new(&sampler, max_b, dim, vocab)?;
        head_prep.get_or_insert(t.elapsed());
        for &i in &of_head {
            let (shape, space) = (todo[i], &spaces[i]);
            bar.set_message(format!("D={dim} V={vocab} B={}", shape.batch));
            let inputs = ShapeInputs::new(&pipeline, &head, shape.batch)?;
            // This shape's even share of what is left, keeping one head preparation per head
            // still to come.
            let deadline = end.map(|end| {
                let heads_left = heads.iter().skip_while(|&&h| h != (dim, vocab)).count().saturating_sub(1) as u32;
                let reserve = head_prep.unwrap_or_default() * heads_left;
                let left = end.saturating_duration_since(Instant::now()).saturating_sub(reserve);
                Instant::now() + left / (todo.len() - measured).max(1) as u32
            });
            let entry = tune_shape(&sampler, &inputs, shape, space, effort, deadline, |config, outcome| {
                bar.inc(1);
                match outcome {
                    Outcome::Timed(_) | Outcome::Skipped => {}
                    Outcome::Failed(e) => bar.println(format!("B={} {config:?}: failed: {e}", shape.batch)),
                    Outcome::Wrong(e) => bar.println(format!("B={} {config:?}: WRONG SAMPLES, discarded: {e}", shape.batch)),
                }
            })?;
            file.upsert(&identity, entry);
            // Saved after every shape so an interrupted run resumes where it stopped.
            file.save(&out)?;
            measured += 1;
        }
    }
    bar.finish_and_clear();

    let Some(section) = file.device(&identity) else { bail!("no entries for {identity}") };
    println!("| D | V | B | rank | config | median us | vs heuristic |");
    println!("|---:|---:|---:|---:|---|---:|---:|");
    for shape in &shapes {
        if let Some(e) = section.entries.iter().find(|e| &e.shape == shape) {
            for (rank, m) in e.top.iter().enumerate() {
                println!(
                    "| {} | {} | {} | {} | `{}` | {:.1} | {:.2}x |",
                    shape.dim,
                    shape.vocab,
                    shape.batch,
                    rank + 1,
                    m.config,
                    m.median_us,
                    e.heuristic.median_us / m.median_us
                );
            }
        }
    }
    println!("{} shapes in {:.1} s", todo.len(), started.elapsed().as_secs_f64());
    Ok(())
}
