"""Layouts of the same two cores, served: TP=1 with 2 threads, TP=2, PP=2 and DP=2 (1 thread per rank), at 8 and
32 concurrent streamed requests, in interleaved rounds.

    python scripts/bench_parallel.py                          # SmolLM2 (the default model)
    python scripts/bench_parallel.py --size 0.9b --rounds 1   # a random ~0.9B Llama (made once, as bench_tp.py does)
    python scripts/bench_parallel.py --configs tp1x2,dp2 --levels 8:16,32:64

Every configuration is a fresh `tpserve serve` (cold prefix cache) that gets one warm-up request; prompts are random
token ids (22 tokens), every request streams --output-len tokens with EOS ignored. Output tok/s is the level's
tokens over its wall time; ITL is the gap between streamed chunks. Writes results/parallel_<model>.json. The load
generator shares the 2 cores with the server: compare configurations within a round. Nothing asserts on timings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_paged import Server, cpu_model, load_avg, load_stats, print_table, random_ids, run_load  # noqa: E402

CONFIGS = {  # name: (tpserve serve flags, TPSERVE_THREADS)
    "tp1x2": (["-tp", "1"], "2"),
    "tp2": (["-tp", "2"], "1"),
    "pp2": (["-pp", "2"], "1"),
    "dp2": (["-dp", "2"], "1"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default=None, help="0.9b: a random ~0.9B Llama (scripts/bench_tp.py); default SmolLM2")
    ap.add_argument("--model", default=None, help="a checkpoint folder instead")
    ap.add_argument("--configs", default="tp1x2,tp2,pp2,dp2")
    ap.add_argument("--levels", default="8:8,32:32", help="CONCURRENCY:NUM_REQUESTS,...")
    ap.add_argument("--input-len", type=int, default=22)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    from bench_tp import bench_model

    model = bench_model(args.size, args.model)
    name = args.size or os.path.basename(model.rstrip("/"))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    levels = [tuple(int(x) for x in lv.split(":")) for lv in args.levels.split(",")]
    configs = args.configs.split(",")
    cpu = cpu_model()
    print(f"CPU: {cpu}; model {name}; load {load_avg()}")
    runs: dict[str, dict[int, list[dict]]] = {c: {lv[0]: [] for lv in levels} for c in configs}
    for r in range(args.rounds):
        for cfg in configs:
            flags, threads = CONFIGS[cfg]
            os.environ["TPSERVE_THREADS"] = threads
            log = ROOT / "results" / "logs" / f"parallel-{name}-{cfg}.log"
            with Server(model, flags + ["--max-model-len", "512", "--max-num-seqs", "32"], log, timeout=900) as srv:
                warm = [{"prompt": random_ids("warm", args.input_len, vocab), "max_tokens": 4, "ignore_eos": True}]
                asyncio.run(run_load(srv.url, warm, 1, 600))
                for conc, n in levels:
                    bodies = [{"prompt": random_ids(f"{cfg}{r}{conc}{i}", args.input_len, vocab),
                               "max_tokens": args.output_len, "ignore_eos": True, "temperature": 0}
                              for i in range(n)]
                    results, wall, _ = asyncio.run(run_load(srv.url, bodies, conc, 1800))
                    stats = load_stats(results, wall)
                    runs[cfg][conc].append(stats)
                    print(f"round {r + 1} {cfg:6} c={conc:3}: {stats['output_tok_s']} tok/s, ITL p50 "
                          f"{(stats['itl_ms'] or {}).get('p50')} ms, failed {stats['failed']}; load {load_avg()}")
    os.environ.pop("TPSERVE_THREADS", None)
    summary, rows = {}, []
    for cfg in configs:
        for conc, _ in levels:
            tok_s = statistics.median(s["output_tok_s"] for s in runs[cfg][conc])
            itls = [s["itl_ms"]["p50"] for s in runs[cfg][conc] if s["itl_ms"] and s["itl_ms"].get("p50") is not None]
            itl = statistics.median(itls) if itls else None  # a tokenizer whose tokens are empty text: no ITL
            summary.setdefault(cfg, {})[conc] = {"output_tok_s": tok_s, "itl_p50_ms": itl}
    base = configs[0]
    for cfg in configs:
        rows.append([cfg] + [x for conc, _ in levels for x in (
            summary[cfg][conc]["output_tok_s"], f"{summary[cfg][conc]['output_tok_s'] / summary[base][conc]['output_tok_s']:.2f}",
            summary[cfg][conc]["itl_p50_ms"])])
    headers = ["layout"] + [h for conc, _ in levels for h in (f"c={conc} tok/s", f"vs {base}", "ITL p50 ms")]
    print_table(f"{name} on {cpu}, medians of {args.rounds} round(s)", headers, rows)
    out = ROOT / "results" / f"parallel_{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu, "model": name, "levels": levels, "summary": summary, "runs": runs,
                               "time": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
