#!/usr/bin/env python3
"""Unfused CPU peers of flashsample's fused sampler, timed on this machine (run by cpu_bench).

For one (D, V) and each batch B, with hidden states [B, D] and weights [V, D] (values drawn as
cpu_bench draws its own: W ~ U(-0.05, 0.05), H ~ U(-1, 1), T = 0.7):
  torch_mm        PyTorch bf16 `H @ W.T` alone (oneDNN), bf16 logits materialized
  torch_eager     PyTorch bf16 matmul + /T + softmax + multinomial, eager
  torch_compile   the same pipeline under torch.compile (inductor; may fail without a
                  C++ compiler: then null, with the reason on stderr)
  numpy           numpy f32 weights: matmul (the BLAS numpy links) + /T + softmax + an
                  inverse-CDF draw per row
Every value is the median of --reps calls after --warmup calls, in milliseconds. Prints one
JSON object: {"torch": version or null, "numpy": version or null, "threads": n, "rows":
[{"dim", "batch", "torch_mm", "torch_eager", "torch_compile", "numpy"}]}. A missing package
gives nulls for its columns, not an error.
"""

import argparse
import json
import statistics
import sys
import time


def median_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    t = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        t.append(time.perf_counter() - start)
    return statistics.median(t) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, required=True)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="0 = the libraries' default")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-numpy", action="store_true")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    V, D, T = args.vocab, args.dim, args.temperature

    try:
        import torch
    except ImportError:
        torch = None
    try:
        import numpy as np
    except ImportError:
        np = None

    out = {
        "torch": torch.__version__ if torch else None,
        "numpy": np.__version__ if np else None,
        "threads": args.threads,
        "rows": [],
    }
    rows = {b: {"dim": D, "batch": b, "torch_mm": None, "torch_eager": None, "torch_compile": None, "numpy": None} for b in batches}

    if torch is not None:
        if args.threads:
            torch.set_num_threads(args.threads)
        out["threads"] = torch.get_num_threads()
        g = torch.Generator().manual_seed(1)
        w = (torch.rand(V, D, generator=g) * 0.1 - 0.05).to(torch.bfloat16)

        def pipeline(h, w):
            logits = (h @ w.T).float() / T
            probs = torch.softmax(logits, dim=-1)
            return torch.multinomial(probs, 1)

        compiled = None
        if not args.no_compile:
            try:
                compiled = torch.compile(pipeline, dynamic=False)
            except Exception as e:  # noqa: BLE001 - report and go on without the peer
                print(f"cpu_peers: torch.compile unavailable: {e}", file=sys.stderr)
        with torch.inference_mode():
            for b in batches:
                h = (torch.rand(b, D, generator=g) * 2 - 1).to(torch.bfloat16)
                rows[b]["torch_mm"] = median_ms(lambda: h @ w.T, args.warmup, args.reps)
                rows[b]["torch_eager"] = median_ms(lambda: pipeline(h, w), args.warmup, args.reps)
                if compiled is not None:
                    try:
                        rows[b]["torch_compile"] = median_ms(lambda: compiled(h, w), args.warmup, args.reps)
                    except Exception as e:  # noqa: BLE001
                        print(f"cpu_peers: torch.compile failed at B={b}: {e}", file=sys.stderr)
                        compiled = None
        del w

    if np is not None and not args.no_numpy:
        rng = np.random.default_rng(1)
        w = rng.uniform(-0.05, 0.05, size=(V, D)).astype(np.float32)
        for b in batches:
            h = rng.uniform(-1.0, 1.0, size=(b, D)).astype(np.float32)
            u = rng.uniform(size=(b, 1))

            def numpy_pipeline():
                logits = h @ w.T
                logits /= T
                logits -= logits.max(axis=1, keepdims=True)
                np.exp(logits, out=logits)
                cdf = np.cumsum(logits, axis=1)
                return (cdf < u * cdf[:, -1:]).sum(axis=1)

            rows[b]["numpy"] = median_ms(numpy_pipeline, args.warmup, args.reps)
        del w

    out["rows"] = [rows[b] for b in batches]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
