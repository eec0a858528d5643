use flashsample_macros::flashsample;

flashsample! {
    pub pipeline Sampler {
        hidden: bf16[B, D], weights: bf16[V, D];
        logits = matmul(hidden, weights);
        logits = top_k_top_p(logits, filter[B], max_k = 0);
        sample = gumbel_argmax(logits, seed, samples = 1);
        outputs(logprob, top_logprobs = 5);
    }
}

fn main() {}
