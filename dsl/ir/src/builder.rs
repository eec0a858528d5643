use crate::{DType, IrError, Operand, Outputs, Pipeline, Sampler, Temperature, Transform, F32};

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
            },
        }
    }

    pub fn hidden(mut self, operand: Operand) -> Self {
        self.pipeline.hidden = operand;
        self
    }

    pub fn weights(mut self, operand: Operand) -> Self {
        self.pipeline.weights = operand;
        self
    }

    pub fn transform(mut self, t: Transform) -> Self {
        self.pipeline.transforms.push(t);
        self
    }

    pub fn temperature_const(self, t: f32) -> Self {
        self.transform(Transform::Temperature(Temperature::Const(F32::new(t))))
    }

    pub fn temperature_scalar(self, operand: &str) -> Self {
        self.transform(Transform::Temperature(Temperature::Scalar { operand: operand.into() }))
    }

    pub fn temperature_per_row(self, operand: &str) -> Self {
        self.transform(Transform::Temperature(Temperature::PerRow { operand: operand.into() }))
    }

    pub fn bias(self, operand: &str) -> Self {
        self.transform(Transform::Bias { operand: operand.into() })
    }

    pub fn mask(self, operand: &str) -> Self {
        self.transform(Transform::Mask { operand: operand.into() })
    }

    pub fn ban(self, operand: &str) -> Self {
        self.transform(Transform::Ban { operand: operand.into() })
    }

    pub fn softcap(self, cap: f32) -> Self {
        self.transform(Transform::Softcap { cap: F32::new(cap) })
    }

    pub fn penalties(self, operand: &str) -> Self {
        self.transform(Transform::Penalties { operand: operand.into() })
    }

    pub fn filter(self, operand: &str, max_k: u32) -> Self {
        self.transform(Transform::Filter { operand: operand.into(), max_k })
    }

    pub fn gumbel(mut self, seed: &str, samples: u32) -> Self {
        self.pipeline.sampler = Sampler::GumbelMax { seed: seed.into(), samples };
        self
    }

    pub fn argmax(mut self) -> Self {
        self.pipeline.sampler = Sampler::Argmax;
        self
    }

    pub fn outputs(mut self, outputs: Outputs) -> Self {
        self.pipeline.outputs = outputs;
        self
    }

    pub fn build(self) -> Result<Pipeline, IrError> {
        self.pipeline.validate()?;
        Ok(self.pipeline)
    }

    /// The pipeline without validation, for front ends that map errors to their own source spans.
    pub fn build_unchecked(self) -> Pipeline {
        self.pipeline
    }
}
