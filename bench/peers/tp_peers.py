#!/usr/bin/env python3
"""Tensor-parallel PyTorch peer of flashsample's TensorParallelSampler (tp_bench).

Each rank holds a vocabulary shard W_k [V/TP, D] (bf16) of the LM head, as vLLM's
column-parallel LM head does, and the replicated hidden states H [B, D]. One step:
  logits_k = H @ W_k.T            (cuBLAS, bf16)
  all_gather(logits_k) -> [B, V]  (torch.distributed, NCCL: B * V * 2 bytes cross GPUs)
  softmax(logits / T) + torch.multinomial on every rank (vLLM gathers to rank 0; the cost
  is the same, and every rank needs the token in the next step anyway).
Timed with CUDA events on rank 0 between barriers-free back-to-back steps after warm-up,
median over --reps; prints a table (and JSON with --json).

Run with torchrun, one process per GPU:
  torchrun --standalone --nproc-per-node 1 bench/peers/tp_peers.py     # a single GPU: TP = 1
  torchrun --standalone --nproc-per-node 8 bench/peers/tp_peers.py
Started as plain `python3` (no torchrun environment) it runs TP = 1 in-process.
"""

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    if "RANK" not in os.environ:
        # Not under torchrun: a world of one, so a single-GPU machine still measures TP = 1.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world > torch.cuda.device_count():
        raise SystemExit(f"TP={world} needs {world} GPUs; this machine has {torch.cuda.device_count()}")

    dim, vocab = a.dim, a.vocab
    # Shards of 128-token blocks, as tp_bench's shard_ranges(vocab, world, 128); the last may be
    # shorter, so pad every shard to the same length (all_gather needs equal sizes) and drop
    # the padding columns after the gather.
    chunk = -(-vocab // world)
    chunk = -(-chunk // 128) * 128
    start, end = min(rank * chunk, vocab), min((rank + 1) * chunk, vocab)
    g = torch.Generator(device="cuda").manual_seed(1 + rank)
    w = torch.zeros(chunk, dim, dtype=torch.bfloat16, device="cuda")
    w[: end - start] = (torch.randn(end - start, dim, device="cuda", generator=g) * (4.0 / dim**0.5)).to(torch.bfloat16)

    def step(h, inv_t, gathered):
        local = h @ w.T  # [B, chunk]
        dist.all_gather_into_tensor(gathered, local)  # [world * B, chunk], rank-major
        b = h.shape[0]
        logits = gathered.view(world, b, chunk).permute(1, 0, 2).reshape(b, world * chunk)[:, :vocab]
        probs = torch.softmax(logits.float() * inv_t, dim=-1)
        return torch.multinomial(probs, 1)

    rows = []
    for b in [int(x) for x in a.batches.split(",")]:
        h = torch.randn(b, dim, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2)).to(torch.bfloat16)
        inv_t = (1.0 / (0.6 + (torch.arange(b, device="cuda") % 5) * 0.2)).unsqueeze(1)
        gathered = torch.empty(world * b, chunk, dtype=torch.bfloat16, device="cuda")
        for _ in range(a.warmup):
            step(h, inv_t, gathered)
        torch.cuda.synchronize()
        dist.barrier()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(a.reps + 1)]
        ev[0].record()
        for i in range(a.reps):
            step(h, inv_t, gathered)
            ev[i + 1].record()
        torch.cuda.synchronize()
        ms = statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(a.reps))
        # The step time is the slowest rank's.
        t = torch.tensor([ms], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rows.append({"tp": world, "batch": b, "dim": dim, "vocab": vocab, "torch_tp_step_us": t.item() * 1e3})

    if rank == 0:
        if a.json:
            print(json.dumps(rows))
        else:
            print(f"\nPyTorch TP peer (mm + all_gather logits + softmax + multinomial), bf16, D={dim}, V={vocab}, "
                  f"TP={world}, medians of {a.reps} (us)\n")
            print("| TP | B | torch TP step us |")
            print("|---:|---:|---:|")
            for r in rows:
                print(f"| {r['tp']} | {r['batch']} | {r['torch_tp_step_us']:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
