"""Decode attention of one layer over the paged KV cache, against the contiguous slot cache it replaced.

SmolLM2's shapes per rank at TP=1 (3 KV heads of 64, 3 query heads per KV head), fp32, 2 threads. Three ways:
  slot     the old slot cache: K/V of the batch are a view of [slots, kv_heads, max_len, d]; two batched matmuls
  gather   the paged cache through torch: index_select the batch's blocks into a copy, then the same matmuls
  kernel   the paged cache through sharding/cpu/csrc/paged_attention.cpp: reads the blocks in place
at batch 1, 8 and 32, 150 and 1000 keys per sequence (lengths varied within the batch), block sizes 16, 32 and 64.
Rounds alternate the ways; medians are reported.

    python scripts/bench_paged_attention.py
    python scripts/bench_paged_attention.py --batches 1,8 --lengths 150 --block-sizes 16 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def timed(fn, iters: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--lengths", default="150,1000")
    ap.add_argument("--block-sizes", default="16,32,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default="results/paged_attention.json")
    args = ap.parse_args(argv)
    from sharding.cpu import kernels

    torch.set_num_threads(args.threads)
    kernel = kernels.paged_decode_attention() if kernels.build_kernels() else None
    kv, g, d, scale = 3, 3, 64, 0.125
    rows = []
    print(f"CPU: {cpu_name()}, {args.threads} threads, load {os.getloadavg()[0]:.2f}; kernel "
          f"{'built' if kernel else 'NOT available'}")
    print(f"{'bs':>3} {'B':>3} {'T':>5} | {'slot us':>8} {'gather us':>9} {'kernel us':>9} | gather/slot kernel/slot")
    for bs in map(int, args.block_sizes.split(",")):
        for b in map(int, args.batches.split(",")):
            for t in map(int, args.lengths.split(",")):
                torch.manual_seed(0)
                nblk = -(-t // bs)
                num_blocks = max(4096 // bs * 16, b * nblk * 2)
                pool = torch.randn(2, kv, num_blocks, bs, d)
                table = torch.randperm(num_blocks)[: b * nblk].view(b, nblk).contiguous()
                lens = torch.randint(max(1, t - 40), t + 1, (b,))
                lens[0] = t
                mask = torch.arange(t)[None, :] < lens[:, None]
                q = torch.randn(b, kv, g, d)
                slots = torch.randn(2 * kv, b, 2048, d)

                def matmuls(k, v):  # k, v [kv, B, T, d]
                    s = torch.matmul(q.transpose(0, 1), k.transpose(-1, -2)).mul_(scale)
                    s.masked_fill_(~mask[None, :, None, :], float("-inf"))
                    return torch.matmul(torch.softmax(s, -1), v).transpose(0, 1)

                def slot():
                    return matmuls(slots[:kv, :, :t], slots[kv:, :, :t])

                def gather():
                    both = pool.view(2 * kv, num_blocks, bs, d).index_select(1, table.reshape(-1))
                    both = both.view(2 * kv, b, -1, d)[:, :, :t]
                    return matmuls(both[:kv], both[kv:])

                def paged():
                    return kernel(q, pool, table, lens, scale, 0)

                ways = {"slot": slot, "gather": gather} | ({"kernel": paged} if kernel else {})
                if kernel:
                    err = (gather() - paged()).abs().max().item()
                    assert err < 1e-4, err
                times: dict[str, list[float]] = {w: [] for w in ways}
                for _ in range(args.rounds):
                    for w, fn in ways.items():
                        times[w].append(timed(fn, args.iters))
                med = {w: statistics.median(v) for w, v in times.items()}
                row = dict(block_size=bs, batch=b, keys=t, **{f"{w}_us": m for w, m in med.items()})
                rows.append(row)
                print(f"{bs:>3} {b:>3} {t:>5} | {med['slot']:>8.0f} {med['gather']:>9.0f} "
                      f"{med.get('kernel', float('nan')):>9.0f} | {med['gather'] / med['slot']:>10.2f} "
                      f"{med.get('kernel', float('nan')) / med['slot']:>11.2f}", flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_name(), "threads": args.threads, "rows": rows}, indent=1))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
