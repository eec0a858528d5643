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
--filter: the pipelines sample with top-k 50 + top-p 0.9 instead (gpu_bench's filtered peer:
matmul, /T, top-k, softmax over the top 50, keep the smallest prefix holding 0.9 of its mass,
draw; numpy: argpartition for the top 50, then the same cut and an inverse-CDF draw).
Every value is the median of --reps calls after --warmup calls, in milliseconds. Prints one
JSON object: {"torch": version or null, "numpy": version or null, "threads": n, "rows":
[{"dim", "batch", "torch_mm", "torch_eager", "torch_compile", "numpy"}]}. A missing package
gives nulls for its columns, not an error.

--serve (how cpu_bench runs it): the same peers, one call at a time on request, so that the
caller can alternate them with its own launches and every column sees the same phase of a
shared machine's memory bandwidth. After set-up it prints one JSON line {"torch", "numpy",
"threads"}; then per input line `warm B` it runs --warmup calls of each peer at batch B
(compiling it) and prints {}; per `time B` one timed call of each, printed as one JSON line
{"torch_mm", "torch_eager", "torch_compile", "numpy"} in milliseconds; `quit` ends it.
--copies N: N identical copies of each W, and every call takes the next one, so that a W the
last-level cache could hold is read from memory as an LM head's is (cpu_bench picks N).
"""

import argparse
import json
import statistics
import sys
import time

# The --filter pipelines' top-k and top-p (cpu_bench's TOP_K and TOP_P).
TOP_K = 50
TOP_P = 0.9


def call_ms(fn):
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


class Peers:
    """The peers of one hidden size: each batch's callables, built on first use."""

    def __init__(self, args):
        self.args = args
        try:
            import torch
        except ImportError:
            torch = None
        try:
            import numpy as np
        except ImportError:
            np = None
        self.torch, self.np = torch, np
        self.threads = args.threads
        V, D, T = args.vocab, args.dim, args.temperature
        self.compiled = None
        if torch is not None:
            if args.threads:
                torch.set_num_threads(args.threads)
            self.threads = torch.get_num_threads()
            self.g = torch.Generator().manual_seed(1)
            w = (torch.rand(V, D, generator=self.g) * 0.1 - 0.05).to(torch.bfloat16)
            self.w = [w] + [w.clone() for _ in range(args.copies - 1)]

            def pipeline(h, w):
                logits = (h @ w.T).float() / T
                probs = torch.softmax(logits, dim=-1)
                return torch.multinomial(probs, 1)

            def filtered(h, w):
                logits = (h @ w.T).float() / T
                vals, idx = torch.topk(logits, TOP_K, dim=-1)  # sorted, most likely first
                probs = torch.softmax(vals, dim=-1)
                # A token stays if the mass before it is < top-p.
                before = probs.cumsum(dim=-1) - probs
                probs = probs.masked_fill(before >= TOP_P, 0.0)
                return idx.gather(-1, torch.multinomial(probs, 1))

            if args.filter:
                pipeline = filtered

            self.pipeline = pipeline
            if not args.no_compile:
                try:
                    self.compiled = torch.compile(pipeline, dynamic=False)
                except Exception as e:  # noqa: BLE001 - report and go on without the peer
                    print(f"cpu_peers: torch.compile unavailable: {e}", file=sys.stderr)
        if np is not None and not args.no_numpy:
            self.rng = np.random.default_rng(1)
            wf = self.rng.uniform(-0.05, 0.05, size=(V, D)).astype(np.float32)
            self.wf = [wf] + [wf.copy() for _ in range(args.copies - 1)]
        else:
            self.np = None
        self.calls = {}
        self.turn = 0

    def next_copy(self):
        """The index of the W copy the next call reads (every call takes the next one)."""
        self.turn = (self.turn + 1) % self.args.copies
        return self.turn

    def versions(self):
        return {
            "torch": self.torch.__version__ if self.torch else None,
            "numpy": self.np.__version__ if self.np else None,
            "threads": self.threads,
        }

    def for_batch(self, b):
        """{column: callable} at batch b."""
        if b in self.calls:
            return self.calls[b]
        D, T = self.args.dim, self.args.temperature
        calls = {}
        if self.torch is not None:
            torch, w, pipeline = self.torch, self.w, self.pipeline
            h = (torch.rand(b, D, generator=self.g) * 2 - 1).to(torch.bfloat16)

            def inference(fn):
                def run():
                    with torch.inference_mode():
                        return fn()

                return run

            calls["torch_mm"] = inference(lambda: h @ w[self.next_copy()].T)
            calls["torch_eager"] = inference(lambda: pipeline(h, w[self.next_copy()]))
            if self.compiled is not None:
                compiled = self.compiled
                calls["torch_compile"] = inference(lambda: compiled(h, w[self.next_copy()]))
        if self.np is not None:
            np, wf = self.np, self.wf
            hf = self.rng.uniform(-1.0, 1.0, size=(b, D)).astype(np.float32)
            u = self.rng.uniform(size=(b, 1))

            def numpy_pipeline():
                logits = hf @ wf[self.next_copy()].T
                logits /= T
                logits -= logits.max(axis=1, keepdims=True)
                np.exp(logits, out=logits)
                cdf = np.cumsum(logits, axis=1)
                return (cdf < u * cdf[:, -1:]).sum(axis=1)

            def numpy_filtered():
                logits = hf @ wf[self.next_copy()].T
                top = np.argpartition(logits, -TOP_K, axis=1)[:, -TOP_K:]
                vals = np.take_along_axis(logits, top, axis=1) / T
                order = np.argsort(-vals, axis=1)
                vals, top = np.take_along_axis(vals, order, axis=1), np.take_along_axis(top, order, axis=1)
                probs = np.exp(vals - vals[:, :1])
                probs /= probs.sum(axis=1, keepdims=True)
                probs[(np.cumsum(probs, axis=1) - probs) >= TOP_P] = 0.0
                cdf = np.cumsum(probs, axis=1)
                pick = np.minimum((cdf < u * cdf[:, -1:]).sum(axis=1), TOP_K - 1)
                return top[np.arange(len(top)), pick]

            calls["numpy"] = numpy_filtered if self.args.filter else numpy_pipeline
        self.calls[b] = calls
        return calls

    def run(self, b, name, fn):
        """One timed call (ms); a failing torch.compile is reported once and dropped."""
        try:
            return call_ms(fn)
        except Exception as e:  # noqa: BLE001
            print(f"cpu_peers: {name} failed at B={b}: {e}", file=sys.stderr)
            self.calls[b].pop(name, None)
            return None


def serve(args):
    peers = Peers(args)
    print(json.dumps(peers.versions()), flush=True)
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "quit":
            break
        b = int(rest[0])
        calls = peers.for_batch(b)
        if cmd == "warm":
            for name, fn in list(calls.items()):
                for _ in range(args.warmup):
                    if peers.run(b, name, fn) is None:
                        break
            print("{}", flush=True)
        elif cmd == "time":
            out = {name: None for name in ("torch_mm", "torch_eager", "torch_compile", "numpy")}
            for name, fn in list(calls.items()):
                out[name] = peers.run(b, name, fn)
            print(json.dumps(out), flush=True)
        else:
            raise SystemExit(f"cpu_peers: unknown command {line!r}")


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
    ap.add_argument("--copies", type=int, default=1, help="rotating copies of W (module doc)")
    ap.add_argument("--serve", action="store_true", help="time calls on request (module doc)")
    ap.add_argument("--filter", action="store_true", help="top-k 50 + top-p 0.9 pipelines (module doc)")
    args = ap.parse_args()
    if args.serve:
        return serve(args)
    batches = [int(b) for b in args.batches.split(",") if b]
    peers = Peers(args)
    out = peers.versions()
    out["rows"] = []
    for b in batches:
        row = {"dim": args.dim, "batch": b, "torch_mm": None, "torch_eager": None, "torch_compile": None, "numpy": None}
        for name, fn in list(peers.for_batch(b).items()):
            for _ in range(args.warmup):
                peers.run(b, name, fn)
            times = [peers.run(b, name, fn) for _ in range(args.reps)]
            if None not in times:
                row[name] = statistics.median(times)
        out["rows"].append(row)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
