//! PTX generation runs entirely inside LLVM: no ptxas, no CUDA toolkit, no GPU.

use flashsample_codegen_ptx::{compile, Arch, GpuConfig, Grid, Schedule};
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
    let c = GpuConfig::new(128, 8, 4, Schedule::MmaSync { stages: 2, k_step: 64, grid: Grid::PerItem });
    let k = compile(&p, &c, Arch::Sm90).unwrap();
    assert!(k.ptx.contains(".entry flashsample_stage1"));
    assert!(k.ptx.contains(".entry flashsample_stage2"));
}
