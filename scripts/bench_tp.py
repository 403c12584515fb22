"""Tensor-parallel decode on CPU against the physical limit, on a random Llama made on the fly.

    python scripts/bench_tp.py                       # ~0.9B model: TP=1 x {1,2} threads, TP=2 x 1 thread; floor
    python scripts/bench_tp.py --size 1gb --load-only   # the ~1 GB checkpoint: per-rank peak memory and load time
    python scripts/bench_tp.py --configs 2x1 --steps 16 --repeats 3 --output results/tp.json

Each configuration runs in a fresh process (rank 0 through the offline LLM API, ranks > 0 spawned by it) with
TPSERVE_THREADS set: it records the time to ready, every rank's peak resident memory (VmHWM of /proc/<pid>/status)
right after start-up, then decode ms/step at batch 1 and 32 (an 8-token prompt prefilled, then `--steps` decode steps
through `runner.run`, greedy argmax on rank 0; median over steps, then over `--repeats`).

The weight-streaming floor is measured the same way the decode reads weights: one pass of the decode's linear
kernel (oneDNN with packed weights, sharding/cpu/kernels.py; plain F.linear too, for reference) with a row of activations
over tensors shaped like every weight of the model: one process with 1 thread and with 2 threads (TP=1's limits), and
2 single-thread processes each streaming half of them at the same time (TP=2's). Decode times then read as a multiple
of the floor, and the ratio of the floors is what TP=2 can gain over TP=1 on this machine at best.
Check the foreign load (printed with every number) before trusting a figure: there are only 2 cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = {
    # hidden, layers, heads, kv heads, intermediate, vocab
    "0.9b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=5632, vocab_size=32000),
    "1gb": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                intermediate_size=2816, vocab_size=32000),
}


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def bench_model(size: str | None, model: str | None) -> str:
    """A checkpoint folder (`model`), the random model of `size` made once under $TPSERVE_HOME, or the default model."""
    if model:
        return model
    if size:
        home = Path(os.environ.get("TPSERVE_HOME", Path.home() / ".cache" / "tpserve"))
        return str(make_model(size, home / f"bench-llama-{size}"))
    from loaders.default_model import ensure_default_model

    return str(ensure_default_model())


def make_model(size: str, folder: Path) -> Path:
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SIZES[size], max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    model.save_pretrained(folder, max_shard_size="2GB")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "unk_token": "<unk>", "eos_token": "<unk>"}))
    return folder


def vm_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(args: argparse.Namespace) -> None:
    """One configuration, in this process: print one JSON line."""
    import torch

    from server.llm import LLM
    from sharding.wire import LOGITS_LAST, Step

    t0 = time.perf_counter()
    llm = LLM(args.model, tensor_parallel_size=args.tp, max_num_seqs=32, max_model_len=256)
    ready = time.perf_counter() - t0
    pids = [os.getpid()] + [p.pid for p in llm.workers.procs.values()]
    out = dict(tp=args.tp, threads=int(os.environ["TPSERVE_THREADS"]), ready_s=ready,
               load_s=llm.executor.load_seconds, peak_mb=[vm_hwm_mb(p) for p in pids], load_before=args.load)
    runner = llm.executor
    if not args.load_only:
        prompt = 8  # short, so the batch-32 prefill stays cheap on 2 cores
        for b in args.batches:
            reps = []
            per_seq = runner.block_table.shape[1]  # sequence s owns blocks [s * per_seq, (s + 1) * per_seq)
            blocks = torch.tensor([[s, j, s * per_seq + j] for s in range(b) for j in range(per_seq)])
            for _ in range(args.repeats):
                ids = torch.randint(1, 1000, (b * prompt,))
                runner.run(Step(ids, torch.tensor([[s, prompt, 0, LOGITS_LAST] for s in range(b)]), blocks))
                times = []
                for i in range(args.steps):
                    t = time.perf_counter()
                    logits = runner.run(Step(torch.randint(1, 1000, (b,)),
                                             torch.tensor([[s, 1, prompt + i, LOGITS_LAST] for s in range(b)])))
                    logits.argmax(-1).tolist()
                    times.append(time.perf_counter() - t)
                reps.append(statistics.median(times) * 1e3)
            out[f"decode_ms_b{b}"] = statistics.median(reps)
            out[f"decode_ms_b{b}_runs"] = reps
        out["peak_mb_after_decode"] = [vm_hwm_mb(p) for p in pids]
    out["load_after"] = load_avg()
    llm.close()
    print("RESULT " + json.dumps(out), flush=True)


def weight_shapes(size: str) -> list[tuple[int, int]]:
    c = SIZES[size]
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = h // c["num_attention_heads"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd
    return [(qkv, h), (h, h), (2 * inter, h), (h, inter)] * c["num_hidden_layers"] + [(v, h)]


def _stream(shapes, part, parts, reps, barrier, queue, kernel, threads=1):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    ws = [torch.randn(n // parts, k) for n, k in shapes]  # this process's share of the output rows
    nbytes = sum(w.nbytes for w in ws)
    xs = {k: torch.randn(1, k) for _, k in shapes}
    times = []
    with torch.inference_mode():
        if kernel == "packed":  # what the decode step uses on CPU (sharding/cpu/kernels.py)
            from sharding.cpu.kernels import pack, packed_linear

            ws = [(w.shape[1], pack(w)) for w in ws]
            run = lambda: [packed_linear(xs[k], p, None) for k, p in ws]  # noqa: E731
        else:
            run = lambda: [F.linear(xs[w.shape[1]], w) for w in ws]  # noqa: E731
        for r in range(reps + 1):
            barrier.wait()
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
            barrier.wait()
    queue.put((part, times[1:], nbytes))


def floor(size: str, parts: int, reps: int, kernel: str = "packed", threads: int = 1) -> dict:
    """ms for one pass over all weights: `parts` processes of `threads` threads streaming 1/parts each, concurrently."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(parts), ctx.Queue()
    procs = [ctx.Process(target=_stream, args=(weight_shapes(size), i, parts, reps, barrier, queue, kernel, threads))
             for i in range(parts)]
    for p in procs:
        p.start()
    res = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    per_rep = [max(r[1][i] for r in res) for i in range(reps)]  # the pass ends when the slowest process ends
    nbytes = sum(r[2] for r in res)
    ms = statistics.median(per_rep) * 1e3
    return dict(processes=parts, threads_each=threads, kernel=kernel, ms=ms, gb_s=nbytes / ms / 1e6, bytes=nbytes,
                load=load_avg())


def run_config(model: Path, tp: int, threads: int, args: argparse.Namespace) -> dict:
    env = dict(os.environ, TPSERVE_THREADS=str(threads))
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--tp", str(tp), "--steps", str(args.steps),
           "--repeats", str(args.repeats), "--batches", ",".join(map(str, args.batches)), "--load", load_avg()]
    if args.load_only:
        cmd.append("--load-only")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"TP={tp} x {threads} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=list(SIZES), default="0.9b")
    ap.add_argument("--model", help="use this checkpoint instead of a random one")
    ap.add_argument("--configs", default="1x1,1x2,2x1", help="TPxTHREADS list")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--load-only", action="store_true", help="only start-up: time to ready and peak memory")
    ap.add_argument("--no-floor", action="store_true")
    ap.add_argument("--rounds", type=int, default=2, help="alternate every floor and configuration this many times")
    ap.add_argument("--output", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--load", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    if args.child:
        child(args)
        return 0
    folder = Path(args.model) if args.model else make_model(args.size, Path(tempfile.gettempdir()) / f"tpserve-bench-{args.size}")
    ckpt_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"model {folder} ({ckpt_bytes / 1e9:.2f} GB); load {load_avg()}", flush=True)
    report: dict = dict(model=str(folder), checkpoint_bytes=ckpt_bytes, size=args.size, rounds=args.rounds, runs=[],
                        floor=[])
    floors = [] if args.no_floor or args.load_only else [(k, p, t) for k in ("packed", "f_linear")
                                                          for p, t in ((1, 1), (1, 2), (2, 1))]
    configs = [tuple(int(x) for x in cfg.split("x")) for cfg in args.configs.split(",")]
    # Rounds: every floor and every configuration once per round, so a slow spell of a shared host (its memory
    # bandwidth moves by tens of percent within minutes) hits all of them alike; medians over rounds are reported.
    for rnd in range(args.rounds):
        for kernel, parts, threads in floors:
            f = floor(args.size, parts, 5, kernel, threads)
            f["round"] = rnd
            report["floor"].append(f)
            print(f"[round {rnd}] floor ({kernel}): {parts} process(es) x {threads} thread(s): {f['ms']:.1f} ms per "
                  f"pass ({f['gb_s']:.1f} GB/s), load {f['load']}", flush=True)
        for tp, threads in configs:
            r = run_config(folder, tp, threads, args)
            r["round"] = rnd
            report["runs"].append(r)
            line = (f"[round {rnd}] TP={tp} x {threads} thread(s): ready {r['ready_s']:.1f} s (load {r['load_s']:.1f} "
                    f"s), peak MB per rank {[round(m) for m in r['peak_mb']]}")
            for b in args.batches:
                if f"decode_ms_b{b}" in r:
                    line += f", B={b} {r[f'decode_ms_b{b}']:.1f} ms/step"
            print(line + f"  (load before {r['load_before']}, after {r['load_after']})", flush=True)
    print("medians over rounds:")
    summary = report["summary"] = dict(floor={}, runs={})
    for kernel, parts, threads in floors:
        ms = statistics.median(f["ms"] for f in report["floor"]
                               if (f["kernel"], f["processes"], f["threads_each"]) == (kernel, parts, threads))
        key = f"{kernel} {parts}x{threads}"
        summary["floor"][key] = ms
        print(f"  floor {key}: {ms:.1f} ms per pass")
    for tp, threads in configs:
        rs = [r for r in report["runs"] if (r["tp"], r["threads"]) == (tp, threads)]
        row = dict(ready_s=statistics.median(r["ready_s"] for r in rs),
                   load_s=statistics.median(r["load_s"] for r in rs), peak_mb=[max(r["peak_mb"][i] for r in rs) for i in range(tp)])
        row.update({f"decode_ms_b{b}": statistics.median(r[f"decode_ms_b{b}"] for r in rs)
                    for b in args.batches if all(f"decode_ms_b{b}" in r for r in rs)})
        summary["runs"][f"{tp}x{threads}"] = row
        print(f"  TP={tp} x {threads}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                     for k, v in row.items()))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
