//! Benchmark helpers shared by the bench binaries: timing and table printing.

use flashsample::{bf16, Device, DeviceTensor, Tensor};
use rand::{rngs::StdRng, Rng};
use std::time::Instant;

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
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
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
    /// Weights for the `D:V` pair `shape` (as `--shapes` takes them) on `device`.
    pub fn random(rng: &mut StdRng, device: &Device, shape: &str) -> Result<Self, Box<dyn std::error::Error>> {
        let (d, v) = shape.split_once(':').ok_or("--shapes takes D:V pairs")?;
        let (dim, vocab): (usize, usize) = (d.parse()?, v.parse()?);
        let host: Vec<bf16> = (0..vocab * dim).map(|_| bf16::from_f32(rng.random_range(-0.05f32..0.05))).collect();
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
