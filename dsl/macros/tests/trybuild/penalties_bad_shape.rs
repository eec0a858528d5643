use flashsample_macros::flashsample;

flashsample! {
    pub pipeline Sampler {
        hidden: bf16[B, D], weights: bf16[V, D];
        logits = matmul(hidden, weights);
        logits = penalties(logits, penalties[B, V]);
        logits = top_k_top_p(logits, filter[B]);
        sample = gumbel_argmax(logits, seed, samples = 1);
    }
}

fn main() {}
