#!/usr/bin/env python3
"""Peers of flashsample's fused scoring (`target_logprob`), timed in this process (run by score_bench).

For one (D, V) and each row count R, with hidden states [R, D], weights [V, D] (bf16; W ~ U(-0.05,
0.05), H ~ U(-1, 1)) and one target token per row:
  torch_compile  torch.compile'd `log_softmax((H @ W.T).float()).gather(targets)`: the [R, V]
                 logits are materialized
  torch_eager    the same, eager
  cublas_mm      the matmul alone, `H @ W.T` in bf16 (cuBLAS on CUDA): no peer can score in less,
                 so it tells where a speed target lies below what the matmul itself takes
  liger          Liger-Kernel's fused linear cross-entropy (reduction="none"; the per-row loss is
                 -logprob), when `liger_kernel` imports and the device is CUDA; it chunks the
                 rows, so its logits are never all in memory at once
Times are medians of --reps calls after --warmup, in ms (CUDA: events around each call). Peak
memory (CUDA only) is torch.cuda.max_memory_allocated during one call minus what was allocated
before it, in MB. Prints one JSON object: {"torch", "liger", "device", "rows": [{"rows",
"torch_compile", "torch_eager", "cublas_mm", "liger", "mem_torch_compile", "mem_torch_eager",
"mem_cublas_mm", "mem_liger"}]};
a missing package or failing peer gives nulls (with the reason on stderr).
"""

import json
import sys

from peer_timing import measure, median_ms, parse_args, peak_mb, torch_and_head


def main():
    args = parse_args(lambda ap: ap.add_argument("--rows", default="256,2048,8192"))
    rows_list = [int(r) for r in args.rows.split(",") if r]
    V, D = args.vocab, args.dim
    out = {"torch": None, "liger": None, "device": args.device, "rows": []}
    head = torch_and_head(args, out)
    if head is None:
        return
    torch, dev, cuda, g, w = head
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        from importlib.metadata import version

        liger_loss = LigerFusedLinearCrossEntropyLoss(reduction="none")
        out["liger"] = version("liger-kernel")
    except Exception as e:  # noqa: BLE001 - any import failure means "no Liger"
        liger_loss = None
        print(f"score_peers: no Liger-Kernel ({e})", file=sys.stderr)


    def score(h, w, t):
        logits = (h @ w.T).float()
        return torch.log_softmax(logits, dim=-1).gather(1, t[:, None])[:, 0]

    compiled = torch.compile(score)

    def matmul(h, w, t):
        return h @ w.T

    def liger(h, w, t):
        # Liger's module takes the weight first; the per-row loss is lse - x_target.
        return -liger_loss(w, h, t)

    def timed(fn, h, t):
        call = lambda: fn(h, w, t)  # noqa: E731
        return median_ms(torch, call, args.warmup, args.reps, cuda, events=True), peak_mb(torch, call, cuda)

    for r in rows_list:
        h = (torch.rand(r, D, generator=g) * 2 - 1).to(torch.bfloat16).to(dev)
        t = torch.randint(0, V, (r,), generator=g).to(dev)
        row = {"rows": r}
        for name, fn, wanted in [("torch_compile", compiled, True), ("torch_eager", score, True), ("cublas_mm", matmul, True), ("liger", liger, liger_loss is not None and cuda)]:
            row[name], row["mem_" + name] = None, None
            if not wanted:
                continue
            measure(row, name, lambda: timed(fn, h, t), f"score_peers at {r} rows", torch, cuda)  # noqa: B023
        out["rows"].append(row)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
