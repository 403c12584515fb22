"""Memory soak: `tpserve serve` under thousands of varied requests, with the RSS of every rank sampled as they go.

    python scripts/soak.py                                          # default model, TP=1, 4000 requests, 8 in flight
    python scripts/soak.py --requests 120 --every 40 --warmup 40    # a quick check
    python scripts/soak.py -tp 2 --server-args "--max-num-seqs 8 --kv-cache-memory 256MiB" --output results/soak2.json

Requests (seeded, so a rerun sends the same ones): prompts of 1..120 words (a third start with one of a few shared
preambles, so the prefix cache gets hits), /v1/completions or /v1/chat/completions, streamed or not, n=1 or 2, greedy
or sampled (some seeded), logprobs on some (echo too, for completions), stop strings on some, max_tokens 1..64.
Every `--every` finished requests the VmRSS of the server process and of each of its descendants (the other ranks) is
read from /proc. The growth reported is between the first sample at or after `--warmup` requests and the last one.
Failed requests (HTTP errors, error events in a stream, timeouts) are counted, not retried. The server is stopped at
the end with SIGTERM (it drains), then SIGKILL if it has not exited within 60 s.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by word "
         "but not what all were we when your can said there use an each which she do how their if will up other about "
         "out many then them these so some her would make like him into time has look two more write go see number no "
         "way could people my than first water been call who oil its now find long down day did get come made may "
         "part robot paint story river city").split()
STOPS = [".", "\n", " the", ",", "!", "robot", "\n\n"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def rank_of(pid: int) -> str:
    """'rankN' from the RANK variable a spawned rank was started with, else the process's name."""
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        rank = next((e[5:].decode() for e in env if e.startswith(b"RANK=")), None)
        return f"rank{rank}" if rank is not None else open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return "gone"


def descendants(pid: int) -> list[int]:
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    except OSError:
        return []
    kids = [int(p) for p in out]
    return kids + [d for k in kids for d in descendants(k)]


def request_spec(seed: int, i: int, preambles: list[str]) -> tuple[str, dict]:
    """(endpoint, JSON body) of request i: a function of (seed, i) only, whatever the completion order."""
    rng = random.Random(seed * 1_000_003 + i)
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120)))
    if rng.random() < 1 / 3:
        text = rng.choice(preambles) + " " + text
    body: dict = dict(max_tokens=rng.randint(1, 64), n=rng.choice([1, 1, 1, 2]),
                      temperature=rng.choice([0.0, 0.0, 0.7, 1.0]), stream=rng.random() < 0.5)
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(2**31)
    if rng.random() < 0.25:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        body["prompt"] = text
        if rng.random() < 0.25:
            body["logprobs"] = rng.randint(0, 5)
            body["echo"] = rng.random() < 0.3
        return "/v1/completions", body
    body["messages"] = [{"role": "user", "content": text}]
    if rng.random() < 0.25:
        body["logprobs"] = True
        body["top_logprobs"] = rng.randint(0, 5)
    return "/v1/chat/completions", body


async def send(client: httpx.AsyncClient, path: str, body: dict) -> str | None:
    """None on success, else a short reason."""
    try:
        if not body["stream"]:
            r = await client.post(path, json=body)
            if r.status_code != 200:
                return f"HTTP {r.status_code}"
            return None if r.json().get("choices") else "no choices"
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return f"HTTP {r.status_code}"
            done = False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: ") and '"error"' in line[:20]:
                    return "error event"
            return None if done else "stream ended without [DONE]"
    except httpx.HTTPError as e:
        return type(e).__name__


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({k for s in samples for k in s["rss_mb"]}):
        pts = [(s["requests"], s["rss_mb"][key]) for s in samples if key in s["rss_mb"]]
        ax.plot(*zip(*pts), marker=".", label=key)
    ax.set_xlabel("requests finished")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("tpserve memory soak")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def soak(args, base: str, server_pid: int, samples: list[dict], errors: collections.Counter) -> None:
    """Send the requests; append RSS samples to `samples` and failure reasons to `errors` as they come."""
    rng = random.Random(args.seed)
    preambles = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(4)]
    done = 0
    todo = iter(range(args.requests))
    t0 = time.monotonic()
    ranks = {server_pid: "rank0"}

    def sample() -> None:
        for pid in descendants(server_pid):
            if pid not in ranks:
                ranks[pid] = rank_of(pid)
        rss = {f"{name} ({pid})": v for pid, name in ranks.items() if (v := rss_mb(pid)) is not None}
        samples.append(dict(requests=done, seconds=round(time.monotonic() - t0, 2), rss_mb=rss,
                            errors=sum(errors.values())))
        print(f"{done:>6} requests {samples[-1]['seconds']:8.1f} s  "
              + "  ".join(f"{k}: {v:7.1f} MiB" for k, v in rss.items())
              + (f"  errors {samples[-1]['errors']}" if errors else ""), flush=True)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done
        for i in todo:
            failure = await send(client, *request_spec(args.seed, i, preambles))
            if failure:
                errors[failure] += 1
            done += 1
            if done % args.every == 0 or done == args.requests:
                sample()

    sample()
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=args.timeout, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: the default model)")
    ap.add_argument("-tp", "--tp", type=int, default=1)
    ap.add_argument("--server-args", default="", help="more `tpserve serve` arguments, one quoted string")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--every", type=int, default=200, help="sample RSS every N finished requests")
    ap.add_argument("--warmup", type=int, default=400, help="growth is measured from the first sample after this")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default="results/soak.json")
    args = ap.parse_args(argv)
    from loaders.default_model import ensure_default_model

    model = args.model or str(ensure_default_model())
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli.main", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", "-tp", str(args.tp), *shlex.split(args.server_args)]
    print(" ".join(cmd), flush=True)
    server = subprocess.Popen(cmd, cwd=ROOT)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the server on SIGTERM too
    samples: list[dict] = []
    errors: collections.Counter = collections.Counter()
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.5)
        asyncio.run(soak(args, f"http://127.0.0.1:{port}", server.pid, samples, errors))
    except (KeyboardInterrupt, SystemExit):
        print("interrupted: stopping the server, keeping the samples so far", flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            code = server.wait()
        print(f"server exited with code {code}", flush=True)
    if not samples:
        return 1
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(samples, indent=1))
    plot(samples, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    total = sum(errors.values())
    print(f"errors: {total} of {samples[-1]['requests']} requests" + (f" ({dict(errors)})" if total else ""))
    first = next((s for s in samples if s["requests"] >= args.warmup), None)
    last = samples[-1]
    if first is None or first is last:
        print(f"no growth measured: no two samples at or after {args.warmup} requests")
        return 0
    n = last["requests"] - first["requests"]
    span = last["seconds"] - first["seconds"]
    print(f"growth from {first['requests']} to {last['requests']} requests ({span:.0f} s):")
    for key, v in last["rss_mb"].items():
        if key in first["rss_mb"]:
            d = v - first["rss_mb"][key]
            print(f"  {key}: {first['rss_mb'][key]:.1f} -> {v:.1f} MiB: {d:+.1f} MiB, {d * 1024 / n:+.2f} KiB/request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
