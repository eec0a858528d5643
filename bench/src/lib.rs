//! Benchmark helpers shared by the bench binaries: the common arguments of the peer-comparing
//! benches, timing, the peers' subprocess and table printing.

pub mod logits;

pub use logits::LogitShape;

use flashsample::{bf16, Device, DeviceTensor, Tensor};
use rand::{rngs::StdRng, Rng};
use std::time::Instant;

/// The speed-up over the torch.compile'd peer that issues 24 (scoring) and 25 (verification)
/// ask for; `score_bench` and `spec_bench` print it as a time beside the matmul alone.
pub const SPEEDUP_TARGET: f64 = 1.3;

/// The header of the column that prints [`target_ms`].
pub fn target_header() -> String {
    format!("target ms (compile / {SPEEDUP_TARGET})")
}

/// [`SPEEDUP_TARGET`] as a time: the compiled peer's time over it (none without the peer).
pub fn target_ms(compile_ms: Option<f64>) -> Option<f64> {
    compile_ms.map(|c| c / SPEEDUP_TARGET)
}

/// Median wall time of `reps` calls of `f` after `warmup` untimed calls, in seconds.
pub fn median_secs<E>(warmup: usize, reps: usize, mut f: impl FnMut() -> Result<(), E>) -> Result<f64, E> {
    for _ in 0..warmup {
        f()?;
    }
    let mut t: Vec<f64> = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        f()?;
        t.push(start.elapsed().as_secs_f64());
    }
    Ok(median(t))
}

/// The tile configs of a bench's `--configs` argument (a JSON array of `GpuConfig` objects);
/// none without it.
pub fn tile_configs(json: Option<&str>) -> Result<Vec<flashsample::GpuConfig>, String> {
    json.map_or(Ok(Vec::new()), |json| serde_json::from_str(json).map_err(|e| format!("--configs: {e}")))
}

/// The median of `t` (the upper one of an even count); `t` must not be empty.
pub fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// The arguments every peer-comparing bench (`score_bench`, `spec_bench`) takes, flattened
/// into its own: the device, the LM-head shapes, the repetitions, and the Python that runs its
/// peers script.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// `cpu` or `cuda`.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// `D:V` pairs.
    #[arg(long, value_delimiter = ',', default_value = "4096:151936,8192:128256")]
    pub shapes: Vec<String>,
    #[arg(long, default_value_t = 10)]
    pub reps: usize,
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Python with PyTorch (and what the peers script uses) for the peers; `none` skips them.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Standard deviation `S` of the raw logits the random LM head gives: W is then
    /// `U(−a, a)` with `a = 3·S/√D` (the hidden states are `U(−1, 1)`). Without it W is
    /// `U(−0.05, 0.05)`, a spread of `0.05·√(D/9)` (1.07 at D = 4096): flat rows, where the
    /// sampler's noise skips save little; trained LMs put most tokens tens of nats below the
    /// top (gpu_bench's default is 3).
    #[arg(long)]
    pub logit_std: Option<f32>,
    /// The shape of the hidden states' logits: `gaussian` (independent of W), `lm-like` (a
    /// trained LM's: a power-law head far above a Gaussian bulk; `flashsample_bench::logits`
    /// says how they are built), or `lm-like-low-ids` (half of that head among the low ids).
    /// W is the same either way.
    #[arg(long, value_enum, default_value_t = LogitShape::Gaussian)]
    pub logits: LogitShape,
}

impl BenchArgs {
    /// The device `--device` names.
    pub fn device(&self) -> Result<Device, Box<dyn std::error::Error>> {
        match self.device.as_str() {
            "cpu" => Ok(Device::cpu()),
            "cuda" => Ok(Device::cuda(0)?),
            other => Err(format!("--device {other}: expected cpu or cuda").into()),
        }
    }

    /// The JSON the peers script `script` prints for one head (`--dim`, `--vocab`, then
    /// `cases`, then the repetitions and the device), or `None` with `--python none` or when
    /// the peers cannot run (the reason on stderr, prefixed with `bench`).
    pub fn peers(&self, bench: &str, script: &str, dim: usize, vocab: usize, cases: &[(&str, String)]) -> Option<serde_json::Value> {
        if self.python == "none" {
            return None;
        }
        let mut args = vec!["--dim".to_string(), dim.to_string(), "--vocab".into(), vocab.to_string()];
        for (flag, value) in cases {
            args.extend([flag.to_string(), value.clone()]);
        }
        args.extend(["--reps".into(), self.reps.to_string(), "--warmup".into(), self.warmup.to_string(), "--device".into(), self.device.clone()]);
        peers_json(&self.python, script, &args).map_err(|e| eprintln!("{bench}: peers skipped: {e}")).ok()
    }
}

/// `xs` as a comma-separated list (a peers script's argument).
pub fn comma_list(xs: &[usize]) -> String {
    xs.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")
}

/// Runs a peers script (`python script args…`, its stderr passed through) and parses the one
/// JSON object it prints.
pub fn peers_json(python: &str, script: &str, args: &[String]) -> Result<serde_json::Value, String> {
    let out = std::process::Command::new(python)
        .arg(script)
        .args(args)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("could not run `{python}`: {e}"))?;
    if !out.status.success() {
        return Err(format!("`{python} {script}` failed ({})", out.status));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("{script} printed no JSON: {e}"))
}

/// `x` with `digits` decimals, or `–` when absent (a peer that did not run).
pub fn fmt_opt(x: Option<f64>, digits: usize) -> String {
    x.map_or("–".into(), |v| format!("{v:.digits$}"))
}

/// Prints a markdown table (so it pastes into BENCHMARKS.md as is).
pub fn print_table(header: &[&str], rows: &[Vec<String>]) {
    println!("| {} |", header.join(" | "));
    println!("|{}|", header.iter().map(|_| "---:").collect::<Vec<_>>().join("|"));
    for r in rows {
        println!("| {} |", r.join(" | "));
    }
}

/// Random bf16 LM-head weights `[vocab, dim]` (`U(−0.05, 0.05)`), uploaded once on CUDA so
/// every timed launch reads them from the device.
pub struct LmHead {
    host: Vec<bf16>,
    device: Option<DeviceTensor>,
    pub dim: usize,
    pub vocab: usize,
}

impl LmHead {
    /// Weights for the `D:V` pair `shape` (as `--shapes` takes them) on `device`, spread as
    /// [`BenchArgs::logit_std`] says.
    pub fn random(rng: &mut StdRng, device: &Device, shape: &str, logit_std: Option<f32>) -> Result<Self, Box<dyn std::error::Error>> {
        let (d, v) = shape.split_once(':').ok_or("--shapes takes D:V pairs")?;
        let (dim, vocab): (usize, usize) = (d.parse()?, v.parse()?);
        let a = logit_std.map_or(0.05, |s| 3.0 * s / (dim as f32).sqrt());
        let host: Vec<bf16> = (0..vocab * dim).map(|_| bf16::from_f32(rng.random_range(-a..a))).collect();
        let device = match device {
            Device::Cuda(c) => Some(c.upload(&host, vocab, dim)?),
            _ => None,
        };
        Ok(LmHead { host, device, dim, vocab })
    }

    /// Random hidden states for `rows` rows of this head (`U(−1, 1)`, bf16, host memory).
    pub fn random_hidden(&self, rng: &mut StdRng, rows: usize) -> Vec<bf16> {
        (0..rows * self.dim).map(|_| bf16::from_f32(rng.random_range(-1f32..1.0))).collect()
    }

    /// The logits `h·Wᵀ` of the given rows of `hidden` (`[rows, dim]` bf16), `[rows.len(), V]`
    /// f32, summed on the host in f32 in `k` order, tokens in parallel: what a bench needs to
    /// build distributions near the target's (`spec_bench --draft-noise`), not the kernels'
    /// bits.
    pub fn host_logits(&self, hidden: &[bf16], rows: &[usize]) -> Vec<f32> {
        let picked: Vec<bf16> = rows.iter().flat_map(|&r| hidden[r * self.dim..][..self.dim].iter().copied()).collect();
        logits::host_logits(&self.host, &picked, self.dim, rows.len())
    }

    /// `rows` hidden states of this head whose logits have the shape `shape`
    /// ([`LogitShape::Gaussian`]: [`LmHead::random_hidden`]).
    pub fn hidden(&self, rng: &mut StdRng, rows: usize, shape: LogitShape) -> Vec<bf16> {
        match shape {
            LogitShape::Gaussian => self.random_hidden(rng, rows),
            lm_like => lm_like.hidden(&self.host, self.dim, rows, rng.random(), Vec::new),
        }
    }

    /// [`logits::describe_rows`] of this head's first rows of `hidden`.
    pub fn describe_rows(&self, hidden: &[bf16], temps: &[f32], show: usize) -> String {
        logits::describe_rows(&self.host, hidden, self.dim, temps, show)
    }

    /// The weights' device copy (CUDA only).
    pub fn device_tensor(&self) -> Option<&DeviceTensor> {
        self.device.as_ref()
    }

    /// The weights as a launch operand (the device copy where there is one).
    pub fn tensor(&self) -> flashsample::Result<Tensor<'_>> {
        match &self.device {
            Some(t) => Ok(Tensor::device(t)),
            None => Tensor::host(&self.host, self.vocab, self.dim),
        }
    }
}
