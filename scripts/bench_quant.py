"""Batch-1 CPU decode at each precision: tpserve (offline LLM, TP=1) against llama.cpp's own `llama-bench`.

    scripts/build_llama_cpp.sh                      # once: llama-bench, llama-quantize (no binary downloads here)
    python scripts/bench_quant.py --rounds 3        # decode, interleaved rounds, JSON to results/quant.json
    python scripts/bench_quant.py --rounds 3 --served   # and `tpserve serve` streaming the same completion
    python scripts/bench_quant.py --rounds 3 --served --pairs 5 --no-llama   # served over offline, 5 pairs a round
    python scripts/bench_quant.py --linears         # the GEMVs alone: SmolLM2's linear shapes at M=1
    python scripts/bench_quant.py --same-file '/data/llama3-8b-{kind}.gguf' --kinds Q4_K_M,Q6_K,Q8_0
                                                    # one GGUF file per kind, served as it is by both engines
    python scripts/bench_quant.py --same-file ... --prefill 512   # a 512-token prompt in one step against
                                                    # `llama-bench -p 512 -n 0` (random ids for both)

Pairs: tpserve float32 / bfloat16 (--dtype) / bf16 (weights only, --quantization) / int8 / int4 (group 32) against
llama.cpp F32 / F16 / F16 / Q8_0 / Q4_0, all made from the same float32 weights (llama.cpp's with its own
llama-quantize). tpserve generates 128 greedy tokens after a 22-token chat prompt (EOS ignored); decode ms/token =
(wall - time to first token) / 127. llama.cpp is measured by its own benchmark, `llama-bench -p 0 -n 128 -d 22` (128
tokens after a 22-token context, no sampling), in a fresh process per round. Same threads for both (default: all cores). Every round runs every pair once, so a slow spell of a shared
host hits all alike; medians over rounds are reported, and each ratio is taken within one round.

--served: `tpserve serve` at the same precision streams the same completion, timed as a streaming client sees it.
Offline and served alternate --pairs times per round and precision (served over offline is the median of the pairs'
ratios: on a host whose speed drifts, a ratio of runs seconds apart). The client is lean (a raw socket, one recv()
per arrival, the events read after the stream ends), since it shares the cores with the server; its CPU per token
is reported, and so is the server's event-loop thread's (from /proc), the work serving adds per token.

--linears times each weight-only kernel and tpserve's float32 kernel (f32_linear, what it runs unquantized) against
oneDNN's packed float32 linear (what it ran before; and int8 dequantized to float32 for F.linear, the path without
the kernel), at --rows activation rows (default 1), and prints
the weight bytes streamed per second. The weights of one linear fit this host's caches: these are kernel speeds, not
memory bandwidth; the decode benchmark above is the one that streams a whole model per token.
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

from bench_baseline import PROMPT, f32_gguf, load_avg  # noqa: E402
from bench_prefill import cpu_name  # noqa: E402
from bench_quant_accuracy import builds, llama_bin  # noqa: E402

# (tpserve dtype, tpserve quantization, llama.cpp GGUF type)
PAIRS = [("float32", None, "F32"), ("bfloat16", None, "F16"), ("float32", "bf16", "F16"), ("float32", "int8", "Q8_0"),
         ("float32", "int4", "Q4_0")]
MAX_TOKENS = 128


def precision(dtype: str, q: str | None) -> str:
    return q or dtype


class Served:
    """`tpserve serve` at the same precision: one streamed completion at a time (the same prompt, 128 tokens, EOS
    ignored); decode ms/token = (last token's arrival - first token's) / 127, as a streaming client sees it."""

    def __init__(self, model: str, dtype: str, quantization: str | None, threads: int):
        import subprocess

        from bench_serving import free_port
        from bench_servers import wait_ready

        self.port = free_port()
        cmd = [sys.executable, "-m", "server.cli.main", "serve", model, "--dtype", dtype, "--max-num-seqs", "1",
               "--kv-cache-memory", "256MiB", "--host", "127.0.0.1", "--port", str(self.port), "--log-level",
               "warning"] + (["--quantization", quantization] if quantization else [])
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, TPSERVE_THREADS=str(threads)))
        try:
            wait_ready(f"http://127.0.0.1:{self.port}/health", self.proc)
            self.model = Path(model).name  # the served model's name
            self.measure()  # warm-up
        except BaseException:
            self.close()
            raise

    def measure(self) -> float:
        """One streamed completion. The client shares the machine's cores with the server, so it does one recv() per
        arrival while the tokens stream and reads the events only after the last byte (each token's time is that
        of the arrival that completed its line)."""
        import socket

        body = json.dumps(dict(model=self.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                               ignore_eos=True, stream=True)).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        arrivals = []
        with socket.create_connection(("127.0.0.1", self.port), timeout=120) as sock:
            sock.sendall(head + body)
            while data := sock.recv(1 << 16):
                arrivals.append((time.perf_counter(), data))
        if not arrivals or not arrivals[0][1].startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"the server answered {b''.join(d for _, d in arrivals)[:500]!r}")
        times, pending = [], b""
        for t, data in arrivals:
            *lines, pending = (pending + data).split(b"\n")
            times += [t for line in lines
                      if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("text")]
        if len(times) < MAX_TOKENS // 2:
            raise RuntimeError(f"the server streamed {len(times)} tokens")
        return (times[-1] - times[0]) / (len(times) - 1) * 1e3

    def event_loop_cpu(self) -> float:
        """CPU seconds so far of the server's main thread (uvicorn's event loop: HTTP, JSON, SSE)."""
        fields = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


class Tpserve:
    def __init__(self, model: str, dtype: str, quantization: str | None, prefill: int = 0):
        from server.llm import LLM
        from server.engine.sampler import SamplingParams

        # prefill: prompts of that many tokens go in one step, and nothing is cached between runs
        extra = dict(max_num_batched_tokens=max(512, prefill), max_model_len=max(2048, prefill + 16),
                     enable_prefix_caching=False) if prefill else {}
        self.llm = LLM(model, dtype=dtype, quantization=quantization, max_num_seqs=1, kv_cache_memory=256 << 20,
                       **extra)
        self.ids = self.llm.tokenizer.encode(PROMPT)
        self.params = SamplingParams
        self.generate(4)  # warm-up
        if prefill:  # random ids as llama-bench's prompt test uses, fixed per run
            import random

            rng = random.Random(0)
            vocab = min(len(self.llm.tokenizer), getattr(self.llm.executor, "vocab_size", len(self.llm.tokenizer)))
            self.prompt = [rng.randrange(100, vocab) for _ in range(prefill)]
            self.prefill_ms()  # warm-up at this shape

    def prefill_ms(self) -> float:
        """One step over the whole prompt (and its one sampled token): ms."""
        t0 = time.perf_counter()
        self.llm.generate([self.prompt], self.params(max_tokens=1, temperature=0, ignore_eos=True))
        return (time.perf_counter() - t0) * 1e3

    def generate(self, n: int):
        return self.llm.generate([self.ids], self.params(max_tokens=n, temperature=0, ignore_eos=True))

    def measure(self) -> float:
        """Decode ms per token."""
        t0 = time.perf_counter()
        self.generate(1)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.generate(MAX_TOKENS)
        return (time.perf_counter() - t0 - ttft) / (MAX_TOKENS - 1) * 1e3

    def close(self) -> None:
        self.llm.close()


def interleaved(offline: "Tpserve", served: Served, pairs: int) -> dict:
    """Offline and served decode alternated `pairs` times: medians, the median of the pairs' served/offline - 1,
    and the CPU per streamed token of the server's event loop and of this (client) process."""
    import resource

    def own_cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    off, on, loop_cpu, client_cpu = [], [], 0.0, 0.0
    for _ in range(pairs):
        off.append(offline.measure())
        loop0, client0 = served.event_loop_cpu(), own_cpu()
        on.append(served.measure())
        loop_cpu += served.event_loop_cpu() - loop0
        client_cpu += own_cpu() - client0
    tokens = pairs * MAX_TOKENS
    return dict(tpserve_ms=statistics.median(off), served_ms=statistics.median(on),
                served_overhead=statistics.median(b / a - 1 for a, b in zip(off, on)), offline_runs=off,
                served_runs=on, event_loop_cpu_ms=loop_cpu / tokens * 1e3, client_cpu_ms=client_cpu / tokens * 1e3)


def linear_bytes(m) -> int:
    """Bytes of module m's own linear weight as its kernel streams it (quantized, blocked float32 or packed), 0 for
    a module without one."""
    qw = getattr(m, "qweight", None)
    if qw is not None:
        return qw.nbytes()
    if getattr(m, "blocked", None) is not None:
        return m.blocked.nbytes
    if getattr(m, "packed", None) is not None and hasattr(m, "matmul"):
        return m.packed.nbytes
    return 0


def weight_bytes(llm) -> int:
    """Bytes of the linears' weights a decode step streams (quantized or float; the embedding table is looked up,
    not streamed): rank 0's model at TP 1."""
    return sum(linear_bytes(m) for m in llm.executor.model.modules())


def llama_gguf(f32: Path, kind: str, threads: int) -> Path:
    if kind == "F32":
        return f32
    out = f32.with_name(f32.name.replace("F32", kind))
    if not out.exists():
        subprocess.run([str(llama_bin("llama-quantize")), str(f32), str(out), kind, str(threads)], check=True,
                       capture_output=True)
    return out


def llama_bench(gguf: Path, threads: int, prefill: int = 0, tokens: int = MAX_TOKENS, depth: int = 22) -> float:
    """Decode ms per token from llama-bench (`tokens` after a context of `depth`); with prefill, ms for a prompt of
    that many tokens (`-p N -n 0`)."""
    shape = ["-p", str(prefill), "-n", "0"] if prefill else ["-p", "0", "-n", str(tokens), "-d", str(depth)]
    out = subprocess.run([str(llama_bin("llama-bench")), "-m", str(gguf), *shape, "-t", str(threads), "-r", "1",
                          "-o", "json"], capture_output=True, text=True, check=True)
    (row,) = json.loads(out.stdout)
    return 1e3 / row["avg_ts"] * (prefill or 1)


def bench_linears(threads: int, iters: int, row_counts: list[int]) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from sharding.cpu import kernels
    from sharding.layers import quant

    torch.set_num_threads(threads)
    assert kernels.build_kernels(), "the CPU kernels did not build"
    shapes = {"qkv": (576 + 2 * 192, 576), "o": (576, 576), "gate_up": (2 * 1536, 576), "down": (576, 1536),
              "lm_head": (49152, 576)}
    rows = []
    print(f"{'linear':<8} {'M':>3} {'N x K':>12} | {'fp32 oneDNN':>18} | {'fp32 f32_linear':>18} | {'int8':>18} | "
          f"{'int4':>18} | {'bf16':>18} | {'int8 dequant+F.linear':>21}")
    for (name, (n, k)), m in ((s, m) for s in shapes.items() for m in row_counts):
        torch.manual_seed(0)
        w = torch.randn(n, k) * 0.02
        x = torch.randn(m, k)
        packed = kernels.pack(w)
        blocked, f32 = kernels.block_f32(w), kernels.f32_linear_op()
        runs = {"fp32": (lambda: kernels.packed_linear(x, packed, None), n * k * 4),
                "f32_kernel": (lambda: f32(x, blocked, None, n), n * k * 4)}
        for mode in ("int8", "int4", "bf16"):
            qw = quant.quantize(w, mode, 32)
            runs[mode] = ((lambda qw=qw: quant.linear(x, qw)), qw.nbytes())
        q8 = quant.quantize(w, "int8", 32)
        runs["int8_dequant"] = ((lambda: F.linear(x, quant.dequantize(q8))), q8.nbytes())
        res = {}
        for _ in range(3):  # interleaved
            for key, (fn, nbytes) in runs.items():
                for _ in range(5):
                    fn()
                t0 = time.perf_counter()
                n_iter = max(3, iters // m)
                for _ in range(n_iter):
                    fn()
                us = (time.perf_counter() - t0) / n_iter * 1e6
                res[key] = min(res.get(key, float("inf")), us)
        row = dict(linear=name, rows=m, n=n, k=k, **{f"{key}_us": res[key] for key in runs},
                   **{f"{key}_gb_s": runs[key][1] / res[key] / 1e3 for key in runs})
        rows.append(row)
        print(f"{name:<8} {m:>3} {n:>6} x {k:<5} | "
              + " | ".join(f"{res[key]:8.1f} us {row[key + '_gb_s']:5.1f} GB/s" for key in runs), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: tpserve's default SmolLM2-135M-Instruct)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--only", action="append", choices=["float32", "bfloat16", "bf16", "int8", "int4"],
                    help="tpserve precisions to run (default: all)")
    ap.add_argument("--linears", action="store_true", help="time the GEMVs alone instead")
    ap.add_argument("--served", action="store_true",
                    help="also measure `tpserve serve` at each precision (a streamed completion, same prompt)")
    ap.add_argument("--pairs", type=int, default=1, help="--served: offline/served alternations per round")
    ap.add_argument("--no-llama", action="store_true", help="leave llama-bench out (served over offline only)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rows", default="1", help="--linears: activation row counts, e.g. 1,8,32,512")
    ap.add_argument("--gguf", default="results/SmolLM2-135M-Instruct-F32.gguf",
                    help="llama.cpp's F32 GGUF of the same weights (quantized from it), or a template of ready files, "
                         "e.g. /data/moe-{kind}.gguf ({kind}: Q8_0, Q4_0, ...)")
    ap.add_argument("--same-file", default=None,
                    help="GGUF files both engines serve as they are, a template over --kinds, e.g. "
                         "/data/llama3-8b-{kind}.gguf: tpserve loads the file itself (its block types' own kernels)")
    ap.add_argument("--kinds", default="Q4_K_M,Q6_K,Q8_0", help="--same-file: the {kind}s")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="time a prompt of N tokens in one step instead of decode (llama-bench -p N -n 0)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    print(f"CPU: {cpu_name()}, {args.threads} threads, load {load_avg()}", flush=True)
    if args.linears:
        rows = bench_linears(args.threads, args.iters, [int(r) for r in args.rows.split(",")])
        out = Path(args.output or "results/quant_linears.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(cpu=cpu_name(), threads=args.threads, rows=rows), indent=2))
        print(f"saved {out}")
        return 0
    os.environ["TPSERVE_THREADS"] = str(args.threads)
    from loaders.default_model import ensure_default_model

    model = args.model or (None if args.same_file else str(ensure_default_model()))
    templated = "{kind}" in args.gguf  # ready GGUFs (e.g. converted by llama.cpp's convert_hf_to_gguf.py)
    have_llama = llama_bin("llama-bench").exists() and not args.no_llama
    if not have_llama:
        print("llama.cpp skipped: run scripts/build_llama_cpp.sh first", flush=True)
    if args.same_file:  # one file per kind, served by both: the case's name (precision()) is the kind
        pairs = [("float32", kind, kind) for kind in args.kinds.split(",")]
        files = {kind: args.same_file.format(kind=kind) for _, _, kind in pairs}
        engines = {kind: Tpserve(files[kind], "float32", None, args.prefill) for _, _, kind in pairs}
        served = {kind: Served(files[kind], "float32", None, args.threads) for _, _, kind in pairs} if args.served else {}
        ggufs = {kind: Path(files[kind]) for _, _, kind in pairs}
        for kind in files:
            print(f"{kind}: {files[kind]}, {weight_bytes(engines[kind].llm) / 1e6:.0f} MB of linear weights (less the "
                  "embedding table: what a dense model streams per token; an MoE's counts every expert)", flush=True)
    else:
        f32 = None if templated else f32_gguf(Path(args.gguf))
        pairs = [p for p in PAIRS if not args.only or precision(p[0], p[1]) in args.only]
        engines = {precision(d, q): Tpserve(model, d, q, args.prefill) for d, q, _ in pairs}
        served = {precision(d, q): Served(model, d, q, args.threads) for d, q, _ in pairs} if args.served else {}
        ggufs = {kind: Path(args.gguf.format(kind=kind)) if templated else llama_gguf(f32, kind, args.threads)
                 for _, _, kind in pairs} if have_llama else {}
    rows = []
    for r in range(args.rounds):
        for dtype, q, kind in pairs:
            name = precision(dtype, q)
            if served:
                row = dict(round=r, precision=name, **interleaved(engines[name], served[name], args.pairs),
                           load=load_avg())
            else:
                e = engines[name]
                row = dict(round=r, precision=name, tpserve_ms=e.prefill_ms() if args.prefill else e.measure(),
                           load=load_avg())
            if have_llama:
                row.update(llama=kind, llama_ms=llama_bench(ggufs[kind], args.threads, args.prefill))
                row["ratio"] = row["llama_ms"] / row["tpserve_ms"]  # > 1: tpserve is faster
            rows.append(row)
            unit = f"ms/{args.prefill}-token prompt" if args.prefill else "ms/token"
            print(f"[round {r}] {name:<8} tpserve {row['tpserve_ms']:6.2f} {unit}"
                  + (f" (served {row['served_ms']:6.2f}, {row['served_overhead'] * 100:+.1f} %; CPU per token: event "
                     f"loop {row['event_loop_cpu_ms']:.3f} ms, client {row['client_cpu_ms']:.3f} ms)" if served else "")
                  + (f" | llama.cpp {kind:<5} {row['llama_ms']:6.2f} {unit} | tpserve speed / llama.cpp "
                     f"{row['ratio']:.2f}x" if have_llama else "") + f"  (load {row['load']})", flush=True)
    for e in [*engines.values(), *served.values()]:
        e.close()
    per = args.prefill or 1  # tokens per timed unit
    print(f"\nmedians (ms per {f'{per}-token prompt' if args.prefill else 'token'}; speed ratio > 1: tpserve faster):")
    summary = []
    for dtype, q, kind in pairs:
        name = precision(dtype, q)
        mine = [r for r in rows if r["precision"] == name]
        s = dict(precision=name, tpserve_ms=statistics.median(r["tpserve_ms"] for r in mine))
        if served:
            s.update(served_ms=statistics.median(r["served_ms"] for r in mine),
                     served_overhead=statistics.median(r["served_overhead"] for r in mine),
                     served_overheads=[r["served_overhead"] for r in mine],
                     event_loop_cpu_ms=statistics.median(r["event_loop_cpu_ms"] for r in mine))
        if have_llama:
            s.update(llama=kind, llama_ms=statistics.median(r["llama_ms"] for r in mine),
                     ratio=statistics.median(r["ratio"] for r in mine), ratios=[r["ratio"] for r in mine])
        summary.append(s)
        print(f"  {name:<8} tpserve {s['tpserve_ms']:6.2f} ({per * 1e3 / s['tpserve_ms']:5.1f} tok/s)"
              + (f" served {s['served_ms']:6.2f} ({s['served_overhead'] * 100:+.1f} %, rounds "
                 + " ".join(f"{o * 100:+.1f}" for o in s["served_overheads"]) + ")" if served else "")
              + (f" | llama.cpp {kind:<5} {s['llama_ms']:6.2f} ({per * 1e3 / s['llama_ms']:5.1f} tok/s) | "
                 f"{s['ratio']:.2f}x" if have_llama else ""))
    out = Path(args.output or "results/quant.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(cpu=cpu_name(), **builds(), threads=args.threads, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                   prefill=args.prefill,
                                   rows=rows, summary=summary), indent=2))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
