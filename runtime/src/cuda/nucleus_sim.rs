//! Tests of the exact nucleus kernels without a GPU, on their LLVM IR as codegen emits it,
//! interpreted on the host ([`super::ir_sim`]): the pick takes the first `R` rows of status 4
//! in row order (a verifying launch's bonus rows only) and zeroes the draw's counters, and when
//! it picked no row every later kernel exits without touching memory — the path of every
//! filtered device-API launch without such a row.

use super::ir_sim::{parse, Cta, Memory, Module};
use flashsample_abi::RowStatus;
use flashsample_codegen_ptx::{
    GpuConfig, Grid, KernelParams, NucleusPickArgs, ParamKind, Schedule, NUCLEUS_CUT, NUCLEUS_CUT_THREADS, NUCLEUS_DRAW, NUCLEUS_HIST,
    NUCLEUS_LOGITS, NUCLEUS_PICK, NUCLEUS_SCATTER, NUCLEUS_THREADS,
};
use flashsample_ir::{DType, Pipeline, PipelineBuilder};
use std::collections::HashMap;

/// Shared-memory arrays the nucleus kernels declare, and their sizes in bytes.
const SHARED: [(&str, usize); 7] = [
    ("@fs_nucleus_hist", 256 * 4),
    ("@fs_nucleus_scan", 256 * 4),
    ("@fs_nucleus_warp", 2048 * 4),
    ("@fs_nucleus_misc", 4 * 4),
    ("@fs_nucleus_bsum", 1024 * 4),
    ("@fs_nucleus_done", 1024 * 4),
    ("@fs_nucleus_last", 4),
];

/// A filtered sampling pipeline (verifying when `verify`) and its nucleus kernels, parsed.
fn kernels(verify: bool, mem: &mut Memory) -> (Pipeline, Module) {
    let b = PipelineBuilder::new("Nucleus", DType::BF16, DType::BF16).temperature_per_row("t").filter("filter", 8);
    let p = if verify { b.verify_sampled("drafts", "draft_probs") } else { b.gumbel("seed", 1) }.build().unwrap();
    let mut c = GpuConfig::new(128, 8, 4, Schedule::MmaSync { stages: 2, k_step: 64, grid: Grid::PerItem });
    c.fit_lists(&p);
    let ir = flashsample_codegen_ptx::llvm_ir(&p, &c).unwrap();
    let globals: HashMap<String, u64> = SHARED.iter().map(|&(name, bytes)| (name.to_string(), mem.add(vec![0; bytes]))).collect();
    let funcs = [NUCLEUS_PICK, NUCLEUS_LOGITS, NUCLEUS_HIST, NUCLEUS_SCATTER, NUCLEUS_CUT, NUCLEUS_DRAW]
        .iter()
        .map(|k| (k.kernel.to_string(), parse(&ir, k.kernel, &globals)))
        .collect();
    (p, Module { funcs })
}

fn u32s(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Runs the pick over `status` with `rows` = R (and `spec_period`, 0 = every row a sample):
/// the picked rows and the count it wrote, after checking it zeroed the draw's counters.
fn pick(verify: bool, status: &[RowStatus], rows: usize, spec_period: u32) -> (Vec<u32>, u32) {
    let mut mem = Memory { bufs: Vec::new() };
    let (p, m) = kernels(verify, &mut mem);
    let samples = p.samples_per_row();
    let codes: Vec<u32> = status.iter().map(|s| s.code()).collect();
    let args = NucleusPickArgs {
        status: mem.add(u32s(&codes)),
        batch: status.len() as u32,
        rows: rows as u32,
        samples,
        picks: mem.add(vec![0xab; (rows + 1) * 4]),
        best: mem.add(vec![0xab; (rows * samples as usize).max(1) * 8]),
        done: mem.add(vec![0xab; rows.max(1) * 4]),
        row_base: 0,
        spec_period,
    };
    let params: Vec<u64> = args.args().iter().map(arg_word).collect();
    m.run_cta_of(&m.funcs[NUCLEUS_PICK.kernel], &params, Cta::default(), 32, &mut mem);
    let buf = |addr: u64| mem.bufs[(addr >> 40) as usize - 1].clone();
    let (picks, best, done) = (buf(args.picks), buf(args.best), buf(args.done));
    assert!(best[..rows * samples as usize * 8].iter().all(|&b| b == 0), "the draw's best keys are zeroed");
    assert!(done[..rows * 4].iter().all(|&b| b == 0), "the draw's counters are zeroed");
    assert_eq!(buf(args.status), u32s(&codes), "the status is only read");
    let word = |i: usize| u32::from_le_bytes(picks[4 * i..][..4].try_into().unwrap());
    let count = word(rows);
    ((0..count as usize).map(word).collect(), count)
}

fn arg_word(a: &flashsample_codegen_ptx::KernelArg) -> u64 {
    match *a {
        flashsample_codegen_ptx::KernelArg::U64(v) => v,
        flashsample_codegen_ptx::KernelArg::U32(v) => u64::from(v),
    }
}

#[test]
fn the_pick_takes_the_first_r_rows_of_status_4_in_row_order() {
    let mut status = vec![RowStatus::Ok; 70];
    for r in [3, 40, 41, 69] {
        status[r] = RowStatus::NucleusTooLarge;
    }
    // Other failures are never picked.
    status[5] = RowStatus::AllMasked;
    status[6] = RowStatus::NonFinite;
    status[7] = RowStatus::ListOverflow;
    assert_eq!(pick(false, &status, 2, 0), (vec![3, 40], 2));
    assert_eq!(pick(false, &status, 10, 0), (vec![3, 40, 41, 69], 4));
    assert_eq!(pick(false, &status, 0, 0), (vec![], 0));
    assert_eq!(pick(false, &[RowStatus::Ok; 33], 2, 0), (vec![], 0));
    // A verifying launch of sequences of k + 1 = 3 rows: only bonus rows (row % 3 == 2) are
    // samples; its draft rows' lists belong to the decision.
    assert_eq!(pick(true, &status, 10, 3), (vec![41], 1));
}

#[test]
fn with_no_row_picked_every_later_kernel_exits_without_touching_memory() {
    let mut mem = Memory { bufs: Vec::new() };
    let (_, m) = kernels(false, &mut mem);
    let r = 2usize;
    // `picks`: R entries, then the count 0.
    let picks = mem.add(u32s(&[7, 9, 0]));
    let kernels: [(KernelParams, u32); 5] = [
        (NUCLEUS_LOGITS, NUCLEUS_THREADS),
        (NUCLEUS_HIST, NUCLEUS_THREADS),
        (NUCLEUS_SCATTER, NUCLEUS_THREADS),
        (NUCLEUS_CUT, NUCLEUS_CUT_THREADS),
        (NUCLEUS_DRAW, NUCLEUS_THREADS),
    ];
    for (table, threads) in kernels {
        let params: Vec<u64> = table
            .params
            .iter()
            .map(|param| match (param.name, param.kind) {
                ("picks", _) => picks,
                (_, ParamKind::ConstPtr | ParamKind::MutPtr) => mem.add(vec![0x5a; 1 << 16]),
                ("rows", _) => r as u64,
                ("vocab", _) => 5003,
                ("dim", _) => 64,
                ("samples", _) => 1,
                ("shift", _) => 8,
                _ => 7,
            })
            .collect();
        let before = mem.bufs.clone();
        for cta in [Cta { x: 0, y: 0, grid_x: 3 }, Cta { x: 2, y: 1, grid_x: 3 }] {
            m.run_cta_of(&m.funcs[table.kernel], &params, cta, threads as usize, &mut mem);
        }
        for (i, (a, b)) in before.iter().zip(&mem.bufs).enumerate() {
            assert!(a == b, "{}: buffer {i} changed although no row was picked", table.kernel);
        }
    }
}
