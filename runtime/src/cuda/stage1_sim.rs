//! Tests of stage one's epilogue without a GPU, on the SIMT schedule's LLVM IR interpreted on
//! the host ([`super::ir_sim`]): every (row, tile)'s candidate, exact logsumexp partial, top
//! list and a verifier's residual list equal a host model of the same f32 logits (one fma per
//! k, ascending, then the pipeline's transforms as `abi` defines them) bit for bit — the
//! epilogue's phases (transforms, per-pair noise parameters, the partial's scratch, the lists
//! and the logits read back from their tile, the selection) checked on the code every schedule
//! shares; with the cross-tile row bounds on, every row's winner is unchanged.

use super::ir_sim::{Memory, Module};
use flashsample_abi::filter::{merge_row, whole_row, Scored};
use flashsample_abi::lse::LsePartial;
use flashsample_abi::math::softcap_f32;
use flashsample_abi::rng::{gumbel_f32, noise_bits};
use flashsample_abi::speculative::{insert_residual, residual_bits, RESIDUAL_EMPTY};
use flashsample_abi::{Candidate, PenaltyArg, RowFilter, SamplingParams, TemperatureArg, INDEX_NONE, INDEX_NONFINITE};
use flashsample_codegen_ptx::{
    captures_logits, target_logits_rows_per_cta, GpuConfig, Grid, NoiseSkip, ParamKind, Schedule, STAGE1, TARGET_LOGITS_KERNEL, TARGET_LOGITS_THREADS,
};

/// Capture slots of the simulated plan (`R`).
const CAPTURE_ROWS: usize = 2;
use flashsample_ir::{DType, Outputs, Pipeline, PipelineBuilder, Transform};
use std::collections::HashMap;

fn bytes<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

/// Stage one's kernel of `p` on the SIMT tile and the helpers it calls, parsed, with its
/// dynamic shared memory.
fn stage_one_module(p: &Pipeline, c: &GpuConfig, mem: &mut Memory) -> Module {
    let ir = flashsample_codegen_ptx::llvm_ir(p, c).unwrap();
    let globals: HashMap<String, u64> = [("@fs_smem".to_string(), mem.add(vec![0; c.smem_bytes() as usize]))].into();
    let kernels: &[&str] = if p.ranks_targets() { &[STAGE1.kernel, TARGET_LOGITS_KERNEL] } else { &[STAGE1.kernel] };
    Module::with_callees(&ir, kernels, &globals)
}

/// What one interpreted stage-one launch wrote: candidates, logsumexp partials, lists, and the
/// captured rows' logits (row, `x`).
type Run = (Vec<Candidate>, Vec<LsePartial>, Vec<Scored>, Vec<(usize, Vec<f32>)>);

/// One interpreted stage-one launch: its candidates, logsumexp partials and lists.
struct Launch<'a> {
    p: &'a Pipeline,
    c: GpuConfig,
    hidden: &'a [f32],
    weights: &'a [f32],
    params: &'a SamplingParams<'a>,
    batch: usize,
    dim: usize,
    vocab: usize,
    row_base: u32,
}

impl Launch<'_> {
    /// With `skip`'s noise skips (and, where it reads them, zeroed row bounds). A pipeline
    /// whose stage one captures logits for the nucleus kernels gets a capture of
    /// [`CAPTURE_ROWS`] slots, which its first rows whose filter may outgrow the lists take in
    /// row order (`nucleus::capture_slot`); their logits come back last.
    fn run(&self, skip: NoiseSkip) -> Run {
        let (_, mem, bufs, _) = self.launch(skip, &[], 0);
        let read = |name: &str| mem.bufs[(bufs[name] >> 40) as usize - 1].clone();
        let captured: Vec<usize> = match self.params.filter {
            Some(filters) if captures_logits(self.p) => (0..self.batch).filter(|&r| filters[r].may_outgrow_lists()).take(CAPTURE_ROWS).collect(),
            _ => Vec::new(),
        };
        let vocab = self.vocab;
        let capture: Vec<(usize, Vec<f32>)> = captured
            .iter()
            .enumerate()
            .map(|(slot, &r)| (r, bytemuck::pod_collect_to_vec(&read("capture")[slot * vocab * 4..][..vocab * 4])))
            .collect();
        (bytemuck::pod_collect_to_vec(&read("candidates")), bytemuck::pod_collect_to_vec(&read("lse")), bytemuck::pod_collect_to_vec(&read("lists")), capture)
    }

    /// A verifying launch's residual lists against the host model: per (draft row, tile) the
    /// `residual_per_tile` best tokens by `x + G_res` (`abi::speculative::residual_bits`),
    /// sorted as `insert_residual` sorts them; a bonus row's (launch row `≡ spec_period − 1`
    /// mod `spec_period`; none when it is 0) left as they were.
    fn check_residual_lists(&self, spec_period: u32) {
        let (_, mem, bufs, _) = self.launch(NoiseSkip::Never, &[], spec_period);
        let got: Vec<Candidate> = bytemuck::pod_collect_to_vec(&mem.bufs[(bufs["residual_lists"] >> 40) as usize - 1]);
        let (vt, per_tile, tiles) = (self.c.vocab_tile as usize, self.c.residual_per_tile as usize, self.c.tiles(self.vocab));
        let x = self.logits();
        let mut listed = 0;
        for r in 0..self.batch {
            let (key, ctr) = (self.params.seed, self.row_base + r as u32);
            if spec_period > 0 && ctr % spec_period == spec_period - 1 {
                let bytes: &[u8] = bytemuck::cast_slice(&got[r * tiles * per_tile..][..tiles * per_tile]);
                assert!(bytes.iter().all(|&b| b == 0xab), "row {r}: a bonus row's residual lists were written");
                continue;
            }
            for t in 0..tiles {
                let mut want = vec![RESIDUAL_EMPTY; per_tile];
                for (v, &xv) in x[r].iter().enumerate().take(((t + 1) * vt).min(self.vocab)).skip(t * vt) {
                    // An excluded token's score (-inf) goes before no entry: it is never listed.
                    let score = xv + gumbel_f32(residual_bits(key, ctr, v as u32, 0));
                    insert_residual(&mut want, Candidate { score, index: v as u32, logit: xv });
                }
                for (k, (g, w)) in got[(r * tiles + t) * per_tile..][..per_tile].iter().zip(&want).enumerate() {
                    assert_eq!((g.index, g.score.to_bits(), g.logit.to_bits()), (w.index, w.score.to_bits(), w.logit.to_bits()), "row {r} tile {t}: residual entry {k}");
                    listed += usize::from(g.index != INDEX_NONE);
                }
            }
        }
        assert!(listed > 0, "no residual entry was written");
    }

    /// DESIGN.md step 6b's list bounds: the same launch with zeroed `list_bounds` (the CTAs
    /// run one after another, so later tiles read the earlier ones' bounds) writes the same
    /// candidates, every row's merged top (what stage three reads) is the unbounded launch's,
    /// and the bound did cut: fewer entries are listed.
    fn check_list_bounds(&self) {
        let groups = flashsample_codegen_ptx::list_bound_groups(self.p, &self.c).expect("a config whose lists are shorter than a tile");
        let need = flashsample_codegen_ptx::list_capacity(self.p) as usize;
        let run = |extra: &[(&str, Vec<u8>)]| {
            let (_, mem, bufs, _) = self.launch(NoiseSkip::Never, extra, 0);
            let read = |name: &str| mem.bufs[(bufs[name] >> 40) as usize - 1].clone();
            (bytemuck::pod_collect_to_vec::<u8, Candidate>(&read("candidates")), bytemuck::pod_collect_to_vec::<u8, Scored>(&read("lists")))
        };
        let (want_cands, want) = run(&[]);
        let (got_cands, got) = run(&[("list_bounds", vec![0; self.batch * groups as usize * 4])]);
        let bits = |c: &[Candidate]| c.iter().map(|c| (c.score.to_bits(), c.index, c.logit.to_bits())).collect::<Vec<_>>();
        assert_eq!(bits(&got_cands), bits(&want_cands), "the list bounds changed a candidate");
        let (per_tile, tiles) = (self.c.list_per_tile as usize, self.c.tiles(self.vocab));
        let row_len = tiles * per_tile;
        for r in 0..self.batch {
            let merged = |lists: &[Scored]| merge_row(&lists[r * row_len..][..row_len], per_tile, need, r);
            assert_eq!(merged(&got), merged(&want), "row {r}: the merged top lists differ");
        }
        let listed = |lists: &[Scored]| lists.iter().filter(|s| !s.is_empty()).count();
        assert!(listed(&got) < listed(&want), "the list bounds cut nothing ({} entries)", listed(&want));
    }

    /// DESIGN.md step 7c: a launch scoring `targets` without ranks (stage one stores their
    /// logits into `target_logprobs`), then one with ranks (`flashsample_target_logits` stores
    /// them, stage one counts against them), which must write the same candidates, partials,
    /// lists and target logits, bit for bit; the target logits and the ranks.
    fn run_ranks(&self, targets: &[u32]) -> (Vec<f32>, Vec<u32>) {
        let read = |mem: &Memory, bufs: &HashMap<&str, u64>, b: &str| mem.bufs[(bufs[b] >> 40) as usize - 1].clone();
        let scored = [("targets", bytes(targets)), ("target_logprobs", bytes(&vec![f32::NAN; self.batch]))];
        let (_, mem, bufs, _) = self.launch(NoiseSkip::CrossTile, &scored, 0);
        let ranked: Vec<_> = scored.iter().cloned().chain([("target_ranks", bytes(&vec![0u32; self.batch]))]).collect();
        let (_, rmem, rbufs, _) = self.launch(NoiseSkip::CrossTile, &ranked, 0);
        for b in ["candidates", "lse", "lists", "target_logprobs"] {
            assert!(read(&mem, &bufs, b) == read(&rmem, &rbufs, b), "{b}: a ranking launch writes what one without ranks does");
        }
        let logits = bytemuck::pod_collect_to_vec(&read(&rmem, &rbufs, "target_logprobs"));
        (logits, bytemuck::pod_collect_to_vec(&read(&rmem, &rbufs, "target_ranks")))
    }

    /// One launch with `skip`, `extra` named buffers (with `target_ranks`: a launch that ranks
    /// its targets, `flashsample_target_logits` first) and `spec_period` (a verifying launch's draft/bonus row period; 0 = every row a draft
    /// row): its module, memory, the buffers' addresses and the arguments.
    fn launch<'n>(&self, skip: NoiseSkip, extra: &[(&'n str, Vec<u8>)], spec_period: u32) -> (Module, Memory, HashMap<&'n str, u64>, Vec<u64>) {
        let (p, params, batch, vocab) = (self.p, self.params, self.batch, self.vocab);
        let c = &self.c.clone().with_noise_skip(skip);
        let mut mem = Memory { bufs: Vec::new() };
        let m = stage_one_module(p, c, &mut mem);
        let tiles = c.tiles(vocab);
        let (per_tile, samples) = (c.list_per_tile as usize, p.samples_per_row() as usize);
        let mut bufs: HashMap<&str, u64> = HashMap::new();
        bufs.insert("hidden", mem.add(bytes(self.hidden)));
        bufs.insert("weights", mem.add(bytes(self.weights)));
        bufs.insert("temperatures", mem.add(bytes(&params.row_temperatures(p, batch))));
        if let Some(a) = params.allowed_bitset(batch, vocab) {
            bufs.insert("allowed", mem.add(bytes(&a)));
        }
        if let Some(t) = params.penalty_table(batch, vocab) {
            for (name, b) in [("pen_bits", bytes(&t.listed.bits)), ("pen_offsets", bytes(&t.listed.offsets)), ("pen_tokens", bytes(&t.listed.tokens))] {
                bufs.insert(name, mem.add(b));
            }
            bufs.insert("pen_subtract", mem.add(bytes(&t.subtract)));
            bufs.insert("pen_repetition", mem.add(bytes(&t.repetition)));
        }
        if let Some(t) = params.logit_bias_table(batch, vocab) {
            for (name, b) in [("lb_bits", bytes(&t.listed.bits)), ("lb_offsets", bytes(&t.listed.offsets)), ("lb_tokens", bytes(&t.listed.tokens))] {
                bufs.insert(name, mem.add(b));
            }
            bufs.insert("lb_values", mem.add(bytes(&t.values)));
        }
        if let Some(filters) = params.filter {
            bufs.insert("filters", mem.add(bytemuck::cast_slice(filters).to_vec()));
            if captures_logits(p) {
                bufs.insert("capture", mem.add(vec![0xab; CAPTURE_ROWS * vocab * 4]));
            }
        }
        bufs.insert("candidates", mem.add(vec![0xab; batch * samples * tiles * 12]));
        bufs.insert("lse", mem.add(vec![0xab; batch * tiles * 32]));
        bufs.insert("lists", mem.add(vec![0xab; batch * tiles * per_tile * 8]));
        if c.residual_per_tile > 0 {
            bufs.insert("residual_lists", mem.add(vec![0xab; batch * tiles * c.residual_per_tile as usize * 12]));
        }
        if skip.uses_row_bounds() {
            bufs.insert("row_bounds", mem.add(vec![0; batch * samples * 4]));
        }
        for (name, b) in extra {
            bufs.insert(name, mem.add(b.clone()));
        }
        let args: Vec<u64> = STAGE1
            .params
            .iter()
            .map(|q| match (q.name, q.kind) {
                (name, ParamKind::ConstPtr | ParamKind::MutPtr) => bufs.get(name).copied().unwrap_or(0),
                ("seed", _) => params.seed,
                ("batch", _) => batch as u64,
                ("dim", _) => self.dim as u64,
                ("vocab", _) => vocab as u64,
                ("row_base", _) => u64::from(self.row_base),
                ("capture_rows", _) => CAPTURE_ROWS as u64,
                ("spec_period", _) => u64::from(spec_period),
                _ => 0,
            })
            .collect();
        if bufs.contains_key("target_ranks") {
            let grid = (batch.div_ceil(target_logits_rows_per_cta(c) as usize) as u32, 1, 1);
            m.run_grid(TARGET_LOGITS_KERNEL, &args, grid, TARGET_LOGITS_THREADS as usize, &mut mem);
        }
        m.run_grid(STAGE1.kernel, &args, c.grid(batch, vocab, 132), c.block_threads() as usize, &mut mem);
        (m, mem, bufs, args)
    }

    /// Every row's transformed logits on the host (`[B][V]`): the SIMT multiply order, then
    /// the pipeline's transforms in order with `abi`'s f32 steps; `-inf` where masked.
    fn logits(&self) -> Vec<Vec<f32>> {
        let (p, params, dim, batch, vocab) = (self.p, self.params, self.dim, self.batch, self.vocab);
        let pen = params.penalty_table(batch, vocab);
        let lb = params.logit_bias_table(batch, vocab);
        let allowed = params.allowed_bitset(batch, vocab);
        let row = |r: usize| {
            (0..vocab)
                .map(|v| {
                    let mut x = (0..dim).fold(0.0f32, |a, k| self.hidden[r * dim + k].mul_add(self.weights[v * dim + k], a));
                    for t in &p.transforms {
                        match t {
                            Transform::Temperature(_) => {
                                let temp = params.row_temperature(p, r);
                                if temp != 0.0 {
                                    x *= 1.0 / temp;
                                }
                            }
                            Transform::Softcap { cap } => x = softcap_f32(x, cap.get()),
                            Transform::Penalties { .. } => x = pen.as_ref().unwrap().apply(r, v as u32, x),
                            Transform::LogitBias { .. } => x = lb.as_ref().unwrap().apply(r, v as u32, x),
                            _ => {}
                        }
                    }
                    let ok = allowed.as_ref().is_none_or(|a| a[r * vocab.div_ceil(32) + v / 32] >> (v % 32) & 1 == 1);
                    if ok { x } else { f32::NEG_INFINITY }
                })
                .collect()
        };
        (0..batch).map(row).collect()
    }

    /// Runs the launch and checks it against the host model: every noise skip within a tile
    /// keeps each tile's candidate, the cross-tile one each row's winner.
    fn check(&self) {
        let (cands, partials, lists, capture) = self.run(NoiseSkip::Never);
        let third_windows = self.check_tiles(&cands, &partials, &lists);
        assert!(third_windows * 2 > self.batch * self.c.tiles(self.vocab), "most partials fill all three windows: {third_windows}");
        let x = self.logits();
        for (r, got) in &capture {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(got), bits(&x[*r]), "row {r}: the captured logits are stage one's x");
        }
        if let Some(filters) = self.params.filter {
            let want = filters.iter().filter(|f| f.may_outgrow_lists()).count().min(CAPTURE_ROWS);
            assert_eq!(capture.len(), want, "captured rows");
        }
        let (in_tile, partials, lists, _) = self.run(NoiseSkip::InTile);
        self.check_tiles(&in_tile, &partials, &lists);
        // With the cross-tile bounds the skips may change a losing tile's candidate, never a
        // row's winner.
        let (bounded, _, _, _) = self.run(NoiseSkip::CrossTile);
        let (samples, tiles) = (self.p.samples_per_row() as usize, self.c.tiles(self.vocab));
        let winner = |c: &[Candidate], r: usize| {
            c[r * samples * tiles..][..tiles].iter().filter(|c| c.index != INDEX_NONE).fold(None::<Candidate>, |b, c| match b {
                Some(b) if b.score > c.score || (b.score == c.score && b.index < c.index) => Some(b),
                _ => Some(*c),
            })
        };
        for r in 0..self.batch {
            assert_eq!(winner(&bounded, r).map(|c| c.index), winner(&cands, r).map(|c| c.index), "row {r}: the winner with row bounds");
        }
    }

    /// Each tile's candidate, logsumexp partial and list against the host model; how many
    /// partials fill all three windows.
    fn check_tiles(&self, cands: &[Candidate], partials: &[LsePartial], lists: &[Scored]) -> usize {
        let (p, c, params, batch, vocab) = (self.p, &self.c, self.params, self.batch, self.vocab);
        let tiles = c.tiles(vocab);
        let (per_tile, samples) = (c.list_per_tile as usize, p.samples_per_row() as usize);
        let x = self.logits();
        let mut third_windows = 0;
        for r in 0..batch {
            // A verifying launch with `spec_period` 0: every row is a draft row, whose
            // candidate is its argmax; so is a row that stage three draws.
            let t_zero = params.row_temperature(p, r) == 0.0;
            let greedy = p.verify.is_some() || t_zero || params.row_filter(r).is_drawn_in_stage_three(t_zero);
            let (key, ctr) = (params.seed, self.row_base + r as u32);
            for t in 0..tiles {
                let mut best = Candidate { score: f32::NEG_INFINITY, index: INDEX_NONE, logit: f32::NEG_INFINITY };
                let mut partial = LsePartial::EMPTY;
                let mut scored = Vec::new();
                let first = t * c.vocab_tile as usize;
                for (v, &xv) in x[r].iter().enumerate().take(((t + 1) * c.vocab_tile as usize).min(vocab)).skip(first) {
                    partial.add(xv);
                    // DESIGN.md step 6b: lists hold the tokens with x > -inf.
                    if xv > f32::NEG_INFINITY {
                        scored.push(Scored { logit: xv, index: v as u32 });
                    }
                    let score = if greedy { xv } else { xv + gumbel_f32(noise_bits(key, ctr, 0, v as u32, 0)) };
                    if score > best.score {
                        best = Candidate { score, index: v as u32, logit: xv };
                    }
                }
                third_windows += usize::from(partial.sums[2] > 0);
                // DESIGN.md step 2: a non-finite product flags the tile.
                let raw = |v: usize| (0..self.dim).fold(0.0f32, |a, k| self.hidden[r * self.dim + k].mul_add(self.weights[v * self.dim + k], a));
                if (first..((t + 1) * c.vocab_tile as usize).min(vocab)).any(|v| !raw(v).is_finite()) {
                    best.index = INDEX_NONFINITE;
                }
                let got = cands[(r * samples) * tiles + t];
                assert_eq!((got.index, got.score.to_bits(), got.logit.to_bits()), (best.index, best.score.to_bits(), best.logit.to_bits()), "row {r} tile {t}: candidate");
                assert_eq!(partials[r * tiles + t], partial, "row {r} tile {t}: logsumexp partial");
                let top = whole_row(&scored);
                for (k, g) in lists[(r * tiles + t) * per_tile..][..per_tile].iter().enumerate() {
                    let w = top.get(k).copied().unwrap_or(Scored::EMPTY);
                    assert_eq!((g.index, g.logit.to_bits()), (w.index, w.logit.to_bits()), "row {r} tile {t}: list entry {k}");
                }
            }
        }
        third_windows
    }
}

/// Inputs with logits spread over ±100, so most tiles' partials fill all three windows.
fn inputs(batch: usize, dim: usize, vocab: usize) -> (Vec<f32>, Vec<f32>) {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut unit = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let hidden = (0..batch * dim).map(|_| 10.0 * unit()).collect();
    let weights = (0..vocab * dim).map(|_| 10.0 * unit()).collect();
    (hidden, weights)
}

fn simt(p: &Pipeline) -> GpuConfig {
    let mut c = GpuConfig::new(128, 8, 4, Schedule::Simt { grid: Grid::PerItem });
    c.fit_lists(p);
    c
}

#[test]
fn simt_stage_one_writes_the_host_models_candidates_partials_and_lists() {
    let (batch, dim, vocab) = (10usize, 8usize, 600usize);
    let p = PipelineBuilder::new("S1", DType::F32, DType::F32)
        .temperature_per_row("t")
        .filter("filter", 8)
        .gumbel("seed", 1)
        .outputs(Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 0 })
        .build()
        .unwrap();
    let (hidden, weights) = inputs(batch, dim, vocab);
    // A greedy row (T = 0) among sampled ones, and one whose `1 / T` takes `div.rn` (T past
    // `RECIP_FAST_END`, so the batch tile's reciprocals take the IEEE branch).
    let temperatures: Vec<f32> = (0..batch).map(|r| match r {
        3 => 0.0,
        8 => 3e19,
        r => 0.5 + 0.1 * r as f32,
    }).collect();
    // Rows 2, 6 and 7 on a lone top-p: stage one captures the first two rows' logits. Rows 1
    // and 4 on a top-k; the others unfiltered, so they draw noise (row 8 with its IEEE `1 / T`).
    let filters: Vec<RowFilter> = (0..batch)
        .map(|r| match r {
            2 | 6 | 7 => RowFilter::top_p(0.9),
            1 | 4 => RowFilter::top_k(8),
            _ => RowFilter::OFF,
        })
        .collect();
    let params = SamplingParams { temperature: TemperatureArg::PerRow(&temperatures), filter: Some(&filters), seed: 0x1234_5678_9abc_def0, ..Default::default() };
    // `row_base` 1000: a chunk's rows draw by their launch rows (`SamplingParams::row_offset`).
    Launch { p: &p, c: simt(&p), hidden: &hidden, weights: &weights, params: &params, batch, dim, vocab, row_base: 1000 }.check();
    // 256-token tiles: each lane's queue sorts 8 keys, among them equal logits (tokens 5 and
    // 6 of each lane's 8 copy tokens 1 and 2, and a lane's token 1 copies the previous lane's
    // token 6), which the lists take in index order.
    let mut wide = GpuConfig::new(256, 16, 4, Schedule::Simt { grid: Grid::PerItem });
    wide.fit_lists(&p);
    let mut tied = weights.clone();
    for v in 1..vocab {
        let from = match v % 8 {
            5 | 6 => v - 4,
            1 if v > 8 => v - 3,
            _ => continue,
        };
        tied.copy_within(from * dim..(from + 1) * dim, v * dim);
    }
    Launch { p: &p, c: wide, hidden: &hidden, weights: &tied, params: &params, batch, dim, vocab, row_base: 1000 }.check();
}

/// A SIMT tile whose threads hold 8 columns (batch tile 32), so the selection and the
/// logsumexp partials reduce them by the lanes' reduce-scatters (`scatter_columns`,
/// `lse::scatter_partial`), over two batch tiles, the second partly filled (its last n tiles
/// have no rows).
#[test]
fn simt_stage_one_with_eight_columns_per_thread_writes_the_host_models_candidates() {
    let (batch, dim, vocab) = (41usize, 8usize, 300usize);
    let p = PipelineBuilder::new("S1W", DType::F32, DType::F32)
        .temperature_per_row("t")
        .gumbel("seed", 1)
        .outputs(Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 0 })
        .build()
        .unwrap();
    let (hidden, weights) = inputs(batch, dim, vocab);
    let temperatures: Vec<f32> = (0..batch).map(|r| if r % 9 == 4 { 0.0 } else { 0.5 + 0.03 * r as f32 }).collect();
    let params = SamplingParams { temperature: TemperatureArg::PerRow(&temperatures), seed: 0x0bad_cafe_1234_5678, ..Default::default() };
    let c = GpuConfig::new(128, 32, 4, Schedule::Simt { grid: Grid::PerItem });
    Launch { p: &p, c, hidden: &hidden, weights: &weights, params: &params, batch, dim, vocab, row_base: 7 }.check();
}

/// The logsumexp partials at the edges of the term's arithmetic, bit for bit: logits on and one
/// ulp beside window boundaries (multiples of 16), zeros and subnormals, windows up to ±2¹⁸
/// (the fast terms' exact thresholds), past ±2²² (the exact terms' branch), columns with no
/// finite logit, and an infinite one; over both kinds of lse function (4 and 8 columns a thread).
#[test]
fn simt_logsumexp_partials_are_exact_at_window_edges_magnitudes_and_non_finite_logits() {
    let vocab = 256usize;
    let mut weights: Vec<f32> = Vec::with_capacity(vocab);
    for k in (-4..=4).filter(|&k| k != 0) {
        let edge = 16.0 * k as f32;
        weights.extend([edge, f32::from_bits(edge.to_bits() + 1), f32::from_bits(edge.to_bits().wrapping_sub(1)), -edge]);
    }
    weights.extend([0.0, -0.0, f32::from_bits(1), -f32::from_bits(1), f32::MIN_POSITIVE, -f32::MIN_POSITIVE, 1e-39, -1e-39]);
    // The rest spread over [-40, 40); tile 1 masked but for a few tokens, one of them +inf
    // (a non-finite product flags its tile, and the partial leaves it out).
    while weights.len() < vocab {
        weights.push(-40.0 + 80.0 * (weights.len() as f32 * 0.618_034).fract());
    }
    weights[200] = f32::INFINITY;
    // Row r's logits are `h_r · w` (D = 1, one exact product): windows near 0, up to ±2¹⁸,
    // past 2²², and subnormal logits.
    let scales = [1.0f32, 0.125, 262_144.0, -262_144.0, 4_194_304.0, -16_777_216.0, 2f32.powi(-140), -1.0];
    let batch = scales.len();
    // Without and with lists (the non-finite flags are stored before the list epilogue,
    // whose tile must leave them alone).
    let pipeline = |name: &str, lists: bool| {
        let b = PipelineBuilder::new(name, DType::F32, DType::F32).temperature_per_row("t").mask("allowed");
        let b = if lists { b.filter("filter", 8) } else { b };
        b.gumbel("seed", 1).outputs(Outputs { score: true, logsumexp: true, logprob: false, top_logprobs: 0 }).build().unwrap()
    };
    let (plain, filtered) = (pipeline("LseEdges", false), pipeline("LseEdgesListed", true));
    let filters = vec![RowFilter::top_k(8); batch];
    let temperatures = vec![1.0f32; batch];
    let words = vocab / 32;
    // Tile 1 (words 4..8) allows tokens 128 + 37·i + {0, 5} and 200; row 7 allows none of it.
    let mask: Vec<u32> = (0..batch * words)
        .map(|i| {
            let (r, w) = (i / words, i % words);
            if w < 4 {
                return u32::MAX;
            }
            let allowed = |v: usize| r != 7 && (v == 200 || matches!((v - 128) % 37, 0 | 5));
            (0..32).filter(|b| allowed(w * 32 + b)).fold(0, |m, b| m | 1 << b)
        })
        .collect();
    let params = SamplingParams { temperature: TemperatureArg::PerRow(&temperatures), mask: Some(&mask), seed: 0x1ed9e5, ..Default::default() };
    let with_filters = SamplingParams { filter: Some(&filters), ..params };
    for (p, params) in [(&plain, &params), (&filtered, &with_filters)] {
        for batch_tile in [8, 32] {
            let mut c = GpuConfig::new(128, batch_tile, 4, Schedule::Simt { grid: Grid::PerItem });
            c.fit_lists(p);
            let launch = Launch { p, c, hidden: &scales, weights: &weights, params, batch, dim: 1, vocab, row_base: 0 };
            let (cands, partials, lists, _) = launch.run(NoiseSkip::Never);
            launch.check_tiles(&cands, &partials, &lists);
        }
    }
}

/// Every per-token transform through `transform_token`: softcap, per-request logit bias,
/// penalties, temperature and a mask, in the pipeline's order.
#[test]
fn simt_stage_one_applies_every_transform_as_the_abi_does() {
    let (batch, dim, vocab) = (6usize, 8usize, 400usize);
    let p = PipelineBuilder::new("S1T", DType::F32, DType::F32)
        .softcap(40.0)
        .logit_bias("logit_bias")
        .penalties("penalties")
        .temperature_per_row("t")
        .mask("allowed")
        .filter("filter", 8)
        .gumbel("seed", 1)
        .outputs(Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 0 })
        .build()
        .unwrap();
    let (hidden, weights) = inputs(batch, dim, vocab);
    let temperatures: Vec<f32> = (0..batch).map(|r| 0.6 + 0.2 * r as f32).collect();
    let filters = vec![RowFilter::top_k(8); batch];
    let words = vocab.div_ceil(32);
    // Every row allows most tokens: word i of row r drops one bit.
    let mask: Vec<u32> = (0..batch * words).map(|i| !(1u32 << (i % 29))).collect();
    let logit_bias: Vec<Vec<(u32, f32)>> = (0..batch).map(|r| vec![(5 + r as u32, 7.5), (130 + r as u32, -3.0), (260, f32::NEG_INFINITY)]).collect();
    let history: Vec<Vec<(u32, u32)>> = (0..batch).map(|r| vec![(7, 2), (129 + r as u32, 0), (300, 1)]).collect();
    let repetition = vec![1.3f32; batch];
    let presence = vec![0.5f32; batch];
    let frequency = vec![0.25f32; batch];
    let params = SamplingParams {
        temperature: TemperatureArg::PerRow(&temperatures),
        filter: Some(&filters),
        mask: Some(&mask),
        logit_bias: Some(&logit_bias),
        penalties: Some(PenaltyArg { repetition: &repetition, presence: &presence, frequency: &frequency, history: &history }),
        seed: 0x0bad_5eed,
        ..Default::default()
    };
    params.validate(&p, batch, vocab).unwrap();
    Launch { p: &p, c: simt(&p), hidden: &hidden, weights: &weights, params: &params, batch, dim, vocab, row_base: 0 }.check();
}

/// DESIGN.md step 7c on the SIMT tile: `flashsample_target_logits` stores each target's
/// logit, bit for bit what stage one stores without ranks, and stage one counts every row's
/// tokens at least as likely (ties included, `-inf` only for an excluded target) against the
/// host model's logits, writing everything else as it does without ranks.
#[test]
fn simt_ranks_count_the_tokens_at_least_as_likely_as_the_target() {
    let (batch, dim, vocab) = (9usize, 8usize, 600usize);
    let p = PipelineBuilder::new("Rank", DType::F32, DType::F32)
        .temperature_per_row("t")
        .mask("allowed")
        .argmax()
        .target_logprob_and_rank("targets")
        .outputs(Outputs { score: false, logsumexp: true, logprob: false, top_logprobs: 0 })
        .build()
        .unwrap();
    let (hidden, mut weights) = inputs(batch, dim, vocab);
    // Tokens 200..205 share a weight row: tied logits in every row.
    let tied = weights[200 * dim..][..dim].to_vec();
    for v in 201..205 {
        weights[v * dim..][..dim].copy_from_slice(&tied);
    }
    let temperatures: Vec<f32> = (0..batch).map(|r| 0.5 + 0.1 * r as f32).collect();
    let words = vocab.div_ceil(32);
    let mut mask = vec![u32::MAX; batch * words];
    mask[words * 4 + 333 / 32] &= !(1 << (333 % 32));
    let params = SamplingParams { temperature: TemperatureArg::PerRow(&temperatures), mask: Some(&mask), ..Default::default() };
    let launch = Launch { p: &p, c: simt(&p), hidden: &hidden, weights: &weights, params: &params, batch, dim, vocab, row_base: 0 };
    let x = launch.logits();
    // Row 4 scores a masked token; rows 2 and 6 one of the tied ones; the rest spread out.
    let targets: Vec<u32> = (0..batch as u32).map(|r| match r {
        4 => 333,
        2 | 6 => 202,
        r => (r * 67 + 5) % vocab as u32,
    }).collect();
    let (logits, ranks) = launch.run_ranks(&targets);
    for r in 0..batch {
        let t = targets[r] as usize;
        assert_eq!(logits[r].to_bits(), x[r][t].to_bits(), "row {r}: the target's logit");
        let want = x[r].iter().filter(|&&y| y >= x[r][t]).count() as u32;
        assert_eq!(ranks[r], want, "row {r}: rank of token {t}");
    }
    assert_eq!(ranks[4], vocab as u32, "an excluded target ranks V");
    assert!(ranks[2] >= 5, "the five tied tokens count together: {}", ranks[2]);
}

/// A verifying pipeline's stage one (sampled drafts, with a filter, so it keeps both the lists
/// and the residual lists, and the epilogue reads its logits back from their tile): every row
/// a draft row (`spec_period` 0), so each tile's candidate is its argmax; partials and lists
/// as for any pipeline, and each tile's residual list as `abi::speculative` builds it.
#[test]
fn simt_stage_one_of_a_verifying_pipeline_writes_the_host_models_candidates_partials_and_lists() {
    let (batch, dim, vocab) = (8usize, 8usize, 600usize);
    let p = PipelineBuilder::new("S1V", DType::F32, DType::F32)
        .temperature_per_row("t")
        .filter("filter", 8)
        .verify_sampled("drafts", "draft_probs")
        .outputs(Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 0 })
        .build()
        .unwrap();
    let (hidden, weights) = inputs(batch, dim, vocab);
    let temperatures: Vec<f32> = (0..batch).map(|r| 0.5 + 0.1 * r as f32).collect();
    let filters = vec![RowFilter::top_k(8); batch];
    let params = SamplingParams { temperature: TemperatureArg::PerRow(&temperatures), filter: Some(&filters), seed: 0x5eed, ..Default::default() };
    let c = simt(&p);
    assert!(c.residual_per_tile > 0 && c.list_per_tile > 0);
    let launch = Launch { p: &p, c, hidden: &hidden, weights: &weights, params: &params, batch, dim, vocab, row_base: 0 };
    launch.check();
    launch.check_residual_lists(0);
    // Sequences of 3 rows (the third a bonus row, whose lists stay unwritten) from launch row
    // 4, and a launch of 6 rows in an 8-row batch tile: the warps' row pairs run past the launch.
    let batch = 6;
    let (hidden, weights) = inputs(batch, dim, vocab);
    let launch = Launch { p: &p, c: simt(&p), hidden: &hidden, weights: &weights, params: &params, batch, dim, vocab, row_base: 4 };
    launch.check_residual_lists(3);
}

/// The list bounds (stage-one parameter `list_bounds`) over many tiles: rows on a top-k, on a
/// lone top-p (whose nucleus stage three reads from the same merged top), greedy and
/// unfiltered rows, on the SIMT tile and on 256-token tiles (8 keys a lane).
#[test]
fn simt_list_bounds_keep_every_rows_merged_top_and_cut_the_rest() {
    let (batch, dim, vocab) = (6usize, 8usize, 4000usize);
    let p = PipelineBuilder::new("LB", DType::F32, DType::F32).temperature_per_row("t").filter("filter", 8).gumbel("seed", 1).build().unwrap();
    let (hidden, weights) = inputs(batch, dim, vocab);
    let temperatures: Vec<f32> = (0..batch).map(|r| if r == 3 { 0.0 } else { 0.6 + 0.1 * r as f32 }).collect();
    let filters: Vec<RowFilter> = (0..batch)
        .map(|r| match r % 3 {
            0 => RowFilter::top_k(8),
            1 => RowFilter::top_p(0.9),
            _ => RowFilter::OFF,
        })
        .collect();
    let params = SamplingParams { temperature: TemperatureArg::PerRow(&temperatures), filter: Some(&filters), seed: 7, ..Default::default() };
    let mut wide = GpuConfig::new(256, 16, 4, Schedule::Simt { grid: Grid::PerItem });
    wide.fit_lists(&p);
    for c in [simt(&p), wide] {
        Launch { p: &p, c, hidden: &hidden, weights: &weights, params: &params, batch, dim, vocab, row_base: 0 }.check_list_bounds();
    }
}

/// The list bound at its edge: tiles 0–7 each hold one high token (10, 9, .., 3; the rest of
/// the vocabulary is far below), so once they are published the row's bound is 3, the least
/// of the 8 groups' maxima, and tile 8 holds a token at 3.5 that the merged top 8 needs. A
/// bound above the least group maximum (any group left out of the minimum) drops it.
#[test]
fn simt_list_bounds_keep_a_late_token_just_above_the_bound() {
    let (batch, dim) = (3usize, 8usize);
    let p = PipelineBuilder::new("LBE", DType::F32, DType::F32).temperature_per_row("t").filter("filter", 8).gumbel("seed", 1).build().unwrap();
    let temperatures = vec![1.0f32; batch];
    let filters = vec![RowFilter::top_k(8); batch];
    let params = SamplingParams { temperature: TemperatureArg::PerRow(&temperatures), filter: Some(&filters), seed: 3, ..Default::default() };
    let hidden: Vec<f32> = (0..batch * dim).map(|i| if i % dim == 0 { 1.0 } else { 0.0 }).collect();
    for tile in [128usize, 256] {
        let vocab = tile * 12;
        let mut weights = vec![0.0f32; vocab * dim];
        for v in 0..vocab {
            let (t, o) = (v / tile, v % tile);
            weights[v * dim] = match (t, o) {
                (0..=7, 5) => 10.0 - t as f32,
                (8, 9) => 3.5,
                _ => -20.0 - (v % 7) as f32,
            };
        }
        let mut c = GpuConfig::new(tile as u32, 8, 4, Schedule::Simt { grid: Grid::PerItem });
        c.fit_lists(&p);
        Launch { p: &p, c, hidden: &hidden, weights: &weights, params: &params, batch, dim, vocab, row_base: 0 }.check_list_bounds();
    }
}
