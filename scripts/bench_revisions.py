"""Two git revisions of tpserve served side by side, measured in interleaved rounds: did a change cost speed?

    python scripts/bench_revisions.py --before HEAD~3 --after HEAD            # SmolLM2 float32, TP=1, 6 rounds
    python scripts/bench_revisions.py --before main --after HEAD --rounds 10 -- -q int4

Each revision is checked out into a temporary git worktree and served from there by this venv's python (its own
sources first on PYTHONPATH; a revision older than the server/cli/ package is started through server.cli:main). Both
servers are up at once and each idles while the other is measured, so a drift of the host's speed between rounds
hits both alike. Each round runs scripts/loadtest.py at concurrency 1 (4 requests) and 8 (16 requests), 22 prompt
tokens, 128 output tokens, the order of the two revisions alternating from round to round. Prints the after/before
ratio per round and the median, and writes results/revisions.json. Arguments after `--` go to both servers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEVELS = (("1", 4), ("8", 16))


def entry(tree: Path) -> str:
    if (tree / "server" / "cli" / "main.py").exists():
        return "from server.cli.main import main; main()"
    return "from server.cli import main; main()"


def wait_health(port: int, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server on port {port} exited with {proc.returncode}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the server on port {port} did not become healthy in {timeout:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="a git revision")
    ap.add_argument("--after", default="HEAD", help="a git revision (default HEAD)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--port", type=int, default=18700)
    ap.add_argument("--output", default=str(ROOT / "results" / "revisions.json"))
    ap.add_argument("server_args", nargs="*", help="after --: arguments for both servers")
    args = ap.parse_args()
    results: dict = {"before": args.before, "after": args.after, "server_args": args.server_args,
                     "rounds": {"before": {c: [] for c, _ in LEVELS}, "after": {c: [] for c, _ in LEVELS}}}
    procs: dict[str, subprocess.Popen] = {}
    with tempfile.TemporaryDirectory(prefix="tpserve-revisions-") as tmp:
        trees = {}
        for i, name in enumerate(("before", "after")):
            tree = Path(tmp) / name
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree),
                            getattr(args, name)], check=True)
            trees[name] = (tree, args.port + 10 * i)
        try:
            for name, (tree, port) in trees.items():
                procs[name] = subprocess.Popen(
                    [sys.executable, "-c", entry(tree), "serve", "--host", "127.0.0.1", "--port", str(port),
                     "--max-num-seqs", "8", *args.server_args],
                    cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)), stdout=subprocess.DEVNULL,
                    stderr=open(Path(tmp) / f"{name}.log", "w"))
            for name, (_, port) in trees.items():
                wait_health(port, procs[name])
            for r in range(args.rounds):
                order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
                for conc, n in LEVELS:
                    for name in order:
                        out = Path(tmp) / f"{name}-{conc}.json"
                        subprocess.run([sys.executable, str(ROOT / "scripts" / "loadtest.py"), "--base-url",
                                        f"http://127.0.0.1:{trees[name][1]}", "--concurrency", conc,
                                        "--num-requests", str(n), "--input-len", "22", "--output-len", "128",
                                        "--output", str(out), "--no-plot", "--no-progress"],
                                       check=True, stdout=subprocess.DEVNULL)
                        tps = json.loads(out.read_text())["levels"][0]["output_throughput"]
                        results["rounds"][name][conc].append(tps)
                print(f"round {r + 1}: " + ", ".join(
                    f"{c} stream(s) before {results['rounds']['before'][c][-1]:.1f} after "
                    f"{results['rounds']['after'][c][-1]:.1f} tok/s" for c, _ in LEVELS), flush=True)
        finally:
            for p in procs.values():
                p.terminate()
                p.wait(60)
            for tree, _ in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    for conc, _ in LEVELS:
        ratios = [a / b for a, b in zip(results["rounds"]["after"][conc], results["rounds"]["before"][conc])]
        results[f"ratio_{conc}"] = {"per_round": [round(x, 3) for x in ratios],
                                    "median": round(statistics.median(ratios), 3)}
        print(f"{conc} stream(s): after/before {results[f'ratio_{conc}']['per_round']}, "
              f"median {results[f'ratio_{conc}']['median']}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
