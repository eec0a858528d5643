use flashsample_macros::flashsample;

flashsample! {
    pub pipeline RawScores {
        hidden: bf16[B, D], weights: bf16[V, D];
        logits = matmul(hidden, weights);
        logits = logits / temperature[B];
        sample = gumbel_argmax(logits, seed, samples = 1);
        outputs(score, raw);
    }
}

flashsample! {
    pub pipeline TwoModes {
        hidden: bf16[B, D], weights: bf16[V, D];
        logits = matmul(hidden, weights);
        sample = argmax(logits);
        outputs(logprob, raw, processed);
    }
}

fn main() {}
