//! PTX generation runs entirely inside LLVM: no ptxas, no CUDA toolkit, no GPU.

use flashsample_codegen_ptx::{compile, Arch, GpuConfig};
use flashsample_ir::{DType, PipelineBuilder};

#[test]
fn generates_ptx_with_an_empty_path() {
    // This test binary is its own process, so changing PATH affects nothing else.
    let empty = std::env::temp_dir().join("flashsample-no-tools");
    std::fs::create_dir_all(&empty).unwrap();
    std::env::set_var("PATH", &empty);
    std::env::remove_var("CUDA_PATH");
    std::env::remove_var("CUDA_HOME");
    let p = PipelineBuilder::new("P", DType::BF16, DType::BF16)
        .gumbel("seed", 1)
        .build()
        .unwrap();
    let c = GpuConfig {
        vocab_tile: 128,
        batch_tile: 8,
        k_step: 64,
        warps: 4,
        stages: 2,
        persistent: false,
        list_per_tile: 0,
        wgmma: false,
        tma: false,
        wgmma_drain: false,
        stagger_us: 0,
        pingpong: false,
    };
    let k = compile(&p, &c, Arch::Sm90).unwrap();
    assert!(k.ptx.contains(".entry flashsample_stage1"));
    assert!(k.ptx.contains(".entry flashsample_stage2"));
}
