//! Tests of the exact nucleus kernels without a GPU, on their LLVM IR as codegen emits it,
//! interpreted on the host ([`super::ir_sim`]): the pick takes the first `R` rows of status 4
//! in row order (a verifying launch's bonus rows only) and zeroes the draw's counters; when it
//! picked no row every later kernel exits without touching memory (the path of every filtered
//! device-API launch without such a row); and the whole chain — logits (the SIMT path's fma
//! order), radix sort, cut and draw — serves a picked row as the host's exact cut does.

use super::ir_sim::{arg_words, Cta, Memory, Module};
use flashsample_abi::RowStatus;
use flashsample_abi::filter::{draw, survivors, whole_row, Scored};
use flashsample_abi::{RowFilter, INDEX_NONE};
use flashsample_codegen_ptx::{
    GpuConfig, Grid, KernelArg, KernelParams, NucleusCutArgs, NucleusDrawArgs, NucleusHistArgs, NucleusLayout, NucleusLogitsArgs,
    NucleusPickArgs, NucleusScatterArgs, ParamKind, Schedule, NUCLEUS_CUT, NUCLEUS_CUT_THREADS, NUCLEUS_DRAW, NUCLEUS_HIST, NUCLEUS_LOGITS,
    NUCLEUS_PICK, NUCLEUS_RADIX_PASSES, NUCLEUS_SCATTER, NUCLEUS_THREADS,
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
    let c = GpuConfig::new(128, 8, 4, Schedule::MmaSync { stages: 2, k_step: 64, grid: Grid::PerItem });
    let m = module(&p, c, mem);
    (p, m)
}

/// The nucleus kernels of `pipeline` on `config`, and the helpers they call, parsed.
fn module(pipeline: &Pipeline, mut config: GpuConfig, mem: &mut Memory) -> Module {
    config.fit_lists(pipeline);
    let ir = flashsample_codegen_ptx::llvm_ir(pipeline, &config).unwrap();
    let globals: HashMap<String, u64> = SHARED.iter().map(|&(name, bytes)| (name.to_string(), mem.add(vec![0; bytes]))).collect();
    let roots = [NUCLEUS_PICK, NUCLEUS_LOGITS, NUCLEUS_HIST, NUCLEUS_SCATTER, NUCLEUS_CUT, NUCLEUS_DRAW].map(|k| k.kernel);
    Module::with_callees(&ir, &roots, &globals)
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
    let params = arg_words(&args.args());
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

#[test]
fn the_pick_takes_the_first_r_rows_of_status_3_or_4_in_row_order() {
    let mut status = vec![RowStatus::Ok; 70];
    for r in [3, 40, 41, 69] {
        status[r] = RowStatus::NucleusTooLarge;
    }
    status[7] = RowStatus::ListOverflow;
    // Other failures are never picked.
    status[5] = RowStatus::AllMasked;
    status[6] = RowStatus::NonFinite;
    assert_eq!(pick(false, &status, 2, 0), (vec![3, 7], 2));
    assert_eq!(pick(false, &status, 10, 0), (vec![3, 7, 40, 41, 69], 5));
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
        for cta in [Cta { x: 0, y: 0, grid_x: 3, grid_y: 2 }, Cta { x: 2, y: 1, grid_x: 3, grid_y: 2 }] {
            m.run_cta_of(&m.funcs[table.kernel], &params, cta, threads as usize, &mut mem);
        }
        for (i, (a, b)) in before.iter().zip(&mem.bufs).enumerate() {
            assert!(a == b, "{}: buffer {i} changed although no row was picked", table.kernel);
        }
    }
}

/// Every CTA of `grid` of `kernel` with `threads` threads.
fn launch(m: &Module, mem: &mut Memory, kernel: &KernelParams, args: Vec<KernelArg>, grid: (u32, u32, u32), threads: u32) {
    m.run_grid(kernel.kernel, &arg_words(&args), grid, threads as usize, mem);
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The whole chain on an f32 pipeline (the SIMT multiply: one fma per k, ascending): a row
/// of status 3 (its top-k overflowed the tile lists) and one of status 4 with a top-p at T = 2,
/// beside a row that is neither, served by pick, logits, four radix passes, cut and draw, give
/// the tokens, logits and status the host gets from each row's logits in that order,
/// `whole_row`, `survivors` and `draw`.
#[test]
fn the_kernels_serve_picked_rows_as_the_host_cut_does() {
    serve_picked_rows(false);
}

/// With the top-p row's logits in the capture (as stage one stores them, `stage1_sim`), the
/// chain serves it as above without reading the weights or hidden states (their addresses are
/// null, which the interpreter cannot load).
#[test]
fn a_captured_row_is_served_from_stage_ones_logits() {
    serve_picked_rows(true);
}

fn serve_picked_rows(captured: bool) {
    let (batch, dim, vocab) = (3usize, 8usize, 1500usize);
    let p = PipelineBuilder::new("Nucleus", DType::F32, DType::F32).temperature_per_row("t").filter("filter", 8).gumbel("seed", 1).build().unwrap();
    let mut mem = Memory { bufs: Vec::new() };
    let m = module(&p, GpuConfig::new(128, 8, 4, Schedule::Simt { grid: Grid::PerItem }), &mut mem);
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut unit = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let hidden: Vec<f32> = (0..batch * dim).map(|_| 2.0 * unit()).collect();
    let weights: Vec<f32> = (0..vocab * dim).map(|_| 2.0 * unit()).collect();
    let temperatures = [0.7f32, 2.0, 1.0];
    let filters = [RowFilter::top_k(8), RowFilter::top_p(0.95), RowFilter::OFF];
    let seed = 0x5eed_u64;
    // Captured: only the top-p row (the capture's only row) is picked, so every picked row was
    // captured and W is not read.
    let served: Vec<(usize, RowStatus)> =
        if captured { vec![(1, RowStatus::NucleusTooLarge)] } else { vec![(0, RowStatus::ListOverflow), (1, RowStatus::NucleusTooLarge)] };
    let mut status = vec![RowStatus::Ok.code(); batch];
    for &(r, st) in &served {
        status[r] = st.code();
    }
    let host_x = |row: usize| -> Vec<f32> {
        let inv_t = 1.0f32 / temperatures[row];
        (0..vocab).map(|v| (0..dim).fold(0.0f32, |acc, k| hidden[row * dim + k].mul_add(weights[v * dim + k], acc)) * inv_t).collect()
    };
    let layout = NucleusLayout { rows: 2, vocab, samples: 1, raw: false };
    let o = layout.offsets();
    let base = mem.add(vec![0; o.bytes]);
    let at = |off: usize| base + off as u64;
    let (rows, vocab32) = (layout.rows as u32, vocab as u32);
    let status_buf = mem.add(u32s(&status));
    let (tokens, scores, logits) = (mem.add(vec![0xab; batch * 4]), mem.add(vec![0xab; batch * 4]), mem.add(vec![0xab; batch * 4]));
    let filters_buf = mem.add(bytemuck::cast_slice(&filters).to_vec());
    let temps = mem.add(f32s(&temperatures));
    // Captured: slot 0 holds row 1's logits as stage one keeps them (row 1 is the first row
    // whose filter may outgrow the lists); slot 1 stays poisoned.
    let (capture_filters, capture_rows, capture) = if captured {
        let mut buf = f32s(&host_x(1));
        buf.extend(vec![0xab; vocab * 4]);
        (filters_buf, 2, mem.add(buf))
    } else {
        (0, 0, 0)
    };
    let pick = NucleusPickArgs { status: status_buf, batch: batch as u32, rows, samples: 1, picks: at(o.picks), best: at(o.best), done: at(o.done), row_base: 0, spec_period: 0 };
    launch(&m, &mut mem, &NUCLEUS_PICK, pick.args(), (1, 1, 1), 32);
    let logits_args = NucleusLogitsArgs {
        picks: at(o.picks),
        rows,
        hidden: if captured { 0 } else { mem.add(f32s(&hidden)) },
        weights: if captured { 0 } else { mem.add(f32s(&weights)) },
        temperatures: temps,
        dim: dim as u32,
        vocab: vocab32,
        x: at(o.x),
        keys: at(o.keys[0]),
        vals: at(o.vals[0]),
        filters: capture_filters,
        capture_rows,
        capture,
        ..Default::default()
    };
    launch(&m, &mut mem, &NUCLEUS_LOGITS, logits_args.args(), layout.logits_grid(), NUCLEUS_THREADS);
    for pass in 0..NUCLEUS_RADIX_PASSES as usize {
        let (src, dst, shift) = (pass % 2, 1 - pass % 2, 8 * pass as u32);
        let hist = NucleusHistArgs { picks: at(o.picks), rows, keys: at(o.keys[src]), vocab: vocab32, shift, hist: at(o.hist) };
        launch(&m, &mut mem, &NUCLEUS_HIST, hist.args(), layout.sort_grid(), NUCLEUS_THREADS);
        let scatter = NucleusScatterArgs {
            picks: at(o.picks),
            rows,
            keys: at(o.keys[src]),
            vals: at(o.vals[src]),
            hist: at(o.hist),
            vocab: vocab32,
            shift,
            keys_out: at(o.keys[dst]),
            vals_out: at(o.vals[dst]),
        };
        launch(&m, &mut mem, &NUCLEUS_SCATTER, scatter.args(), layout.sort_grid(), NUCLEUS_THREADS);
    }
    let cut = NucleusCutArgs { picks: at(o.picks), rows, keys: at(o.keys[0]), filters: filters_buf, vocab: vocab32, masses: at(o.keys[1]), kept: at(o.kept) };
    launch(&m, &mut mem, &NUCLEUS_CUT, cut.args(), layout.cut_grid(), NUCLEUS_CUT_THREADS);
    let draw_args = NucleusDrawArgs {
        picks: at(o.picks),
        rows,
        vals: at(o.vals[0]),
        x: at(o.x),
        kept: at(o.kept),
        vocab: vocab32,
        samples: 1,
        seed,
        best: at(o.best),
        done: at(o.done),
        out_tokens: tokens,
        out_scores: scores,
        out_logits: logits,
        out_status: status_buf,
        ..Default::default()
    };
    launch(&m, &mut mem, &NUCLEUS_DRAW, draw_args.args(), layout.draw_grid(), NUCLEUS_THREADS);

    // The host: each served row's logits in the SIMT order, then the exact cut and draw.
    let word = |mem: &mut Memory, addr: u64, i: usize| mem.load(addr + 4 * i as u64, 4) as u32;
    for (slot, &(row, _)) in served.iter().enumerate() {
        let x = host_x(row);
        let row_x = at(o.x) + (slot * vocab * 4) as u64;
        let kernel_x: Vec<f32> = (0..vocab).map(|v| f32::from_bits(word(&mut mem, row_x, v))).collect();
        assert_eq!(kernel_x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "row {row}'s logits");
        let scored: Vec<Scored> = x.iter().enumerate().map(|(v, &logit)| Scored { logit, index: v as u32 }).collect();
        let top = whole_row(&scored);
        let sorted: Vec<u32> = (0..vocab).map(|i| word(&mut mem, at(o.vals[0]) + (slot * vocab * 4) as u64, i)).collect();
        assert_eq!(sorted, top.iter().map(|s| s.index).collect::<Vec<_>>(), "row {row}: the radix sort's order is whole_row's");
        let lse = {
            let m = top[0].logit;
            m + scored.iter().map(|s| f64::from(s.logit - m).exp()).sum::<f64>().ln() as f32
        };
        let n = survivors(&top, &filters[row], lse, true, row).unwrap();
        assert_eq!(word(&mut mem, at(o.kept), slot) as usize, n, "row {row}: the cut keeps survivors' count");
        match filters[row].top_k {
            0 => assert!(n > 8 && n < vocab, "a nucleus past the lists and short of the vocabulary: {n}"),
            k => assert_eq!(n, k as usize, "the overflowed row keeps its top-k"),
        }
        let (want, _) = draw(&top[..n], seed, row as u32, 0, 0, 0).unwrap();
        assert_eq!(word(&mut mem, tokens, row), want.index, "row {row}: the sample");
        assert_eq!(f32::from_bits(word(&mut mem, logits, row)).to_bits(), want.logit.to_bits(), "row {row}: its logit");
        assert_eq!(word(&mut mem, status_buf, row), 0, "row {row} served: status 0");
    }
    for r in (0..batch).filter(|&r| served.iter().all(|&(s, _)| s != r)) {
        assert_eq!(word(&mut mem, tokens, r), 0xabab_abab, "row {r} was not picked");
        assert_ne!(word(&mut mem, tokens, r), INDEX_NONE);
    }
}
