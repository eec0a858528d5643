//! The run-time parameters of one sampling launch, shared by every backend and the reference.

use crate::row_tokens::RowTokens;
use crate::speculative::{check_drafts, drafts_per_sequence, DraftKind, SpecError};
use bytemuck::{Pod, Zeroable};
use flashsample_ir::{Pipeline, Temperature, Transform};
use std::ops::RangeInclusive;

/// Positive temperatures below this sample greedily, exactly as `T = 0` does (vLLM's
/// `_SAMPLING_EPS`). Below it `logit / T` no longer differs from the argmax in any way f32
/// can show, and `1 / T` overflows f32 near 3e-39. [`SamplingParams::row_temperature`]
/// applies it, so every backend, stage three and the reference see the same `0`.
pub const MIN_TEMPERATURE: f32 = 1e-5;

/// Accepted repetition penalties (1 = off). Outside it a penalty scales a logit by more than
/// 100x: it pushes logits toward f32 overflow without changing which tokens can win.
pub const REPETITION_PENALTY: RangeInclusive<f32> = 0.01..=100.0;

/// Accepted presence and frequency penalties (0 = off), as vLLM and the OpenAI API accept.
pub const PRESENCE_FREQUENCY_PENALTY: RangeInclusive<f32> = -2.0..=2.0;

/// Temperature values supplied at launch (constant temperatures live in the pipeline).
#[derive(Clone, Copy, Debug, Default)]
pub enum TemperatureArg<'a> {
    /// The pipeline has no run-time temperature (none, or a constant one).
    #[default]
    None,
    /// One temperature for every row (a pipeline declaring `temperature(logits, scalar t)`).
    Scalar(f32),
    /// `[B]` temperatures, one per row (a pipeline declaring a per-row temperature).
    PerRow(&'a [f32]),
}

/// One row's top-k / top-p / min-p setting (see `crate::filter`); laid out as the GPU reads it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct RowFilter {
    /// Keep the `top_k` most likely tokens; 0 = no top-k.
    pub top_k: u32,
    /// Keep the smallest set of most likely tokens holding `top_p` of the mass; 1 = off.
    pub top_p: f32,
    /// Keep tokens with `p >= min_p · p_max`; 0 = off.
    pub min_p: f32,
}

impl RowFilter {
    /// No filtering: the row samples from its whole distribution.
    pub const OFF: RowFilter = RowFilter { top_k: 0, top_p: 1.0, min_p: 0.0 };

    /// Only a top-k.
    pub fn top_k(k: u32) -> Self {
        RowFilter { top_k: k, ..Self::OFF }
    }

    /// Only a top-p.
    pub fn top_p(p: f32) -> Self {
        RowFilter { top_p: p, ..Self::OFF }
    }

    /// Whether the filter keeps every token.
    pub fn is_off(&self) -> bool {
        self.top_k == 0 && self.top_p >= 1.0 && self.min_p <= 0.0
    }

    /// Whether stage three draws the samples of a row with this filter (DESIGN.md step 9): any
    /// filter but OFF on a row that is not greedy (a filtering pipeline has a filter for every
    /// row). Stage one draws no noise for such a row: its candidates are its argmax, as a
    /// greedy row's, since stage three replaces stage two's result with its own draw.
    pub fn is_drawn_in_stage_three(&self, greedy: bool) -> bool {
        !greedy && !self.is_off()
    }

    /// Whether the candidate set is cut inside the top list by a top-k or a min-p, so stage
    /// three never needs the row's full logsumexp (a lone top-p measures mass against it).
    pub fn is_bounded(&self) -> bool {
        self.top_k > 0 || self.min_p > 0.0
    }

    /// Whether the row's candidate set can outgrow any list: a top-p or min-p without a
    /// top-k (a top-k is at most the lists' capacity). Only such a row can be
    /// [`crate::filter::ListError::NucleusTooLarge`].
    pub fn may_outgrow_lists(&self) -> bool {
        self.top_k == 0 && !self.is_off()
    }
}

impl Default for RowFilter {
    fn default() -> Self {
        Self::OFF
    }
}

/// vLLM's sampling penalties, per row. `history[r]` lists (token, count) pairs: `count` is how
/// often the token was generated so far (frequency and presence act on it); a prompt token
/// with count 0 gets only the repetition penalty, as vLLM's prompt mask does.
#[derive(Clone, Copy, Debug)]
pub struct PenaltyArg<'a> {
    /// `[B]`, in [`REPETITION_PENALTY`]; 1 = off. Positive logits are divided by it, others multiplied.
    pub repetition: &'a [f32],
    /// `[B]`, in [`PRESENCE_FREQUENCY_PENALTY`], subtracted once from every generated token's logit; 0 = off.
    pub presence: &'a [f32],
    /// `[B]`, in [`PRESENCE_FREQUENCY_PENALTY`], subtracted `count` times; 0 = off.
    pub frequency: &'a [f32],
    /// `[B]` lists of (token, count); a token listed twice has the sum of its counts.
    pub history: &'a [Vec<(u32, u32)>],
}

/// Penalties in the form kernels read: the penalized tokens of each row ([`RowTokens`]: the
/// bitset every logit tests, then a binary search) and, per entry, what to subtract.
#[derive(Clone, Debug, PartialEq)]
pub struct PenaltyTable {
    /// The penalized tokens of each row.
    pub listed: RowTokens,
    /// Per entry of `listed`: `frequency · count + presence · [count > 0]`, in f32.
    pub subtract: Vec<f32>,
    /// `[B]`.
    pub repetition: Vec<f32>,
}

/// Per-request logit biases in the form kernels read: the biased tokens of each row
/// ([`RowTokens`], the same lookup as the penalties) and, per entry, the bias added.
#[derive(Clone, Debug, PartialEq)]
pub struct LogitBiasTable {
    /// The biased tokens of each row.
    pub listed: RowTokens,
    /// Per entry of `listed`: the bias, finite or `-inf`.
    pub values: Vec<f32>,
}

impl LogitBiasTable {
    /// The biased value of `x` for token `v` of `row` (`x` unchanged if `v` is not listed).
    pub fn apply(&self, row: usize, v: u32, x: f32) -> f32 {
        match self.listed.find(row, v) {
            Some(j) => x + self.values[j],
            None => x,
        }
    }
}

/// One row's history with repeated tokens merged (counts added in u64, so they cannot wrap),
/// sorted by token; `None` if the counts of one token overflow u64.
fn merged_history(history: &[(u32, u32)]) -> Option<Vec<(u32, u64)>> {
    let mut sorted = history.to_vec();
    sorted.sort_unstable();
    let mut rows: Vec<(u32, u64)> = Vec::with_capacity(sorted.len());
    for (tok, n) in sorted {
        match rows.last_mut() {
            Some(last) if last.0 == tok => last.1 = last.1.checked_add(u64::from(n))?,
            _ => rows.push((tok, u64::from(n))),
        }
    }
    Some(rows)
}

/// The penalized logit of one listed token, the f32 steps every backend emits.
pub fn penalize_f32(x: f32, repetition: f32, subtract: f32) -> f32 {
    let y = if x > 0.0 { x / repetition } else { x * repetition };
    y - subtract
}

impl PenaltyTable {
    /// The penalized value of `x` for token `v` of `row` (`x` unchanged if `v` is not listed).
    pub fn apply(&self, row: usize, v: u32, x: f32) -> f32 {
        match self.listed.find(row, v) {
            Some(j) => penalize_f32(x, self.repetition[row], self.subtract[j]),
            None => x,
        }
    }
}

/// Everything a launch needs besides the two matrices.
#[derive(Clone, Copy, Debug, Default)]
pub struct SamplingParams<'a> {
    /// The run-time temperature, for pipelines that declare one.
    pub temperature: TemperatureArg<'a>,
    /// `[V]` additive bias; `-inf` bans a token for every row.
    pub bias: Option<&'a [f32]>,
    /// `[B]` per-request logit biases (OpenAI's `logit_bias`), for pipelines with a
    /// `logit_bias` transform: row `r`'s `(token, bias)` pairs, each token at most once, each
    /// bias finite or `-inf` (which bans the token for that row). An empty list biases nothing.
    pub logit_bias: Option<&'a [Vec<(u32, f32)>]>,
    /// `[B, ceil(V/32)]` allowed-token bitset, bit `v % 32` of word `v / 32`.
    pub mask: Option<&'a [u32]>,
    /// Per-row banned token ids (`B` lists).
    pub banned: Option<&'a [Vec<u32>]>,
    /// The launch's Philox key; row `r` draws noise `noise_bits(seed, r, s, v)` unless it has its own seed.
    pub seed: u64,
    /// `[B]` per-row seeds (one per request). A row with its own seed draws noise
    /// `noise_bits(row_seeds[r], 0, s, v, step)`: independent of its position in the batch.
    pub row_seeds: Option<&'a [u64]>,
    /// `[B]` per-row decode steps (counter word 3, `abi::rng::counter_word3`); absent = every
    /// row at step 0. A request that advances its step each decode step draws fresh noise
    /// from one seed, and step `n` reproduces the same sample wherever it is computed.
    pub row_steps: Option<&'a [u32]>,
    /// `[B]` per-row top-k / top-p / min-p, for pipelines with a `filter` transform.
    pub filter: Option<&'a [RowFilter]>,
    /// `[B]` the token each row scores, for pipelines with `target_logprob` (each `< V`).
    pub targets: Option<&'a [u32]>,
    /// `[S·k]` draft tokens, for pipelines with `verify`: the `B` rows are `S` sequences of
    /// `k + 1` target positions (`abi::speculative`), so `k = drafts / (B − drafts)`.
    pub drafts: Option<&'a [u32]>,
    /// `[S·k, V]` draft distributions, for pipelines verifying sampled drafts.
    pub draft_probs: Option<&'a [f32]>,
    /// For pipelines with a `penalties` transform.
    pub penalties: Option<PenaltyArg<'a>>,
    /// Global vocabulary index of this launch's token 0 (a tensor-parallel shard's first
    /// token): noise is drawn at `v + vocab_offset`, so every sharding sees the same noise.
    /// Returned token indices stay local to the launch.
    pub vocab_offset: u32,
    /// Launch row of this launch's row 0: 0 for a whole launch, the first row for a range of
    /// rows launched on its own (the backends' row chunks, or a caller splitting a batch).
    /// A row without its own seed draws noise counter row `row_offset + r`
    /// ([`SamplingParams::row_stream`]), so a range draws what the whole launch would.
    pub row_offset: u32,
}

/// A launch parameter that does not fit the pipeline or the shapes.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ParamError {
    /// Draft tokens or distributions that cannot be verified (`verify` pipelines).
    #[error(transparent)]
    Draft(#[from] SpecError),
    /// The pipeline declares an operand the launch did not pass.
    #[error("the pipeline declares `{0}`, but no value was passed for it")]
    Missing(&'static str),
    /// The launch passed an operand the pipeline does not declare.
    #[error("`{0}` was passed, but the pipeline does not declare it")]
    Unexpected(&'static str),
    /// An operand of the wrong length.
    #[error("`{what}` has {got} elements, expected {expected}")]
    Length {
        /// The operand.
        what: &'static str,
        /// Its expected length.
        expected: usize,
        /// Its length.
        got: usize,
    },
    /// A NaN, infinite or negative temperature.
    #[error("temperature of row {row} is {value}; temperatures must be finite and >= 0 (0 = greedy)")]
    Temperature {
        /// The row.
        row: usize,
        /// The value given.
        value: f32,
    },
    /// A NaN or `+inf` bias.
    #[error("bias[{index}] is {value}; a bias must be finite or -inf")]
    Bias {
        /// The token.
        index: usize,
        /// The value given.
        value: f32,
    },
    /// A scored target token past the vocabulary.
    #[error("target token {token} of row {row} is outside the vocabulary of {vocab} tokens")]
    TargetOutOfRange {
        /// The row.
        row: usize,
        /// The token id.
        token: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A per-request logit bias names a token past the vocabulary.
    #[error("logit bias token {token} of row {row} is outside the vocabulary of {vocab} tokens")]
    LogitBiasOutOfRange {
        /// The row.
        row: usize,
        /// The token id.
        token: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A per-request logit bias that is NaN or `+inf`.
    #[error("logit bias of token {token} in row {row} is {value}; a bias must be finite or -inf (-inf bans the token)")]
    LogitBiasValue {
        /// The row.
        row: usize,
        /// The token id.
        token: u32,
        /// The value given.
        value: f32,
    },
    /// A token listed twice in one row's logit bias.
    #[error("token {token} appears twice in the logit bias of row {row}; give each token one bias")]
    LogitBiasDuplicate {
        /// The row.
        row: usize,
        /// The token id.
        token: u32,
    },
    /// A banned token id past the vocabulary.
    #[error("banned token {token} of row {row} is outside the vocabulary of {vocab} tokens")]
    BannedOutOfRange {
        /// The row.
        row: usize,
        /// The token id.
        token: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A row's top-k / top-p / min-p is out of range.
    #[error("row {row}: {what}")]
    Filter {
        /// The row.
        row: usize,
        /// The operand.
        what: String,
    },
    /// A row's penalties are out of range.
    #[error("row {row}: {what}")]
    Penalty {
        /// The row.
        row: usize,
        /// The operand.
        what: String,
    },
    /// A penalized token id past the vocabulary.
    #[error("penalized token {token} of row {row} is outside the vocabulary of {vocab} tokens")]
    HistoryOutOfRange {
        /// The row.
        row: usize,
        /// The token id.
        token: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A `row_offset` whose rows run past 2^32.
    #[error("row_offset {offset} with {batch} rows runs past 2^32 launch rows")]
    RowOffset {
        /// The offset given.
        offset: u32,
        /// The launch's rows.
        batch: usize,
    },
    /// A `vocab_offset` that is not a multiple of 4 or runs past 2^32 tokens.
    #[error("vocab_offset {offset} must be a multiple of 4 and, with the vocabulary of {vocab}, stay below 2^32")]
    VocabOffset {
        /// The offset given.
        offset: u32,
        /// The vocabulary size.
        vocab: usize,
    },
}

/// u32 words per row of a `[B, V]` token bitset.
pub fn mask_words_per_row(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

impl SamplingParams<'_> {
    /// Checks the parameters against the pipeline and the shapes, once per launch.
    pub fn validate(&self, pipeline: &Pipeline, batch: usize, vocab: usize) -> Result<(), ParamError> {
        let want_temp = match pipeline.temperature() {
            Some(Temperature::Scalar { .. }) => Some(false),
            Some(Temperature::PerRow { .. }) => Some(true),
            _ => None,
        };
        match (want_temp, self.temperature) {
            (None, TemperatureArg::None) => {}
            (None, _) => return Err(ParamError::Unexpected("temperature")),
            (Some(_), TemperatureArg::None) => return Err(ParamError::Missing("temperature")),
            (Some(false), TemperatureArg::Scalar(t)) => check_temperature(0, t)?,
            (Some(true), TemperatureArg::PerRow(t)) => {
                if t.len() != batch {
                    return Err(ParamError::Length { what: "temperature", expected: batch, got: t.len() });
                }
                for (row, &v) in t.iter().enumerate() {
                    check_temperature(row, v)?;
                }
            }
            (Some(false), _) => return Err(ParamError::Length { what: "temperature", expected: 1, got: batch }),
            (Some(true), _) => return Err(ParamError::Length { what: "temperature", expected: batch, got: 1 }),
        }
        let has = |f: fn(&Transform) -> bool| pipeline.transforms.iter().any(f);
        match (has(|t| matches!(t, Transform::Bias { .. })), self.bias) {
            (true, None) => return Err(ParamError::Missing("bias")),
            (false, Some(_)) => return Err(ParamError::Unexpected("bias")),
            (true, Some(b)) => {
                if b.len() != vocab {
                    return Err(ParamError::Length { what: "bias", expected: vocab, got: b.len() });
                }
                if let Some((index, &value)) =
                    b.iter().enumerate().find(|(_, v)| v.is_nan() || **v == f32::INFINITY)
                {
                    return Err(ParamError::Bias { index, value });
                }
            }
            (false, None) => {}
        }
        match (pipeline.has_logit_bias(), self.logit_bias) {
            (true, None) => return Err(ParamError::Missing("logit_bias")),
            (false, Some(_)) => return Err(ParamError::Unexpected("logit_bias")),
            (true, Some(rows)) => {
                if rows.len() != batch {
                    return Err(ParamError::Length { what: "logit_bias", expected: batch, got: rows.len() });
                }
                for (row, entries) in rows.iter().enumerate() {
                    check_logit_bias_row(row, entries, vocab)?;
                }
            }
            (false, None) => {}
        }
        match (pipeline.targets.is_some(), self.targets) {
            (true, None) => return Err(ParamError::Missing("targets")),
            (false, Some(_)) => return Err(ParamError::Unexpected("targets")),
            (true, Some(t)) => {
                if t.len() != batch {
                    return Err(ParamError::Length { what: "targets", expected: batch, got: t.len() });
                }
                if let Some((row, &token)) = t.iter().enumerate().find(|(_, &v)| v as usize >= vocab) {
                    return Err(ParamError::TargetOutOfRange { row, token, vocab });
                }
            }
            (false, None) => {}
        }
        self.validate_drafts(pipeline, batch, vocab)?;
        match (has(|t| matches!(t, Transform::Mask { .. })), self.mask) {
            (true, None) => return Err(ParamError::Missing("mask")),
            (false, Some(_)) => return Err(ParamError::Unexpected("mask")),
            (true, Some(m)) => {
                let expected = batch * mask_words_per_row(vocab);
                if m.len() != expected {
                    return Err(ParamError::Length { what: "mask", expected, got: m.len() });
                }
            }
            (false, None) => {}
        }
        match (has(|t| matches!(t, Transform::Ban { .. })), self.banned) {
            (true, None) => return Err(ParamError::Missing("banned token lists")),
            (false, Some(_)) => return Err(ParamError::Unexpected("banned token lists")),
            (true, Some(lists)) => {
                if lists.len() != batch {
                    return Err(ParamError::Length { what: "banned token lists", expected: batch, got: lists.len() });
                }
                for (row, list) in lists.iter().enumerate() {
                    if let Some(&token) = list.iter().find(|&&t| t as usize >= vocab) {
                        return Err(ParamError::BannedOutOfRange { row, token, vocab });
                    }
                }
            }
            (false, None) => {}
        }
        if let Some(seeds) = self.row_seeds {
            if seeds.len() != batch {
                return Err(ParamError::Length { what: "row seeds", expected: batch, got: seeds.len() });
            }
        }
        if let Some(steps) = self.row_steps {
            if steps.len() != batch {
                return Err(ParamError::Length { what: "row steps", expected: batch, got: steps.len() });
            }
        }
        if u64::from(self.row_offset) + batch as u64 > 1 << 32 {
            return Err(ParamError::RowOffset { offset: self.row_offset, batch });
        }
        if u64::from(self.vocab_offset) + vocab as u64 > 1 << 32 || !self.vocab_offset.is_multiple_of(4) {
            return Err(ParamError::VocabOffset { offset: self.vocab_offset, vocab });
        }
        match (pipeline.filter_max_k(), self.filter) {
            (Some(_), None) => return Err(ParamError::Missing("filter (per-row top-k / top-p / min-p)")),
            (None, Some(_)) => return Err(ParamError::Unexpected("filter")),
            (Some(max_k), Some(rows)) => {
                if rows.len() != batch {
                    return Err(ParamError::Length { what: "filter", expected: batch, got: rows.len() });
                }
                for (row, f) in rows.iter().enumerate() {
                    let bad = |what: String| Err(ParamError::Filter { row, what });
                    if f.top_k > max_k {
                        return bad(format!(
                            "top_k {} exceeds the pipeline's filter capacity max_k = {max_k}; declare a larger max_k",
                            f.top_k
                        ));
                    }
                    if !(f.top_p > 0.0 && f.top_p <= 1.0) {
                        return bad(format!("top_p is {}; it must be in (0, 1]", f.top_p));
                    }
                    if !(0.0..=1.0).contains(&f.min_p) {
                        return bad(format!("min_p is {}; it must be in [0, 1]", f.min_p));
                    }
                }
            }
            (None, None) => {}
        }
        match (pipeline.has_penalties(), &self.penalties) {
            (true, None) => return Err(ParamError::Missing("penalties")),
            (false, Some(_)) => return Err(ParamError::Unexpected("penalties")),
            (true, Some(p)) => {
                for (what, got) in [
                    ("repetition penalties", p.repetition.len()),
                    ("presence penalties", p.presence.len()),
                    ("frequency penalties", p.frequency.len()),
                    ("penalty histories", p.history.len()),
                ] {
                    if got != batch {
                        return Err(ParamError::Length { what, expected: batch, got });
                    }
                }
                for row in 0..batch {
                    let bad = |what: String| Err(ParamError::Penalty { row, what });
                    let r = p.repetition[row];
                    if !REPETITION_PENALTY.contains(&r) {
                        return bad(format!(
                            "repetition penalty is {r}; it must be in [{}, {}] (1 = off)",
                            REPETITION_PENALTY.start(),
                            REPETITION_PENALTY.end()
                        ));
                    }
                    for (name, v) in [("presence", p.presence[row]), ("frequency", p.frequency[row])] {
                        if !PRESENCE_FREQUENCY_PENALTY.contains(&v) {
                            return bad(format!(
                                "{name} penalty is {v}; it must be in [{}, {}] (0 = off)",
                                PRESENCE_FREQUENCY_PENALTY.start(),
                                PRESENCE_FREQUENCY_PENALTY.end()
                            ));
                        }
                    }
                    if let Some(&(token, _)) = p.history[row].iter().find(|(t, _)| *t as usize >= vocab) {
                        return Err(ParamError::HistoryOutOfRange { row, token, vocab });
                    }
                    if merged_history(&p.history[row]).is_none() {
                        return bad("the counts of one token add up past 2^64".into());
                    }
                }
            }
            (false, None) => {}
        }
        Ok(())
    }

    /// The Philox key and counter row of `row`'s noise: `(seed, row)`, or `(row_seeds[row], 0)`.
    pub fn row_stream(&self, row: usize) -> (u64, u32) {
        match self.row_seeds {
            Some(seeds) => (seeds[row], 0),
            None => (self.seed, self.row_offset.wrapping_add(row as u32)),
        }
    }

    /// The decode step of `row`'s noise: `row_steps[row]`, or 0 without steps.
    pub fn row_step(&self, row: usize) -> u32 {
        self.row_steps.map_or(0, |s| s[row])
    }

    /// The draft operands against the pipeline's `verify` (`abi::speculative::check_drafts`).
    fn validate_drafts(&self, pipeline: &Pipeline, batch: usize, vocab: usize) -> Result<(), ParamError> {
        let kind = pipeline.verify.as_ref().map(|v| v.kind());
        match (kind, self.drafts) {
            (Some(_), None) => return Err(ParamError::Missing("drafts")),
            (None, Some(_)) => return Err(ParamError::Unexpected("drafts")),
            _ => {}
        }
        match (kind == Some(DraftKind::Sampled), self.draft_probs) {
            (true, None) => return Err(ParamError::Missing("draft_probs")),
            (false, Some(_)) => return Err(ParamError::Unexpected("draft_probs")),
            _ => {}
        }
        if let Some(drafts) = self.drafts {
            let k = drafts_per_sequence(batch, drafts.len())?;
            check_drafts(batch / (k + 1), k, vocab, drafts, self.draft_probs)?;
        }
        Ok(())
    }

    /// Whether this launch needs the rows' full logsumexp of the processed logits: the pipeline
    /// outputs processed logprobs (logsumexp, logprob, top logprobs, target logprob), verifies
    /// drafts (acceptance reads every draft row's exact normalizer, DESIGN.md "Speculative
    /// verification"), or some sampled row filters by a lone top-p. Backends may skip the online
    /// logsumexp of stage one otherwise (it is most of a filtered launch's extra cost). The raw
    /// mode's logsumexp (`Pipeline::needs_raw_logsumexp`) is the pipeline's alone.
    pub fn needs_logsumexp(&self, pipeline: &Pipeline, batch: usize) -> bool {
        if pipeline.verify.is_some() || (pipeline.logprob_mode.is_processed() && pipeline.reports_logprobs()) {
            return true;
        }
        pipeline.filter_max_k().is_some()
            && !pipeline.is_greedy()
            && (0..batch).any(|r| {
                let f = self.row_filter(r);
                !f.is_off() && !f.is_bounded() && self.row_temperature(pipeline, r) != 0.0
            })
    }

    /// The row's filter, `RowFilter::OFF` when the launch has none.
    pub fn row_filter(&self, row: usize) -> RowFilter {
        self.filter.map_or(RowFilter::OFF, |f| f[row])
    }

    /// The kernels' form of the penalties (call after `validate`).
    pub fn penalty_table(&self, batch: usize, vocab: usize) -> Option<PenaltyTable> {
        let p = self.penalties?;
        // `validate` rejected histories whose merged counts overflow.
        let merged: Vec<Vec<(u32, u64)>> =
            p.history[..batch].iter().map(|h| merged_history(h).unwrap_or_default()).collect();
        let subtract = merged
            .iter()
            .enumerate()
            .flat_map(|(row, h)| {
                h.iter().map(move |&(_, n)| {
                    let present = if n > 0 { p.presence[row] } else { 0.0 };
                    p.frequency[row] * n as f32 + present
                })
            })
            .collect();
        Some(PenaltyTable {
            listed: RowTokens::from_sorted_rows(vocab, merged.iter().map(|h| h.iter().map(|&(tok, _)| tok))),
            subtract,
            repetition: p.repetition.to_vec(),
        })
    }

    /// The kernels' form of the per-request logit biases (call after `validate`).
    pub fn logit_bias_table(&self, batch: usize, vocab: usize) -> Option<LogitBiasTable> {
        let rows = self.logit_bias?;
        let sorted: Vec<Vec<(u32, f32)>> = rows[..batch]
            .iter()
            .map(|entries| {
                let mut e = entries.clone();
                e.sort_unstable_by_key(|&(tok, _)| tok);
                e
            })
            .collect();
        Some(LogitBiasTable {
            listed: RowTokens::from_sorted_rows(vocab, sorted.iter().map(|e| e.iter().map(|&(tok, _)| tok))),
            values: sorted.iter().flat_map(|e| e.iter().map(|&(_, b)| b)).collect(),
        })
    }

    /// The temperature row `row` is sampled at: 0 means greedy (also for positive
    /// temperatures below [`MIN_TEMPERATURE`]), 1 when the pipeline has none.
    pub fn row_temperature(&self, pipeline: &Pipeline, row: usize) -> f32 {
        let t = match (pipeline.temperature(), self.temperature) {
            (Some(Temperature::Const(t)), _) => t.get(),
            (Some(_), TemperatureArg::Scalar(t)) => t,
            (Some(_), TemperatureArg::PerRow(t)) => t[row],
            _ => 1.0,
        };
        if t < MIN_TEMPERATURE {
            0.0
        } else {
            t
        }
    }

    /// The per-row temperature vector a kernel reads (length `batch`).
    pub fn row_temperatures(&self, pipeline: &Pipeline, batch: usize) -> Vec<f32> {
        (0..batch).map(|r| self.row_temperature(pipeline, r)).collect()
    }

    /// The single `[B, ceil(V/32)]` allowed-token bitset kernels read: the mask ANDed with
    /// the banned lists, with the padding bits past `V` cleared. `None` when nothing is excluded.
    pub fn allowed_bitset(&self, batch: usize, vocab: usize) -> Option<Vec<u32>> {
        if self.mask.is_none() && self.banned.is_none() {
            return None;
        }
        let words = mask_words_per_row(vocab);
        let mut bits = match self.mask {
            Some(m) => m.to_vec(),
            None => vec![u32::MAX; batch * words],
        };
        if !vocab.is_multiple_of(32) {
            let keep = (1u32 << (vocab % 32)) - 1;
            for row in 0..batch {
                bits[row * words + words - 1] &= keep;
            }
        }
        if let Some(lists) = self.banned {
            for (row, list) in lists.iter().enumerate() {
                for &t in list {
                    bits[row * words + t as usize / 32] &= !(1u32 << (t % 32));
                }
            }
        }
        Some(bits)
    }
}

/// One row's logit bias: tokens inside the vocabulary, each once, biases finite or `-inf`.
fn check_logit_bias_row(row: usize, entries: &[(u32, f32)], vocab: usize) -> Result<(), ParamError> {
    for &(token, value) in entries {
        if token as usize >= vocab {
            return Err(ParamError::LogitBiasOutOfRange { row, token, vocab });
        }
        if value.is_nan() || value == f32::INFINITY {
            return Err(ParamError::LogitBiasValue { row, token, value });
        }
    }
    let mut tokens: Vec<u32> = entries.iter().map(|&(t, _)| t).collect();
    tokens.sort_unstable();
    match tokens.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(ParamError::LogitBiasDuplicate { row, token: w[0] }),
        None => Ok(()),
    }
}

fn check_temperature(row: usize, value: f32) -> Result<(), ParamError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(ParamError::Temperature { row, value })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashsample_ir::{DType, PipelineBuilder};

    fn penalized(repetition: f32, presence: f32, frequency: f32, history: &[Vec<(u32, u32)>]) -> Result<(), ParamError> {
        let p = PipelineBuilder::new("P", DType::F32, DType::F32).penalties("pen").build().unwrap();
        let pen = PenaltyArg { repetition: &[repetition], presence: &[presence], frequency: &[frequency], history };
        SamplingParams { penalties: Some(pen), ..Default::default() }.validate(&p, 1, 64)
    }

    #[test]
    fn tiny_positive_temperatures_are_greedy() {
        let p = PipelineBuilder::new("T", DType::F32, DType::F32).temperature_per_row("t").build().unwrap();
        let temps = [1e-38f32, 1e-45, 9.9e-6, MIN_TEMPERATURE, 0.7, 0.0];
        let params = SamplingParams { temperature: TemperatureArg::PerRow(&temps), ..Default::default() };
        params.validate(&p, temps.len(), 8).unwrap();
        assert_eq!(params.row_temperatures(&p, temps.len()), vec![0.0, 0.0, 0.0, MIN_TEMPERATURE, 0.7, 0.0]);
        let c = PipelineBuilder::new("C", DType::F32, DType::F32).temperature_const(1e-30).build().unwrap();
        assert_eq!(SamplingParams::default().row_temperature(&c, 0), 0.0);
    }

    #[test]
    fn extreme_penalties_are_parameter_errors() {
        let h = vec![vec![(3u32, 1u32)]];
        penalized(1.0, 0.0, 0.0, &h).unwrap();
        penalized(*REPETITION_PENALTY.start(), -2.0, 2.0, &h).unwrap();
        penalized(*REPETITION_PENALTY.end(), 2.0, -2.0, &h).unwrap();
        for (rep, presence, frequency, what) in [
            (1e-45, 0.0, 0.0, "repetition penalty is 0.000000000000000000000000000000000000000000001"),
            (0.0, 0.0, 0.0, "repetition penalty is 0;"),
            (f32::INFINITY, 0.0, 0.0, "repetition penalty is inf"),
            (f32::NAN, 0.0, 0.0, "repetition penalty is NaN"),
            (1e3, 0.0, 0.0, "repetition penalty is 1000"),
            (1.0, 0.0, -1e38, "frequency penalty is -1000000"),
            (1.0, 2.5, 0.0, "presence penalty is 2.5"),
            (1.0, f32::NAN, 0.0, "presence penalty is NaN"),
        ] {
            match penalized(rep, presence, frequency, &h) {
                Err(e @ ParamError::Penalty { row: 0, .. }) => assert!(e.to_string().contains(what), "{e}"),
                other => panic!("({rep}, {presence}, {frequency}): {other:?}"),
            }
        }
    }

    #[test]
    fn repeated_counts_add_up_without_wrapping() {
        let h = vec![vec![(7u32, u32::MAX), (9, 2), (7, 1)]];
        penalized(1.0, 0.5, 2.0, &h).unwrap();
        let pen = PenaltyArg { repetition: &[1.0], presence: &[0.5], frequency: &[2.0], history: &h };
        let t = SamplingParams { penalties: Some(pen), ..Default::default() }.penalty_table(1, 64).unwrap();
        assert_eq!(t.listed.tokens, vec![7, 9]);
        assert_eq!(t.subtract, vec![2.0 * 4_294_967_296.0 + 0.5, 4.5]);
    }

    fn biased(rows: &[Vec<(u32, f32)>]) -> Result<(), ParamError> {
        let p = PipelineBuilder::new("L", DType::F32, DType::F32).logit_bias("lb").build().unwrap();
        SamplingParams { logit_bias: Some(rows), ..Default::default() }.validate(&p, rows.len(), 64)
    }

    #[test]
    fn targets_are_checked_per_row() {
        let p = PipelineBuilder::new("S", DType::F32, DType::F32).argmax().target_logprob("targets").build().unwrap();
        let with = |t: &[u32]| SamplingParams { targets: Some(t), ..Default::default() }.validate(&p, 2, 64);
        with(&[0, 63]).unwrap();
        assert_eq!(with(&[0, 64]), Err(ParamError::TargetOutOfRange { row: 1, token: 64, vocab: 64 }));
        assert_eq!(with(&[0]), Err(ParamError::Length { what: "targets", expected: 2, got: 1 }));
        assert_eq!(SamplingParams::default().validate(&p, 2, 64), Err(ParamError::Missing("targets")));
        let plain = PipelineBuilder::new("P", DType::F32, DType::F32).build().unwrap();
        assert_eq!(SamplingParams { targets: Some(&[1]), ..Default::default() }.validate(&plain, 1, 64), Err(ParamError::Unexpected("targets")));
    }

    #[test]
    fn bad_logit_biases_are_typed_errors_naming_row_and_token() {
        biased(&[vec![], vec![(63, -100.0), (0, f32::NEG_INFINITY), (5, 1e30)]]).unwrap();
        assert_eq!(biased(&[vec![], vec![(3, 1.0), (64, 1.0)]]), Err(ParamError::LogitBiasOutOfRange { row: 1, token: 64, vocab: 64 }));
        assert!(matches!(
            biased(&[vec![(7, f32::NAN)]]),
            Err(ParamError::LogitBiasValue { row: 0, token: 7, value }) if value.is_nan()
        ));
        assert_eq!(
            biased(&[vec![(1, 0.0)], vec![(9, f32::INFINITY)]]),
            Err(ParamError::LogitBiasValue { row: 1, token: 9, value: f32::INFINITY })
        );
        assert_eq!(biased(&[vec![(4, 1.0), (2, 0.5), (4, -1.0)]]), Err(ParamError::LogitBiasDuplicate { row: 0, token: 4 }));
        let e = biased(&[vec![(4, 1.0), (4, 1.0)]]).unwrap_err().to_string();
        assert!(e.contains("token 4") && e.contains("row 0"), "{e}");
        // The table must be declared, passed and sized like the batch.
        let p = PipelineBuilder::new("L", DType::F32, DType::F32).logit_bias("lb").build().unwrap();
        assert_eq!(SamplingParams::default().validate(&p, 1, 64), Err(ParamError::Missing("logit_bias")));
        let rows = [vec![(1u32, 1.0f32)]];
        assert_eq!(
            SamplingParams { logit_bias: Some(&rows), ..Default::default() }.validate(&p, 2, 64),
            Err(ParamError::Length { what: "logit_bias", expected: 2, got: 1 })
        );
        let plain = PipelineBuilder::new("P", DType::F32, DType::F32).build().unwrap();
        assert_eq!(
            SamplingParams { logit_bias: Some(&rows), ..Default::default() }.validate(&plain, 1, 64),
            Err(ParamError::Unexpected("logit_bias"))
        );
    }

    #[test]
    fn the_logit_bias_table_adds_each_rows_own_biases() {
        let rows = vec![vec![(40u32, 2.5f32), (3, f32::NEG_INFINITY)], vec![], vec![(3, -1.0)]];
        let t = SamplingParams { logit_bias: Some(&rows), ..Default::default() }.logit_bias_table(3, 41).unwrap();
        t.listed.check(3, 41, t.values.len()).unwrap();
        assert_eq!(t.listed.tokens, vec![3, 40, 3]);
        assert_eq!(t.listed.offsets, vec![0, 2, 2, 3]);
        assert_eq!(t.apply(0, 40, 1.0), 3.5);
        assert_eq!(t.apply(0, 3, 1.0), f32::NEG_INFINITY);
        assert_eq!(t.apply(0, 4, 1.0), 1.0);
        assert_eq!(t.apply(1, 3, 1.0), 1.0);
        assert_eq!(t.apply(2, 3, 1.0), 0.0);
    }

    #[test]
    fn only_unbounded_top_p_or_min_p_rows_can_outgrow_the_lists() {
        assert!(!RowFilter::OFF.may_outgrow_lists());
        assert!(!RowFilter::top_k(50).may_outgrow_lists());
        assert!(RowFilter::top_p(0.9).may_outgrow_lists());
        assert!(RowFilter { min_p: 0.05, ..RowFilter::OFF }.may_outgrow_lists());
        assert!(!RowFilter { top_p: 0.9, ..RowFilter::top_k(8) }.may_outgrow_lists());
    }
}
