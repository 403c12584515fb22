"""A speculative verification step against a plain decode step after a long prompt: one sequence, TP 1, in one
process, the two alternated step by step (the host drifts; a ratio from interleaved steps holds).

    python scripts/bench_verify.py                                  # SmolLM2 int4, 3000-token context, 5 rows
    python scripts/bench_verify.py -q int8 --context 512 --rows 5 --steps 60

The prompt (random ids) is prefilled once; then each pair of steps decodes 1 row at the next position, and `--rows`
rows of the same sequence at consecutive positions (what a verification of rows - 1 drafts runs: each row an ordinary
decode row of the same block-table row). Nothing is written to the cache beyond the context, so every step sees the
same context. Prints the median ms of each and their ratio; saves JSON (results/verify.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: the default model)")
    ap.add_argument("-q", "--quantization", default="int4", help="int8, int4, bf16 or none")
    ap.add_argument("--context", type=int, default=3000, help="prompt tokens before the steps")
    ap.add_argument("--rows", type=int, default=5, help="rows of the verification step (drafts + 1)")
    ap.add_argument("--steps", type=int, default=40, help="steps of each kind")
    ap.add_argument("--output", default=str(ROOT / "results" / "verify.json"))
    args = ap.parse_args(argv)

    import torch

    from loaders.default_model import ensure_default_model
    from sharding.dist import init_dist
    from sharding.executor import start_executor
    from sharding.runner import EngineConfig
    from sharding.wire import LOGITS_LAST, Step

    model = args.model or str(ensure_default_model())
    P, R = args.context, args.rows
    runner = start_executor(EngineConfig(model=model, max_num_seqs=max(8, R), max_model_len=P + R + 16,
                                         kv_cache_memory=1 << 30,
                                         quantization=None if args.quantization == "none" else args.quantization),
                            init_dist())
    blocks = (P + R + 16) // runner.block_size + 1
    updates = torch.tensor([(0, j, j) for j in range(blocks)])  # row 0's blocks: 0, 1, ...
    ids = torch.randint(10, 1000, (P,), generator=torch.Generator().manual_seed(0))
    runner.run(Step(ids, torch.tensor([(0, P, 0, LOGITS_LAST)]), updates))

    def step(rows: int) -> float:
        table = torch.tensor([(0, 1, P + i, LOGITS_LAST) for i in range(rows)])
        t0 = time.perf_counter()
        runner.run(Step(torch.randint(10, 1000, (rows,)), table, None))
        return time.perf_counter() - t0

    for _ in range(3):  # warm-up
        step(1), step(R)
    times: dict[int, list[float]] = {1: [], R: []}
    for _ in range(args.steps):
        times[1].append(step(1))
        times[R].append(step(R))
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "?")
    result = {"cpu": cpu, "threads": torch.get_num_threads(), "model": model, "quantization": args.quantization,
              "context": P, "rows": R, "plain_ms": ms[1], "verify_ms": ms[R], "ratio": ms[R] / ms[1]}
    print(f"{cpu}, {torch.get_num_threads()} threads, {args.quantization}, context {P}: plain step {ms[1]:.2f} ms, "
          f"{R} rows {ms[R]:.2f} ms, ratio {ms[R] / ms[1]:.3f}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")
    os._exit(0)  # (the runner's threads)


if __name__ == "__main__":
    sys.exit(main())
