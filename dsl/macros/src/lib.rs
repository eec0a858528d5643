//! The `flashsample!` proc macro: parse pipeline declarations, validate them at compile time with
//! the real IR validator (errors point at the offending tokens), and expand each to a typed
//! sampler struct over the `flashsample` runtime.
//!
//! ```ignore
//! flashsample! {
//!     /// Doc comments and attributes pass through to the struct.
//!     pub pipeline QwenSampler {
//!         hidden: bf16[B, D], weights: bf16[V, D];
//!         logits = matmul(hidden, weights);
//!         logits = logits / temperature[B];      // or `logits / temperature` (scalar), `logits / 0.7`
//!         logits = logits + bias[V];
//!         logits = mask(logits, allowed[B, V]);
//!         logits = ban(logits, banned[B]);
//!         logits = softcap(logits, 30.0);
//!         logits = penalties(logits, penalties[B]);  // repetition / presence / frequency, per row
//!         logits = top_k_top_p(logits, filter[B], max_k = 64);   // per-row top-k / top-p / min-p; last
//!         sample = gumbel_argmax(logits, seed, samples = 1);   // or `sample = argmax(logits);`
//!         outputs(score, logsumexp, logprob, top_logprobs = 5);   // optional, any subset
//!     }
//! }
//! ```
//!
//! expands to `pub struct QwenSampler` with `IR`, `pipeline()`, `new(&Device)`, `sampler()` and
//! `sample(hidden, weights, temperature, bias, allowed, banned, penalties, filter, seed)`, whose
//! arguments follow the declared runtime operands in order (`penalties: PenaltyArg<'_>`,
//! `filter: &[RowFilter]`). Sampling pipelines also get `sample_with_seeds(.., row_seeds: &[u64])`:
//! the same arguments with one seed per row in place of `seed`, so a row's noise does not depend
//! on its position in the batch. The expansion names only `::flashsample::…` paths.

mod ast;
mod expand;
mod lower;
#[cfg(test)]
mod tests;

/// Declares one or more sampling pipelines; see the crate docs for the syntax.
#[proc_macro]
pub fn flashsample(input: proc_macro::TokenStream) -> proc_macro::TokenStream {
    expand::expand(input.into())
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}
