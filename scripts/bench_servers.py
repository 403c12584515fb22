"""tpserve against llama.cpp's own OpenAI-compatible server, both driven by scripts/loadtest.py, interleaved.

    python scripts/bench_servers.py                          # levels 1:4,8:16; 3 rounds
    python scripts/bench_servers.py --levels 1:6 --rounds 5

Both servers run at once on this machine, idle between runs: tpserve (TP=1, the default SmolLM2 checkpoint) and
llama-cpp-python's `llama_cpp.server` on an F32 GGUF holding the same weights (written by bench_baseline.f32_gguf),
with as many threads as tpserve. Each round runs every level against each server in turn, so a drift of the host's
memory bandwidth hits both alike. Prompts, lengths, client and machine are identical; llama.cpp's server has no
`ignore_eos`, so its end-of-text tokens are banned through `logit_bias` to hold the output length. llama.cpp's
server runs one request at a time (no batching; `--interrupt_requests False`, or a new request would cut the running
one short), so at 8 concurrent requests it queues them.

Needs the benchmark extras in the venv (not dependencies of tpserve):
`.venv/bin/pip install llama-cpp-python==0.3.36 diskcache jinja2 sse-starlette starlette-context pydantic-settings`.
Writes results/servers.json (every run and the medians) and prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_serving import free_port, load_avg  # noqa: E402


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server behind {url} did not start (exit code {proc.poll()})") from None
            time.sleep(0.5)


def run_level(name: str, port: int, conc: int, num: int, args, tokenizer: str, extra: dict | None,
              round_: int) -> dict:
    path = Path(args.outdir) / f"servers_{name}_c{conc}_r{round_}.json"
    cmd = [sys.executable, "scripts/loadtest.py", "--base-url", f"http://127.0.0.1:{port}", "--concurrency", str(conc),
           "--num-requests", str(num), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--tokenizer", tokenizer, "--output", str(path), "--no-plot", "--no-progress"]
    if extra:
        cmd += ["--extra-body", json.dumps(extra)]
    before = load_avg()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    level = json.loads(path.read_text())["levels"][0]
    row = dict(server=name, round=round_, concurrency=conc, requests=num, ok=level.get("completed"),
               failed=level.get("failed"), output_tok_s=level.get("output_throughput"),
               mean_output_tokens=level.get("mean_output_tokens"), ttft_p50_ms=level["ttft_ms"]["p50"],
               itl_p50_ms=level["itl_ms"]["p50"], tpot_p50_ms=level["tpot_ms"]["p50"], load_before=before)
    print(f"[round {round_}] {name:9s} c={conc:>2}: {row['ok']}/{num} ok, {row['output_tok_s']:6.1f} tok/s, TTFT p50 "
          f"{row['ttft_p50_ms']:4.0f} ms, ITL p50 {row['itl_p50_ms']:5.1f} ms, "
          f"{row['mean_output_tokens']:.1f} tokens/request  (load {before})", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="1:4,8:16", help="CONCURRENCY:NUM_REQUESTS,...")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=22)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="both servers' threads")
    ap.add_argument("--gguf", default="results/SmolLM2-135M-Instruct-F32.gguf")
    ap.add_argument("--outdir", default="results/serving")
    ap.add_argument("--output", default="results/servers.json")
    args = ap.parse_args(argv)
    import importlib.util

    missing = [m for m in ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings")
               if importlib.util.find_spec(m) is None]
    if missing:
        print(f"bench_servers needs llama.cpp's server in this venv (missing: {', '.join(missing)}): pip install "
              "llama-cpp-python==0.3.36 diskcache jinja2 sse-starlette starlette-context pydantic-settings",
              file=sys.stderr)
        return 2
    from bench_baseline import f32_gguf

    from loaders.default_model import ensure_default_model

    model = str(ensure_default_model())
    gguf = f32_gguf(Path(args.gguf))
    Path(args.outdir).mkdir(parents=True, exist_ok=True)
    levels = [tuple(int(x) for x in level.split(":")) for level in args.levels.split(",")]
    # SmolLM2's end-of-text tokens (<|endoftext|>, <|im_end|>): banned on llama.cpp, which has no ignore_eos
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    eos_ids = sorted({i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")) if i is not None})
    no_eos = {"logit_bias": {str(i): -100 for i in eos_ids}}

    tp_port, ll_port = free_port(), free_port()
    env = dict(os.environ, TPSERVE_THREADS=str(args.threads))
    procs = {
        "tpserve": subprocess.Popen([sys.executable, "-m", "server.cli", "serve", model, "--host", "127.0.0.1",
                                     "--port", str(tp_port), "--log-level", "warning"], cwd=ROOT, env=env),
        "llama.cpp": subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads",
                                       str(args.threads), "--n_threads_batch", str(args.threads), "--n_ctx", "2048",
                                       "--interrupt_requests", "False",  # else a new request cuts the running one
                                       "--host", "127.0.0.1", "--port", str(ll_port)], cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    }
    servers = [("tpserve", tp_port, None), ("llama.cpp", ll_port, no_eos)]
    rows = []
    try:
        wait_ready(f"http://127.0.0.1:{tp_port}/health", procs["tpserve"])
        wait_ready(f"http://127.0.0.1:{ll_port}/v1/models", procs["llama.cpp"])
        for r in range(args.rounds):
            for conc, num in levels:
                for name, port, extra in (servers if r % 2 == 0 else servers[::-1]):
                    rows.append(run_level(name, port, conc, num, args, model, extra, r))
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    summary = []
    print("\nmedians over rounds:")
    for conc, _ in levels:
        med = {}
        for name, _, _ in servers:
            runs = [x for x in rows if x["server"] == name and x["concurrency"] == conc]
            med[name] = {k: statistics.median(x[k] for x in runs)
                         for k in ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "mean_output_tokens")}
            summary.append(dict(server=name, concurrency=conc, rounds=len(runs), **med[name]))
            m = med[name]
            print(f"  {name:9s} c={conc:>2}: {m['output_tok_s']:6.1f} tok/s, TTFT p50 {m['ttft_p50_ms']:4.0f} ms, "
                  f"ITL p50 {m['itl_p50_ms']:5.1f} ms")
        ratio = med["tpserve"]["output_tok_s"] / med["llama.cpp"]["output_tok_s"]
        print(f"  c={conc}: tpserve / llama.cpp server = {ratio:.2f}x")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(dict(threads=args.threads, input_len=args.input_len,
                                                 output_len=args.output_len, runs=rows, summary=summary), indent=1))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
