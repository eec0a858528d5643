//! Runs the generated kernels on a CUDA GPU and checks them against the abi semantics
//! computed on the CPU: `cargo run --release --example gpu_check [bench]`.
//!
//! Per (row, sample, tile) candidate: the GPU winner is allowed and in the tile, its logit
//! matches the CPU's transformed logit within the matmul's rounding bound, its score is
//! exactly `logit + gumbel_f32(noise_bits(..))` (bit-identical noise), and no CPU score in
//! the tile beats it by more than that bound. Stage two must equal `abi::StageTwo::reduce`
//! applied to the GPU's own candidates.

use cudarc::driver::{sys, CudaContext, DevicePtr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use flashsample_abi::math::softcap_f32;
use flashsample_abi::rng::{gumbel_f32, noise_bits};
use flashsample_abi::{Candidate, LsePartial, StageTwo, INDEX_NONE, INDEX_NONFINITE};
use flashsample_codegen_ptx::{compile_with, Arch, CodegenOptions, GpuConfig, GpuLimits};
use flashsample_ir::{DType, Outputs, Pipeline, PipelineBuilder, Transform};
use std::sync::Arc;
use std::time::Instant;

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
    fn unit(&mut self) -> f32 {
        self.next() as f32 / (1u64 << 31) as f32 * 2.0 - 1.0
    }
}

fn encode(vals: &[f32], dt: DType) -> Vec<u8> {
    match dt {
        DType::F32 => bytemuck::cast_slice(vals).to_vec(),
        DType::BF16 => vals
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect(),
        DType::F16 => vals
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes())
            .collect(),
    }
}
fn decode(vals: &[f32], dt: DType) -> Vec<f64> {
    match dt {
        DType::F32 => vals.iter().map(|v| f64::from(*v)).collect(),
        DType::BF16 => vals
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f64())
            .collect(),
        DType::F16 => vals
            .iter()
            .map(|v| half::f16::from_f32(*v).to_f64())
            .collect(),
    }
}

struct Case {
    name: String,
    pipeline: Pipeline,
    config: GpuConfig,
    batch: usize,
    dim: usize,
    vocab: usize,
    nan_hidden_row: Option<usize>,
    all_masked_row: Option<usize>,
}

fn pipeline(dt: DType, greedy: bool, full: bool, samples: u32) -> Pipeline {
    let mut b = PipelineBuilder::new("P", dt, dt);
    if full {
        b = b.temperature_per_row("t").bias("b").mask("m").softcap(20.0);
    }
    b = if greedy {
        b.argmax()
    } else {
        b.gumbel("seed", samples)
    };
    if full {
        b = b.outputs(Outputs {
            score: true,
            logsumexp: true,
            logprob: false,
            top_logprobs: 0,
        });
    }
    b.build().unwrap()
}

fn run_case(ctx: &Arc<CudaContext>, case: &Case, bench: usize) -> Result<f64, String> {
    let p = &case.pipeline;
    let c = &case.config;
    c.validate(p, &GpuLimits::H200)
        .map_err(|e| format!("validate: {e}"))?;
    let opts = match std::env::var("OUTLINE").as_deref() {
        Ok("1") => CodegenOptions { outline_math: true, skip_logsumexp: false },
        Ok("0") => CodegenOptions {
            outline_math: false,
            skip_logsumexp: false,
        },
        _ => CodegenOptions::for_config(c),
    };
    let compiled = compile_with(p, c, Arch::Sm90, opts).map_err(|e| e.to_string())?;
    let stream = ctx.default_stream();
    let module = ctx
        .load_module(Ptx::from_src(compiled.ptx.clone()))
        .map_err(|e| format!("load: {e:?}"))?;
    let k1 = module
        .load_function("flashsample_stage1")
        .map_err(|e| format!("{e:?}"))?;
    let k2 = module
        .load_function("flashsample_stage2")
        .map_err(|e| format!("{e:?}"))?;
    let (b, d, v) = (case.batch, case.dim, case.vocab);
    let s = p.samples_per_row() as usize;
    let mut rng = Lcg(case.name.len() as u64 * 7919 + (b * d * v) as u64);
    let mut h: Vec<f32> = (0..b * d).map(|_| rng.unit()).collect();
    let w: Vec<f32> = (0..v * d).map(|_| rng.unit() * 0.5).collect();
    if let Some(r) = case.nan_hidden_row {
        h[r * d + d / 2] = f32::NAN;
    }
    let temps: Vec<f32> = (0..b)
        .map(|r| {
            if r % 4 == 3 {
                0.0
            } else {
                0.5 + r as f32 * 0.25
            }
        })
        .collect();
    let bias: Vec<f32> = (0..v)
        .map(|i| {
            if i % 97 == 5 {
                f32::NEG_INFINITY
            } else {
                rng.unit()
            }
        })
        .collect();
    let words = v.div_ceil(32);
    let mut allowed: Vec<u32> = (0..b * words).map(|_| rng.next() | rng.next()).collect();
    for r in 0..b {
        if v % 32 != 0 {
            allowed[r * words + words - 1] &= (1u32 << (v % 32)) - 1;
        }
    }
    if let Some(r) = case.all_masked_row {
        allowed[r * words..(r + 1) * words].fill(0);
    }
    let seed = 0x1234_5678_9abc_def0u64 ^ (b as u64);
    let tiles = c.tiles(v);

    let hd = stream
        .clone_htod(&encode(&h, p.hidden.dtype))
        .map_err(|e| format!("{e:?}"))?;
    let wd = stream
        .clone_htod(&encode(&w, p.weights.dtype))
        .map_err(|e| format!("{e:?}"))?;
    let td = stream.clone_htod(&temps).map_err(|e| format!("{e:?}"))?;
    let bd = stream.clone_htod(&bias).map_err(|e| format!("{e:?}"))?;
    let ad = stream.clone_htod(&allowed).map_err(|e| format!("{e:?}"))?;
    let cand = stream
        .alloc_zeros::<u32>(b * s * tiles * 3)
        .map_err(|e| format!("{e:?}"))?;
    let lse = stream
        .alloc_zeros::<f32>(b * tiles * 2)
        .map_err(|e| format!("{e:?}"))?;
    let o_tok = stream
        .alloc_zeros::<u32>(b * s)
        .map_err(|e| format!("{e:?}"))?;
    let o_sc = stream
        .alloc_zeros::<f32>(b * s)
        .map_err(|e| format!("{e:?}"))?;
    let o_lg = stream
        .alloc_zeros::<f32>(b * s)
        .map_err(|e| format!("{e:?}"))?;
    let o_lse = stream.alloc_zeros::<f32>(b).map_err(|e| format!("{e:?}"))?;
    let o_st = stream.alloc_zeros::<u32>(b).map_err(|e| format!("{e:?}"))?;
    let full = p.has_bias();
    let needs_lse = p.needs_logsumexp();
    let (hp, wp) = (hd.device_ptr(&stream).0, wd.device_ptr(&stream).0);
    let tp = td.device_ptr(&stream).0;
    let bp = if full { bd.device_ptr(&stream).0 } else { 0 };
    let ap = if p.has_mask() {
        ad.device_ptr(&stream).0
    } else {
        0
    };
    let cp = cand.device_ptr(&stream).0;
    let lp = if needs_lse {
        lse.device_ptr(&stream).0
    } else {
        0
    };
    let (otp, osp, olp) = (
        o_tok.device_ptr(&stream).0,
        o_sc.device_ptr(&stream).0,
        o_lg.device_ptr(&stream).0,
    );
    let olsep = if needs_lse {
        o_lse.device_ptr(&stream).0
    } else {
        0
    };
    let ostp = o_st.device_ptr(&stream).0;
    let smem = c.smem_bytes();
    if smem > 48 * 1024 {
        k1.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(|e| format!("{e:?}"))?;
    }
    let cfg1 = LaunchConfig {
        grid_dim: c.grid(b, v, 132),
        block_dim: c.block(),
        shared_mem_bytes: smem,
    };
    let cfg2 = LaunchConfig {
        grid_dim: c.stage2_grid(b),
        block_dim: (c.stage2_block_threads(), 1, 1),
        shared_mem_bytes: 0,
    };
    let (bu, du, vu, su, tu) = (b as u32, d as u32, v as u32, s as u32, tiles as u32);
    let launch = || -> Result<(), String> {
        let mut l = stream.launch_builder(&k1);
        l.arg(&hp)
            .arg(&wp)
            .arg(&tp)
            .arg(&bp)
            .arg(&ap)
            .arg(&cp)
            .arg(&lp)
            .arg(&seed)
            .arg(&bu)
            .arg(&du)
            .arg(&vu);
        unsafe { l.launch(cfg1) }.map_err(|e| format!("launch1 {e:?}"))?;
        let mut l = stream.launch_builder(&k2);
        l.arg(&cp)
            .arg(&lp)
            .arg(&bu)
            .arg(&su)
            .arg(&tu)
            .arg(&otp)
            .arg(&osp)
            .arg(&olp)
            .arg(&olsep)
            .arg(&ostp);
        unsafe { l.launch(cfg2) }.map_err(|e| format!("launch2 {e:?}"))?;
        Ok(())
    };
    launch()?;
    stream.synchronize().map_err(|e| format!("sync {e:?}"))?;
    let mut us = 0.0;
    if bench > 0 {
        let t0 = Instant::now();
        for _ in 0..bench {
            launch()?;
        }
        stream.synchronize().map_err(|e| format!("sync {e:?}"))?;
        us = t0.elapsed().as_secs_f64() * 1e6 / bench as f64;
    }
    let cand_h: Vec<u32> = stream.clone_dtoh(&cand).map_err(|e| format!("{e:?}"))?;
    let cands: Vec<Candidate> = bytemuck::cast_slice(&cand_h).to_vec();
    let lse_h: Vec<f32> = stream.clone_dtoh(&lse).map_err(|e| format!("{e:?}"))?;
    let lse_parts: Vec<LsePartial> = bytemuck::cast_slice(&lse_h).to_vec();
    let tok: Vec<u32> = stream.clone_dtoh(&o_tok).map_err(|e| format!("{e:?}"))?;
    let sc: Vec<f32> = stream.clone_dtoh(&o_sc).map_err(|e| format!("{e:?}"))?;
    let lg: Vec<f32> = stream.clone_dtoh(&o_lg).map_err(|e| format!("{e:?}"))?;
    let olse: Vec<f32> = stream.clone_dtoh(&o_lse).map_err(|e| format!("{e:?}"))?;
    let st: Vec<u32> = stream.clone_dtoh(&o_st).map_err(|e| format!("{e:?}"))?;
    if bench > 0 && v * d > 50_000_000 {
        return Ok(us); // too big to check on the CPU here
    }

    // CPU semantics.
    let hq = decode(&h, p.hidden.dtype);
    let wq = decode(&w, p.weights.dtype);
    let layout = StageTwo {
        batch: b,
        samples: s,
        tiles,
    };
    let mut errors = Vec::new();
    for r in 0..b {
        let t = if p.temperature().is_some() {
            temps[r]
        } else {
            1.0
        };
        let greedy = p.is_greedy() || (p.temperature().is_some() && t == 0.0);
        let mut xs = vec![f32::NEG_INFINITY; v];
        let mut tol = vec![0f32; v];
        let mut nonfinite = vec![false; tiles];
        for tok_v in 0..v {
            let (mut raw, mut abs) = (0f64, 0f64);
            for k in 0..d {
                let pr = hq[r * d + k] * wq[tok_v * d + k];
                raw += pr;
                abs += pr.abs();
            }
            if !raw.is_finite() {
                nonfinite[tok_v / c.vocab_tile as usize] = true;
                continue;
            }
            let mut x = raw as f32;
            let mut scale = 1f32;
            for tr in &p.transforms {
                match tr {
                    Transform::Temperature(_) if t != 0.0 => {
                        x *= 1.0 / t;
                        scale /= t;
                    }
                    Transform::Bias { .. } => x += bias[tok_v],
                    Transform::Softcap { cap } => x = softcap_f32(x, cap.get()),
                    _ => {}
                }
            }
            let ok = !p.has_mask() || allowed[r * words + tok_v / 32] >> (tok_v % 32) & 1 == 1;
            xs[tok_v] = if ok { x } else { f32::NEG_INFINITY };
            tol[tok_v] = (abs as f32 * (d as f32 * 1.2e-7) + 1e-6) * scale + x.abs() * 1e-6;
        }
        for smp in 0..s {
            for tile in 0..tiles {
                let got = cands[layout.slot(r, smp, tile)];
                let lo = tile * c.vocab_tile as usize;
                let hi = (lo + c.vocab_tile as usize).min(v);
                if nonfinite[tile] {
                    if got.index != INDEX_NONFINITE {
                        errors.push(format!("r{r} s{smp} t{tile}: want NONFINITE, got {got:?}"));
                    }
                    continue;
                }
                let score = |i: usize| {
                    if greedy || xs[i] == f32::NEG_INFINITY {
                        xs[i]
                    } else {
                        xs[i] + gumbel_f32(noise_bits(seed, r as u32, smp as u32, i as u32, 0))
                    }
                };
                let best = (lo..hi)
                    .filter(|&i| score(i) > f32::NEG_INFINITY)
                    .max_by(|&a, &b2| score(a).total_cmp(&score(b2)).then(b2.cmp(&a)));
                match (best, got.index) {
                    (None, INDEX_NONE) => {}
                    (None, _) | (Some(_), INDEX_NONE) | (Some(_), INDEX_NONFINITE) => {
                        errors.push(format!("r{r} s{smp} t{tile}: cpu {best:?}, gpu {got:?}"))
                    }
                    (Some(bi), gi) => {
                        let gi = gi as usize;
                        if !(lo..hi).contains(&gi) || xs[gi] == f32::NEG_INFINITY {
                            errors.push(format!("r{r} s{smp} t{tile}: gpu index {gi} not an allowed token of the tile"));
                            continue;
                        }
                        if (got.logit - xs[gi]).abs() > tol[gi] * 4.0 + 1e-4 {
                            errors.push(format!(
                                "r{r} s{smp} t{tile}: logit of {gi}: gpu {} cpu {}",
                                got.logit, xs[gi]
                            ));
                        }
                        let want_score = if greedy {
                            got.logit
                        } else {
                            got.logit
                                + gumbel_f32(noise_bits(seed, r as u32, smp as u32, gi as u32, 0))
                        };
                        if got.score.to_bits() != want_score.to_bits() {
                            errors.push(format!(
                                "r{r} s{smp} t{tile}: score {} != logit + noise {}",
                                got.score, want_score
                            ));
                        }
                        if score(bi) - got.score > tol[bi] * 4.0 + tol[gi] * 4.0 + 1e-4 {
                            errors.push(format!(
                                "r{r} s{smp} t{tile}: cpu best {bi} ({}) beats gpu {gi} ({})",
                                score(bi),
                                got.score
                            ));
                        }
                    }
                }
            }
        }
        if needs_lse {
            for tile in 0..tiles {
                let lo = tile * c.vocab_tile as usize;
                let hi = (lo + c.vocab_tile as usize).min(v);
                if nonfinite[tile] {
                    continue;
                }
                let live: Vec<f64> = (lo..hi)
                    .map(|i| f64::from(xs[i]))
                    .filter(|x| *x > f64::NEG_INFINITY)
                    .collect();
                let got = lse_parts[r * tiles + tile];
                if live.is_empty() {
                    if got != LsePartial::EMPTY {
                        errors.push(format!("r{r} t{tile}: lse want EMPTY got {got:?}"));
                    }
                    continue;
                }
                let m = live.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let want = m + live.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                let g = f64::from(got.max) + f64::from(got.sum).ln();
                if (g - want).abs() > 1e-3 + 1e-4 * want.abs() {
                    errors.push(format!("r{r} t{tile}: lse partial {g} vs {want}"));
                }
            }
        }
    }
    // Stage two against abi on the GPU's own candidates.
    for r in 0..b {
        let one = StageTwo {
            batch: 1,
            samples: s,
            tiles,
        };
        let row_c = &cands[r * s * tiles..(r + 1) * s * tiles];
        let want_status = match one.reduce(row_c, None) {
            Ok(res) => {
                for smp in 0..s {
                    let i = r * s + smp;
                    if tok[i] != res.tokens[smp]
                        || sc[i].to_bits() != res.scores[smp].to_bits()
                        || lg[i].to_bits() != res.logits[smp].to_bits()
                    {
                        errors.push(format!(
                            "stage2 r{r} s{smp}: gpu ({}, {}, {}) abi ({}, {}, {})",
                            tok[i], sc[i], lg[i], res.tokens[smp], res.scores[smp], res.logits[smp]
                        ));
                    }
                }
                0
            }
            Err(flashsample_abi::RowError::AllMasked { .. }) => 1,
            Err(flashsample_abi::RowError::NonFinite { .. }) => 2,
        };
        if st[r] != want_status {
            errors.push(format!("stage2 r{r}: status {} want {want_status}", st[r]));
        }
        if needs_lse && want_status == 0 {
            let want = layout.logsumexp(&lse_parts, r);
            if (f64::from(olse[r]) - want).abs() > 1e-4 * (1.0 + want.abs()) {
                errors.push(format!("stage2 r{r}: lse {} want {want}", olse[r]));
            }
        }
    }
    if errors.is_empty() {
        Ok(us)
    } else {
        let n = errors.len();
        errors.truncate(12);
        Err(format!("{n} mismatches:\n  {}", errors.join("\n  ")))
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let bench = args.iter().any(|a| a == "bench");
    let sweep = args.iter().any(|a| a == "sweep");
    let ctx = CudaContext::new(0).expect("CUDA device 0");
    let cfg = |vocab_tile, batch_tile, k_step, warps, stages, persistent| GpuConfig {
        vocab_tile,
        batch_tile,
        k_step,
        warps,
        stages,
        persistent,
        list_per_tile: 0,
        wgmma: false,
        tma: false,
        wgmma_drain: false,
        stagger_us: 0,
        pingpong: false,
    };
    let mk = |name: &str, pipeline: Pipeline, config: GpuConfig, batch, dim, vocab| Case {
        name: name.to_string(),
        pipeline,
        config,
        batch,
        dim,
        vocab,
        nan_hidden_row: None,
        all_masked_row: None,
    };
    let bf = DType::BF16;
    let mut cases = vec![
        mk(
            "bf16 full gemv",
            pipeline(bf, false, true, 2),
            cfg(256, 8, 64, 8, 4, false),
            5,
            136,
            1000,
        ),
        mk(
            "bf16 full D%8!=0",
            pipeline(bf, false, true, 2),
            cfg(128, 16, 64, 4, 3, false),
            6,
            100,
            1000,
        ),
        mk(
            "f16 plain persistent",
            pipeline(DType::F16, false, false, 1),
            cfg(128, 32, 128, 4, 2, true),
            37,
            256,
            777,
        ),
        mk(
            "f32 simt full",
            pipeline(DType::F32, false, true, 3),
            cfg(128, 8, 64, 4, 1, false),
            9,
            70,
            500,
        ),
        mk(
            "bf16 greedy big tile",
            pipeline(bf, true, false, 1),
            cfg(256, 64, 64, 4, 4, false),
            70,
            512,
            3000,
        ),
        mk(
            "bf16 full b128",
            pipeline(bf, false, true, 1),
            cfg(128, 128, 64, 4, 2, true),
            130,
            192,
            700,
        ),
        mk(
            "bf16 full quads4",
            pipeline(bf, false, true, 1),
            cfg(512, 16, 64, 4, 2, false),
            20,
            264,
            2100,
        ),
    ];
    let mut nanc = mk(
        "bf16 nan row",
        pipeline(bf, false, true, 1),
        cfg(256, 8, 64, 8, 2, false),
        4,
        64,
        600,
    );
    nanc.nan_hidden_row = Some(1);
    nanc.all_masked_row = Some(2);
    cases.push(nanc);
    let mut nans = mk(
        "simt nan row",
        pipeline(DType::F32, true, true, 1),
        cfg(128, 8, 64, 4, 1, false),
        4,
        33,
        300,
    );
    nans.nan_hidden_row = Some(0);
    nans.all_masked_row = Some(3);
    cases.push(nans);
    if sweep {
        let p = pipeline(bf, false, true, 2);
        let all = GpuConfig::enumerate(&p, &GpuLimits::H200);
        println!("enumerate: {} configs", all.len());
        for (i, c) in all.into_iter().enumerate().filter(|(i, _)| i % 5 == 0) {
            cases.push(mk(&format!("sweep{i} {c:?}"), p.clone(), c, 19, 200, 1500));
        }
    }
    let mut failed = 0;
    if std::env::var_os("SKIP_CHECK").is_some() {
        cases.clear();
    }
    for case in &cases {
        match run_case(&ctx, case, 0) {
            Ok(_) => println!(
                "ok   {} {:?} B={} D={} V={}",
                case.name, case.config, case.batch, case.dim, case.vocab
            ),
            Err(e) => {
                failed += 1;
                println!(
                    "FAIL {} {:?} B={} D={} V={}: {e}",
                    case.name, case.config, case.batch, case.dim, case.vocab
                )
            }
        }
    }
    if bench {
        bench_big(&ctx);
    }
    println!("{} cases, {failed} failed", cases.len());
    std::process::exit(if failed == 0 { 0 } else { 1 });
}

/// Times stage one + two at the Qwen3-8B LM-head shape (D 4096, V 151936) for a few batches.
fn bench_big(ctx: &Arc<CudaContext>) {
    let (d, v) = (4096usize, 151_936usize);
    let p = pipeline(DType::BF16, std::env::var_os("GREEDY").is_some(), true, 1);
    let stream = ctx.default_stream();
    let mut rng = Lcg(99);
    let w: Vec<u16> = (0..v * d)
        .map(|_| half::bf16::from_f32(rng.unit() * 0.05).to_bits())
        .collect();
    let wd = stream.clone_htod(&w).unwrap();
    let hmax: Vec<u16> = (0..256 * d)
        .map(|_| half::bf16::from_f32(rng.unit()).to_bits())
        .collect();
    let hd = stream.clone_htod(&hmax).unwrap();
    let temps = stream.clone_htod(&vec![0.8f32; 256]).unwrap();
    let bias = stream.clone_htod(&vec![0.0f32; v]).unwrap();
    let allowed = stream
        .clone_htod(&vec![u32::MAX; 256 * v.div_ceil(32)])
        .unwrap();
    let cand = stream.alloc_zeros::<u32>(256 * 3 * 2400).unwrap();
    let lse = stream.alloc_zeros::<f32>(256 * 2 * 2400).unwrap();
    let out = stream.alloc_zeros::<u32>(256 * 8).unwrap();
    let ptr = |s: &cudarc::driver::CudaSlice<u16>| s.device_ptr(&stream).0;
    let (wp, hp) = (ptr(&wd), ptr(&hd));
    let (tp, bp, ap) = (
        temps.device_ptr(&stream).0,
        bias.device_ptr(&stream).0,
        allowed.device_ptr(&stream).0,
    );
    let (cp, lp, op) = (
        cand.device_ptr(&stream).0,
        lse.device_ptr(&stream).0,
        out.device_ptr(&stream).0,
    );
    let bytes = (v * d * 2) as f64;
    let batches: Vec<usize> = std::env::var("BATCHES")
        .map(|b| b.split(',').map(|x| x.parse().unwrap()).collect())
        .unwrap_or(vec![1, 8, 32, 64, 256]);
    for batch in batches {
        let mut configs = vec![GpuConfig::heuristic(&p, batch, d, v, &GpuLimits::H200)];
        let all = GpuConfig::enumerate(&p, &GpuLimits::H200);
        let fits: Vec<GpuConfig> = all
            .into_iter()
            .filter(|c| !c.persistent && c.batch_tile as usize <= batch.max(8) * 2)
            .collect();
        let step = std::env::var("STEP")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(fits.len() / 12)
            .max(1);
        configs.extend(fits.iter().step_by(step).cloned());
        let mut results = Vec::new();
        for c in configs {
            let opts = match std::env::var("OUTLINE").as_deref() {
                Ok("1") => CodegenOptions { outline_math: true, skip_logsumexp: false },
                Ok("0") => CodegenOptions {
                    outline_math: false,
                    skip_logsumexp: false,
                },
                _ => CodegenOptions::for_config(&c),
            };
            let Ok(compiled) = compile_with(&p, &c, Arch::Sm90, opts) else {
                continue;
            };
            let module = ctx.load_module(Ptx::from_src(compiled.ptx)).unwrap();
            let k1 = module.load_function("flashsample_stage1").unwrap();
            let k2 = module.load_function("flashsample_stage2").unwrap();
            let smem = c.smem_bytes();
            if smem > 48 * 1024 {
                k1.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .unwrap();
            }
            let tiles = c.tiles(v) as u32;
            let cfg1 = LaunchConfig {
                grid_dim: c.grid(batch, v, 132),
                block_dim: c.block(),
                shared_mem_bytes: smem,
            };
            let cfg2 = LaunchConfig {
                grid_dim: c.stage2_grid(batch),
                block_dim: (c.stage2_block_threads(), 1, 1),
                shared_mem_bytes: 0,
            };
            let (bu, du, vu, su, seed) = (batch as u32, d as u32, v as u32, 1u32, 7u64);
            let (o1, o2, o3, o4, o5) = (op, op + 4096, op + 2 * 4096, op + 3 * 4096, op + 4 * 4096);
            let launch = |two: bool| {
                let mut l = stream.launch_builder(&k1);
                l.arg(&hp)
                    .arg(&wp)
                    .arg(&tp)
                    .arg(&bp)
                    .arg(&ap)
                    .arg(&cp)
                    .arg(&lp)
                    .arg(&seed)
                    .arg(&bu)
                    .arg(&du)
                    .arg(&vu);
                unsafe { l.launch(cfg1) }.unwrap();
                if two {
                    let mut l = stream.launch_builder(&k2);
                    l.arg(&cp)
                        .arg(&lp)
                        .arg(&bu)
                        .arg(&su)
                        .arg(&tiles)
                        .arg(&o1)
                        .arg(&o2)
                        .arg(&o3)
                        .arg(&o4)
                        .arg(&o5);
                    unsafe { l.launch(cfg2) }.unwrap();
                }
            };
            launch(true);
            stream.synchronize().unwrap();
            let n = 20;
            let t0 = Instant::now();
            for _ in 0..n {
                launch(false);
            }
            stream.synchronize().unwrap();
            let us1 = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
            let t0 = Instant::now();
            for _ in 0..n {
                launch(true);
            }
            stream.synchronize().unwrap();
            let us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
            let attr = |a| {
                unsafe {
                    cudarc::driver::result::function::get_function_attribute(k1.cu_function(), a)
                }
                .unwrap_or(-1)
            };
            let regs = attr(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS);
            let local = attr(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES);
            let occ = k1
                .occupancy_max_active_blocks_per_multiprocessor(
                    c.block_threads(),
                    smem as usize,
                    None,
                )
                .unwrap_or(0);
            println!("  B={batch} {us:8.1} us stage1 {us1:8.1} regs {regs} local {local} ctas/SM {occ} {c:?}");
            results.push((us, us1, c));
        }
        let heur = results.first().cloned();
        results.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (us, us1, c) in results.iter().take(3) {
            println!(
                "bench B={batch}: {us:8.1} us total, stage1 {us1:8.1} us ({:.2} TB/s of W) {c:?}",
                bytes / us1 / 1e6
            );
        }
        if let Some((us, us1, c)) = heur {
            println!("bench B={batch}: heuristic {us:8.1} us, stage1 {us1:8.1} us {c:?}");
        }
    }
}
