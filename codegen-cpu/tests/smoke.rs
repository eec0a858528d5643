use flashsample_codegen_cpu::*;
use flashsample_ir::{DType, PipelineBuilder};
#[test]
fn smoke() {
    let p = PipelineBuilder::new("P", DType::F32, DType::BF16).temperature_per_row("t").bias("b").mask("m").softcap(30.0).outputs(flashsample_ir::Outputs{score:true, logsumexp:true, logprob:false}).gumbel("seed", 2).build().unwrap();
    let cfg = CpuConfig { vocab_tile: 8, row_block: 3, threads: 2 };
    let k = CpuKernel::compile(&p, &cfg).unwrap();
    println!("{} bytes of clif", k.clif().len());
}
