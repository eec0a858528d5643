//! Structural checks and snapshots of the generated PTX, and config validation against the
//! recorded H200 limits. Nothing here needs a GPU.

use flashsample_codegen_ptx::{compile, Arch, CompiledPtx, GpuConfig, GpuLimits, Grid, GridKind, NoiseSkip, PtxError, Schedule};
use flashsample_ir::{DType, LogprobMode, Outputs, Pipeline, PipelineBuilder};

fn full(dtype: DType) -> Pipeline {
    PipelineBuilder::new("Full", dtype, dtype)
        .temperature_per_row("t")
        .bias("bias")
        .mask("allowed")
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
}

/// Every new contract piece: penalties, filter, top logprobs.
fn filtered(dtype: DType) -> Pipeline {
    PipelineBuilder::new("Filtered", dtype, dtype)
        .temperature_per_row("t")
        .bias("bias")
        .penalties("pen")
        .mask("allowed")
        .filter("filter", 64)
        .gumbel("seed", 2)
        .outputs(Outputs {
            score: true,
            logsumexp: true,
            logprob: true,
            top_logprobs: 5,
        })
        .build()
        .unwrap()
}

/// [`filtered`] in the raw logprob mode (DESIGN.md step 10): raw top lists, the raw logit
/// beside each processed list entry, a second logsumexp.
fn raw_filtered(dtype: DType) -> Pipeline {
    let mut p = filtered(dtype);
    p.name = "RawFiltered".into();
    p.logprob_mode = LogprobMode::Raw;
    p.validate().unwrap();
    p
}

/// A raw pipeline with raw top logprobs and no filter: its lists are the raw ones alone.
fn raw_top(dtype: DType) -> Pipeline {
    let mut p = full(dtype);
    p.name = "RawTop".into();
    p.logprob_mode = LogprobMode::Raw;
    p.outputs.top_logprobs = 4;
    p.validate().unwrap();
    p
}

/// Speculative verification with per-row temperatures: sampled drafts (with a filter) or
/// greedy drafts.
fn verifying(filter: bool) -> Pipeline {
    let b = PipelineBuilder::new("Verify", DType::BF16, DType::BF16).temperature_per_row("t").mask("allowed");
    let b = if filter { b.filter("filter", 32).verify_sampled("drafts", "draft_probs") } else { b.verify_greedy("drafts") };
    b.outputs(Outputs { score: false, logsumexp: false, logprob: true, top_logprobs: 0 }).build().unwrap()
}

fn with_lists(mut c: GpuConfig, p: &Pipeline) -> GpuConfig {
    c.fit_lists(p);
    c
}

fn greedy(dtype: DType) -> Pipeline {
    PipelineBuilder::new("Greedy", dtype, dtype)
        .argmax()
        .build()
        .unwrap()
}

fn grid(persistent: bool) -> Grid {
    if persistent {
        Grid::Persistent
    } else {
        Grid::PerItem
    }
}

/// A SIMT (`stages == 1`) or mma.sync tile.
fn cfg(vocab_tile: u32, batch_tile: u32, k_step: u32, warps: u32, stages: u32, persistent: bool) -> GpuConfig {
    let grid = grid(persistent);
    let schedule = if stages == 1 { Schedule::Simt { grid } } else { Schedule::MmaSync { stages, k_step, grid } };
    GpuConfig::new(vocab_tile, batch_tile, warps, schedule)
}

fn tensor_small() -> GpuConfig {
    cfg(128, 8, 64, 4, 2, false)
}

fn ptx(p: &Pipeline, c: &GpuConfig, arch: Arch) -> CompiledPtx {
    compile(p, c, arch).unwrap_or_else(|e| panic!("{c:?}: {e}"))
}

/// The stage-one kernel's text.
fn stage1_text(ptx: &str) -> &str {
    let start = ptx.find(".entry flashsample_stage1").expect("stage one");
    let end = ptx.find(".entry flashsample_stage2").expect("stage two");
    &ptx[start.min(end)..start.max(end)]
}

#[test]
fn tensor_path_uses_mma_ldmatrix_and_cp_async() {
    for (dtype, name) in [(DType::BF16, "bf16"), (DType::F16, "f16")] {
        let k = ptx(&full(dtype), &cfg(256, 16, 64, 8, 3, false), Arch::Sm90);
        let t = &k.ptx;
        assert!(
            t.contains(&format!(
                "mma.sync.aligned.m16n8k16.row.col.f32.{name}.{name}.f32"
            )),
            "{name}"
        );
        assert!(t.contains("ldmatrix.sync.aligned.m8n8.x4.shared.b16"));
        assert!(t.contains("cp.async.cg.shared.global"));
        assert!(t.contains("cp.async.commit_group"));
        assert!(
            t.contains("cp.async.wait_group 1;"),
            "stages − 2 groups stay in flight"
        );
        assert!(t.contains(".entry flashsample_stage1("));
        assert!(t.contains(".entry flashsample_stage2("));
        assert!(t.contains(".target sm_90"));
        assert!(t.contains(".version 8.0"));
        assert!(t.contains(".maxntid 256"));
        assert!(
            !t.contains(".local"),
            "no local memory in the generated code"
        );
        assert!(
            !stage1_text(t).contains("call."),
            "small tiles inline everything: no calls"
        );
        assert_eq!(
            (k.stage1, k.stage2),
            ("flashsample_stage1", "flashsample_stage2")
        );
    }
}

#[test]
fn stage1_has_the_design_parameter_list() {
    let k = ptx(&full(DType::BF16), &tensor_small(), Arch::Sm90);
    let head = &k.ptx[k.ptx.find(".entry flashsample_stage1(").unwrap()..];
    let params = &head[..head.find(')').unwrap()];
    let types: Vec<&str> = params
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().nth(1).unwrap_or(""))
        .collect();
    assert_eq!(
        types,
        [
            ".u64", ".u64", ".u64", ".u64", ".u64", ".u64", ".u64", ".u64", ".u32", ".u32", ".u32",
            ".u32", ".u64", ".u64", ".u64", ".u64", ".u64", ".u64", ".u64", ".align", ".u64", ".u64",
            ".u64", ".u64", ".u64", ".u64", ".u64", ".u64", ".u32", ".u64", ".u64", ".u64", ".u64", ".u32",
            ".u64", ".u64", ".u32", ".u64", ".u64"
        ]
    );
    // The table the runtime pushes from is the one the header came from.
    assert_eq!(flashsample_codegen_ptx::STAGE1.params.len(), types.len());
    assert_eq!(flashsample_codegen_ptx::Stage1Args::default().args().len(), types.len());
    let head = &k.ptx[k.ptx.find(".entry flashsample_stage2(").unwrap()..];
    let params = &head[..head.find(')').unwrap()];
    let types: Vec<&str> = params
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().nth(1).unwrap_or(""))
        .collect();
    assert_eq!(
        types,
        [".u64", ".u64", ".u32", ".u32", ".u32", ".u64", ".u64", ".u64", ".u64", ".u64", ".u64", ".u64", ".u64", ".u64", ".u32", ".u64"]
    );
}

#[test]
fn epilogue_math_is_never_contracted() {
    // Every f32 add/mul/div is explicitly rounded (.rn), so ptxas cannot fuse them.
    let k = ptx(&full(DType::BF16), &tensor_small(), Arch::Sm90);
    for line in k.ptx.lines() {
        let op = line.split_whitespace().next().unwrap_or("");
        for bare in [
            "add.f32",
            "sub.f32",
            "mul.f32",
            "div.f32",
            "fma.f32",
            "div.approx.f32",
            "div.full.f32",
        ] {
            assert_ne!(op, bare, "unrounded f32 op: {line}");
        }
        assert!(
            !op.starts_with("ex2.approx") && !op.starts_with("lg2.approx"),
            "approximate transcendental: {line}"
        );
    }
    assert!(k.ptx.contains("div.rn.f32"));
    assert!(k.ptx.contains("fma.rn.f32"));
}

#[test]
fn simt_path_for_f32_and_mixed_dtypes() {
    let f32p = full(DType::F32);
    let simt = cfg(128, 8, 64, 4, 1, false);
    let k = ptx(&f32p, &simt, Arch::Sm80);
    assert!(k.ptx.contains(".target sm_80"));
    assert!(!k.ptx.contains("mma.sync") && !k.ptx.contains("cp.async"));
    assert!(k.ptx.contains("fma.rn.f32"));
    let mixed = PipelineBuilder::new("M", DType::F32, DType::BF16)
        .gumbel("s", 1)
        .build()
        .unwrap();
    ptx(&mixed, &simt, Arch::Sm90);
    // A tensor-core config for an f32 pipeline is refused with a typed error.
    assert!(matches!(
        compile(&f32p, &tensor_small(), Arch::Sm90),
        Err(PtxError::UnsupportedDtypes { .. })
    ));
    let bf_f16 = PipelineBuilder::new("X", DType::BF16, DType::F16)
        .argmax()
        .build()
        .unwrap();
    assert!(matches!(
        compile(&bf_f16, &tensor_small(), Arch::Sm90),
        Err(PtxError::UnsupportedDtypes { .. })
    ));
}

#[test]
fn greedy_pipelines_skip_the_noise() {
    let k = ptx(&greedy(DType::BF16), &tensor_small(), Arch::Sm90);
    // Philox's multipliers appear only when noise is drawn.
    let m0 = flashsample_abi::rng::PHILOX_M0 as i32;
    assert!(
        !k.ptx
            .contains(&format!("{}", flashsample_abi::rng::PHILOX_M0))
            && !k.ptx.contains(&format!("{m0}"))
    );
    let k = ptx(&full(DType::BF16), &tensor_small(), Arch::Sm90);
    assert!(
        k.ptx
            .contains(&format!("{}", flashsample_abi::rng::PHILOX_M0))
            || k.ptx.contains(&format!("{m0}"))
    );
}

/// Each `NoiseSkip` emits what it says in the stage-one IR: `Never` calls the noise helper
/// without thresholds, `InTile` tests thresholds but neither reads nor publishes row bounds,
/// `CrossTile` does both (an atomic max per tile and sample).
#[test]
fn noise_skips_emit_what_they_say() {
    let p = full(DType::BF16);
    for skip in [NoiseSkip::Never, NoiseSkip::InTile, NoiseSkip::CrossTile] {
        let c = tensor_small().with_noise_skip(skip);
        let ir = flashsample_codegen_ptx::llvm_ir(&p, &c).unwrap();
        let stage1 = ir_function(&ir, "flashsample_stage1");
        let calls_all = stage1.contains("@fs_noise_pair_all(");
        let calls_tested = stage1.contains("@fs_noise_pair(");
        let publishes = stage1.contains("atomicrmw umax");
        let reads_bounds = stage1.contains("ld.relaxed.gpu.global.b32");
        let want = match skip {
            NoiseSkip::Never => (true, false, false, false),
            NoiseSkip::InTile => (false, true, false, false),
            NoiseSkip::CrossTile => (false, true, true, true),
        };
        assert_eq!((calls_all, calls_tested, publishes, reads_bounds), want, "{skip:?}: (untested call, tested call, publishes, reads bounds)");
        // ptxas-free check that the module assembles through LLVM for every kind.
        ptx(&p, &c, Arch::Sm90);
    }
}

fn entry_param_types<'a>(ptx: &'a str, name: &str) -> Vec<&'a str> {
    let head = &ptx[ptx.find(&format!(".entry {name}(")).unwrap_or_else(|| panic!("{name}"))..];
    let params = &head[..head.find(')').unwrap()];
    params.lines().skip(1).map(|l| l.split_whitespace().nth(1).unwrap_or("")).collect()
}

#[test]
fn list_pipelines_get_the_filter_kernel() {
    let p = filtered(DType::BF16);
    let c = with_lists(tensor_small(), &p);
    assert_eq!(c.list_per_tile, 4, "default: one entry per 32 tokens of the 128-token tile, at least 4");
    let k = ptx(&p, &c, Arch::Sm90);
    assert_eq!(k.filter, Some("flashsample_filter"));
    assert_eq!(
        entry_param_types(&k.ptx, "flashsample_filter"),
        [
            ".u64", ".u32", ".u32", ".u32", ".u32", ".u32", ".u64", ".u64", ".u64", ".u32", ".u64", ".u64",
            ".u32", ".u32", ".u64", ".u64", ".u64", ".u64", ".u64", ".u64", ".u32", ".u64", ".u64", ".u64", ".u32", ".u64", ".u64"
        ]
    );
    assert_eq!(flashsample_codegen_ptx::FilterArgs::default().args().len(), 27);
    assert!(!k.ptx.contains(".local"), "no local memory");
    // The penalty lookup is out of line, the survivors use the abi's ln / exp.
    assert!(k.ptx.contains("fs_penalize_token"));
    assert!(k.ptx.contains("atom.shared.add.u32"));
    // Pipelines without lists have no third kernel.
    let k = ptx(&full(DType::BF16), &tensor_small(), Arch::Sm90);
    assert_eq!(k.filter, None);
    assert!(!k.ptx.contains("flashsample_filter"));
}

#[test]
fn list_configs_are_validated_and_sized() {
    let p = filtered(DType::BF16);
    let l = GpuLimits::H200;
    let c = with_lists(tensor_small(), &p);
    c.validate(&p, &l).unwrap();
    // Too long for the capacity or the tile, or missing, or set without lists.
    for bad in [0, 129, 2000] {
        let mut b = c.clone();
        b.list_per_tile = bad;
        assert!(matches!(b.validate(&p, &l), Err(PtxError::InvalidConfig { knob: "list_per_tile", .. })), "{bad}");
    }
    let mut b = tensor_small();
    b.list_per_tile = 4;
    assert!(b.validate(&full(DType::BF16), &l).is_err());
    // The list epilogue's tile lives after the scratch.
    let plain = tensor_small();
    assert_eq!(c.smem_bytes(), plain.smem_bytes().max(4 * 6 * 8 * 4 + 128 * 8 * 4));
    // The exact-list fallback holds the whole capacity (capped by the tile).
    assert_eq!(c.exact_lists(p.list_capacity()).list_per_tile, 64);
    let big = PipelineBuilder::new("Big", DType::BF16, DType::BF16).filter("f", 1024).build().unwrap();
    assert_eq!(with_lists(tensor_small(), &big).exact_lists(big.list_capacity()).list_per_tile, 128);
}

#[test]
fn list_pipelines_compile_on_both_paths() {
    for (dtype, c) in [
        (DType::BF16, cfg(256, 16, 64, 8, 3, false)),
        (DType::BF16, cfg(128, 64, 64, 4, 4, true)),
        (DType::F32, cfg(128, 8, 64, 4, 1, false)),
    ] {
        let p = filtered(dtype);
        let c = with_lists(c, &p);
        let k = ptx(&p, &c, Arch::Sm80);
        assert!(!k.ptx.contains(".local"), "{c:?}");
        let k = ptx(&p, &c.exact_lists(1024), Arch::Sm90);
        assert!(!k.ptx.contains(".local"), "{c:?}");
    }
}

/// The pre-optimization LLVM IR of the stage-one kernel of a small greedy config per
/// schedule (`insta` snapshots: a reviewer reads the IR a schedule emits, and an LLVM upgrade
/// does not churn them).
#[test]
fn snapshot_stage1_ir_per_schedule() {
    let p = greedy(DType::BF16);
    let simt_p = greedy(DType::F32);
    let item = Grid::PerItem;
    // One warp where the schedule allows it (a warpgroup for wgmma): the cp.async rings
    // unroll every thread's chunks, twice (aligned and 2-byte fallback).
    for (name, pipeline, warps, schedule) in [
        ("stage1_simt", &simt_p, 1, Schedule::Simt { grid: item }),
        ("stage1_mma_sync", &p, 1, Schedule::MmaSync { stages: 2, k_step: 64, grid: item }),
        ("stage1_mma_sync_persistent", &p, 1, Schedule::MmaSync { stages: 2, k_step: 64, grid: Grid::Persistent }),
        ("stage1_wgmma", &p, 4, Schedule::Wgmma { stages: 3, drain: false, grid: item }),
        ("stage1_wgmma_tma", &p, 4, Schedule::WgmmaTma { stages: 3, grid: GridKind::PerItem }),
        ("stage1_wgmma_tma_pingpong", &p, 4, Schedule::WgmmaTma { stages: 3, grid: GridKind::PingPong }),
    ] {
        let c = GpuConfig::new(32 * warps, 8, warps, schedule);
        let ir = flashsample_codegen_ptx::llvm_ir(pipeline, &c).unwrap_or_else(|e| panic!("{name}: {e}"));
        insta::assert_snapshot!(name, ir_function(&ir, "flashsample_stage1"));
    }
}

/// A verifying pipeline's stage one keeps residual lists (the config's `residual_per_tile`,
/// a list tile in shared memory even without a filter), writes the draft logits through the
/// target capture and draws the residual stream; other pipelines get none of it.
#[test]
fn verifying_pipelines_keep_residual_lists() {
    let plain = with_lists(tensor_small(), &greedy(DType::BF16));
    assert_eq!(plain.residual_per_tile, 0);
    for filter in [false, true] {
        let p = verifying(filter);
        let c = with_lists(tensor_small(), &p);
        assert_eq!(c.residual_per_tile, flashsample_codegen_ptx::GPU_RESIDUAL_PER_TILE);
        assert_eq!(c.smem_layout().list_tile_bytes, c.vocab_tile * c.batch_tile * 4);
        c.validate(&p, &GpuLimits::H200).unwrap();
        // Without residual lists the kernel could not verify; with them a plain pipeline is refused.
        let bare = GpuConfig { residual_per_tile: 0, ..c.clone() };
        assert!(matches!(bare.validate(&p, &GpuLimits::H200), Err(PtxError::InvalidConfig { .. })), "{bare:?}");
        let stray = GpuConfig { residual_per_tile: 8, ..plain.clone() };
        assert!(matches!(stray.validate(&greedy(DType::BF16), &GpuLimits::H200), Err(PtxError::InvalidConfig { .. })));
        let ir = flashsample_codegen_ptx::llvm_ir(&p, &c).unwrap();
        let stage1 = ir_function(&ir, "flashsample_stage1");
        assert!(stage1.contains("%residual_lists"), "the lists are written");
        assert!(stage1.contains("%targets"), "the draft logits are captured");
        assert!(stage1.contains("urem i32"), "draft rows are told from bonus rows");
        let whole = c.whole_tile_residuals();
        assert_eq!(whole.residual_per_tile, whole.vocab_tile);
        whole.validate(&p, &GpuLimits::H200).unwrap();
        let k = ptx(&p, &c, Arch::Sm90);
        assert!(!k.ptx.contains(".local"), "{c:?}");
    }
    // The heuristic fits the list tile into shared memory at both LM-head shapes.
    for filter in [false, true] {
        let p = verifying(filter);
        for (d, v) in [(4096, 151_936), (8192, 128_256)] {
            for batch in [4, 64, 512] {
                let c = GpuConfig::heuristic(&p, batch, d, v, &GpuLimits::H200);
                assert!(c.residual_per_tile > 0, "{c:?}");
                c.validate(&p, &GpuLimits::H200).unwrap_or_else(|e| panic!("B={batch} {d}:{v} {c:?}: {e}"));
                c.whole_tile_residuals().validate(&p, &GpuLimits::H200).unwrap_or_else(|e| panic!("whole tiles {c:?}: {e}"));
            }
        }
    }
    // The serialized form of a config without residual lists is unchanged.
    assert!(!serde_json::to_string(&plain).unwrap().contains("residual"));
}

/// A verifying pipeline's module carries the decision kernel and the drafts' spreading into
/// targets; its f64 arithmetic is only the explicit round-to-nearest intrinsics (never an
/// `fadd`/`fmul` LLVM could contract into an fma the host does not run), and it runs the
/// abi's f64 `ln`, `exp` and Gumbel. Other pipelines have neither kernel.
#[test]
fn verifying_pipelines_decide_on_the_device() {
    use flashsample_codegen_ptx::llvm_ir;
    for filter in [false, true] {
        let p = verifying(filter);
        let c = with_lists(tensor_small(), &p);
        let ir = llvm_ir(&p, &c).unwrap();
        let decide = ir_function(&ir, "flashsample_decide");
        for param in ["%residual_lists", "%draft_probs", "%drafts", "%filters", "%out_status", "%out_logprobs"] {
            assert!(decide.contains(param), "{param}");
        }
        for helper in ["@fs_exp_f64", "@fs_ln_f64", "@fs_gumbel_f64", "@fs_philox"] {
            assert!(decide.contains(helper) || ir_function(&ir, "fs_gumbel_f64").contains(helper), "{helper}");
        }
        for f in ["flashsample_decide", "fs_ln_f64", "fs_exp_f64", "fs_gumbel_f64"] {
            let body = ir_function(&ir, f);
            for op in ["fadd double", "fmul double", "fdiv double", "fsub double"] {
                assert!(!body.contains(op), "{f}: {op}");
            }
        }
        assert!(ir_function(&ir, "flashsample_spec_targets").contains("urem i32"));
        let k = ptx(&p, &c, Arch::Sm90);
        assert_eq!(k.decide, Some(("flashsample_decide", "flashsample_spec_targets")));
        assert!(k.ptx.contains(".entry flashsample_decide") && k.ptx.contains(".entry flashsample_spec_targets"));
        assert!(!k.ptx.contains(".local"), "no local memory");
    }
    let k = ptx(&greedy(DType::BF16), &tensor_small(), Arch::Sm90);
    assert_eq!(k.decide, None);
    assert!(!k.ptx.contains("flashsample_decide"));
}

/// Per-request logit bias in vLLM's order, beside the global bias, on a sampling pipeline
/// with lists (the filter sees the biased logits).
fn request_bias(dtype: DType) -> Pipeline {
    PipelineBuilder::new("RequestBias", dtype, dtype)
        .softcap(30.0)
        .logit_bias("logit_bias")
        .bias("bias")
        .penalties("pen")
        .temperature_per_row("t")
        .filter("filter", 16)
        .gumbel("seed", 2)
        .outputs(Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 3 })
        .build()
        .unwrap()
}

/// The logit bias compiles on every schedule: a bitset test per quad and column, then the
/// out-of-line binary search (`fs_logit_bias_token`) before the penalties' (vLLM's order);
/// pipelines without it never read its parameters. With `FLASHSAMPLE_PTX_DUMP=DIR` the
/// modules are written there, for `ptxas -arch=<the module's .target>`.
#[test]
fn logit_bias_compiles_on_every_schedule() {
    let item = Grid::PerItem;
    let dump = std::env::var_os("FLASHSAMPLE_PTX_DUMP").map(std::path::PathBuf::from);
    for (name, dtype, c, arch) in [
        ("simt", DType::F32, cfg(128, 8, 64, 4, 1, false), Arch::Sm80),
        ("mma_sync", DType::BF16, cfg(128, 16, 64, 4, 3, false), Arch::Sm80),
        ("mma_sync_persistent", DType::F16, cfg(128, 64, 64, 4, 4, true), Arch::Sm90),
        ("wgmma", DType::BF16, GpuConfig::new(256, 64, 8, Schedule::Wgmma { stages: 4, drain: false, grid: item }), Arch::Sm90),
        ("wgmma_tma", DType::BF16, GpuConfig::new(256, 64, 8, Schedule::WgmmaTma { stages: 5, grid: GridKind::PerItem }), Arch::Sm90),
        ("wgmma_tma_pingpong", DType::BF16, GpuConfig::new(128, 64, 4, Schedule::WgmmaTma { stages: 4, grid: GridKind::PingPong }), Arch::Sm90),
        ("wgmma_tma_cooperative", DType::BF16, GpuConfig::new(128, 64, 4, Schedule::WgmmaTma { stages: 4, grid: GridKind::Cooperative }), Arch::Sm90),
        ("wgmma_tma_cooperative_pair", DType::BF16, GpuConfig::new(256, 32, 8, Schedule::WgmmaTma { stages: 3, grid: GridKind::CooperativePair }), Arch::Sm90),
    ] {
        let p = request_bias(dtype);
        let c = with_lists(c, &p);
        c.validate(&p, &GpuLimits::H200).unwrap_or_else(|e| panic!("{name}: {e}"));
        let k = ptx(&p, &c, arch);
        let ir = flashsample_codegen_ptx::llvm_ir(&p, &c).unwrap();
        let stage1 = ir_function(&ir, "flashsample_stage1");
        assert!(stage1.contains("addrspace(1) %lb_bits, i64") && stage1.contains("addrspace(1) %lb_offsets, i64"), "{name}");
        let (bias, penalty) = (stage1.find("@fs_logit_bias_token(").unwrap(), stage1.find("@fs_penalize_token(").unwrap());
        assert!(bias < penalty, "{name}: the logit bias comes before the penalties");
        assert!(ir_function(&ir, "fs_logit_bias_token").contains("llvm.nvvm.add.rn.f"), "{name}: x + bias, rounded");
        assert!(k.ptx.contains("fs_logit_bias_token"), "{name}: out of line");
        assert!(!k.ptx.contains(".local"), "{name}: no local memory");
        if let Some(dir) = &dump {
            std::fs::create_dir_all(dir).unwrap();
            std::fs::write(dir.join(format!("logit_bias_{name}.ptx")), &k.ptx).unwrap();
        }
    }
    let plain = flashsample_codegen_ptx::llvm_ir(&full(DType::BF16), &tensor_small()).unwrap();
    assert!(!ir_function(&plain, "flashsample_stage1").contains("addrspace(1) %lb_bits, i64"), "no logit bias, no reads");
    assert!(!plain.contains("fs_logit_bias_token"));
}

/// The TMA schedules take their two tensor maps by value, as one 256-byte kernel-constant
/// parameter (`__grid_constant__`), and hand `cp.async.bulk.tensor` its generic address; the
/// other schedules have the parameter and never read it.
#[test]
fn tma_schedules_read_their_maps_from_the_kernel_parameter() {
    let p = full(DType::BF16);
    for grid in [GridKind::PerItem, GridKind::PingPong, GridKind::Cooperative, GridKind::CooperativePair] {
        let c = GpuConfig::new(256, 64, 8, Schedule::WgmmaTma { stages: 4, grid });
        let k = ptx(&p, &c, Arch::Sm90);
        let index = flashsample_codegen_ptx::STAGE1.index("tmaps").unwrap();
        let param = format!("flashsample_stage1_param_{index}");
        assert!(k.ptx.contains(&format!(".param .align 64 .b8 {param}[256]")), "{grid:?}: a 256-byte by-value parameter");
        let mov = k.ptx.lines().find(|l| l.contains("mov.b64") && l.ends_with(&format!(", {param};"))).expect("the parameter's address");
        let reg = mov.split_whitespace().nth(1).unwrap().trim_end_matches(',');
        assert!(k.ptx.lines().any(|l| l.contains("cvta.param.u64") && l.ends_with(&format!(", {reg};"))), "{grid:?}: made generic");
        assert!(k.ptx.contains("cp.async.bulk.tensor"), "{grid:?}");
        assert!(!k.ptx.contains(&format!("[{param}]")), "{grid:?}: the maps are read in place, not loaded as a pointer");
    }
    let plain = ptx(&p, &tensor_small(), Arch::Sm90);
    assert!(!plain.ptx.contains("cvta.param"), "no TMA, no use of the maps");
}

/// Token noise reads the row's decode step (`row_steps`, counter word 3 = step · 4 + the
/// token stream) in stage one and in the filter's draw, and only where the pointer is given.
#[test]
fn token_noise_takes_the_rows_decode_step() {
    let p = filtered(DType::BF16);
    let c = with_lists(tensor_small(), &p);
    let ir = flashsample_codegen_ptx::llvm_ir(&p, &c).unwrap();
    for kernel in ["flashsample_stage1", "flashsample_filter"] {
        let f = ir_function(&ir, kernel);
        assert!(f.contains("noalias readonly %row_steps"), "{kernel}: a parameter");
        assert!(f.contains("icmp ne ptr addrspace(1) %row_steps, null"), "{kernel}");
    }
    let noise = ir_function(&ir, "fs_noise_pair");
    assert!(noise.contains("i32 %w3_a") && noise.contains("@fs_philox(i32 %ctr, i32 %row_a, i32 %s, i32 %w3_a"));
    // Greedy pipelines draw no noise and never read the steps.
    let g = flashsample_codegen_ptx::llvm_ir(&greedy(DType::BF16), &tensor_small()).unwrap();
    assert!(!ir_function(&g, "flashsample_stage1").contains("%row_steps, null"));
}

/// Status codes come from `abi::RowStatus`: stage two writes AllMasked / NonFinite, stage
/// three ListOverflow / NucleusTooLarge.
#[test]
fn kernels_write_the_abi_status_codes() {
    use flashsample_abi::RowStatus;
    let p = filtered(DType::BF16);
    let ir = flashsample_codegen_ptx::llvm_ir(&p, &with_lists(tensor_small(), &p)).unwrap();
    let s2 = ir_function(&ir, "flashsample_stage2");
    assert!(s2.contains(&format!("i32 {}, i32 {}", RowStatus::AllMasked.code(), RowStatus::Ok.code())));
    assert!(s2.contains(&format!("i32 {}, i32 %", RowStatus::NonFinite.code())));
    let s3 = ir_function(&ir, "flashsample_filter");
    for s in [RowStatus::ListOverflow, RowStatus::NucleusTooLarge] {
        assert!(s3.contains(&format!("store i32 {}, ptr addrspace(1)", s.code())), "{s:?}");
    }
}

// ---- validation against the recorded H200 limits ----

#[test]
fn h200_limits_are_the_recorded_ones() {
    let l = GpuLimits::H200;
    assert_eq!(l.compute_capability, (9, 0));
    assert_eq!(l.sm_count, 132);
    assert_eq!(l.max_shared_per_block_optin, 227 * 1024);
    assert_eq!(l.max_threads_per_block, 1024);
    assert_eq!(l.max_regs_per_block, 65536);
}

#[test]
fn validation_prunes_impossible_configs() {
    let p = full(DType::BF16);
    let h200 = GpuLimits::H200;
    assert!(tensor_small().validate(&p, &h200).is_ok());
    let over_smem = cfg(512, 16, 128, 4, 4, false); // 4 · (528 · 256) bytes
    assert!(
        matches!(over_smem.validate(&p, &h200), Err(PtxError::OverLimit { what, .. }) if what.starts_with("shared"))
    );
    assert!(
        over_smem.validate_shape(&p).is_ok(),
        "shape is fine, only the device is too small"
    );
    let bad = |c: GpuConfig, knob: &str| match c.validate(&p, &h200) {
        Err(PtxError::InvalidConfig { knob: k, .. }) => assert_eq!(k, knob, "{c:?}"),
        other => panic!("{c:?}: {other:?}"),
    };
    bad(cfg(100, 8, 64, 4, 2, false), "vocab_tile"); // not 32·warps-aligned
    bad(cfg(64, 8, 64, 4, 2, false), "vocab_tile");
    bad(cfg(128, 12, 64, 4, 2, false), "batch_tile"); // not a multiple of mma n = 8
    bad(cfg(128, 256, 64, 4, 2, false), "batch_tile");
    bad(cfg(128, 8, 48, 4, 2, false), "k_step");
    bad(cfg(128, 8, 64, 4, 0, false), "stages");
    bad(cfg(128, 8, 64, 4, 9, false), "stages");
    bad(cfg(128, 8, 64, 0, 2, false), "warps");
    bad(cfg(4096, 128, 64, 4, 2, false), "vocab_tile"); // accumulators per thread
    let too_many_threads = GpuLimits {
        max_threads_per_block: 128,
        ..h200
    };
    assert!(matches!(
        cfg(256, 8, 64, 8, 2, false).validate(&p, &too_many_threads),
        Err(PtxError::OverLimit { .. })
    ));
    let few_regs = GpuLimits {
        max_regs_per_block: 16384,
        ..h200
    };
    assert!(matches!(
        cfg(256, 128, 64, 8, 2, false).validate(&p, &few_regs),
        Err(PtxError::OverLimit { .. })
    ));
    let old = GpuLimits {
        compute_capability: (7, 5),
        ..h200
    };
    assert!(matches!(
        tensor_small().validate(&p, &old),
        Err(PtxError::UnsupportedArch { .. })
    ));
    assert!(Arch::from_compute_capability((7, 0)).is_err());
    assert_eq!(Arch::from_compute_capability((8, 9)).unwrap(), Arch::Sm80);
    assert_eq!(Arch::from_compute_capability((9, 0)).unwrap(), Arch::Sm90);
    assert_eq!(Arch::from_compute_capability((10, 0)).unwrap(), Arch::Sm90);
}

#[test]
fn heuristic_configs_are_valid() {
    let h200 = GpuLimits::H200;
    for p in [
        full(DType::BF16),
        full(DType::F16),
        full(DType::F32),
        greedy(DType::BF16),
    ] {
        for batch in [1, 7, 8, 9, 32, 33, 64, 256, 1000] {
            let c = GpuConfig::heuristic(&p, batch, 4096, 151_936, &h200);
            c.validate(&p, &h200)
                .unwrap_or_else(|e| panic!("{batch}: {c:?}: {e}"));
        }
    }
    let small = GpuLimits {
        max_shared_per_block_optin: 100 * 1024,
        ..h200
    };
    let c = GpuConfig::heuristic(&full(DType::BF16), 64, 4096, 151_936, &small);
    assert!(c.validate(&full(DType::BF16), &small).is_ok(), "{c:?}");
}

#[test]
fn geometry() {
    let c = cfg(256, 8, 64, 8, 4, false);
    assert_eq!(c.block_threads(), 256);
    assert_eq!(c.block(), (256, 1, 1));
    assert_eq!(c.tiles(151_936), 594);
    assert_eq!(c.tiles(256), 1);
    assert_eq!(c.tiles(257), 2);
    assert_eq!(c.grid(5, 1000, 132), (4, 1, 1));
    assert_eq!(c.grid(17, 1000, 132), (4, 3, 1));
    assert_eq!(c.smem_bytes(), 4 * (256 + 8) * 64 * 2);
    let p = cfg(256, 8, 64, 8, 4, true);
    assert_eq!(p.grid(64, 151_936, 132), (132, 1, 1), "as many CTAs as are resident");
    // The persistent tensor path keeps its epilogue scratch after the ring (it overlaps the
    // next item's prologue), so it needs both.
    assert!(p.overlaps_epilogue() && !c.overlaps_epilogue());
    assert_eq!(p.smem_bytes(), c.smem_bytes() + 8 * 8 * 4 * 8, "eight 4-byte fields of warps × batch_tile entries");
    assert_eq!(
        p.grid(1, 1000, 132),
        (4, 1, 1),
        "never more CTAs than work items"
    );
    assert_eq!(c.stage2_grid(7), (7, 1, 1));
    assert_eq!(c.stage2_block_threads(), 256);
    let simt = cfg(128, 8, 64, 4, 1, false);
    assert_eq!(
        simt.smem_bytes(),
        4 * 8 * 4 * 8,
        "SIMT needs only the epilogue scratch: eight 4-byte fields of warps × batch_tile entries"
    );
}

#[test]
fn large_tiles_outline_the_per_token_math() {
    let c = cfg(128, 64, 64, 4, 4, false);
    assert!(flashsample_codegen_ptx::CodegenOptions::for_config(&c).outline_math);
    let k = ptx(&full(DType::BF16), &c, Arch::Sm90);
    assert!(k.ptx.contains(".func"), "noise/exp/softcap are functions");
    assert!(k.ptx.contains("mma.sync.aligned.m16n8k16"));
}

#[test]
fn list_epilogue_selects_in_registers_for_the_heuristic_tiles() {
    // The heuristic's tiles for B = 1, 16, 64 (256, 32 or 64 columns), both archs: the
    // per-tile top lists come from warp `redux.sync` rounds over register keys, with no
    // local memory, and the filter kernel's head threshold is a histogram, not rounds.
    let p = filtered(DType::BF16);
    for (vt, bt, warps) in [(256, 8, 8), (128, 32, 4), (128, 64, 4)] {
        let c = with_lists(cfg(vt, bt, 64, warps, 4, false), &p);
        for arch in [Arch::Sm80, Arch::Sm90] {
            let k = ptx(&p, &c, arch);
            let s1 = stage1_text(&k.ptx);
            assert!(s1.contains("redux.sync.max.u32"), "{c:?} {arch:?}");
            assert!(s1.contains("vote.sync.ballot.b32"), "{c:?} {arch:?}");
            assert!(!k.ptx.contains(".local"), "{c:?} {arch:?}: no local memory");
            if std::env::var_os("FS_DUMP_PTX").is_some() {
                std::fs::write(format!("/tmp/fs_{vt}_{bt}_{warps}_{arch:?}.ptx"), &k.ptx).unwrap();
            }
        }
    }
}

/// The IR text of one `define` (up to the next one).
fn ir_function<'a>(ir: &'a str, name: &str) -> &'a str {
    let start = ir.find(&format!("@{name}(")).and_then(|i| ir[..i].rfind("define ")).expect(name);
    let end = ir[start + 7..].find("\ndefine ").map_or(ir.len(), |e| start + 7 + e);
    &ir[start..end]
}

#[test]
fn skip_logsumexp_variant_has_no_lse_epilogue() {
    use flashsample_codegen_ptx::{compile_with, llvm_ir_with, CodegenOptions};
    // A top-k serving pipeline without logprob outputs: lists, so `needs_logsumexp()`.
    let p = PipelineBuilder::new("TopK", DType::BF16, DType::BF16)
        .temperature_per_row("t")
        .filter("filter", 50)
        .gumbel("seed", 1)
        .build()
        .unwrap();
    assert!(p.needs_logsumexp());
    let c = with_lists(cfg(256, 64, 64, 8, 4, false), &p);
    let with = CodegenOptions::for_config(&c);
    let without = CodegenOptions { skip_logsumexp: true, ..with };
    let ir_with = llvm_ir_with(&p, &c, with).unwrap();
    let ir_without = llvm_ir_with(&p, &c, without).unwrap();
    let (s1_with, s1_without) = (ir_function(&ir_with, "flashsample_stage1"), ir_function(&ir_without, "flashsample_stage1"));
    // With: the exact per-token terms (in the per-column or reduce-scatter functions) and the
    // null-checked store of the partials.
    let lse_fn = |ir: &str| ir.contains("@fs_lse_column") || ir.contains("@fs_lse_scatter");
    assert!(lse_fn(s1_with) && s1_with.contains("icmp ne ptr addrspace(1) %lse, null"));
    // Without: `%lse` is only the parameter (never read, compared or stored through), no exp.
    assert_eq!(s1_without.matches("%lse").count(), 1, "only the parameter");
    assert!(!s1_without.contains("@fs_lse_term(") && !lse_fn(s1_without) && !s1_without.contains("@fs_lse_merge("));
    // Stage two and three are shared (both check their lse pointers for 0).
    for name in ["flashsample_stage2", "flashsample_filter"] {
        assert_eq!(ir_function(&ir_with, name), ir_function(&ir_without, name), "{name}");
    }
    let f = ir_function(&ir_without, "flashsample_filter");
    assert!(f.contains("icmp ne ptr addrspace(1) %lse, null"), "stage three reads lse only when given");
    // PTX: stage one of the variant stores only the 32-byte partial (three u64 sums, the
    // window, the pad; LLVM may pair them) fewer.
    let k_with = compile_with(&p, &c, Arch::Sm90, with).unwrap();
    let k_without = compile_with(&p, &c, Arch::Sm90, without).unwrap();
    let stores = |ptx: &str| stage1_text(ptx).matches("st.global").count();
    let extra = stores(&k_with.ptx) - stores(&k_without.ptx);
    assert!((2..=5).contains(&extra), "{extra} stores");
    assert!(!k_without.ptx.contains(".local"));
    // Pipelines without lists or lse outputs are unaffected by the option.
    let g = greedy(DType::BF16);
    let gc = tensor_small();
    let go = CodegenOptions::for_config(&gc);
    assert_eq!(llvm_ir_with(&g, &gc, go).unwrap(), llvm_ir_with(&g, &gc, CodegenOptions { skip_logsumexp: true, ..go }).unwrap());
}

/// `c`'s tile and ring depth on the `cp.async` wgmma ring.
fn wgmma(c: GpuConfig) -> GpuConfig {
    let schedule = Schedule::Wgmma { stages: c.stages(), drain: false, grid: grid(c.is_persistent()) };
    c.with_schedule(schedule)
}

#[test]
fn wgmma_path_targets_sm_90a_and_multiplies_from_shared_memory() {
    for (dtype, name) in [(DType::BF16, "bf16"), (DType::F16, "f16")] {
        for (c, n, per_slice) in [
            (wgmma(cfg(256, 64, 64, 8, 4, false)), 64, 8),
            (wgmma(cfg(512, 8, 64, 4, 3, true)), 8, 32),
        ] {
            let k = ptx(&full(dtype), &c, Arch::Sm90);
            let t = stage1_text(&k.ptx);
            assert!(k.ptx.contains(".target sm_90a"), "{c:?}");
            assert!(k.ptx.contains(".extern .shared .align 1024 .b8 fs_smem[]"), "swizzle atoms need 1024-byte alignment");
            let insn = format!("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{name}.{name}");
            // k_step / 16 steps × 2·quads m64 operands per warpgroup, fully unrolled.
            assert_eq!(t.matches(&insn).count(), per_slice, "{c:?}");
            assert!(!t.contains("ldmatrix") && !t.contains("mma.sync"), "{c:?}");
            for needed in ["fence.proxy.async.shared::cta", "wgmma.fence.sync.aligned", "wgmma.commit_group.sync.aligned", "wgmma.wait_group.sync.aligned 1", "wgmma.wait_group.sync.aligned 0", "cp.async.cg.shared.global"] {
                assert!(t.contains(needed), "{c:?}: {needed}");
            }
            assert!(!k.ptx.contains(".local"), "{c:?}: no local memory");
        }
    }
}

#[test]
fn wgmma_configs_are_refused_where_they_cannot_run() {
    let p = full(DType::BF16);
    let ok = wgmma(cfg(256, 64, 64, 8, 4, false));
    ok.validate(&p, &GpuLimits::H200).unwrap();
    let a100 = GpuLimits { compute_capability: (8, 0), ..GpuLimits::H200 };
    assert!(matches!(ok.validate(&p, &a100), Err(PtxError::WgmmaNeedsSm90a { compute_capability: (8, 0) })));
    let blackwell = GpuLimits { compute_capability: (10, 0), ..GpuLimits::H200 };
    assert!(matches!(ok.validate(&p, &blackwell), Err(PtxError::WgmmaNeedsSm90a { .. })));
    assert!(matches!(compile(&p, &ok, Arch::Sm80), Err(PtxError::WgmmaNeedsSm90a { .. })));
    for (bad, knob) in [(wgmma(cfg(64, 8, 64, 2, 3, false)), "warps"), (wgmma(cfg(128, 8, 64, 4, 2, false)), "stages")] {
        match bad.validate_shape(&p) {
            Err(PtxError::InvalidConfig { knob: k, .. }) => assert_eq!(k, knob, "{bad:?}"),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
}

/// `c`'s tile and ring depth on the TMA wgmma ring.
fn tma(c: GpuConfig) -> GpuConfig {
    let schedule = Schedule::WgmmaTma { stages: c.stages(), grid: grid(c.is_persistent()).into() };
    c.with_schedule(schedule)
}

#[test]
fn tma_ring_loads_boxes_and_waits_on_mbarriers() {
    for (c, boxes) in [(tma(cfg(256, 64, 64, 8, 5, false)), 2), (tma(cfg(128, 8, 64, 4, 3, true)), 1)] {
        let k = ptx(&full(DType::BF16), &c, Arch::Sm90);
        let t = stage1_text(&k.ptx);
        assert!(k.ptx.contains(".target sm_90a"), "{c:?}");
        // One 5-d W box per warpgroup (its 128 rows in wgmma order) and one H box, in the
        // prologue and in the refill.
        let w_boxes = t.matches("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes").count();
        let h_boxes = t.matches("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes").count();
        assert_eq!(w_boxes % boxes, 0, "{c:?}: {w_boxes} W boxes");
        assert_eq!(w_boxes / boxes, h_boxes, "{c:?}");
        assert!(h_boxes >= 2, "{c:?}: prologue and refill");
        for needed in ["mbarrier.init.shared::cta.b64", "fence.mbarrier_init.release.cluster", "mbarrier.try_wait.parity.shared::cta.b64", "mbarrier.arrive.expect_tx.shared::cta.b64", "mbarrier.arrive.shared::cta.b64", "wgmma.wait_group.sync.aligned 1"] {
            assert!(t.contains(needed), "{c:?}: {needed}");
        }
        // No per-thread copies, no proxy fence for them, no CTA barrier inside the k loop:
        // the only barriers are the init, the end of each item's k loop and the epilogue's.
        assert!(!t.contains("cp.async.cg") && !t.contains("cp.async.wait_group") && !t.contains("fence.proxy.async"), "{c:?}");
        let plain = ptx(&full(DType::BF16), &wgmma(c.clone()), Arch::Sm90);
        let bars = |s: &str| s.matches("bar.sync").count();
        assert_eq!(bars(t), bars(stage1_text(&plain.ptx)), "{c:?}: TMA adds the init barrier and drops the per-slice one");
        assert!(!k.ptx.contains(".local"), "{c:?}: no local memory");
        // The mbarriers sit after everything else, 8-byte aligned.
        assert_eq!(c.smem_bytes(), wgmma(c.clone()).smem_bytes().next_multiple_of(8) + 16 * c.stages());
    }
}

#[test]
fn tma_configs_need_describable_shapes() {
    let p = full(DType::BF16);
    let ok = tma(cfg(256, 64, 64, 8, 5, false));
    ok.validate(&p, &GpuLimits::H200).unwrap();
    assert!(GpuConfig::tma_fits(4096, 151_936) && GpuConfig::tma_fits(8192, 128_256));
    assert!(!GpuConfig::tma_fits(4095, 151_936) && !GpuConfig::tma_fits(4096, 151_937) && !GpuConfig::tma_fits(203, 1000));
    // Whole 32-row blocks of W only (the box's row dims would reach past V inside the map).
    assert!(!GpuConfig::tma_fits(4096, 1000) && GpuConfig::tma_fits(4096, 1056));
    // The W box covers one 32-row block per warp.
    let wide = tma(cfg(512, 8, 64, 4, 3, true));
    assert!(matches!(wide.validate_shape(&p), Err(PtxError::InvalidConfig { knob: "vocab_tile", .. })), "{wide:?}");
    assert!(ok.for_shape(4096, 151_936).uses_tma());
    assert_eq!(ok.for_shape(4096, 1003), wgmma(ok.clone()));
}

#[test]
fn drained_wgmma_ring_waits_for_every_slice_and_prefetches_deeper() {
    let p = full(DType::BF16);
    let plain = wgmma(cfg(128, 64, 64, 4, 4, false));
    let drained = plain.clone().with_schedule(Schedule::Wgmma { stages: 4, drain: true, grid: Grid::PerItem });
    let (tp, td) = (ptx(&p, &plain, Arch::Sm90), ptx(&p, &drained, Arch::Sm90));
    let (tp, td) = (stage1_text(&tp.ptx), stage1_text(&td.ptx));
    assert!(tp.contains("wgmma.wait_group.sync.aligned 1;") && !td.contains("wgmma.wait_group.sync.aligned 1;"));
    assert!(td.contains("wgmma.wait_group.sync.aligned 0;"));
    // The prologue issues stages − 1 slices instead of stages − 2: one more cp.async group.
    let groups = |t: &str| t.matches("cp.async.commit_group").count();
    assert_eq!(groups(td), groups(tp) + 1, "one more prologue group");
}

#[test]
fn stagger_delays_only_the_first_waves_second_ctas() {
    let p = full(DType::BF16);
    let c = wgmma(cfg(128, 64, 64, 4, 4, false)).with_stagger(40);
    let t = ptx(&p, &c, Arch::Sm90).ptx;
    let s1 = stage1_text(&t);
    assert!(s1.contains("%nsmid") && s1.contains("%globaltimer") && s1.contains("setp.lt.u64 p, d, 40000;"), "40 µs in ns");
    assert!(!stage1_text(&ptx(&p, &c.clone().with_stagger(0), Arch::Sm90).ptx).contains("%globaltimer"));
    assert!(matches!(
        c.clone().with_stagger(201).validate_shape(&p),
        Err(PtxError::InvalidConfig { knob: "stagger_us", .. })
    ));
    assert!(c.two_per_sm(&GpuLimits::H200) && !wgmma(cfg(256, 64, 64, 8, 5, false)).two_per_sm(&GpuLimits::H200));
}

#[test]
fn heuristic_pairs_ctas_only_where_two_fit() {
    let h200 = GpuLimits::H200;
    let plain = greedy(DType::BF16);
    // A vocabulary the TMA maps cannot describe (V % 32 != 0) keeps the cp.async tiles.
    let c = GpuConfig::heuristic(&plain, 64, 4096, 151_937, &h200);
    assert_eq!((c.vocab_tile, c.warps, c.schedule, c.stagger_us), (128, 4, Schedule::Wgmma { stages: 4, drain: true, grid: Grid::PerItem }, 30), "{c:?}");
    assert!(c.two_per_sm(&h200));
    // Where two do not fit (less shared memory per SM), the one-CTA 256 × 64 tile, unstaggered.
    let small = GpuLimits { max_shared_per_block_optin: 150_000, ..h200 };
    let c = GpuConfig::heuristic(&plain, 64, 4096, 151_937, &small);
    assert_eq!((c.vocab_tile, c.warps, c.stagger_us), (256, 8, 0), "{c:?}");
}

#[test]
fn heuristic_takes_the_tma_ring_above_batch_32_where_the_maps_fit() {
    let h200 = GpuLimits::H200;
    for p in [greedy(DType::BF16), full(DType::BF16), filtered(DType::BF16), verifying(false), verifying(true)] {
        let tile_lists = p.list_capacity() > 0 || p.verify.is_some();
        for (batch, batch_tile) in [(33, 64), (64, 64), (128, 64), (191, 64), (192, 128), (256, 128)] {
            let c = GpuConfig::heuristic(&p, batch, 4096, 151_936, &h200);
            c.validate(&p, &h200).unwrap_or_else(|e| panic!("{c:?}: {e}"));
            if !tile_lists && batch >= 192 {
                // List-free throughput batches: the 256 × 128 tile on the TMA ring.
                assert_eq!((c.schedule, c.vocab_tile, c.batch_tile), (Schedule::WgmmaTma { stages: 4, grid: GridKind::Persistent }, 256, 128), "B={batch}");
            } else if !tile_lists {
                let stages = if batch_tile == 64 { 8 } else { 6 };
                assert_eq!((c.schedule, c.vocab_tile, c.batch_tile), (Schedule::WgmmaTma { stages, grid: GridKind::PingPong }, 128, batch_tile), "B={batch}");
            } else if batch >= 192 && p.verify.is_some() && p.list_capacity() == 0 {
                // A verifier without a filter from B = 192: the 128 × 64 ping-pong on a 4-stage
                // ring.
                assert_eq!((c.schedule, c.vocab_tile, c.batch_tile), (Schedule::WgmmaTma { stages: 4, grid: GridKind::PingPong }, 128, 64), "B={batch}");
                assert!(c.residual_per_tile > 0 && c.smem_bytes() <= h200.max_shared_per_block_optin, "B={batch}: {c:?}");
            } else if batch >= 192 {
                // Lists from B = 192: the 256 × 128 tile, one CTA per item (lists alias the
                // ring).
                assert_eq!((c.schedule, c.vocab_tile, c.batch_tile), (Schedule::WgmmaTma { stages: 4, grid: GridKind::PerItem }, 256, 128), "B={batch}");
                assert!(c.list_per_tile + c.residual_per_tile > 0 && c.smem_bytes() <= h200.max_shared_per_block_optin, "B={batch}: {c:?}");
            } else {
                // Lists take shared memory: fewer stages, still the ping-pong schedule, never
                // an invalid config.
                assert!(c.is_pingpong() && (c.vocab_tile, c.batch_tile) == (128, 64), "B={batch}: {c:?}");
                assert!(c.stages() >= 3 && c.smem_bytes() <= h200.max_shared_per_block_optin, "B={batch}: {c:?}");
            }
        }
        for b in [1, 16, 32] {
            assert!(!GpuConfig::heuristic(&p, b, 4096, 151_936, &h200).is_pingpong(), "B={b}");
        }
        // No wgmma below compute capability 9.0, no TMA maps for D % 8 != 0.
        let a100 = GpuLimits { compute_capability: (8, 0), ..h200 };
        assert!(!GpuConfig::heuristic(&p, 64, 4096, 151_936, &a100).is_pingpong());
        assert!(!GpuConfig::heuristic(&p, 64, 4095, 151_936, &h200).is_pingpong());
    }
}

#[test]
fn heuristic_gives_large_scorers_the_cooperative_pair() {
    let h200 = GpuLimits::H200;
    let scorer = |top_logprobs| {
        PipelineBuilder::new("Scorer", DType::BF16, DType::BF16)
            .argmax()
            .target_logprob("targets")
            .outputs(Outputs { score: false, logsumexp: true, logprob: false, top_logprobs })
            .build()
            .unwrap()
    };
    let pair = Schedule::WgmmaTma { stages: 4, grid: GridKind::CooperativePair };
    for (d, v) in [(4096, 151_936), (8192, 128_256)] {
        for (rows, paired) in [(256, false), (2047, false), (2048, true), (8192, true)] {
            let p = scorer(0);
            let c = GpuConfig::heuristic(&p, rows, d, v, &h200);
            c.validate(&p, &h200).unwrap_or_else(|e| panic!("{rows}: {c:?}: {e}"));
            assert_eq!((c.schedule == pair, c.vocab_tile, c.batch_tile), (paired, 256, 128), "{rows} rows at D {d}: {c:?}");
        }
        // Top logprobs (lists) keep the list tiles; a sampler keeps the persistent tile.
        for p in [scorer(5), greedy(DType::BF16)] {
            let c = GpuConfig::heuristic(&p, 4096, d, v, &h200);
            assert_ne!(c.schedule.grid(), GridKind::CooperativePair, "{c:?}");
        }
    }
    // A vocabulary the TMA maps cannot describe keeps the cp.async tiles.
    assert!(!GpuConfig::heuristic(&scorer(0), 4096, 4096, 151_937, &h200).uses_tma());
}

#[test]
fn pingpong_splits_the_cta_into_a_producer_warp_and_two_consumer_sets() {
    let p = full(DType::BF16);
    let c = GpuConfig::new(128, 64, 4, Schedule::WgmmaTma { stages: 8, grid: GridKind::PingPong });
    c.validate(&p, &GpuLimits::H200).unwrap();
    assert_eq!(c.block_threads(), 2 * 128 + 128);
    let ring = tma(cfg(128, 64, 64, 4, 8, true));
    // Two epilogue areas after the ring, then the slots' mbarriers and one mainloop-done
    // barrier per set.
    let epilogue = ring.smem_bytes() - 16 * c.stages() - c.stages() * (128 + 64) * 64 * 2;
    assert_eq!(c.smem_bytes(), ring.smem_bytes() + epilogue + 16);
    let k = ptx(&p, &c, Arch::Sm90);
    let t = stage1_text(&k.ptx);
    assert_eq!(t.matches("mbarrier.init.shared::cta.b64").count() as u32, 2 * c.stages() + 2);
    assert!(t.contains(".maxntid 384") && t.contains(".maxnreg 168"), "block of 384 threads, 168 registers each");
    // The producer warpgroup keeps 24 registers; the consumers take the rest.
    assert!(t.contains("setmaxnreg.dec.sync.aligned.u32 24;") && t.contains("setmaxnreg.inc.sync.aligned.u32 240;"));
    // One CTA barrier (after the mbarrier init); everything else syncs one consumer set on
    // its named barrier (1 or 2) of 128 threads.
    assert_eq!(t.matches("bar.sync 0;").count(), 1);
    assert!(t.matches(", 128;").count() >= 2 && t.contains("bar.sync %r"), "named barriers of one set");
    // The producer's loop is the only place boxes are issued: one W and one H box per slice.
    assert_eq!(t.matches("cp.async.bulk.tensor.5d").count(), 1);
    assert_eq!(t.matches("cp.async.bulk.tensor.2d").count(), 1);
    assert!(!k.ptx.contains(".local"), "no local memory");
    // Shapes the maps cannot describe run the persistent cp.async ring.
    assert_eq!(c.for_shape(203, 1003), wgmma(cfg(128, 64, 64, 4, 8, true)));
    assert!(c.for_shape(4096, 151_936).is_pingpong());
}

/// The cooperative schedule: one consumer set of two warpgroups on the 256 × 128 tile plus the
/// producer warpgroup, no mainloop-done barriers, the producer the only issuer of boxes.
#[test]
fn cooperative_is_one_consumer_set_fed_by_a_producer_warpgroup() {
    let p = full(DType::BF16);
    let c = GpuConfig::new(256, 128, 8, Schedule::WgmmaTma { stages: 4, grid: GridKind::Cooperative });
    c.validate(&p, &GpuLimits::H200).unwrap();
    assert!(c.is_warp_specialized() && !c.is_pingpong());
    assert_eq!(c.block_threads(), 256 + 128);
    let persistent = c.clone().with_schedule(Schedule::WgmmaTma { stages: 4, grid: GridKind::Persistent });
    // One epilogue area after the ring, like the persistent tile; no mainloop-done barriers.
    assert_eq!(c.smem_bytes(), persistent.smem_bytes());
    let k = ptx(&p, &c, Arch::Sm90);
    let t = stage1_text(&k.ptx);
    assert_eq!(t.matches("mbarrier.init.shared::cta.b64").count() as u32, 2 * c.stages());
    assert!(t.contains(".maxntid 384") && t.contains(".maxnreg 168"), "block of 384 threads, 168 registers each");
    // The producer keeps 24 registers; the one consumer set takes (65536 − 24·128) / 256.
    assert!(t.contains("setmaxnreg.dec.sync.aligned.u32 24;") && t.contains("setmaxnreg.inc.sync.aligned.u32 240;"));
    assert_eq!(t.matches("bar.sync 0;").count(), 1);
    assert!(t.matches(", 256;").count() >= 2, "named barriers of the 256 consumer threads");
    // The producer issues every box: one W box per consumer warpgroup and one H box a slice.
    assert_eq!(t.matches("cp.async.bulk.tensor.5d").count(), 2);
    assert_eq!(t.matches("cp.async.bulk.tensor.2d").count(), 1);
    assert!(c.for_shape(4096, 151_936).is_warp_specialized());
}

/// The cooperative pair: a kernel of compile-time 2-CTA clusters whose producers each
/// multicast one W box (the other CTA's empty barriers counting its consumers too), a grid of
/// whole clusters over batch tiles padded to pairs, and 8 warps or a typed error.
#[test]
fn cooperative_pair_multicasts_half_the_w_slice_per_cta() {
    let p = full(DType::BF16);
    let c = GpuConfig::new(256, 128, 8, Schedule::WgmmaTma { stages: 4, grid: GridKind::CooperativePair });
    c.validate(&p, &GpuLimits::H200).unwrap();
    assert_eq!((c.cluster_ctas(), c.block_threads()), (2, 384));
    let k = ptx(&p, &c, Arch::Sm90);
    let t = stage1_text(&k.ptx);
    assert!(t.contains(".reqnctapercluster 2, 1, 1"), "compile-time clusters of two");
    // One multicast W box (this CTA's warpgroup half, to both CTAs) and one local H box.
    assert_eq!(t.matches(".multicast::cluster").count(), 1);
    assert_eq!(t.matches("cp.async.bulk.tensor.5d").count(), 1);
    assert_eq!(t.matches("cp.async.bulk.tensor.2d").count(), 1);
    // Empty barriers count both CTAs' 8 consumer warps; releases arrive on the other CTA too.
    let inits: Vec<&str> = t.lines().filter(|l| l.contains("mbarrier.init.shared::cta.b64")).collect();
    let counts: Vec<&str> = inits.iter().map(|l| l.rsplit(", ").next().unwrap().trim_end_matches(';')).collect();
    let sixteen = t.lines().filter(|l| l.contains("mov.b32") && l.ends_with(", 16;")).map(|l| l.split_whitespace().nth(1).unwrap().trim_end_matches(',')).collect::<Vec<_>>();
    assert_eq!(counts.iter().filter(|r| sixteen.contains(r)).count() as u32, c.stages(), "one empty barrier of 16 arrivals per slot: {inits:?}");
    assert!(t.contains("mapa.shared::cluster.u32") && t.contains("mbarrier.arrive.shared::cluster.b64 _"));
    // CTA-scope releases: a cluster-scope one is a MEMBAR.ALL.GPU per arrival.
    assert!(!t.contains("mbarrier.arrive.release.cluster"));
    // A cluster barrier after the barriers' initialisation and one before the exit.
    assert_eq!(t.matches("barrier.cluster.arrive.release.aligned").count(), 2);
    // Three batch tiles walk as four (the third pairs with an empty one); whole clusters.
    assert_eq!(c.grid_batch_tiles(300), 4);
    assert_eq!(c.grid(300, 151_936, 132), (132, 1, 1));
    assert_eq!(c.grid(100, 256, 132), (2, 1, 1));
    assert_eq!(c.grid(100, 256, 1), (2, 1, 1), "never half a cluster");
    let four = GpuConfig::new(128, 128, 4, Schedule::WgmmaTma { stages: 4, grid: GridKind::CooperativePair });
    assert!(matches!(four.validate(&p, &GpuLimits::H200), Err(flashsample_codegen_ptx::PtxError::InvalidConfig { knob: "warps", .. })));
}

/// Tuning files written before `Schedule` existed (flat flags) load as the schedule they
/// meant; flag combinations no schedule has are refused, naming the flags.
#[test]
fn legacy_flag_configs_load_and_illegal_combinations_are_refused() {
    let flags = |extra: &str| {
        format!(r#"{{"vocab_tile": 128, "batch_tile": 64, "k_step": 64, "warps": 4, "stages": 8, "persistent": true{extra}}}"#)
    };
    let load = |json: &str| serde_json::from_str::<GpuConfig>(json);
    let mma = cfg(128, 64, 64, 4, 8, true);
    assert_eq!(load(&flags("")).unwrap(), mma);
    assert_eq!(load(&flags(r#", "wgmma": true, "wgmma_drain": true, "stagger_us": 30"#)).unwrap(), mma.clone().with_schedule(Schedule::Wgmma { stages: 8, drain: true, grid: Grid::Persistent }).with_stagger(30));
    assert_eq!(load(&flags(r#", "wgmma": true, "tma": true, "pingpong": true"#)).unwrap(), GpuConfig::new(128, 64, 4, Schedule::WgmmaTma { stages: 8, grid: GridKind::PingPong }));
    let simt = r#"{"vocab_tile": 128, "batch_tile": 8, "k_step": 64, "warps": 4, "stages": 1, "persistent": false}"#;
    assert_eq!(load(simt).unwrap(), cfg(128, 8, 64, 4, 1, false));
    for bad in [r#", "tma": true"#, r#", "pingpong": true"#, r#", "wgmma_drain": true"#, r#", "wgmma": true, "tma": true, "wgmma_drain": true"#] {
        let e = load(&flags(bad)).unwrap_err().to_string();
        assert!(e.contains("no schedule has"), "{bad}: {e}");
    }
    let wide = r#"{"vocab_tile": 128, "batch_tile": 64, "k_step": 128, "warps": 4, "stages": 4, "persistent": false, "wgmma": true}"#;
    assert!(load(wide).unwrap_err().to_string().contains("k_step = 128"));
    // The current form round-trips.
    for c in [mma, GpuConfig::new(128, 64, 4, Schedule::WgmmaTma { stages: 8, grid: GridKind::PingPong }).with_stagger(20)] {
        assert_eq!(load(&serde_json::to_string(&c).unwrap()).unwrap(), c);
    }
}

/// NVIDIA's assembler accepts every module the heuristic (B 1..512, both LM-head shapes) and
/// each schedule emits, for the pipelines with a logsumexp, lists and neither. Runs where
/// `PTXAS` names a ptxas binary (CUDA 12.4+, e.g. from the `nvidia-cuda-nvcc-cu12` wheel);
/// ignored elsewhere, never passed vacuously.
#[test]
#[ignore = "needs ptxas: set PTXAS=/path/to/ptxas and run with --include-ignored"]
fn ptxas_accepts_every_schedule() {
    let ptxas = std::env::var("PTXAS").expect("PTXAS names the ptxas binary");
    let dir = std::env::temp_dir().join(format!("flashsample-ptxas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let h200 = GpuLimits::H200;
    let mut configs: Vec<(Pipeline, GpuConfig)> = Vec::new();
    let scorer = PipelineBuilder::new("Scorer", DType::BF16, DType::BF16)
        .temperature_per_row("t")
        .mask("allowed")
        .argmax()
        .target_logprob("targets")
        .outputs(Outputs { score: false, logsumexp: true, logprob: false, top_logprobs: 5 })
        .build()
        .unwrap();
    for p in [full(DType::BF16), filtered(DType::BF16), greedy(DType::BF16), full(DType::F32), scorer, raw_filtered(DType::BF16), raw_top(DType::BF16), verifying(false), verifying(true)] {
        for (d, v) in [(4096, 151_936), (8192, 128_256)] {
            for batch in [1, 8, 33, 64, 128, 256, 512] {
                let c = GpuConfig::heuristic(&p, batch, d, v, &h200);
                if p.verify.is_some() {
                    // The recompute of one row over its whole vocabulary.
                    configs.push((p.clone(), c.whole_tile_residuals()));
                }
                configs.push((p.clone(), c));
            }
        }
        if p.weights.dtype == DType::BF16 {
            for c in [
                tensor_small(),
                cfg(128, 64, 64, 4, 4, true),
                wgmma(cfg(256, 64, 64, 8, 4, false)),
                wgmma(cfg(512, 8, 64, 4, 3, true)),
                tma(cfg(256, 64, 64, 8, 5, false)),
                tma(cfg(128, 8, 64, 4, 3, true)),
                GpuConfig::new(128, 64, 4, Schedule::WgmmaTma { stages: 8, grid: GridKind::PingPong }),
            ] {
                configs.push((p.clone(), with_lists(c, &p)));
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    for (i, (p, c)) in configs.iter().enumerate() {
        let k = ptx(p, c, Arch::Sm90);
        if !seen.insert(k.ptx.clone()) {
            continue;
        }
        let target = k.ptx.lines().find_map(|l| l.strip_prefix(".target ")).expect(".target").trim().to_string();
        let file = dir.join(format!("m{i}.ptx"));
        std::fs::write(&file, &k.ptx).unwrap();
        let out = std::process::Command::new(&ptxas).arg(format!("-arch={target}")).arg(&file).arg("-o").arg("/dev/null").output().unwrap();
        assert!(out.status.success(), "{} {c:?}: {}", p.name, String::from_utf8_lossy(&out.stderr));
    }
    assert!(seen.len() >= 10, "only {} distinct modules", seen.len());
    std::fs::remove_dir_all(&dir).ok();
}

/// DESIGN.md step 10 on the GPU: a raw pipeline's stage one writes the raw partials, the raw
/// lists and the raw logit beside each processed entry, and its filter reads them; a processed
/// pipeline's stage one never touches those parameters.
#[test]
fn raw_pipelines_write_the_raw_partials_and_lists() {
    use flashsample_codegen_ptx::llvm_ir;
    let uses = |ir: &str, kernel: &str, param: &str| ir_function(ir, kernel).matches(param).count() - 1;
    for p in [raw_filtered(DType::BF16), raw_top(DType::BF16)] {
        let c = with_lists(tensor_small(), &p);
        assert!(c.list_per_tile > 0, "{}: raw top logprobs need lists", p.name);
        let ir = llvm_ir(&p, &c).unwrap();
        assert!(uses(&ir, "flashsample_stage1", "%raw_lse,") + uses(&ir, "flashsample_stage1", "%raw_lse ") > 0, "{}", p.name);
        assert!(uses(&ir, "flashsample_stage1", "%raw_lists") > 0, "{}", p.name);
        assert_eq!(uses(&ir, "flashsample_stage1", "%list_raws") > 0, p.lists_carry_raw(), "{}", p.name);
        assert_eq!(uses(&ir, "flashsample_stage1", "%lists,") > 0, p.list_capacity() > 0, "{}: processed lists", p.name);
        assert!(uses(&ir, "flashsample_filter", "%raw_lists") > 0, "{}", p.name);
        let k = ptx(&p, &c, Arch::Sm90);
        assert_eq!(k.filter, Some("flashsample_filter"));
        assert!(!k.ptx.contains(".local"), "{}: no local memory", p.name);
    }
    let p = filtered(DType::BF16);
    let ir = llvm_ir(&p, &with_lists(tensor_small(), &p)).unwrap();
    for param in ["%raw_lse", "%raw_lists", "%list_raws"] {
        assert_eq!(ir_function(&ir, "flashsample_stage1").matches(param).count(), 1, "{param}: only the parameter");
    }
}

/// The shipped H200 entry for D 4096 (128 × 64 wgmma+TMA ping-pong, 8 stages) fills shared
/// memory for a plain pipeline; a verifying pipeline adds a list tile, and the runtime keeps
/// the tuned tile by dropping ring stages instead of falling back to the heuristic.
#[test]
fn a_tuned_ring_gives_up_stages_for_a_list_tile() {
    let h200 = GpuLimits::H200;
    let plain = PipelineBuilder::new("Plain", DType::BF16, DType::BF16).temperature_per_row("t").build().unwrap();
    let tuned = GpuConfig::new(128, 64, 4, Schedule::WgmmaTma { stages: 8, grid: GridKind::PingPong });
    assert!(tuned.validate(&plain, &h200).is_ok());
    let p = verifying(false);
    let mut c = tuned.clone();
    c.fit_lists(&p);
    assert!(c.validate(&p, &h200).is_err(), "the premise: eight stages and a list tile overflow");
    let fitted = c.shallower_ring_that_fits(&p, &h200).expect("a shallower ring fits");
    assert!(fitted.validate(&p, &h200).is_ok());
    assert!(fitted.stages() < 8 && fitted.stages() >= 3, "{fitted:?}");
    assert_eq!((fitted.vocab_tile, fitted.batch_tile, fitted.residual_per_tile), (128, 64, c.residual_per_tile));
    // The deepest that fits: one more stage does not.
    let deeper = fitted.clone().with_schedule(fitted.schedule.with_stages(fitted.stages() + 1));
    assert!(deeper.validate(&p, &h200).is_err());
    // SIMT has no ring to shrink.
    let simt = GpuConfig::new(128, 8, 4, Schedule::Simt { grid: Grid::PerItem });
    assert_eq!(simt.shallower_ring_that_fits(&p, &h200), None);
}

/// The exact nucleus's kernels (DESIGN.md "Exact nucleus on the device") come with every
/// sampling pipeline that has a filter, on both multiply paths: the logits kernel runs the
/// tensor-core path's `mma.sync` for 16-bit operands and the SIMT path's `fma` chain otherwise,
/// and calls the same transform helpers as stage one (penalties out of line); the scatter is
/// stable through `match.any`; the cut reads the abi's `ln` / `exp`. Greedy or unfiltered
/// pipelines have none. With `FLASHSAMPLE_PTX_DUMP=DIR` the modules are written there.
#[test]
fn filtered_pipelines_get_the_nucleus_kernels() {
    let dump = std::env::var_os("FLASHSAMPLE_PTX_DUMP").map(std::path::PathBuf::from);
    let kernels = [
        "flashsample_nucleus_pick",
        "flashsample_nucleus_logits",
        "flashsample_nucleus_hist",
        "flashsample_nucleus_scatter",
        "flashsample_nucleus_cut",
        "flashsample_nucleus_draw",
    ];
    for (name, p, c, arch) in [
        ("bf16_mma", filtered(DType::BF16), tensor_small(), Arch::Sm80),
        ("f32_simt", filtered(DType::F32), cfg(128, 8, 64, 4, 1, false), Arch::Sm80),
        ("raw_bf16", raw_filtered(DType::BF16), tensor_small(), Arch::Sm80),
        ("bias_wgmma", request_bias(DType::BF16), wgmma(cfg(256, 64, 64, 8, 4, false)), Arch::Sm90),
    ] {
        let c = with_lists(c, &p);
        assert!(flashsample_codegen_ptx::has_nucleus_kernels(&p));
        let k = ptx(&p, &c, arch);
        for kernel in kernels {
            assert!(k.ptx.contains(&format!(".entry {kernel}(")), "{name}: {kernel}");
        }
        let ir = flashsample_codegen_ptx::llvm_ir(&p, &c).unwrap();
        let logits = ir_function(&ir, "flashsample_nucleus_logits");
        assert_eq!(logits.contains("mma.sync.aligned.m16n8k16"), c.is_tensor(), "{name}");
        assert_eq!(logits.contains("@llvm.fma.f32"), !c.is_tensor(), "{name}");
        assert!(logits.contains("@fs_penalize_token("), "{name}: stage one's penalty search");
        assert!(ir_function(&ir, "flashsample_nucleus_scatter").contains("match.any.sync.b32"));
        let cut = ir_function(&ir, "flashsample_nucleus_cut");
        assert!(cut.contains("@fs_ln_f32(") && cut.contains("@fs_exp_f32("), "{name}");
        assert!(ir_function(&ir, "flashsample_nucleus_draw").contains("@fs_gumbel_f32("), "{name}");
        assert!(!k.ptx.contains(".local"), "{name}: no local memory");
        if let Some(dir) = &dump {
            std::fs::create_dir_all(dir).unwrap();
            std::fs::write(dir.join(format!("nucleus_{name}.ptx")), &k.ptx).unwrap();
        }
    }
    // A verifying pipeline's pick skips draft rows (stage one's `spec_period` test).
    let v = verifying(true);
    let ir = flashsample_codegen_ptx::llvm_ir(&v, &with_lists(tensor_small(), &v)).unwrap();
    assert!(ir_function(&ir, "flashsample_nucleus_pick").contains("urem i32"));
    let plain = flashsample_codegen_ptx::llvm_ir(&filtered(DType::BF16), &with_lists(tensor_small(), &filtered(DType::BF16))).unwrap();
    assert!(!ir_function(&plain, "flashsample_nucleus_pick").contains("%spec_period, 0"));
    for p in [greedy(DType::BF16), full(DType::BF16)] {
        assert!(!flashsample_codegen_ptx::has_nucleus_kernels(&p));
        assert!(!ptx(&p, &tensor_small(), Arch::Sm80).ptx.contains("flashsample_nucleus_"));
    }
}

/// The nucleus scratch layout: fields in order, 8-byte aligned, none overlapping, `R × V × 20`
/// bytes of per-row buffers (24 with the raw logits) plus the small ones; grids cover the
/// vocabulary.
#[test]
fn nucleus_layout_is_aligned_and_disjoint() {
    use flashsample_codegen_ptx::{NucleusLayout, NUCLEUS_DRAW_TILE, NUCLEUS_LOGITS_TOKENS, NUCLEUS_SORT_TILE};
    for (rows, vocab, samples, raw) in [(2usize, 151_936usize, 2usize, false), (3, 1003, 1, true), (1, 5, 4, false)] {
        let l = NucleusLayout { rows, vocab, samples, raw };
        let o = l.offsets();
        let per_row = rows * vocab * 4;
        let mut fields = vec![
            (o.picks, (rows + 1) * 4),
            (o.best, rows * samples * 8),
            (o.done, rows * 4),
            (o.kept, rows * 4),
            (o.hist, rows * l.sort_tiles() * 256 * 4),
            (o.x, per_row),
            (o.keys[0], per_row),
            (o.keys[1], per_row),
            (o.vals[0], per_row),
            (o.vals[1], per_row),
        ];
        assert_eq!(o.raw.is_some(), raw);
        fields.extend(o.raw.map(|r| (r, per_row)));
        fields.sort();
        for w in fields.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{w:?} overlap");
        }
        assert!(fields.iter().all(|f| f.0 % 8 == 0));
        let last = fields.last().unwrap();
        assert!(last.0 + last.1 <= o.bytes && o.bytes < last.0 + last.1 + 8);
        assert!(o.bytes >= per_row * if raw { 6 } else { 5 });
        assert!(l.logits_grid().0 as usize * NUCLEUS_LOGITS_TOKENS as usize >= vocab);
        assert!(l.sort_grid().0 as usize * NUCLEUS_SORT_TILE as usize >= vocab && l.sort_grid().1 as usize == rows);
        assert!(l.draw_grid().0 as usize * NUCLEUS_DRAW_TILE as usize >= vocab && l.draw_grid().1 as usize == rows);
        assert_eq!(l.cut_grid(), (rows as u32, 1, 1));
    }
}

/// The runtime's glue kernel comes from the same emitter and parameter tables: one sm_80
/// module with the finishing kernel, its signature from `params.rs`.
#[test]
fn the_glue_module_has_the_finishing_kernel() {
    use flashsample_codegen_ptx::{compile_glue, glue_llvm_ir, FINALIZE};
    let ptx = compile_glue().unwrap();
    assert!(ptx.contains(".target sm_80"));
    assert_eq!(entry_param_types(&ptx, FINALIZE.kernel).len(), FINALIZE.params.len());
    assert_eq!(ptx.matches(".entry").count(), 1);
    let ir = glue_llvm_ir();
    assert!(ir_function(&ir, "flashsample_finalize").contains(&format!("store i32 {}", flashsample_abi::INDEX_NONE as i32)));
    if let Ok(ptxas) = std::env::var("PTXAS") {
        let path = std::env::temp_dir().join(format!("flashsample-glue-{}.ptx", std::process::id()));
        std::fs::write(&path, &ptx).unwrap();
        let out = std::process::Command::new(ptxas).args(["-arch=sm_80", "-o", "/dev/null"]).arg(&path).output().unwrap();
        assert!(out.status.success(), "ptxas: {}", String::from_utf8_lossy(&out.stderr));
    }
}

/// Which kernels read stage one's list bounds (DESIGN.md step 6b): a pipeline's processed
/// lists on a tile that neither lists whole tiles (the exact nucleus path) nor runs ping-pong, with
/// `G = max(list_per_tile, list capacity)` groups; never a verifier, raw lists alone, or a
/// pipeline without lists. The kernels that read them use the `list_bounds` parameter.
#[test]
fn list_bounds_are_read_where_the_design_says() {
    use flashsample_codegen_ptx::list_bound_groups;
    let tma = |grid| GpuConfig::new(256, 128, 8, Schedule::WgmmaTma { stages: 4, grid });
    let p = filtered(DType::BF16);
    let per_item = with_lists(tma(GridKind::PerItem), &p);
    assert_eq!(list_bound_groups(&p, &per_item), Some(per_item.list_per_tile.max(64)));
    assert_eq!(list_bound_groups(&p, &with_lists(tma(GridKind::Persistent), &p)), Some(per_item.list_per_tile.max(64)));
    let pingpong = with_lists(GpuConfig::new(128, 64, 4, Schedule::WgmmaTma { stages: 6, grid: GridKind::PingPong }), &p);
    assert_eq!(list_bound_groups(&p, &pingpong), None, "ping-pong tiles keep their lists unbounded");
    assert_eq!(list_bound_groups(&p, &per_item.exact_lists(1024)), None, "the exact nucleus path lists whole tiles");
    assert_eq!(list_bound_groups(&verifying(true), &with_lists(tma(GridKind::PerItem), &verifying(true))), None);
    assert_eq!(list_bound_groups(&raw_top(DType::BF16), &with_lists(tma(GridKind::PerItem), &raw_top(DType::BF16))), None, "raw lists alone");
    assert_eq!(list_bound_groups(&full(DType::BF16), &tma(GridKind::PerItem)), None, "no lists");
    // The bounded kernel loads the `list_bounds` parameter; the unbounded one never does.
    let index = flashsample_codegen_ptx::STAGE1.index("list_bounds").expect("a stage-one parameter");
    let load = format!("[flashsample_stage1_param_{index}]");
    let reads = |p: &Pipeline, c: &GpuConfig| stage1_text(&ptx(p, c, Arch::Sm90).ptx).contains(&load);
    assert!(reads(&p, &per_item), "the per-item list tile stages and publishes its bounds");
    assert!(!reads(&p, &pingpong), "the ping-pong list tile does not");
}
