"""LoRA served: tpserve --enable-lora against its base model, against merged models served one after the other, and
against llama.cpp's llama-server with the same adapters (issue 29's targets), interleaved rounds.

    scripts/build_llama_cpp.sh                                   # once: llama-server
    python scripts/bench_lora_served.py --rounds 3               # float32 against F32
    python scripts/bench_lora_served.py --rounds 3 --precision int8   # tpserve -q int8 against Q8_0

SmolLM2-135M-Instruct (the default model), four random rank-16 adapters a1..a4 on every linear of every layer
(scripts/bench_lora.py make_adapter: PEFT's format, written directly). Servers, all up at once and idle between runs,
every one with the same threads (--threads, default the CPUs this process may use):
- tpserve --enable-lora --lora-modules a1=.. a2=.. a3=.. a4=.. --max-loras 4: base requests name the base model
  (their steps are base-only), adapter requests name an adapter;
- four tpserve servers without adapters, each on one adapter merged into the base (PEFT: merge_and_unload, then
  save_pretrained to safetensors, in a folder per adapter), started one after the other (their start-up times are
  recorded, not counted in the serving times);
- llama-server on llama.cpp's F32 (or Q8_0) GGUF of the same weights, with the four adapters converted by llama.cpp's
  own convert_lora_to_gguf.py (f32), loaded with --lora-init-without-apply and picked per request ("lora": scale 1 for
  the request's adapter, 0 for the others; llama-server batches only requests whose adapters and scales agree).

Every run sends prompts of --input-len tokens (the same per request index on every server) and streams
--output-len tokens per request (tpserve: ignore_eos; llama-server: its end-of-text tokens banned by logit_bias).
Runs per round (the order of the servers alternates between rounds):
- b1 base / b1 a1: --b1-requests requests one after the other, base model / adapter a1 (tpserve and llama-server);
- c8 base / c8 a1 / c8 mix4: 8 requests at once, all base / all a1 / two per adapter a1..a4;
- merged, one after the other: the same 8 requests as c8 mix4, each adapter's two sent at once to its merged
  model's server, the four servers in turn; its wall time is the sum of the four.
Throughput = output tokens / wall time of the run. Ratios are taken within a round; medians over rounds are
printed, with every round's values in the JSON (results/lora_served[_PRECISION].json) and a PNG next to it.
"""

from __future__ import annotations

import argparse
import asyncio
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
sys.path.insert(0, str(ROOT / "scripts"))

import httpx  # noqa: E402

from bench_lora import cpu_name, make_adapter  # noqa: E402
from bench_serving import free_port, load_avg  # noqa: E402
from bench_servers import stop_servers, wait_ready  # noqa: E402

ADAPTERS = ["a1", "a2", "a3", "a4"]
CONVERT_LORA = Path("/work/bench/llama-src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_lora_to_gguf.py")
PRECISIONS = {"float32": ([], "F32"), "int8": (["--quantization", "int8"], "Q8_0")}


def cpu_id() -> str:
    fam = model = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("cpu family") and fam == "?":
            fam = line.split(":", 1)[1].strip()
        elif line.startswith("model") and not line.startswith("model name") and model == "?":
            model = line.split(":", 1)[1].strip()
    return f"{cpu_name()}, family {fam} model {model}, {len(os.sched_getaffinity(0))} CPUs"


# ---- the files: adapters, merged models, GGUFs -------------------------------------------------------------------


def merged_model(base: Path, adapter: Path, out: Path) -> Path:
    """The adapter merged into the base by PEFT (merge_and_unload), saved as safetensors with the base's tokenizer."""
    if (out / "config.json").exists():
        return out
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    tmp = out.with_name(out.name + ".tmp")
    merged.save_pretrained(str(tmp), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(tmp))
    tmp.rename(out)
    return out


def lora_gguf(base: Path, adapter: Path, out: Path) -> Path:
    """llama.cpp's own conversion of the PEFT adapter (f32), against the base folder's config."""
    if out.exists():
        return out
    env = dict(os.environ, PYTHONPATH=str(CONVERT_LORA.parent / "gguf-py"))
    subprocess.run([sys.executable, str(CONVERT_LORA), "--base", str(base), "--outtype", "f32", "--outfile", str(out),
                    str(adapter)], check=True, env=env, stdout=subprocess.DEVNULL)
    return out


# ---- the client --------------------------------------------------------------------------------------------------


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    times, usage = [], None
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            if '"usage"' in data:  # the client shares the 2 cores with the server: parse only what counts
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                if not any(c.get("text") for c in chunk.get("choices", [])):
                    continue
            elif '"text":""' in data.replace(" ", ""):
                continue
            times.append(time.perf_counter())
    tokens = usage["completion_tokens"] if usage else len(times)
    return {"tokens": tokens, "chunks": len(times), "ttft": times[0] - t0 if times else None,
            "itl": [b - a for a, b in zip(times, times[1:])]}


async def run_batch(url: str, bodies: list[dict], concurrent: bool) -> dict:
    """Send the bodies (all at once, or one after the other); wall time, tokens, TTFT and ITL medians."""
    async with httpx.AsyncClient(timeout=600) as client:
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        if concurrent:
            res = await asyncio.gather(*(one_request(client, url, b) for b in bodies))
        else:
            res = [await one_request(client, url, b) for b in bodies]
        wall = time.perf_counter() - t0
        client_cpu = time.process_time() - cpu0
    itl = [x for r in res for x in r["itl"]]
    return {"wall_s": wall, "tokens": sum(r["tokens"] for r in res), "client_cpu_s": client_cpu,
            "ttft_p50_ms": 1000 * statistics.median(r["ttft"] for r in res if r["ttft"] is not None),
            "itl_p50_ms": 1000 * statistics.median(itl) if itl else None}


# ---- main --------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precision", default="float32", choices=list(PRECISIONS))
    ap.add_argument("--input-len", type=int, default=22)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--b1-requests", type=int, default=2, help="requests one after the other in a batch-1 run")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--no-llama", action="store_true", help="skip llama-server")
    ap.add_argument("--no-merged", action="store_true", help="skip the merged-model servers")
    ap.add_argument("--workdir", default=str(ROOT / "results" / "lora_served"))
    ap.add_argument("--gguf", default="results/SmolLM2-135M-Instruct-F32.gguf", help="llama.cpp's F32 GGUF of the "
                    "same weights (written once from the shipped GGUF; Q8_0 is quantized from it)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)

    from bench_baseline import f32_gguf
    from bench_quant import llama_gguf
    from bench_quant_accuracy import llama_bin
    from transformers import AutoTokenizer

    from loadtest import synthetic_prompt
    from loaders.default_model import ensure_default_model

    model = ensure_default_model()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    tp_args, kind = PRECISIONS[args.precision]
    adapters = {n: make_adapter(model, work / "adapters" / n, seed=i) if not (work / "adapters" / n /
                                                                             "adapter_config.json").exists()
                else work / "adapters" / n for i, n in enumerate(ADAPTERS, 1)}
    merged = {} if args.no_merged else {n: merged_model(model, p, work / "merged" / n) for n, p in adapters.items()}
    use_llama = not args.no_llama and llama_bin("llama-server").exists()
    if not args.no_llama and not use_llama:
        print("llama-server not built (scripts/build_llama_cpp.sh): its rows are skipped", flush=True)
    if use_llama:
        gguf = llama_gguf(f32_gguf(Path(args.gguf)), kind, args.threads)
        lora_ggufs = {n: lora_gguf(model, p, work / f"{n}-f32.gguf") for n, p in adapters.items()}

    tok = AutoTokenizer.from_pretrained(str(model))
    rng = random.Random(0)
    prompts = [synthetic_prompt(rng, args.input_len, tok) for _ in range(8)]
    eos_ids = sorted({i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")) if i is not None})

    env = dict(os.environ, TPSERVE_THREADS=str(args.threads))
    procs: dict[str, subprocess.Popen] = {}
    ports: dict[str, int] = {}
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    startup: dict[str, float] = {}

    def tpserve(name: str, folder: Path, extra: list[str]) -> None:
        ports[name] = free_port()
        t0 = time.monotonic()
        procs[name] = subprocess.Popen([sys.executable, "-m", "server.cli.main", "serve", str(folder), *tp_args, *extra,
                                        "--host", "127.0.0.1", "--port", str(ports[name]), "--log-level", "warning",
                                        "--max-model-len", "512"], cwd=ROOT, env=env)
        wait_ready(f"http://127.0.0.1:{ports[name]}/health", procs[name])
        startup[name] = time.monotonic() - t0

    rows: list[dict] = []
    try:
        tpserve("tpserve", model, ["--enable-lora", "--max-loras", "4", "--lora-modules",
                                   *(f"{n}={p}" for n, p in adapters.items())])
        for n, folder in merged.items():
            tpserve(f"merged {n}", folder, [])
        if use_llama:
            ports["llama"] = free_port()
            per_slot = args.input_len + args.output_len + 64
            t0 = time.monotonic()
            procs["llama"] = subprocess.Popen(
                [str(llama_bin("llama-server")), "-m", str(gguf), "-t", str(args.threads), "-tb", str(args.threads),
                 "-np", "8", "-cb", "-c", str(8 * per_slot), "--lora", ",".join(str(lora_ggufs[n]) for n in ADAPTERS),
                 "--lora-init-without-apply", "--host", "127.0.0.1", "--port", str(ports["llama"])], cwd=ROOT, **quiet)
            wait_ready(f"http://127.0.0.1:{ports['llama']}/health", procs["llama"])
            startup["llama"] = time.monotonic() - t0
        models = httpx.get(f"http://127.0.0.1:{ports['tpserve']}/v1/models").json()["data"]
        base_name = next(m["id"] for m in models if m.get("parent") is None)

        def body(server: str, adapter: str | None, i: int) -> dict:
            b = {"prompt": prompts[i], "max_tokens": args.output_len, "temperature": 0.0, "stream": True}
            if server == "llama":
                b["logit_bias"] = {str(e): -100 for e in eos_ids}
                b["lora"] = [{"id": j, "scale": 1.0 if n == adapter else 0.0} for j, n in enumerate(ADAPTERS)]
            else:
                b["ignore_eos"] = True
                b["stream_options"] = {"include_usage": True}
                if server == "tpserve":
                    b["model"] = adapter or base_name
            return b

        def run(server: str, label: str, adapters_of: list[str | None], concurrent: bool, rnd: int) -> dict:
            url = f"http://127.0.0.1:{ports[server]}/v1/completions"
            before = load_avg()
            r = asyncio.run(run_batch(url, [body(server, a, i) for i, a in enumerate(adapters_of)], concurrent))
            row = dict(server=server, run=label, round=rnd, load_before=before, **r,
                       tok_s=r["tokens"] / r["wall_s"])
            rows.append(row)
            print(f"[round {rnd}] {server:8s} {label:8s}: {r['tokens']:5d} tokens in {r['wall_s']:6.2f} s = "
                  f"{row['tok_s']:6.1f} tok/s, TTFT p50 {r['ttft_p50_ms']:5.0f} ms, ITL p50 "
                  f"{r['itl_p50_ms'] or 0:5.1f} ms, client CPU {r['client_cpu_s']:.2f} s  (load {before})", flush=True)
            return row

        def merged_run(rnd: int) -> None:
            parts = []
            for k, n in enumerate(ADAPTERS):  # the same 8 requests as c8 mix4: request i has adapter i % 4
                idx = [i for i in range(8) if i % 4 == k]
                url = f"http://127.0.0.1:{ports['merged ' + n]}/v1/completions"
                parts.append(asyncio.run(run_batch(url, [body("merged", None, i) for i in idx], True)))
            wall = sum(p["wall_s"] for p in parts)
            tokens = sum(p["tokens"] for p in parts)
            rows.append(dict(server="merged", run="c8 mix4", round=rnd, wall_s=wall, tokens=tokens,
                             client_cpu_s=sum(p["client_cpu_s"] for p in parts),
                             tok_s=tokens / wall, parts=parts, ttft_p50_ms=None, itl_p50_ms=statistics.median(
                                 p["itl_p50_ms"] for p in parts)))
            walls = ", ".join(f"{p['wall_s']:.2f}" for p in parts)
            print(f"[round {rnd}] merged   c8 mix4 : {tokens:5d} tokens in {wall:6.2f} s = {tokens / wall:6.1f} tok/s "
                  f"(four servers in turn, {walls} s)", flush=True)

        mix = [ADAPTERS[i % 4] for i in range(8)]
        for server in ["tpserve"] + (["llama"] if use_llama else []):  # warm-up: one short request per server/model
            for a in [None] + ADAPTERS:
                asyncio.run(run_batch(f"http://127.0.0.1:{ports[server]}/v1/completions",
                                      [dict(body(server, a, 0), max_tokens=8)], False))
        for n in merged:
            asyncio.run(run_batch(f"http://127.0.0.1:{ports['merged ' + n]}/v1/completions",
                                  [dict(body("merged", None, 0), max_tokens=8)], False))
        for rnd in range(args.rounds):
            order = ["tpserve", "merged", "llama"]
            order = [s for s in (order if rnd % 2 == 0 else order[::-1])
                     if (s != "llama" or use_llama) and (s != "merged" or merged)]
            for server in order:
                if server == "merged":
                    merged_run(rnd)
                    continue
                run(server, "b1 base", [None] * args.b1_requests, False, rnd)
                run(server, "b1 a1", ["a1"] * args.b1_requests, False, rnd)
                run(server, "c8 base", [None] * 8, True, rnd)
                run(server, "c8 a1", ["a1"] * 8, True, rnd)
                run(server, "c8 mix4", mix, True, rnd)
    finally:
        stop_servers(procs)

    def val(server: str, run_: str, rnd: int) -> float | None:
        r = [x for x in rows if x["server"] == server and x["run"] == run_ and x["round"] == rnd]
        return r[0]["tok_s"] if r else None

    ratio_defs = {  # name: (numerator (server, run), denominator (server, run)), of throughputs
        "tpserve b1: adapter time / base time (<= 1.15)": (("tpserve", "b1 base"), ("tpserve", "b1 a1")),
        "tpserve c8 mix4 / c8 base (>= 0.8)": (("tpserve", "c8 mix4"), ("tpserve", "c8 base")),
        "tpserve c8 a1 / c8 base": (("tpserve", "c8 a1"), ("tpserve", "c8 base")),
        "tpserve c8 mix4 / merged servers in turn (>= 3)": (("tpserve", "c8 mix4"), ("merged", "c8 mix4")),
        "tpserve / llama-server, b1 a1 (>= 1.0)": (("tpserve", "b1 a1"), ("llama", "b1 a1")),
        "tpserve / llama-server, c8 a1 (>= 1.5)": (("tpserve", "c8 a1"), ("llama", "c8 a1")),
        "tpserve / llama-server, c8 mix4": (("tpserve", "c8 mix4"), ("llama", "c8 mix4")),
        "tpserve / llama-server, b1 base": (("tpserve", "b1 base"), ("llama", "b1 base")),
        "tpserve / llama-server, c8 base": (("tpserve", "c8 base"), ("llama", "c8 base")),
        "llama-server b1: adapter time / base time": (("llama", "b1 base"), ("llama", "b1 a1")),
        "llama-server c8 mix4 / c8 base": (("llama", "c8 mix4"), ("llama", "c8 base")),
    }
    ratios = {}
    for name, (num, den) in ratio_defs.items():
        per_round = [val(*num, r) / val(*den, r) for r in range(args.rounds)
                     if val(*num, r) is not None and val(*den, r) is not None]
        if per_round:
            ratios[name] = {"median": statistics.median(per_round), "rounds": per_round}
    medians = {}
    for server, run_ in sorted({(x["server"], x["run"]) for x in rows}):
        medians[f"{server} {run_}"] = statistics.median(x["tok_s"] for x in rows if x["server"] == server
                                                        and x["run"] == run_)
    print(f"\nmedians over {args.rounds} rounds ({args.precision}; llama.cpp {kind}), output tok/s:")
    for k, v in medians.items():
        print(f"  {k:24s} {v:7.1f}")
    print("ratios (median of per-round ratios; rounds):")
    for k, v in ratios.items():
        print(f"  {k:58s} {v['median']:.3f}  ({', '.join(f'{x:.3f}' for x in v['rounds'])})")
    print("start-up (s): " + ", ".join(f"{k} {v:.1f}" for k, v in startup.items()))
    out = Path(args.output or (ROOT / "results" / ("lora_served.json" if args.precision == "float32"
                                                   else f"lora_served_{args.precision}.json")))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(cpu=cpu_id(), precision=args.precision, llama_gguf=kind, threads=args.threads,
                                   input_len=args.input_len, output_len=args.output_len,
                                   b1_requests=args.b1_requests, startup_s=startup, runs=rows, medians_tok_s=medians,
                                   ratios=ratios), indent=1))
    print(f"wrote {out}")
    try:
        plot(medians, out.with_suffix(".png"), args.precision, kind)
    except Exception as e:  # noqa: BLE001 - the plot is optional
        print(f"no plot: {e}")
    return 0


def plot(medians: dict[str, float], path: Path, precision: str, kind: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = ["b1 base", "b1 a1", "c8 base", "c8 a1", "c8 mix4"]
    servers = [("tpserve", "tpserve"), ("llama", f"llama-server ({kind})"), ("merged", "merged servers in turn")]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.27
    for k, (s, label) in enumerate(servers):
        xs = [i + (k - 1) * width for i, r in enumerate(runs) if f"{s} {r}" in medians]
        ys = [medians[f"{s} {r}"] for r in runs if f"{s} {r}" in medians]
        if xs:
            ax.bar(xs, ys, width, label=label)
    ax.set_xticks(range(len(runs)), runs)
    ax.set_ylabel("output tokens/s (median of rounds)")
    ax.set_title(f"LoRA served, SmolLM2-135M {precision}, rank-16 adapters on every linear")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
