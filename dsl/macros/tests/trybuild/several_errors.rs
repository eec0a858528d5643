use flashsample_macros::flashsample;

flashsample! {
    pub pipeline Sampler {
        hidden: bf8[B, D], weights: bf16[V, D];
        logits = matmul(hidden, weights);
        logits = logits / temperature[V];
        sample = gumbel_argmax(logits, seed, samples = 0);
    }
}

fn main() {}
