"""tpserve against llama.cpp's own servers, all driven by scripts/loadtest.py, interleaved.

    scripts/build_llama_cpp.sh                               # once: llama-server (no binary downloads here)
    python scripts/bench_servers.py                          # levels 1:4,8:16,32:32; 2 rounds; float32
    python scripts/bench_servers.py --precision int8         # tpserve --quantization int8 against Q8_0
    python scripts/bench_servers.py --levels 1:6 --rounds 5
    python scripts/bench_servers.py --same-file model-Q4_K_M.gguf --levels 8:16   # one GGUF file served by both
    python scripts/bench_servers.py --same-file model-Q4_K_M.gguf --start --rounds 3   # launch to first token, RSS
    python scripts/bench_servers.py --same-file model-Q8_0.gguf --answers   # greedy chat answers, word for word

The servers run at once on this machine, idle between runs, with the same threads:
- tpserve: TP=1, the default SmolLM2 checkpoint (--dtype bfloat16 / --quantization bf16|int8|int4 for the other
  precisions).
- llama-server: llama.cpp's C++ server, as its users run it: `--parallel N` slots (N = the highest concurrency, or
  --llama-parallel) with continuous batching, on a GGUF holding the same weights (the F32 one from
  bench_baseline.f32_gguf, or its F16 / Q8_0 / Q4_0 made by llama-quantize).
- llama-cpp-python's `llama_cpp.server`, when it is installed in the venv (a second row, not a dependency:
  `pip install llama-cpp-python==0.3.36 diskcache jinja2 sse-starlette starlette-context pydantic-settings`). It runs
  one request at a time (`--interrupt_requests False`, or a new request cuts the running one short).

Each round runs every level against each server in turn (the order alternates), so a drift of the host's memory
bandwidth hits all alike. Prompts, lengths, client and machine are identical; llama.cpp's servers have no
`ignore_eos` in the OpenAI API, so their end-of-text tokens are banned through `logit_bias` to hold the output
length (the mean output tokens are printed to check). Writes results/servers[_PRECISION].json and prints the ratios.
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


def tree_rss(pid: int) -> int:
    """Resident bytes of process `pid` and its descendants (tpserve's ranks), from /proc."""
    return sum(tree_rss_parts(pid).values())


def tree_rss_parts(pid: int) -> dict[int, int]:
    """Resident bytes of process `pid` and of each of its descendants, by pid."""
    parts, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                parts[p] = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{p}/task"):  # children of every thread (the ranks' launcher's too)
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration):
            pass
    return parts


def first_token(port: int, extra: dict | None, deadline: float) -> None:
    """One streamed completion of one token: returns when its first content chunk arrives."""
    body = dict(prompt="Hello", max_tokens=1, stream=True, temperature=0, **(extra or {}))
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    while True:
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                for line in r:
                    if line.startswith(b"data: {"):
                        return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def measure_starts(commands: dict, rounds: int, env: dict) -> list[dict]:
    """Each server alone, `rounds` times, interleaved: seconds from its launch to its first streamed token, and its
    resident memory (with its ranks) then."""
    rows = []
    for r in range(rounds):
        for name, (cmd, port, extra) in (commands.items() if r % 2 == 0 else list(commands.items())[::-1]):
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                first_token(port, extra, t0 + 600)
                parts = tree_rss_parts(proc.pid)
                row = dict(server=name, round=r, start_to_first_token_s=time.monotonic() - t0,
                           rss_bytes=sum(parts.values()), rss_by_process=sorted(parts.values(), reverse=True))
            finally:
                stop_servers({name: proc})
            rows.append(row)
            print(f"[round {r}] {name:22s} start to first token {row['start_to_first_token_s']:6.1f} s, RSS "
                  f"{row['rss_bytes'] / 2**30:.2f} GiB (by process: "
                  + ", ".join(f"{b / 2**30:.2f}" for b in row["rss_by_process"]) + ")", flush=True)
    return rows


QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "How many legs does a spider have?",
             "Explain what a prime number is in one sentence.", "Give me three tips for sleeping better.",
             "What is 17 times 23?", "Translate 'good morning' into Spanish.", "Who wrote Romeo and Juliet?",
             "Name the planets of the solar system.", "What does a CPU do?", "Write a Python function that reverses "
             "a string.", "Why is the sky blue?"]


def chat_answer(port: int, question: str, max_tokens: int, logprobs: bool = False) -> tuple[str, list]:
    """The greedy answer, and (logprobs) each token's text with its two most likely alternatives' log-probabilities."""
    body = dict(messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0)
    if logprobs:
        body.update(logprobs=True, top_logprobs=2)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        choice = json.loads(r.read())["choices"][0]
    tokens = [(t["token"], [x["logprob"] for x in t["top_logprobs"]]) for t in
              (choice.get("logprobs") or {}).get("content") or []]
    return choice["message"]["content"], tokens


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def margin_at(tokens: list, chars: int) -> float | None:
    """The top-1 minus top-2 log-probability of the token holding character `chars` of the answer."""
    seen = 0
    for text, top in tokens:
        seen += len(text)
        if seen > chars:
            return top[0] - top[1] if len(top) > 1 else None
    return None


def compare_answers(commands: dict, env: dict, max_tokens: int) -> dict:
    """Each server alone: greedy chat answers to QUESTIONS (the chat template each takes from the file); which are
    equal word for word, and where the others part."""
    answers = {}
    for name, (cmd, port, _extra, health) in commands.items():
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_ready(f"http://127.0.0.1:{port}{health}", proc)
            answers[name] = [chat_answer(port, q, max_tokens, logprobs=True) for q in QUESTIONS]
        finally:
            stop_servers({name: proc})
    (a, theirs), (b, ours) = list(answers.items())[1], list(answers.items())[0]
    rows = []
    for q, (x, tokens), (y, their_tokens) in zip(QUESTIONS, ours, theirs):
        same = x == y
        part = next((i for i, (c, d) in enumerate(zip(x, y)) if c != d), min(len(x), len(y)))
        # how close each engine's own choice was at the first token where they part (by the tokens both return;
        # by the first differing character if llama-server gave none): a near tie flips on rounding alone
        margin = theirs_margin = None
        if not same and their_tokens:
            k = next((i for i, (t, u) in enumerate(zip(tokens, their_tokens)) if t[0] != u[0]), None)
            if k is not None:
                margin = tokens[k][1][0] - tokens[k][1][1] if len(tokens[k][1]) > 1 else None
                top = their_tokens[k][1]
                theirs_margin = top[0] - top[1] if len(top) > 1 else None
        elif not same:
            margin = margin_at(tokens, part)
        rows.append(dict(question=q, equal=same, tpserve=x, llama=y, common_chars=part, tpserve_margin=margin,
                         llama_margin=theirs_margin))
        print(f"{'EQUAL ' if same else 'DIFFER'} {q!r}" + ("" if same else f" (first {part} characters equal; top-2 "
              f"log-probability margin at the first differing token: tpserve {fmt(margin)}, {a} {fmt(theirs_margin)})"
              f"\n    {b}: {x!r}\n    {a}: {y!r}"), flush=True)
    equal = sum(r["equal"] for r in rows)
    margins = sorted(r["tpserve_margin"] for r in rows if r["tpserve_margin"] is not None)
    theirs_m = sorted(r["llama_margin"] for r in rows if r["llama_margin"] is not None)
    print(f"\n{equal} of {len(rows)} greedy answers equal ({max_tokens} tokens at most); top-2 margins where they "
          f"part: tpserve {', '.join(f'{m:.3f}' for m in margins)}; {a} {', '.join(f'{m:.3f}' for m in theirs_m)}")
    return dict(equal=equal, questions=len(rows), max_tokens=max_tokens, rows=rows, margins=margins,
                llama_margins=theirs_m)


def stop_servers(procs: dict) -> None:
    """SIGTERM every server, then wait up to a minute for each (SIGKILL what is left)."""
    for p in procs.values():
        p.terminate()
    for p in procs.values():
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


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


PRECISIONS = {"float32": ([], "F32"), "bfloat16": (["--dtype", "bfloat16"], "F16"),
              "bf16": (["--quantization", "bf16"], "F16"), "int8": (["--quantization", "int8"], "Q8_0"),
              "int4": (["--quantization", "int4"], "Q4_0")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="1:4,8:16,32:32", help="CONCURRENCY:NUM_REQUESTS,...")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--precision", default="float32", choices=list(PRECISIONS))
    ap.add_argument("--input-len", type=int, default=22)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="every server's threads")
    ap.add_argument("--llama-parallel", type=int, default=None, help="llama-server slots (default: highest level)")
    ap.add_argument("--gguf", default="results/SmolLM2-135M-Instruct-F32.gguf",
                    help="llama.cpp's F32 GGUF of the same weights (quantized from it), or a template of ready files, "
                         "e.g. /data/moe-{kind}.gguf")
    ap.add_argument("--model", help="tpserve's checkpoint folder (default: the default model)")
    ap.add_argument("--same-file", default=None,
                    help="a GGUF file both servers serve as it is (tpserve's block-type kernels; --precision ignored)")
    ap.add_argument("--tpserve-args", default="", help="more `tpserve serve` flags, e.g. '-tp 2 --kv-cache-memory 2GiB'")
    ap.add_argument("--start", action="store_true",
                    help="instead: each server alone, --rounds times: launch to first streamed token, and RSS then")
    ap.add_argument("--answers", action="store_true",
                    help="instead: each server alone, greedy chat answers to a dozen questions, compared word for word")
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--outdir", default="results/serving")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    import importlib.util

    from bench_baseline import f32_gguf
    from bench_quant import llama_gguf
    from bench_quant_accuracy import builds, llama_bin

    from loaders.default_model import ensure_default_model

    if not llama_bin("llama-server").exists():
        print("bench_servers needs llama-server: run scripts/build_llama_cpp.sh first", file=sys.stderr)
        return 2
    model = args.model or str(ensure_default_model())
    tp_args, kind = PRECISIONS[args.precision]
    tp_args = tp_args + args.tpserve_args.split()
    if args.same_file:
        from loaders.gguf_file import find_gguf, load_tokenizer, tokenizer_cache

        gguf = Path(args.same_file)
        load_tokenizer(gguf)  # converted once into its cache folder, which the load generator reads
        model, tp_args, kind = str(gguf), args.tpserve_args.split(), gguf.name
        tokenizer = str(tokenizer_cache(find_gguf(gguf)))
    else:
        gguf = (Path(args.gguf.format(kind=kind)) if "{kind}" in args.gguf
                else llama_gguf(f32_gguf(Path(args.gguf)), kind, args.threads))
        tokenizer = model
    Path(args.outdir).mkdir(parents=True, exist_ok=True)
    levels = [tuple(int(x) for x in level.split(":")) for level in args.levels.split(",")]
    slots = args.llama_parallel or max(c for c, _ in levels)
    # SmolLM2's end-of-text tokens (<|endoftext|>, <|im_end|>): banned on llama.cpp, which has no ignore_eos
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    eos_ids = sorted({i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")) if i is not None})
    no_eos = {"logit_bias": {str(i): -100 for i in eos_ids}}

    ports = {}
    env = dict(os.environ, TPSERVE_THREADS=str(args.threads))
    procs, servers = {}, []
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    commands = {}  # name -> (argv, port, extra body, health path)
    port = free_port()
    commands["tpserve"] = ([sys.executable, "-m", "server.cli.main", "serve", model, *tp_args, "--host", "127.0.0.1",
                            "--port", str(port), "--log-level", "warning"], port, None, "/health")
    name = f"llama-server -np {slots}"
    port = free_port()
    per_slot = args.input_len + args.output_len + 64
    commands[name] = ([str(llama_bin("llama-server")), "-m", str(gguf), "-t", str(args.threads), "-tb",
                       str(args.threads), "-np", str(slots), "-cb", "-c", str(slots * per_slot), "--host", "127.0.0.1",
                       "--port", str(port)], port, no_eos, "/health")
    if all(importlib.util.find_spec(m) for m in ("llama_cpp", "sse_starlette", "starlette_context",
                                                 "pydantic_settings")):
        name = "llama-cpp-python"
        port = free_port()
        commands[name] = ([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads",
                           str(args.threads), "--n_threads_batch", str(args.threads), "--n_ctx", "2048",
                           "--interrupt_requests", "False", "--host", "127.0.0.1", "--port", str(port)], port, no_eos,
                          "/v1/models")
    else:
        print("llama-cpp-python's server not installed: its row is skipped", flush=True)
    if args.answers:
        llama = [n for n in commands if n.startswith("llama-server")][0]
        llama_cmd = commands[llama][0] + ["--jinja"]  # the file's chat template through llama.cpp's Jinja engine
        result = compare_answers({"tpserve": commands["tpserve"], llama: (llama_cmd, *commands[llama][1:])}, env,
                                 args.answer_tokens)
        out = Path(args.output or "results/servers_answers.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(**builds(), gguf=str(gguf), model=model, **result), indent=1))
        print(f"wrote {out}")
        return 0
    if args.start:
        rows = measure_starts({n: c[:3] for n, c in commands.items()}, args.rounds, env)
        summary = [dict(server=name, start_to_first_token_s=statistics.median(
            x["start_to_first_token_s"] for x in rows if x["server"] == name), rss_bytes=statistics.median(
            x["rss_bytes"] for x in rows if x["server"] == name)) for name in commands]
        for x in summary:
            print(f"  {x['server']:22s} start to first token {x['start_to_first_token_s']:6.1f} s, RSS "
                  f"{x['rss_bytes'] / 2**30:.2f} GiB (medians)")
        out = Path(args.output or "results/servers_start.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(**builds(), gguf=str(gguf), model=model, threads=args.threads, runs=rows,
                                       summary=summary), indent=1))
        print(f"wrote {out}")
        return 0
    for name, (cmd, port, extra, health) in commands.items():
        ports[name] = port
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env if name == "tpserve" else None,
                                       **({} if name == "tpserve" else quiet))
        servers.append((name, health, extra))
    rows = []
    try:
        for name, health, _ in servers:
            wait_ready(f"http://127.0.0.1:{ports[name]}{health}", procs[name])
        for r in range(args.rounds):
            for conc, num in levels:
                for name, _, extra in (servers if r % 2 == 0 else servers[::-1]):
                    rows.append(run_level(name, ports[name], conc, num, args, tokenizer, extra, r))
    finally:
        stop_servers(procs)
    summary = []
    print(f"\nmedians over rounds ({args.precision}; llama.cpp on {kind}):")
    for conc, _ in levels:
        med = {}
        for name, _, _ in servers:
            runs = [x for x in rows if x["server"] == name and x["concurrency"] == conc]
            med[name] = {k: statistics.median(x[k] for x in runs)
                         for k in ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "mean_output_tokens")}
            ratios = {}
            if name != "tpserve":  # per round: tpserve / this server
                ratios = {"tpserve_ratio": statistics.median(
                    t["output_tok_s"] / x["output_tok_s"] for t, x in
                    zip(sorted((y for y in rows if y["server"] == "tpserve" and y["concurrency"] == conc),
                               key=lambda y: y["round"]), sorted(runs, key=lambda y: y["round"])))}
            summary.append(dict(server=name, concurrency=conc, rounds=len(runs), **med[name], **ratios))
            m = med[name]
            print(f"  {name:22s} c={conc:>2}: {m['output_tok_s']:6.1f} tok/s, TTFT p50 {m['ttft_p50_ms']:5.0f} ms, "
                  f"ITL p50 {m['itl_p50_ms']:5.1f} ms, {m['mean_output_tokens']:.0f} tokens/request"
                  + (f"  | tpserve / this = {ratios['tpserve_ratio']:.2f}x" if ratios else ""))
    out = Path(args.output or ("results/servers_same_file.json" if args.same_file
                               else "results/servers.json" if args.precision == "float32"
                               else f"results/servers_{args.precision}.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(**builds(), precision=args.precision, gguf=kind, threads=args.threads,
                                   llama_slots=slots, input_len=args.input_len, output_len=args.output_len, runs=rows,
                                   summary=summary), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
