//! Parse → IR for every syntax form, every error at the right tokens, and expansion snapshots.

use crate::ast::Input;
use crate::expand::expand;
use crate::lower::lower;
use flashsample_ir::{DType, LogprobMode, Operand, Outputs, Pipeline, PipelineBuilder};
use proc_macro2::TokenStream;

const QWEN: &str = r#"
    /// A Qwen-style sampler.
    pub pipeline QwenSampler {
        hidden: bf16[B, D], weights: bf16[V, D];
        logits = matmul(hidden, weights);
        logits = logits / temperature[B];
        logits = logits + bias[V];
        logits = mask(logits, allowed[B, V]);
        logits = ban(logits, banned[B]);
        logits = softcap(logits, 30.0);
        sample = gumbel_argmax(logits, seed, samples = 1);
        outputs(score, logsumexp, logprob);
    }
"#;

/// Penalties, per-row filtering and top logprobs: the statements vLLM-style serving needs.
const CHAT: &str = r#"
    pub pipeline ChatSampler {
        hidden: bf16[B, D], weights: bf16[V, D];
        logits = matmul(hidden, weights);
        logits = penalties(logits, penalties[B]);
        logits = logits / temperature[B];
        logits = top_k_top_p(logits, filter[B], max_k = 64);
        sample = gumbel_argmax(logits, seed, samples = 1);
        outputs(logprob, top_logprobs = 5);
    }
"#;

fn chat_builder() -> PipelineBuilder {
    PipelineBuilder::new("ChatSampler", DType::BF16, DType::BF16)
        .penalties("penalties")
        .temperature_per_row("temperature")
        .filter("filter", 64)
        .gumbel("seed", 1)
        .outputs(Outputs {
            logprob: true,
            top_logprobs: 5,
            ..Outputs::default()
        })
}

fn tokens(src: &str) -> TokenStream {
    src.parse().expect("test source tokenizes")
}

/// The IR of the first pipeline in `src`.
fn ir(src: &str) -> Pipeline {
    let input: Input = syn::parse2(tokens(src)).unwrap_or_else(|e| panic!("{e}"));
    let p = lower(&input.pipelines[0]).unwrap_or_else(|e| panic!("{e}")).pipeline;
    p
}

/// One reported error: message, (line, column) of its start and of its end.
type Found = (String, (usize, usize), (usize, usize));

/// Each error of `src`.
fn errors(src: &str) -> Vec<Found> {
    let e = match expand(tokens(src)) {
        Ok(out) => panic!("expected an error, got {out}"),
        Err(e) => e,
    };
    e.into_iter()
        .map(|e| {
            let (s, t) = (e.span().start(), e.span().end());
            (e.to_string(), (s.line, s.column), (t.line, t.column))
        })
        .collect()
}

/// Line (1-based) and column (0-based, in chars) as spans report them, of the `nth` occurrence
/// of `needle` with any `|` removed: at the `|` if there is one, else at the needle's start
/// (`end = false`) or just past its end (`end = true`).
fn pos(src: &str, needle: &str, nth: usize, end: bool) -> (usize, usize) {
    let plain = needle.replace('|', "");
    let at = src
        .match_indices(&plain)
        .nth(nth)
        .unwrap_or_else(|| panic!("`{plain}` #{nth} not in source"))
        .0;
    let offset = match needle.find('|') {
        Some(i) => i,
        None if end => plain.len(),
        None => 0,
    };
    let before = &src[..at + offset];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().unwrap().chars().count();
    (line, col)
}

fn start(src: &str, needle: &str) -> (usize, usize) {
    pos(src, needle, 0, false)
}

/// Asserts `src` fails with exactly one error containing `message`, starting at the `nth`
/// occurrence of `start` and, if given, ending at the `nth` occurrence of `end` (see [`pos`]).
fn assert_error(src: &str, message: &str, start: (&str, usize), end: Option<(&str, usize)>) {
    let errs = errors(src);
    assert_eq!(errs.len(), 1, "{errs:#?}");
    let (msg, s, t) = &errs[0];
    assert!(msg.contains(message), "message `{msg}` lacks `{message}`");
    assert_eq!(*s, pos(src, start.0, start.1, false), "start of `{msg}`");
    if let Some((needle, nth)) = end {
        assert_eq!(*t, pos(src, needle, nth, true), "end of `{msg}`");
    }
}

fn qwen_builder() -> PipelineBuilder {
    PipelineBuilder::new("QwenSampler", DType::BF16, DType::BF16)
}

// ---- syntax forms → IR ----

#[test]
fn full_pipeline_matches_the_builder() {
    let built = qwen_builder()
        .temperature_per_row("temperature")
        .bias("bias")
        .mask("allowed")
        .ban("banned")
        .softcap(30.0)
        .gumbel("seed", 1)
        .outputs(Outputs {
            score: true,
            logsumexp: true,
            logprob: true,
            top_logprobs: 0,
        })
        .build()
        .unwrap();
    assert_eq!(ir(QWEN), built);
}

#[test]
fn temperature_forms() {
    let src = |t: &str| {
        format!("pipeline QwenSampler {{ hidden: bf16[B, D], weights: bf16[V, D]; logits = matmul(hidden, weights); logits = logits / {t}; sample = gumbel_argmax(logits, seed, samples = 1); }}")
    };
    assert_eq!(
        ir(&src("temperature")),
        qwen_builder().temperature_scalar("temperature").build().unwrap()
    );
    assert_eq!(
        ir(&src("t[B]")),
        qwen_builder().temperature_per_row("t").build().unwrap()
    );
    assert_eq!(ir(&src("0.7")), qwen_builder().temperature_const(0.7).build().unwrap());
    assert_eq!(ir(&src("2")), qwen_builder().temperature_const(2.0).build().unwrap());
    assert_eq!(
        ir(&src("0.0")),
        qwen_builder().temperature_const(0.0).build().unwrap(),
        "0 = greedy is valid"
    );
}

#[test]
fn argmax_dtypes_names_and_order() {
    let p = ir("pipeline Greedy {
        h: f32[N, K], w: f16[Vocab, K];
        logits = matmul(h, w);
        logits = softcap(logits, 15);
        logits = logits + b[Vocab];
        sample = argmax(logits);
    }");
    let built = PipelineBuilder::new("Greedy", DType::F32, DType::F16)
        .hidden(Operand {
            name: "h".into(),
            dtype: DType::F32,
            dims: ["N".into(), "K".into()],
        })
        .weights(Operand {
            name: "w".into(),
            dtype: DType::F16,
            dims: ["Vocab".into(), "K".into()],
        })
        .softcap(15.0)
        .bias("b")
        .argmax()
        .build()
        .unwrap();
    assert_eq!(p, built);
}

#[test]
fn samples_default_count_outputs_subset_and_semicolon_operands() {
    let p = ir("pipeline QwenSampler {
        hidden: bf16[B, D]; weights: bf16[V, D];
        logits = matmul(hidden, weights);
        sample = gumbel_argmax(logits, rng);
        outputs(logprob);
    }");
    let want = qwen_builder().gumbel("rng", 1).outputs(Outputs {
        logprob: true,
        ..Outputs::default()
    });
    assert_eq!(p, want.build().unwrap());
    let p = ir(
        "pipeline QwenSampler { hidden: bf16[B, D], weights: bf16[V, D],; logits = matmul(hidden, weights);
                sample = gumbel_argmax(logits, seed, samples = 64); outputs(logsumexp, score,); }",
    );
    let want = qwen_builder().gumbel("seed", 64).outputs(Outputs {
        score: true,
        logsumexp: true,
        logprob: false,
        top_logprobs: 0,
    });
    assert_eq!(p, want.build().unwrap());
}

#[test]
fn penalties_filter_and_top_logprobs_match_the_builder() {
    assert_eq!(ir(CHAT), chat_builder().build().unwrap());
}

#[test]
fn each_new_statement_alone() {
    let src = |stmt: &str, outputs: &str| {
        format!(
            "pipeline QwenSampler {{ hidden: bf16[B, D], weights: bf16[V, D]; logits = matmul(hidden, weights);
             {stmt} sample = gumbel_argmax(logits, seed, samples = 1); {outputs} }}"
        )
    };
    assert_eq!(
        ir(&src("logits = penalties(logits, penalties[B]);", "")),
        qwen_builder().penalties("penalties").build().unwrap()
    );
    assert_eq!(
        ir(&src("logits = top_k_top_p(logits, filter[B], max_k = 64);", "")),
        qwen_builder().filter("filter", 64).build().unwrap()
    );
    // Other operand names, and the capacity's bounds.
    assert_eq!(
        ir(&src("logits = penalties(logits, pen[B]); logits = top_k_top_p(logits, f[B], max_k = 1024,);", "")),
        qwen_builder().penalties("pen").filter("f", 1024).build().unwrap()
    );
    assert_eq!(
        ir(&src("logits = top_k_top_p(logits, filter[B], max_k = 1);", "")),
        qwen_builder().filter("filter", 1).build().unwrap()
    );
    let top = |n| {
        qwen_builder()
            .outputs(Outputs {
                top_logprobs: n,
                ..Outputs::default()
            })
            .build()
            .unwrap()
    };
    assert_eq!(ir(&src("", "outputs(top_logprobs = 5);")), top(5));
    assert_eq!(ir(&src("", "outputs(top_logprobs = 1024);")), top(1024));
    assert_eq!(ir(&src("", "outputs(top_logprobs = 0);")), top(0), "0 = none, as in the IR");
    let all = ir(&src("", "outputs(top_logprobs = 3, score, logsumexp, logprob);"));
    assert_eq!(
        all.outputs,
        Outputs {
            score: true,
            logsumexp: true,
            logprob: true,
            top_logprobs: 3
        }
    );
    // Penalties may sit anywhere before the filter; the filter on a greedy pipeline is valid IR.
    assert_eq!(
        ir("pipeline QwenSampler { hidden: bf16[B, D], weights: bf16[V, D]; logits = matmul(hidden, weights);
            logits = softcap(logits, 30.0); logits = penalties(logits, penalties[B]);
            logits = top_k_top_p(logits, filter[B], max_k = 8); sample = argmax(logits); }"),
        qwen_builder().softcap(30.0).penalties("penalties").filter("filter", 8).argmax().build().unwrap()
    );
}

#[test]
fn constants_round_to_the_nearest_f32() {
    let p = ir(
        "pipeline P { hidden: f32[B, D], weights: f32[V, D]; logits = matmul(hidden, weights);
                logits = logits / 0.1; logits = softcap(logits, 1e1); sample = argmax(logits); }",
    );
    let built = PipelineBuilder::new("P", DType::F32, DType::F32)
        .temperature_const(0.1)
        .softcap(10.0)
        .argmax();
    assert_eq!(p, built.build().unwrap());
}

// ---- expansion ----

fn pretty(tokens: TokenStream) -> String {
    prettyplease::unparse(&syn::parse2::<syn::File>(tokens).expect("expansion is a valid file"))
}

#[test]
fn snapshot_qwen_expansion() {
    insta::assert_snapshot!("qwen_sampler", pretty(expand(tokens(QWEN)).unwrap()));
}

#[test]
fn snapshot_greedy_scalar_expansion() {
    let src = "#[derive(Debug)] pub(crate) pipeline Chat {
        h: f32[B, D], w: f16[V, D];
        logits = matmul(h, w);
        logits = logits / t;
        sample = argmax(logits);
    }";
    insta::assert_snapshot!("greedy_scalar", pretty(expand(tokens(src)).unwrap()));
}

#[test]
fn expansion_shapes_the_sample_signature() {
    let out = pretty(expand(tokens(QWEN)).unwrap());
    assert!(out.contains("/// A Qwen-style sampler."), "{out}");
    assert!(out.contains("TemperatureArg::PerRow(temperature)"), "{out}");
    assert!(out.contains("seed: ::core::primitive::u64"), "{out}");
    let constant = pretty(
        expand(tokens(
            "pipeline C { hidden: bf16[B, D], weights: bf16[V, D]; logits = matmul(hidden, weights);
                       logits = logits / 0.7; sample = argmax(logits); }",
        ))
        .unwrap(),
    );
    assert!(
        constant.contains("temperature: ::flashsample::TemperatureArg::None"),
        "{constant}"
    );
    assert!(constant.contains("bias: ::core::option::Option::None"), "{constant}");
    // Greedy: no seed parameter, and the seed fields keep their defaults (never read).
    assert!(!constant.contains("seed"), "{constant}");
    let renamed = expand(tokens(&QWEN.replace("logits, seed,", "logits, rng,")))
        .unwrap()
        .to_string();
    assert!(renamed.contains("seed : rng"), "{renamed}");
    // Only the two matrices: constants and argmax take no argument.
    let sig = constant
        .split("pub fn sample(")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap()
        .to_string();
    assert_eq!(sig.matches(':').count() - sig.matches("::").count() * 2, 2, "{sig}");
}

#[test]
fn snapshot_chat_expansion() {
    insta::assert_snapshot!("chat_sampler", pretty(expand(tokens(CHAT)).unwrap()));
}

/// The `sample` parameter list (after `&self`) of the `nth` generated method named `name`.
fn signature(out: &str, name: &str) -> String {
    let sig = out
        .split(&format!("pub fn {name}("))
        .nth(1)
        .unwrap_or_else(|| panic!("no `{name}` in {out}"));
    sig[..sig.find(") ->").unwrap()].split_whitespace().collect::<Vec<_>>().join(" ")
}

#[test]
fn logit_bias_matches_the_builder_and_expands_to_per_row_maps() {
    let src = CHAT.replace(
        "logits = penalties(logits, penalties[B]);",
        "logits = logit_bias(logits, logit_bias[B]); logits = penalties(logits, penalties[B]);",
    );
    let want = PipelineBuilder::new("ChatSampler", DType::BF16, DType::BF16)
        .logit_bias("logit_bias")
        .penalties("penalties")
        .temperature_per_row("temperature")
        .filter("filter", 64)
        .gumbel("seed", 1)
        .outputs(Outputs { logprob: true, top_logprobs: 5, ..Outputs::default() });
    assert_eq!(ir(&src), want.build().unwrap());
    let out = pretty(expand(tokens(&src)).unwrap());
    assert!(
        signature(&out, "sample").contains(
            "logit_bias: &[::std::vec::Vec<(::core::primitive::u32, ::core::primitive::f32)>], \
             penalties: ::flashsample::PenaltyArg<'_>"
        ),
        "{out}"
    );
    assert!(out.contains("logit_bias: ::core::option::Option::Some(logit_bias)"), "{out}");
    assert!(out.contains("- `logit_bias`: `B` per-request logit biases"), "{out}");
    assert!(pretty(expand(tokens(CHAT)).unwrap()).contains("logit_bias: ::core::option::Option::None"));
}

#[test]
fn expansion_passes_penalties_filter_and_row_seeds() {
    let out = pretty(expand(tokens(CHAT)).unwrap());
    // Declaration order: penalties, temperature, filter, then the seed.
    assert_eq!(
        signature(&out, "sample"),
        "&self, hidden: ::flashsample::Matrix<'_, ::flashsample::bf16>, \
         weights: ::flashsample::Matrix<'_, ::flashsample::bf16>, penalties: ::flashsample::PenaltyArg<'_>, \
         temperature: &[::core::primitive::f32], filter: &[::flashsample::RowFilter], seed: ::core::primitive::u64,"
    );
    assert_eq!(
        signature(&out, "sample_with_seeds"),
        "&self, hidden: ::flashsample::Matrix<'_, ::flashsample::bf16>, \
         weights: ::flashsample::Matrix<'_, ::flashsample::bf16>, penalties: ::flashsample::PenaltyArg<'_>, \
         temperature: &[::core::primitive::f32], filter: &[::flashsample::RowFilter], \
         row_seeds: &[::core::primitive::u64],"
    );
    assert!(out.contains("filter: ::core::option::Option::Some(filter)"), "{out}");
    assert!(out.contains("penalties: ::core::option::Option::Some(penalties)"), "{out}");
    assert!(out.contains("row_seeds: ::core::option::Option::Some(row_seeds)"), "{out}");
    assert!(out.contains("- `filter`: `[B]` per-row top-k / top-p / min-p"), "{out}");
    assert!(out.contains("`top_k` at most 64"), "{out}");
    assert!(out.contains("- `penalties`: per-row repetition, presence and frequency"), "{out}");
    assert!(out.contains("`top_logprobs` (the 5 most likely tokens of each row)"), "{out}");
    // Pipelines without them pass `None`; greedy pipelines have no noise, hence no row seeds.
    let greedy = pretty(
        expand(tokens(
            "pipeline G { hidden: bf16[B, D], weights: bf16[V, D]; logits = matmul(hidden, weights);
                       sample = argmax(logits); }",
        ))
        .unwrap(),
    );
    assert!(greedy.contains("filter: ::core::option::Option::None"), "{greedy}");
    assert!(greedy.contains("penalties: ::core::option::Option::None"), "{greedy}");
    assert!(!greedy.contains("sample_with_seeds"), "{greedy}");
    // A renamed seed operand is replaced by `row_seeds` in `sample_with_seeds`.
    let renamed = pretty(expand(tokens(&CHAT.replace("logits, seed,", "logits, rng,"))).unwrap());
    assert!(signature(&renamed, "sample").ends_with("rng: ::core::primitive::u64,"), "{renamed}");
    assert!(!signature(&renamed, "sample_with_seeds").contains("rng"), "{renamed}");
}

#[test]
fn ir_const_is_the_canonical_text() {
    let out = expand(tokens(QWEN)).unwrap().to_string();
    let text = ir(QWEN).to_string();
    assert!(out.contains(&format!("{:?}", text)), "{out}");
}

#[test]
fn several_pipelines_in_one_invocation() {
    let src = format!("{QWEN} pipeline Greedy {{ hidden: f16[B, D], weights: f16[V, D]; logits = matmul(hidden, weights); sample = argmax(logits); }}");
    let out = pretty(expand(tokens(&src)).unwrap());
    assert!(out.contains("pub struct QwenSampler"), "{out}");
    assert!(out.contains("\nstruct Greedy"), "{out}");
    // One bad pipeline fails the invocation, with the error at its tokens.
    let bad = src.replace("argmax(logits); }", "argmax(logitz); }");
    assert_error(&bad, "`argmax` applies to `logits`", ("logitz", 0), Some(("logitz", 0)));
}

// ---- errors, at the offending tokens ----

#[test]
fn unknown_op() {
    let src = QWEN.replace("logits = softcap(logits, 30.0);", "logits = frobnicate(logits);");
    assert_error(
        &src,
        "unknown op `frobnicate`; expected one of `matmul`, `mask`",
        ("frobnicate", 0),
        Some(("frobnicate", 0)),
    );
    let src = QWEN.replace("sample = gumbel_argmax", "sample = top_k");
    assert_error(&src, "unknown op `top_k`", ("top_k", 0), None);
}

#[test]
fn shape_mismatch_points_at_the_weights_contraction_dim() {
    let src = QWEN.replace("weights: bf16[V, D]", "weights: bf16[V, K]");
    assert_error(
        &src,
        "shape mismatch: matmul contracts `hidden[.., D]` with `weights[.., K]`",
        ("K", 0),
        Some(("K", 0)),
    );
}

#[test]
fn batch_cannot_be_vocab() {
    let src = QWEN.replace("hidden: bf16[B, D]", "hidden: bf16[V, D]");
    // The per-row operands now also mismatch ([B] vs [V]); the IR error comes only when the
    // macro's own checks pass, so use a pipeline without them.
    let src = src.split("logits = logits /").next().unwrap().to_string() + "sample = argmax(logits); }";
    assert_error(&src, "batch dimension `V`", ("V", 1), Some(("V", 1)));
}

#[test]
fn wrong_operand_shapes() {
    for (from, to, at) in [
        ("bias[V]", "bias[B]", "[B]"),
        ("temperature[B]", "temperature[V]", "[V]"),
        ("allowed[B, V]", "allowed[B]", "[B]"),
        ("banned[B]", "banned[B, V]", "[B, V]"),
    ] {
        let src = QWEN.replace(from, to);
        let name = from.split('[').next().unwrap();
        let idx = src.find(to).unwrap() + to.find('[').unwrap();
        let nth = src[..idx].matches(at).count();
        assert_error(&src, &format!("wrong shape for `{name}`"), (at, nth), Some((at, nth)));
    }
    let src = QWEN.replace("bias[V]", "bias");
    assert_error(&src, "declare the shape of `bias`", ("bias;", 0), None);
}

#[test]
fn transform_before_matmul() {
    let src = QWEN.replace(
        "logits = matmul(hidden, weights);\n        logits = logits / temperature[B];",
        "logits = mask(logits, allowed[B, V]);\n        logits = matmul(hidden, weights);",
    );
    let src = src.replace(
        "        logits = mask(logits, allowed[B, V]);\n        logits = ban",
        "        logits = ban",
    );
    assert_error(
        &src,
        "`logits` is used before it is defined",
        ("logits = mask", 0),
        Some(("allowed[B, V]);", 0)),
    );
    let src = "pipeline P { hidden: bf16[B, D], weights: bf16[V, D]; sample = argmax(logits); }";
    assert_error(
        src,
        "used before it is defined",
        ("sample", 0),
        Some(("argmax(logits);", 0)),
    );
}

#[test]
fn matmul_operands_must_be_the_declared_ones() {
    let src = QWEN.replace("matmul(hidden, weights)", "matmul(hidden, lm_head)");
    assert_error(&src, "`lm_head` is not a declared operand", ("lm_head", 0), None);
    let src = QWEN.replace("matmul(hidden, weights)", "matmul(weights, hidden)");
    assert_error(
        &src,
        "in declaration order: `matmul(hidden, weights)`",
        ("matmul(|weights", 0),
        Some(("matmul(weights|", 0)),
    );
    let src = QWEN.replace("matmul(hidden, weights)", "matmul(hidden)");
    assert_error(&src, "declaration order", ("matmul", 0), Some(("matmul(hidden)", 0)));
    let src = QWEN.replace("logits = logits / temperature[B];", "logits = matmul(hidden, weights);");
    assert_error(&src, "a pipeline has one `matmul`", ("logits = matmul", 1), None);
}

#[test]
fn sampler_count_and_position() {
    let src = QWEN.replace("outputs(score, logsumexp, logprob);", "sample = argmax(logits);");
    assert_error(
        &src,
        "a second sampler",
        ("sample = argmax", 0),
        Some(("argmax(logits);", 0)),
    );
    let src = QWEN.replace("        sample = gumbel_argmax(logits, seed, samples = 1);\n", "");
    let errs = errors(&src);
    assert_eq!(errs.len(), 2, "{errs:#?}"); // no sampler, and `outputs` before it
    assert!(
        errs[0].0.contains("`outputs(...)` comes after the sampler"),
        "{errs:#?}"
    );
    assert!(errs[1].0.contains("has no sampler"), "{errs:#?}");
    assert_eq!(errs[1].1, start(&src, "QwenSampler"));
    let src = QWEN.replace("outputs(score, logsumexp, logprob);", "logits = softcap(logits, 2.0);");
    assert_error(
        &src,
        "only `outputs(...)` may follow the sampler",
        ("logits = softcap(logits, 2.0)", 0),
        None,
    );
    let src = QWEN.replace("sample = gumbel_argmax", "logits = gumbel_argmax");
    assert_error(
        &src,
        "a sampler assigns `sample`",
        ("logits = gumbel", 0),
        Some(("logits", 11)),
    );
    let src = QWEN.replace(
        "sample = gumbel_argmax(logits, seed, samples = 1)",
        "sample = ban(logits, banned[B])",
    );
    assert_error(
        &src,
        "`sample = ...` takes a sampler",
        ("sample = ban", 0),
        Some(("banned[B]);", 1)),
    );
}

#[test]
fn sample_counts() {
    let src = QWEN.replace("samples = 1", "samples = 0");
    assert_error(
        &src,
        "samples per row must be in 1..=64, got 0",
        ("samples = |0", 0),
        Some(("samples = 0", 0)),
    );
    let src = QWEN.replace("samples = 1", "samples = 65");
    assert_error(&src, "got 65", ("65", 0), None);
    let src = QWEN.replace("samples = 1", "samples = -1");
    assert_error(&src, "non-negative integer", ("-1", 0), Some(("-1", 0)));
    let src = QWEN.replace("samples = 1", "draws = 1");
    assert_error(&src, "unknown argument `draws`", ("draws", 0), None);
    let src = QWEN.replace("gumbel_argmax(logits, seed,", "gumbel_argmax(logits, 42,");
    assert_error(&src, "the seed is a runtime `u64` operand", ("42", 0), None);
}

#[test]
fn unknown_dtype_and_bad_declarations() {
    let src = QWEN.replace("hidden: bf16", "hidden: bf8");
    assert_error(
        &src,
        "unknown dtype `bf8`; expected `bf16`, `f16` or `f32`",
        ("bf8", 0),
        Some(("bf8", 0)),
    );
    let src = QWEN.replace("weights: bf16[V, D]", "weights: bf16[V, D, E]");
    assert_error(&src, "operands are rank 2", ("[V, D, E]", 0), Some(("[V, D, E]", 0)));
    let src = QWEN.replace("weights: bf16[V, D];", "weights: bf16[V, D], extra: f32[V, D];");
    assert_error(&src, "exactly two operands", ("hidden:", 0), Some(("f32[V, D];", 0)));
}

#[test]
fn ir_errors_map_to_their_tokens() {
    // Constants checked by `Pipeline::validate`, pointed at by `IrError::location()`.
    let src = QWEN.replace("softcap(logits, 30.0)", "softcap(logits, -1.0)");
    assert_error(
        &src,
        "softcap must be finite and > 0, got -1",
        ("-1.0", 0),
        Some(("-1.0", 0)),
    );
    let src = QWEN.replace("logits / temperature[B]", "logits / -0.5");
    assert_error(
        &src,
        "a constant temperature must be finite and >= 0",
        ("-0.5", 0),
        Some(("-0.5", 0)),
    );
    let src = QWEN.replace("logits = ban(logits, banned[B]);", "logits = softcap(logits, 2.0);");
    assert_error(
        &src,
        "`softcap` appears twice",
        ("logits = softcap(logits, 30.0)", 0),
        Some(("30.0);", 0)),
    );
}

#[test]
fn duplicate_operand_names() {
    let src = QWEN.replace("ban(logits, banned[B])", "ban(logits, temperature[B])");
    assert_error(
        &src,
        "operand name `temperature` is used twice",
        ("temperature", 1),
        Some(("temperature", 1)),
    );
    let src = QWEN.replace("gumbel_argmax(logits, seed,", "gumbel_argmax(logits, bias,");
    assert_error(&src, "operand name `bias` is used twice", ("bias", 1), None);
    let src = QWEN
        .replace("weights: bf16[V, D]", "hidden: bf16[V, D]")
        .replace("matmul(hidden, weights)", "matmul(hidden, hidden)");
    assert_error(&src, "operand name `hidden` is used twice", ("hidden", 1), None);
}

#[test]
fn malformed_statements() {
    let src = QWEN.replace("logits = logits + bias[V];", "logits = logits * bias[V];");
    assert_error(&src, "unsupported operator `*`", ("*", 0), None);
    let src = QWEN.replace("logits = logits + bias[V];", "logits = scores + bias[V];");
    assert_error(
        &src,
        "transforms apply to `logits`, found `scores`",
        ("scores", 0),
        None,
    );
    let src = QWEN.replace("logits = logits + bias[V];", "probs = logits + bias[V];");
    assert_error(&src, "cannot assign `probs`", ("probs", 0), None);
    let src = QWEN.replace("logits = logits + bias[V];", "mask(logits, allowed[B, V]);");
    assert_error(
        &src,
        "found a bare `mask(...)` call",
        ("mask(logits, allowed[B, V]);", 0),
        None,
    );
    let src = QWEN.replace("mask(logits, allowed[B, V])", "mask(allowed[B, V])");
    assert_error(&src, "`mask` takes two arguments", ("mask", 0), None);
    let src = QWEN.replace("outputs(score, logsumexp, logprob)", "outputs(score, entropy)");
    assert_error(&src, "unknown output", ("entropy", 0), None);
    let src = QWEN.replace("outputs(score, logsumexp, logprob)", "outputs(score, score)");
    assert_error(&src, "listed twice", ("score", 1), None);
    let src = QWEN.replace(
        "outputs(score, logsumexp, logprob);",
        "outputs(score); outputs(logprob);",
    );
    assert_error(&src, "`outputs(...)` appears twice", ("outputs(logprob)", 0), None);
    let src = "pipeline P { hidden: bf16[B, D], weights: bf16[V, D]; }";
    let errs = errors(src);
    assert!(errs[0].0.contains("no `logits = matmul"), "{errs:#?}");
    assert!(errs[1].0.contains("no sampler"), "{errs:#?}");
    // Plain syntax errors come from syn, still at the token.
    let src = QWEN.replace("pub pipeline", "pub pipe");
    assert_error(&src, "expected `pipeline`, found `pipe`", ("pipe", 0), None);
    assert!(errors("").len() == 1);
}

#[test]
fn independent_errors_are_reported_together() {
    let src = QWEN
        .replace("hidden: bf16", "hidden: bf8")
        .replace("logits = softcap(logits, 30.0);", "logits = frobnicate(logits);")
        .replace("bias[V]", "bias[B]")
        .replace("temperature[B]", "temperature[V]");
    let errs = errors(&src);
    let msgs: Vec<&str> = errs.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(errs.len(), 4, "{msgs:#?}");
    assert!(msgs[0].contains("unknown dtype `bf8`"));
    assert!(
        msgs[1].contains("wrong shape for `temperature`"),
        "a bad dtype must not hide shape errors"
    );
    assert!(msgs[2].contains("wrong shape for `bias`"));
    assert!(msgs[3].contains("unknown op `frobnicate`"));
    assert_eq!(errs[3].1, start(&src, "frobnicate"));
}

// ---- penalties, filter, top logprobs: errors ----

#[test]
fn penalties_errors() {
    let src = CHAT.replace("penalties[B]", "penalties[V]");
    assert_error(
        &src,
        "wrong shape for `penalties`: per-row penalties (repetition, presence, frequency and a token history per row) is `[B]`, found `[V]`",
        ("penalties|[V]", 0),
        Some(("penalties[V]", 0)),
    );
    let src = CHAT.replace("penalties[B]", "penalties");
    assert_error(&src, "declare the shape of `penalties`", ("penalties);", 0), Some(("penalties|);", 0)));
    let src = CHAT.replace("penalties(logits, penalties[B])", "penalties(penalties[B])");
    assert_error(
        &src,
        "`penalties` takes two arguments: `penalties(logits, penalties[B])`",
        ("penalties(", 0),
        Some(("penalties(penalties[B])", 0)),
    );
    let src = CHAT.replace("penalties(logits, penalties[B])", "penalties(scores, penalties[B])");
    assert_error(&src, "`penalties` applies to `logits`", ("scores", 0), Some(("scores", 0)));
    let src = CHAT.replace("penalties[B]", "temperature[B]");
    assert_error(
        &src,
        "operand name `temperature` is used twice",
        ("temperature", 1),
        Some(("temperature", 1)),
    );
    let src = CHAT.replace(
        "logits = logits / temperature[B];",
        "logits = penalties(logits, more[B]);",
    );
    assert_error(
        &src,
        "`penalties` appears twice",
        ("logits = penalties(logits, more", 0),
        Some(("more[B]);", 0)),
    );
}

#[test]
fn filter_shape_and_arguments() {
    let src = CHAT.replace("filter[B]", "filter[B, V]");
    assert_error(
        &src,
        "wrong shape for `filter`: per-row top-k / top-p / min-p settings (one per row) is `[B]`, found `[B, V]`",
        ("filter|[B, V]", 0),
        Some(("filter[B, V]", 0)),
    );
    let src = CHAT.replace("filter[B]", "filter");
    assert_error(&src, "declare the shape of `filter`", ("filter,", 0), Some(("filter", 0)));
    let src = CHAT.replace("top_k_top_p(logits, filter[B], max_k = 64)", "top_k_top_p(logits, filter[B])");
    assert_error(
        &src,
        "`top_k_top_p` needs `max_k = K`, the capacity of its fused candidate lists",
        ("top_k_top_p", 0),
        Some(("top_k_top_p(logits, filter[B])", 0)),
    );
    let src = CHAT.replace("max_k = 64", "max_k = 64, 2");
    assert_error(&src, "`top_k_top_p` takes three arguments", ("top_k_top_p", 0), None);
    let src = CHAT.replace("max_k = 64", "64");
    assert_error(&src, "the capacity is a named constant", ("64", 0), Some(("64", 0)));
    let src = CHAT.replace("max_k = 64", "k = 64");
    assert_error(&src, "unknown argument `k`; expected `top_k_top_p(", ("k = 64", 0), Some(("k| = 64", 0)));
    for bad in ["-1", "6.5"] {
        let src = CHAT.replace("max_k = 64", &format!("max_k = {bad}"));
        assert_error(&src, "expected a non-negative integer", (bad, 0), Some((bad, 0)));
    }
    let src = CHAT.replace("top_k_top_p(logits,", "top_k_top_p(probs,");
    assert_error(&src, "`top_k_top_p` applies to `logits`", ("probs", 0), None);
    let src = CHAT.replace("filter[B]", "seed[B]");
    assert_error(&src, "operand name `seed` is used twice", ("seed", 1), Some(("seed", 1)));
}

#[test]
fn filter_capacity_is_checked_by_the_ir_at_the_value() {
    for (k, msg) in [("0", "got 0"), ("1025", "got 1025")] {
        let src = CHAT.replace("max_k = 64", &format!("max_k = {k}"));
        assert_error(
            &src,
            &format!("filter max_k must be in 1..=1024, {msg}"),
            (&format!("max_k = |{k}"), 0),
            Some((&format!("max_k = {k}"), 0)),
        );
    }
}

#[test]
fn filter_must_be_last() {
    let src = CHAT.replace(
        "logits = logits / temperature[B];\n        logits = top_k_top_p(logits, filter[B], max_k = 64);",
        "logits = top_k_top_p(logits, filter[B], max_k = 64);\n        logits = logits / temperature[B];",
    );
    assert_error(
        &src,
        "the top-k/top-p filter must be the last transform",
        ("logits = top_k_top_p", 0),
        Some(("max_k = 64);", 0)),
    );
    // A second filter is caught by the same rule, at the first one.
    let src = CHAT.replace(
        "logits = logits / temperature[B];",
        "logits = top_k_top_p(logits, f2[B], max_k = 8);",
    );
    assert_error(
        &src,
        "must be the last transform",
        ("logits = top_k_top_p(logits, f2", 0),
        Some(("max_k = 8);", 0)),
    );
    // After the sampler it is a statement-order error, not an IR one.
    let src = CHAT.replace(
        "outputs(logprob, top_logprobs = 5);",
        "logits = top_k_top_p(logits, f2[B], max_k = 8);",
    );
    assert_error(&src, "only `outputs(...)` may follow the sampler", ("logits = top_k_top_p(logits, f2", 0), None);
    let src = CHAT.replace("sample = gumbel_argmax(logits, seed, samples = 1)", "sample = top_k_top_p(logits, f2[B], max_k = 8)");
    assert_error(&src, "`sample = ...` takes a sampler", ("sample = top_k_top_p", 0), None);
}

#[test]
fn top_logprobs_errors() {
    let src = CHAT.replace("top_logprobs = 5", "top_logprobs = 1025");
    assert_error(
        &src,
        "top_logprobs must be in 0..=1024, got 1025",
        ("1025", 0),
        Some(("1025", 0)),
    );
    let src = CHAT.replace("top_logprobs = 5", "top_logprobs");
    assert_error(&src, "`top_logprobs` takes a count: `top_logprobs = N`", ("top_logprobs", 0), None);
    let src = CHAT.replace("top_logprobs = 5", "top_logprobs = -5");
    assert_error(&src, "expected a non-negative integer", ("-5", 0), Some(("-5", 0)));
    let src = CHAT.replace("top_logprobs = 5", "top_logprobs = 5, top_logprobs = 6");
    assert_error(&src, "this output is listed twice", ("top_logprobs = 6", 0), Some(("top_logprobs = 6", 0)));
    let src = CHAT.replace("top_logprobs = 5", "entropy = 5");
    assert_error(
        &src,
        "unknown output; expected any of `score`, `logsumexp`, `logprob`, `top_logprobs = N`, and the logprob mode",
        ("entropy", 0),
        Some(("entropy = 5", 0)),
    );
}

#[test]
fn target_logprob_matches_the_builder_and_takes_the_targets() {
    let src = CHAT.replace("outputs(logprob, top_logprobs = 5);", "score = target_logprob(logits, targets[B]);\n        outputs(logprob, top_logprobs = 5);");
    let want = chat_builder().target_logprob("targets");
    assert_eq!(ir(&src), want.build().unwrap());
    let out = pretty(expand(tokens(&src)).unwrap());
    assert!(signature(&out, "sample").contains("targets: &[::core::primitive::u32]"), "{out}");
    assert!(out.contains("targets: ::core::option::Option::Some(targets)"), "{out}");
    assert!(out.contains("`target_logprobs`"), "{out}");
}

#[test]
fn target_logprob_with_rank_matches_the_builder_and_names_a_wrong_third_argument() {
    let src = CHAT.replace("outputs(logprob, top_logprobs = 5);", "score = target_logprob(logits, targets[B], rank);\n        outputs(logprob, top_logprobs = 5);");
    assert_eq!(ir(&src), chat_builder().target_logprob_and_rank("targets").build().unwrap());
    let out = pretty(expand(tokens(&src)).unwrap());
    assert!(out.contains("`target_ranks`"), "{out}");
    let bad = CHAT.replace("outputs(logprob, top_logprobs = 5);", "score = target_logprob(logits, targets[B], ranks);\n        outputs(logprob, top_logprobs = 5);");
    assert_error(&bad, "the third argument of `target_logprob` is `rank`", ("ranks", 0), Some(("ranks", 0)));
}

#[test]
fn verify_matches_the_builder_and_generates_verify_methods() {
    let src = CHAT.replace(
        "outputs(logprob, top_logprobs = 5);",
        "accept = verify(logits, drafts[N], draft_probs[N, V]);\n        outputs(logprob, top_logprobs = 5);",
    );
    assert_eq!(ir(&src), chat_builder().verify_sampled("drafts", "draft_probs").build().unwrap());
    let out = pretty(expand(tokens(&src)).unwrap());
    let verify = signature(&out, "verify");
    assert!(verify.contains("drafts: &[::core::primitive::u32]") && verify.contains("draft_probs: &[::core::primitive::f32]"), "{out}");
    assert!(out.contains("::flashsample::Result<::flashsample::Verified>"), "{out}");
    assert!(out.contains("fn verify_with_seeds") && !out.contains("fn sample("), "{out}");
    let greedy = CHAT.replace("outputs(logprob, top_logprobs = 5);", "accept = verify(logits, drafts[N]);\n        outputs(logprob, top_logprobs = 5);");
    assert_eq!(ir(&greedy), chat_builder().verify_greedy("drafts").build().unwrap());
}

#[test]
fn the_raw_logprob_mode_matches_the_builder_and_needs_a_logprob_output() {
    let src = CHAT.replace("top_logprobs = 5);", "top_logprobs = 5, raw);");
    assert_eq!(ir(&src), chat_builder().logprob_mode(LogprobMode::Raw).build().unwrap());
    let out = pretty(expand(tokens(&src)).unwrap());
    assert!(out.contains("raw logprobs"), "{out}");
    // `processed` is the default, written or not.
    let src = CHAT.replace("top_logprobs = 5);", "processed, top_logprobs = 5);");
    assert_eq!(ir(&src), chat_builder().build().unwrap());
    let src = CHAT.replace("outputs(logprob, top_logprobs = 5);", "outputs(score, raw);");
    assert_error(&src, "the `raw` logprob mode chooses what", ("raw", 0), Some(("raw", 0)));
    let src = CHAT.replace("top_logprobs = 5);", "top_logprobs = 5, raw, processed);");
    assert_error(&src, "`outputs` names at most one logprob mode", ("processed", 0), Some(("processed", 0)));
    // Scoring alone may report raw logprobs.
    let src = CHAT.replace("outputs(logprob, top_logprobs = 5);", "score = target_logprob(logits, targets[B]);\n        outputs(raw);");
    let want = chat_builder().outputs(Outputs::default()).target_logprob("targets").logprob_mode(LogprobMode::Raw);
    assert_eq!(ir(&src), want.build().unwrap());
}
