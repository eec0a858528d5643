#!/usr/bin/env python3
"""Peer of flashsample's fused speculative verification, timed in this process (run by spec_bench).

For one (D, V) and each (B sequences, k drafts), with target hidden states [B·(k+1), D], weights
[V, D] (bf16; W ~ U(-0.05, 0.05), H ~ U(-1, 1)), k sampled drafts per sequence and their
distributions [B·k, V] (f32, on the device, as engines hold them):
  torch_compile  a torch.compile'd verification step the way engines run it over materialized
                 probabilities: logits = (H @ W.T).float() [B·(k+1), V], softmax, then vLLM's
                 rejection sampler (accept d_j iff u_j < min(1, p_j(d_j) / q_j(d_j)); at the
                 first rejection draw from normalize(max(0, p_j − q_j)); after k acceptances
                 the bonus from p_k; both draws by the exponential race argmax(p / E) that
                 vLLM's sampler uses)
  torch_eager    the same, eager
  cublas_mm      the matmul alone, `H @ W.T` in bf16 (cuBLAS on CUDA): what any verifier that
                 computes the target logits must at least spend
Times are medians of --reps calls after --warmup, in ms of wall time around each call (a
synchronize before and after, as spec_bench times the host API). Peak memory (CUDA only) is
torch.cuda.max_memory_allocated during one call minus what was allocated before it, in MB.
Prints one JSON object: {"torch", "device", "cases": [{"batch", "k", "torch_compile",
"torch_eager", "cublas_mm", "mem_torch_compile", "mem_torch_eager", "mem_cublas_mm"}]}; a
missing package or failing peer gives nulls (with the reason on stderr).
"""

import json

from peer_timing import measure, median_ms, parse_args, peak_mb, torch_and_head


def main():
    def own(ap):
        ap.add_argument("--batches", default="1,16,64")
        ap.add_argument("--ks", default="3,7")

    args = parse_args(own)
    batches = [int(b) for b in args.batches.split(",") if b]
    ks = [int(k) for k in args.ks.split(",") if k]
    V, D = args.vocab, args.dim
    out = {"torch": None, "device": args.device, "cases": []}
    head = torch_and_head(args, out)
    if head is None:
        return
    torch, dev, cuda, g, w = head

    def verify(h, w, drafts, q, temperature, uniforms):
        # h [B·(k+1), D]; drafts [B, k]; q [B, k, V]; temperature [B·(k+1)]; uniforms [B, k].
        b, k = drafts.shape
        logits = (h @ w.T).float() / temperature[:, None]
        p = torch.softmax(logits, dim=-1).view(b, k + 1, -1)
        p_draft = p[:, :k].gather(-1, drafts[..., None])[..., 0]
        q_draft = q.gather(-1, drafts[..., None])[..., 0]
        accepted = uniforms < torch.clamp(p_draft / q_draft, max=1.0)
        # Drafts accepted before the first rejection.
        n_accepted = torch.cumprod(accepted.int(), dim=1).sum(dim=1)
        residual = torch.clamp(p[:, :k] - q, min=0.0)
        residual = residual / residual.sum(dim=-1, keepdim=True).clamp(min=1e-30)
        race = torch.empty_like(residual).exponential_()
        recovered = torch.argmax(residual / race, dim=-1)
        bonus = torch.argmax(p[:, k] / torch.empty_like(p[:, k]).exponential_(), dim=-1)
        at = torch.clamp(n_accepted, max=k - 1)[:, None]
        correction = recovered.gather(1, at)[:, 0]
        next_token = torch.where(n_accepted == k, bonus, correction)
        return n_accepted, next_token

    compiled = torch.compile(verify)

    def matmul(h, w, *_):
        return h @ w.T

    def timed(fn, inputs):
        call = lambda: fn(*inputs)  # noqa: E731
        return median_ms(torch, call, args.warmup, args.reps, cuda, events=False), peak_mb(torch, call, cuda)

    for b in batches:
        for k in ks:
            rows = b * (k + 1)
            h = (torch.rand(rows, D, generator=g) * 2 - 1).to(torch.bfloat16).to(dev)
            q = torch.rand(b, k, V, generator=g) ** 4
            q = (q / q.sum(dim=-1, keepdim=True)).to(dev)
            drafts = torch.multinomial(q.view(b * k, V).cpu(), 1, generator=g).view(b, k).to(dev)
            temperature = torch.ones(rows, device=dev)
            uniforms = torch.rand(b, k, generator=g).to(dev)
            case = {"batch": b, "k": k}
            inputs = (h, w, drafts, q, temperature, uniforms)
            for name, fn in [("torch_compile", compiled), ("torch_eager", verify), ("cublas_mm", matmul)]:
                measure(case, name, lambda: timed(fn, inputs), f"spec_peers B={b} k={k}", torch, cuda)  # noqa: B023
            out["cases"].append(case)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
