//! Batch invariance (DESIGN.md "Batch invariance"): a pool of requests, each with its own row
//! seed and step, sampled in batches of any composition and config; each request's outputs
//! must be the same bits as when it was sampled alone.

use crate::Case;
use flashsample::{KernelConfig, Samples, Sampler};

/// A pool of requests: row `r` of `case` is request `r`, with `row_seeds[r]` and `steps[r]`.
pub struct Pool {
    pub case: Case,
    pub row_seeds: Vec<u64>,
    pub steps: Vec<u32>,
}

/// One request's outputs, compared bit for bit (f32 by their bits, NaN included).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestOutputs {
    pub tokens: Vec<u32>,
    pub scores: Option<Vec<u32>>,
    pub logprobs: Option<Vec<u32>>,
    pub logsumexp: Option<u32>,
    pub top_logprobs: Option<Vec<(u32, u32)>>,
    pub target_logprob: Option<u32>,
    pub target_rank: Option<u32>,
}

impl Pool {
    /// `case`'s rows as requests with distinct seeds and a spread of steps.
    pub fn new(case: Case) -> Pool {
        let n = case.batch as u64;
        let row_seeds = (0..n).map(|r| 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(r + 1) ^ 0x5eed).collect();
        let steps = (0..n as u32).map(|r| r * 7 % 23).collect();
        Pool { case, row_seeds, steps }
    }

    /// A batch of the requests `ids` (any order, repeats allowed): their rows and parameters
    /// gathered from the pool; the weights stay the pool's.
    pub fn batch(&self, ids: &[usize]) -> (Case, Vec<u64>, Vec<u32>) {
        (self.case.rows(ids), ids.iter().map(|&r| self.row_seeds[r]).collect(), ids.iter().map(|&r| self.steps[r]).collect())
    }

    /// Samples the batch `ids` (with `config`, else the sampler's own choice) and returns each
    /// position's request outputs.
    pub fn run(&self, sampler: &Sampler, ids: &[usize], config: Option<&KernelConfig>) -> flashsample::Result<Vec<RequestOutputs>> {
        let (case, seeds, steps) = self.batch(ids);
        let params = flashsample::SamplingParams { row_seeds: Some(&seeds), row_steps: Some(&steps), ..case.params(sampler.pipeline()) };
        let weights = self.case.weights.tensor();
        let out = match config {
            Some(c) => sampler.sample_with(case.hidden.tensor(), weights, &params, c)?,
            None => sampler.sample(case.hidden.tensor(), weights, &params)?,
        };
        Ok((0..ids.len()).map(|pos| outputs_of(&out, pos)).collect())
    }

    /// Checks that every position of each batch in `batches` gets the outputs its request got
    /// alone (`alone[request]`), naming the first difference.
    pub fn check(&self, sampler: &Sampler, alone: &[RequestOutputs], batches: &[Vec<usize>], config: Option<&KernelConfig>, what: &str) -> Result<(), String> {
        for ids in batches {
            let got = self.run(sampler, ids, config).map_err(|e| format!("{what}: B={}: {e}", ids.len()))?;
            for (pos, (&r, g)) in ids.iter().zip(&got).enumerate() {
                if *g != alone[r] {
                    return Err(format!("{what}: B={} position {pos}: request {r} got {g:?}, alone {:?}", ids.len(), alone[r]));
                }
            }
        }
        Ok(())
    }

    /// Each request sampled alone (B = 1).
    pub fn alone(&self, sampler: &Sampler, config: Option<&KernelConfig>) -> flashsample::Result<Vec<RequestOutputs>> {
        (0..self.case.batch).map(|r| Ok(self.run(sampler, &[r], config)?.remove(0))).collect()
    }
}

/// Position `pos`'s outputs of a launch.
pub fn outputs_of(out: &Samples, pos: usize) -> RequestOutputs {
    let s = out.samples_per_row;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    RequestOutputs {
        tokens: out.row(pos).to_vec(),
        scores: out.scores.as_ref().map(|v| bits(&v[pos * s..][..s])),
        logprobs: out.logprobs.as_ref().map(|v| bits(&v[pos * s..][..s])),
        logsumexp: out.logsumexp.as_ref().map(|v| v[pos].to_bits()),
        top_logprobs: out.top_logprobs.as_ref().map(|t| t[pos].iter().map(|&(i, l)| (i, l.to_bits())).collect()),
        target_logprob: out.target_logprobs.as_ref().map(|t| t[pos].to_bits()),
        target_rank: out.target_ranks.as_ref().map(|t| t[pos]),
    }
}

/// Batch compositions of the requests `0..n`: all in order, reversed, evens then odds, and
/// every request twice, each time next to a different neighbour.
pub fn compositions(n: usize) -> Vec<Vec<usize>> {
    let all: Vec<usize> = (0..n).collect();
    let reversed: Vec<usize> = all.iter().rev().copied().collect();
    let interleaved: Vec<usize> = (0..n).step_by(2).chain((1..n).step_by(2)).collect();
    let pairs: Vec<usize> = (0..n).flat_map(|i| [i, (i * 5 + 3) % n]).collect();
    vec![all, reversed, interleaved, pairs]
}
