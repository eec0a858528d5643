"""Timing shared by the peers scripts: medians of repeated calls and their peak extra memory."""

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
