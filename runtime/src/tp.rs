//! Tensor-parallel sampling: the LM head sharded by vocabulary across GPUs (column-parallel,
//! as Megatron and vLLM shard it), each rank running the fused sampler on its rows `[V_k, D]`,
//! and only a few bytes per row crossing GPUs (an NCCL all-gather).
//!
//! Why the merge is exact and pathwise: every rank launches with
//! `vocab_offset = first global token of its shard`, so token `g` gets the Gumbel noise of
//! global index `g` on whichever rank holds it. The TP = 1 sample is the argmax of
//! `x_g + G_g` over all tokens (ties to the lower index); the argmax over shards of each
//! shard's argmax (ties to the lower global index) is the same token. Greedy rows are the same
//! argmax without noise. So TP = 1 and TP = N return the same tokens for the same seed, given
//! bit-identical logits (the same dot products). This differs from [`crate::ShardedSampler`],
//! which indexes noise shard-locally and draws the shard by log-mass.
//!
//! Per (row, sample) a rank contributes its winner (perturbed score, global index, transformed
//! logit: [`Candidate`]) and per row its shard's logsumexp (when the pipeline returns a
//! logsumexp or logprobs); [`merge_summaries`] is the pure host-side merge, unit-tested
//! without GPUs, and [`summarize_shard`] is one rank's local work on any device.
//!
//! [`TensorParallelSampler`] runs one rank per GPU in one process: one worker thread per GPU
//! (a dedicated rayon pool of `world` threads; thread `i` always serves rank `i`, so a
//! communicator and its CUDA context stay with one thread), communicators from
//! `ncclCommInitAll`, collectives on each device's flashsample stream.
//!
//! # NCCL library
//! cudarc loads NCCL at run time (`dlopen`), trying the names of
//! `cudarc::get_lib_name_candidates("nccl")`: `libnccl.so`, `libnccl.so.12`, ... but not
//! `libnccl.so.2`, the name NVIDIA's packages and PyTorch's wheel ship
//! (`site-packages/nvidia/nccl/lib/libnccl.so.2`). Link it as `libnccl.so` in a directory on
//! `LD_LIBRARY_PATH` before the process starts (`scripts/nccl-env.sh` does this for PyTorch's
//! copy). Without a loadable library every constructor returns [`TpError::NoNccl`].
//!
//! Not supported yet: pipelines with candidate lists (a `filter` transform or
//! `top_logprobs`), which need the merged top lists and stage three on the host
//! ([`TpError::Unsupported`]).

use crate::{
    cuda::{CudaDevice, DeviceTensor},
    launch::check_operands,
    Device, Element, Error, PenaltyArg, Sampler, Samples, SamplingParams, Tensor,
};
use cudarc::driver::CudaSlice;
use cudarc::nccl::safe::Comm;
use flashsample_abi::{Candidate, RowError, StageTwo, INDEX_NONE};
use flashsample_ir::{Outputs, Pipeline};
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// Why tensor-parallel sampling could not run.
#[derive(Debug, thiserror::Error)]
pub enum TpError {
    /// No loadable NCCL library.
    #[error(
        "NCCL library not found (tried {searched:?}). PyTorch's wheel ships \
         site-packages/nvidia/nccl/lib/libnccl.so.2, a name cudarc does not try: symlink it as libnccl.so \
         in a directory on LD_LIBRARY_PATH before starting the process (scripts/nccl-env.sh)"
    )]
    NoNccl {
        /// The library names tried.
        searched: Vec<String>,
    },
    /// An NCCL call failed; names the call and NCCL's result code.
    #[error("NCCL {call} failed: {code}")]
    Nccl {
        /// The NCCL call.
        call: &'static str,
        /// Its result code.
        code: String,
    },
    /// A rank's own failure (its device, its inputs, a row error found on its shard).
    #[error("rank {rank}: {source}")]
    Rank {
        /// The rank.
        rank: usize,
        /// Its error.
        #[source]
        source: Error,
    },
    /// An error of the runtime outside any one rank.
    #[error(transparent)]
    Runtime(#[from] Error),
    /// A pipeline or parameter tensor parallelism does not support.
    #[error("tensor-parallel sampling does not support {0}")]
    Unsupported(String),
    /// Shards or devices that do not make a tensor-parallel sampler.
    #[error("bad tensor-parallel setup: {0}")]
    Setup(String),
}

fn nccl(call: &'static str) -> impl FnOnce(cudarc::nccl::result::NcclError) -> TpError {
    move |e| TpError::Nccl { call, code: format!("{:?}", e.0) }
}

use crate::cuda::drv;

/// Checks that libnccl can be loaded, before any cudarc NCCL call (which would panic).
#[cfg(feature = "dynamic-loading")]
fn require_nccl() -> Result<(), TpError> {
    // SAFETY: only tries to dlopen the library; nothing is called through it.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(TpError::NoNccl { searched: cudarc::get_lib_name_candidates("nccl") })
    }
}

/// Linked builds (`dynamic-linking`) cannot start without libnccl: nothing to check.
#[cfg(not(feature = "dynamic-loading"))]
fn require_nccl() -> Result<(), TpError> {
    Ok(())
}

/// The loaded NCCL's version `(major, minor, patch)`; [`TpError::NoNccl`] without the library.
pub fn nccl_version() -> Result<(u32, u32, u32), TpError> {
    require_nccl()?;
    let v = cudarc::nccl::result::get_nccl_version().map_err(nccl("ncclGetVersion"))?.max(0) as u32;
    // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
    Ok((v / 10000, v / 100 % 100, v % 100))
}

/// Balanced vocabulary shards for `world` ranks: contiguous, in order, every boundary a
/// multiple of `align` (rounded up to a multiple of 4, which `vocab_offset` requires); the last
/// shards may be shorter or empty-free by construction (fails only if `world` exceeds the
/// number of aligned blocks).
pub fn shard_ranges(vocab: usize, world: usize, align: usize) -> Result<Vec<Range<usize>>, TpError> {
    let align = align.max(4).next_multiple_of(4);
    if world == 0 {
        return Err(TpError::Setup("world size 0".into()));
    }
    let chunk = vocab.div_ceil(world).next_multiple_of(align);
    let ranges: Vec<Range<usize>> = (0..world).map(|k| (k * chunk).min(vocab)..((k + 1) * chunk).min(vocab)).collect();
    if ranges.iter().any(|r| r.is_empty()) {
        return Err(TpError::Setup(format!("{vocab} tokens in blocks of {align} cannot give {world} non-empty shards")));
    }
    Ok(ranges)
}

/// One rank's contribution for one launch.
#[derive(Clone, Debug, PartialEq)]
pub struct RankSummary {
    /// `[B * S]` winners with *global* token indices; `index == INDEX_NONE` where the shard has
    /// no allowed token for the row.
    pub winners: Vec<Candidate>,
    /// `[B]` logsumexp of the shard's allowed transformed logits (`-inf` if none), when the
    /// pipeline needs it (logsumexp or logprob output); empty otherwise.
    pub lse: Vec<f32>,
}

impl RankSummary {
    /// A rank none of whose tokens may be sampled for any row.
    pub fn empty(batch: usize, samples: usize, with_lse: bool) -> RankSummary {
        RankSummary {
            winners: vec![Candidate { score: f32::NEG_INFINITY, index: INDEX_NONE, logit: f32::NEG_INFINITY }; batch * samples],
            lse: if with_lse { vec![f32::NEG_INFINITY; batch] } else { Vec::new() },
        }
    }
}

/// Whether the merged result needs per-shard logsumexps.
fn wants_lse(outputs: &Outputs) -> bool {
    outputs.logsumexp || outputs.logprob
}

/// The pure merge: per (row, sample) the best winner over ranks (`StageTwo::beats`: higher
/// score, ties to the lower global index), per row `log Σ_k exp(lse_k)` (f64), logprob =
/// logit − merged logsumexp. `outputs` is the user pipeline's. A row with no winner on any rank
/// is [`RowError::AllMasked`].
pub fn merge_summaries(summaries: &[RankSummary], batch: usize, samples: usize, outputs: &Outputs) -> Result<Samples, RowError> {
    let with_lse = wants_lse(outputs);
    let mut tokens = Vec::with_capacity(batch * samples);
    let mut scores = Vec::with_capacity(batch * samples);
    let mut logits = Vec::with_capacity(batch * samples);
    let mut lse = Vec::with_capacity(if with_lse { batch } else { 0 });
    for row in 0..batch {
        for s in 0..samples {
            let i = row * samples + s;
            let mut best: Option<Candidate> = None;
            for c in summaries.iter().map(|r| r.winners[i]) {
                if c.index != INDEX_NONE && best.is_none_or(|b| StageTwo::beats(&c, &b)) {
                    best = Some(c);
                }
            }
            let best = best.ok_or(RowError::AllMasked { row })?;
            tokens.push(best.index);
            scores.push(best.score);
            logits.push(best.logit);
        }
        if with_lse {
            // `ln Σ_k exp(lse_k)` over the shards, in f64. (Shards exchange f32 logsumexps, not
            // exact sums, so this merge is not part of the batch-invariance guarantee.)
            let m = summaries.iter().map(|r| f64::from(r.lse[row])).fold(f64::NEG_INFINITY, f64::max);
            let merged = if m == f64::NEG_INFINITY {
                m
            } else {
                m + summaries.iter().map(|r| (f64::from(r.lse[row]) - m).exp()).sum::<f64>().ln()
            };
            lse.push(merged as f32);
        }
    }
    let logprobs = outputs.logprob.then(|| logits.iter().enumerate().map(|(i, l)| l - lse[i / samples]).collect());
    Ok(Samples {
        target_logprobs: None,
        target_ranks: None,
        batch,
        samples_per_row: samples,
        tokens,
        scores: outputs.score.then_some(scores),
        logsumexp: outputs.logsumexp.then_some(lse),
        logprobs,
        top_logprobs: None,
        row_errors: vec![None; batch],
        list_reruns: 0,
    })
}

/// The pipeline a rank runs: the user's, also returning what the merge needs (score; per-row
/// logsumexp and logprobs when the user wants either, from which the logit is recovered).
pub fn shard_pipeline(pipeline: &Pipeline) -> Result<Pipeline, TpError> {
    if pipeline.targets.is_some() {
        return Err(TpError::Unsupported(format!(
            "pipeline `{}`: scoring (`target_logprob`) needs the target's shard; score on one device",
            pipeline.name
        )));
    }
    if !pipeline.logprob_mode.is_processed() {
        return Err(TpError::Unsupported(format!(
            "pipeline `{}`: raw logprobs need each rank's raw logsumexp in the merge; use one device",
            pipeline.name
        )));
    }
    if pipeline.list_capacity() > 0 {
        return Err(TpError::Unsupported(format!(
            "pipeline `{}`: filters (top-k / top-p / min-p) and top_logprobs need merged candidate lists",
            pipeline.name
        )));
    }
    let mut local = pipeline.clone();
    let lse = wants_lse(&pipeline.outputs);
    local.outputs = Outputs { score: true, logsumexp: lse, logprob: lse, top_logprobs: 0 };
    Ok(local)
}

/// `len` bits of each row of a `[batch, words]` bitset starting at bit `offset`, as a
/// `[batch, ceil(len/32)]` bitset with the padding past `len` cleared. Word-wise: the
/// shard's bits are a shifted window of two global words.
fn window_bits(bits: &[u32], words: usize, batch: usize, offset: usize, len: usize) -> Vec<u32> {
    let local_words = len.div_ceil(32);
    let (w0, shift) = (offset / 32, offset % 32);
    let mut out = vec![0u32; batch * local_words];
    for row in 0..batch {
        let src = &bits[row * words..][..words];
        for j in 0..local_words {
            let lo = src[w0 + j] >> shift;
            let hi = if shift == 0 { 0 } else { src.get(w0 + j + 1).map_or(0, |w| w << (32 - shift)) };
            out[row * local_words + j] = lo | hi;
        }
        if !len.is_multiple_of(32) {
            out[row * local_words + local_words - 1] &= (1u32 << (len % 32)) - 1;
        }
    }
    out
}

/// A shard's view of the global launch parameters, with the storage its slices borrow.
struct ShardParams<'a> {
    global: &'a SamplingParams<'a>,
    /// Shard-local `[B, ceil(len/32)]` mask.
    mask: Option<Vec<u32>>,
    banned: Option<Vec<Vec<u32>>>,
    history: Option<Vec<Vec<(u32, u32)>>>,
    /// Shard-local per-request logit biases.
    logit_bias: Option<Vec<Vec<(u32, f32)>>>,
    offset: usize,
    len: usize,
    /// Per row: the shard has no token the row may sample (its result is discarded).
    empty: Vec<bool>,
    /// No row may sample any token of the shard (every bias is -inf): no launch at all.
    all_empty: bool,
}

impl<'a> ShardParams<'a> {
    fn new(global: &'a SamplingParams<'a>, batch: usize, vocab: usize, offset: usize, len: usize) -> ShardParams<'a> {
        let local_words = len.div_ceil(32);
        let mask = global.mask.map(|m| window_bits(m, vocab.div_ceil(32), batch, offset, len));
        let local = |t: u32| (t as usize).checked_sub(offset).filter(|&l| l < len).map(|l| l as u32);
        let banned: Option<Vec<Vec<u32>>> =
            global.banned.map(|lists| lists.iter().map(|l| l.iter().filter_map(|&t| local(t)).collect()).collect());
        let history = global.penalties.map(|p| {
            p.history.iter().map(|h| h.iter().filter_map(|&(t, n)| local(t).map(|l| (l, n))).collect()).collect()
        });
        let logit_bias = global.logit_bias.map(|rows| crate::sharded::shard_logit_bias(rows, offset, len));
        // Tokens a finite bias keeps (all of them without a bias), as a local bitset row.
        let mut keep = vec![u32::MAX; local_words];
        if !len.is_multiple_of(32) {
            keep[local_words - 1] = (1u32 << (len % 32)) - 1;
        }
        if let Some(b) = global.bias {
            for (i, &x) in b[offset..offset + len].iter().enumerate() {
                if x == f32::NEG_INFINITY {
                    keep[i / 32] &= !(1 << (i % 32));
                }
            }
        }
        let all_empty = keep.iter().all(|&w| w == 0);
        let mut empty = vec![all_empty; batch];
        if !all_empty && (mask.is_some() || banned.is_some() || logit_bias.is_some()) {
            let mut row_bits = vec![0u32; local_words];
            for (row, e) in empty.iter_mut().enumerate() {
                match &mask {
                    Some(m) => row_bits.copy_from_slice(&m[row * local_words..][..local_words]),
                    None => row_bits.fill(u32::MAX),
                }
                if let Some(b) = &banned {
                    for &t in &b[row] {
                        row_bits[t as usize / 32] &= !(1 << (t % 32));
                    }
                }
                if let Some(lb) = &logit_bias {
                    for &(t, _) in lb[row].iter().filter(|&&(_, b)| b == f32::NEG_INFINITY) {
                        row_bits[t as usize / 32] &= !(1 << (t % 32));
                    }
                }
                *e = row_bits.iter().zip(&keep).all(|(a, k)| a & k == 0);
            }
        }
        let mut p = ShardParams { global, mask, banned, history, logit_bias, offset, len, empty, all_empty };
        p.unmask_empty_rows(local_words);
        p
    }

    /// A row with nothing to sample on this shard would fail the whole launch
    /// (`RowError::AllMasked`), though other shards may hold its sample: let it sample
    /// anything the bias allows (at least one token, as the shard is not all-empty) and drop
    /// its result in [`summarize_shard`].
    fn unmask_empty_rows(&mut self, local_words: usize) {
        if self.all_empty {
            return;
        }
        for row in (0..self.empty.len()).filter(|&r| self.empty[r]) {
            if let Some(m) = self.mask.as_mut() {
                m[row * local_words..][..local_words].fill(u32::MAX);
                if !self.len.is_multiple_of(32) {
                    m[row * local_words + local_words - 1] = (1u32 << (self.len % 32)) - 1;
                }
            }
            if let Some(b) = self.banned.as_mut() {
                b[row].clear();
            }
            if let Some(lb) = self.logit_bias.as_mut() {
                lb[row].clear();
            }
        }
    }

    fn params(&self) -> Result<SamplingParams<'_>, Error> {
        let g = self.global;
        let vocab_offset = u32::try_from(self.offset)
            .ok()
            .and_then(|o| o.checked_add(g.vocab_offset))
            .ok_or(flashsample_abi::ParamError::VocabOffset { offset: g.vocab_offset, vocab: self.offset + self.len })?;
        Ok(SamplingParams {
            bias: g.bias.map(|b| &b[self.offset..self.offset + self.len]),
            mask: self.mask.as_deref(),
            banned: self.banned.as_deref(),
            logit_bias: self.logit_bias.as_deref(),
            penalties: match (g.penalties, &self.history) {
                (Some(p), Some(h)) => Some(PenaltyArg { history: h.as_slice(), ..p }),
                _ => None,
            },
            vocab_offset,
            ..*g
        })
    }
}

/// One rank's local work: samples its shard `[len, D]` (which starts at global token
/// `offset` of a `vocab`-token head) with `sampler`, whose pipeline must be
/// [`shard_pipeline`]`(user pipeline)`, and returns its summary. `params` are the global
/// launch parameters (bias `[V]`, mask `[B, ceil(V/32)]`, global token ids), validated against
/// the user pipeline and `vocab` by the caller.
pub fn summarize_shard(
    sampler: &Sampler,
    hidden: Tensor<'_>,
    shard: Tensor<'_>,
    params: &SamplingParams<'_>,
    offset: usize,
    vocab: usize,
) -> Result<RankSummary, Error> {
    let (batch, len) = (hidden.rows(), shard.rows());
    if offset + len > vocab || !offset.is_multiple_of(4) {
        return Err(Error::Shape(format!("shard [{offset}, {}) of a {vocab}-token vocabulary (offsets must be multiples of 4)", offset + len)));
    }
    let samples = sampler.pipeline().samples_per_row() as usize;
    let with_lse = sampler.pipeline().outputs.logsumexp;
    let local = ShardParams::new(params, batch, vocab, offset, len);
    if local.all_empty {
        return Ok(RankSummary::empty(batch, samples, with_lse));
    }
    let out = sampler.sample(hidden, shard, &local.params()?)?.into_complete()?;
    let lse_of = |row: usize| out.logsumexp.as_ref().map_or(f32::NEG_INFINITY, |l| l[row]);
    let mut summary = RankSummary { winners: Vec::with_capacity(batch * samples), lse: Vec::new() };
    for row in 0..batch {
        for s in 0..samples {
            let i = row * samples + s;
            summary.winners.push(if local.empty[row] {
                Candidate { score: f32::NEG_INFINITY, index: INDEX_NONE, logit: f32::NEG_INFINITY }
            } else {
                // The rank's logprob is logit - lse_k in f32, so this recovers the logit to
                // within an ulp of lse_k (exact for greedy rows' scores, which are logits).
                let logit = match &out.logprobs {
                    Some(lp) => lp[i] + lse_of(row),
                    None => f32::NAN,
                };
                Candidate { score: out.scores.as_ref().map_or(f32::NAN, |s| s[i]), index: out.tokens[i] + offset as u32, logit }
            });
        }
        if with_lse {
            summary.lse.push(if local.empty[row] { f32::NEG_INFINITY } else { lse_of(row) });
        }
    }
    Ok(summary)
}

/// Words of one rank's wire record: status, `B*S` candidates (3 words each), `B` lse words.
fn record_words(batch: usize, samples: usize) -> usize {
    1 + 3 * batch * samples + batch
}

const RECORD_OK: u32 = 0;
const RECORD_FAILED: u32 = 1;

/// A rank's record for the all-gather (`None`: the rank failed; it still takes part, so no
/// peer waits forever in the collective).
fn encode(summary: Option<&RankSummary>, batch: usize, samples: usize) -> Vec<u32> {
    let mut w = Vec::with_capacity(record_words(batch, samples));
    match summary {
        None => w.resize(record_words(batch, samples), 0),
        Some(s) => {
            w.push(RECORD_OK);
            for c in &s.winners {
                w.extend_from_slice(&[c.score.to_bits(), c.index, c.logit.to_bits()]);
            }
            w.extend(s.lse.iter().map(|x| x.to_bits()));
            w.resize(record_words(batch, samples), f32::NEG_INFINITY.to_bits());
        }
    }
    w[0] = if summary.is_some() { RECORD_OK } else { RECORD_FAILED };
    w
}

/// The summary in a rank's record, `None` if that rank failed.
fn decode(w: &[u32], batch: usize, samples: usize, with_lse: bool) -> Option<RankSummary> {
    if w[0] != RECORD_OK {
        return None;
    }
    let n = batch * samples;
    let winners = w[1..1 + 3 * n]
        .chunks_exact(3)
        .map(|c| Candidate { score: f32::from_bits(c[0]), index: c[1], logit: f32::from_bits(c[2]) })
        .collect();
    let lse = if with_lse { w[1 + 3 * n..][..batch].iter().map(|&x| f32::from_bits(x)).collect() } else { Vec::new() };
    Some(RankSummary { winners, lse })
}

/// `Comm` holds a raw `ncclComm_t`, so it is not `Send`. A communicator has no thread
/// affinity; NCCL only requires that one is not used by two threads at once, which the
/// `Mutex<Rank>` around it guarantees.
struct RankComm(Comm);
// SAFETY: see above; the communicator is only reached through `&mut Rank` under its mutex.
unsafe impl Send for RankComm {}

/// One GPU's state, owned by its worker thread's mutex.
struct Rank {
    rank: usize,
    sampler: Sampler,
    shard: DeviceTensor,
    device: Arc<CudaDevice>,
    comm: RankComm,
    send: Option<CudaSlice<u32>>,
    recv: Option<CudaSlice<u32>>,
}

impl Rank {
    /// All-gathers `words` from every rank (in rank order) on this device's stream.
    fn all_gather(&mut self, words: &[u32], world: usize) -> Result<Vec<u32>, TpError> {
        let dev = self.device.clone();
        let stream = dev.stream();
        let n = words.len();
        if self.send.as_ref().is_none_or(|b| b.len() < n) {
            // SAFETY: written by the copy below before NCCL reads it.
            self.send = Some(unsafe { stream.alloc::<u32>(n.next_power_of_two()) }.map_err(drv("cuMemAllocAsync"))?);
            self.recv = Some(unsafe { stream.alloc::<u32>(n.next_power_of_two() * world) }.map_err(drv("cuMemAllocAsync"))?);
        }
        let (Some(send), Some(recv)) = (self.send.as_mut(), self.recv.as_mut()) else {
            return Err(TpError::Setup("gather buffers missing".into()));
        };
        stream.memcpy_htod(words, &mut send.slice_mut(0..n)).map_err(drv("cuMemcpyHtoDAsync"))?;
        self.comm.0.all_gather(&send.slice(0..n), &mut recv.slice_mut(0..n * world)).map_err(nccl("ncclAllGather"))?;
        let mut out = vec![0u32; n * world];
        stream.memcpy_dtoh(&recv.slice(0..n * world), &mut out).map_err(drv("cuMemcpyDtoHAsync"))?;
        // `words` and `out` are pageable host memory the queued copies use until here.
        stream.synchronize().map_err(drv("cuStreamSynchronize after ncclAllGather"))?;
        Ok(out)
    }

    /// SPMD step: local sample, all-gather of the summaries, merge. Every rank gets the
    /// same samples (as every TP rank needs the token for the next step).
    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        user: &Pipeline,
        hidden: Tensor<'_>,
        params: &SamplingParams<'_>,
        offset: usize,
        vocab: usize,
        world: usize,
    ) -> Result<Samples, TpError> {
        let (batch, samples) = (hidden.rows(), user.samples_per_row() as usize);
        let local = summarize_shard(&self.sampler, hidden, Tensor::device(&self.shard), params, offset, vocab);
        let words = encode(local.as_ref().ok(), batch, samples);
        let gathered = self.all_gather(&words, world)?;
        let local = local.map_err(|source| TpError::Rank { rank: self.rank, source })?;
        let with_lse = wants_lse(&user.outputs);
        let mut all = Vec::with_capacity(world);
        for (k, rec) in gathered.chunks_exact(words.len()).enumerate() {
            if k == self.rank {
                all.push(local.clone());
                continue;
            }
            match decode(rec, batch, samples, with_lse) {
                Some(s) => all.push(s),
                None => return Err(PeerFailed(k).into()),
            }
        }
        merge_summaries(&all, batch, samples, &user.outputs).map_err(|e| TpError::Runtime(e.into()))
    }
}

/// Marker: another rank failed (its own error is the one to report).
struct PeerFailed(usize);

impl From<PeerFailed> for TpError {
    fn from(p: PeerFailed) -> TpError {
        TpError::Setup(format!("rank {} failed; see its error", p.0))
    }
}

/// Samples from a vocabulary-sharded LM head on several GPUs of this process (see the module
/// docs): rank `k` holds shard `k` (`shards` in vocabulary order, one per distinct GPU).
pub struct TensorParallelSampler {
    pipeline: Pipeline,
    ranks: Vec<Mutex<Rank>>,
    offsets: Vec<usize>,
    vocab: usize,
    dim: usize,
    /// One worker thread per rank.
    pool: rayon::ThreadPool,
}

impl TensorParallelSampler {
    /// Binds `shards[k]` (rows `[offsets[k], offsets[k] + V_k)` of the head; every shard but
    /// the last a multiple of 4 tokens) to rank `k` and creates the NCCL communicators.
    pub fn new(pipeline: Pipeline, shards: Vec<DeviceTensor>) -> Result<TensorParallelSampler, TpError> {
        pipeline.validate().map_err(Error::from)?;
        let local = shard_pipeline(&pipeline)?;
        let world = shards.len();
        if world == 0 {
            return Err(TpError::Setup("no shards".into()));
        }
        let dim = shards[0].cols();
        let mut offsets = Vec::with_capacity(world);
        let mut vocab = 0usize;
        for (k, s) in shards.iter().enumerate() {
            if s.cols() != dim || s.dtype() != pipeline.weights.dtype {
                return Err(TpError::Setup(format!(
                    "shard {k} is {:?} [{}, {}]; expected {:?} [_, {dim}]",
                    s.dtype(),
                    s.rows(),
                    s.cols(),
                    pipeline.weights.dtype
                )));
            }
            if k + 1 < world && !s.rows().is_multiple_of(4) {
                return Err(TpError::Setup(format!("shard {k} has {} tokens; all but the last need a multiple of 4", s.rows())));
            }
            if shards[..k].iter().any(|o| o.device().ordinal() == s.device().ordinal()) {
                return Err(TpError::Setup(format!("shards {k} and another share cuda:{}; one shard per GPU", s.device().ordinal())));
            }
            offsets.push(vocab);
            vocab += s.rows();
        }
        require_nccl()?;
        let comms = Comm::from_devices(shards.iter().map(|s| s.device().stream().clone()).collect())
            .map_err(nccl("ncclCommInitAll"))?;
        let mut ranks = Vec::with_capacity(world);
        for (rank, (shard, comm)) in shards.into_iter().zip(comms).enumerate() {
            let device = shard.device().clone();
            let sampler = Sampler::new(local.clone(), &Device::Cuda(device.clone()))?;
            ranks.push(Mutex::new(Rank { rank, sampler, shard, device, comm: RankComm(comm), send: None, recv: None }));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(world)
            .thread_name(|i| format!("flashsample-tp-rank{i}"))
            .build()
            .map_err(|e| TpError::Setup(format!("worker threads: {e}")))?;
        Ok(TensorParallelSampler { pipeline, ranks, offsets, vocab, dim, pool })
    }

    /// Uploads `weights` (`[vocab, dim]`, host) split by [`shard_ranges`] (blocks of 128
    /// tokens) to `ordinals` and builds the sampler.
    pub fn from_host<T: Element>(
        pipeline: Pipeline,
        ordinals: &[usize],
        weights: &[T],
        vocab: usize,
        dim: usize,
    ) -> Result<TensorParallelSampler, TpError> {
        if weights.len() != vocab * dim {
            return Err(Error::Length("weights", weights.len(), vocab, dim).into());
        }
        let mut shards = Vec::with_capacity(ordinals.len());
        for (r, &o) in shard_ranges(vocab, ordinals.len(), 128)?.into_iter().zip(ordinals) {
            let dev = CudaDevice::open(o)?;
            shards.push(dev.upload(&weights[r.start * dim..r.end * dim], r.len(), dim)?);
        }
        Self::new(pipeline, shards)
    }

    /// The pipeline every rank runs.
    pub fn pipeline(&self) -> &Pipeline {
        &self.pipeline
    }
    /// Ranks (one per GPU and vocabulary shard).
    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }
    /// Total vocabulary over all shards.
    pub fn vocab(&self) -> usize {
        self.vocab
    }
    /// First global token of each rank's shard.
    pub fn shard_offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// Samples every row of `hidden` over the whole vocabulary. `hidden` is one tensor per
    /// rank (on that rank's GPU, as TP ranks hold it after the last all-reduce, or on the
    /// host), or a single host tensor every rank reads. `params` are global (bias `[V]`, mask
    /// `[B, ceil(V/32)]`, global token ids); returned tokens are global.
    pub fn sample(&self, hidden: &[Tensor<'_>], params: &SamplingParams<'_>) -> Result<Samples, TpError> {
        let world = self.world_size();
        let first = *hidden.first().ok_or(Error::EmptyBatch)?;
        if hidden.len() != 1 && hidden.len() != world {
            return Err(TpError::Setup(format!("{} hidden tensors for {world} ranks (pass 1 or {world})", hidden.len())));
        }
        for h in hidden {
            if (h.rows(), h.cols(), h.dtype()) != (first.rows(), first.cols(), first.dtype()) {
                return Err(TpError::Setup("every rank's hidden tensor must have the same shape and dtype".into()));
            }
        }
        // Whole-head validation here, so bad inputs fail before any rank enters a collective.
        let head = Tensor { dtype: self.pipeline.weights.dtype, rows: self.vocab, cols: self.dim, storage: crate::tensor::Storage::Host(&[]) };
        check_operands(&self.pipeline, &first, &head)?;
        params.validate(&self.pipeline, first.rows(), self.vocab).map_err(Error::from)?;
        let results: Vec<Result<Samples, TpError>> = self.pool.broadcast(|ctx| {
            let k = ctx.index();
            let mut rank = self.ranks[k].lock().unwrap_or_else(|e| e.into_inner());
            let h = if hidden.len() == 1 { first } else { hidden[k] };
            rank.step(&self.pipeline, h, params, self.offsets[k], self.vocab, world)
        });
        // A rank's own error explains the peers' "rank k failed".
        let mut results = results.into_iter();
        let mut first_err = None;
        let mut out = None;
        for r in results.by_ref() {
            match r {
                Ok(s) => {
                    out.get_or_insert(s);
                }
                Err(e @ (TpError::Rank { .. } | TpError::Nccl { .. } | TpError::Runtime(_))) => {
                    if !matches!(first_err, Some(TpError::Rank { .. })) {
                        first_err = Some(e);
                    }
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match (first_err, out) {
            (Some(e), _) => Err(e),
            (None, Some(s)) => Ok(s),
            (None, None) => Err(TpError::Setup("no rank returned".into())),
        }
    }

    /// Wall-clock seconds of each of `reps` complete [`TensorParallelSampler::sample`] calls
    /// after `warmup` (local launches, read-back, all-gather, merge: what a decoding step waits for).
    pub fn time(&self, hidden: &[Tensor<'_>], params: &SamplingParams<'_>, warmup: usize, reps: usize) -> Result<Vec<f64>, TpError> {
        for _ in 0..warmup {
            self.sample(hidden, params)?;
        }
        (0..reps)
            .map(|_| {
                let t = std::time::Instant::now();
                self.sample(hidden, params).map(|_| t.elapsed().as_secs_f64())
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(score: f32, index: u32) -> Candidate {
        Candidate { score, index, logit: score - 1.0 }
    }

    const ALL: Outputs = Outputs { score: true, logsumexp: true, logprob: true, top_logprobs: 0 };

    #[test]
    fn merge_takes_the_best_score_ties_to_the_lower_index() {
        let a = RankSummary { winners: vec![cand(1.0, 3), cand(2.0, 1)], lse: vec![0.5] };
        let b = RankSummary { winners: vec![cand(1.0, 700), cand(2.5, 900)], lse: vec![1.5] };
        let m = merge_summaries(&[b.clone(), a.clone()], 1, 2, &ALL).unwrap();
        assert_eq!(m.tokens, vec![3, 900]);
        assert_eq!(m.scores, Some(vec![1.0, 2.5]));
        let want = (0.5f64.exp() + 1.5f64.exp()).ln() as f32;
        assert!((m.logsumexp.as_ref().unwrap()[0] - want).abs() < 1e-6);
        assert_eq!(m.logprobs.unwrap()[1], 1.5 - m.logsumexp.unwrap()[0]);
    }

    #[test]
    fn empty_shards_are_skipped_and_all_empty_rows_are_errors() {
        let empty = RankSummary::empty(2, 1, true);
        let one = RankSummary { winners: vec![cand(-3.0, 8), Candidate { index: INDEX_NONE, ..cand(0.0, 0) }], lse: vec![-3.0, f32::NEG_INFINITY] };
        let m = merge_summaries(&[empty.clone(), one.clone()], 1, 1, &ALL).unwrap();
        assert_eq!((m.tokens[0], m.logsumexp.unwrap()[0]), (8, -3.0));
        assert_eq!(merge_summaries(&[empty, one], 2, 1, &ALL), Err(RowError::AllMasked { row: 1 }));
    }

    #[test]
    fn records_round_trip() {
        let s = RankSummary { winners: vec![cand(1.0, 3), cand(f32::NEG_INFINITY, INDEX_NONE)], lse: vec![0.25] };
        let w = encode(Some(&s), 1, 2);
        assert_eq!(w.len(), record_words(1, 2));
        assert_eq!(decode(&w, 1, 2, true), Some(s));
        assert_eq!(decode(&encode(None, 1, 2), 1, 2, true), None);
    }

    #[test]
    fn window_bits_shifts_across_words() {
        // Row of 96 bits: bit i set iff i % 3 == 0.
        let mut bits = vec![0u32; 3];
        for i in (0..96).step_by(3) {
            bits[i / 32] |= 1 << (i % 32);
        }
        for (off, len) in [(0usize, 96usize), (4, 40), (36, 60), (64, 5)] {
            let w = window_bits(&bits, 3, 1, off, len);
            for i in 0..w.len() * 32 {
                let got = w[i / 32] >> (i % 32) & 1 == 1;
                assert_eq!(got, i < len && (off + i) % 3 == 0, "off {off} len {len} bit {i}");
            }
        }
    }

    #[test]
    fn shard_ranges_are_aligned_and_cover() {
        let r = shard_ranges(128_256, 8, 128).unwrap();
        assert_eq!(r.len(), 8);
        assert_eq!(r[0].start, 0);
        assert_eq!(r[7].end, 128_256);
        assert!(r.windows(2).all(|w| w[0].end == w[1].start && w[1].start % 128 == 0));
        assert!(shard_ranges(100, 8, 64).is_err());
    }
}
