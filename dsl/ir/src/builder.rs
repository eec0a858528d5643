use crate::{DType, IrError, LogprobMode, Operand, Outputs, Pipeline, Sampler, Temperature, Transform, F32};

/// Builds a [`Pipeline`] at run time, validating on [`PipelineBuilder::build`].
///
/// ```
/// use flashsample_ir::{DType, PipelineBuilder};
/// let p = PipelineBuilder::new("Greedy", DType::BF16, DType::BF16).argmax().build().unwrap();
/// assert_eq!(p.samples_per_row(), 1);
/// ```
#[derive(Clone, Debug)]
pub struct PipelineBuilder {
    pipeline: Pipeline,
}

impl PipelineBuilder {
    /// A pipeline `hidden: hidden_dtype[B, D]`, `weights: weights_dtype[V, D]`,
    /// `logits = matmul(hidden, weights)`, sampling one token per row with seed operand `seed`.
    pub fn new(name: &str, hidden_dtype: DType, weights_dtype: DType) -> Self {
        let dims = |a: &str, b: &str| [a.to_string(), b.to_string()];
        PipelineBuilder {
            pipeline: Pipeline {
                name: name.to_string(),
                hidden: Operand { name: "hidden".into(), dtype: hidden_dtype, dims: dims("B", "D") },
                weights: Operand { name: "weights".into(), dtype: weights_dtype, dims: dims("V", "D") },
                transforms: Vec::new(),
                sampler: Sampler::GumbelMax { seed: "seed".into(), samples: 1 },
                outputs: Outputs::default(),
                targets: None,
                verify: None,
                logprob_mode: LogprobMode::Processed,
            },
        }
    }

    /// Replaces the hidden-state operand (default `hidden: DTYPE[B, D]`).
    pub fn hidden(mut self, operand: Operand) -> Self {
        self.pipeline.hidden = operand;
        self
    }

    /// Replaces the weights operand (default `weights: DTYPE[V, D]`).
    pub fn weights(mut self, operand: Operand) -> Self {
        self.pipeline.weights = operand;
        self
    }

    /// Appends a transform; the others below are shorthands for it.
    pub fn transform(mut self, t: Transform) -> Self {
        self.pipeline.transforms.push(t);
        self
    }

    /// `logits / t` with `t` baked into the kernel (0 = greedy).
    pub fn temperature_const(self, t: f32) -> Self {
        self.transform(Transform::Temperature(Temperature::Const(F32::new(t))))
    }

    /// `logits / t` with one `t` passed per launch.
    pub fn temperature_scalar(self, operand: &str) -> Self {
        self.transform(Transform::Temperature(Temperature::Scalar { operand: operand.into() }))
    }

    /// `logits / t[r]` with `[B]` temperatures passed per launch (0 = greedy row).
    pub fn temperature_per_row(self, operand: &str) -> Self {
        self.transform(Transform::Temperature(Temperature::PerRow { operand: operand.into() }))
    }

    /// `logits + bias[v]` with an f32 `[V]` operand.
    pub fn bias(self, operand: &str) -> Self {
        self.transform(Transform::Bias { operand: operand.into() })
    }

    /// `logits + logit_bias[r][v]` with per-request sparse `{token: bias}` maps (before any
    /// penalties and temperature).
    pub fn logit_bias(self, operand: &str) -> Self {
        self.transform(Transform::LogitBias { operand: operand.into() })
    }

    /// Keeps the tokens set in a `[B, ceil(V/32)]` bitset operand.
    pub fn mask(self, operand: &str) -> Self {
        self.transform(Transform::Mask { operand: operand.into() })
    }

    /// Excludes per-row lists of token ids.
    pub fn ban(self, operand: &str) -> Self {
        self.transform(Transform::Ban { operand: operand.into() })
    }

    /// `cap · tanh(logit / cap)`.
    pub fn softcap(self, cap: f32) -> Self {
        self.transform(Transform::Softcap { cap: F32::new(cap) })
    }

    /// vLLM's repetition / presence / frequency penalties, per row.
    pub fn penalties(self, operand: &str) -> Self {
        self.transform(Transform::Penalties { operand: operand.into() })
    }

    /// Per-row top-k / top-p / min-p with lists of `max_k` entries; must be last.
    pub fn filter(self, operand: &str, max_k: u32) -> Self {
        self.transform(Transform::Filter { operand: operand.into(), max_k })
    }

    /// Samples `samples` tokens per row by Gumbel-max with the launch seed `seed` (the default, 1 sample).
    pub fn gumbel(mut self, seed: &str, samples: u32) -> Self {
        self.pipeline.sampler = Sampler::GumbelMax { seed: seed.into(), samples };
        self
    }

    /// Scores the given tokens: each row reports the log-probability of `targets[r]`
    /// (`Samples::target_logprobs`). Pair it with `argmax()` to score without sampling.
    pub fn target_logprob(mut self, targets: &str) -> Self {
        self.pipeline.targets = Some(crate::Targets { operand: targets.into(), rank: false });
        self
    }

    /// Scores the given tokens as [`Self::target_logprob`] does and also reports each
    /// target's rank (`Samples::target_ranks`, DESIGN.md step 7c).
    pub fn target_logprob_and_rank(mut self, targets: &str) -> Self {
        self.pipeline.targets = Some(crate::Targets { operand: targets.into(), rank: true });
        self
    }

    /// Verifies greedy drafts (`[S·k]` tokens in operand `drafts`): the rows are sequences of
    /// `k + 1` target positions (`Sampler::verify`).
    pub fn verify_greedy(mut self, drafts: &str) -> Self {
        self.pipeline.verify = Some(crate::Verify { drafts: drafts.into(), draft_probs: None });
        self
    }

    /// Verifies sampled drafts: `[S·k]` tokens in `drafts` and their `[S·k, V]` f32
    /// distributions in `draft_probs`.
    pub fn verify_sampled(mut self, drafts: &str, draft_probs: &str) -> Self {
        self.pipeline.verify = Some(crate::Verify { drafts: drafts.into(), draft_probs: Some(draft_probs.into()) });
        self
    }

    /// Takes the argmax instead of sampling.
    pub fn argmax(mut self) -> Self {
        self.pipeline.sampler = Sampler::Argmax;
        self
    }

    /// The extra outputs to return.
    pub fn outputs(mut self, outputs: Outputs) -> Self {
        self.pipeline.outputs = outputs;
        self
    }

    /// What the logprob outputs describe (default [`LogprobMode::Processed`]).
    pub fn logprob_mode(mut self, mode: LogprobMode) -> Self {
        self.pipeline.logprob_mode = mode;
        self
    }

    /// Validates and returns the pipeline.
    pub fn build(self) -> Result<Pipeline, IrError> {
        self.pipeline.validate()?;
        Ok(self.pipeline)
    }

    /// The pipeline without validation, for front ends that map errors to their own source spans.
    pub fn build_unchecked(self) -> Pipeline {
        self.pipeline
    }
}
