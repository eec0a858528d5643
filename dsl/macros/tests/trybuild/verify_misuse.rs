use flashsample_macros::flashsample;

flashsample! {
    pub pipeline Verifier {
        hidden: bf16[B, D], weights: bf16[V, D];
        logits = matmul(hidden, weights);
        accept = verify(logits, drafts[N]);
        sample = gumbel_argmax(logits, seed, samples = 2);
        accept = verify(logits, drafts[N], draft_probs[N, D]);
        accept = check(logits, drafts[N]);
    }
}

fn main() {}
