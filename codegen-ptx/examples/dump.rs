//! Prints the PTX (or with `ir`, the LLVM IR) of a pipeline: `cargo run --example dump [ir]
//! [simt] [bench] [filter]`. `bench` is gpu_bench's pipeline (per-row temperature + Gumbel),
//! `filter` adds its top-k/top-p filter; the tile config comes from the environment
//! (`VT`, `BT`, `WARPS`, `KS`, `STAGES`, defaults 128, 16, 4, 64, 4; `WGMMA=1`, `TMA=1`,
//! `DRAIN=1` and `PERSISTENT=1` switch those on; `STAGGER_US` sets the stagger).
use flashsample_codegen_ptx::{compile, llvm_ir, Arch, GpuConfig};
use flashsample_ir::{DType, Outputs, PipelineBuilder};

fn env_u32(name: &str, default: u32) -> u32 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let has = |a: &str| args.iter().any(|x| x == a);
    let simt = has("simt");
    let dt = if simt { DType::F32 } else { DType::BF16 };
    let p = if has("bench") {
        let b = PipelineBuilder::new("Bench", dt, dt).temperature_per_row("temperature");
        let b = if has("filter") { b.filter("filter", 50) } else { b };
        b.gumbel("seed", 1).build().unwrap()
    } else {
        PipelineBuilder::new("Q", dt, dt)
            .temperature_per_row("t")
            .bias("b")
            .mask("m")
            .softcap(30.0)
            .gumbel("seed", 2)
            .outputs(Outputs {
                score: true,
                logsumexp: true,
                logprob: false,
                top_logprobs: 0,
            })
            .build()
            .unwrap()
    };
    let mut c = GpuConfig {
        vocab_tile: env_u32("VT", 128),
        batch_tile: env_u32("BT", 16),
        k_step: env_u32("KS", 64),
        warps: env_u32("WARPS", 4),
        stages: if simt { 1 } else { env_u32("STAGES", 4) },
        persistent: env_u32("PERSISTENT", 0) == 1,
        list_per_tile: 0,
        wgmma: env_u32("WGMMA", 0) == 1 || env_u32("TMA", 0) == 1,
        tma: env_u32("TMA", 0) == 1,
        wgmma_drain: env_u32("DRAIN", 0) == 1,
        stagger_us: env_u32("STAGGER_US", 0),
        pingpong: env_u32("PINGPONG", 0) != 0,
    };
    c.fit_lists(&p);
    if has("ir") {
        println!("{}", llvm_ir(&p, &c).unwrap());
    } else {
        match compile(&p, &c, Arch::Sm90) {
            Ok(k) => println!("{}", k.ptx),
            Err(e) => eprintln!("{e}"),
        }
    }
}
