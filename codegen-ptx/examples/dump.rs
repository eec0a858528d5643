//! Prints the PTX (or with `ir`, the LLVM IR) of a pipeline: `cargo run --example dump [ir]
//! [simt] [greedy | bench [filter] [lse] | score [rank] | spec [filter]]`. `bench` is gpu_bench's pipeline (per-row
//! temperature + Gumbel), `filter` adds its top-k/top-p filter, `lse` a logprob output (the
//! exact logsumexp partials), `greedy` is a bare argmax (`simt`: f32 operands); with ptxas -v
//! it shows each schedule's registers and spills. The tile config comes from the
//! environment: `SCHEDULE` (`simt`, `mma`, `wgmma`, `wgmma-drain`, `tma`, `pingpong`, `coop`, `pair`),
//! `PERSISTENT=1`, `VT`, `BT`, `WARPS`, `KS` (mma only), `STAGES` (defaults 128, 16, 4, 64, 4)
//! and `STAGGER_US`.
use flashsample_codegen_ptx::{compile, llvm_ir, Arch, GpuConfig, Grid, GridKind, Schedule};
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
    let p = if has("greedy") {
        PipelineBuilder::new("Greedy", dt, dt).argmax().build().unwrap()
    } else if has("bench") {
        let b = PipelineBuilder::new("Bench", dt, dt).temperature_per_row("temperature");
        let b = if has("filter") { b.filter("filter", 50) } else { b };
        let b = if has("lse") { b.outputs(Outputs { score: false, logsumexp: false, logprob: true, top_logprobs: 0 }) } else { b };
        b.gumbel("seed", 1).build().unwrap()
    } else if has("spec") {
        // spec_bench's verifier of sampled drafts (top-k/top-p filtered with `filter`).
        let b = PipelineBuilder::new("Spec", dt, dt).temperature_per_row("t");
        let b = if has("filter") { b.filter("filter", 50) } else { b };
        b.verify_sampled("drafts", "draft_probs").build().unwrap()
    } else if has("score") {
        // score_bench's scorer; `rank` adds the target ranks (DESIGN.md step 7c).
        let b = PipelineBuilder::new("Score", dt, dt).temperature_per_row("t").argmax();
        let b = if has("rank") { b.target_logprob_and_rank("targets") } else { b.target_logprob("targets") };
        b.outputs(Outputs { score: false, logsumexp: true, logprob: false, top_logprobs: 0 }).build().unwrap()
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
    let stages = env_u32("STAGES", 4);
    let grid = if env_u32("PERSISTENT", 0) == 1 { Grid::Persistent } else { Grid::PerItem };
    let schedule = match std::env::var("SCHEDULE").as_deref().unwrap_or(if simt { "simt" } else { "mma" }) {
        "simt" => Schedule::Simt { grid },
        "mma" => Schedule::MmaSync { stages, k_step: env_u32("KS", 64), grid },
        "wgmma" => Schedule::Wgmma { stages, drain: false, grid },
        "wgmma-drain" => Schedule::Wgmma { stages, drain: true, grid },
        "tma" => Schedule::WgmmaTma { stages, grid: grid.into() },
        "pingpong" => Schedule::WgmmaTma { stages, grid: GridKind::PingPong },
        "coop" => Schedule::WgmmaTma { stages, grid: GridKind::Cooperative },
        "pair" => Schedule::WgmmaTma { stages, grid: GridKind::CooperativePair },
        other => panic!("SCHEDULE={other}: one of simt, mma, wgmma, wgmma-drain, tma, pingpong, coop, pair"),
    };
    let mut c = GpuConfig::new(env_u32("VT", 128), env_u32("BT", 16), env_u32("WARPS", 4), schedule).with_stagger(env_u32("STAGGER_US", 0));
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
