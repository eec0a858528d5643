//! The `flashsample!` proc macro: parse pipeline declarations, validate them at compile time with
//! the real IR validator (errors point at the offending tokens), and expand each to a typed
//! sampler struct over the `flashsample` runtime.
//!
//! The syntax is documented on [`flashsample!`](macro@flashsample), which the `flashsample`
//! crate re-exports.

mod ast;
mod expand;
mod lower;
#[cfg(test)]
mod tests;

/// Declares one or more sampling pipelines, checked at compile time, each as a typed sampler.
///
/// ```ignore
/// use flashsample::{flashsample, Device, Matrix, RowFilter};
///
/// flashsample! {
///     /// Doc comments and attributes pass through to the struct.
///     pub pipeline QwenSampler {
///         hidden: bf16[B, D], weights: bf16[V, D];   // bf16, f16 or f32; B, D, V are names
///         logits = matmul(hidden, weights);
///         // Transforms, in the order they apply, each at most once:
///         logits = logits / temperature[B];      // per row (0 = greedy row); or `logits / temperature`
///                                                // (one for the launch), or a constant `logits / 0.7`
///         logits = logits + bias[V];             // f32 per token; -inf bans it
///         logits = mask(logits, allowed[B, V]);  // u32 bitset, bit v % 32 of word v / 32 per row
///         logits = ban(logits, banned[B]);       // per-row lists of token ids
///         logits = softcap(logits, 30.0);        // cap · tanh(logit / cap)
///         logits = logit_bias(logits, logit_bias[B]);  // per-request {token: bias}; -inf bans;
///                                                // before penalties and temperature (vLLM's order)
///         logits = penalties(logits, penalties[B]);  // vLLM repetition / presence / frequency
///         logits = top_k_top_p(logits, filter[B], max_k = 64);  // per-row top-k / top-p / min-p; last
///         sample = gumbel_argmax(logits, seed, samples = 1);    // or `sample = argmax(logits);`
///         // Optional, after the sampler: `score = target_logprob(logits, targets[B]);` also
///         // returns each row's logprob of `targets[r]` (`Samples::target_logprobs`);
///         // `target_logprob(logits, targets[B], rank)` its rank too (`Samples::target_ranks`).
///         outputs(score, logsumexp, logprob, top_logprobs = 5); // optional, any subset; add `raw`
///                                                // for the model's logprobs (before penalties, logit bias,
///                                                // temperature and masks) instead of the processed ones
///     }
/// }
///
/// let sampler = QwenSampler::new(&Device::cpu())?;
/// let out = sampler.sample(
///     Matrix::new(&hidden, b, d)?, Matrix::new(&weights, v, d)?,
///     &temperatures, &bias, &allowed, &banned, penalties, &filters, seed,
/// )?;
/// ```
///
/// Each pipeline becomes a struct (here `pub struct QwenSampler`) with:
/// - `IR: &str`, the pipeline's IR text, and `pipeline()`, the validated
///   `flashsample::ir::Pipeline`;
/// - `new(&Device) -> Result<Self>` and `sampler()`, the underlying `flashsample::Sampler`;
/// - `sample(hidden, weights, <runtime operands in declaration order>, seed)`: the matrices as
///   `Matrix<'_, bf16 | f16 | f32>`, then one argument per declared operand: temperature
///   `&[f32]` (per row) or `f32` (scalar), bias `&[f32]`, mask `&[u32]`, banned `&[Vec<u32>]`,
///   logit bias `&[Vec<(u32, f32)>]`, penalties `PenaltyArg<'_>`, filter `&[RowFilter]`; then the `u64` seed (sampling pipelines);
/// - `sample_with_seeds(.., row_seeds: &[u64])` (sampling pipelines): the same arguments with one
///   seed per row in place of `seed`, so a row's noise does not depend on its position in the batch.
///
/// A pipeline that does not validate (a transform after the filter, an unknown operation, a
/// zero `max_k`, …) is a compile error pointing at the offending tokens. The expansion names
/// only `::flashsample::…` paths. The same pipeline in the runtime's IR text form, which
/// `flashsample_ir::Pipeline::parse` reads, is spelled differently (see its docs).
#[proc_macro]
pub fn flashsample(input: proc_macro::TokenStream) -> proc_macro::TokenStream {
    expand::expand(input.into())
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}
