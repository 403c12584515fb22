"""Mixture-of-experts: prefill against llama.cpp's own `llama-bench`, and tpserve's layouts against each other.

    python scripts/make_moe_checkpoint.py /data/qwen3moe-12l --layers 12     # random Qwen3-30B-A3B geometry, bf16
    # llama.cpp: convert_hf_to_gguf.py --outtype bf16, then llama-quantize to Q8_0 and Q4_0 (see BENCHMARKS.md)
    python scripts/bench_moe.py prefill --model /data/qwen3moe-12l --gguf '/data/qwen3moe-12l-{kind}.gguf' -q int8
    python scripts/bench_moe.py layouts --model /data/qwen3moe-12l -q int8 --layouts tp1,tp2,ep2 --fresh

prefill: the time to the first token of a --prompt-len prompt (fresh random token ids each time, so no prefix is
cached) with tpserve's offline LLM at TP 1, against `llama-bench -p N -n 0` on the GGUF of the same weights at the
same precision (Q8_0 for int8, Q4_0 for int4), alternated per round; tokens per second, and the ratio per round.

layouts: batch-1 decode (ms/token over 128 tokens after a 22-token prompt) and 8 concurrent sequences (output tokens
per second) for each layout, e.g. tp1 (one rank), tp2 (two ranks, every expert split), ep2 (two ranks, whole
experts each); one layout loaded at a time (the box holds one copy), rounds alternate the order. Also prints the
bytes of weights a batch-1 step streams (active parameters: attention, the k routed experts, the router, the LM
head) and the bandwidth that implies.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LLAMA_KIND = {"int8": "Q8_0", "int4": "Q4_0", "bf16": "BF16", "float32": "F32"}
DECODE_TOKENS = 128
PROMPT_LEN = 22


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def llama_bin(name: str) -> Path:
    """llama.cpp's tool `name` from LLAMA_CPP_DIR (default $TPSERVE_HOME/llama.cpp: scripts/build_llama_cpp.sh)."""
    home = Path(os.environ.get("TPSERVE_HOME") or Path.home() / ".cache" / "tpserve")
    return Path(os.environ.get("LLAMA_CPP_DIR") or home / "llama.cpp") / "bin" / name


def llama_bench(gguf: str, threads: int, prompt: int, gen: int, depth: int = 0) -> float:
    """tokens/s from llama-bench (one repetition, a fresh process)."""
    cmd = [str(llama_bin("llama-bench")), "-m", gguf, "-p", str(prompt), "-n", str(gen), "-t", str(threads), "-r", "1",
           "-o", "json"] + (["-d", str(depth)] if depth else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    (row,) = json.loads(out.stdout)
    return float(row["avg_ts"])


def active_bytes(llm) -> dict:
    """Bytes a batch-1 decode step streams on rank 0: every non-expert weight of its layers and the LM head, its share
    of each MoE layer's k routed experts (k of its slices under TP; k x its experts / all experts on average under
    EP), the routers; the embedding's one row is left out."""
    from sharding.layers.moe import SparseMoe

    def nbytes(mod) -> int:
        return sum(t.nbytes for t in mod.parameters()) + sum(
            (m.qweight.data.nbytes + m.qweight.scale.nbytes) for m in mod.modules()
            if getattr(m, "qweight", None) is not None) + sum(
            m.blocked.nbytes for m in mod.modules() if getattr(m, "blocked", None) is not None)

    model = llm.executor.model
    total = nbytes(model.lm_head) if model.lm_head is not None and not model.lm_head.tied else 0
    experts = routers = 0
    for layer in model.layers:
        mlp = layer.mlp
        if isinstance(mlp, SparseMoe):
            per_expert = statistics.mean(nbytes(e) for e in mlp.experts) if len(mlp.experts) else 0
            # k experts per token, of which this rank holds its share (all of them under TP) on average
            experts += per_expert * mlp.routing.top_k * len(mlp.experts) / mlp.num_experts
            routers += nbytes(mlp.router)
            total += nbytes(layer) - sum(nbytes(e) for e in mlp.experts) - nbytes(mlp.router)
        else:
            total += nbytes(layer)
    return dict(dense_bytes=total, expert_bytes=int(experts), router_bytes=routers,
                total_bytes=int(total + experts + routers))


def prefill(args) -> dict:
    from server.llm import LLM
    from server.engine.sampler import SamplingParams

    kind = LLAMA_KIND[args.quantization]
    gguf = args.gguf.format(kind=kind)
    llm = LLM(args.model, quantization=None if args.quantization == "float32" else args.quantization, max_num_seqs=1,
              max_model_len=args.prompt_len + 64,
              max_num_batched_tokens=args.prompt_len, enable_prefix_caching=False,
              kv_cache_memory=512 << 20)
    vocab = llm.executor.vocab_size
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def tpserve_tok_s() -> float:
        ids = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
        t0 = time.perf_counter()
        llm.generate([ids], one)
        return args.prompt_len / (time.perf_counter() - t0)

    tpserve_tok_s()  # warm-up
    rows = []
    for r in range(args.rounds):
        pair = {}
        for side in (("tpserve", "llama") if r % 2 == 0 else ("llama", "tpserve")):
            pair[side] = tpserve_tok_s() if side == "tpserve" else llama_bench(gguf, args.threads, args.prompt_len, 0)
        rows.append(dict(round=r, tpserve_tok_s=pair["tpserve"], llama_tok_s=pair["llama"],
                         ratio=pair["tpserve"] / pair["llama"]))
        print(f"[round {r}] pp{args.prompt_len}: tpserve {args.quantization} {pair['tpserve']:7.1f} tok/s | "
              f"llama.cpp {kind} {pair['llama']:7.1f} tok/s | {pair['tpserve'] / pair['llama']:.2f}x", flush=True)
    llm.close()
    summary = dict(tpserve_tok_s=statistics.median(r["tpserve_tok_s"] for r in rows),
                   llama_tok_s=statistics.median(r["llama_tok_s"] for r in rows),
                   ratio=statistics.median(r["ratio"] for r in rows))
    print(f"median: tpserve {summary['tpserve_tok_s']:.1f} tok/s, llama.cpp {summary['llama_tok_s']:.1f} tok/s, "
          f"{summary['ratio']:.2f}x")
    return dict(kind="prefill", prompt_len=args.prompt_len, quantization=args.quantization, llama=kind, rows=rows,
                summary=summary)


LAYOUTS = {"tp1": dict(tensor_parallel_size=1), "tp2": dict(tensor_parallel_size=2),
           "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True)}


def one_layout(args) -> dict:
    """One layout in this (fresh) process: its batch-1 and 8-stream decode, the bytes of a batch-1 step, and the peak
    resident memory of rank 0 and of the other ranks (each a process of its own) since start."""
    import resource

    from server.llm import LLM
    from server.engine.sampler import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, quantization=args.quantization, max_num_seqs=8, max_model_len=512,
              kv_cache_memory=512 << 20, **LAYOUTS[args.layout])
    load_s = time.perf_counter() - t0
    vocab = llm.executor.vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(PROMPT_LEN)] for _ in range(8)]
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    llm.generate([prompts[1]], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate([prompts[1]], params)
    ms = (time.perf_counter() - t0 - ttft) / (DECODE_TOKENS - 1) * 1e3
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    tok_s = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
    step = active_bytes(llm)
    others = [peak_rss_gb(p.pid) for p in (llm.workers.procs.values() if llm.workers else [])]
    llm.close()
    return dict(layout=args.layout, load_s=load_s, batch1_ms=ms, batch8_tok_s=tok_s, **step,
                rank0_gb_s=step["total_bytes"] / ms / 1e6,
                rank0_peak_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                other_ranks_peak_gb=max(others, default=0.0))


def peak_rss_gb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def fresh_memory() -> None:
    """Drop the page cache and compact memory (root only), so that each load gets the huge pages a fresh host gives:
    on a host whose memory the previous load fragmented, the same int4 engine ran at 15-23 ms per token."""
    subprocess.run(["sync"], check=False)
    for path, value in (("/proc/sys/vm/drop_caches", "3"), ("/proc/sys/vm/compact_memory", "1")):
        try:
            Path(path).write_text(value)
        except OSError as e:
            print(f"--fresh: cannot write {path} ({e})", flush=True)
    time.sleep(2)


def layouts(args) -> dict:
    names = args.layouts.split(",")
    rows = []
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):  # one layout per fresh process: one copy in memory
            if args.fresh:
                fresh_memory()
            out = subprocess.run([sys.executable, __file__, "one", "--layout", name, "--model", args.model, "-q",
                                  args.quantization, "--seed", str(r)], capture_output=True, text=True, cwd=ROOT)
            if out.returncode:
                raise RuntimeError(f"{name}: {out.stderr[-2000:]}")
            row = dict(round=r, **json.loads(out.stdout.strip().splitlines()[-1]))
            rows.append(row)
            print(f"[round {r}] {name}: batch 1 {row['batch1_ms']:6.2f} ms/token ({1e3 / row['batch1_ms']:5.1f} "
                  f"tok/s), 8 streams {row['batch8_tok_s']:6.1f} tok/s; rank 0 streams "
                  f"{row['total_bytes'] / 1e6:7.1f} MB per batch-1 step ({row['rank0_gb_s']:.1f} GB/s); loaded in "
                  f"{row['load_s']:.0f} s; peak RSS rank 0 {row['rank0_peak_gb']:.2f} GB, other ranks "
                  f"{row['other_ranks_peak_gb']:.2f} GB", flush=True)
    summary = []
    for name in names:
        mine = [x for x in rows if x["layout"] == name]
        summary.append(dict(layout=name, batch1_ms=statistics.median(x["batch1_ms"] for x in mine),
                            batch8_tok_s=statistics.median(x["batch8_tok_s"] for x in mine),
                            rank0_mb=mine[0]["total_bytes"] / 1e6,
                            rank0_gb_s=statistics.median(x["rank0_gb_s"] for x in mine),
                            rank0_peak_gb=max(x["rank0_peak_gb"] for x in mine),
                            other_ranks_peak_gb=max(x["other_ranks_peak_gb"] for x in mine)))
        s = summary[-1]
        print(f"median {name}: batch 1 {s['batch1_ms']:.2f} ms/token, 8 streams {s['batch8_tok_s']:.1f} tok/s, "
              f"rank 0 {s['rank0_mb']:.0f} MB/step at {s['rank0_gb_s']:.1f} GB/s, peak RSS {s['rank0_peak_gb']:.2f} "
              f"/ {s['other_ranks_peak_gb']:.2f} GB")
    return dict(kind="layouts", quantization=args.quantization, rows=rows, summary=summary)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["prefill", "layouts", "one"])
    ap.add_argument("--layout", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--model", required=True)
    ap.add_argument("--gguf", help="prefill: a template of the GGUFs, e.g. /data/moe-{kind}.gguf")
    ap.add_argument("-q", "--quantization", default="int8", choices=list(LLAMA_KIND))
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--layouts", default="tp1,tp2,ep2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--fresh", action="store_true",
                    help="layouts: drop the page cache and compact memory before each load (needs root)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if args.what == "one":
        print(json.dumps(one_layout(args)))
        return 0
    print(f"CPU: {cpu_name()}, {args.threads} threads", flush=True)
    result = prefill(args) if args.what == "prefill" else layouts(args)
    result.update(cpu=cpu_name(), threads=args.threads, model=args.model,
                  tpserve_kernels=os.environ.get("TPSERVE_KERNELS", "auto"),
                  llama_cpp=(llama_bin("VERSION").parent.parent / "VERSION").read_text().strip()
                  if (llama_bin("VERSION").parent.parent / "VERSION").exists() else None)
    out = Path(args.output or f"results/bench_moe_{args.what}_{args.quantization}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
