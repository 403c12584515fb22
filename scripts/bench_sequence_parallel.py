"""Sequence parallelism at TP=2: prefill time and every rank's peak memory for one long prompt, with and without.

    python scripts/bench_sequence_parallel.py                      # SmolLM2, a 2000-token prompt, 3 rounds
    python scripts/bench_sequence_parallel.py --size 0.9b --tokens 2000

Each configuration runs in a fresh process (the offline LLM at TP=2; rank 1 spawned by it), with the prompt in one
prefill step (--max-num-batched-tokens = the prompt) and prefix caching off, so every round computes the whole
prompt. Peak memory is each rank's VmHWM (/proc/<pid>/status): after loading and a short warm-up, and again after
the long prefills; the difference is what the long prefill's activations added at their peak. Configurations alternate
within each round. Writes results/sequence_parallel_<model>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(model: str, sp: bool, tokens: int, repeats: int, out: str) -> None:
    import random

    from server.llm import LLM
    from server.engine.sampler import SamplingParams

    os.environ.setdefault("TPSERVE_THREADS", "1")
    with LLM(model, tensor_parallel_size=2, sequence_parallel=sp, max_model_len=tokens + 16,
             max_num_batched_tokens=tokens + 16, enable_prefix_caching=False, max_num_seqs=2) as llm:
        pids = [os.getpid()] + [p.pid for p in llm.workers.procs.values()]
        vocab = llm.executor.vocab_size
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        llm.generate([[5, 6, 7, 8]], one)
        before = [vm_hwm_mib(p) for p in pids]
        rng = random.Random(0)
        times = []
        for _ in range(repeats):
            prompt = [rng.randrange(100, vocab) for _ in range(tokens)]
            t0 = time.perf_counter()
            llm.generate([prompt], one)
            times.append(time.perf_counter() - t0)
        after = [vm_hwm_mib(p) for p in pids]
        steps = llm.executor.seq_parallel_steps
    Path(out).write_text(json.dumps({"prefill_s": times, "hwm_before_mib": before, "hwm_after_mib": after,
                                     "seq_parallel_steps": steps}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default=None, help="0.9b: the random ~0.9B Llama of scripts/bench_tp.py")
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="long prefills per process")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from bench_tp import bench_model

    model = bench_model(args.size, args.model)
    if args.child:
        child(model, args.child[0] == "sp", args.tokens, args.repeats, args.child[2])
        return 0
    from bench_paged import cpu_model, load_avg

    name = args.size or os.path.basename(model.rstrip("/"))
    cpu = cpu_model()
    print(f"CPU: {cpu}; model {name}; {args.tokens}-token prompt at TP=2, 1 thread per rank")
    runs: dict[str, list[dict]] = {"tp2": [], "tp2+sp": []}
    for r in range(args.rounds):
        for label in runs:
            out = ROOT / "results" / "logs" / f"sp-{label}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--repeats", str(args.repeats),
                   "--child", "sp" if label.endswith("sp") else "tp", "x", str(out)]
            cmd += ["--size", args.size] if args.size else (["--model", args.model] if args.model else [])
            subprocess.run(cmd, check=True, cwd=ROOT, timeout=1800)
            res = json.loads(out.read_text())
            runs[label].append(res)
            grow = [a - b for a, b in zip(res["hwm_after_mib"], res["hwm_before_mib"])]
            print(f"round {r + 1} {label:7}: prefill {statistics.median(res['prefill_s']) * 1000:.0f} ms, peak growth "
                  f"per rank {', '.join(f'{g:.1f}' for g in grow)} MiB (SP steps {res['seq_parallel_steps']}); load "
                  f"{load_avg()}")
    summary = {}
    for label, rs in runs.items():
        summary[label] = {
            "prefill_ms": round(statistics.median(statistics.median(x["prefill_s"]) for x in rs) * 1000, 1),
            "peak_growth_mib_per_rank": [round(statistics.median(x["hwm_after_mib"][i] - x["hwm_before_mib"][i]
                                                                 for x in rs), 1) for i in range(2)]}
    print(json.dumps(summary, indent=2))
    path = ROOT / "results" / f"sequence_parallel_{name}.json"
    path.write_text(json.dumps({"cpu": cpu, "model": name, "tokens": args.tokens, "summary": summary, "runs": runs},
                               indent=2))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
