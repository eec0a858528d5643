//! A scalar Rust model of DESIGN.md's stage-one semantics, built from `flashsample_abi`,
//! and the helpers the tests share.
#![allow(dead_code)]

use flashsample_abi::math::softcap_f32;
use flashsample_abi::rng::{gumbel_f32, noise_bits};
use flashsample_abi::{Candidate, LogitBiasTable, LsePartial, LseSum, PenaltyTable, RowFilter, Scored, StageTwo, INDEX_NONE, INDEX_NONFINITE};
use flashsample_codegen_cpu::{CpuConfig, CpuEngine, CpuKernel, CpuLaunch, NoiseSkip};
use flashsample_ir::{DType, Pipeline, Sampler, Transform};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// One launch's inputs, owned.
#[derive(Clone, Debug)]
pub struct Inputs {
    pub batch: usize,
    pub dim: usize,
    pub vocab: usize,
    pub dtype: DType,
    pub hidden: Vec<f32>,
    pub weights: Vec<u8>,
    pub temperatures: Vec<f32>,
    pub bias: Option<Vec<f32>>,
    pub allowed: Option<Vec<u32>>,
    pub seed: u64,
    pub row_seeds: Option<Vec<u64>>,
    pub row_steps: Option<Vec<u32>>,
    pub vocab_offset: u32,
    pub row_offset: u32,
    pub penalties: Option<PenaltyTable>,
    pub logit_bias: Option<LogitBiasTable>,
    /// Iff the pipeline filters: a sampled row whose filter is not OFF takes its argmax.
    pub filters: Option<Vec<RowFilter>>,
}

impl Inputs {
    /// Philox key and counter-row word of row `r` (DESIGN.md step 5).
    pub fn stream(&self, r: usize) -> (u64, u32) {
        match &self.row_seeds {
            Some(seeds) => (seeds[r], 0),
            None => (self.seed, self.row_offset.wrapping_add(r as u32)),
        }
    }

    /// Decode step of row `r`'s noise (counter word 3).
    pub fn step(&self, r: usize) -> u32 {
        self.row_steps.as_ref().map_or(0, |s| s[r])
    }
}

pub fn encode(dtype: DType, x: f32) -> Vec<u8> {
    match dtype {
        DType::BF16 => half::bf16::from_f32(x).to_bits().to_le_bytes().to_vec(),
        DType::F16 => half::f16::from_f32(x).to_bits().to_le_bytes().to_vec(),
        DType::F32 => x.to_le_bytes().to_vec(),
    }
}

pub fn weight(inp: &Inputs, v: usize, d: usize) -> f32 {
    let size = inp.dtype.size_bytes();
    let at = (v * inp.dim + d) * size;
    let bytes = &inp.weights[at..at + size];
    match inp.dtype {
        DType::BF16 => half::bf16::from_bits(u16::from_le_bytes([bytes[0], bytes[1]])).to_f32(),
        DType::F16 => half::f16::from_bits(u16::from_le_bytes([bytes[0], bytes[1]])).to_f32(),
        DType::F32 => f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
    }
}

pub fn raw_logit(inp: &Inputs, r: usize, v: usize) -> f32 {
    (0..inp.dim).fold(0.0f32, |acc, d| inp.hidden[r * inp.dim + d].mul_add(weight(inp, v, d), acc))
}

/// The transformed logit `x` of DESIGN.md step 3.
pub fn transformed(p: &Pipeline, inp: &Inputs, r: usize, v: usize, raw: f32) -> f32 {
    let mut x = raw;
    for t in &p.transforms {
        match t {
            Transform::Temperature(_) => {
                let t = inp.temperatures[r];
                if t != 0.0 {
                    x *= 1.0f32 / t;
                }
            }
            Transform::Bias { .. } => x += inp.bias.as_ref().unwrap()[v],
            Transform::Softcap { cap } => x = softcap_f32(x, cap.get()),
            Transform::Penalties { .. } => x = inp.penalties.as_ref().unwrap().apply(r, v as u32, x),
            Transform::LogitBias { .. } => x = inp.logit_bias.as_ref().unwrap().apply(r, v as u32, x),
            Transform::Mask { .. } | Transform::Ban { .. } | Transform::Filter { .. } => {}
        }
    }
    x
}

pub fn is_allowed(inp: &Inputs, r: usize, v: usize) -> bool {
    match &inp.allowed {
        None => true,
        Some(bits) => bits[r * inp.vocab.div_ceil(32) + v / 32] >> (v % 32) & 1 == 1,
    }
}

pub fn is_greedy(p: &Pipeline, inp: &Inputs, r: usize) -> bool {
    matches!(p.sampler, Sampler::Argmax) || (p.temperature().is_some() && inp.temperatures[r] == 0.0)
}

/// Whether row `r`'s candidates are its argmax: greedy, or drawn in stage three (DESIGN.md
/// step 5).
pub fn takes_argmax(p: &Pipeline, inp: &Inputs, r: usize) -> bool {
    let greedy = is_greedy(p, inp, r);
    greedy || inp.filters.as_ref().is_some_and(|f| f[r].is_drawn_in_stage_three(greedy))
}

pub fn score(p: &Pipeline, inp: &Inputs, r: usize, s: usize, v: usize, x: f32) -> f32 {
    if takes_argmax(p, inp, r) {
        x
    } else {
        let (key, ctr_row) = inp.stream(r);
        x + gumbel_f32(noise_bits(key, ctr_row, s as u32, v as u32 + inp.vocab_offset, inp.step(r)))
    }
}

/// What the model says one tile of one row holds.
#[derive(Clone, Debug)]
pub struct TileModel {
    pub nonfinite: bool,
    /// `(v, x, allowed)` per token of the tile.
    pub tokens: Vec<(usize, f32, bool)>,
    pub lse: LsePartial,
}

pub fn tile_model(p: &Pipeline, inp: &Inputs, tile_size: usize, r: usize, tile: usize) -> TileModel {
    let begin = tile * tile_size;
    let end = (begin + tile_size).min(inp.vocab);
    let mut nonfinite = false;
    let mut tokens = Vec::new();
    for v in begin..end {
        let raw = raw_logit(inp, r, v);
        nonfinite |= !raw.is_finite();
        tokens.push((v, transformed(p, inp, r, v, raw), is_allowed(inp, r, v)));
    }
    let mut lse = LsePartial::EMPTY;
    tokens.iter().filter(|t| t.2).for_each(|t| lse.add(t.1));
    TileModel { nonfinite, tokens, lse }
}

/// The model's candidate for (row, sample) of a tile: DESIGN.md step 6.
pub fn model_candidate(p: &Pipeline, inp: &Inputs, t: &TileModel, r: usize, s: usize) -> Candidate {
    let mut best = Candidate { score: f32::NEG_INFINITY, index: INDEX_NONE, logit: f32::NEG_INFINITY };
    for &(v, x, allowed) in &t.tokens {
        let sc = score(p, inp, r, s, v, x);
        if allowed && sc > best.score {
            best = Candidate { score: sc, index: v as u32, logit: x };
        }
    }
    if t.nonfinite {
        best.index = INDEX_NONFINITE;
    }
    best
}

pub const POISON_INDEX: u32 = 0xDEAD_BEEF;

/// The model's top list of a tile (DESIGN.md step 6b).
pub fn model_list(t: &TileModel, per_tile: usize) -> Vec<Scored> {
    let mut list = vec![Scored::EMPTY; per_tile];
    for &(v, x, allowed) in &t.tokens {
        if allowed && x > f32::NEG_INFINITY {
            flashsample_abi::filter::insert(&mut list, Scored { logit: x, index: v as u32 });
        }
    }
    list
}

/// Runs the kernel with poisoned output buffers.
pub fn run(kernel: &CpuKernel, p: &Pipeline, inp: &Inputs) -> (Vec<Candidate>, Option<Vec<LsePartial>>) {
    let (c, l, _) = run_with_lists(kernel, p, inp);
    (c, l)
}

/// [`run`], also returning the top lists when the pipeline has them.
pub fn run_with_lists(kernel: &CpuKernel, p: &Pipeline, inp: &Inputs) -> (Vec<Candidate>, Option<Vec<LsePartial>>, Option<Vec<Scored>>) {
    let tiles = kernel.tiles(inp.vocab);
    let layout = StageTwo { batch: inp.batch, samples: p.samples_per_row() as usize, tiles };
    let mut cands = vec![Candidate { score: f32::NAN, index: POISON_INDEX, logit: f32::NAN }; layout.candidate_count()];
    let mut lse = p.needs_logsumexp().then(|| vec![LsePartial { sums: [u64::MAX; 3], window: 7, pad: 0 }; inp.batch * tiles]);
    let per_tile = p.list_capacity() as usize;
    let mut lists = (per_tile > 0).then(|| vec![Scored::EMPTY; inp.batch * tiles * per_tile]);
    kernel
        .launch(CpuLaunch { targets: None, ranks: None, vocab_tiles: None, residual: None, raw: None, capture: None,
            hidden: &inp.hidden,
            weights: &inp.weights,
            batch: inp.batch,
            dim: inp.dim,
            vocab: inp.vocab,
            temperatures: &inp.temperatures,
            filters: inp.filters.as_deref(),
            bias: inp.bias.as_deref(),
            allowed: inp.allowed.as_deref(),
            seed: inp.seed,
            row_seeds: inp.row_seeds.as_deref(),
            row_steps: inp.row_steps.as_deref(),
            vocab_offset: inp.vocab_offset,
            row_offset: inp.row_offset,
            penalties: inp.penalties.as_ref(),
            logit_bias: inp.logit_bias.as_ref(),
            lists: lists.as_deref_mut(),
            candidates: &mut cands,
            lse: lse.as_deref_mut(),
        })
        .expect("launch");
    (cands, lse, lists)
}

/// How far the kernel's f32 dot product may drift from the model's sequential one.
pub fn tolerance(inp: &Inputs, x: f32) -> f32 {
    2e-5 * (inp.dim as f32 + 4.0) * (1.0 + x.abs())
}

/// Checks every candidate and lse partial against the model. `exact`: scores, logits and
/// indices must match bit for bit (for inputs where every product and sum is exact).
pub fn check(kernel: &CpuKernel, p: &Pipeline, inp: &Inputs, exact: bool) {
    let tile_size = kernel.config().vocab_tile as usize;
    let (cands, lse, lists) = run_with_lists(kernel, p, inp);
    let per_tile = p.list_capacity() as usize;
    let tiles = kernel.tiles(inp.vocab);
    let samples = p.samples_per_row() as usize;
    let layout = StageTwo { batch: inp.batch, samples, tiles };
    let ctx = |r: usize, s: usize, t: usize| format!("{} {:?} B={} D={} V={} row {r} sample {s} tile {t}", p, kernel.config(), inp.batch, inp.dim, inp.vocab);
    for r in 0..inp.batch {
        for t in 0..tiles {
            let tm = tile_model(p, inp, tile_size, r, t);
            for s in 0..samples {
                let got = cands[layout.slot(r, s, t)];
                let want = model_candidate(p, inp, &tm, r, s);
                if want.index == INDEX_NONFINITE || want.index == INDEX_NONE {
                    assert_eq!(got.index, want.index, "{}: got {got:?}", ctx(r, s, t));
                    continue;
                }
                assert!(got.index != INDEX_NONE && got.index != INDEX_NONFINITE && got.index != POISON_INDEX,
                    "{}: got {got:?}, want {want:?}", ctx(r, s, t));
                if exact {
                    assert_eq!(
                        (got.index, got.score.to_bits(), got.logit.to_bits()),
                        (want.index, want.score.to_bits(), want.logit.to_bits()),
                        "{}: got {got:?}, want {want:?}", ctx(r, s, t)
                    );
                    continue;
                }
                let tol = tolerance(inp, want.score);
                assert!((got.score - want.score).abs() <= tol, "{}: got {got:?}, want {want:?}", ctx(r, s, t));
                if got.index != want.index {
                    // A near-tie: the kernel's token must score (in the model) within tolerance of the best.
                    let &(v, x, allowed) = tm.tokens.iter().find(|tok| tok.0 == got.index as usize)
                        .unwrap_or_else(|| panic!("{}: index {} outside the tile", ctx(r, s, t), got.index));
                    let alt = score(p, inp, r, s, v, x);
                    assert!(allowed && (alt - want.score).abs() <= 2.0 * tol,
                        "{}: got {got:?}, want {want:?} (model score of got {alt})", ctx(r, s, t));
                    assert!((got.logit - x).abs() <= tol, "{}: got {got:?}, model logit {x}", ctx(r, s, t));
                } else {
                    assert!((got.logit - want.logit).abs() <= tolerance(inp, want.logit), "{}: got {got:?}, want {want:?}", ctx(r, s, t));
                }
            }
            if let (Some(lists), false) = (&lists, tm.nonfinite) {
                let got = &lists[(r * tiles + t) * per_tile..][..per_tile];
                let want = model_list(&tm, per_tile);
                for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                    if exact {
                        assert_eq!((g.index, g.logit.to_bits()), (w.index, w.logit.to_bits()), "list {} slot {j}: {got:?} vs {want:?}", ctx(r, 0, t));
                    } else {
                        assert_eq!(g.is_empty(), w.is_empty(), "list {} slot {j}: {got:?} vs {want:?}", ctx(r, 0, t));
                        if !w.is_empty() {
                            assert!((g.logit - w.logit).abs() <= tolerance(inp, w.logit), "list {} slot {j}: {got:?} vs {want:?}", ctx(r, 0, t));
                        }
                    }
                }
            }
            if let Some(lse) = &lse {
                let got = lse[r * tiles + t];
                let want = tm.lse;
                if tm.nonfinite {
                    continue;
                }
                if exact || want == LsePartial::EMPTY {
                    // The partial is an exact integer sum: equal logits give equal bits.
                    assert_eq!(got, want, "lse {}", ctx(r, 0, t));
                } else {
                    let (g, w) = (LseSum::of(&[got]).logsumexp() as f64, LseSum::of(&[want]).logsumexp() as f64);
                    let tol = tolerance(inp, w as f32) as f64 + 1e-5 * (1.0 + w.abs());
                    assert!((g - w).abs() <= tol, "lse {}: got {got:?}, want {want:?}", ctx(r, 0, t));
                }
            }
        }
    }
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// Random inputs for a pipeline: values in [-1, 1], temperatures in {0, 0.5, 1, 1.7}
/// (0 only with a temperature transform), ~30 % banned tokens and ~10 % -inf bias.
pub fn random_inputs(p: &Pipeline, rng: &mut StdRng, batch: usize, dim: usize, vocab: usize) -> Inputs {
    let dtype = p.weights.dtype;
    let hidden = (0..batch * dim).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let weights = (0..vocab * dim).flat_map(|_| encode(dtype, rng.random_range(-1.0f32..1.0))).collect();
    let temperatures = (0..batch)
        .map(|_| if p.temperature().is_some() { [0.0, 0.5, 1.0, 1.7][rng.random_range(0..4)] } else { 1.0 })
        .collect();
    let bias = p.has_bias().then(|| {
        (0..vocab).map(|_| if rng.random_bool(0.1) { f32::NEG_INFINITY } else { rng.random_range(-2.0f32..2.0) }).collect()
    });
    let allowed = p.has_mask().then(|| {
        let words = vocab.div_ceil(32);
        let mut bits = vec![0u32; batch * words];
        for r in 0..batch {
            for v in 0..vocab {
                if rng.random_bool(0.7) {
                    bits[r * words + v / 32] |= 1 << (v % 32);
                }
            }
        }
        bits
    });
    let penalties = p.has_penalties().then(|| {
        let history: Vec<Vec<(u32, u32)>> = (0..batch)
            .map(|_| (0..rng.random_range(0..8)).map(|_| (rng.random_range(0..vocab as u32), rng.random_range(0..3))).collect())
            .collect();
        let repetition: Vec<f32> = (0..batch).map(|_| rng.random_range(1.0f32..2.0)).collect();
        let presence: Vec<f32> = (0..batch).map(|_| rng.random_range(0.0f32..1.0)).collect();
        let frequency: Vec<f32> = (0..batch).map(|_| rng.random_range(0.0f32..0.5)).collect();
        let arg = flashsample_abi::PenaltyArg { repetition: &repetition, presence: &presence, frequency: &frequency, history: &history };
        flashsample_abi::SamplingParams { penalties: Some(arg), ..Default::default() }
            .penalty_table(batch, vocab)
            .expect("penalties given")
    });
    // Some rows without a bias, some tokens banned (-inf), some biases large enough to move the argmax.
    let logit_bias = p.has_logit_bias().then(|| {
        let rows: Vec<Vec<(u32, f32)>> = (0..batch)
            .map(|_| {
                let mut tokens: Vec<u32> = (0..rng.random_range(0..6)).map(|_| rng.random_range(0..vocab as u32)).collect();
                tokens.sort_unstable();
                tokens.dedup();
                let value = |rng: &mut StdRng| match rng.random_range(0..4) {
                    0 => f32::NEG_INFINITY,
                    1 => rng.random_range(5.0f32..20.0),
                    _ => rng.random_range(-3.0f32..3.0),
                };
                tokens.into_iter().map(|t| (t, value(rng))).collect()
            })
            .collect();
        flashsample_abi::SamplingParams { logit_bias: Some(&rows), ..Default::default() }
            .logit_bias_table(batch, vocab)
            .expect("logit bias given")
    });
    let row_seeds = rng.random_bool(0.5).then(|| (0..batch).map(|_| rng.random()).collect());
    let row_steps = rng.random_bool(0.5).then(|| (0..batch).map(|_| rng.random()).collect());
    let vocab_offset = 4 * rng.random_range(0..1000u32);
    let row_offset = if rng.random_bool(0.5) { rng.random_range(0..100_000u32) } else { 0 };
    let seed = rng.random();
    // Drawn last, so the other inputs of a pipeline without a filter stay what they were.
    let filters = p.filter_max_k().map(|max_k| {
        (0..batch)
            .map(|_| match rng.random_range(0..4) {
                0 => RowFilter::OFF,
                1 => RowFilter::top_k(rng.random_range(1..=max_k)),
                2 => RowFilter::top_p(rng.random_range(0.5f32..0.99)),
                _ => RowFilter { min_p: 0.1, ..RowFilter::top_k(max_k) },
            })
            .collect()
    });
    Inputs { batch, dim, vocab, dtype, hidden, weights, temperatures, bias, allowed, seed, row_seeds, row_steps, vocab_offset, row_offset, penalties, logit_bias, filters }
}

pub fn compile(p: &Pipeline, vocab_tile: u32, row_block: u32, threads: usize) -> CpuKernel {
    compile_on(p, CpuEngine::Cranelift, vocab_tile, row_block, threads)
}

/// A kernel whose every tile's candidate is its own best token ([`NoiseSkip::InTile`]), which
/// [`check`] holds to the model tile by tile.
pub fn compile_on(p: &Pipeline, engine: CpuEngine, vocab_tile: u32, row_block: u32, threads: usize) -> CpuKernel {
    compile_with_skip(p, engine, vocab_tile, row_block, threads, NoiseSkip::InTile)
}

pub fn compile_with_skip(p: &Pipeline, engine: CpuEngine, vocab_tile: u32, row_block: u32, threads: usize, noise_skip: NoiseSkip) -> CpuKernel {
    CpuKernel::compile(p, &CpuConfig { vocab_tile, row_block, threads, engine, noise_skip }).expect("compile")
}
