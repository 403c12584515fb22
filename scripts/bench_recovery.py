"""What a dead rank costs a running server: the time from the SIGKILL to its replica serving again, the pause the
streams of the dead replica see, and the throughput of the surviving replica meanwhile.

    python scripts/bench_recovery.py                      # SmolLM2 (the default model), -dp 2, 3 rounds
    python scripts/bench_recovery.py --size 1gb           # the ~1 GB random Llama of scripts/bench_tp.py
    python scripts/bench_recovery.py --layout tp2         # -tp 2 -dp 1: the only way back is the respawn

Each round streams --streams completions (ignore_eos) at once, SIGKILLs rank 1 once every stream has 8 chunks, and
records every chunk's arrival. A stream "of the dead replica" is one whose longest gap after the kill is over 5x its
median gap before it (the others are the surviving replica's). Recovery is measured twice: the server's own log line
("replica 1 restarted in X s": death noticed to groups joined) and the client's view (kill to /health "ok").
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
                "temperature": 0, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    arrivals[i].append(time.monotonic())
                    if not killed and min(len(a) for a in arrivals) >= 8:
                        killed["t"] = time.monotonic()
                        os.kill(rank_pid(server_pid, 1), signal.SIGKILL)

    async def health(client):
        while "t" not in killed:
            await asyncio.sleep(0.01)
        while True:
            r = await client.get("/health")
            if r.status_code == 200 and r.json().get("status") == "ok":
                return time.monotonic()
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        h = asyncio.create_task(health(client))
        await asyncio.gather(*(stream(client, i) for i in range(streams)))
        healthy = await h
    t_kill = killed["t"]
    per_stream = []
    for a in arrivals:
        before = [b - x for x, b in zip(a, a[1:]) if b <= t_kill]
        after = [(x, b - x) for x, b in zip(a, a[1:]) if b > t_kill]
        pause = max((g for _, g in after), default=0.0)
        per_stream.append(dict(median_gap_s=statistics.median(before) if before else None, pause_s=pause,
                               tokens=len(a)))
    dead = [s for s in per_stream if s["median_gap_s"] and s["pause_s"] > 5 * s["median_gap_s"]]
    live = [i for i, s in enumerate(per_stream) if s not in dead]
    outage_end = healthy

    def rate(indices, start, end):
        n = sum(1 for i in indices for t in arrivals[i] if start < t <= end)
        return n / (end - start) if end > start else None

    window = max(outage_end - t_kill, 1e-3)
    return dict(client_recovery_s=healthy - t_kill, dead_streams=len(dead), live_streams=len(live),
                dead_stream_pause_s=max((s["pause_s"] for s in dead), default=None),
                live_tok_s_during_outage=rate(live, t_kill, outage_end) if live else None,
                live_tok_s_before=rate(live, t_kill - window, t_kill) if live else None,
                streams=per_stream)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: the embedded SmolLM2)")
    ap.add_argument("--size", default=None, help="a random model of scripts/bench_tp.py's sizes, e.g. 1gb")
    ap.add_argument("--layout", choices=["dp2", "tp2"], default="dp2")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from bench_tp import bench_model  # noqa: E402 (scripts/bench_tp.py)
    from conftest import free_port  # noqa: E402 (tests/server/conftest.py)

    model = args.model or (bench_model(args.size, None) if args.size else None)
    port = free_port()
    layout = ["-dp", "2", "-tp", "1"] if args.layout == "dp2" else ["-tp", "2"]
    log = Path("results") / f"recovery_server_{port}.log"
    log.parent.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "server.cli", "serve", *([model] if model else []), *layout, "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "512", "--log-level", "info", "--max-rank-restarts",
           str(args.rounds + 1)]
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
            print(f"round {k + 1}: kill -> /health ok {r['client_recovery_s']:.2f} s; {r['dead_streams']} stream(s) "
                  f"of the dead replica paused {r['dead_stream_pause_s'] or 0:.2f} s; surviving replica "
                  f"{r['live_tok_s_before'] or 0:.1f} -> {r['live_tok_s_during_outage'] or 0:.1f} tok/s", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    server_s = [float(x) for x in re.findall(r"restarted in ([0-9.]+) s", log.read_text())]
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    name = Path(model).name if model else "SmolLM2-135M-Instruct"
    out = dict(model=name, layout=args.layout, cpu=cpu, streams=args.streams, tokens=args.tokens,
               server_restart_s=server_s, rounds=rounds,
               median_client_recovery_s=statistics.median(r["client_recovery_s"] for r in rounds))
    path = Path("results") / f"recovery_{name}_{args.layout}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"{name} {args.layout} on {cpu}: server restart {server_s} s; median kill -> ok "
          f"{out['median_client_recovery_s']:.2f} s; saved {path}")


if __name__ == "__main__":
    main()
