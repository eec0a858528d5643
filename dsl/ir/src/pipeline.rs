use serde::{Deserialize, Serialize};

/// Element type of a matmul operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// bfloat16.
    BF16,
    /// IEEE half precision.
    F16,
    /// IEEE single precision.
    F32,
}

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }
    /// The name the text form and the macro use (`bf16`, `f16`, `f32`).
    pub fn name(self) -> &'static str {
        match self {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
        }
    }
    /// The dtype of a name, `None` if unknown.
    pub fn from_name(s: &str) -> Option<DType> {
        match s {
            "bf16" => Some(DType::BF16),
            "f16" => Some(DType::F16),
            "f32" => Some(DType::F32),
            _ => None,
        }
    }
}

/// An f32 constant held by its bits, so pipelines are `Eq + Hash` and print exactly.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct F32(
    /// The f32's bits.
    pub u32,
);

impl F32 {
    /// Holds `v`.
    pub fn new(v: f32) -> Self {
        F32(v.to_bits())
    }
    /// The value.
    pub fn get(self) -> f32 {
        f32::from_bits(self.0)
    }
}

impl std::fmt::Debug for F32 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.get())
    }
}

/// A rank-2 matmul operand: `name: dtype[rows, cols]` with symbolic dimension names.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Operand {
    /// The name the pipeline refers to it by.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Symbolic names of the two dimensions, e.g. `["B", "D"]`.
    pub dims: [String; 2],
}

/// Where the temperature comes from. A temperature of 0 makes that row greedy.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Temperature {
    /// A constant baked into the kernel.
    Const(F32),
    /// One f32 for the whole batch, passed at launch.
    Scalar {
        /// Its name.
        operand: String,
    },
    /// One f32 per row (`[B]`), passed at launch.
    PerRow {
        /// Its name.
        operand: String,
    },
}

/// An elementwise transform of one logit, applied in declaration order in the epilogue.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Transform {
    /// `logit / T` (per row); rows with `T = 0` are sampled greedily.
    Temperature(Temperature),
    /// `logit + bias[v]` with an f32 `[V]` operand (`-inf` bans a token).
    Bias {
        /// Its name.
        operand: String,
    },
    /// `logit + logit_bias[r][v]`: per-request sparse `{token: bias}` maps passed at launch
    /// (OpenAI's `logit_bias`); `-inf` bans the token for that row. vLLM applies it before the
    /// penalties and the temperature, so validation requires it before both.
    LogitBias {
        /// Its name.
        operand: String,
    },
    /// Keep only tokens whose bit is set in a `[B, ceil(V/32)]` u32 bitset (bit `v%32` of word `v/32`).
    /// Masked tokens are excluded from sampling whatever transforms follow.
    Mask {
        /// Its name.
        operand: String,
    },
    /// Exclude per-row lists of banned token ids. Same exclusion semantics as [`Transform::Mask`].
    Ban {
        /// Its name.
        operand: String,
    },
    /// `cap · tanh(logit / cap)`, Gemma-style soft-capping.
    Softcap {
        /// The cap, finite and > 0.
        cap: F32,
    },
    /// vLLM's repetition, presence and frequency penalties from per-row lists of
    /// (token, count) pairs passed at launch, applied to the logit at this position.
    Penalties {
        /// Its name.
        operand: String,
    },
    /// Per-row top-k, then min-p, then top-p (each optional per row, passed at launch) on the
    /// transformed logits; the sample is drawn from the renormalized survivors. `max_k` is the
    /// capacity of the fused candidate lists: the largest top-k, and the most tokens a
    /// top-p / min-p nucleus may hold when the row sets no top-k. Always the last transform.
    Filter {
        /// Its name.
        operand: String,
        /// Capacity of the candidate lists, in 1..=MAX_LIST_CAPACITY.
        max_k: u32,
    },
}

impl Transform {
    /// Whether this transform belongs to the model rather than to the request: the global
    /// `bias[V]` and the softcap (vLLM's raw logprobs are `compute_logits`'s output, which
    /// includes Gemma's final softcap). Raw logits ([`LogprobMode::Raw`]) apply only these.
    pub fn is_model(&self) -> bool {
        matches!(self, Transform::Bias { .. } | Transform::Softcap { .. })
    }
}

/// How the token is chosen from the transformed logits.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Sampler {
    /// Exact sampling from `softmax(logits)` by Gumbel-max, `samples` independent draws per row.
    GumbelMax {
        /// Name of the seed operand.
        seed: String,
        /// Draws per row.
        samples: u32,
    },
    /// Greedy `argmax(logits)`.
    Argmax,
}

/// Extra per-row outputs beside the sampled token ids.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Outputs {
    /// The winning (perturbed) score of each sample.
    pub score: bool,
    /// `logsumexp` of the row's transformed logits (over unmasked tokens).
    pub logsumexp: bool,
    /// The sampled token's log-probability under `softmax(logits)`.
    pub logprob: bool,
    /// The `n` most likely tokens of each row and their log-probabilities (0 = none).
    pub top_logprobs: u32,
}

/// Which distribution the logprob outputs (`logprob`, `logsumexp`, `top_logprobs`,
/// `target_logprob`) describe (DESIGN.md "Logprob modes"). Sampling always draws from the
/// processed distribution; the mode only chooses what is reported.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LogprobMode {
    /// After every transform before the filter (temperature, biases, softcap, penalties), over
    /// the allowed tokens: the distribution the sampler draws from before top-k / top-p.
    #[default]
    Processed,
    /// The model's own distribution (vLLM's default `raw_logprobs`): the LM head's logits after
    /// the transforms that belong to the model ([`Transform::is_model`]: the global bias and the
    /// softcap, in pipeline order) and before any request processing (per-request logit bias,
    /// penalties, temperature, masks and bans), over every token whose raw logit is `> -inf`.
    Raw,
}

impl LogprobMode {
    /// The name the text form and the macro use in `outputs(...)` (`processed`, `raw`).
    pub fn name(self) -> &'static str {
        match self {
            LogprobMode::Processed => "processed",
            LogprobMode::Raw => "raw",
        }
    }
    /// Whether this is the default, [`LogprobMode::Processed`].
    pub fn is_processed(&self) -> bool {
        *self == LogprobMode::Processed
    }
}

/// A validated-or-not sampling pipeline; see the crate docs.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Pipeline {
    /// The pipeline's (and the macro's struct's) name.
    pub name: String,
    /// `[B, D]` hidden states.
    pub hidden: Operand,
    /// `[V, D]` LM-head weights.
    pub weights: Operand,
    /// Applied to each logit in this order.
    pub transforms: Vec<Transform>,
    /// How the token is chosen.
    pub sampler: Sampler,
    /// Extra outputs.
    pub outputs: Outputs,
    /// Scoring given tokens (`target_logprob(logits, NAME[, rank])`): each row reports the
    /// log-probability of its given token under the transformed distribution (prompt
    /// logprobs, reward scoring, a speculative target's probabilities), and its rank if asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub targets: Option<Targets>,
    /// What the logprob outputs describe. A field of the pipeline rather than of [`Outputs`]
    /// so that `Outputs` literals keep their meaning; written inside `outputs(...)`.
    #[serde(default, skip_serializing_if = "LogprobMode::is_processed")]
    pub logprob_mode: LogprobMode,
    /// Speculative verification (`accept = verify(logits, drafts[, draft_probs])`): the rows
    /// are sequences of `k + 1` target positions and the launch accepts or rejects each
    /// sequence's `k` draft tokens (DESIGN.md "Speculative verification").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<Verify>,
}

/// The scoring op's operand and what each row reports about its token.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Targets {
    /// The `[B]` u32 operand naming one token per row.
    pub operand: String,
    /// Whether each row also reports its token's rank (DESIGN.md step 7c): the number of
    /// tokens at least as likely as it, vLLM's rank (1 = the most likely). It costs a second
    /// pass of stage one over the weights.
    #[serde(default)]
    pub rank: bool,
}

/// Where the draft tokens came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DraftKind {
    /// Deterministic drafts (greedy drafting, n-gram, EAGLE's top-1): `q_j = δ(d_j)`.
    Greedy,
    /// Sampled drafts: the draft's full distribution per position (`[B·k, V]`).
    Sampled,
}

/// The verification op's operands: `[S·k]` draft tokens and, for sampled drafts, the
/// `[S·k, V]` f32 draft distributions.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Verify {
    /// The draft tokens' operand.
    pub drafts: String,
    /// The draft distributions' operand; `None` for greedy drafts.
    pub draft_probs: Option<String>,
}

impl Verify {
    /// Greedy without draft distributions, sampled with them.
    pub fn kind(&self) -> DraftKind {
        match self.draft_probs {
            Some(_) => DraftKind::Sampled,
            None => DraftKind::Greedy,
        }
    }
}

impl Pipeline {
    /// Stable 64-bit fingerprint of the canonical text form: equal pipelines hash equal
    /// across processes and compiler versions, so it can key on-disk kernel caches.
    pub fn fingerprint(&self) -> u64 {
        xxhash_rust::xxh3::xxh3_64(self.to_string().as_bytes())
    }

    /// The temperature transform, if any.
    pub fn temperature(&self) -> Option<&Temperature> {
        self.transforms.iter().find_map(|t| match t {
            Transform::Temperature(t) => Some(t),
            _ => None,
        })
    }

    /// Whether a mask or ban transform excludes tokens.
    pub fn has_mask(&self) -> bool {
        self.transforms.iter().any(|t| matches!(t, Transform::Mask { .. } | Transform::Ban { .. }))
    }

    /// Whether the pipeline has a bias.
    pub fn has_bias(&self) -> bool {
        self.transforms.iter().any(|t| matches!(t, Transform::Bias { .. }))
    }

    /// Draws per row (1 for greedy).
    pub fn samples_per_row(&self) -> u32 {
        match self.sampler {
            Sampler::GumbelMax { samples, .. } => samples,
            Sampler::Argmax => 1,
        }
    }

    /// Whether the sampler is argmax.
    pub fn is_greedy(&self) -> bool {
        matches!(self.sampler, Sampler::Argmax)
    }

    /// Whether the pipeline reports any logprob output (`logsumexp`, `logprob`,
    /// `top_logprobs`, `target_logprob`), in either [`LogprobMode`].
    pub fn reports_logprobs(&self) -> bool {
        let o = self.outputs;
        o.logsumexp || o.logprob || o.top_logprobs > 0 || self.targets.is_some()
    }

    /// Whether the kernel may need the row's online logsumexp of the processed logits: for the
    /// processed logprob outputs, and for the filter's top-p.
    pub fn needs_logsumexp(&self) -> bool {
        (self.logprob_mode.is_processed() && self.reports_logprobs()) || self.list_capacity() > 0 || self.verify.is_some()
    }

    /// Whether the kernel accumulates a second online logsumexp, of the raw logits
    /// ([`LogprobMode::Raw`]): every raw-mode pipeline reports some logprob output.
    pub fn needs_raw_logsumexp(&self) -> bool {
        self.logprob_mode == LogprobMode::Raw && self.reports_logprobs()
    }

    /// Whether each row reports its target's rank (`target_logprob(logits, NAME, rank)`).
    pub fn ranks_targets(&self) -> bool {
        self.targets.as_ref().is_some_and(|t| t.rank)
    }

    /// Whether the pipeline has per-request logit biases.
    pub fn has_logit_bias(&self) -> bool {
        self.transforms.iter().any(|t| matches!(t, Transform::LogitBias { .. }))
    }

    /// Whether the pipeline has penalties.
    pub fn has_penalties(&self) -> bool {
        self.transforms.iter().any(|t| matches!(t, Transform::Penalties { .. }))
    }

    /// `max_k` of the [`Transform::Filter`], if any.
    pub fn filter_max_k(&self) -> Option<u32> {
        self.transforms.iter().find_map(|t| match t {
            Transform::Filter { max_k, .. } => Some(*max_k),
            _ => None,
        })
    }

    /// Length of the per-row top list stage one keeps (by transformed logit): enough for the
    /// filter's `max_k` and the requested processed top logprobs; 0 when neither is declared.
    pub fn list_capacity(&self) -> u32 {
        let top = if self.logprob_mode.is_processed() { self.outputs.top_logprobs } else { 0 };
        self.filter_max_k().unwrap_or(0).max(top)
    }

    /// Length of the per-row top list of raw logits stage one keeps for raw `top_logprobs`
    /// (every token, by raw logit); 0 in the processed mode.
    pub fn raw_list_capacity(&self) -> u32 {
        match self.logprob_mode {
            LogprobMode::Raw => self.outputs.top_logprobs,
            LogprobMode::Processed => 0,
        }
    }

    /// Whether the processed lists carry each entry's raw logit beside it: in the raw mode with
    /// a filter and a `logprob` output, the token the filter draws reports its raw logprob.
    pub fn lists_carry_raw(&self) -> bool {
        self.logprob_mode == LogprobMode::Raw && self.filter_max_k().is_some() && self.outputs.logprob
    }
}
