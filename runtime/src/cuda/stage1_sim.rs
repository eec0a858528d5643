//! Tests of stage one's epilogue without a GPU, on the SIMT schedule's LLVM IR interpreted on
//! the host ([`super::ir_sim`]): every (row, tile)'s candidate, exact logsumexp partial and
//! top list equal a host model of the same f32 logits (one fma per k, ascending) bit for bit —
//! the epilogue's phases (transforms, per-pair noise parameters, the partial's scratch, the
//! lists and the logits read back from their tile, the selection) checked on the code every
//! schedule shares; and with the cross-tile row bounds on, every row's winner is unchanged.

use super::ir_sim::{parse, Cta, Memory, Module};
use flashsample_abi::filter::{whole_row, Scored};
use flashsample_abi::lse::LsePartial;
use flashsample_abi::rng::{gumbel_f32, noise_bits};
use flashsample_abi::{Candidate, RowFilter, INDEX_NONE};
use flashsample_codegen_ptx::{GpuConfig, Grid, KernelArg, ParamKind, Schedule, STAGE1};
use flashsample_ir::{DType, Outputs, PipelineBuilder};
use std::collections::HashMap;

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn simt_stage_one_writes_the_host_models_candidates_partials_and_lists() {
    let (batch, dim, vocab, seed) = (10usize, 8usize, 600usize, 0x1234_5678_9abc_def0u64);
    let p = PipelineBuilder::new("S1", DType::F32, DType::F32)
        .temperature_per_row("t")
        .filter("filter", 8)
        .gumbel("seed", 1)
        .outputs(Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 0 })
        .build()
        .unwrap();
    let mut c = GpuConfig::new(128, 8, 4, Schedule::Simt { grid: Grid::PerItem });
    c.fit_lists(&p);
    let ir = flashsample_codegen_ptx::llvm_ir(&p, &c).unwrap();
    let mut mem = Memory { bufs: Vec::new() };
    let globals: HashMap<String, u64> = [("@fs_smem".to_string(), mem.add(vec![0; c.smem_bytes() as usize]))].into();
    let mut funcs = HashMap::new();
    let mut todo = vec![STAGE1.kernel.to_string()];
    while let Some(name) = todo.pop() {
        if funcs.contains_key(&name) {
            continue;
        }
        let signature = format!("@{name}(");
        let start = ir.match_indices("define ").map(|(i, _)| i).find(|&i| ir[i..].lines().next().is_some_and(|l| l.contains(&signature))).unwrap();
        let text = &ir[start..][..ir[start..].find("\n}").unwrap()];
        for (_, callee) in text.split("call ").skip(1).filter_map(|c| c.lines().next()?.split_once('@')) {
            let callee = callee.split('(').next().unwrap();
            if callee.starts_with("fs_") {
                todo.push(callee.to_string());
            }
        }
        funcs.insert(name.clone(), parse(&ir, &name, &globals));
    }
    let m = Module { funcs };

    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut unit = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    // Logits spread over ±100, so most tiles' partials fill all three windows (16 wide).
    let hidden: Vec<f32> = (0..batch * dim).map(|_| 10.0 * unit()).collect();
    let weights: Vec<f32> = (0..vocab * dim).map(|_| 10.0 * unit()).collect();
    // A greedy row (T = 0) among sampled ones.
    let temperatures: Vec<f32> = (0..batch).map(|r| if r == 3 { 0.0 } else { 0.5 + 0.1 * r as f32 }).collect();
    let filters = vec![RowFilter::top_k(8); batch];
    let tiles = c.tiles(vocab);
    let (per_tile, samples) = (c.list_per_tile as usize, p.samples_per_row() as usize);

    // `row_base` 1000: a chunk's rows draw by their launch rows (`SamplingParams::row_offset`).
    let row_base = 1000u32;
    let run = |mem: &mut Memory, row_bounds: bool| -> (Vec<Candidate>, Vec<LsePartial>, Vec<Scored>) {
        let mut bufs: HashMap<&str, u64> = HashMap::new();
        bufs.insert("hidden", mem.add(f32s(&hidden)));
        bufs.insert("weights", mem.add(f32s(&weights)));
        bufs.insert("temperatures", mem.add(f32s(&temperatures)));
        bufs.insert("filters", mem.add(bytemuck::cast_slice(&filters).to_vec()));
        bufs.insert("candidates", mem.add(vec![0xab; batch * samples * tiles * 12]));
        bufs.insert("lse", mem.add(vec![0xab; batch * tiles * 32]));
        bufs.insert("lists", mem.add(vec![0xab; batch * tiles * per_tile * 8]));
        if row_bounds {
            bufs.insert("row_bounds", mem.add(vec![0; batch * samples * 4]));
        }
        let params: Vec<u64> = STAGE1
            .params
            .iter()
            .map(|q| match (q.name, q.kind) {
                (name, ParamKind::ConstPtr | ParamKind::MutPtr) => bufs.get(name).copied().unwrap_or(0),
                ("seed", _) => seed,
                ("batch", _) => batch as u64,
                ("dim", _) => dim as u64,
                ("vocab", _) => vocab as u64,
                ("row_base", _) => u64::from(row_base),
                _ => 0,
            })
            .collect();
        let grid = c.grid(batch, vocab, 132);
        let f = &m.funcs[STAGE1.kernel];
        for y in 0..grid.1 {
            for x in 0..grid.0 {
                let cta = Cta { x: u64::from(x), y: u64::from(y), grid_x: u64::from(grid.0), grid_y: u64::from(grid.1) };
                m.run_cta_of(f, &params, cta, c.block_threads() as usize, mem);
            }
        }
        let read = |mem: &Memory, name: &str| mem.bufs[(bufs[name] >> 40) as usize - 1].clone();
        (
            bytemuck::pod_collect_to_vec(&read(mem, "candidates")),
            bytemuck::pod_collect_to_vec(&read(mem, "lse")),
            bytemuck::pod_collect_to_vec(&read(mem, "lists")),
        )
    };
    let _ = KernelArg::U32(0);

    // The host model: the SIMT path's logits (one fma per k, ascending), the temperature,
    // then per tile the winner by score (ties to the lower token), the exact partial and the
    // top list.
    let x = |r: usize, v: usize| {
        let acc = (0..dim).fold(0.0f32, |a, k| hidden[r * dim + k].mul_add(weights[v * dim + k], a));
        let t = temperatures[r];
        if t == 0.0 { acc } else { acc * (1.0 / t) }
    };
    let (cands, partials, lists) = run(&mut mem, false);
    let mut third_windows = 0;
    for r in 0..batch {
        for t in 0..tiles {
            let tokens = t * 128..((t + 1) * 128).min(vocab);
            let mut best: Option<Candidate> = None;
            let mut partial = LsePartial::EMPTY;
            let mut scored = Vec::new();
            for v in tokens {
                let xv = x(r, v);
                partial.add(xv);
                scored.push(Scored { logit: xv, index: v as u32 });
                let score = if temperatures[r] == 0.0 { xv } else { xv + gumbel_f32(noise_bits(seed, row_base + r as u32, 0, v as u32, 0)) };
                if best.is_none_or(|b| score > b.score) {
                    best = Some(Candidate { score, index: v as u32, logit: xv });
                }
            }
            third_windows += usize::from(partial.sums[2] > 0);
            let got = cands[(r * samples) * tiles + t];
            let want = best.unwrap();
            assert_eq!((got.index, got.score.to_bits(), got.logit.to_bits()), (want.index, want.score.to_bits(), want.logit.to_bits()), "row {r} tile {t}: candidate");
            assert_eq!(partials[r * tiles + t], partial, "row {r} tile {t}: logsumexp partial");
            let top = whole_row(&scored);
            let got_list = &lists[(r * tiles + t) * per_tile..][..per_tile];
            for (k, g) in got_list.iter().enumerate() {
                let w = top.get(k).copied().unwrap_or(Scored::EMPTY);
                assert_eq!((g.index, g.logit.to_bits()), (w.index, w.logit.to_bits()), "row {r} tile {t}: list entry {k}");
            }
        }
    }
    assert!(third_windows * 2 > batch * tiles, "most partials fill all three windows: {third_windows}");
    // With the cross-tile bounds the skips may change a losing tile's candidate, never a
    // row's winner.
    let (bounded, _, _) = run(&mut mem, true);
    let winner = |c: &[Candidate], r: usize| {
        c[r * samples * tiles..][..tiles].iter().filter(|c| c.index != INDEX_NONE).fold(None::<Candidate>, |b, c| match b {
            Some(b) if b.score > c.score || (b.score == c.score && b.index < c.index) => Some(b),
            _ => Some(*c),
        })
    };
    for r in 0..batch {
        assert_eq!(winner(&bounded, r).map(|c| c.index), winner(&cands, r).map(|c| c.index), "row {r}: the winner with row bounds");
    }
}
