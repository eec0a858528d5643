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
    tuning::{ShapeKey, TunedConfig, TuningFile, TUNING_ENV},
    Device, KernelConfig, Sampler,
};
use flashsample_autotune::{
    cpu_space::{self, CpuLimits},
    gpu_space,
    tune::{tune_shape, Effort, HeadInputs, Outcome, ShapeInputs},
};
use flashsample_codegen_ptx::NoiseSkip;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// A count that must be at least 1 (a batch, a dimension, repetitions).
fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// A time budget in seconds: finite and positive.
fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 && x < 1e9 => Ok(x),
        Ok(x) => Err(format!("{x} is not a positive number of seconds")),
        Err(e) => Err(e.to_string()),
    }
}

/// The command line.
#[derive(Parser)]
#[command(name = "flashsample-autotune", version, about = "Tune flashsample kernels for this device")]
struct Args {
    /// A built-in pipeline (`sampling`, `greedy`, `full`) or a path to an IR text file.
    #[arg(long, default_value = "sampling")]
    pipeline: String,
    /// Element type of both operands for built-in pipelines.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Vocabulary size V.
    #[arg(long, default_value_t = 151_936, value_parser = positive)]
    vocab: usize,
    /// Hidden size D.
    #[arg(long, default_value_t = 4096, value_parser = positive)]
    hidden: usize,
    /// Several heads in one run, as `D:V` pairs (overrides --hidden / --vocab), sharing --budget-s.
    #[arg(long, value_delimiter = ',')]
    shapes: Vec<String>,
    /// Batch sizes to tune.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64,128,256,512", value_parser = positive)]
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
    /// Untimed launches before timing a config.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Timed launches per config (the median is kept).
    #[arg(long, default_value_t = 10, value_parser = positive)]
    reps: usize,
    /// Configs kept per shape in the file and the printed table.
    #[arg(long, default_value_t = 5, value_parser = positive)]
    top: usize,
    /// Wall-clock budget in seconds for the whole run (weights, references, compiles,
    /// timing), shared evenly by the shapes still to measure; turns the quick pass on.
    #[arg(long, value_parser = seconds, allow_negative_numbers = true)]
    budget_s: Option<f64>,
    /// Measure only the heuristic and the K best configs by the cost model (CUDA) or
    /// enumeration order (CPU); turns the quick pass on.
    #[arg(long)]
    top_heuristic: Option<usize>,
    /// Launches per config in the quick pass.
    #[arg(long, default_value_t = 3, value_parser = positive)]
    quick_reps: usize,
    /// Configs of the quick pass timed again with --warmup / --reps.
    #[arg(long, default_value_t = 3, value_parser = positive)]
    finalists: usize,
}

/// Progress on stderr: a bar on a terminal; plain lines elsewhere (logs, CI), at most one
/// per `PLAIN_EVERY` while configs are measured.
struct Progress {
    bar: ProgressBar,
    plain: bool,
    last_line: std::cell::Cell<Instant>,
}

const PLAIN_EVERY: Duration = Duration::from_secs(5);

impl Progress {
    fn new(total: u64) -> Progress {
        let plain = !std::io::stderr().is_terminal();
        let bar = if plain { ProgressBar::hidden() } else { ProgressBar::new(total) };
        bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} configs  {msg}").expect("static template"));
        Progress { bar, plain, last_line: std::cell::Cell::new(Instant::now()) }
    }

    /// What is being done now.
    fn stage(&self, msg: String) {
        if self.plain {
            eprintln!("{msg}");
            self.last_line.set(Instant::now());
        } else {
            self.bar.set_message(msg);
        }
    }

    /// A line that stays (a result or a failure).
    fn note(&self, msg: String) {
        if self.plain {
            eprintln!("{msg}");
            self.last_line.set(Instant::now());
        } else {
            self.bar.println(msg);
        }
    }

    /// One more config measured: `done` of `of` for the shape named `what`.
    fn config_done(&self, what: &str, done: usize, of: usize) {
        self.bar.inc(1);
        if self.plain && self.last_line.get().elapsed() >= PLAIN_EVERY {
            self.stage(format!("{what}: {done}/{of} configs measured"));
        }
    }
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
                // What the runtime would refuse to load (scratch past its bound) is not worth timing.
                .filter(|c| c.unusable(shape).is_none())
                .map(KernelConfig::Cpu)
                .collect()
        }
        // The PTX generator's own space, already pruned against this GPU's limits, ranked
        // by the cost model.
        Device::Cuda(gpu) => {
            let valid = gpu_space::enumerate(pipeline, gpu.limits())
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
    // The heuristic tile with the other noise skips right after it: whether the skips pay is
    // a property of the shape more than of the tile.
    if let KernelConfig::Cuda(h) = &heuristic {
        let others = [NoiseSkip::Never, NoiseSkip::InTile, NoiseSkip::CrossTile].into_iter().filter(|&s| s != h.noise_skip);
        for (i, skip) in others.enumerate() {
            space.insert(i, KernelConfig::Cuda(h.clone().with_noise_skip(skip)));
        }
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
            let d = positive(d).map_err(anyhow::Error::msg).with_context(|| format!("D in --shapes entry `{s}`"))?;
            let v = positive(v).map_err(anyhow::Error::msg).with_context(|| format!("V in --shapes entry `{s}`"))?;
            Ok((d, v))
        })
        .collect()
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
    let args = Args::parse();
    let dtype = DType::from_name(&args.dtype).with_context(|| format!("unknown dtype {}", args.dtype))?;
    let pipeline = builtin(&args.pipeline, dtype)?;
    let device = match args.device.split_once(':') {
        None if args.device == "cpu" => Device::cpu(),
        Some(("cpu", n)) => Device::cpu_with_threads(n.parse().context("cpu:THREADS")?)?,
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
    let progress = Progress::new(spaces.iter().map(|s| s.len() as u64).sum());
    let mut measured = 0usize;
    let mut head_prep: Option<Duration> = None;
    for &(dim, vocab) in &heads {
        let of_head: Vec<usize> = (0..todo.len()).filter(|&i| (todo[i].dim, todo[i].vocab) == (dim, vocab)).collect();
        let Some(max_b) = of_head.iter().map(|&i| todo[i].batch).max() else { continue };
        let t = Instant::now();
        progress.stage(format!("D={dim} V={vocab}: generating the LM head and {max_b} hidden rows"));
        let head = HeadInputs::new(&sampler, max_b, dim, vocab)?;
        head_prep.get_or_insert(t.elapsed());
        for &i in &of_head {
            let (shape, space) = (todo[i], &spaces[i]);
            let what = format!("D={dim} V={vocab} B={}", shape.batch);
            let shape_started = Instant::now();
            progress.stage(format!("{what}: float64 reference of the checked rows"));
            let inputs = ShapeInputs::new(&pipeline, &head, shape.batch)?;
            progress.stage(format!("{what}: measuring {} configs", space.len()));
            let mut done = 0usize;
            // This shape's even share of what is left, keeping one head preparation per head
            // still to come.
            let deadline = end.map(|end| {
                let heads_left = heads.iter().skip_while(|&&h| h != (dim, vocab)).count().saturating_sub(1) as u32;
                let reserve = head_prep.unwrap_or_default() * heads_left;
                let left = end.saturating_duration_since(Instant::now()).saturating_sub(reserve);
                Instant::now() + left / (todo.len() - measured).max(1) as u32
            });
            let entry = tune_shape(&sampler, &inputs, shape, space, effort, deadline, |config, outcome| {
                done += 1;
                progress.config_done(&what, done, space.len());
                match outcome {
                    Outcome::Timed(_) | Outcome::Skipped => {}
                    Outcome::Failed(e) => progress.note(format!("{what} {config:?}: failed: {e}")),
                    Outcome::Wrong(e) => progress.note(format!("{what} {config:?}: WRONG SAMPLES, discarded: {e}")),
                }
            })?;
            let heuristic = entry.heuristic.median_us;
            // `upsert` keeps the heuristic where it measured faster than the search's best.
            let saved = if heuristic < entry.best.median_us { heuristic } else { entry.best.median_us };
            progress.note(format!(
                "{what}: saved {saved:.1} us, heuristic {heuristic:.1} us ({:.2}x), {done} configs in {:.1} s",
                heuristic / saved,
                shape_started.elapsed().as_secs_f64()
            ));
            file.upsert(&identity, entry);
            // Saved after every shape so an interrupted run resumes where it stopped.
            file.save(&out)?;
            measured += 1;
        }
    }
    progress.bar.finish_and_clear();

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
