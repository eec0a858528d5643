//! The canonical text form: one statement per line, in the order the kernel applies them.
//!
//! ```text
//! pipeline QwenSampler
//!   hidden: bf16[B, D]
//!   weights: bf16[V, D]
//!   logits = matmul(hidden, weights)
//!   logits = temperature(logits, per_row temperature)
//!   logits = bias(logits, bias)
//!   logits = mask(logits, allowed)
//!   logits = softcap(logits, 30)
//!   sample = gumbel_max(logits, seed, samples=1)
//!   score = target_logprob(logits, targets)     // optional: score given tokens (`, rank`: and rank them)
//!   accept = verify(logits, drafts, draft_probs) // optional: speculative verification
//!   outputs(score, logsumexp)                  // `raw` among them: the raw logprob mode
//! ```

use crate::{DType, IrError, LogprobMode, Operand, Outputs, Pipeline, Sampler, Temperature, Transform, F32};
use std::fmt;

/// Why IR text did not parse.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ParseError {
    /// The text is not a pipeline (line 0: something is missing at the end).
    #[error("line {line}: {message}")]
    Syntax {
        /// 1-based line number; 0 when something is missing at the end.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// The text parsed, but the pipeline is invalid.
    #[error("invalid pipeline: {0}")]
    Invalid(#[from] IrError),
}

impl fmt::Display for Pipeline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "pipeline {}", self.name)?;
        for op in [&self.hidden, &self.weights] {
            writeln!(f, "  {}: {}[{}, {}]", op.name, op.dtype.name(), op.dims[0], op.dims[1])?;
        }
        writeln!(f, "  logits = matmul({}, {})", self.hidden.name, self.weights.name)?;
        for t in &self.transforms {
            match t {
                Transform::Temperature(Temperature::Const(v)) => {
                    writeln!(f, "  logits = temperature(logits, {:?})", v.get())?
                }
                Transform::Temperature(Temperature::Scalar { operand }) => {
                    writeln!(f, "  logits = temperature(logits, scalar {operand})")?
                }
                Transform::Temperature(Temperature::PerRow { operand }) => {
                    writeln!(f, "  logits = temperature(logits, per_row {operand})")?
                }
                Transform::Bias { operand } => writeln!(f, "  logits = bias(logits, {operand})")?,
                Transform::LogitBias { operand } => writeln!(f, "  logits = logit_bias(logits, {operand})")?,
                Transform::Mask { operand } => writeln!(f, "  logits = mask(logits, {operand})")?,
                Transform::Ban { operand } => writeln!(f, "  logits = ban(logits, {operand})")?,
                Transform::Softcap { cap } => writeln!(f, "  logits = softcap(logits, {:?})", cap.get())?,
                Transform::Penalties { operand } => writeln!(f, "  logits = penalties(logits, {operand})")?,
                Transform::Filter { operand, max_k } => {
                    writeln!(f, "  logits = filter(logits, {operand}, max_k={max_k})")?
                }
            }
        }
        match &self.sampler {
            Sampler::GumbelMax { seed, samples } => {
                writeln!(f, "  sample = gumbel_max(logits, {seed}, samples={samples})")?
            }
            Sampler::Argmax => writeln!(f, "  sample = argmax(logits)")?,
        }
        if let Some(t) = &self.targets {
            let rank = if t.rank { ", rank" } else { "" };
            writeln!(f, "  score = target_logprob(logits, {}{rank})", t.operand)?;
        }
        if let Some(v) = &self.verify {
            match &v.draft_probs {
                Some(q) => writeln!(f, "  accept = verify(logits, {}, {q})", v.drafts)?,
                None => writeln!(f, "  accept = verify(logits, {})", v.drafts)?,
            }
        }
        let o = self.outputs;
        let mut names: Vec<String> = [(o.score, "score"), (o.logsumexp, "logsumexp"), (o.logprob, "logprob")]
            .into_iter()
            .filter(|(on, _)| *on)
            .map(|(_, n)| n.to_string())
            .collect();
        if o.top_logprobs > 0 {
            names.push(format!("top_logprobs={}", o.top_logprobs));
        }
        if !self.logprob_mode.is_processed() {
            names.push(self.logprob_mode.name().to_string());
        }
        if !names.is_empty() {
            writeln!(f, "  outputs({})", names.join(", "))?;
        }
        Ok(())
    }
}

struct Line<'a> {
    number: usize,
    text: &'a str,
}

impl Line<'_> {
    fn err<T>(&self, message: impl Into<String>) -> Result<T, ParseError> {
        Err(ParseError::Syntax { line: self.number, message: message.into() })
    }

    /// `head(arg, arg, ...)` → args, checking the head.
    fn call<'s>(&self, s: &'s str, head: &str) -> Result<Vec<&'s str>, ParseError> {
        let inner = s
            .strip_prefix(head)
            .and_then(|r| r.trim_start().strip_prefix('('))
            .and_then(|r| r.trim_end().strip_suffix(')'));
        match inner {
            Some(inner) => Ok(inner.split(',').map(str::trim).filter(|a| !a.is_empty()).collect()),
            None => self.err(format!("expected `{head}(...)`, found `{s}`")),
        }
    }

    fn f32(&self, s: &str) -> Result<F32, ParseError> {
        match s.parse::<f32>() {
            Ok(v) => Ok(F32::new(v)),
            Err(_) => self.err(format!("`{s}` is not a number")),
        }
    }

    fn operand(&self) -> Result<Operand, ParseError> {
        let Some((name, ty)) = self.text.split_once(':') else {
            return self.err("expected `name: dtype[rows, cols]`");
        };
        let ty = ty.trim();
        let Some((dtype, dims)) = ty.split_once('[') else {
            return self.err("expected `dtype[rows, cols]`");
        };
        let Some(dtype) = DType::from_name(dtype.trim()) else {
            return self.err(format!("unknown dtype `{}` (expected bf16, f16 or f32)", dtype.trim()));
        };
        let dims: Vec<&str> = dims.trim_end_matches(']').split(',').map(str::trim).collect();
        let [rows, cols] = dims.as_slice() else {
            return self.err("operands are rank 2: `dtype[rows, cols]`");
        };
        Ok(Operand { name: name.trim().to_string(), dtype, dims: [rows.to_string(), cols.to_string()] })
    }
}

impl Pipeline {
    /// Parses the IR text form and validates the result.
    ///
    /// The text form is what `Display` prints, what `flashsample ir` shows and what
    /// `flashsample sample --pipeline FILE` reads. One statement per line, in the order the
    /// kernel applies them; blank lines and `//` comments are ignored:
    ///
    /// ```text
    /// pipeline NAME
    ///   HIDDEN: DTYPE[B, D]                       // DTYPE: bf16, f16 or f32; dims are names
    ///   WEIGHTS: DTYPE[V, D]
    ///   logits = matmul(HIDDEN, WEIGHTS)
    ///   logits = TRANSFORM(logits, ARG)           // zero or more, each kind at most once:
    ///       temperature(logits, per_row NAME)     //   one f32 per row (0 = greedy row)
    ///       temperature(logits, scalar NAME)      //   one f32 for the launch
    ///       temperature(logits, 0.7)              //   a constant
    ///       bias(logits, NAME)                    //   f32 [V]; -inf bans a token
    ///       logit_bias(logits, NAME)              //   per-row {token: bias}; before penalties
    ///                                             //   and temperature (vLLM's order)
    ///       mask(logits, NAME)                    //   u32 bitset [B, ceil(V/32)]
    ///       ban(logits, NAME)                     //   per-row lists of token ids
    ///       softcap(logits, 30)                   //   cap · tanh(logit / cap)
    ///       penalties(logits, NAME)               //   repetition / presence / frequency
    ///       filter(logits, NAME, max_k=64)        //   per-row top-k / top-p / min-p; last
    ///   sample = gumbel_max(logits, SEED, samples=N)   // or: sample = argmax(logits)
    ///   outputs(score, logsumexp, logprob, top_logprobs=N)   // optional, any subset; add
    ///                                             //   `raw` for the model's logprobs
    /// ```
    ///
    /// It differs from the `flashsample!` macro's syntax, which reads like Rust: there a
    /// pipeline is `pub pipeline NAME { ... }` with `;` after each statement, operands are
    /// declared together (`hidden: bf16[B, D], weights: bf16[V, D];`), temperature is
    /// `logits / temperature[B]` (per row), `logits / temperature` (scalar) or `logits / 0.7`,
    /// bias is `logits + bias[V]`, shapes are written on the operands (`mask(logits,
    /// allowed[B, V])`, `ban(logits, banned[B])`, `logit_bias(logits, logit_bias[B])`,
    /// `penalties(logits, penalties[B])`), the filter
    /// is `top_k_top_p(logits, filter[B], max_k = 64)`, the sampler is `gumbel_argmax(logits,
    /// seed, samples = 1)` and `key = value` takes spaces. Both produce the same [`Pipeline`].
    ///
    /// ```
    /// let p = flashsample_ir::Pipeline::parse(
    ///     "pipeline Chat
    ///        hidden: bf16[B, D]
    ///        weights: bf16[V, D]
    ///        logits = matmul(hidden, weights)
    ///        logits = temperature(logits, per_row t)
    ///        logits = filter(logits, f, max_k=64)
    ///        sample = gumbel_max(logits, seed, samples=1)
    ///        outputs(logprob)",
    /// )?;
    /// assert_eq!(p.filter_max_k(), Some(64));
    /// assert_eq!(flashsample_ir::Pipeline::parse(&p.to_string())?, p);
    /// # Ok::<(), flashsample_ir::ParseError>(())
    /// ```
    pub fn parse(text: &str) -> Result<Pipeline, ParseError> {
        let mut lines = text
            .lines()
            .enumerate()
            .map(|(i, l)| Line { number: i + 1, text: l.split("//").next().unwrap_or("").trim() })
            .filter(|l| !l.text.is_empty());
        let missing = |what: &str| ParseError::Syntax { line: 0, message: format!("missing {what}") };

        let head = lines.next().ok_or_else(|| missing("`pipeline NAME`"))?;
        let Some(name) = head.text.strip_prefix("pipeline ") else {
            return head.err("expected `pipeline NAME`");
        };
        let hidden = lines.next().ok_or_else(|| missing("hidden operand"))?.operand()?;
        let weights = lines.next().ok_or_else(|| missing("weights operand"))?.operand()?;
        let mm = lines.next().ok_or_else(|| missing("matmul"))?;
        let Some(rhs) = mm.text.strip_prefix("logits = ") else {
            return mm.err("expected `logits = matmul(hidden, weights)`");
        };
        let args = mm.call(rhs, "matmul")?;
        if args != [hidden.name.as_str(), weights.name.as_str()] {
            return mm.err("matmul must take the hidden operand, then the weights operand");
        }

        let mut transforms = Vec::new();
        let mut sampler = None;
        let mut outputs = Outputs::default();
        let mut targets: Option<crate::Targets> = None;
        let mut verify: Option<crate::Verify> = None;
        let mut logprob_mode: Option<LogprobMode> = None;
        for line in lines {
            let t = line.text;
            if let Some(rhs) = t.strip_prefix("logits = ") {
                if sampler.is_some() {
                    return line.err("transforms must come before the sampler");
                }
                let op = rhs.split('(').next().unwrap_or("").trim();
                let args = line.call(rhs, op)?;
                if op == "filter" {
                    let ["logits", operand, max_k] = args.as_slice() else {
                        return line.err("expected `filter(logits, NAME, max_k=K)`");
                    };
                    let max_k = max_k
                        .strip_prefix("max_k=")
                        .and_then(|n| n.trim().parse().ok())
                        .ok_or(ParseError::Syntax { line: line.number, message: "expected `max_k=K`".into() })?;
                    transforms.push(Transform::Filter { operand: operand.to_string(), max_k });
                    continue;
                }
                let [first, arg] = args.as_slice() else {
                    return line.err(format!("`{op}` takes (logits, argument)"));
                };
                if *first != "logits" {
                    return line.err(format!("`{op}` must apply to `logits`"));
                }
                transforms.push(match op {
                    "temperature" => Transform::Temperature(if let Some(o) = arg.strip_prefix("per_row ") {
                        Temperature::PerRow { operand: o.trim().into() }
                    } else if let Some(o) = arg.strip_prefix("scalar ") {
                        Temperature::Scalar { operand: o.trim().into() }
                    } else {
                        Temperature::Const(line.f32(arg)?)
                    }),
                    "bias" => Transform::Bias { operand: arg.to_string() },
                    "logit_bias" => Transform::LogitBias { operand: arg.to_string() },
                    "mask" => Transform::Mask { operand: arg.to_string() },
                    "ban" => Transform::Ban { operand: arg.to_string() },
                    "softcap" => Transform::Softcap { cap: line.f32(arg)? },
                    "penalties" => Transform::Penalties { operand: arg.to_string() },
                    other => return line.err(format!("unknown transform `{other}`")),
                });
            } else if let Some(rhs) = t.strip_prefix("sample = ") {
                if sampler.is_some() {
                    return line.err("a pipeline has exactly one sampler");
                }
                sampler = Some(if rhs.starts_with("argmax") {
                    line.call(rhs, "argmax")?;
                    Sampler::Argmax
                } else {
                    let args = line.call(rhs, "gumbel_max")?;
                    let [_, seed, samples] = args.as_slice() else {
                        return line.err("expected `gumbel_max(logits, SEED, samples=N)`");
                    };
                    let samples = samples
                        .strip_prefix("samples=")
                        .and_then(|n| n.trim().parse().ok())
                        .ok_or(ParseError::Syntax { line: line.number, message: "expected `samples=N`".into() })?;
                    Sampler::GumbelMax { seed: seed.to_string(), samples }
                });
            } else if let Some(rhs) = t.strip_prefix("score = ") {
                if targets.is_some() {
                    return line.err("a pipeline scores one operand of targets");
                }
                let args = line.call(rhs, "target_logprob")?;
                targets = Some(match args.as_slice() {
                    ["logits", operand] => crate::Targets { operand: operand.to_string(), rank: false },
                    ["logits", operand, "rank"] => crate::Targets { operand: operand.to_string(), rank: true },
                    _ => return line.err("expected `target_logprob(logits, TARGETS)` or `target_logprob(logits, TARGETS, rank)`"),
                });
            } else if let Some(rhs) = t.strip_prefix("accept = ") {
                if verify.is_some() {
                    return line.err("a pipeline verifies one set of drafts");
                }
                verify = Some(match line.call(rhs, "verify")?.as_slice() {
                    ["logits", drafts] => crate::Verify { drafts: drafts.to_string(), draft_probs: None },
                    ["logits", drafts, q] => crate::Verify { drafts: drafts.to_string(), draft_probs: Some(q.to_string()) },
                    _ => return line.err("expected `verify(logits, DRAFTS)` or `verify(logits, DRAFTS, DRAFT_PROBS)`"),
                });
            } else if t.starts_with("outputs") {
                for o in line.call(t, "outputs")? {
                    match o {
                        "score" => outputs.score = true,
                        "logsumexp" => outputs.logsumexp = true,
                        "logprob" => outputs.logprob = true,
                        n if n.starts_with("top_logprobs=") => {
                            outputs.top_logprobs = n["top_logprobs=".len()..].trim().parse().map_err(|_| {
                                ParseError::Syntax { line: line.number, message: "expected `top_logprobs=N`".into() }
                            })?
                        }
                        mode @ ("raw" | "processed") => {
                            if logprob_mode.is_some() {
                                return line.err("`outputs` names at most one logprob mode (`raw` or `processed`)");
                            }
                            logprob_mode = Some(if mode == "raw" { LogprobMode::Raw } else { LogprobMode::Processed });
                        }
                        other => return line.err(format!("unknown output `{other}`")),
                    }
                }
            } else {
                return line.err(format!("unknown statement `{t}`"));
            }
        }
        let pipeline = Pipeline {
            name: name.trim().to_string(),
            hidden,
            weights,
            transforms,
            sampler: sampler.ok_or_else(|| missing("sampler (`sample = ...`)"))?,
            outputs,
            targets,
            verify,
            logprob_mode: logprob_mode.unwrap_or_default(),
        };
        pipeline.validate()?;
        Ok(pipeline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PipelineBuilder;

    fn qwen() -> Pipeline {
        PipelineBuilder::new("QwenSampler", DType::BF16, DType::BF16)
            .temperature_per_row("temperature")
            .bias("bias")
            .mask("allowed")
            .ban("banned")
            .softcap(30.0)
            .gumbel("seed", 2)
            .outputs(Outputs { score: true, logsumexp: true, logprob: false, top_logprobs: 0 })
            .build()
            .unwrap()
    }

    #[test]
    fn text_round_trips() {
        for p in [
            qwen(),
            PipelineBuilder::new("G", DType::F16, DType::F32).temperature_const(0.7).argmax().build().unwrap(),
            PipelineBuilder::new("Score", DType::BF16, DType::BF16).temperature_const(0.7).argmax().target_logprob("targets").build().unwrap(),
            PipelineBuilder::new("Rank", DType::BF16, DType::BF16).argmax().target_logprob_and_rank("targets").build().unwrap(),
            PipelineBuilder::new("Spec", DType::BF16, DType::BF16).temperature_per_row("t").verify_sampled("drafts", "q").build().unwrap(),
            PipelineBuilder::new("SpecGreedy", DType::BF16, DType::BF16).filter("f", 8).verify_greedy("drafts").build().unwrap(),
            PipelineBuilder::new("S", DType::F32, DType::BF16).temperature_scalar("t").build().unwrap(),
        ] {
            let text = p.to_string();
            assert_eq!(Pipeline::parse(&text).unwrap(), p, "{text}");
            assert_eq!(Pipeline::parse(&text).unwrap().fingerprint(), p.fingerprint());
        }
    }

    #[test]
    fn the_raw_logprob_mode_round_trips_and_needs_a_logprob_output() {
        let p = PipelineBuilder::new("Raw", DType::BF16, DType::BF16)
            .penalties("pen")
            .temperature_per_row("t")
            .filter("f", 8)
            .outputs(Outputs { score: false, logsumexp: true, logprob: true, top_logprobs: 3 })
            .logprob_mode(LogprobMode::Raw)
            .build()
            .unwrap();
        let text = p.to_string();
        assert!(text.ends_with("  outputs(logsumexp, logprob, top_logprobs=3, raw)\n"), "{text}");
        assert_eq!(Pipeline::parse(&text).unwrap(), p);
        let processed = Pipeline { logprob_mode: LogprobMode::Processed, ..p.clone() };
        assert_ne!(processed.fingerprint(), p.fingerprint(), "the mode is part of the fingerprint");
        // `processed` is the default: written or not, the same pipeline, printed without it.
        assert_eq!(Pipeline::parse(&text.replace(", raw)", ", processed)")).unwrap(), processed);
        assert!(!processed.to_string().contains("processed"));
        // The raw lists serve the top logprobs; the processed lists only the filter.
        assert_eq!((p.list_capacity(), p.raw_list_capacity()), (8, 3));
        assert_eq!((processed.list_capacity(), processed.raw_list_capacity()), (8, 0));
        assert!(p.needs_raw_logsumexp() && p.needs_logsumexp() && p.lists_carry_raw());
        // Scoring alone may be raw; a raw mode with nothing to report is not a pipeline.
        let score = PipelineBuilder::new("S", DType::F32, DType::F32).argmax().target_logprob("tg").logprob_mode(LogprobMode::Raw);
        let score = score.build().unwrap();
        assert!(score.needs_raw_logsumexp() && !score.needs_logsumexp());
        assert_eq!(Pipeline::parse(&score.to_string()).unwrap(), score);
        let bare = PipelineBuilder::new("B", DType::F32, DType::F32)
            .outputs(Outputs { score: true, ..Outputs::default() })
            .logprob_mode(LogprobMode::Raw);
        assert_eq!(bare.build().unwrap_err(), IrError::RawModeWithoutLogprobs);
        assert_eq!(
            Pipeline::parse(&text.replace(", raw)", ", raw, processed)")).unwrap_err(),
            ParseError::Syntax { line: 9, message: "`outputs` names at most one logprob mode (`raw` or `processed`)".into() }
        );
    }

    #[test]
    fn penalties_filter_and_top_logprobs_round_trip() {
        let p = PipelineBuilder::new("ChatSampler", DType::BF16, DType::BF16)
            .penalties("penalties")
            .temperature_per_row("temperature")
            .filter("filter", 64)
            .outputs(Outputs { score: false, logsumexp: false, logprob: true, top_logprobs: 5 })
            .build()
            .unwrap();
        let text = p.to_string();
        assert_eq!(
            text,
            "pipeline ChatSampler\n  hidden: bf16[B, D]\n  weights: bf16[V, D]\n  logits = matmul(hidden, weights)\n  \
             logits = penalties(logits, penalties)\n  logits = temperature(logits, per_row temperature)\n  \
             logits = filter(logits, filter, max_k=64)\n  sample = gumbel_max(logits, seed, samples=1)\n  \
             outputs(logprob, top_logprobs=5)\n"
        );
        assert_eq!(Pipeline::parse(&text).unwrap(), p, "{text}");
        assert_eq!(Pipeline::parse(&text).unwrap().fingerprint(), p.fingerprint());
        // Top logprobs alone, and a filter on a greedy pipeline.
        for p in [
            PipelineBuilder::new("T", DType::F16, DType::F16)
                .outputs(Outputs { top_logprobs: 1024, ..Outputs::default() })
                .build()
                .unwrap(),
            PipelineBuilder::new("G", DType::F32, DType::F32).penalties("p").filter("f", 1).argmax().build().unwrap(),
        ] {
            let text = p.to_string();
            assert_eq!(Pipeline::parse(&text).unwrap(), p, "{text}");
        }
        let mut changed = p.clone();
        changed.transforms[2] = Transform::Filter { operand: "filter".into(), max_k: 65 };
        assert_ne!(changed.fingerprint(), p.fingerprint(), "max_k is part of the fingerprint");
        // The IR rules hold on parsed text too.
        let bad = text.replace("max_k=64", "max_k=0");
        assert_eq!(
            Pipeline::parse(&bad),
            Err(ParseError::Invalid(IrError::InvalidFilterCapacity { max_k: 0, at: 2 }))
        );
        let bad = text.replace("top_logprobs=5", "top_logprobs=1025");
        assert_eq!(Pipeline::parse(&bad), Err(ParseError::Invalid(IrError::InvalidTopLogprobs { n: 1025 })));
        let swapped = text
            .replace("logits = temperature(logits, per_row temperature)", "TMP")
            .replace("logits = filter(logits, filter, max_k=64)", "logits = temperature(logits, per_row temperature)")
            .replace("TMP", "logits = filter(logits, filter, max_k=64)");
        assert_eq!(Pipeline::parse(&swapped), Err(ParseError::Invalid(IrError::FilterNotLast { at: 1 })));
        let bad = text.replace("max_k=64", "k=64");
        assert!(matches!(Pipeline::parse(&bad), Err(ParseError::Syntax { line: 7, .. })), "{:?}", Pipeline::parse(&bad));
    }

    #[test]
    fn logit_bias_round_trips_and_comes_before_penalties_and_temperature() {
        let p = PipelineBuilder::new("Serve", DType::BF16, DType::BF16)
            .softcap(30.0)
            .logit_bias("logit_bias")
            .bias("bias")
            .penalties("penalties")
            .temperature_per_row("temperature")
            .build()
            .unwrap();
        let text = p.to_string();
        assert!(text.contains("\n  logits = logit_bias(logits, logit_bias)\n"), "{text}");
        assert_eq!(Pipeline::parse(&text).unwrap(), p, "{text}");
        assert!(p.has_logit_bias());
        let mut without = p.clone();
        without.transforms.remove(1);
        assert!(!without.has_logit_bias());
        assert_ne!(without.fingerprint(), p.fingerprint());
        // After the temperature or the penalties it is an error naming the one it follows.
        let late = text
            .replace("  logits = logit_bias(logits, logit_bias)\n", "")
            .replace("  sample =", "  logits = logit_bias(logits, logit_bias)\n  sample =");
        assert_eq!(
            Pipeline::parse(&late),
            Err(ParseError::Invalid(IrError::LogitBiasOrder { after: "penalties", at: 4 }))
        );
        let after_temperature = PipelineBuilder::new("T", DType::F32, DType::F32).temperature_scalar("t").logit_bias("lb").build();
        assert_eq!(after_temperature, Err(IrError::LogitBiasOrder { after: "temperature", at: 1 }));
        assert_eq!(after_temperature.unwrap_err().location(), crate::Location::Transform(1));
        let twice = PipelineBuilder::new("D", DType::F32, DType::F32).logit_bias("a").logit_bias("b").build();
        assert_eq!(twice, Err(IrError::DuplicateTransform { kind: "logit_bias", at: 1 }));
        let shared = PipelineBuilder::new("S", DType::F32, DType::F32).logit_bias("bias").bias("bias").build();
        assert!(matches!(shared, Err(IrError::DuplicateOperand { .. })), "{shared:?}");
    }

    #[test]
    fn snapshot_ir_text() {
        insta::assert_snapshot!("qwen_sampler", qwen().to_string());
        insta::assert_snapshot!(
            "greedy_f16",
            PipelineBuilder::new("Greedy", DType::F16, DType::F16).softcap(15.0).argmax().build().unwrap().to_string()
        );
        insta::assert_snapshot!(
            "serving_logit_bias",
            PipelineBuilder::new("Serving", DType::BF16, DType::BF16)
                .logit_bias("logit_bias")
                .penalties("penalties")
                .temperature_per_row("temperature")
                .filter("filter", 64)
                .outputs(Outputs { score: false, logsumexp: false, logprob: true, top_logprobs: 5 })
                .build()
                .unwrap()
                .to_string()
        );
        insta::assert_snapshot!(
            "scalar_temperature_logprob",
            PipelineBuilder::new("Chat", DType::BF16, DType::BF16)
                .temperature_scalar("t")
                .outputs(Outputs { score: false, logsumexp: false, logprob: true, top_logprobs: 0 })
                .build()
                .unwrap()
                .to_string()
        );
        insta::assert_snapshot!(
            "speculative_sampled",
            PipelineBuilder::new("Verifier", DType::BF16, DType::BF16)
                .temperature_per_row("temperature")
                .penalties("penalties")
                .filter("filter", 64)
                .verify_sampled("drafts", "draft_probs")
                .outputs(Outputs { score: false, logsumexp: false, logprob: true, top_logprobs: 0 })
                .build()
                .unwrap()
                .to_string()
        );
    }

    #[test]
    fn verify_takes_one_sample_and_no_targets() {
        use crate::{IrError, Location};
        let b = || PipelineBuilder::new("S", DType::F32, DType::F32).verify_sampled("drafts", "q");
        assert!(b().build().is_ok());
        assert_eq!(b().gumbel("seed", 2).build(), Err(IrError::VerifySamples { samples: 2 }));
        assert_eq!(b().target_logprob("targets").build(), Err(IrError::VerifyWithTargets));
        let logprob = crate::Outputs { logprob: true, ..Default::default() };
        assert_eq!(b().outputs(logprob).logprob_mode(crate::LogprobMode::Raw).build(), Err(IrError::VerifyWithRawLogprobs));
        assert!(b().outputs(logprob).build().is_ok(), "processed logprobs of the emitted tokens");
        assert!(matches!(
            PipelineBuilder::new("S", DType::F32, DType::F32).verify_sampled("drafts", "drafts").build(),
            Err(IrError::DuplicateOperand { at: Location::Verify, .. })
        ));
        let text = b().build().unwrap().to_string().replace("verify(logits, drafts, q)", "verify(logits)");
        assert!(matches!(Pipeline::parse(&text), Err(ParseError::Syntax { .. })));
    }

    #[test]
    fn fingerprint_distinguishes_pipelines() {
        let a = qwen();
        let mut b = qwen();
        b.transforms.pop();
        assert_ne!(a.fingerprint(), b.fingerprint());
    }

    #[test]
    fn rejects_bad_text() {
        let bad = qwen().to_string().replace("softcap(logits, 30.0)", "softcap(logits, -1.0)");
        assert!(matches!(Pipeline::parse(&bad), Err(ParseError::Invalid(IrError::InvalidSoftcap { .. }))));
        let bad = qwen().to_string().replace("softcap", "frobnicate");
        assert!(matches!(Pipeline::parse(&bad), Err(ParseError::Syntax { line: 9, .. })), "{:?}", Pipeline::parse(&bad));
        let bad = qwen().to_string().replace("weights: bf16[V, D]", "weights: bf16[V, K]");
        assert!(matches!(Pipeline::parse(&bad), Err(ParseError::Invalid(IrError::ContractionMismatch { .. }))));
        let dup = qwen().to_string().replace("bias(logits, bias)", "bias(logits, allowed)");
        assert!(matches!(Pipeline::parse(&dup), Err(ParseError::Invalid(IrError::DuplicateOperand { .. }))));
    }
}
