"""Prefill speed: tpserve's offline LLM against one transformers forward, same prompt ids, SmolLM2-135M fp32, TP=1.

    python scripts/bench_prefill.py                                   # 200,600,1800,4000 tokens, 3 rounds, 2 threads
    python scripts/bench_prefill.py --lengths 64,200 --rounds 1 --warmup first   # a quick check
    python scripts/bench_prefill.py --threads 1 --output results/prefill_t1.json

Engines, each timed around one call (the prompt: seeded random token ids, the same for every engine):
- transformers: `model(ids, logits_to_keep=1)` under inference_mode (sdpa attention; logits of the last token only).
- tpserve one step: `LLM.generate([ids], max_tokens=1, temperature=0)` (prefill + sampling of one token) with
  max_num_batched_tokens = the longest prompt rounded up to 256, so every prompt is ONE step; prefix caching off.
- tpserve chunked: the same with the server's default step budget (512-token chunks).
- tpserve cached prefix: prefix caching on; an untimed generate of the prompt warms the cache, then a prompt that
  differs only in its last `--tail` tokens (fresh each round) is timed: the step computes the tail plus whatever part
  of the last shared 16-token block is not full.

The three tpserve engines are three LLM instances in this process (TP=1 spawns nothing; they coexist), each with its
own `--kv-cache-memory` pool instead of the default half of the machine's memory. All engines are loaded first and
run once untimed at every length (`--warmup first`: the first length only; a new shape costs up to ~0.5 s the first
time), then each round runs every length and engine once; medians over rounds are reported.
Other work on the host makes the numbers noisy: the load average is recorded with every measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ENGINES = ("transformers", "tpserve_one_step", "tpserve_chunked", "tpserve_cached_prefix")
LABELS = dict(transformers="transformers s", tpserve_one_step="one step s", tpserve_chunked="chunked s",
              tpserve_cached_prefix="cached prefix s")


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


class Transformers:
    def __init__(self, folder: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
        self.model.eval()

    def run(self, ids: list[int]) -> float:
        x = self.torch.tensor([ids], dtype=self.torch.int64)
        with self.torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model(input_ids=x, logits_to_keep=1)
            dt = time.perf_counter() - t0
        assert out.logits.shape[1] == 1
        return dt


class Tpserve:
    """One LLM instance; `steps` and `tokens` count what the engine ran in the last call (via its step listeners)."""

    def __init__(self, folder: str, budget: int | None, prefix_caching: bool, kv_bytes: int):
        from server.llm import LLM
        from server.engine.sampler import SamplingParams

        self.llm = LLM(folder, 1, max_model_len=8192, max_num_batched_tokens=budget,
                       enable_prefix_caching=prefix_caching, kv_cache_memory=kv_bytes)
        self.params = SamplingParams(max_tokens=1, temperature=0)
        self.steps = self.tokens = 0
        self.llm.engine.step_listeners.append(self._count)

    def _count(self, _dt: float, tokens: int) -> None:
        self.steps += 1
        self.tokens += tokens

    def run(self, ids: list[int]) -> float:
        self.steps = self.tokens = 0
        t0 = time.perf_counter()
        out = self.llm.generate([ids], self.params)
        dt = time.perf_counter() - t0
        assert len(out[0].token_ids) == 1, out[0]
        return dt


def measure(engines: dict, name: str, ids: list[int], tail: list[int]) -> dict:
    """One timed call of engine `name` on `ids` (the cached-prefix engine: on ids[:-len(tail)] + tail, warmed)."""
    if name == "transformers":
        return dict(seconds=engines[name].run(ids))
    e = engines[name]
    if name == "tpserve_cached_prefix":
        e.run(ids)  # warms the cache (a no-op after the first round: ids are cached already)
        ids = ids[: len(ids) - len(tail)] + tail
    dt = e.run(ids)
    return dict(seconds=dt, steps=e.steps, computed_tokens=e.tokens)


def plot(summary: list[dict], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"plot skipped: {e}"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in ENGINES:
        pts = [(s["length"], s["length"] / s[name]) for s in summary if s.get(name)]
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prompt tokens / s (median)")
    ax.set_title("Prefill, SmolLM2-135M fp32, TP=1")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def main(argv: list[str] | None = None) -> int:
    from server.cli.main import parse_bytes

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: the default model)")
    ap.add_argument("--lengths", default="200,600,1800,4000", help="prompt lengths in tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tail", type=int, default=20, help="tokens the cached-prefix prompt does not share")
    ap.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("768MiB"),
                    help="KV pool of each tpserve instance (default 768MiB: two 8192-token sequences)")
    ap.add_argument("--warmup", choices=["all", "first"], default="all",
                    help="untimed runs of every engine at every length (default) or at the first length only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default="results/prefill.json")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if max(lengths) >= 8192 or min(lengths) <= args.tail:
        raise SystemExit(f"lengths must be in ({args.tail}, 8192)")
    os.environ["TPSERVE_THREADS"] = str(args.threads)  # tpserve sets torch's thread count when an LLM starts
    import torch

    from loaders.default_model import ensure_default_model

    torch.set_num_threads(args.threads)
    folder = args.model or str(ensure_default_model())
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}, {args.threads} threads; "
          f"load {load_avg()}", flush=True)
    one_step = -(-max(lengths) // 256) * 256
    engines = dict(transformers=Transformers(folder),
                   tpserve_one_step=Tpserve(folder, one_step, False, args.kv_cache_memory),
                   tpserve_chunked=Tpserve(folder, None, False, args.kv_cache_memory),
                   tpserve_cached_prefix=Tpserve(folder, one_step, True, args.kv_cache_memory))
    torch.set_num_threads(args.threads)
    chunk = engines["tpserve_chunked"].llm.engine.lanes[0].scheduler.max_num_batched_tokens
    print(f"loaded; tpserve step budgets: one step {one_step}, chunked {chunk} tokens; threads "
          f"{torch.get_num_threads()}", flush=True)
    rng = random.Random(args.seed)
    vocab = engines["tpserve_one_step"].llm.tokenizer.vocab_size
    prompts = {n: [rng.randrange(vocab) for _ in range(n)] for n in lengths}
    # warm-up, untimed: a first call at a new length pays one-off costs (allocations, oneDNN primitives for the shape)
    for n in lengths if args.warmup == "all" else lengths[:1]:
        for name in ENGINES:
            measure(engines, name, prompts[n], [rng.randrange(vocab) for _ in range(args.tail)])
    print(f"warmed up at {'every length' if args.warmup == 'all' else lengths[0]}; load {load_avg()}", flush=True)
    rows: list[dict] = []
    for r in range(args.rounds):
        for n in lengths:
            tail = [rng.randrange(vocab) for _ in range(args.tail)]  # fresh each round: never cached before
            for name in ENGINES:
                load = load_avg()
                m = measure(engines, name, prompts[n], tail)
                rows.append(dict(round=r, length=n, engine=name, load=load, **m))
                extra = f", {m['steps']} step(s), {m['computed_tokens']} tokens computed" if "steps" in m else ""
                print(f"[round {r}] {n:>5} tokens {name:<22} {m['seconds']:8.3f} s  {n / m['seconds']:8.0f} tok/s"
                      f"{extra}  (load {load})", flush=True)
    for name in ENGINES[1:]:
        engines[name].llm.close()
    summary = []
    for n in lengths:
        s = dict(length=n)
        for name in ENGINES:
            s[name] = statistics.median(x["seconds"] for x in rows if x["length"] == n and x["engine"] == name)
        s["tok_s"] = {name: n / s[name] for name in ENGINES}
        s["ratio_vs_transformers"] = {name: s["transformers"] / s[name] for name in ENGINES[1:]}
        summary.append(s)
    print(f"\nmedians over {args.rounds} round(s); ratio = tpserve tok/s / transformers tok/s (load now {load_avg()})")
    print(f"{'length':>6} | " + " | ".join(f"{LABELS[e]:>15}" for e in ENGINES) + " | ratio one/chunked/cached")
    for s in summary:
        ratios = "/".join(f"{r:.2f}" for r in s["ratio_vs_transformers"].values())
        print(f"{s['length']:>6} | " + " | ".join(f"{s[e]:15.3f}" for e in ENGINES) + f" | {ratios}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(model=folder, cpu=cpu_name(), threads=args.threads, lengths=lengths,
                                   rounds=args.rounds, tail=args.tail, one_step_budget=one_step, chunk_budget=chunk,
                                   transformers_logits_to_keep=1, rows=rows, summary=summary), indent=1))
    print(f"wrote {out}")
    note = plot(summary, out.with_suffix(".png"))
    print(note or f"wrote {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
