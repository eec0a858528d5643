//! The run-time parameters of one sampling launch, shared by every backend and the reference.

use flashsample_ir::{Pipeline, Temperature, Transform};

/// Temperature values supplied at launch (constant temperatures live in the pipeline).
#[derive(Clone, Copy, Debug, Default)]
pub enum TemperatureArg<'a> {
    #[default]
    None,
    Scalar(f32),
    PerRow(&'a [f32]),
}

/// Everything a launch needs besides the two matrices.
#[derive(Clone, Copy, Debug, Default)]
pub struct SamplingParams<'a> {
    pub temperature: TemperatureArg<'a>,
    /// `[V]` additive bias; `-inf` bans a token for every row.
    pub bias: Option<&'a [f32]>,
    /// `[B, ceil(V/32)]` allowed-token bitset, bit `v % 32` of word `v / 32`.
    pub mask: Option<&'a [u32]>,
    /// Per-row banned token ids (`B` lists).
    pub banned: Option<&'a [Vec<u32>]>,
    pub seed: u64,
}

/// A launch parameter that does not fit the pipeline or the shapes.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ParamError {
    #[error("the pipeline declares `{0}`, but no value was passed for it")]
    Missing(&'static str),
    #[error("`{0}` was passed, but the pipeline does not declare it")]
    Unexpected(&'static str),
    #[error("`{what}` has {got} elements, expected {expected}")]
    Length { what: &'static str, expected: usize, got: usize },
    #[error("temperature of row {row} is {value}; temperatures must be finite and >= 0 (0 = greedy)")]
    Temperature { row: usize, value: f32 },
    #[error("bias[{index}] is {value}; a bias must be finite or -inf")]
    Bias { index: usize, value: f32 },
    #[error("banned token {token} of row {row} is outside the vocabulary of {vocab} tokens")]
    BannedOutOfRange { row: usize, token: u32, vocab: usize },
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
        Ok(())
    }

    /// The temperature row `row` is sampled at: 0 means greedy, 1 when the pipeline has none.
    pub fn row_temperature(&self, pipeline: &Pipeline, row: usize) -> f32 {
        match (pipeline.temperature(), self.temperature) {
            (Some(Temperature::Const(t)), _) => t.get(),
            (Some(_), TemperatureArg::Scalar(t)) => t,
            (Some(_), TemperatureArg::PerRow(t)) => t[row],
            _ => 1.0,
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

fn check_temperature(row: usize, value: f32) -> Result<(), ParamError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(ParamError::Temperature { row, value })
    }
}
