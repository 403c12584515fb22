"""Microseconds per all-reduce of one hidden-size vector: gloo versus the shared-memory path (sharding/shm_allreduce).

    python scripts/bench_allreduce.py                      # 2 ranks, sizes 576 and 2048 float32
    python scripts/bench_allreduce.py --three              # also 3 ranks (oversubscribed on a 2-core machine)
    python scripts/bench_allreduce.py --iters 5000 --sizes 576,2048,65536

Each rank runs with 1 torch thread and times every call on its own (time.perf_counter_ns), back to back with no
barrier in between, as a decode step does; the table shows rank 0's median and p90 (a call's time includes
waiting for the slowest rank). Writes results/bench_allreduce.json (or --output).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def timed(fn, t: torch.Tensor, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn(t)
    out = []
    for _ in range(iters):
        start = time.perf_counter_ns()
        fn(t)
        out.append((time.perf_counter_ns() - start) / 1000)
    return out


def rank_main(rank: int, world: int, port: int, args, queue) -> None:
    import os

    from sharding.dist import init_dist

    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          TPSERVE_STORE_PORT=str(port), TPSERVE_STORE_SECRET="hand-made-ranks-" + str(port),
                          TPSERVE_THREADS="1", TPSERVE_SHM_ALLREDUCE="1")
        d = init_dist()
        shm, group = d.fast_all_reduce, d.cpu_group
        barrier = lambda: group.all_reduce(torch.zeros(1))  # noqa: E731
        rows = []
        for size in args.sizes:
            t = torch.randn(size)
            for name, fn in (("gloo", group.all_reduce), ("shm", shm.all_reduce)):
                iters = args.iters if name == "shm" else max(200, args.iters // 5)
                barrier()
                us = sorted(timed(fn, t, iters, warmup=max(20, iters // 10)))
                rows.append(dict(world=world, size=size, backend=name, iters=iters,
                                 median_us=statistics.median(us), p90_us=us[int(0.9 * (len(us) - 1))]))
        barrier()
        queue.put((rank, rows))
        d.shutdown()
    except Exception as e:  # noqa: BLE001
        queue.put((rank, repr(e)))


def run(world: int, args) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=args.timeout) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    bad = {r: x for r, x in results.items() if not isinstance(x, list)}
    if bad:
        raise SystemExit(f"ranks failed at world size {world}: {bad}")
    return results[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="576,2048", help="float32 elements per all-reduce, comma-separated")
    ap.add_argument("--iters", type=int, default=3000, help="timed calls per shm case (gloo: a fifth, >= 200)")
    ap.add_argument("--three", action="store_true", help="also measure 3 ranks")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the ranks")
    ap.add_argument("--output", default="results/bench_allreduce.json")
    args = ap.parse_args()
    args.sizes = [int(x) for x in args.sizes.split(",")]
    rows = [row for world in ((2, 3) if args.three else (2,)) for row in run(world, args)]
    print(f"{'ranks':>5} {'floats':>7} {'path':>5} {'median us':>10} {'p90 us':>8}")
    for r in rows:
        print(f"{r['world']:>5} {r['size']:>7} {r['backend']:>5} {r['median_us']:>10.1f} {r['p90_us']:>8.1f}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out.write_text(json.dumps(dict(rows=rows, cores=cores, machine=platform.machine(), torch=torch.__version__,
                                   python=sys.version.split()[0], time=time.strftime("%Y-%m-%dT%H:%M:%S")), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
