//! Sampling over a vocabulary split into shards, as a tensor-parallel LM head splits it:
//! each shard runs the fused kernel on its rows of `W` and reports, per row and sample, its
//! local sample and log-mass; `abi::sharded::pick_shard` draws the shard by log-mass. The
//! result has exactly the distribution of unsharded sampling (see `flashsample_abi::sharded`).

use crate::{
    cpu::{host_f32, CpuBackend},
    launch::{check_operands, Shape},
    Device, Error, Result, Samples, Tensor,
};
use flashsample_abi::{
    sharded::{pick_shard, ShardDraw},
    RowError, SamplingParams,
};
use flashsample_ir::Pipeline;
use std::sync::Arc;

/// A pipeline whose weights come as vocabulary shards `[V_k, D]`, in vocabulary order.
pub struct ShardedSampler {
    pipeline: Arc<Pipeline>,
    /// Runs each shard; its pipeline also asks for score and logsumexp, which the merge needs.
    shard: CpuBackend,
}

impl ShardedSampler {
    /// Sharded sampling runs on the CPU device (simulated shards); tensor-parallel GPUs run one
    /// `Sampler` per rank.
    pub fn new(pipeline: Pipeline, device: &Device) -> Result<ShardedSampler> {
        pipeline.validate()?;
        if pipeline.targets.is_some() {
            return Err(Error::Unsupported("sharded scoring (`target_logprob`): use one Sampler over the whole vocabulary".into()));
        }
        if !pipeline.logprob_mode.is_processed() {
            return Err(Error::Unsupported("sharded raw logprobs: use one Sampler over the whole vocabulary".into()));
        }
        if pipeline.list_capacity() > 0 || pipeline.has_penalties() {
            // Their per-row token lists and per-tile candidate lists are indexed by global token;
            // the shard merge here carries one winner per shard. Tensor-parallel GPUs handle them.
            return Err(Error::Unsupported(
                "sharded sampling of pipelines with a filter, penalties or top logprobs".into(),
            ));
        }
        let threads = match device {
            Device::Cpu { threads } => *threads,
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => return Err(Error::Unsupported(format!("sharded sampling on {}; use Device::cpu()", device.describe()))),
        };
        let mut local = pipeline.clone();
        local.outputs.score = true;
        local.outputs.logsumexp = true;
        Ok(ShardedSampler { pipeline: Arc::new(pipeline), shard: CpuBackend::new(Arc::new(local), threads) })
    }

    /// The user's pipeline.
    pub fn pipeline(&self) -> &Pipeline {
        &self.pipeline
    }

    /// Samples from `softmax` over the concatenation of `shards`, exactly.
    pub fn sample(&self, hidden: Tensor<'_>, shards: &[Tensor<'_>], params: &SamplingParams<'_>) -> Result<Samples> {
        if shards.is_empty() {
            return Err(Error::EmptyOperand("shard list"));
        }
        let mut shapes = Vec::with_capacity(shards.len());
        for w in shards {
            shapes.push(check_operands(&self.pipeline, &hidden, w)?);
        }
        let vocab: usize = shapes.iter().map(|s| s.vocab).sum();
        let batch = hidden.rows;
        params.validate(&self.pipeline, batch, vocab)?;

        let hidden_f32 = host_f32(&hidden)?;
        let allowed = params.allowed_bitset(batch, vocab);
        let samples = self.pipeline.samples_per_row() as usize;
        let mut draws: Vec<Vec<ShardDraw>> = vec![Vec::with_capacity(shards.len()); batch * samples];
        let mut offset = 0usize;
        for (w, shape) in shards.iter().zip(&shapes) {
            let local = Shape { batch, dim: shape.dim, vocab: shape.vocab };
            let bias = params.bias.map(|b| &b[offset..offset + shape.vocab]);
            let bits = allowed.as_ref().map(|a| shard_bitset(a, batch, vocab, offset, shape.vocab));
            let local_bias = params.logit_bias.map(|rows| shard_logit_bias(rows, offset, shape.vocab));
            let local_params = SamplingParams { bias, mask: None, banned: None, logit_bias: local_bias.as_deref(), ..*params };
            let config = self.shard.config_for(local);
            let one = self.shard.stage_one(&hidden_f32, w, &local_params, bits.as_deref(), local, &config)?;
            let lse = one.lse.as_deref().ok_or_else(|| Error::Unsupported("shard pipeline without logsumexp".into()))?;
            for row in 0..batch {
                let log_mass = f64::from(one.layout.logsumexp(lse, row));
                for s in 0..samples {
                    let winner = one.layout.winner(&one.candidates, row, s)?.map(|mut c| {
                        c.index += offset as u32;
                        c
                    });
                    draws[row * samples + s].push(ShardDraw { winner, log_mass });
                }
            }
            offset += shape.vocab;
        }

        let mut out = Samples {
            target_logprobs: None,
            target_ranks: None,
            batch,
            samples_per_row: samples,
            tokens: Vec::with_capacity(batch * samples),
            scores: self.pipeline.outputs.score.then(Vec::new),
            logsumexp: self.pipeline.outputs.logsumexp.then(Vec::new),
            logprobs: self.pipeline.outputs.logprob.then(Vec::new),
            top_logprobs: None,
            row_errors: vec![None; batch],
            list_reruns: 0,
        };
        for row in 0..batch {
            let greedy = self.pipeline.is_greedy() || params.row_temperature(&self.pipeline, row) == 0.0;
            let row_draws = &draws[row * samples..][..samples];
            let row_lse = log_mass_total(row_draws[0].iter().map(|d| d.log_mass));
            // The row's own noise stream (its seed, if it has one), as its tokens use.
            let (key, stream_row) = params.row_stream(row);
            for (s, d) in row_draws.iter().enumerate() {
                let k = pick_shard(d, key, stream_row, s as u32, params.row_step(row), greedy).ok_or(RowError::AllMasked { row })?;
                let w = d[k].winner.ok_or(RowError::AllMasked { row })?;
                out.tokens.push(w.index);
                if let Some(v) = out.scores.as_mut() {
                    v.push(w.score);
                }
                if let Some(v) = out.logprobs.as_mut() {
                    v.push((f64::from(w.logit) - row_lse) as f32);
                }
            }
            if let Some(v) = out.logsumexp.as_mut() {
                v.push(row_lse as f32);
            }
        }
        Ok(out)
    }
}

/// `log Σ exp(m_k)` over shard log-masses.
fn log_mass_total(masses: impl Iterator<Item = f64> + Clone) -> f64 {
    let m = masses.clone().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + masses.map(|x| (x - m).exp()).sum::<f64>().ln()
}

/// Each row's logit biases on tokens `[offset, offset + len)`, as shard-local tokens.
pub(crate) fn shard_logit_bias(rows: &[Vec<(u32, f32)>], offset: usize, len: usize) -> Vec<Vec<(u32, f32)>> {
    let local = |t: u32| (t as usize).checked_sub(offset).filter(|&l| l < len).map(|l| l as u32);
    rows.iter().map(|r| r.iter().filter_map(|&(t, b)| local(t).map(|l| (l, b))).collect()).collect()
}

/// Bits `[offset, offset + len)` of each row of a `[batch, ceil(vocab/32)]` bitset, repacked
/// as a `[batch, ceil(len/32)]` bitset.
fn shard_bitset(bits: &[u32], batch: usize, vocab: usize, offset: usize, len: usize) -> Vec<u32> {
    let (words, local_words) = (vocab.div_ceil(32), len.div_ceil(32));
    let mut out = vec![0u32; batch * local_words];
    for row in 0..batch {
        for i in 0..len {
            let g = offset + i;
            if bits[row * words + g / 32] >> (g % 32) & 1 == 1 {
                out[row * local_words + i / 32] |= 1 << (i % 32);
            }
        }
    }
    out
}
