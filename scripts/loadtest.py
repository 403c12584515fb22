"""Load generator for any OpenAI-compatible streaming server (tpserve, vLLM, TGI, llama.cpp's server).

Common cases (the server at http://127.0.0.1:8000, model = first id of GET /v1/models):

    python scripts/loadtest.py --concurrency 8 --num-requests 64
    python scripts/loadtest.py --concurrency 1,8,32 --num-requests 64 --input-len 256 --output-len 128
    python scripts/loadtest.py --request-rate 2.5 --num-requests 100 --seed 0
    python scripts/loadtest.py --endpoint chat --concurrency 4 --duration 60
    python scripts/loadtest.py --tokenizer /path/to/model --input-len 512 --output-len 64 --concurrency 16
    python scripts/loadtest.py --prompts-file prompts.jsonl --concurrency 8 --output results/run.json --no-plot
    python scripts/loadtest.py --base-url http://gpu-box:8000 --api-key sk-x --model my-model --no-ignore-eos

`--concurrency 1,8,32` runs each level in turn; `--request-rate R` (or `1,2,4`) sends at seeded Poisson arrival
times (`--concurrency N` then caps requests in flight). A level stops sending after `--num-requests` and/or
`--duration` seconds, then waits for requests in flight (each bounded by `--timeout`). Output tokens come from
`usage` in the final chunk (stream_options.include_usage), else from counting chunks with text. Writes JSON
(`--output`) and PNG plots next to it. Exit code 0; 1 if every request failed; 2 for usage errors or no server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
import math
import random
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write "
         "go see number no way could people my than first water been call who oil its now find long down day did "
         "get come made may part").split()


class RequestFailed(Exception):
    """A request that the server answered with an error (HTTP status or an error object in the stream)."""


class ServerUnavailable(Exception):
    """The server cannot be reached, refuses the API key, or lists no model (and none was given)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is accepted)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", help="model id (default: first id from GET /v1/models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--concurrency", help="requests in flight, or a sweep like 1,8,32 (default 8; with "
                                         "--request-rate: an optional cap)")
    p.add_argument("--request-rate", help="Poisson arrivals, requests/s (or a sweep like 1,2,4; 'inf' = all at once)")
    p.add_argument("--num-requests", type=int, help="requests per level (default 100 unless --duration is given)")
    p.add_argument("--duration", type=float, help="seconds per level: stop sending new requests after this")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per request (default 300)")
    p.add_argument("--input-len", type=int, default=128, help="synthetic prompt length in tokens (default 128)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request (default 128)")
    p.add_argument("--tokenizer", help="a tokenizer folder/id for transformers: exact --input-len prompts")
    p.add_argument("--prompts-file", help="JSONL with 'prompt' or 'messages' (optional 'max_tokens'), or text lines")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos: true")
    p.add_argument("--no-usage", action="store_true", help="do not send stream_options (count chunks instead)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", metavar="JSON", help="fields merged into every request body, e.g. "
                   "'{\"logit_bias\": {\"2\": -100}}' to hold lengths on a server without ignore_eos")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="results/loadtest.json", help="JSON report; plots go next to it")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = p.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")] if args.concurrency else None
        args.request_rate = [float(r) for r in args.request_rate.split(",")] if args.request_rate else None
        args.extra_body = json.loads(args.extra_body) if args.extra_body else {}
        if not isinstance(args.extra_body, dict):
            raise ValueError("--extra-body must be a JSON object")
    except ValueError as exc:
        p.error(f"bad --concurrency, --request-rate or --extra-body: {exc}")
    if args.request_rate and args.concurrency and len(args.concurrency) > 1:
        p.error("with --request-rate, --concurrency is a single cap, not a sweep")
    if any(c < 1 for c in args.concurrency or []) or any(r <= 0 for r in args.request_rate or []):
        p.error("--concurrency and --request-rate must be positive")
    if args.num_requests is None and args.duration is None:
        args.num_requests = 100
    if (args.num_requests is not None and args.num_requests < 1) or (args.duration is not None and args.duration <= 0):
        p.error("--num-requests and --duration must be positive")
    args.base_url = args.base_url.rstrip("/").removesuffix("/v1")
    return args


def make_levels(args: argparse.Namespace) -> list[dict]:
    """One dict per load level: {'name', 'concurrency', 'request_rate'} (None where it does not apply)."""
    if args.request_rate:
        cap = args.concurrency[0] if args.concurrency else None
        return [{"name": f"rate={r:g}/s", "concurrency": cap, "request_rate": r} for r in args.request_rate]
    return [{"name": f"c={c}", "concurrency": c, "request_rate": None} for c in (args.concurrency or [8])]


def load_prompts_file(path: str) -> list[dict]:
    """Entries {'prompt': str} or {'messages': [...]}, optionally with 'max_tokens'; plain lines become prompts."""
    entries = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            item = None
        if not isinstance(item, dict):
            entries.append({"prompt": line})
        elif "prompt" in item or "messages" in item:
            entries.append(item)
        else:
            raise ValueError(f"{path}:{number}: a JSON line needs a 'prompt' or 'messages' key")
    if not entries:
        raise ValueError(f"{path}: no prompts")
    return entries


def load_tokenizer(path: str):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        print("warning: transformers is not importable; approximating --input-len with words", file=sys.stderr)
        return None
    return AutoTokenizer.from_pretrained(path)


def synthetic_prompt(rng: random.Random, num_tokens: int, tokenizer=None) -> str:
    """Random common words: about one token each, or exactly `num_tokens` tokens when a tokenizer is given."""
    text = " ".join(rng.choice(WORDS) for _ in range(num_tokens))
    if tokenizer is None:
        return text
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < num_tokens:
        text += " " + " ".join(rng.choice(WORDS) for _ in range(num_tokens))
        ids = tokenizer.encode(text, add_special_tokens=False)
    keep = num_tokens  # decode a prefix, re-encode, and adjust: merges at the cut can change the count
    for _ in range(20):
        text = tokenizer.decode(ids[:keep])
        got = len(tokenizer.encode(text, add_special_tokens=False))
        if got == num_tokens:
            break
        keep = max(1, min(len(ids), keep + num_tokens - got))
    return text


def request_entry(args, level_index: int, i: int, file_entries: list[dict] | None, tokenizer) -> dict:
    """The i-th prompt of a level: from the file (cycled) or synthetic, seeded by (seed, level, i)."""
    if file_entries:
        return file_entries[i % len(file_entries)]
    return {"prompt": synthetic_prompt(random.Random(f"{args.seed}:{level_index}:{i}"), args.input_len, tokenizer)}


def build_payload(args, model: str, entry: dict) -> dict:
    body = {"model": model, "max_tokens": entry.get("max_tokens", args.output_len),
            "temperature": args.temperature, "stream": True}
    if args.endpoint == "chat":
        body["messages"] = entry.get("messages") or [{"role": "user", "content": entry["prompt"]}]
    else:
        body["prompt"] = entry["prompt"] if "prompt" in entry else "\n".join(
            str(m.get("content", "")) for m in entry["messages"])
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    if not args.no_usage:
        body["stream_options"] = {"include_usage": True}
    body.update(args.extra_body)
    return body


def chunk_text(chunk: dict, chat: bool) -> str:
    choice = (chunk.get("choices") or [{}])[0]
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def stream_request(client: httpx.AsyncClient, url: str, payload: dict, chat: bool, result: dict) -> None:
    """POST one streaming request, filling `result` with timings (seconds) and token counts as chunks arrive."""
    start = time.perf_counter()
    last = None
    async with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode("utf-8", "replace").strip()
            raise RequestFailed(f"HTTP {response.status_code}: {body[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, ': keep-alive' comments, 'event:' lines
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                raise RequestFailed(f"error in stream: {json.dumps(chunk['error'])[:300]}")
            now = time.perf_counter()
            if chunk_text(chunk, chat):
                if last is None:
                    result["ttft"] = now - start
                else:
                    result["itl"].append(now - last)
                last = now
                result["chunks"] += 1
            usage = chunk.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                result["usage_tokens"] = usage["completion_tokens"]
                result["prompt_tokens"] = usage.get("prompt_tokens")
    result["e2e"] = time.perf_counter() - start
    if result["chunks"] == 0:
        raise RequestFailed("the stream carried no tokens")


async def send_request(client: httpx.AsyncClient, args, model: str, entry: dict) -> dict:
    """One request's record: ok, error, ttft/e2e (s), itl (list of s), output_tokens, prompt_tokens, usage."""
    result = {"ok": False, "error": None, "ttft": None, "e2e": None, "itl": [], "chunks": 0,
              "usage_tokens": None, "prompt_tokens": None}
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    try:
        await asyncio.wait_for(stream_request(client, args.base_url + path, build_payload(args, model, entry),
                                              args.endpoint == "chat", result), args.timeout)
        result["ok"] = True
    except asyncio.TimeoutError:
        result["error"] = f"timed out after {args.timeout:g}s"
    except RequestFailed as exc:
        result["error"] = str(exc)
    except Exception as exc:  # httpx errors, malformed JSON chunks: recorded, the run goes on
        result["error"] = f"{type(exc).__name__}: {exc}".rstrip(": ")
    result["usage"] = result["usage_tokens"] is not None
    result["output_tokens"] = result["usage_tokens"] if result["usage"] else result["chunks"]
    return result


async def resolve_model(client: httpx.AsyncClient, args) -> str:
    """Check the server is reachable (GET /v1/models) and return --model or the first listed id."""
    try:
        response = await client.get(args.base_url + "/v1/models", timeout=15.0)
    except httpx.HTTPError as exc:
        raise ServerUnavailable(f"error: cannot reach an OpenAI-compatible server at {args.base_url} "
                                f"({type(exc).__name__}: {exc}). Is it running? Check --base-url.") from None
    status = response.status_code
    if status in (401, 403):
        raise ServerUnavailable(f"error: {args.base_url} refused the credentials (HTTP {status}); pass --api-key")
    if args.model:
        return args.model
    try:
        models = [m.get("id") for m in response.json().get("data", []) if m.get("id")] if status == 200 else []
    except (ValueError, AttributeError):
        models = []
    if not models:
        raise ServerUnavailable(f"error: GET {args.base_url}/v1/models gave HTTP {status} and no model id; "
                                "pass --model")
    return models[0]


async def run_level(client, args, model: str, level: dict, level_index: int, file_entries, tokenizer) -> tuple:
    """Send one level's requests (fixed concurrency or Poisson arrivals); return (results, wall seconds)."""
    limit = args.num_requests
    results: list[dict] = []
    prepared = [request_entry(args, level_index, i, file_entries, tokenizer) for i in range(limit or 0)]
    start = time.perf_counter()
    deadline = start + args.duration if args.duration else math.inf
    counter = itertools.count()
    progress = tqdm(total=limit, desc=level["name"], unit="req", disable=args.no_progress, leave=True)

    def next_index() -> int | None:
        if time.perf_counter() >= deadline:
            return None
        i = next(counter)
        return None if limit is not None and i >= limit else i

    async def one(i: int) -> None:
        entry = prepared[i] if prepared else request_entry(args, level_index, i, file_entries, tokenizer)
        results.append(await send_request(client, args, model, entry))
        progress.update(1)

    if level["request_rate"] is None:
        async def worker() -> None:
            while (i := next_index()) is not None:
                await one(i)
        await asyncio.gather(*(worker() for _ in range(level["concurrency"])))
    else:
        arrivals = random.Random(f"{args.seed}:arrivals:{level_index}")
        cap = asyncio.Semaphore(level["concurrency"]) if level["concurrency"] else contextlib.nullcontext()

        async def capped(i: int) -> None:
            async with cap:
                await one(i)

        tasks = []
        while (i := next_index()) is not None:
            tasks.append(asyncio.create_task(capped(i)))
            if limit is not None and i + 1 >= limit:
                break
            await asyncio.sleep(min(arrivals.expovariate(level["request_rate"]), deadline - time.perf_counter()))
        await asyncio.gather(*tasks)
    progress.close()
    return results, time.perf_counter() - start


def percentiles(values_s: list[float]) -> dict:
    """mean/p50/p90/p99/max in milliseconds (None for no data)."""
    if not values_s:
        return {key: None for key in ("mean", "p50", "p90", "p99", "max")}
    ms = np.asarray(values_s) * 1000.0
    stats = {"mean": ms.mean(), "max": ms.max(), **{f"p{q}": np.percentile(ms, q) for q in (50, 90, 99)}}
    return {key: round(float(value), 3) for key, value in stats.items()}


def summarize_level(level: dict, results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["output_tokens"] for r in ok)
    prompt_tokens = [r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None]
    sources = {"usage" if r["usage"] else "chunks" for r in ok}
    errors = list(dict.fromkeys(r["error"] for r in results if not r["ok"]))
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    rate = level["request_rate"]
    return {
        "name": level["name"], "concurrency": level["concurrency"],
        "request_rate": rate if rate is None or math.isfinite(rate) else "inf",
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": round(wall, 3),
        "request_throughput": round(len(ok) / wall, 3) if wall > 0 else None,
        "output_throughput": round(tokens / wall, 3) if wall > 0 else None,
        "total_output_tokens": tokens,
        "total_input_tokens": sum(prompt_tokens) if prompt_tokens else None,
        "mean_output_tokens": round(tokens / len(ok), 2) if ok else None,
        "output_tokens_source": "/".join(sorted(sources)) or None,
        "ttft_ms": percentiles([r["ttft"] for r in ok]),
        "itl_ms": percentiles([gap for r in ok for gap in r["itl"]]),
        "tpot_ms": percentiles(tpot),
        "e2e_ms": percentiles([r["e2e"] for r in ok]),
        "errors": errors[:5],
        "requests": [{"ok": r["ok"], "ttft_ms": r["ttft"] and round(r["ttft"] * 1000, 3),
                      "e2e_ms": r["e2e"] and round(r["e2e"] * 1000, 3), "output_tokens": r["output_tokens"],
                      "prompt_tokens": r["prompt_tokens"], "error": r["error"]} for r in results],
    }


def fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_table(summaries: list[dict]) -> None:
    """Metrics as rows, one column per level: narrow enough for a terminal even for a long sweep."""
    rows = [("requests ok/failed", [f"{s['completed']}/{s['failed']}" for s in summaries]),
            ("duration s", [fmt(s["duration_s"], 2) for s in summaries]),
            ("requests/s", [fmt(s["request_throughput"], 2) for s in summaries]),
            ("output tokens/s", [fmt(s["output_throughput"]) for s in summaries]),
            ("mean output tokens", [fmt(s["mean_output_tokens"]) for s in summaries])]
    for metric, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
        for q in ("p50", "p90", "p99"):
            rows.append((f"{label} {q} ms", [fmt(s[metric][q]) for s in summaries]))
    width = max(12, *(len(s["name"]) + 2 for s in summaries))
    print(f"\n{'':<20}" + "".join(f"{s['name']:>{width}}" for s in summaries))
    for label, cells in rows:
        print(f"{label:<20}" + "".join(f"{cell:>{width}}" for cell in cells))
    for s in summaries:
        for message in s["errors"]:
            print(f"[{s['name']}] error: {message}")


def cdf_panel(ax, series: dict[str, list[float]], title: str) -> None:
    values = [v for vs in series.values() for v in vs if v > 0]
    for name, vs in series.items():
        if vs:
            xs = np.sort(np.asarray(vs) * 1000.0)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name, linewidth=1.5)
    if values and max(values) / min(values) > 50:
        ax.set_xscale("log")
    ax.set(title=title, xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def write_plots(summaries: list[dict], raw: list[list[dict]], output: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, suffix: str) -> None:
        paths.append(str(output.with_name(f"{output.stem}_{suffix}.png")))
        fig.tight_layout()
        fig.savefig(paths[-1])
        plt.close(fig)

    paths: list[str] = []
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 4), dpi=100)
    cdf_panel(left, {s["name"]: [r["ttft"] for r in rs if r["ok"]] for s, rs in zip(summaries, raw)}, "TTFT CDF")
    cdf_panel(right, {s["name"]: [g for r in rs if r["ok"] for g in r["itl"]] for s, rs in zip(summaries, raw)},
              "Inter-token latency CDF")
    save(fig, "latency")
    if len(summaries) > 1:
        by_rate = summaries[0]["request_rate"] is not None
        xs = list(range(len(summaries)))  # evenly spaced levels: reads like a log axis, and allows rate=inf
        fig, (left, right) = plt.subplots(1, 2, figsize=(8, 4), dpi=100)
        left.plot(xs, [s["output_throughput"] or 0 for s in summaries], "o-")
        left.set(title="Output throughput", xlabel="request rate (req/s)" if by_rate else "concurrency",
                 ylabel="output tokens/s", ylim=(0, None))
        for metric, label, color in (("ttft_ms", "TTFT", "tab:blue"), ("itl_ms", "ITL", "tab:green")):
            for q, style in (("p50", "o-"), ("p90", "^--")):
                right.plot(xs, [s[metric][q] or np.nan for s in summaries], style, color=color, label=f"{label} {q}")
        right.set(title="Latency", xlabel=left.get_xlabel(), ylabel="ms", yscale="log")
        right.legend(fontsize=8)
        for ax in (left, right):
            ax.set_xticks(xs, [s["name"].split("=")[1].removesuffix("/s") for s in summaries])
            ax.grid(alpha=0.3)
        save(fig, "sweep")
    return paths


async def run(args, file_entries, tokenizer) -> int:
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.timeout, connect=15.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        model = await resolve_model(client, args)
        levels = make_levels(args)
        bounds = " and ".join(filter(None, [args.num_requests and f"{args.num_requests} requests",
                                            args.duration and f"{args.duration:g}s"]))
        print(f"{args.base_url} /v1/{'chat/completions' if args.endpoint == 'chat' else 'completions'} "
              f"model={model}: {len(levels)} level(s) of {bounds}", file=sys.stderr)
        summaries, raw = [], []
        for index, level in enumerate(levels):
            results, wall = await run_level(client, args, model, level, index, file_entries, tokenizer)
            raw.append(results)
            summaries.append(summarize_level(level, results, wall))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        plots = [] if args.no_plot else write_plots(summaries, raw, output)
    except Exception as exc:  # a plotting problem must not lose the measurements
        print(f"warning: plotting failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        plots = []
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    config["request_rate"] = [r if math.isfinite(r) else "inf" for r in args.request_rate or []] or None
    completed = sum(s["completed"] for s in summaries)
    report = {"tool": "tpserve-loadtest", "version": 1, "started_at": started_at, "base_url": args.base_url,
              "endpoint": args.endpoint, "model": model, "config": config,
              "mode": "request_rate" if args.request_rate else "concurrency",
              "total": {"requests": sum(s["num_requests"] for s in summaries), "completed": completed,
                        "failed": sum(s["failed"] for s in summaries)},
              "levels": summaries, "plots": plots}
    output.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print_table(summaries)
    print(f"\nwrote {output}" + "".join(f", {p}" for p in plots))
    if completed == 0:
        hint = " (if the server rejects a field, try --no-ignore-eos / --no-usage)" if any(
            "ignore_eos" in e or "stream_options" in e for s in summaries for e in s["errors"]) else ""
        print(f"error: every request failed{hint}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        file_entries = load_prompts_file(args.prompts_file) if args.prompts_file else None
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run(args, file_entries, tokenizer))
    except ServerUnavailable as exc:
        print(exc, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
