"""What a dead rank costs a running server: the time from the SIGKILL to its replica serving again, the pause the
streams of the dead replica see, and the throughput of the surviving replica meanwhile.

    python scripts/bench_recovery.py                      # SmolLM2 (the default model), -dp 2, 3 rounds
    python scripts/bench_recovery.py --size 1gb           # the ~1 GB random Llama of scripts/bench_tp.py
    python scripts/bench_recovery.py --layout tp2         # -tp 2 -dp 1: the only way back is the respawn
    python scripts/bench_recovery.py --model /work/bench/llama3-8b-shapes --serve-args "-q int4" --tokens 96

Each round streams --streams completions (ignore_eos) at once, SIGKILLs rank 1 once every stream has 16 chunks, and
records every chunk's arrival: the longest pause of each stream after the kill (under -dp 2 the dead replica's
streams wait for their recompute on the other replica; under -tp 2 every stream waits for the respawn), and the
tokens per second of all streams before the kill and during the outage. Recovery is measured twice: the server's own
log line ("replica 1 restarted in X s": death noticed to groups joined) and the client's view (kill to /health
saying a replica is down, then "ok" again).
Prints a table and saves results/recovery_<model>_<layout>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "server"))


def rank_pid(server_pid: int, rank: int) -> int:
    out = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True).stdout
    for pid in map(int, out.split()):
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return pid
    raise RuntimeError(f"no process for rank {rank}")


async def one_round(url: str, server_pid: int, streams: int, tokens: int) -> dict:
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    killed: dict = {}

    async def stream(client, i):
        async with client.stream("POST", "/v1/completions", json={
                "prompt": f"Stream {i}: once upon a time", "max_tokens": tokens, "ignore_eos": True,
                "temperature": 0, "stream": True, "logprobs": 0}) as r:  # (logprobs: a chunk per token, even
            async for line in r.aiter_lines():                        # when a stub tokenizer decodes it to "")
                if line.startswith("data: {"):
                    now = time.monotonic()
                    chunk = json.loads(line[6:])["choices"]
                    for _ in (chunk[0]["logprobs"] or {}).get("tokens", []) if chunk else []:
                        arrivals[i].append(now)
                    if not killed and min(len(a) for a in arrivals) >= 16:
                        killed["t"] = time.monotonic()
                        os.kill(rank_pid(server_pid, 1), signal.SIGKILL)

    async def health(client):
        """Kill -> /health says a replica is down -> /health "ok" again: (noticed, serving again)."""
        while "t" not in killed:
            await asyncio.sleep(0.005)
        noticed = None
        while True:
            r = await client.get("/health")
            status = r.json().get("status")
            if noticed is None and status != "ok":
                noticed = time.monotonic()
            if noticed is not None and status == "ok":
                return noticed, time.monotonic()
            await asyncio.sleep(0.02)

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        h = asyncio.create_task(health(client))
        await asyncio.gather(*(stream(client, i) for i in range(streams)))
        if "t" not in killed:
            h.cancel()
            raise RuntimeError(f"the streams ended before each had 16 tokens: {[len(a) for a in arrivals]}")
        noticed, healthy = await h
    t_kill = killed["t"]
    first = max(a[0] for a in arrivals)  # every stream decodes from here
    last = max(a[-1] for a in arrivals)
    pauses = [max((b - x for x, b in zip(a, a[1:]) if b > t_kill), default=0.0) for a in arrivals]
    gaps = [b - x for a in arrivals for x, b in zip(a, a[1:]) if b <= t_kill]

    def rate(start, end):
        n = sum(1 for a in arrivals for t in a if start < t <= end)
        return n / (end - start) if end > start else None

    return dict(noticed_s=noticed - t_kill, serving_again_s=healthy - t_kill,
                median_gap_before_s=statistics.median(gaps), max_pause_s=max(pauses),
                median_pause_s=statistics.median(pauses), pauses_s=pauses,
                tok_s_before=rate(first, t_kill), tok_s_during_outage=rate(t_kill, min(healthy, last)),
                streams_ended_before_recovery=last < healthy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: the embedded SmolLM2)")
    ap.add_argument("--size", default=None, help="a random model of scripts/bench_tp.py's sizes, e.g. 1gb")
    ap.add_argument("--layout", choices=["dp2", "tp2"], default="dp2")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve-args", default="", help="more `tpserve serve` arguments, e.g. '-q int4' (a respawn then "
                    "reads the quantized cache the first start wrote)")
    args = ap.parse_args()
    from bench_tp import bench_model  # noqa: E402 (scripts/bench_tp.py)
    from conftest import free_port  # noqa: E402 (tests/server/conftest.py)

    model = args.model or (bench_model(args.size, None) if args.size else None)
    port = free_port()
    layout = ["-dp", "2", "-tp", "1"] if args.layout == "dp2" else ["-tp", "2"]
    log = Path("results") / f"recovery_server_{port}.log"
    log.parent.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "server.cli.main", "serve", *([model] if model else []), *layout, "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "1024", "--log-level", "info", "--max-rank-restarts",
           str(args.rounds + 1), *args.serve_args.split()]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        rounds = []
        for k in range(args.rounds):
            r = asyncio.run(one_round(url, proc.pid, args.streams, args.tokens))
            rounds.append(r)
            print(f"round {k + 1}: noticed {r['noticed_s']:.2f} s, serving again {r['serving_again_s']:.2f} s after "
                  f"the kill; longest stream pause {r['max_pause_s']:.2f} s (median {r['median_pause_s']:.2f}, gap "
                  f"before {r['median_gap_before_s'] * 1000:.0f} ms); {r['tok_s_before']:.1f} tok/s before, "
                  f"{r['tok_s_during_outage'] or 0:.1f} during the outage", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    server_s = [float(x) for x in re.findall(r"restarted in ([0-9.]+) s", log.read_text())]
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    name = Path(model).name if model else "SmolLM2-135M-Instruct"
    out = dict(model=name, layout=args.layout, serve_args=args.serve_args, cpu=cpu, streams=args.streams, tokens=args.tokens,
               server_restart_s=server_s, rounds=rounds,
               median_serving_again_s=statistics.median(r["serving_again_s"] for r in rounds))
    suffix = "".join(args.serve_args.split()).replace("-", "_")
    path = Path("results") / f"recovery_{name}_{args.layout}{suffix}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"{name} {args.layout} on {cpu}: server restart {server_s} s; median kill -> serving again "
          f"{out['median_serving_again_s']:.2f} s; saved {path}")


if __name__ == "__main__":
    main()
