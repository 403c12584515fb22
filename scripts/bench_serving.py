"""Serving numbers in one run: `tpserve serve` (TP=1 by default) under scripts/loadtest.py at 1, 8 and 32 concurrent
requests (22-token prompts, 128 output tokens, EOS ignored), one JSON per level plus a summary.

    python scripts/bench_serving.py                              # default model, TP=1, all cores
    TPSERVE_THREADS=1 python scripts/bench_serving.py --tag t1   # leave a core to the load generator and HTTP
    python scripts/bench_serving.py --tp 2 --dtype bfloat16 --levels 1:4,8:16

Levels are CONCURRENCY:NUM_REQUESTS. The server, its ranks and the load generator share this machine's cores: the
foreign load (`uptime`) is printed with every level.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: the default model)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--levels", default="1:4,8:16,32:64")
    ap.add_argument("--input-len", type=int, default=22)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--tag", default="tp1")
    ap.add_argument("--outdir", default="results/serving")
    args = ap.parse_args(argv)
    from loaders.default_model import ensure_default_model

    model = args.model or str(ensure_default_model())
    port = free_port()
    tpserve = [sys.executable, "-m", "server.cli.main"]
    server = subprocess.Popen(tpserve + ["serve", model, "--port", str(port), "-tp", str(args.tp), "--dtype", args.dtype,
                                         "--host", "127.0.0.1", "--log-level", "warning"], cwd=ROOT)
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    summary = []
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("server did not start")
                time.sleep(0.5)
        for level in args.levels.split(","):
            conc, num = (int(x) for x in level.split(":"))
            before = load_avg()
            path = out / f"{args.tag}_c{conc}.json"
            subprocess.run([sys.executable, "scripts/loadtest.py", "--base-url", f"http://127.0.0.1:{port}",
                            "--concurrency", str(conc), "--num-requests", str(num), "--input-len", str(args.input_len),
                            "--output-len", str(args.output_len), "--tokenizer", model, "--output", str(path),
                            "--no-plot", "--no-progress"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            data = json.loads(path.read_text())
            level_s = (data.get("levels") or data.get("results") or [data])[0]
            row = dict(tag=args.tag, tp=args.tp, dtype=args.dtype, threads=os.environ.get("TPSERVE_THREADS", "auto"),
                       concurrency=conc, requests=num, output_tok_s=level_s.get("output_throughput"),
                       ttft_p50_ms=(level_s.get("ttft_ms") or {}).get("p50"),
                       itl_p50_ms=(level_s.get("itl_ms") or {}).get("p50"), load_before=before, load_after=load_avg())
            summary.append(row)
            print(f"{args.tag}: c={conc:>2}: {row['output_tok_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms, "
                  f"ITL p50 {row['itl_p50_ms']:.1f} ms  (load before {before}, after {row['load_after']})", flush=True)
    finally:
        server.terminate()
        server.wait(60)
    (out / f"{args.tag}_summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
