"""What the peers scripts share: their common arguments, the weights they time against, the
medians of repeated calls and their peak extra memory."""

import argparse
import json
import statistics
import sys
import time


def median_ms(torch, call, warmup, reps, cuda, events):
    """Median ms of `reps` calls of `call` after `warmup`: CUDA events around each call
    (`events`), else wall time with a synchronize before and after on CUDA."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        if cuda and events:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            call()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
            continue
        s = time.perf_counter()
        call()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - s) * 1e3)
    return statistics.median(times)


def peak_mb(torch, call, cuda):
    """CUDA's peak allocation during one call beyond what was allocated before it, in MB
    (None off CUDA)."""
    if not cuda:
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def measure(record, name, timed_call, what, torch, cuda):
    """Sets `record[name]` and `record["mem_" + name]` from `timed_call()` (ms, MB); a failing
    peer (out of memory, no compiler) leaves nulls and says why on stderr."""
    record[name], record["mem_" + name] = None, None
    try:
        record[name], record["mem_" + name] = timed_call()
    except Exception as e:  # noqa: BLE001 - a failing peer is a null, not a crash
        print(f"{what}: {name} failed: {e}", file=sys.stderr)
        if cuda:
            torch.cuda.empty_cache()


def parse_args(own):
    """The arguments every peers script takes (--dim, --vocab, --reps, --warmup, --device), plus
    the script's own, which `own(parser)` adds."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, required=True)
    ap.add_argument("--vocab", type=int, default=151936)
    own(ap)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    return ap.parse_args()


def torch_and_head(args, out):
    """PyTorch (its version into `out["torch"]`), the device, whether it is CUDA, a CPU
    generator seeded at 1 and the bf16 weights [V, D] ~ U(-0.05, 0.05) on the device; or None,
    once `out` is printed as it is, when PyTorch does not import."""
    try:
        import torch
    except ImportError:
        print(json.dumps(out))
        return None
    out["torch"] = torch.__version__
    dev = torch.device(args.device)
    g = torch.Generator(device="cpu").manual_seed(1)
    w = (torch.rand(args.vocab, args.dim, generator=g) * 0.1 - 0.05).to(torch.bfloat16).to(dev)
    return torch, dev, dev.type == "cuda", g, w
