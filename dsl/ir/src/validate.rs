use crate::{Pipeline, Sampler, Temperature, Transform, MAX_LIST_CAPACITY, MAX_SAMPLES_PER_ROW};
use std::collections::HashSet;

/// Where in a pipeline an [`IrError`] was found, so front ends can point at the source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    /// The pipeline's name.
    Name,
    /// The hidden-state operand.
    Hidden,
    /// The weights operand.
    Weights,
    /// Index into [`Pipeline::transforms`].
    Transform(usize),
    /// The sampler.
    Sampler,
    /// The scored targets (`target_logprob`).
    Targets,
    /// The verification op (`verify`).
    Verify,
    /// The outputs (`outputs(...)`).
    Outputs,
}

/// Why a pipeline is invalid.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum IrError {
    /// Verification draws one token per target row.
    #[error("`verify` draws one token per target row, but the sampler draws {samples}")]
    VerifySamples {
        /// The sampler's draws per row.
        samples: u32,
    },
    /// Verification scores the drafts itself; it does not combine with `target_logprob`.
    #[error("`verify` and `target_logprob` cannot share a pipeline: verification reports the emitted tokens' logprobs")]
    VerifyWithTargets,
    /// Acceptance needs the processed distribution, which the raw logprob mode does not report.
    #[error("`verify` reports the processed logprobs of the tokens it emits: the raw logprob mode is not supported with it")]
    VerifyWithRawLogprobs,
    /// A name that is not an identifier.
    #[error("`{name}` is not a valid identifier")]
    InvalidName {
        /// The name as written.
        name: String,
        /// Where it is.
        at: Location,
    },
    #[error(
        "shape mismatch: matmul contracts `{hidden}[.., {hidden_dim}]` with `{weights}[.., {weights_dim}]`; \
         the hidden dimension must be the same symbol in both operands"
    )]
    /// The matmul's operands name different hidden dimensions.
    ContractionMismatch {
        /// The hidden operand's name.
        hidden: String,
        /// Its contracted dimension.
        hidden_dim: String,
        /// The weights operand's name.
        weights: String,
        /// Its contracted dimension.
        weights_dim: String,
    },
    /// The batch dimension is named like the vocabulary dimension.
    #[error("the batch dimension `{0}` of the hidden states cannot also be the vocabulary dimension")]
    BatchIsVocab(String),
    /// Two operands share a name.
    #[error("operand name `{name}` is used twice")]
    DuplicateOperand {
        /// The name as written.
        name: String,
        /// Where it is.
        at: Location,
    },
    /// A transform kind appears twice.
    #[error("`{kind}` appears twice; a pipeline takes at most one")]
    DuplicateTransform {
        /// The transform kind.
        kind: &'static str,
        /// Where it is.
        at: usize,
    },
    /// A softcap that is not finite and positive.
    #[error("softcap must be finite and > 0, got {cap}")]
    InvalidSoftcap {
        /// The cap given.
        cap: f32,
        /// Where it is.
        at: usize,
    },
    /// A constant temperature that is not finite and non-negative.
    #[error("a constant temperature must be finite and >= 0, got {value}")]
    InvalidTemperature {
        /// The temperature given.
        value: f32,
        /// Where it is.
        at: usize,
    },
    /// A sample count out of range.
    #[error("samples per row must be in 1..={max}, got {samples}", max = MAX_SAMPLES_PER_ROW)]
    InvalidSampleCount {
        /// The count given.
        samples: u32,
    },
    /// A filter capacity out of range.
    #[error("filter max_k must be in 1..={max}, got {max_k}", max = MAX_LIST_CAPACITY)]
    InvalidFilterCapacity {
        /// The capacity given.
        max_k: u32,
        /// Where it is.
        at: usize,
    },
    /// A transform after the filter.
    #[error("the top-k/top-p filter must be the last transform (it acts on the final logits)")]
    FilterNotLast {
        /// Where it is.
        at: usize,
    },
    /// A per-request logit bias after the penalties or the temperature.
    #[error(
        "`logit_bias` must come before `{after}`: logit biases act on the model's logits, before \
         penalties and temperature, as vLLM applies them"
    )]
    LogitBiasOrder {
        /// The transform kind it follows.
        after: &'static str,
        /// Where the `logit_bias` is.
        at: usize,
    },
    /// A top-logprobs count out of range.
    #[error("top_logprobs must be in 0..={max}, got {n}", max = MAX_LIST_CAPACITY)]
    InvalidTopLogprobs {
        /// The count given.
        n: u32,
    },
    /// The raw logprob mode on a pipeline that reports no logprob output.
    #[error(
        "the `raw` logprob mode chooses what `logprob`, `logsumexp`, `top_logprobs` and \
         `target_logprob` report, but the pipeline reports none of them"
    )]
    RawModeWithoutLogprobs,
}

impl IrError {
    /// Where in the pipeline the error is.
    pub fn location(&self) -> Location {
        match self {
            IrError::InvalidName { at, .. } | IrError::DuplicateOperand { at, .. } => *at,
            IrError::ContractionMismatch { .. } => Location::Weights,
            IrError::BatchIsVocab(_) => Location::Weights,
            IrError::DuplicateTransform { at, .. }
            | IrError::InvalidSoftcap { at, .. }
            | IrError::InvalidTemperature { at, .. }
            | IrError::InvalidFilterCapacity { at, .. }
            | IrError::FilterNotLast { at }
            | IrError::LogitBiasOrder { at, .. } => Location::Transform(*at),
            IrError::InvalidSampleCount { .. } | IrError::InvalidTopLogprobs { .. } => Location::Sampler,
            IrError::VerifySamples { .. } | IrError::VerifyWithTargets | IrError::VerifyWithRawLogprobs => Location::Verify,
            IrError::RawModeWithoutLogprobs => Location::Outputs,
        }
    }
}

pub(crate) fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn transform_kind(t: &Transform) -> &'static str {
    match t {
        Transform::Temperature(_) => "temperature",
        Transform::Bias { .. } => "bias",
        Transform::LogitBias { .. } => "logit_bias",
        Transform::Mask { .. } => "mask",
        Transform::Ban { .. } => "ban",
        Transform::Softcap { .. } => "softcap",
        Transform::Penalties { .. } => "penalties",
        Transform::Filter { .. } => "filter",
    }
}

impl Pipeline {
    /// Checks every rule a backend relies on; backends call this before lowering.
    pub fn validate<'a>(&'a self) -> Result<(), IrError> {
        let name_ok = |name: &str, at: Location| {
            if is_identifier(name) {
                Ok(())
            } else {
                Err(IrError::InvalidName { name: name.to_string(), at })
            }
        };
        name_ok(&self.name, Location::Name)?;
        for (op, at) in [(&self.hidden, Location::Hidden), (&self.weights, Location::Weights)] {
            name_ok(&op.name, at)?;
            for d in &op.dims {
                name_ok(d, at)?;
            }
        }
        if self.hidden.dims[1] != self.weights.dims[1] {
            return Err(IrError::ContractionMismatch {
                hidden: self.hidden.name.clone(),
                hidden_dim: self.hidden.dims[1].clone(),
                weights: self.weights.name.clone(),
                weights_dim: self.weights.dims[1].clone(),
            });
        }
        if self.hidden.dims[0] == self.weights.dims[0] || self.hidden.dims[0] == self.hidden.dims[1] {
            return Err(IrError::BatchIsVocab(self.hidden.dims[0].clone()));
        }

        let mut names: HashSet<&'a str> = HashSet::new();
        let mut claim = |name: &'a str, at: Location| -> Result<(), IrError> {
            name_ok(name, at)?;
            if !names.insert(name) {
                return Err(IrError::DuplicateOperand { name: name.to_string(), at });
            }
            Ok(())
        };
        claim(&self.hidden.name, Location::Hidden)?;
        claim(&self.weights.name, Location::Weights)?;

        let mut kinds: HashSet<&'static str> = HashSet::new();
        for (i, t) in self.transforms.iter().enumerate() {
            let at = Location::Transform(i);
            if !kinds.insert(transform_kind(t)) {
                return Err(IrError::DuplicateTransform { kind: transform_kind(t), at: i });
            }
            match t {
                Transform::Temperature(Temperature::Const(v)) => {
                    let v = v.get();
                    if !(v.is_finite() && v >= 0.0) {
                        return Err(IrError::InvalidTemperature { value: v, at: i });
                    }
                }
                Transform::Temperature(Temperature::Scalar { operand })
                | Transform::Temperature(Temperature::PerRow { operand })
                | Transform::Bias { operand }
                | Transform::Mask { operand }
                | Transform::Ban { operand }
                | Transform::Penalties { operand } => claim(operand, at)?,
                Transform::LogitBias { operand } => {
                    claim(operand, at)?;
                    if let Some(after) = self.transforms[..i].iter().find_map(|t| match t {
                        Transform::Temperature(_) | Transform::Penalties { .. } => Some(transform_kind(t)),
                        _ => None,
                    }) {
                        return Err(IrError::LogitBiasOrder { after, at: i });
                    }
                }
                Transform::Filter { operand, max_k } => {
                    claim(operand, at)?;
                    if *max_k == 0 || *max_k > MAX_LIST_CAPACITY {
                        return Err(IrError::InvalidFilterCapacity { max_k: *max_k, at: i });
                    }
                    if i + 1 != self.transforms.len() {
                        return Err(IrError::FilterNotLast { at: i });
                    }
                }
                Transform::Softcap { cap } => {
                    let c = cap.get();
                    if !(c.is_finite() && c > 0.0) {
                        return Err(IrError::InvalidSoftcap { cap: c, at: i });
                    }
                }
            }
        }
        if let Sampler::GumbelMax { seed, samples } = &self.sampler {
            claim(seed, Location::Sampler)?;
            if *samples == 0 || *samples > MAX_SAMPLES_PER_ROW {
                return Err(IrError::InvalidSampleCount { samples: *samples });
            }
        }
        if let Some(targets) = &self.targets {
            name_ok(&targets.operand, Location::Targets)?;
            claim(&targets.operand, Location::Targets)?;
        }
        if self.outputs.top_logprobs > MAX_LIST_CAPACITY {
            return Err(IrError::InvalidTopLogprobs { n: self.outputs.top_logprobs });
        }
        if let Some(v) = &self.verify {
            claim(&v.drafts, Location::Verify)?;
            if let Some(q) = &v.draft_probs {
                claim(q, Location::Verify)?;
            }
            if self.samples_per_row() != 1 {
                return Err(IrError::VerifySamples { samples: self.samples_per_row() });
            }
            if self.targets.is_some() {
                return Err(IrError::VerifyWithTargets);
            }
            if self.logprob_mode == crate::LogprobMode::Raw {
                return Err(IrError::VerifyWithRawLogprobs);
            }
        }
        if !self.logprob_mode.is_processed() && !self.reports_logprobs() {
            return Err(IrError::RawModeWithoutLogprobs);
        }
        Ok(())
    }
}
