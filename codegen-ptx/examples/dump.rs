//! Prints the PTX (or with `ir`, the LLVM IR) of a small pipeline: `cargo run --example dump [ir] [simt]`.
use flashsample_codegen_ptx::{compile, llvm_ir, Arch, GpuConfig};
use flashsample_ir::{DType, Outputs, PipelineBuilder};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let simt = args.iter().any(|a| a == "simt");
    let dt = if simt { DType::F32 } else { DType::BF16 };
    let p = PipelineBuilder::new("Q", dt, dt)
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
        .unwrap();
    let bt: u32 = std::env::var("BT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    let c = GpuConfig {
        vocab_tile: 128,
        batch_tile: bt,
        k_step: 64,
        warps: 4,
        stages: if simt { 1 } else { 4 },
        persistent: false,
        list_per_tile: 0,
    };
    if args.iter().any(|a| a == "ir") {
        println!("{}", llvm_ir(&p, &c).unwrap());
    } else {
        match compile(&p, &c, Arch::Sm90) {
            Ok(k) => println!("{}", k.ptx),
            Err(e) => eprintln!("{e}"),
        }
    }
}
