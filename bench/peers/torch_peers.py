#!/usr/bin/env python3
"""Unfused PyTorch peers of flashsample's fused LM-head sampler, timed on the same GPU.

For each (D, V) and batch B, with bf16 hidden states [B, D] and weights [V, D]:
  matmul    cuBLAS `H @ W.T` alone (bf16 logits, materialized)
  compiled  torch.compile'd matmul + softmax(logits / T) + torch.multinomial
  gumbel_compiled  torch.compile'd matmul + /T + Gumbel-argmax (inductor fuses the noise and
            the argmax into one pass over the logits): the Gumbel peer
  gumbel    the same eager (cuBLAS matmul, then five elementwise/reduction kernels)
  filtered  torch.compile'd matmul + /T + top-k 50 + softmax + top-p 0.9 + multinomial
            (vLLM's order: top-p on the top-k renormalized), for --filter-batches
and a large device-to-device copy (bytes read + written / time) as the bandwidth ceiling, and
an 8192³ bf16 cuBLAS GEMM (2·8192³ / time) as the tensor cores' dense peak: the compute floor
of a batch is 2·B·D·V / that peak.

Timing: CUDA events between back-to-back calls (no host sync inside the timed loop), after
warm-up, median over `--reps`, cycling through `--rotate` weight buffers so L2 never holds
the previous call's weights. Prints a table, or one JSON object with --json.
"""

import argparse
import json
import statistics
import sys

import torch


def parse_shapes(s):
    out = []
    for item in s.split(","):
        d, v = item.split(":")
        out.append((int(d), int(v)))
    return out


def time_calls(fn, args_list, warmup, reps):
    """Median milliseconds of fn(*args) over reps calls, cycling args_list."""
    for i in range(warmup):
        fn(*args_list[i % len(args_list)])
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    events[0].record()
    for i in range(reps):
        fn(*args_list[i % len(args_list)])
        events[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(reps))


def copy_bandwidth(nbytes, reps):
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_calls(lambda: dst.copy_(src), [()], 5, reps)
    return 2 * nbytes / (ms * 1e-3)


def bf16_peak_flops(reps):
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_calls(lambda: a @ b, [()], 5, reps)
    return 2 * n ** 3 / (ms * 1e-3)


def matmul(h, w, t):
    return h @ w.T


def softmax_multinomial(h, w, t):
    logits = (h @ w.T).float() / t[:, None]
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1)


def gumbel_argmax(h, w, t):
    logits = (h @ w.T).float() / t[:, None]
    u = torch.rand_like(logits)
    return torch.argmax(logits - torch.log(-torch.log(u)), dim=-1)


def topk_topp_multinomial(h, w, t):
    logits = (h @ w.T).float() / t[:, None]
    vals, idx = torch.topk(logits, 50, dim=-1)  # sorted, most likely first
    probs = torch.softmax(vals, dim=-1)
    # Keep the smallest prefix holding 0.9 of the top-k mass (a token stays if the mass
    # before it is < 0.9), then draw from the renormalized survivors.
    before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(before >= 0.9, 0.0)
    choice = torch.multinomial(probs, 1)
    return idx.gather(-1, choice)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096:151936,8192:128256")
    ap.add_argument("--batches", default="1,4,16,64,128,256")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rotate", type=int, default=3)
    ap.add_argument("--filter-batches", default="1,16,64,256", help="batches of the top-k/top-p peer; empty = none")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    a = ap.parse_args()

    torch.manual_seed(0)
    # One compiled graph per batch size and shape; the default recompile limit (8) is too few.
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1024)
    compiled = torch.compile(softmax_multinomial, dynamic=False)
    compiled_filtered = torch.compile(topk_topp_multinomial, dynamic=False)
    compiled_gumbel = torch.compile(gumbel_argmax, dynamic=False)
    filter_batches = [int(b) for b in a.filter_batches.split(",") if b]

    out = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "copy_bytes_per_s": copy_bandwidth(2 << 30, 20),
        "bf16_peak_flops": bf16_peak_flops(20),
        "results": [],
    }
    batches = [int(b) for b in a.batches.split(",")]
    for d, v in parse_shapes(a.shapes):
        ws = [(torch.randn(v, d, device="cuda", dtype=torch.bfloat16) * (3.0 / d ** 0.5)) for _ in range(a.rotate)]
        for b in sorted(set(batches) | set(filter_batches)):
            h = torch.randn(b, d, device="cuda", dtype=torch.bfloat16)
            t = torch.rand(b, device="cuda", dtype=torch.float32) + 0.5
            args = [(h, w, t) for w in ws]
            row = {"dim": d, "vocab": v, "batch": b}
            if b in batches:
                row["matmul_ms"] = time_calls(matmul, args, a.warmup, a.reps)
                row["gumbel_ms"] = time_calls(gumbel_argmax, args, a.warmup, a.reps)
                if not a.no_compile:
                    compiled(*args[0])  # compile outside the timed loop
                    row["compiled_ms"] = time_calls(compiled, args, a.warmup, a.reps)
                    compiled_gumbel(*args[0])
                    row["gumbel_compiled_ms"] = time_calls(compiled_gumbel, args, a.warmup, a.reps)
            if b in filter_batches and not a.no_compile:
                compiled_filtered(*args[0])
                row["filtered_ms"] = time_calls(compiled_filtered, args, a.warmup, a.reps)
            out["results"].append(row)
            print(f"peers: D={d} V={v} B={b} {row}", file=sys.stderr, flush=True)
        del ws
        torch.cuda.empty_cache()
    if a.json:
        print(json.dumps(out))
    else:
        print(f"{out['device']}, torch {out['torch']}, copy {out['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
              f"bf16 GEMM {out['bf16_peak_flops'] / 1e12:.0f} TFLOP/s")
        for r in out["results"]:
            print(r)


if __name__ == "__main__":
    main()
