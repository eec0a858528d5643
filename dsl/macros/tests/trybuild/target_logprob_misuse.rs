use flashsample_macros::flashsample;

flashsample! {
    pub pipeline Scorer {
        hidden: bf16[B, D], weights: bf16[V, D];
        logits = matmul(hidden, weights);
        score = target_logprob(logits, targets[B]);
        sample = argmax(logits);
        score = target_logprob(logits, targets[V]);
        score = rank(logits, targets[B]);
    }
}

fn main() {}
