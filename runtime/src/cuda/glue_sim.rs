//! Tests of the glue kernels without a GPU, on their LLVM IR interpreted on the host
//! ([`super::ir_sim`]): the finishing kernel (a failed row's samples become
//! `INDEX_NONE` with NaN logprobs, the others `logit − lse` in f32).

use super::ir_sim::{arg_words, Memory, Module};
use flashsample_abi::INDEX_NONE;
use flashsample_codegen_ptx::{glue_llvm_ir, FinalizeArgs, FINALIZE, GLUE_THREADS};
use std::collections::HashMap;

/// One interpreted launch of the finishing kernel over `args.n` samples.
pub(super) fn finalize(args: &FinalizeArgs, mem: &mut Memory) {
    let m = Module::with_callees(&glue_llvm_ir(), &[FINALIZE.kernel], &HashMap::new());
    m.run_grid(FINALIZE.kernel, &arg_words(&args.args()), (args.n.div_ceil(GLUE_THREADS).max(1), 1, 1), GLUE_THREADS as usize, mem);
}

fn read<T: bytemuck::Pod>(mem: &Memory, addr: u64) -> Vec<T> {
    bytemuck::pod_collect_to_vec(&mem.bufs[(addr >> 40) as usize - 1])
}

#[test]
fn finalize_voids_failed_rows_and_writes_logprobs() {
    let (rows, samples) = (300usize, 2usize);
    let n = rows * samples;
    let status: Vec<u32> = (0..rows as u32).map(|r| if r % 7 == 3 { 1 + r % 4 } else { 0 }).collect();
    let logits: Vec<f32> = (0..n).map(|i| i as f32 * 0.37 - 50.0).collect();
    let lse: Vec<f32> = (0..rows).map(|r| r as f32 * 0.11 + 3.0).collect();
    for with_logprobs in [false, true] {
        let mut mem = Memory { bufs: Vec::new() };
        let tokens = mem.add(bytemuck::cast_slice(&(0..n as u32).collect::<Vec<_>>()).to_vec());
        let st = mem.add(bytemuck::cast_slice(&status).to_vec());
        let lg = mem.add(bytemuck::cast_slice(&logits).to_vec());
        let ls = mem.add(bytemuck::cast_slice(&lse).to_vec());
        let lp = if with_logprobs { mem.add(vec![0xab; n * 4]) } else { 0 };
        finalize(&FinalizeArgs { tokens, status: st, logits: lg, lse: ls, logprobs: lp, n: n as u32, samples: samples as u32 }, &mut mem);
        let got: Vec<u32> = read(&mem, tokens);
        for i in 0..n {
            let failed = status[i / samples] != 0;
            assert_eq!(got[i], if failed { INDEX_NONE } else { i as u32 }, "sample {i}");
        }
        if with_logprobs {
            let got: Vec<f32> = read(&mem, lp);
            for i in 0..n {
                let want = if status[i / samples] != 0 { f32::NAN } else { logits[i] - lse[i / samples] };
                assert!(got[i].to_bits() == want.to_bits() || (got[i].is_nan() && want.is_nan()), "logprob {i}: {} vs {want}", got[i]);
            }
        }
    }
}
