//! Config validation, launch argument checking and the CLIF snapshot.

mod common;

use common::*;
use flashsample_abi::{Candidate, LsePartial, RowFilter};
use flashsample_abi::Scored;
use flashsample_codegen_cpu::{capture_stride, Capture, CpuCodegenError, CpuConfig, CpuEngine, CpuKernel, CpuLaunch, NoiseSkip, CAPTURE_NONE};
use flashsample_ir::{DType, Outputs, PipelineBuilder};

#[test]
fn config_validation_names_the_field() {
    let ok = CpuConfig { vocab_tile: 64, row_block: 2, threads: 2, engine: CpuEngine::Cranelift, noise_skip: NoiseSkip::default() };
    assert!(ok.validate().is_ok());
    for (cfg, field) in [
        (CpuConfig { vocab_tile: 6, ..ok.clone() }, "vocab_tile"),
        (CpuConfig { vocab_tile: 0, ..ok.clone() }, "vocab_tile"),
        (CpuConfig { row_block: 0, ..ok.clone() }, "row_block"),
        (CpuConfig { row_block: 9, ..ok.clone() }, "row_block"),
        (CpuConfig { threads: 0, ..ok.clone() }, "threads"),
    ] {
        match cfg.validate() {
            Err(CpuCodegenError::InvalidConfig { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{cfg:?}: {other:?}"),
        }
        let p = PipelineBuilder::new("P", DType::F32, DType::BF16).build().unwrap();
        assert!(matches!(CpuKernel::compile(&p, &cfg), Err(CpuCodegenError::InvalidConfig { .. })));
    }
}

#[test]
fn heuristic_configs_are_valid_and_roundtrip_through_serde() {
    let p = PipelineBuilder::new("P", DType::BF16, DType::BF16).build().unwrap();
    for (b, d, v) in [(1, 4096, 151_936), (16, 1024, 151_936), (3, 7, 5), (64, 8, 1), (100_000, 8, 151_936)] {
        let cfg = CpuConfig::heuristic(&p, b, d, v);
        cfg.validate().unwrap();
        let json = serde_json::to_string(&cfg).unwrap();
        assert_eq!(serde_json::from_str::<CpuConfig>(&json).unwrap(), cfg);
    }
}

#[test]
fn invalid_pipelines_are_errors() {
    let p = PipelineBuilder::new("P", DType::F32, DType::BF16).softcap(-1.0).build_unchecked();
    let cfg = CpuConfig { vocab_tile: 8, row_block: 1, threads: 1, engine: CpuEngine::Cranelift, noise_skip: NoiseSkip::default() };
    assert!(matches!(CpuKernel::compile(&p, &cfg), Err(CpuCodegenError::Pipeline(_))));
}

#[test]
fn launch_rejects_mismatched_buffers() {
    let p = PipelineBuilder::new("P", DType::F32, DType::BF16)
        .bias("b")
        .gumbel("seed", 2)
        .outputs(Outputs { score: false, logsumexp: true, logprob: false, top_logprobs: 0 })
        .build()
        .unwrap();
    let kernel = compile(&p, 8, 2, 1);
    let (batch, dim, vocab) = (3usize, 5usize, 20usize);
    let tiles = kernel.tiles(vocab);
    assert_eq!(tiles, 3);
    let hidden = vec![0.5f32; batch * dim];
    let weights = vec![0u8; vocab * dim * 2];
    let temps = vec![1.0f32; batch];
    let bias = vec![0.0f32; vocab];
    let mask = vec![u32::MAX; batch];
    let mut cands = vec![Candidate { score: 0.0, index: 0, logit: 0.0 }; batch * 2 * tiles];
    let mut lse = vec![LsePartial::EMPTY; batch * tiles];
    let launch = |hidden: &[f32], weights: &[u8], temps: &[f32], bias: Option<&[f32]>, allowed: Option<&[u32]>,
                  cands: &mut [Candidate], lse: Option<&mut [LsePartial]>| {
        kernel.launch(CpuLaunch { targets: None, ranks: None, vocab_tiles: None, residual: None, raw: None, capture: None,
            hidden, weights, batch, dim, vocab, temperatures: temps, filters: None, bias, allowed, seed: 1, candidates: cands, lse,
            row_seeds: None, row_steps: None, vocab_offset: 0, row_offset: 0, penalties: None, logit_bias: None, lists: None,
        })
    };
    assert!(launch(&hidden, &weights, &temps, Some(&bias), None, &mut cands, Some(&mut lse)).is_ok());
    let length = |r: Result<(), CpuCodegenError>| match r {
        Err(CpuCodegenError::Length { what, .. }) => what,
        other => panic!("{other:?}"),
    };
    assert_eq!(length(launch(&hidden[1..], &weights, &temps, Some(&bias), None, &mut cands, Some(&mut lse))), "hidden");
    assert_eq!(length(launch(&hidden, &weights[2..], &temps, Some(&bias), None, &mut cands, Some(&mut lse))), "weights");
    assert_eq!(length(launch(&hidden, &weights, &temps[1..], Some(&bias), None, &mut cands, Some(&mut lse))), "temperatures");
    assert_eq!(length(launch(&hidden, &weights, &temps, Some(&bias[1..]), None, &mut cands, Some(&mut lse))), "bias");
    assert_eq!(length(launch(&hidden, &weights, &temps, Some(&bias), None, &mut cands[1..], Some(&mut lse))), "candidates");
    assert_eq!(length(launch(&hidden, &weights, &temps, Some(&bias), None, &mut cands, Some(&mut lse[1..]))), "lse");
    assert!(matches!(launch(&hidden, &weights, &temps, None, None, &mut cands, Some(&mut lse)), Err(CpuCodegenError::Missing("bias"))));
    assert!(matches!(launch(&hidden, &weights, &temps, Some(&bias), None, &mut cands, None), Err(CpuCodegenError::Missing("lse"))));
    assert!(matches!(
        launch(&hidden, &weights, &temps, Some(&bias), Some(&mask), &mut cands, Some(&mut lse)),
        Err(CpuCodegenError::Unexpected("allowed"))
    ));
}

#[test]
fn launch_checks_the_capture() {
    // A capture needs lists (the only pipelines whose nucleus can outgrow them), one slot per
    // row, whole rows of `capture_stride(vocab)` floats and slots inside them.
    let filtered = PipelineBuilder::new("F", DType::F32, DType::F32).filter("f", 4).gumbel("seed", 1).build().unwrap();
    let plain = PipelineBuilder::new("P", DType::F32, DType::F32).gumbel("seed", 1).build().unwrap();
    let (batch, dim, vocab) = (2usize, 3usize, 10usize);
    let stride = capture_stride(vocab);
    assert_eq!(stride, 12);
    let top_p = vec![RowFilter::top_p(0.9); batch];
    let run = |p: &flashsample_ir::Pipeline, slots: &[u32], floats: usize| {
        let kernel = compile(p, 8, 1, 1);
        let tiles = kernel.tiles(vocab);
        let mut cands = vec![Candidate { score: 0.0, index: 0, logit: 0.0 }; batch * tiles];
        let has_lists = p.list_capacity() > 0;
        let mut lists = vec![Scored::EMPTY; batch * tiles * 4];
        let mut logits = vec![0.0f32; floats];
        let mut lse = vec![LsePartial::EMPTY; batch * tiles];
        kernel.launch(CpuLaunch {
            targets: None, ranks: None, vocab_tiles: None, residual: None, raw: None,
            capture: Some(Capture { slots, logits: &mut logits, raws: None }),
            hidden: &vec![0.5; batch * dim], weights: &vec![0; vocab * dim * 4], batch, dim, vocab,
            temperatures: &vec![1.0; batch], filters: p.filter_max_k().map(|_| &top_p[..]), bias: None, allowed: None, seed: 1, candidates: &mut cands,
            lse: kernel.logsumexp().then_some(&mut lse[..]),
            row_seeds: None, row_steps: None, vocab_offset: 0, row_offset: 0, penalties: None, logit_bias: None,
            lists: has_lists.then_some(&mut lists[..]),
        })?;
        Ok::<Vec<f32>, CpuCodegenError>(logits)
    };
    // Row 1 captured in slot 0: its zero logits (zero weights), `-inf` past the vocabulary.
    let row = run(&filtered, &[CAPTURE_NONE, 0], stride).unwrap();
    assert_eq!(&row[..vocab], &[0.0; 10]);
    assert_eq!(&row[vocab..], &[f32::NEG_INFINITY; 2]);
    assert!(matches!(run(&filtered, &[0], stride), Err(CpuCodegenError::Length { what: "capture slots", .. })));
    assert!(matches!(run(&filtered, &[0, 1], stride), Err(CpuCodegenError::BadArgument(m)) if m.contains("slot 1 of row 1")));
    assert!(matches!(run(&filtered, &[0, 0], stride + 1), Err(CpuCodegenError::BadArgument(_))));
    assert!(matches!(run(&plain, &[0, 0], stride), Err(CpuCodegenError::Unexpected(_))));
}

#[test]
fn empty_launches_write_nothing() {
    let p = PipelineBuilder::new("P", DType::F32, DType::F32).argmax().build().unwrap();
    let kernel = compile(&p, 8, 2, 2);
    let mut none: [Candidate; 0] = [];
    for (batch, vocab) in [(0, 10), (2, 0)] {
        kernel
            .launch(CpuLaunch { targets: None, ranks: None, vocab_tiles: None, residual: None, raw: None, capture: None,
                hidden: &vec![0.0; batch * 3],
                weights: &vec![0; vocab * 3 * 4],
                batch,
                dim: 3,
                vocab,
                temperatures: &vec![1.0; batch],
                filters: None,
                bias: None,
                allowed: None,
                seed: 0,
                row_seeds: None,
                row_steps: None,
                vocab_offset: 0,
                row_offset: 0,
                penalties: None, logit_bias: None,
                lists: None,
                candidates: &mut none,
                lse: None,
            })
            .unwrap();
    }
}

#[test]
fn clif_snapshot() {
    let p = PipelineBuilder::new("Snap", DType::F32, DType::BF16)
        .temperature_per_row("t")
        .mask("m")
        .gumbel("seed", 1)
        .build()
        .unwrap();
    let cfg = CpuConfig { vocab_tile: 16, row_block: 2, threads: 1, engine: CpuEngine::Cranelift, noise_skip: NoiseSkip::default() };
    let a = CpuKernel::compile(&p, &cfg).unwrap();
    let b = CpuKernel::compile(&p, &cfg).unwrap();
    assert_eq!(a.clif(), b.clif(), "CLIF is deterministic");
    insta::assert_snapshot!(a.clif());
}
