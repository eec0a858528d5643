use flashsample_macros::flashsample;

flashsample! {
    pub pipeline Sampler {
        hidden: bf16[B, D], weights: bf16[V, K];
        logits = matmul(hidden, weights);
        sample = gumbel_argmax(logits, seed, samples = 1);
    }
}

fn main() {}
