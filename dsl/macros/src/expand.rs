//! Expansion: a validated pipeline → a typed sampler struct over the `::flashsample` facade.

use crate::ast::Input;
use crate::lower::{lower, Errors, Lowered};
use flashsample_ir::{DType, LogprobMode, Pipeline, Sampler, Temperature, Transform};
use proc_macro2::TokenStream;
use quote::quote;

/// Expands a whole `flashsample!` invocation. Every pipeline is checked; if any is invalid
/// the result is all their errors together (and nothing else, so no follow-on errors).
pub fn expand(tokens: TokenStream) -> syn::Result<TokenStream> {
    let input: Input = syn::parse2(tokens)?;
    let mut errors = Errors::default();
    let mut out = TokenStream::new();
    for def in &input.pipelines {
        match lower(def).and_then(|l| generate(&l)) {
            Ok(tokens) => out.extend(tokens),
            Err(e) => errors.push(e),
        }
    }
    errors.finish()?;
    Ok(out)
}

fn element(dtype: DType) -> TokenStream {
    match dtype {
        DType::BF16 => quote!(::flashsample::bf16),
        DType::F16 => quote!(::flashsample::f16),
        DType::F32 => quote!(::core::primitive::f32),
    }
}

fn generate(l: &Lowered) -> syn::Result<TokenStream> {
    let p = &l.pipeline;
    let ir = p.to_string();
    // `pipeline()` parses this text at run time; make sure now that it means the same pipeline.
    if Pipeline::parse(&ir).as_ref() != Ok(p) {
        return Err(syn::Error::new_spanned(
            &l.def.name,
            format!("flashsample! internal error: the IR text does not round-trip:\n{ir}"),
        ));
    }
    let attrs = &l.def.attrs;
    let vis = &l.def.vis;
    let name = &l.def.name;

    let (hidden, weights) = (&l.hidden.name, &l.weights.name);
    let (he, we) = (element(p.hidden.dtype), element(p.weights.dtype));
    let mut params = vec![
        quote!(#hidden: ::flashsample::Matrix<'_, #he>),
        quote!(#weights: ::flashsample::Matrix<'_, #we>),
    ];
    let (b, d, v) = (&p.hidden.dims[0], &p.hidden.dims[1], &p.weights.dims[0]);
    let mut docs = vec![
        format!("- `{hidden}`: `[{b}, {d}]` {} hidden states", p.hidden.dtype.name()),
        format!("- `{weights}`: `[{v}, {d}]` {} LM-head weights", p.weights.dtype.name()),
    ];
    let mut temperature = quote!(::flashsample::TemperatureArg::None);
    let none = quote!(::core::option::Option::None);
    let [mut bias, mut mask, mut banned, mut filter, mut penalties, mut logit_bias] = std::array::from_fn(|_| none.clone());
    for (t, src) in p.transforms.iter().zip(&l.transforms) {
        let Some(op) = &src.operand else { continue }; // constants take no argument
        let (ty, doc) = match t {
            Transform::Temperature(Temperature::Scalar { .. }) => {
                temperature = quote!(::flashsample::TemperatureArg::Scalar(#op));
                (
                    quote!(::core::primitive::f32),
                    "one temperature for every row (0 = greedy)".to_string(),
                )
            }
            Transform::Temperature(Temperature::PerRow { .. }) => {
                temperature = quote!(::flashsample::TemperatureArg::PerRow(#op));
                (
                    quote!(&[::core::primitive::f32]),
                    format!("`[{b}]` per-row temperatures (0 = greedy row)"),
                )
            }
            Transform::Bias { .. } => {
                bias = quote!(::core::option::Option::Some(#op));
                (
                    quote!(&[::core::primitive::f32]),
                    format!("`[{v}]` additive logit bias (`-inf` bans a token)"),
                )
            }
            Transform::LogitBias { .. } => {
                logit_bias = quote!(::core::option::Option::Some(#op));
                (
                    quote!(&[::std::vec::Vec<(::core::primitive::u32, ::core::primitive::f32)>]),
                    format!(
                        "`{b}` per-request logit biases: `(token, bias)` pairs, each token at most once, each bias \
                         finite or `-inf` (bans the token for that row)"
                    ),
                )
            }
            Transform::Mask { .. } => {
                mask = quote!(::core::option::Option::Some(#op));
                (
                    quote!(&[::core::primitive::u32]),
                    format!("`[{b}, ceil({v}/32)]` allowed-token bitset: bit `v % 32` of word `v / 32`"),
                )
            }
            Transform::Ban { .. } => {
                banned = quote!(::core::option::Option::Some(#op));
                (
                    quote!(&[::std::vec::Vec<::core::primitive::u32>]),
                    format!("`{b}` lists of banned token ids"),
                )
            }
            Transform::Penalties { .. } => {
                penalties = quote!(::core::option::Option::Some(#op));
                (
                    quote!(::flashsample::PenaltyArg<'_>),
                    format!(
                        "per-row repetition, presence and frequency penalties (`[{b}]` each; 1, 0, 0 = off) \
                         and `{b}` histories of `(token, count)` pairs"
                    ),
                )
            }
            Transform::Filter { max_k, .. } => {
                filter = quote!(::core::option::Option::Some(#op));
                (
                    quote!(&[::flashsample::RowFilter]),
                    format!(
                        "`[{b}]` per-row top-k / top-p / min-p (`RowFilter::OFF` leaves a row unfiltered); \
                         `top_k` at most {max_k}, the declared `max_k` (a row with no top-k whose top-p / min-p \
                         nucleus outgrows the candidate lists is served exactly by `Sampler::sample`; a \
                         device-API launch reports it as `ListError::NucleusTooLarge`)"
                    ),
                )
            }
            Transform::Temperature(Temperature::Const(_)) | Transform::Softcap { .. } => continue,
        };
        params.push(quote!(#op: #ty));
        docs.push(format!("- `{op}`: {doc}"));
    }
    let mut targets = none.clone();
    if let Some(t) = &l.targets {
        let op = &t.operand;
        targets = quote!(::core::option::Option::Some(#op));
        params.push(quote!(#op: &[::core::primitive::u32]));
        docs.push(format!("- `{op}`: `[{b}]` the token to score in each row (its logprob is `target_logprobs`)"));
    }
    let (mut drafts, mut draft_probs) = (none.clone(), none.clone());
    if let Some(spec) = &l.verify {
        let op = &spec.drafts;
        drafts = quote!(::core::option::Option::Some(#op));
        params.push(quote!(#op: &[::core::primitive::u32]));
        docs.push(format!(
            "- `{op}`: `[S·k]` draft tokens, `k` per sequence; the `{b}` rows are `S` sequences of `k + 1` target \
             positions (row `i·(k+1) + j` predicts draft `j` of sequence `i`, row `i·(k+1) + k` the bonus)"
        ));
        if let Some(q) = &spec.draft_probs {
            draft_probs = quote!(::core::option::Option::Some(#q));
            params.push(quote!(#q: &[::core::primitive::f32]));
            docs.push(format!("- `{q}`: `[S·k, {v}]` f32 draft distributions, one row per draft (finite, ≥ 0, > 0 at the draft token)"));
        }
    }
    // Every field the pipeline's transforms decide; the seed fields differ between `sample`
    // and `sample_with_seeds`, and `vocab_offset` (sharding) is left to `ShardedSampler`.
    let fields = quote! {
        temperature: #temperature,
        bias: #bias,
        mask: #mask,
        banned: #banned,
        filter: #filter,
        penalties: #penalties,
        logit_bias: #logit_bias,
        targets: #targets,
        drafts: #drafts,
        draft_probs: #draft_probs,
    };
    let o = p.outputs;
    let mut returned = vec!["`tokens`".to_string()];
    for (on, what) in [(o.score, "`scores`"), (o.logsumexp, "`logsumexp`"), (o.logprob, "`logprobs`")] {
        if on {
            returned.push(what.to_string());
        }
    }
    if o.top_logprobs > 0 {
        returned.push(format!("`top_logprobs` (the {} most likely tokens of each row)", o.top_logprobs));
    }
    if let Some(t) = &p.targets {
        returned.push("`target_logprobs`".to_string());
        if t.rank {
            returned.push("`target_ranks`".to_string());
        }
    }
    let mode = match p.logprob_mode {
        LogprobMode::Processed => "",
        LogprobMode::Raw => " The logprob outputs are raw logprobs: the model's, before the request's processing.",
    };
    // A verifying pipeline's methods verify (`Sampler::verify`, returning `Verified`) instead
    // of sampling.
    let (sample, sample_with_seeds, entry, output, returns, what) = if p.verify.is_some() {
        (
            quote!(verify),
            quote!(verify_with_seeds),
            quote!(verify),
            quote!(::flashsample::Verified),
            format!(
                "Returns `Verified`: per sequence the accepted drafts, the next token and the emitted tokens{}.",
                if o.logprob { " with their logprobs" } else { "" }
            ),
            "Verifies the drafts of each sequence against".to_string(),
        )
    } else {
        (
            quote!(sample),
            quote!(sample_with_seeds),
            quote!(sample),
            quote!(::flashsample::Samples),
            format!("Returns `Samples` with {}.{mode}", returned.join(", ")),
            format!("Samples {} token(s) per row from", p.samples_per_row()),
        )
    };
    let sample_doc = |docs: &[String]| {
        format!(
            "{what} `{hidden} · {weights}ᵀ` through this pipeline.\n\n\
             Arguments, in declaration order:\n{}\n\n{returns}",
            docs.join("\n")
        )
    };
    let sample_fns = match (&p.sampler, &l.sampler.seed) {
        (Sampler::GumbelMax { .. }, Some(seed)) => {
            // Field shorthand when the operand is named `seed` (clippy: redundant_field_names).
            let seed_field = if seed == "seed" { quote!(#seed) } else { quote!(seed: #seed) };
            let seed_doc = format!("- `{seed}`: Philox seed of the Gumbel noise (row `r` draws from counter row `r`)");
            let doc = sample_doc(&[docs.clone(), vec![seed_doc]].concat());
            // Mixed-site hygiene: a user operand that happens to be named `row_seeds` is a
            // different binding, so the two parameters cannot collide.
            let row_seeds = proc_macro2::Ident::new("row_seeds", proc_macro2::Span::mixed_site());
            let with_seeds_doc = format!(
                "Like [`Self::{sample}`], but with one Philox seed per row in place of `{seed}`: row `r` draws \
                 its noise from `row_seeds[r]` alone, so a request samples the same tokens wherever it sits \
                 in the batch (continuous batching).\n\n{}",
                sample_doc(&[docs, vec![format!("- `row_seeds`: `[{b}]` per-row Philox seeds")]].concat())
            );
            quote! {
                #[doc = #doc]
                #[allow(clippy::too_many_arguments)]
                pub fn #sample(&self, #(#params,)* #seed: ::core::primitive::u64) -> ::flashsample::Result<#output> {
                    self.inner.#entry(
                        #hidden.into(),
                        #weights.into(),
                        &::flashsample::SamplingParams {
                            #fields
                            #seed_field,
                            ..::core::default::Default::default()
                        },
                    )
                }

                #[doc = #with_seeds_doc]
                #[allow(clippy::too_many_arguments)]
                pub fn #sample_with_seeds(
                    &self,
                    #(#params,)*
                    #row_seeds: &[::core::primitive::u64],
                ) -> ::flashsample::Result<#output> {
                    self.inner.#entry(
                        #hidden.into(),
                        #weights.into(),
                        &::flashsample::SamplingParams {
                            #fields
                            row_seeds: ::core::option::Option::Some(#row_seeds),
                            ..::core::default::Default::default()
                        },
                    )
                }
            }
        }
        // Greedy: no noise, so no seed and no `sample_with_seeds`.
        _ => {
            let doc = sample_doc(&docs);
            quote! {
                #[doc = #doc]
                #[allow(clippy::too_many_arguments)]
                pub fn #sample(&self, #(#params),*) -> ::flashsample::Result<#output> {
                    self.inner.#entry(
                        #hidden.into(),
                        #weights.into(),
                        &::flashsample::SamplingParams {
                            #fields
                            ..::core::default::Default::default()
                        },
                    )
                }
            }
        }
    };
    let ir_doc =
        format!("The pipeline's canonical IR text, validated when this crate was compiled:\n\n```text\n{ir}```");

    Ok(quote! {
        #(#attrs)*
        #vis struct #name {
            inner: ::flashsample::Sampler,
        }

        impl #name {
            #[doc = #ir_doc]
            pub const IR: &'static str = #ir;

            /// The pipeline, parsed from [`Self::IR`].
            pub fn pipeline() -> ::flashsample::ir::Pipeline {
                // `IR` passed `Pipeline::validate` and round-tripped through `Pipeline::parse`
                // when the macro expanded, so this cannot fail.
                ::flashsample::ir::Pipeline::parse(Self::IR).expect("flashsample!: IR validated at compile time")
            }

            /// Compiles (or fetches from the kernel cache) this pipeline's kernels for `device`.
            pub fn new(device: &::flashsample::Device) -> ::flashsample::Result<Self> {
                ::core::result::Result::Ok(Self { inner: ::flashsample::Sampler::new(Self::pipeline(), device)? })
            }

            /// The untyped sampler underneath.
            pub fn sampler(&self) -> &::flashsample::Sampler {
                &self.inner
            }

            #sample_fns
        }
    })
}
