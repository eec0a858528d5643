//! Lowering: syntax tree → [`flashsample_ir::Pipeline`], every error at the tokens that caused it.
//!
//! The macro checks what only the surface syntax knows (op names, statement order, operand
//! shapes like `bias[V]`), gathering all such errors; then the real IR validator runs, and its
//! [`IrError`] is mapped back to source tokens through the spans kept here. The rules thus
//! live in one place (`flashsample_ir::validate`) and the macro cannot drift from the runtime.

use crate::ast::{Arg, BinOp, Call, Expr, OperandDecl, PipelineDef, SpanRange, Stmt};
use flashsample_ir::{
    DType, IrError, Location, LogprobMode, Operand, Outputs, Pipeline, Sampler, Temperature, Transform, F32, MAX_SAMPLES_PER_ROW,
};
use syn::Ident;

/// Op names a statement may call (for the "unknown op" message).
const OPS: &str = "`matmul`, `mask`, `ban`, `softcap`, `logit_bias`, `penalties`, `top_k_top_p`, `gumbel_argmax`, `argmax` \
                   (temperature and bias are written `logits / temperature[B]` and `logits + bias[V]`)";

/// The call-form transforms, lowered by [`transform`]; `matmul` and the samplers are separate.
const TRANSFORM_OPS: [&str; 6] = ["mask", "ban", "softcap", "logit_bias", "penalties", "top_k_top_p"];

const FILTER_USAGE: &str = "`top_k_top_p(logits, filter[B], max_k = K)`";

const USED_BEFORE_DEFINED: &str =
    "`logits` is used before it is defined: the first statement must be `logits = matmul(hidden, weights);`";

/// Errors gathered while lowering one pipeline, reported together.
#[derive(Default)]
pub struct Errors(Option<syn::Error>);

impl Errors {
    pub fn push(&mut self, e: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(e),
            None => self.0 = Some(e),
        }
    }
    fn is_empty(&self) -> bool {
        self.0.is_none()
    }
    pub fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}

/// Where one IR transform was written.
pub struct TransformSrc {
    pub stmt: SpanRange,
    /// The runtime operand's name as written, so generated parameters carry the user's span.
    pub operand: Option<Ident>,
    /// The constant (temperature, cap, or the filter's `max_k` value).
    pub value: Option<SpanRange>,
}

/// Where the sampler was written.
pub struct SamplerSrc {
    pub stmt: SpanRange,
    pub seed: Option<Ident>,
    pub samples: Option<SpanRange>,
}

/// A validated pipeline and where each of its parts was written.
pub struct Lowered<'a> {
    pub def: &'a PipelineDef,
    pub pipeline: Pipeline,
    pub hidden: &'a OperandDecl,
    pub weights: &'a OperandDecl,
    /// Parallel to `pipeline.transforms`.
    pub transforms: Vec<TransformSrc>,
    pub sampler: SamplerSrc,
    pub outputs: Option<OutputsSrc>,
    /// Where `score = target_logprob(logits, targets[B]);` was written, if it was.
    pub targets: Option<TargetsSrc>,
    /// Where `accept = verify(logits, drafts[N][, draft_probs[N, V]]);` was written, if it was.
    pub verify: Option<VerifySrc>,
}

/// Where the verification op was written.
pub struct VerifySrc {
    pub stmt: SpanRange,
    /// The draft tokens' operand as written.
    pub drafts: Ident,
    /// The draft distributions' operand as written (sampled drafts).
    pub draft_probs: Option<Ident>,
}

/// Where the scored targets were written.
pub struct TargetsSrc {
    /// The operand's name as written.
    pub operand: Ident,
    /// Whether `rank` was written as the third argument.
    pub rank: bool,
}

/// Where `outputs(...)` was written.
pub struct OutputsSrc {
    pub stmt: SpanRange,
    /// The `N` of `top_logprobs = N`.
    pub top_logprobs: Option<SpanRange>,
    /// The logprob mode (`raw` / `processed`), if one was written.
    pub mode: Option<SpanRange>,
}

/// The symbolic batch and vocabulary dimensions, `None` where the declaration was broken
/// (its error is already reported; shape checks against it would only add noise).
struct Dims {
    batch: Option<String>,
    vocab: Option<String>,
}

pub fn lower(def: &PipelineDef) -> syn::Result<Lowered<'_>> {
    let mut errors = Errors::default();
    let [hidden, weights] = match def.operands.as_slice() {
        [h, w] => [h, w],
        ops => {
            return Err(def.operands_range.error(format!(
                "a pipeline declares exactly two operands, `hidden: dtype[B, D], weights: dtype[V, D]`; found {}",
                ops.len()
            )))
        }
    };
    let hidden_op = operand(hidden, &mut errors);
    let weights_op = operand(weights, &mut errors);
    if let (Some(h), Some(w)) = (&hidden_op, &weights_op) {
        if h.dims[1] != w.dims[1] {
            // Checked here as well as by the IR so it is reported together with the other errors.
            let e = IrError::ContractionMismatch {
                hidden: h.name.clone(),
                hidden_dim: h.dims[1].clone(),
                weights: w.name.clone(),
                weights_dim: w.dims[1].clone(),
            };
            errors.push(syn::Error::new_spanned(&weights.dims[1], e));
        }
    }
    // From the declarations' dims alone, so a bad dtype does not hide shape errors.
    let rows = |d: &OperandDecl| (d.dims.len() == 2).then(|| d.dims[0].to_string());
    let dims = Dims {
        batch: rows(hidden),
        vocab: rows(weights),
    };

    let mut matmul_seen = false;
    let mut sampler_seen = false;
    let mut transforms = Vec::new();
    let mut srcs = Vec::new();
    let mut sampler: Option<(Sampler, SamplerSrc)> = None;
    let mut outputs: Option<(Outputs, LogprobMode, OutputsSrc)> = None;
    let mut targets: Option<TargetsSrc> = None;
    let mut verify: Option<VerifySrc> = None;
    for stmt in &def.stmts {
        let range = stmt.range();
        match stmt {
            Stmt::Assign { target, expr, .. } if target == "logits" => {
                if let Expr::Call(c) = expr {
                    if c.func == "matmul" {
                        if sampler_seen {
                            errors.push(range.error("only `outputs(...)` may follow the sampler"));
                        } else if matmul_seen {
                            errors.push(range.error("`logits` is already defined: a pipeline has one `matmul`, first"));
                        } else if let Err(e) = check_matmul(c, hidden, weights) {
                            errors.push(e);
                        }
                        matmul_seen = true;
                        continue;
                    }
                    if c.func == "gumbel_argmax" || c.func == "argmax" {
                        errors.push(syn::Error::new_spanned(
                            target,
                            format!("a sampler assigns `sample`: write `sample = {}(...);`", c.func),
                        ));
                        sampler_seen = true;
                        continue;
                    }
                    if !TRANSFORM_OPS.iter().any(|op| c.func == op) {
                        errors.push(unknown_op(&c.func));
                        continue;
                    }
                }
                if sampler_seen {
                    errors.push(range.error("only `outputs(...)` may follow the sampler"));
                } else if !matmul_seen {
                    errors.push(range.error(USED_BEFORE_DEFINED));
                }
                match transform(expr, range, &dims) {
                    Ok((t, src)) => {
                        transforms.push(t);
                        srcs.push(src);
                    }
                    Err(e) => errors.push(e),
                }
            }
            Stmt::Assign { target, expr, .. } if target == "sample" => match expr {
                // Any `sample = ...` counts as the sampler, so one bad sampler is one error, not
                // also "no sampler" and "outputs before the sampler".
                Expr::Call(c) if c.func == "gumbel_argmax" || c.func == "argmax" => {
                    if sampler_seen {
                        errors.push(range.error("a second sampler: a pipeline has exactly one `sample = ...;`"));
                    } else if !matmul_seen {
                        errors.push(range.error(USED_BEFORE_DEFINED));
                    }
                    match lower_sampler(c, range) {
                        Ok(s) if !sampler_seen => sampler = Some(s),
                        Ok(_) => {}
                        Err(e) => errors.push(e),
                    }
                    sampler_seen = true;
                }
                Expr::Call(c) if c.func != "matmul" && !TRANSFORM_OPS.iter().any(|op| c.func == op) => {
                    errors.push(unknown_op(&c.func));
                    sampler_seen = true;
                }
                _ => {
                    errors.push(range.error(
                        "`sample = ...` takes a sampler: `gumbel_argmax(logits, seed, samples = N)` or `argmax(logits)`",
                    ));
                    sampler_seen = true;
                }
            },
            Stmt::Assign { target, expr, .. } if target == "score" => {
                if !sampler_seen {
                    errors.push(range.error("`score = target_logprob(...)` comes after the sampler"));
                } else if outputs.is_some() {
                    errors.push(range.error("`score = target_logprob(...)` comes before `outputs(...)`"));
                }
                if targets.is_some() {
                    errors.push(range.error("a pipeline scores one operand: one `score = target_logprob(logits, targets[B]);`"));
                }
                match lower_targets(expr, range, &dims) {
                    Ok(t) => {
                        targets.get_or_insert(t);
                    }
                    Err(e) => errors.push(e),
                }
            }
            Stmt::Assign { target, expr, .. } if target == "accept" => {
                if !sampler_seen {
                    errors.push(range.error("`accept = verify(...)` comes after the sampler"));
                } else if outputs.is_some() {
                    errors.push(range.error("`accept = verify(...)` comes before `outputs(...)`"));
                }
                if verify.is_some() {
                    errors.push(range.error("a pipeline verifies one set of drafts: one `accept = verify(...)`"));
                }
                match lower_verify(expr, range, &dims) {
                    Ok(v) => {
                        verify.get_or_insert(v);
                    }
                    Err(e) => errors.push(e),
                }
            }
            Stmt::Assign { target, .. } => errors.push(syn::Error::new_spanned(
                target,
                format!(
                    "cannot assign `{target}`: statements assign `logits` (matmul, transforms), `sample` (the sampler), \
                     `score` (`target_logprob`) or `accept` (`verify`)"
                ),
            )),
            Stmt::Call { call, .. } if call.func == "outputs" => {
                if !sampler_seen {
                    errors.push(range.error("`outputs(...)` comes after the sampler"));
                }
                if outputs.is_some() {
                    errors.push(range.error("`outputs(...)` appears twice: list every output in one"));
                }
                match lower_outputs(call) {
                    Ok(lowered) => {
                        outputs.get_or_insert(lowered.with_stmt(range));
                    }
                    Err(e) => errors.push(e),
                }
            }
            Stmt::Call { call, .. } => errors.push(syn::Error::new_spanned(
                &call.func,
                format!(
                    "expected `logits = ...;`, `sample = ...;` or `outputs(...);`, found a bare `{}(...)` call",
                    call.func
                ),
            )),
        }
    }
    if !matmul_seen && errors.is_empty() {
        errors.push(syn::Error::new_spanned(
            &def.name,
            format!("pipeline `{}` has no `logits = matmul(hidden, weights);`", def.name),
        ));
    }
    if !sampler_seen {
        errors.push(syn::Error::new_spanned(
            &def.name,
            format!(
                "pipeline `{}` has no sampler: end it with `sample = gumbel_argmax(logits, seed, samples = 1);` \
                 or `sample = argmax(logits);`",
                def.name
            ),
        ));
    }
    errors.finish()?;
    // Every `None` here was reported above, so this is unreachable; still an error, not a panic.
    let (Some(hidden_op), Some(weights_op), Some((sampler, sampler_src))) = (hidden_op, weights_op, sampler) else {
        return Err(syn::Error::new_spanned(
            &def.name,
            "flashsample! internal error: incomplete pipeline",
        ));
    };
    let (outputs, logprob_mode, outputs_src) =
        outputs.map_or((Outputs::default(), LogprobMode::Processed, None), |(o, mode, src)| (o, mode, Some(src)));
    let lowered = Lowered {
        def,
        pipeline: Pipeline {
            name: def.name.to_string(),
            hidden: hidden_op,
            weights: weights_op,
            transforms,
            sampler,
            outputs,
            targets: targets.as_ref().map(|t| flashsample_ir::Targets { operand: t.operand.to_string(), rank: t.rank }),
            verify: verify.as_ref().map(|v| flashsample_ir::Verify {
                drafts: v.drafts.to_string(),
                draft_probs: v.draft_probs.as_ref().map(Ident::to_string),
            }),
            logprob_mode,
        },
        hidden,
        weights,
        transforms: srcs,
        sampler: sampler_src,
        outputs: outputs_src,
        targets,
        verify,
    };
    match lowered.pipeline.validate() {
        Ok(()) => Ok(lowered),
        Err(e) => Err(ir_error_span(&e, &lowered).error(&e)),
    }
}

fn unknown_op(func: &Ident) -> syn::Error {
    syn::Error::new_spanned(func, format!("unknown op `{func}`; expected one of {OPS}"))
}

/// `name: dtype[rows, cols]` → IR operand, or `None` after reporting why not.
fn operand(decl: &OperandDecl, errors: &mut Errors) -> Option<Operand> {
    let dtype = DType::from_name(&decl.dtype.to_string());
    if dtype.is_none() {
        errors.push(syn::Error::new_spanned(
            &decl.dtype,
            format!("unknown dtype `{}`; expected `bf16`, `f16` or `f32`", decl.dtype),
        ));
    }
    let dims: Vec<String> = decl.dims.iter().map(Ident::to_string).collect();
    let dims: Option<[String; 2]> = dims.try_into().ok();
    if dims.is_none() {
        errors.push(
            SpanRange(decl.bracket.span.open(), decl.bracket.span.close()).error(format!(
                "operands are rank 2, `{}: dtype[rows, cols]`; found {} dimension(s)",
                decl.name,
                decl.dims.len()
            )),
        );
    }
    Some(Operand {
        name: decl.name.to_string(),
        dtype: dtype?,
        dims: dims?,
    })
}

fn check_matmul(c: &Call, hidden: &OperandDecl, weights: &OperandDecl) -> syn::Result<()> {
    let expected = format!(
        "matmul takes the declared operands in declaration order: `matmul({}, {})`",
        hidden.name, weights.name
    );
    let args: Vec<&Arg> = c.args.iter().collect();
    let [a, b] = args.as_slice() else {
        return Err(c.range().error(expected));
    };
    for (arg, decl) in [(a, hidden), (b, weights)] {
        match arg {
            Arg::Ident(i) if *i == decl.name => {}
            Arg::Ident(i) if *i != hidden.name && *i != weights.name => {
                return Err(syn::Error::new_spanned(
                    i,
                    format!("`{i}` is not a declared operand; {expected}"),
                ))
            }
            other => return Err(other.range().error(expected)),
        }
    }
    Ok(())
}

/// `verify(logits, drafts[N])` (greedy drafts) or `verify(logits, drafts[N], draft_probs[N, V])`
/// (sampled drafts): `N` is the drafts' count, `S·k`, any symbol, the same in both.
fn lower_verify(expr: &Expr, stmt: SpanRange, dims: &Dims) -> syn::Result<VerifySrc> {
    const USAGE: &str = "`accept = verify(logits, drafts[N]);` or `accept = verify(logits, drafts[N], draft_probs[N, V]);`";
    let Expr::Call(c) = expr else {
        return Err(stmt.error(format!("`accept = ...` takes {USAGE}")));
    };
    if c.func != "verify" {
        return Err(syn::Error::new_spanned(&c.func, format!("unknown verification op `{}`: {USAGE}", c.func)));
    }
    let args: Vec<&Arg> = c.args.iter().collect();
    let (first, drafts, probs) = match args.as_slice() {
        [first, drafts] => (first, drafts, None),
        [first, drafts, probs] => (first, drafts, Some(probs)),
        _ => return Err(c.range().error(format!("`verify` takes two or three arguments: {USAGE}"))),
    };
    expect_logits(first, "verify")?;
    let count = match drafts {
        Arg::Indexed { dims: d, .. } if d.len() == 1 => Some(d[0].to_string()),
        _ => None,
    };
    let what = "the draft tokens, `S·k` of them (S sequences of k drafts)";
    let drafts = check_shape(drafts, what, "drafts[N]", &[&count.clone().or(Some("N".into()))])?;
    let draft_probs = match probs {
        Some(q) => Some(check_shape(q, "the draft distributions, one f32 row per draft", "draft_probs[N, V]", &[&count, &dims.vocab])?),
        None => None,
    };
    Ok(VerifySrc { stmt, drafts, draft_probs })
}

/// Checks `name[dims]` against the expected symbolic shape.
/// `target_logprob(logits, targets[B][, rank])`: the scored tokens, one per row, and whether
/// their ranks are reported.
fn lower_targets(expr: &Expr, stmt: SpanRange, dims: &Dims) -> syn::Result<TargetsSrc> {
    const USAGE: &str = "`score = target_logprob(logits, targets[B]);` or `score = target_logprob(logits, targets[B], rank);`";
    let Expr::Call(c) = expr else {
        return Err(stmt.error(format!("`score = ...` takes {USAGE}")));
    };
    if c.func != "target_logprob" {
        return Err(syn::Error::new_spanned(&c.func, format!("unknown scoring op `{}`: {USAGE}", c.func)));
    }
    let args: Vec<&Arg> = c.args.iter().collect();
    let (first, arg, rank) = match args.as_slice() {
        [first, arg] => (first, arg, None),
        [first, arg, rank] => (first, arg, Some(rank)),
        _ => return Err(c.range().error(format!("`target_logprob` takes two or three arguments: {USAGE}"))),
    };
    expect_logits(first, "target_logprob")?;
    let operand = check_shape(arg, "the token to score in each row (one u32 per row)", "targets[B]", &[&dims.batch])?;
    if let Some(r) = rank {
        if !matches!(r, Arg::Ident(i) if i == "rank") {
            return Err(r.range().error(format!("the third argument of `target_logprob` is `rank`: {USAGE}")));
        }
    }
    Ok(TargetsSrc { operand, rank: rank.is_some() })
}

fn check_shape(arg: &Arg, what: &str, example: &str, expected: &[&Option<String>]) -> syn::Result<Ident> {
    let (name, bracket, dims) = match arg {
        Arg::Indexed { name, bracket, dims } => (name, bracket, dims),
        Arg::Ident(i) => {
            return Err(syn::Error::new_spanned(
                i,
                format!("declare the shape of `{i}`: {what}, `{example}`"),
            ))
        }
        other => {
            return Err(other
                .range()
                .error(format!("expected a runtime operand: {what}, `{example}`")))
        }
    };
    let Some(expected) = expected.iter().map(|d| d.as_deref()).collect::<Option<Vec<&str>>>() else {
        return Ok(name.clone()); // the declaration is broken and already reported
    };
    let found: Vec<String> = dims.iter().map(Ident::to_string).collect();
    if found != expected {
        return Err(SpanRange(bracket.span.open(), bracket.span.close()).error(format!(
            "wrong shape for `{name}`: {what} is `[{}]`, found `[{}]`",
            expected.join(", "),
            found.join(", ")
        )));
    }
    Ok(name.clone())
}

fn expect_logits(arg: &Arg, op: &str) -> syn::Result<()> {
    if arg.is_ident("logits") {
        Ok(())
    } else {
        Err(arg.range().error(format!("`{op}` applies to `logits`")))
    }
}

fn transform(expr: &Expr, stmt: SpanRange, dims: &Dims) -> syn::Result<(Transform, TransformSrc)> {
    let batch = &dims.batch;
    let vocab = &dims.vocab;
    let src = |operand: Option<Ident>, value: Option<SpanRange>| TransformSrc { stmt, operand, value };
    match expr {
        Expr::Binary { lhs, op, rhs } => {
            if lhs != "logits" {
                return Err(syn::Error::new_spanned(
                    lhs,
                    format!("transforms apply to `logits`, found `{lhs}`"),
                ));
            }
            match (op, rhs) {
                (BinOp::Div, Arg::Number(n)) => Ok((
                    Transform::Temperature(Temperature::Const(F32::new(n.f32()?))),
                    src(None, Some(n.range())),
                )),
                (BinOp::Div, Arg::Ident(i)) => Ok((
                    Transform::Temperature(Temperature::Scalar { operand: i.to_string() }),
                    src(Some(i.clone()), None),
                )),
                (BinOp::Div, arg @ Arg::Indexed { .. }) => {
                    let name = check_shape(
                        arg,
                        "a per-row temperature (one f32 per row of the hidden states)",
                        "temperature[B]",
                        &[batch],
                    )?;
                    Ok((
                        Transform::Temperature(Temperature::PerRow {
                            operand: name.to_string(),
                        }),
                        src(Some(name), None),
                    ))
                }
                (BinOp::Div, other) => Err(other.range().error(
                    "a temperature is a constant (`logits / 0.7`), a scalar operand (`logits / temperature`) \
                     or a per-row operand (`logits / temperature[B]`)",
                )),
                (BinOp::Add, arg) => {
                    let name = check_shape(
                        arg,
                        "an additive bias (one f32 per vocabulary token)",
                        "bias[V]",
                        &[vocab],
                    )?;
                    Ok((
                        Transform::Bias {
                            operand: name.to_string(),
                        },
                        src(Some(name), None),
                    ))
                }
                (BinOp::Other(c, span), _) => Err(SpanRange::single(*span).error(format!(
                    "unsupported operator `{c}`: `logits / temperature` scales, `logits + bias[V]` adds a bias"
                ))),
            }
        }
        Expr::Call(c) => {
            let func = c.func.to_string();
            let usage = match func.as_str() {
                "mask" => "mask(logits, allowed[B, V])",
                "ban" => "ban(logits, banned[B])",
                "penalties" => "penalties(logits, penalties[B])",
                "logit_bias" => "logit_bias(logits, logit_bias[B])",
                "top_k_top_p" => return filter(c, stmt, batch),
                _ => "softcap(logits, 30.0)",
            };
            let args: Vec<&Arg> = c.args.iter().collect();
            let [first, arg] = args.as_slice() else {
                return Err(c.range().error(format!("`{func}` takes two arguments: `{usage}`")));
            };
            expect_logits(first, &func)?;
            match func.as_str() {
                "mask" => {
                    let name = check_shape(arg, "an allowed-token mask", "allowed[B, V]", &[batch, vocab])?;
                    Ok((
                        Transform::Mask {
                            operand: name.to_string(),
                        },
                        src(Some(name), None),
                    ))
                }
                "ban" => {
                    let name = check_shape(arg, "banned-token lists (one list per row)", "banned[B]", &[batch])?;
                    Ok((
                        Transform::Ban {
                            operand: name.to_string(),
                        },
                        src(Some(name), None),
                    ))
                }
                "logit_bias" => {
                    let name = check_shape(
                        arg,
                        "per-request logit biases (a `{token: bias}` map per row)",
                        "logit_bias[B]",
                        &[batch],
                    )?;
                    Ok((
                        Transform::LogitBias {
                            operand: name.to_string(),
                        },
                        src(Some(name), None),
                    ))
                }
                "penalties" => {
                    let name = check_shape(
                        arg,
                        "per-row penalties (repetition, presence, frequency and a token history per row)",
                        "penalties[B]",
                        &[batch],
                    )?;
                    Ok((
                        Transform::Penalties {
                            operand: name.to_string(),
                        },
                        src(Some(name), None),
                    ))
                }
                _ => match arg {
                    Arg::Number(n) => Ok((
                        Transform::Softcap {
                            cap: F32::new(n.f32()?),
                        },
                        src(None, Some(n.range())),
                    )),
                    other => Err(other.range().error(format!("the cap is a constant: `{usage}`"))),
                },
            }
        }
    }
}

/// `top_k_top_p(logits, filter[B], max_k = K)`. The range of `K` and the filter's position
/// (last transform) are left to `Pipeline::validate`, whose errors `ir_error_span` maps back
/// to `K` and to this statement, so those rules are stated once, in the IR.
fn filter(c: &Call, stmt: SpanRange, batch: &Option<String>) -> syn::Result<(Transform, TransformSrc)> {
    let args: Vec<&Arg> = c.args.iter().collect();
    let (first, arg, max_k) = match args.as_slice() {
        [first, arg, max_k] => (first, arg, max_k),
        // Reported before the operands are checked so a missing `max_k` is not hidden behind
        // an operand error; the message says why the capacity is not a runtime value.
        [_, _] => {
            return Err(c.range().error(format!(
                "`top_k_top_p` needs `max_k = K`, the capacity of its fused candidate lists \
                 (the largest per-row top-k, and the most tokens a top-p / min-p nucleus may keep; \
                 fixed when the kernel is compiled): {FILTER_USAGE}"
            )));
        }
        _ => return Err(c.range().error(format!("`top_k_top_p` takes three arguments: {FILTER_USAGE}"))),
    };
    expect_logits(first, "top_k_top_p")?;
    let name = check_shape(
        arg,
        "per-row top-k / top-p / min-p settings (one per row)",
        "filter[B]",
        &[batch],
    )?;
    let value = match max_k {
        Arg::Named { name, value } if name == "max_k" => value,
        Arg::Named { name, .. } => {
            return Err(syn::Error::new_spanned(
                name,
                format!("unknown argument `{name}`; expected {FILTER_USAGE}"),
            ))
        }
        other => {
            return Err(other
                .range()
                .error(format!("the capacity is a named constant: {FILTER_USAGE}")))
        }
    };
    Ok((
        Transform::Filter {
            operand: name.to_string(),
            max_k: value.u32()?,
        },
        TransformSrc {
            stmt,
            operand: Some(name),
            value: Some(value.range()),
        },
    ))
}

fn lower_sampler(c: &Call, stmt: SpanRange) -> syn::Result<(Sampler, SamplerSrc)> {
    let args: Vec<&Arg> = c.args.iter().collect();
    if c.func == "argmax" {
        let [first] = args.as_slice() else {
            return Err(c.range().error("expected `argmax(logits)`"));
        };
        expect_logits(first, "argmax")?;
        return Ok((
            Sampler::Argmax,
            SamplerSrc {
                stmt,
                seed: None,
                samples: None,
            },
        ));
    }
    let usage = "expected `gumbel_argmax(logits, seed, samples = N)`";
    let (first, seed, samples) = match args.as_slice() {
        [first, seed] => (first, seed, None),
        [first, seed, samples] => (first, seed, Some(samples)),
        _ => return Err(c.range().error(usage)),
    };
    expect_logits(first, "gumbel_argmax")?;
    let Arg::Ident(seed) = seed else {
        return Err(seed
            .range()
            .error("the seed is a runtime `u64` operand: name it, e.g. `seed`"));
    };
    let (count, range) = match samples {
        None => (1, None),
        Some(Arg::Named { name, value }) if name == "samples" => (value.u32()?, Some(value.range())),
        Some(Arg::Named { name, .. }) => {
            return Err(syn::Error::new_spanned(
                name,
                format!("unknown argument `{name}`; {usage}"),
            ))
        }
        Some(other) => return Err(other.range().error(usage)),
    };
    if let Some(range) = range {
        if count == 0 || count > MAX_SAMPLES_PER_ROW {
            return Err(range.error(IrError::InvalidSampleCount { samples: count }));
        }
    }
    Ok((
        Sampler::GumbelMax {
            seed: seed.to_string(),
            samples: count,
        },
        SamplerSrc {
            stmt,
            seed: Some(seed.clone()),
            samples: range,
        },
    ))
}

/// What `outputs(...)` lowered to, before its statement's span is attached.
struct LoweredOutputs {
    outputs: Outputs,
    mode: LogprobMode,
    top_logprobs: Option<SpanRange>,
    mode_at: Option<SpanRange>,
}

impl LoweredOutputs {
    fn with_stmt(self, stmt: SpanRange) -> (Outputs, LogprobMode, OutputsSrc) {
        (self.outputs, self.mode, OutputsSrc { stmt, top_logprobs: self.top_logprobs, mode: self.mode_at })
    }
}

/// `outputs(score, logsumexp, logprob, top_logprobs = N, raw)`, any non-empty subset in any
/// order, with at most one logprob mode (`raw` or `processed`, the default); also returns
/// where `N` and the mode were written. Their rules are checked by `Pipeline::validate`.
fn lower_outputs(c: &Call) -> syn::Result<LoweredOutputs> {
    const EXPECTED: &str = "`score`, `logsumexp`, `logprob`, `top_logprobs = N`, and the logprob mode `raw` or `processed`";
    let mut o = Outputs::default();
    let mut top_logprobs: Option<SpanRange> = None;
    let mut mode: Option<(LogprobMode, SpanRange)> = None;
    if c.args.is_empty() {
        return Err(c.range().error(format!("`outputs` lists at least one of {EXPECTED}")));
    }
    for arg in &c.args {
        let flag = match arg {
            Arg::Ident(i) if i == "score" => &mut o.score,
            Arg::Ident(i) if i == "logsumexp" => &mut o.logsumexp,
            Arg::Ident(i) if i == "logprob" => &mut o.logprob,
            Arg::Ident(i) if i == "raw" || i == "processed" => {
                if mode.is_some() {
                    return Err(arg.range().error("`outputs` names at most one logprob mode: `raw` or `processed`"));
                }
                let m = if i == "raw" { LogprobMode::Raw } else { LogprobMode::Processed };
                mode = Some((m, arg.range()));
                continue;
            }
            Arg::Named { name, value } if name == "top_logprobs" => {
                if top_logprobs.is_some() {
                    return Err(arg.range().error("this output is listed twice"));
                }
                o.top_logprobs = value.u32()?;
                top_logprobs = Some(value.range());
                continue;
            }
            Arg::Ident(i) if i == "top_logprobs" => {
                return Err(syn::Error::new_spanned(
                    i,
                    "`top_logprobs` takes a count: `top_logprobs = N`, the N most likely tokens of each row",
                ))
            }
            other => return Err(other.range().error(format!("unknown output; expected any of {EXPECTED}"))),
        };
        if std::mem::replace(flag, true) {
            return Err(arg.range().error("this output is listed twice"));
        }
    }
    Ok(LoweredOutputs {
        outputs: o,
        mode: mode.map_or(LogprobMode::Processed, |m| m.0),
        top_logprobs,
        mode_at: mode.map(|m| m.1),
    })
}

/// The tokens an [`IrError`] is about.
fn ir_error_span(e: &IrError, l: &Lowered) -> SpanRange {
    let ident = |i: &Ident| SpanRange::single(i.span());
    // Within an operand declaration, the token spelling `name` (the name or a dimension).
    let in_decl = |decl: &OperandDecl, name: &str| {
        std::iter::once(&decl.name)
            .chain(decl.dims.iter())
            .find(|i| *i == name)
            .map_or(decl.range(), ident)
    };
    let transform = |i: usize| l.transforms.get(i);
    match e {
        IrError::ContractionMismatch { .. } => ident(&l.weights.dims[1]),
        IrError::BatchIsVocab(_) => {
            if l.pipeline.hidden.dims[0] == l.pipeline.weights.dims[0] {
                ident(&l.weights.dims[0])
            } else {
                ident(&l.hidden.dims[1])
            }
        }
        IrError::DuplicateTransform { at, .. } => transform(*at).map_or(l.sampler.stmt, |t| t.stmt),
        IrError::InvalidSoftcap { at, .. } | IrError::InvalidTemperature { at, .. } => {
            transform(*at).map_or(l.sampler.stmt, |t| t.value.unwrap_or(t.stmt))
        }
        IrError::InvalidFilterCapacity { at, .. } => transform(*at).map_or(l.sampler.stmt, |t| t.value.unwrap_or(t.stmt)),
        // The rule is about the filter's place, so the whole filter statement; what follows it
        // is visible right below.
        IrError::FilterNotLast { at } => transform(*at).map_or(l.sampler.stmt, |t| t.stmt),
        // The rule is about the logit bias's place: its whole statement.
        IrError::LogitBiasOrder { at, .. } => transform(*at).map_or(l.sampler.stmt, |t| t.stmt),
        IrError::InvalidSampleCount { .. } => l.sampler.samples.unwrap_or(l.sampler.stmt),
        IrError::InvalidTopLogprobs { .. } => l
            .outputs
            .as_ref()
            .map_or(l.sampler.stmt, |o| o.top_logprobs.unwrap_or(o.stmt)),
        IrError::InvalidName { name, .. } | IrError::DuplicateOperand { name, .. } => match e.location() {
            Location::Name => ident(&l.def.name),
            Location::Hidden => in_decl(l.hidden, name),
            Location::Weights => in_decl(l.weights, name),
            Location::Transform(i) => transform(i).map_or(l.sampler.stmt, |t| t.operand.as_ref().map_or(t.stmt, ident)),
            Location::Sampler => l.sampler.seed.as_ref().map_or(l.sampler.stmt, ident),
            Location::Targets => l.targets.as_ref().map_or(l.sampler.stmt, |t| ident(&t.operand)),
            Location::Verify => l
                .verify
                .as_ref()
                .and_then(|v| std::iter::once(&v.drafts).chain(v.draft_probs.as_ref()).find(|i| *i == name))
                .map_or(l.sampler.stmt, ident),
            Location::Outputs => l.outputs.as_ref().map_or(l.sampler.stmt, |o| o.stmt),
        },
        IrError::VerifySamples { .. } | IrError::VerifyWithTargets | IrError::VerifyWithRawLogprobs => l.verify.as_ref().map_or(l.sampler.stmt, |v| v.stmt),
        // The mode is what has nothing to act on.
        IrError::RawModeWithoutLogprobs => l.outputs.as_ref().map_or(l.sampler.stmt, |o| o.mode.unwrap_or(o.stmt)),
    }
}
