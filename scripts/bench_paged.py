"""The paged KV cache, measured: capacity at a fixed memory budget, prefix caching (a shared system prompt, multi-turn
chat), chunked prefill under a long prompt, and a no-regression check against the slot cache it replaced.

    python scripts/bench_paged.py all                           # every scenario in turn, full size (~20-25 min)
    python scripts/bench_paged.py capacity                      # 1 GiB: paged (64 sequences) vs slot cache (11 slots)
    python scripts/bench_paged.py shared-prefix --rounds 2      # 1500-token system prompt, caching on/off interleaved
    python scripts/bench_paged.py multi-turn                    # 8 chats x 6 turns: TTFT per turn; same answers?
    python scripts/bench_paged.py long-prompt --chunk-budgets 512/64,512/128,512,8192
    python scripts/bench_paged.py regression --levels 1:4,8:16,32:64
    python scripts/bench_paged.py all --quick                   # small sizes, 1 round: a smoke test (~5-10 min)

The slot-cache baseline (capacity, regression) is the commit before the paged cache, checked out beside this tree:
`git worktree add /tmp/tpserve_slot 88145e8` (--slot-tree); it runs with the same venv, cwd = that folder. Every run
starts a fresh server (cold cache), sends it one short warm-up request, and stops it at the end (SIGTERM, then kill).
What is compared runs in interleaved rounds (--rounds; medians reported) because this host's speed drifts. The client
(asyncio + httpx, streamed) shares the cores with the server. Writes results/paged/<scenario>.json and the servers'
logs under results/paged/logs/, and prints the CPU and load averages with every table. Nothing asserts on timings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import io
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import loadtest  # noqa: E402
from bench_serving import free_port, load_avg  # noqa: E402
from server.cli.main import parse_bytes  # noqa: E402

SCENARIOS = ("capacity", "shared-prefix", "multi-turn", "long-prompt", "regression")
SIZES = {  # scenario: (flag, default, value under --quick, help)
    "capacity": [("--cap-requests", 128, 16, ""), ("--cap-concurrency", 64, 16, "also the paged --max-num-seqs"),
                 ("--cap-input-len", 256, 64, ""), ("--cap-output-len", 128, 8, ""),
                 ("--cap-paged-args", "", "", "more flags for the paged server, one quoted string")],
    "shared-prefix": [("--system-len", 1500, 400, "system prompt tokens"), ("--questions", 32, 8, ""),
                      ("--question-len", 20, 20, ""), ("--sp-concurrency", 4, 4, ""), ("--sp-output-len", 16, 4, "")],
    "multi-turn": [("--conversations", 8, 2, ""), ("--turns", 6, 3, ""),
                   ("--mt-concurrency", 8, 8, "conversations at once"), ("--mt-output-len", 32, 8, "")],
    "long-prompt": [("--streams", 8, 2, ""), ("--stream-input-len", 22, 22, ""), ("--stream-output-len", 400, 80, ""),
                    ("--long-len", 4000, 1500, ""), ("--long-delay", 2.0, 0.5, "seconds after the streams start"),
                    ("--long-max-model-len", 8192, 8192, ""),
                    ("--chunk-budgets", "512/64,512/128,512,8192", "512/64,8192",
                     "STEP[/CAP] configurations: --max-num-batched-tokens [/ --max-prefill-tokens-while-decoding]")],
    "regression": [("--levels", "1:4,8:16,32:64", "1:2,8:8", "CONCURRENCY:NUM_REQUESTS,..."),
                   ("--input-len", 22, 22, ""), ("--output-len", 128, 8, "")],
}
TOPICS = ("the moon", "bread", "rivers", "chess", "volcanoes", "bees", "trains", "the ocean")
TURNS = ("Tell me about {}.", "Why is that?", "Can you give an example?", "Explain it more simply.",
         "What else should I know?", "Summarize what you said.")


class Server:
    """A fresh `tpserve serve` (cwd `tree`: this checkout or the slot-cache worktree), ready on /health."""

    def __init__(self, model: str, flags: list[str], log: Path, tree: Path = ROOT, timeout: float = 300):
        self.url = f"http://127.0.0.1:{free_port()}"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "server.cli.main", "serve", model, "--host", "127.0.0.1",
                                          "--port", self.url.rsplit(":", 1)[1], "--log-level", "warning", *flags],
                                         cwd=tree, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    urllib.request.urlopen(self.url + "/health", timeout=2)
                    break
                except OSError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                        raise RuntimeError(f"server ({tree}, {' '.join(flags)}) did not start; {log}:\n"
                                           f"{tail}") from None
                    time.sleep(0.5)
        except BaseException:  # also Ctrl-C while waiting
            self.stop()
            raise
        self.info = "; ".join(x[9:] for x in log.read_text(errors="replace").splitlines() if x.startswith("tpserve: "))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(45)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def client(timeout: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=15.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def stream(http: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed request: arrival times of its text chunks (s after sending), ttft, text, usage; errors kept."""
    chat = "messages" in body
    r = {"ok": False, "error": None, "sent": time.perf_counter(), "ttft": None, "times": [], "text": "",
         "output_tokens": None, "prompt_tokens": None}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with http.stream("POST", url + ("/v1/chat/completions" if chat else "/v1/completions"),
                               json=body) as resp:
            if resp.status_code != 200:
                raise loadtest.RequestFailed(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("error"):
                    raise loadtest.RequestFailed(f"error in stream: {json.dumps(chunk['error'])[:300]}")
                if text := loadtest.chunk_text(chunk, chat):
                    r["times"].append(time.perf_counter() - r["sent"])
                    r["text"] += text
                if chunk.get("usage"):
                    r["output_tokens"] = chunk["usage"].get("completion_tokens")
                    r["prompt_tokens"] = chunk["usage"].get("prompt_tokens")
        r["ok"], r["ttft"] = True, (r["times"] or [None])[0]
    except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
        r["error"] = f"{type(exc).__name__}: {exc}"
    return r


def get_metrics(url: str) -> dict[str, float]:
    """/metrics (Prometheus text) -> {'name{labels}': value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return {name: float(value) for name, _, value in (x.rpartition(" ") for x in lines if x and x[0] != "#")}


async def run_load(url: str, bodies: list[dict], concurrency: int, timeout: float, poll: bool = False):
    """Send `bodies`, `concurrency` in flight: (results in order, wall s, peaks of /metrics gauges every 0.2 s)."""
    results, todo, peaks = [{}] * len(bodies), iter(range(len(bodies))), {}
    async with client(timeout) as http:
        async def worker() -> None:
            for i in todo:
                results[i] = await stream(http, url, bodies[i])

        async def poller() -> None:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    for line in (await http.get(url + "/metrics", timeout=5)).text.splitlines():
                        name, _, value = line.rpartition(" ")
                        if name in ("tpserve_requests_running", "tpserve_requests_waiting",
                                    "tpserve_kv_cache_usage_ratio"):
                            peaks[name] = max(peaks.get(name, 0.0), float(value))
                await asyncio.sleep(0.2)

        polling = asyncio.create_task(poller()) if poll else None
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
        if polling:
            polling.cancel()
    return results, wall, peaks


def load_stats(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["output_tokens"] or len(r["times"]) for r in ok)
    return {"ok": len(ok), "failed": len(results) - len(ok), "wall_s": round(wall, 3), "output_tokens": tokens,
            "errors": list(dict.fromkeys(r["error"] for r in results if r["error"]))[:3],
            "output_tok_s": round(tokens / wall, 2) if wall else None,
            "prompt_tokens": max((r["prompt_tokens"] or 0 for r in ok), default=None),
            "ttft_ms": loadtest.percentiles([r["ttft"] for r in ok if r["ttft"] is not None]),
            "itl_ms": loadtest.percentiles([b - a for r in ok for a, b in zip(r["times"], r["times"][1:])])}


def random_ids(key: str, n: int, vocab: int) -> list[int]:
    """A seeded prompt of exactly n token ids (no special tokens: those sit at the bottom of the vocabulary)."""
    rng = random.Random(key)
    return [rng.randrange(200, vocab) for _ in range(n)]


def kv_bytes_per_token(cfg: dict) -> int:
    """layers x 2 (K, V) x KV heads x head dim x dtype size: what one token costs in the KV cache at TP=1."""
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.get("torch_dtype") or cfg.get("dtype") or "float32"]
    return cfg["num_hidden_layers"] * 2 * heads * head_dim * size


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def mean_ms(seconds) -> float | None:
    seconds = [s for s in seconds if s is not None]
    return round(statistics.mean(seconds) * 1000, 2) if seconds else None


def ratio(a, b) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def fmt(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}" if isinstance(v, float) else str(v)


def print_table(title: str, headers: list[str], rows: list[list]) -> None:
    cells = [headers] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    print(f"\n{title}")
    for row in cells[:1] + [["-" * w for w in widths]] + cells[1:]:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))


def cpu_model() -> str:
    """lscpu's "Model name", else /proc/cpuinfo's "model name"."""
    out = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out += subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    with contextlib.suppress(OSError):
        out += Path("/proc/cpuinfo").read_text()
    m = re.search(r"^model name\s*:\s*(.+)$", out, re.M | re.I)
    return m.group(1).strip() if m else "unknown"


class Ctx:
    """What every scenario needs: the arguments, the model (folder, config, tokenizer) and where to write."""

    def __init__(self, args):
        from transformers import AutoTokenizer

        from loaders.default_model import ensure_default_model

        self.args, self.model = args, args.model or str(ensure_default_model())
        self.config = json.loads((Path(self.model) / "config.json").read_text())
        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self.vocab = min(self.config["vocab_size"], len(self.tokenizer))
        self.out, self.cpu = Path(args.outdir), cpu_model()

    def rounds(self, scenario: str, configs: list[tuple], measure, rounds: int | None = None, warm=None) -> list:
        """Interleaved rounds: each (label, flags, on the slot tree?) config on a fresh server, warmed up with one
        request (`warm`, or a short one); measure(url) -> dict, plus what /metrics counted during it."""
        if any(slot for *_, slot in configs) and not (Path(self.args.slot_tree) / "server" / "cli.py").exists():
            raise SystemExit(f"no slot-cache tree at {self.args.slot_tree}: git worktree add {self.args.slot_tree} "
                             "88145e8 (the commit before the paged cache), or pass --slot-tree")
        warm = warm or dict(prompt=random_ids(f"{self.args.seed}:warm-up", 16, self.vocab), max_tokens=4)
        runs = []
        for rnd in range(rounds or self.args.rounds):
            for label, flags, slot in configs:
                with Server(self.model, flags, self.out / "logs" / f"{scenario}_{label}_r{rnd}.log",
                            Path(self.args.slot_tree) if slot else ROOT, self.args.start_timeout) as srv:
                    asyncio.run(run_load(srv.url, [warm], 1, self.args.timeout))
                    m0, before = get_metrics(srv.url), load_avg()
                    print(f"[{scenario}, round {rnd}] {label}: {' '.join(flags) or 'default flags'}"
                          f"{' (slot-cache tree)' if slot else ''}, load {before}", flush=True)
                    data = measure(srv.url)
                    m1 = get_metrics(srv.url)
                count = {k: m1[f"tpserve_{k}_total"] - m0[f"tpserve_{k}_total"] if f"tpserve_{k}_total" in m1 else None
                         for k in ("prefix_cache_hits", "prefix_cache_queries", "num_preemptions")}
                runs.append(dict(label=label, round=rnd, flags=flags, server=srv.info, **data,
                                 hit_rate=ratio(count["prefix_cache_hits"], count["prefix_cache_queries"]),
                                 preemptions=count["num_preemptions"], load_before=before, load_after=load_avg()))
        return runs

    def save(self, scenario: str, started: str, load_before: str, data: dict) -> None:
        keep = ("rounds", "kv_cache_memory", "seed", "quick", "slot_tree",
                *(flag[2:].replace("-", "_") for flag, *_ in SIZES[scenario]))
        report = {"scenario": scenario, "started_at": started, "cpu": self.cpu, "cores": os.cpu_count(),
                  "load_before": load_before, "load_after": load_avg(), "model": self.model,
                  "config": {k: v for k, v in vars(self.args).items() if k in keep}, **data}
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"{scenario}.json"
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"CPU: {self.cpu} ({os.cpu_count()} cores); load {load_before} -> {report['load_after']}; wrote {path}")


def capacity(ctx: Ctx) -> dict:
    a, cfg = ctx.args, ctx.config
    per_token = kv_bytes_per_token(cfg)
    max_len = min(cfg.get("max_position_embeddings", 2048), 2048)  # both servers' default --max-model-len
    slots = parse_bytes(a.kv_cache_memory) // (max_len * per_token)
    bodies = [dict(prompt=random_ids(f"{a.seed}:cap:{i}", a.cap_input_len, ctx.vocab), max_tokens=a.cap_output_len,
                   temperature=0, ignore_eos=True) for i in range(a.cap_requests)]

    def measure(url: str) -> dict:
        results, wall, peaks = asyncio.run(run_load(url, bodies, a.cap_concurrency, a.timeout, poll=True))
        return dict(peak_running=peaks.get("tpserve_requests_running"),
                    peak_waiting=peaks.get("tpserve_requests_waiting"),
                    peak_kv_usage=peaks.get("tpserve_kv_cache_usage_ratio"), **load_stats(results, wall))

    runs = ctx.rounds("capacity", [("paged", ["--kv-cache-memory", a.kv_cache_memory, "--max-num-seqs",
                                              str(a.cap_concurrency), *a.cap_paged_args.split()], False),
                                   ("slot", ["--max-num-seqs", str(slots)], True)], measure, rounds=1)
    paged, slot = runs
    summary = dict(kv_bytes_per_token=per_token, max_model_len=max_len, slot_seqs=slots,
                   peak_running_ratio=ratio(paged["peak_running"], slot["peak_running"]),
                   output_tok_s_ratio=ratio(paged["output_tok_s"], slot["output_tok_s"]))
    print_table(f"capacity: {a.cap_requests} requests of {a.cap_input_len} + {a.cap_output_len} tokens, "
                f"{a.cap_concurrency} concurrent, KV budget {a.kv_cache_memory} ({per_token} bytes/token; slot cache: "
                f"{slots} x {max_len} tokens)",
                ["server", "peak running", "ok/failed", "output tok/s", "TTFT p50 ms", "TTFT p90 ms", "ITL p50 ms",
                 "preemptions", "peak KV usage"],
                [[r["label"], r["peak_running"], f"{r['ok']}/{r['failed']}", r["output_tok_s"], r["ttft_ms"]["p50"],
                  r["ttft_ms"]["p90"], r["itl_ms"]["p50"], r["preemptions"], r["peak_kv_usage"]] for r in runs])
    print(f"peak running sequences, paged / slot: {fmt(summary['peak_running_ratio'], 2)}x (target >= 4x); "
          f"output tok/s: {fmt(summary['output_tok_s_ratio'], 2)}x")
    return dict(runs=runs, summary=summary)


def caching_configs(a) -> list[tuple]:
    return [("on", ["--kv-cache-memory", a.kv_cache_memory], False),
            ("off", ["--kv-cache-memory", a.kv_cache_memory, "--no-enable-prefix-caching"], False)]


def shared_prefix(ctx: Ctx) -> dict:
    a = ctx.args
    system = loadtest.synthetic_prompt(random.Random(f"{a.seed}:system"), a.system_len, ctx.tokenizer)

    def body(question: str) -> dict:
        return dict(messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
                    max_tokens=a.sp_output_len, temperature=0)

    bodies = [body(loadtest.synthetic_prompt(random.Random(f"{a.seed}:q{i}"), a.question_len, ctx.tokenizer)
                   .capitalize() + "?") for i in range(a.questions)]
    runs = ctx.rounds("shared-prefix", caching_configs(a), lambda url: load_stats(
        *asyncio.run(run_load(url, bodies, a.sp_concurrency, a.timeout))[:2]), warm=body("What is this text about?"))
    med = {m: {q: median(r["ttft_ms"][q] for r in runs if r["label"] == m) for q in ("p50", "p90")}
           for m in ("on", "off")}
    summary = dict(ttft_ms=med, ttft_p50_off_over_on=ratio(med["off"]["p50"], med["on"]["p50"]),
                   ttft_p90_off_over_on=ratio(med["off"]["p90"], med["on"]["p90"]),
                   hit_rate_on=median(r["hit_rate"] for r in runs if r["label"] == "on"))
    print_table(f"shared-prefix: {a.system_len}-token system prompt + {a.questions} questions of ~{a.question_len} "
                f"tokens, chat, {a.sp_concurrency} concurrent, max_tokens {a.sp_output_len} (after one warm-up "
                "request with the system prompt)",
                ["round", "caching", "prompt tokens", "ok/failed", "TTFT p50 ms", "TTFT p90 ms", "hit rate"],
                [[r["round"], r["label"], r["prompt_tokens"], f"{r['ok']}/{r['failed']}", r["ttft_ms"]["p50"],
                  r["ttft_ms"]["p90"], r["hit_rate"]] for r in runs])
    print(f"medians: TTFT p50 {fmt(med['on']['p50'])} ms with caching, {fmt(med['off']['p50'])} ms without: "
          f"{fmt(summary['ttft_p50_off_over_on'], 2)}x lower (target >= 5x); p90 "
          f"{fmt(summary['ttft_p90_off_over_on'], 2)}x; hit rate {fmt(summary['hit_rate_on'], 2)}")
    return dict(runs=runs, summary=summary)


async def conversations(url: str, a) -> list[list[dict]]:
    """Each conversation sends its turns one after the other, the whole history (answers included) every time."""
    gate = asyncio.Semaphore(a.mt_concurrency)
    async with client(a.timeout) as http:
        async def one(c: int) -> list[dict]:
            messages, turns = [], []
            async with gate:
                for t in range(a.turns):
                    messages.append({"role": "user", "content": TURNS[t % len(TURNS)].format(TOPICS[c % len(TOPICS)])})
                    turns.append(await stream(http, url, dict(messages=list(messages), max_tokens=a.mt_output_len,
                                                              temperature=0)))
                    messages.append({"role": "assistant", "content": turns[-1]["text"]})
            return turns
        return await asyncio.gather(*(one(c) for c in range(a.conversations)))


def multi_turn(ctx: Ctx) -> dict:
    a = ctx.args

    def measure(url: str) -> dict:
        convs = asyncio.run(conversations(url, a))
        flat = [r for conv in convs for r in conv]
        return dict(failed=sum(not r["ok"] for r in flat), errors=list(dict.fromkeys(r["error"] for r in flat
                                                                                     if r["error"]))[:3],
                    ttft_ms_per_turn=[mean_ms(conv[t]["ttft"] for conv in convs) for t in range(a.turns)],
                    prompt_tokens_per_turn=[convs[0][t]["prompt_tokens"] for t in range(a.turns)],
                    answers=[[r["text"] for r in conv] for conv in convs])

    runs = ctx.rounds("multi-turn", caching_configs(a), measure)
    reference = next(r for r in runs if r["label"] == "off")["answers"]  # greedy, without the cache
    pairs = [(c, t) for c in range(a.conversations) for t in range(a.turns)]
    for r in runs:
        differ = [(c, t) for c, t in pairs if r["answers"][c][t] != reference[c][t]]
        r["identical_answers"] = f"{len(pairs) - len(differ)}/{len(pairs)}"
        r["first_difference"] = differ and dict(conversation=differ[0][0], turn=differ[0][1],
                                                this=r["answers"][differ[0][0]][differ[0][1]],
                                                reference=reference[differ[0][0]][differ[0][1]]) or None
    per_turn = {m: [median(r["ttft_ms_per_turn"][t] for r in runs if r["label"] == m) for t in range(a.turns)]
                for m in ("on", "off")}
    summary = dict(ttft_ms_per_turn=per_turn, off_over_on=[ratio(f, n) for n, f in zip(*per_turn.values())],
                   all_answers_identical=all(r["first_difference"] is None for r in runs))
    at_once = min(a.mt_concurrency, a.conversations)
    print_table(f"multi-turn: {a.conversations} conversations x {a.turns} turns ({at_once} at once), chat, "
                f"max_tokens {a.mt_output_len}, greedy; TTFT: mean over conversations, median over rounds",
                ["turn", "prompt tokens", "TTFT ms, cache on", "TTFT ms, cache off", "off / on"],
                [[t + 1, runs[0]["prompt_tokens_per_turn"][t], per_turn["on"][t], per_turn["off"][t],
                  summary["off_over_on"][t]] for t in range(a.turns)])
    for r in runs:
        print(f"round {r['round']}, cache {r['label']:3s}: answers identical to cache-off round 0: "
              f"{r['identical_answers']}; hit rate {fmt(r['hit_rate'], 2)}; failed {r['failed']}"
              + (f"; first difference: {json.dumps(r['first_difference'])[:300]}" if r["first_difference"] else ""))
    return dict(runs=runs, summary=summary)


async def long_prompt_run(url: str, ctx: Ctx) -> dict:
    """`streams` decoding streams; `long_delay` s later, one long prompt. Gaps between the streams' chunks only."""
    a = ctx.args
    bodies = [dict(prompt=random_ids(f"{a.seed}:stream{i}", a.stream_input_len, ctx.vocab),
                   max_tokens=a.stream_output_len, temperature=0, ignore_eos=True) for i in range(a.streams)]
    async with client(a.timeout) as http:
        tasks = [asyncio.create_task(stream(http, url, b)) for b in bodies]
        await asyncio.sleep(a.long_delay)
        long = await stream(http, url, dict(prompt=random_ids(f"{a.seed}:long", a.long_len, ctx.vocab),
                                            max_tokens=16, temperature=0, ignore_eos=True))
        streams = await asyncio.gather(*tasks)
    ok = [s for s in streams if s["ok"]]
    gaps = [(s["sent"] + t0, t1 - t0) for s in ok for t0, t1 in zip(s["times"], s["times"][1:])]  # (start, length)
    first = long["sent"] + long["ttft"] if long["ttft"] else None  # the long prompt's first token
    during = [g for start, g in gaps if first and start < first and start + g > long["sent"]]
    itl = loadtest.percentiles([g for _, g in gaps])
    return dict(failed=len(streams) - len(ok) + (not long["ok"]),
                errors=[r["error"] for r in streams + [long] if r["error"]][:3], itl_ms=itl,
                max_over_p50=ratio(itl["max"], itl["p50"]),
                max_gap_during_long_prefill_ms=round(max(during) * 1000, 1) if during else None,
                long_ttft_ms=long["ttft"] and round(long["ttft"] * 1000, 1), long_prompt_tokens=long["prompt_tokens"],
                streams_decoding_at_long_first_token=sum(bool(first and s["sent"] + s["times"][-1] > first)
                                                         for s in ok),
                stream_tokens=[len(s["times"]) for s in ok])


def long_prompt(ctx: Ctx) -> dict:
    a = ctx.args
    budgets = a.chunk_budgets.split(",")  # STEP[/CAP]: --max-num-batched-tokens [--max-prefill-tokens-while-decoding]

    def flags(b: str) -> list[str]:
        step, _, cap = b.partition("/")
        return ["--max-num-batched-tokens", step, "--max-prefill-tokens-while-decoding", cap or "0"]

    configs = [(b, ["--max-model-len", str(a.long_max_model_len), "--kv-cache-memory", a.kv_cache_memory, *flags(b)],
                False) for b in budgets]
    runs = ctx.rounds("long-prompt", configs, lambda url: asyncio.run(long_prompt_run(url, ctx)))
    rows, summary = [], {}
    for b in budgets:
        mine = [r for r in runs if r["label"] == b]
        s = summary[b] = {f"itl_{q}_ms": median(r["itl_ms"][q] for r in mine) for q in ("p50", "p99", "max")}
        for k in ("max_over_p50", "max_gap_during_long_prefill_ms", "long_ttft_ms"):
            s[k] = median(r[k] for r in mine)
        one_shot = int(b.partition("/")[0]) >= a.long_len + a.streams and b.partition("/")[2] in ("", "0")
        rows.append([f"{b} ({'one-shot' if one_shot else 'chunked'})", s["itl_p50_ms"],
                     s["itl_p99_ms"], s["itl_max_ms"], s["max_over_p50"], s["max_gap_during_long_prefill_ms"],
                     s["long_ttft_ms"]])
    print_table(f"long-prompt: {a.streams} streams ({a.stream_input_len} + {a.stream_output_len} tokens), a "
                f"{a.long_len}-token prompt {a.long_delay:g} s later; gaps between the streams' chunks (client side), "
                f"medians over {a.rounds} round(s)",
                ["max-num-batched-tokens", "ITL p50 ms", "ITL p99 ms", "longest gap ms", "longest / p50",
                 "longest gap in the long prefill ms", "long prompt TTFT ms"], rows)
    plot_long_prompt(summary, Path(a.outdir) / "long_prompt.png",
                     f"{a.streams} streams decoding, a {a.long_len}-token prompt arrives ({cpu_model()})")
    print("target: longest gap <= 4x ITL p50 with chunking. Streams still decoding at the long prompt's first token: "
          + ", ".join(f"{r['label']}/r{r['round']}: {r['streams_decoding_at_long_first_token']}/{a.streams}"
                      + (f" ({r['failed']} failed)" if r["failed"] else "") for r in runs))
    return dict(runs=runs, summary=summary)


def plot_long_prompt(summary: dict, path: Path, title: str) -> None:
    """The trade a prefill cap makes: the streams' longest gap (over their ITL p50) against the long prompt's time
    to first token, one point per configuration."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, s in summary.items():
        if s["long_ttft_ms"] is None or s["max_over_p50"] is None:
            continue
        ax.scatter(s["long_ttft_ms"] / 1000, s["max_over_p50"], color="C1" if "auto" in label else "C0")
        ax.annotate(label, (s["long_ttft_ms"] / 1000, s["max_over_p50"]), textcoords="offset points", xytext=(5, 4),
                    fontsize=8)
    ax.axhline(4, color="grey", linestyle="--", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("long prompt: time to first token (s)")
    ax.set_ylabel("streams' longest gap / ITL p50")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def regression(ctx: Ctx) -> dict:
    a = ctx.args
    levels = [tuple(int(x) for x in level.split(":")) for level in a.levels.split(",")]

    def measure(url: str) -> dict:
        out = {}
        for conc, num in levels:
            with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()) as log, \
                    contextlib.redirect_stderr(log):
                code = loadtest.main(["--base-url", url, "--concurrency", str(conc), "--num-requests", str(num),
                                      "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--tokenizer",
                                      ctx.model, "--output", f"{tmp}/run.json", "--no-plot", "--no-progress", "--seed",
                                      str(a.seed)])
                if code != 0:
                    raise RuntimeError(f"loadtest failed (exit {code}):\n{log.getvalue()[-2000:]}")
                lv = json.loads(Path(f"{tmp}/run.json").read_text())["levels"][0]
            out[str(conc)] = dict(requests=num, ok=lv["completed"], failed=lv["failed"], errors=lv["errors"],
                                  output_tok_s=lv["output_throughput"], mean_output_tokens=lv["mean_output_tokens"],
                                  ttft_p50_ms=lv["ttft_ms"]["p50"], itl_p50_ms=lv["itl_ms"]["p50"], load=load_avg())
            print(f"  c={conc:>2}: {lv['completed']}/{num} ok, {fmt(lv['output_throughput'])} tok/s "
                  f"(load {load_avg()})", flush=True)
        return dict(levels=out)

    runs = ctx.rounds("regression", [("paged", [], False), ("slot", [], True)], measure)
    summary, rows = [], []
    for conc, _ in levels:
        per = {s: [r["levels"][str(conc)] for r in runs if r["label"] == s] for s in ("paged", "slot")}
        med = {s: {k: median(x[k] for x in per[s]) for k in ("output_tok_s", "ttft_p50_ms", "itl_p50_ms")} for s in per}
        summary.append(dict(concurrency=conc, **med, rounds_tok_s={s: [x["output_tok_s"] for x in per[s]] for s in per},
                            ratio=ratio(med["paged"]["output_tok_s"], med["slot"]["output_tok_s"])))
        rows.append([conc, med["paged"]["output_tok_s"], ", ".join(fmt(x["output_tok_s"]) for x in per["paged"]),
                     med["slot"]["output_tok_s"], ", ".join(fmt(x["output_tok_s"]) for x in per["slot"]),
                     summary[-1]["ratio"], med["paged"]["ttft_p50_ms"], med["slot"]["ttft_p50_ms"],
                     med["paged"]["itl_p50_ms"], med["slot"]["itl_p50_ms"]])
    print_table(f"regression: {a.input_len}-token prompts, {a.output_len} output tokens (EOS ignored), default server "
                f"flags; medians over {a.rounds} round(s) (paged: this tree, slot: {a.slot_tree})",
                ["c", "paged tok/s", "(rounds)", "slot tok/s", "(rounds)", "paged / slot", "TTFT p50 ms paged",
                 "slot", "ITL p50 ms paged", "slot"], rows)
    print("target: paged / slot within 5 % (0.95-1.05)")
    return dict(runs=runs, summary=summary)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario", choices=SCENARIOS + ("all",), help="which benchmark ('all': each in turn)")
    ap.add_argument("--model", help="checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds, fresh servers each (capacity: 1)")
    ap.add_argument("--kv-cache-memory", default="1GiB", help="KV budget (every scenario but regression: defaults)")
    ap.add_argument("--slot-tree", default="/tmp/tpserve_slot", help="worktree of the slot-cache commit (88145e8)")
    ap.add_argument("--outdir", default="results/paged")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds for a server to answer /health")
    ap.add_argument("--quick", action="store_true", help="small sizes, 1 round: a smoke test (overrides the sizes)")
    for scenario, flags in SIZES.items():
        g = ap.add_argument_group(scenario)
        for flag, default, quick, text in flags:
            g.add_argument(flag, type=type(default), default=default,
                           help=f"{text + '; ' if text else ''}default {default}, --quick {quick}")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = 1 if args.rounds == ap.get_default("rounds") else args.rounds
        for flag, default, quick, _ in (f for flags in SIZES.values() for f in flags):
            if getattr(args, flag[2:].replace("-", "_")) == default:  # sizes given explicitly stay
                setattr(args, flag[2:].replace("-", "_"), quick)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = Ctx(args)
    print(f"CPU: {ctx.cpu} ({os.cpu_count()} cores); load {load_avg()}; model {ctx.model}", flush=True)
    failed = []
    for name in SCENARIOS if args.scenario == "all" else (args.scenario,):
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        before, t0 = load_avg(), time.monotonic()
        print(f"\n=== {name} ({started})", flush=True)
        try:
            data = globals()[name.replace("-", "_")](ctx)
        except (RuntimeError, OSError, httpx.HTTPError) as exc:  # one failing scenario does not stop `all`
            print(f"{name} failed: {exc}", file=sys.stderr)
            failed.append(name)
            continue
        data["elapsed_s"] = round(time.monotonic() - t0, 1)
        ctx.save(name, started, before, data)
        print(f"{name}: {data['elapsed_s']:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
