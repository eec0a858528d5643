use flashsample_macros::flashsample;

flashsample! {
    pub pipeline Sampler {
        hidden: bf16[B, D], weights: bf16[V, D];
        logits = matmul(hidden, weights);
        logits = logits / temperature[B];
        logits = logit_bias(logits, logit_bias[B]);
        sample = gumbel_argmax(logits, seed, samples = 1);
    }
}

fn main() {}
