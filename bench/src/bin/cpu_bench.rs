//! CPU benchmark: the fused sampler (`Sampler::sample` on the CPU device, the engine its
//! heuristic picks, or `--engine`) against the peers a CPU user would pick, in the same
//! invocation: PyTorch (bf16 matmul + /T + softmax + multinomial, the faster of eager and
//! torch.compile, and the matmul alone) and numpy (f32), run by `bench/peers/cpu_peers.py` in a
//! Python subprocess (`--python`; without torch or numpy their columns say so), and the memory
//! floor: weight bytes / the best all-thread streaming read of W (three read patterns,
//! `ReadPattern`). Every row's reps are paired: each runs one fused launch, one read of W in
//! each pattern and one call of every peer in turn (the peers'
//! script serves calls on request), so a shared machine's moving memory bandwidth falls on
//! every column alike. Medians of `--reps` (≥ 7 for quotable numbers); the floor is the best
//! of the row's reads. Prints one markdown table.
//!
//! A W that fits the last-level cache would be partly served from it when it is read again
//! (a 311 MB W, D = 1024, on a 300 MB L3: repeated reads of one buffer climbed from 19 to
//! 28 GB/s where three rotating copies stayed at 20), which neither an LM head (its W is read
//! once per step among the model's other weights) nor a memory floor has. So every access to
//! W — each fused launch, each floor read, each peer call — takes the next of
//! [`w_copies`] identical copies, enough that the bytes read between two uses of one copy are
//! six times the cache, each kind of access keeping to its own copies (an adaptive last-level
//! cache still kept part of a copy across three times its size).
//!
//! `--unfused` adds this crate's portable Rust baseline (multi-threaded matmul writing `[B, V]`
//! f32 logits, then softmax and inverse-CDF sampling). `--filter` samples with top-k 50 +
//! top-p 0.9 instead (the Rust baseline then selects the top 50 per row, renormalizes, cuts
//! at 0.9 and draws; the Python peers run their filtered pipelines, `cpu_peers.py --filter`:
//! PyTorch's matmul, /T, top-k, softmax, top-p and multinomial, eager and compiled, and
//! numpy's). `--nucleus` (with
//! `--filter`) also times the same batch with its last row on a lone top-p 0.95 at T = 2, a
//! nucleus far past the lists that the sampler serves exactly by recomputing that row alone
//! (DESIGN.md step 9), and prints that launch's time over the batch's (the budget is 2x). A
//! lone top-p row makes the whole launch compute the row logsumexps (to see whether its
//! nucleus fits the lists), so it also times the batch with a lone top-p row whose nucleus is
//! one token ("lse batch"): the exact path's own cost is the ratio to that.

use clap::Parser;
use flashsample::{bf16, ir::PipelineBuilder, CpuConfig, CpuEngine, Device, KernelConfig, NoiseSkip, RowFilter, Sampler, SamplingParams, TemperatureArg, Tensor};
use flashsample_abi::rng::{noise_bits, uniform_f64};
use flashsample_bench::{median_secs, print_table, LogitShape};
use flashsample_ir::DType;
use rand::{rngs::StdRng, Rng, SeedableRng};
use rayon::prelude::*;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 151_936)]
    vocab: usize,
    /// Hidden sizes to run (4096 is Qwen3-8B).
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096,8192")]
    dims: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,256")]
    batches: Vec<usize>,
    /// Timed launches per cell (the median is printed), after one warm-up launch.
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// Sample with top-k 50 and top-p 0.9 (the fused sampler, the Rust baseline and the
    /// Python peers' filtered pipelines).
    #[arg(long)]
    filter: bool,
    /// With `--filter`: also time the batch with one lone top-p 0.95 row at T = 2.
    #[arg(long, requires = "filter")]
    nucleus: bool,
    /// Force a CPU engine (`cranelift`, `avx512bf16`, `amx`) instead of the heuristic's choice.
    #[arg(long)]
    engine: Option<CpuEngine>,
    /// Also time the portable Rust unfused baseline.
    #[arg(long)]
    unfused: bool,
    /// The Python that runs `bench/peers/cpu_peers.py` (needs torch and/or numpy; README's
    /// "CPU benchmark" says how to install them in a venv).
    #[arg(long, default_value = "python3")]
    python: String,
    /// Skip the Python peers.
    #[arg(long)]
    no_peers: bool,
    /// Skip torch.compile (its first call per batch compiles for tens of seconds).
    #[arg(long)]
    no_compile: bool,
    /// The fused pipeline also returns the logprob and the row logsumexp (the exact logsumexp
    /// accumulation's cost; the peers are unchanged).
    #[arg(long)]
    logprobs: bool,
    /// With `--logprobs`: report raw logprobs (DESIGN.md step 10), so the kernel also computes
    /// the raw logits and their logsumexp over every token (two online logsumexps when the
    /// launch's filter needs the processed one: `--filter --nucleus`'s lone top-p row).
    #[arg(long, requires = "logprobs")]
    raw: bool,
    /// With `--logprobs`: also the top `N` logprobs per row (per-tile top lists; by raw logit
    /// with `--raw`).
    #[arg(long, requires = "logprobs", default_value_t = 0)]
    top_logprobs: u32,
    /// Standard deviation of the raw logits (before T = 0.7). By default W is `U(−0.05, 0.05)`
    /// and H `U(−1, 1)`, a spread of `0.05·√(D/9)` (1.07 at D = 4096): flat rows, on which the
    /// noise skips save little. Trained LMs at T ≤ 1 put most tokens tens of nats below the
    /// top (a larger value here); W is then `U(−a, a)` with `a = 3·S / √D`.
    #[arg(long)]
    logit_std: Option<f32>,
    /// The shape of the rows' logits: `gaussian` (hidden states independent of W), or
    /// `lm-like` (a trained LM's: a power-law head 14–28 above a Gaussian bulk, built from the
    /// same W: `flashsample_bench::logits`).
    #[arg(long, value_enum, default_value_t = LogitShape::Gaussian)]
    logits: LogitShape,
    /// Force the epilogue's noise skips (`never`, `in_tile`, `cross_tile`) instead of the
    /// config's (`cross_tile`): every choice samples the same tokens.
    #[arg(long, value_parser = noise_skip)]
    noise_skip: Option<NoiseSkip>,
}

/// A `NoiseSkip` by its serde name.
fn noise_skip(s: &str) -> Result<NoiseSkip, String> {
    serde_json::from_value(serde_json::Value::String(s.into())).map_err(|e| format!("{s:?}: {e} (never, in_tile, cross_tile)"))
}

/// Accesses to W in one rep of this process: a fused launch and a floor read in each pattern
/// (the Python peers rotate through copies of their own).
const ACCESSES_PER_REP: usize = 1 + ReadPattern::ALL.len();

/// The most bytes [`w_copies`] spends on copies of W (the Python peers hold as many again in
/// bf16 and twice in f32).
const COPIES_BYTES: usize = 3 << 30;

/// Identical copies of a `w_bytes` W that the accesses rotate through, while W is under twice
/// the last-level cache (`/sys/devices/system/cpu/cpu0/cache/index3/size`), else 1: enough
/// that six caches' worth of bytes are read between two uses of one copy, rounded up to a
/// multiple of [`ACCESSES_PER_REP`] so each kind of access keeps to its own copies, and at
/// most [`COPIES_BYTES`] in all. On the 300 MiB L3 of the Sapphire Rapids VM at D = 1024
/// (311 MB), four copies let the fused launch read W at ~39 GB/s, above every floor read
/// (fused/floor 0.87×), and seven gave floor reads of 47 GB/s; eight read fused/floor
/// 1.05–1.09× with the floor at the DRAM rate a C probe measures (BENCHMARKS.md, CPU,
/// seventeenth session).
fn w_copies(w_bytes: usize) -> usize {
    let l3 = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index3/size")
        .ok()
        .and_then(|s| {
            let s = s.trim();
            let (num, scale) = match s.strip_suffix('K') {
                Some(n) => (n, 1 << 10),
                None => match s.strip_suffix('M') {
                    Some(n) => (n, 1 << 20),
                    None => (s, 1),
                },
            };
            num.parse::<usize>().ok().map(|n| n * scale)
        })
        .unwrap_or(0);
    if w_bytes < 2 * l3 {
        let wanted = (1 + (6 * l3).div_ceil(w_bytes)).next_multiple_of(ACCESSES_PER_REP);
        let affordable = (COPIES_BYTES / w_bytes.max(1)) / ACCESSES_PER_REP * ACCESSES_PER_REP;
        wanted.min(affordable).max(1 + (2 * l3).div_ceil(w_bytes))
    } else {
        1
    }
}

const TOP_K: usize = 50;
const TOP_P: f32 = 0.9;
/// The `--nucleus` row: issue 26's lone top-p 0.95 at T = 2.
const NUCLEUS_TOP_P: f32 = 0.95;
const NUCLEUS_T: f32 = 2.0;
/// The "lse batch" row's top-p: a nucleus of one token (it fits), the same logsumexp work.
const LSE_ONLY_TOP_P: f32 = 1e-6;

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

/// How a floor read walks each thread's share of W. The floor is the best read of any: on
/// the Sapphire Rapids VM two plain streams per core read 21-32 GB/s where sixteen prefetched
/// ones read 30-35 (BENCHMARKS.md, CPU 2026-12-06), and a floor below what a kernel reaches
/// would flatter it. Each pattern reads whole 64-byte lines as vectors (one bounds check per
/// line; AVX-512 where the CPU has it): element-wise indexing read 25-27 GB/s where the same
/// walk as vectors reads 31-32, oneDNN's bf16 matmul's rate.
#[derive(Clone, Copy)]
enum ReadPattern {
    /// The share front to back in 64-byte steps.
    OneStream,
    /// The share's two halves side by side in 64-byte steps.
    TwoStreams,
    /// Sixteen equal parts side by side, each line prefetched two lines ahead (the AMX
    /// engine's access pattern at B <= 4, without the arithmetic).
    SixteenPrefetched,
}

impl ReadPattern {
    /// Every pattern, in the order a rep reads them.
    const ALL: [ReadPattern; 3] = [ReadPattern::OneStream, ReadPattern::TwoStreams, ReadPattern::SixteenPrefetched];
}

/// One all-thread streaming read of `buf` (the weights themselves, so every hidden size is
/// measured on its own W-sized buffer, never in cache) in `pattern`, in seconds.
fn read_pass(buf: &[bf16], threads: usize, pattern: ReadPattern) -> f64 {
    // SAFETY: bf16 is plain 16-bit data, and every bit pattern is a valid u64; the unaligned
    // ends (under 8 bytes each) are not read.
    let (_, words, _) = unsafe { buf.align_to::<u64>() };
    let share = words.len() / threads.max(1);
    let start = std::time::Instant::now();
    std::thread::scope(|s| {
        for part in words.chunks(share.max(1)) {
            s.spawn(move || {
                std::hint::black_box(match pattern {
                    ReadPattern::OneStream => xor_streams_widest::<1>(part),
                    ReadPattern::TwoStreams => xor_streams_widest::<2>(part),
                    ReadPattern::SixteenPrefetched => xor_streams_widest::<16>(part),
                })
            });
        }
    });
    start.elapsed().as_secs_f64()
}

/// [`xor_streams`] compiled for AVX-512 where the CPU has it (one 64-byte load per line), else
/// for the baseline. The baseline's 16-byte loads read W at 19–29 GB/s on the Sapphire
/// Rapids VM where 64-byte loads read 32–34 (a C probe, 1244 MB, two threads): a floor read
/// slower than the machine's best would flatter every fused/floor ratio.
fn xor_streams_widest<const N: usize>(part: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        #[target_feature(enable = "avx512f")]
        fn wide<const N: usize>(part: &[u64]) -> u64 {
            xor_streams::<N>(part)
        }
        // SAFETY: the CPU has AVX-512 F (checked above).
        return unsafe { wide::<N>(part) };
    }
    xor_streams::<N>(part)
}

/// XOR of every word of `part`, read as `N` equal parts side by side in 64-byte steps (eight
/// independent lanes vectorize), each part's line two steps ahead prefetched where `N > 2`.
#[inline(always)]
fn xor_streams<const N: usize>(part: &[u64]) -> u64 {
    const LINE: usize = 8;
    let len = part.len() / N / LINE * LINE;
    let streams: [&[u64]; N] = std::array::from_fn(|p| &part[p * len..(p + 1) * len]);
    let mut lanes = [0u64; LINE];
    for at in (0..len).step_by(LINE) {
        for stream in &streams {
            #[cfg(target_arch = "x86_64")]
            if N > 2 {
                // A prefetch never faults; `wrapping_add` makes no claim about the allocation.
                let ahead = stream.as_ptr().wrapping_add(at + 2 * LINE).cast::<i8>();
                // SAFETY: SSE is baseline on x86_64.
                unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(ahead) };
            }
            // One bounds check per line, so the eight lanes load as one vector.
            let line: &[u64; LINE] = stream[at..at + LINE].try_into().expect("a whole line");
            for k in 0..LINE {
                lanes[k] ^= line[k];
            }
        }
    }
    lanes.iter().chain(&part[N * len..]).fold(0, |acc, &w| acc ^ w)
}

/// The peers' milliseconds at one batch (`None`: not measured).
#[derive(Default, Clone, Copy)]
struct Peers {
    torch_mm: Option<f64>,
    torch_eager: Option<f64>,
    torch_compile: Option<f64>,
    numpy: Option<f64>,
}

impl Peers {
    /// The PyTorch pipeline: the faster of eager and torch.compile.
    fn torch_pipeline(&self) -> Option<f64> {
        match (self.torch_eager, self.torch_compile) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Each column's median over `reps` (a column missing from any rep is `None`).
    fn medians(reps: &[Peers]) -> Peers {
        let med = |get: fn(&Peers) -> Option<f64>| {
            let t: Option<Vec<f64>> = reps.iter().map(get).collect();
            t.filter(|t| !t.is_empty()).map(flashsample_bench::median)
        };
        Peers { torch_mm: med(|p| p.torch_mm), torch_eager: med(|p| p.torch_eager), torch_compile: med(|p| p.torch_compile), numpy: med(|p| p.numpy) }
    }
}

/// `bench/peers/cpu_peers.py --serve` for one hidden size: the peers run one call at a time on
/// request, so each rep of a row runs the fused launch, a read of W and one call of every peer
/// back to back, and all of them see the same phase of a shared machine's memory bandwidth
/// (this VM's moves 2-3x within minutes: BENCHMARKS.md, CPU 2026-12-06).
struct PeerServer {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl PeerServer {
    fn start(args: &Args, dim: usize, threads: usize, copies: usize) -> Result<PeerServer, String> {
        use std::process::{Command, Stdio};
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/peers/cpu_peers.py");
        let mut cmd = Command::new(&args.python);
        cmd.arg(script)
            .args(["--serve", "--dim", &dim.to_string(), "--vocab", &args.vocab.to_string()])
            .args(["--threads", &threads.to_string(), "--copies", &copies.to_string()])
            // OpenBLAS's idle workers spin for ~2^28 cycles after each call (its default
            // thread timeout), taking a core from the fused launch that follows numpy's call:
            // B = 1, D = 4096 ran 65-80 ms against 47-51 with the workers put to sleep at once.
            .env("OPENBLAS_THREAD_TIMEOUT", "4")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if args.no_compile {
            cmd.arg("--no-compile");
        }
        if args.filter {
            cmd.arg("--filter");
        }
        let mut child = cmd.spawn().map_err(|e| format!("could not run `{}`: {e}", args.python))?;
        let (stdin, stdout) = (child.stdin.take().ok_or("no stdin")?, child.stdout.take().ok_or("no stdout")?);
        let mut server = PeerServer { child, stdin, stdout: std::io::BufReader::new(stdout) };
        let hello = server.reply()?;
        if hello["torch"].is_null() {
            eprintln!(
                "cpu_bench: `{}` has no torch: PyTorch columns skipped (install it in a venv: README, \"CPU benchmark\")",
                args.python
            );
        }
        if hello["numpy"].is_null() {
            eprintln!("cpu_bench: `{}` has no numpy: numpy column skipped", args.python);
        }
        Ok(server)
    }

    fn reply(&mut self) -> Result<serde_json::Value, String> {
        use std::io::BufRead;
        let mut line = String::new();
        self.stdout.read_line(&mut line).map_err(|e| format!("cpu_peers.py: {e}"))?;
        serde_json::from_str(&line).map_err(|e| format!("cpu_peers.py answered {line:?}: {e}"))
    }

    fn request(&mut self, line: &str) -> Result<serde_json::Value, String> {
        use std::io::Write;
        writeln!(self.stdin, "{line}").and_then(|_| self.stdin.flush()).map_err(|e| format!("cpu_peers.py: {e}"))?;
        self.reply()
    }

    /// Compiles and warms every peer at `batch`.
    fn warm(&mut self, batch: usize) -> Result<(), String> {
        self.request(&format!("warm {batch}")).map(|_| ())
    }

    /// One timed call of every peer at `batch`.
    fn time(&mut self, batch: usize) -> Result<Peers, String> {
        let r = self.request(&format!("time {batch}"))?;
        let ms = |k: &str| r[k].as_f64();
        Ok(Peers { torch_mm: ms("torch_mm"), torch_eager: ms("torch_eager"), torch_compile: ms("torch_compile"), numpy: ms("numpy") })
    }
}

/// `f` on the peers' server, if it still runs; an error is reported and ends the peers for the
/// rest of the run.
fn with_peers<T>(peers: &mut Option<PeerServer>, f: impl FnOnce(&mut PeerServer) -> Result<T, String>) -> Option<T> {
    let result = f(peers.as_mut()?);
    result
        .map_err(|e| {
            eprintln!("cpu_bench: Python peers stopped: {e}");
            *peers = None;
        })
        .ok()
}

impl Drop for PeerServer {
    fn drop(&mut self) {
        use std::io::Write;
        let _ = writeln!(self.stdin, "quit").and_then(|_| self.stdin.flush());
        let _ = self.child.wait();
    }
}

/// One row's results.
struct Row {
    dim: usize,
    batch: usize,
    engine: String,
    /// Median seconds of the fused launches.
    fused: f64,
    /// The best of the reads of W alternating with them, seconds.
    floor: f64,
    w_bytes: usize,
    peers: Peers,
    unfused: Option<f64>,
    /// The `--nucleus` pair of seconds.
    nucleus: Option<(f64, f64)>,
}

fn ms(x: Option<f64>) -> String {
    x.map_or_else(|| "–".into(), |v| format!("{v:.1}"))
}

fn main() -> flashsample::Result<()> {
    let args = Args::parse();
    let device = Device::cpu();
    let threads = match &device {
        Device::Cpu { threads } => *threads,
        _ => 1,
    };
    let mut pipeline = PipelineBuilder::new("Bench", DType::BF16, DType::BF16);
    pipeline = if args.filter {
        // Per-row temperatures, so the `--nucleus` row can run at T = 2.
        pipeline.temperature_per_row("t").filter("filter", 64)
    } else {
        pipeline.temperature_const(0.7)
    };
    if args.logprobs {
        pipeline = pipeline.outputs(flashsample_ir::Outputs { score: false, logsumexp: true, logprob: true, top_logprobs: args.top_logprobs });
    }
    if args.raw {
        pipeline = pipeline.logprob_mode(flashsample_ir::LogprobMode::Raw);
    }
    let sampler = Sampler::new(pipeline.build()?, &device)?;
    println!(
        "device {}, V = {}, bf16, T = 0.7{}{}{}{}, medians of {} after 1 warm-up",
        device.describe(),
        args.vocab,
        args.logit_std.map_or(String::new(), |s| format!(", raw logit std {s}")),
        match (args.logits, args.noise_skip) {
            (shape, Some(skip)) if shape.is_lm_like() => format!(", {shape:?} rows, noise skip {skip:?}"),
            (shape, None) if shape.is_lm_like() => format!(", {shape:?} rows"),
            (_, Some(skip)) => format!(", noise skip {skip:?}"),
            _ => String::new(),
        },
        if args.filter { ", top-k 50 + top-p 0.9" } else { "" },
        match (args.logprobs, args.raw) {
            (true, true) => format!(", + raw logprob and logsumexp, top {} logprobs", args.top_logprobs),
            (true, false) => format!(", + logprob and logsumexp, top {} logprobs", args.top_logprobs),
            _ => String::new(),
        },
        args.reps
    );
    let peers_wanted = !args.no_peers;
    let mut rng = StdRng::seed_from_u64(1);
    let mut rows = Vec::new();
    for &dim in &args.dims {
        let half_width = args.logit_std.map_or(0.05, |std| 3.0 * std / (dim as f32).sqrt());
        let weights: Vec<bf16> = (0..args.vocab * dim).map(|_| bf16::from_f32(rng.random_range(-half_width..half_width))).collect();
        let w_bytes = weights.len() * 2;
        let copies = w_copies(w_bytes);
        // The first copy is the generated W itself: a 2.5 GB W (D = 8192) is not held twice.
        let clones: Vec<Vec<bf16>> = (1..copies).map(|_| weights.clone()).collect();
        let weights: Vec<Vec<bf16>> = std::iter::once(weights).chain(clones).collect();
        eprintln!("cpu_bench: D = {dim}: {copies} rotating cop{} of W ({} MB)", if copies == 1 { "y" } else { "ies" }, w_bytes / 1_000_000);
        let mut peers = if peers_wanted {
            PeerServer::start(&args, dim, threads, copies).map_err(|e| eprintln!("cpu_bench: Python peers skipped: {e}")).ok()
        } else {
            None
        };
        for &batch in &args.batches {
            let hidden = args.logits.hidden(&weights[0], dim, batch, 100 + batch as u64, || (0..batch * dim).map(|_| bf16::from_f32(rng.random_range(-1.0..1.0))).collect());
            if args.logits.is_lm_like() {
                println!("D {dim} B {batch}, LM-like rows 0–2: {}", flashsample_bench::logits::describe_rows(&weights[0], &hidden, dim, &[0.7; 3], 3));
            }
            let h = Tensor::host(&hidden, batch, dim)?;
            let ws = weights.iter().map(|w| Tensor::host(w, args.vocab, dim)).collect::<Result<Vec<_>, _>>()?;
            // Each access to W takes the next copy (module doc).
            let turn = std::cell::Cell::new(0usize);
            let next = || {
                let i = turn.get();
                turn.set((i + 1) % copies);
                i
            };
            let filters = vec![RowFilter { top_k: TOP_K as u32, top_p: TOP_P, min_p: 0.0 }; batch];
            let temps = vec![0.7f32; batch];
            let params = SamplingParams {
                seed: 7,
                filter: args.filter.then_some(&filters[..]),
                temperature: if args.filter { TemperatureArg::PerRow(&temps) } else { TemperatureArg::None },
                ..Default::default()
            };
            let config = match args.engine {
                Some(engine) => {
                    KernelConfig::Cpu(CpuConfig { threads, ..CpuConfig::heuristic_for_engine(engine, batch, dim, args.vocab) })
                }
                None => sampler.config_for(batch, dim, args.vocab),
            };
            let config = match (config, args.noise_skip) {
                (KernelConfig::Cpu(c), Some(noise_skip)) => KernelConfig::Cpu(CpuConfig { noise_skip, ..c }),
                (config, _) => config,
            };
            let engine = match &config {
                KernelConfig::Cpu(c) => c.engine.to_string(),
                _ => "?".into(),
            };
            // Paired reps: a fused launch, a read of W and one call of each peer, in turn, so
            // the ratios compare runs that shared the machine's bandwidth of the moment.
            // Rows the host API ran again because short lists overflowed, over the launches.
            let reruns = std::cell::Cell::new(0);
            let launch = || -> flashsample::Result<f64> {
                let w = ws[next()];
                let start = std::time::Instant::now();
                let s = sampler.sample_with(h, w, &params, &config)?;
                let elapsed = start.elapsed().as_secs_f64();
                reruns.set(reruns.get() + s.list_reruns);
                Ok(elapsed)
            };
            launch()?;
            with_peers(&mut peers, |server| server.warm(batch));
            // The best read of W in any pattern.
            let read = || {
                ReadPattern::ALL
                    .into_iter()
                    .map(|pattern| read_pass(&weights[next()], threads, pattern))
                    .fold(f64::INFINITY, f64::min)
            };
            let mut floor = read();
            let (mut fused, mut peer_reps) = (Vec::new(), Vec::new());
            for _ in 0..args.reps {
                fused.push(launch()?);
                floor = floor.min(read());
                peer_reps.extend(with_peers(&mut peers, |server| server.time(batch)));
            }
            if args.filter {
                println!("D {dim} B {batch}: the host API reran {} rows over {} launches (short lists overflowed)", reruns.get(), args.reps + 1);
            }
            let nucleus = if args.nucleus {
                // The last row on a lone top-p: `top_p` at temperature `t`; every row must be
                // sampled (the nucleus row exactly).
                let time_last_row = |top_p: f32, t: f32| {
                    let (mut filters, mut temps) = (filters.clone(), temps.clone());
                    filters[batch - 1] = RowFilter::top_p(top_p);
                    temps[batch - 1] = t;
                    let params = SamplingParams { filter: Some(&filters), temperature: TemperatureArg::PerRow(&temps), ..params };
                    median_secs(1, args.reps, || sampler.sample_with(h, ws[next()], &params, &config)?.into_complete().map(|_| ()))
                };
                Some((time_last_row(LSE_ONLY_TOP_P, NUCLEUS_T)?, time_last_row(NUCLEUS_TOP_P, NUCLEUS_T)?))
            } else {
                None
            };
            let unfused = args.unfused.then(|| {
                let hidden_f32: Vec<f32> = hidden.iter().map(|x| x.to_f32()).collect();
                let mut logits = vec![0.0f32; batch * args.vocab];
                median_secs::<()>(1, args.reps, || {
                    unfused_logits(&hidden_f32, &weights[next()], batch, dim, args.vocab, &mut logits);
                    if args.filter {
                        std::hint::black_box(unfused_sample_filtered(&logits, batch, args.vocab, 0.7, 7));
                    } else {
                        std::hint::black_box(unfused_sample(&logits, batch, args.vocab, 0.7, 7));
                    }
                    Ok(())
                })
                .unwrap_or(f64::NAN)
            });
            let peers = Peers::medians(&peer_reps);
            rows.push(Row { dim, batch, engine, fused: flashsample_bench::median(fused), floor, w_bytes, peers, unfused, nucleus });
        }
    }
    let rows: Vec<Vec<String>> = rows
        .into_iter()
        .map(|Row { dim, batch, engine, fused, floor, w_bytes, peers: p, unfused, nucleus }| {
            let torch = p.torch_pipeline();
            vec![
                dim.to_string(),
                batch.to_string(),
                engine,
                format!("{:.1}", fused * 1e3),
                format!("{:.2}x", fused / floor),
                ms(torch),
                torch.map_or_else(|| "–".into(), |t| format!("{:.2}x", t / (fused * 1e3))),
                ms(p.torch_eager),
                ms(p.torch_compile),
                ms(p.torch_mm),
                ms(p.numpy),
                ms(unfused.map(|u| u * 1e3)),
                format!("{:.1}", floor * 1e3),
                format!("{:.1}", w_bytes as f64 / floor / 1e9),
                ms(nucleus.map(|n| n.0 * 1e3)),
                ms(nucleus.map(|n| n.1 * 1e3)),
                nucleus.map_or_else(|| "–".into(), |n| format!("{:.2}x", n.1 / fused)),
                nucleus.map_or_else(|| "–".into(), |n| format!("{:.2}x", n.1 / n.0)),
            ]
        })
        .collect();
    print_table(
        &[
            "D",
            "B",
            "engine",
            "fused ms",
            "fused/floor",
            "PyTorch pipeline ms",
            "PyTorch/fused",
            "eager",
            "compile",
            "PyTorch matmul alone",
            "numpy f32",
            "Rust unfused",
            "floor ms",
            "read GB/s",
            "lse batch ms",
            "with a nucleus row ms",
            "nucleus/batch",
            "nucleus/lse batch",
        ],
        &rows,
    );
    println!("floor = W / the best all-thread read of W among the row's reps (each rep: a fused launch, a read in each pattern, one call of each peer); every access takes the next of the rotating copies of W");
    Ok(())
}
