"""The newer endpoints against their references, in interleaved rounds on one machine (ratios from one run).

    python scripts/bench_api.py embeddings   # /v1/embeddings vs sentence-transformers' encode, same checkpoint
    python scripts/bench_api.py responses    # /v1/responses stream vs /v1/chat/completions stream, batch 1

embeddings: 32 concurrent requests of one 128-token input each against `tpserve serve` (float32, TP 1), then
sentence-transformers' `encode` of the same 32 texts (batch_size 32, the same torch threads) in this process; the
server idles while sentence-transformers runs and the other way round. Prints and saves tokens/s per round.
Needs `pip install sentence-transformers` (not a dependency of tpserve).

responses: one stream at a time, 128 output tokens (EOS ignored), alternating the two endpoints; tokens/s from the
first to the last token, and the time to the first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} vCPU)"
    except OSError:
        pass
    return platform.processor()


def start(model: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "server.cli.main", "serve", model, "--host", "127.0.0.1", "--port",
                             str(port), "--log-level", "warning", *extra], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server not ready")


def texts_of(tokenizer, n: int, tokens: int, salt: int = 0) -> list[str]:
    """n different texts of exactly `tokens` tokens each (words added until the count is reached); another `salt`
    gives other texts from the first token on, so a round never finds the previous round's in the prefix cache."""
    words = ("tensor parallel serving splits every weight matrix over ranks while the cache keeps keys and values "
             "of each sequence in blocks that the scheduler hands out and takes back when a request ends").split()
    out = []
    for i in range(n):
        text, k = f"{salt} Document {i}:", i + 3 * salt
        while len(tokenizer.encode(text, add_special_tokens=True)) < tokens:
            text += " " + words[k % len(words)]
            k += 7
        ids = tokenizer.encode(text, add_special_tokens=True)
        while len(ids) > tokens:
            text = text.rsplit(" ", 1)[0]
            ids = tokenizer.encode(text, add_special_tokens=True)
        out.append(text)
    return out


async def embed_round(url: str, texts: list[str]) -> tuple[float, int]:
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(client.post(url + "/v1/embeddings", json={"input": t, "encoding_format": "base64"})
                                    for t in texts))
        dt = time.perf_counter() - t0
    return dt, sum(r.json()["usage"]["prompt_tokens"] for r in rs)


def bench_embeddings(args) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    texts = texts_of(tok, args.inputs, args.tokens)  # the warm-up's; every round has its own
    st = SentenceTransformer(args.model, device="cpu")
    st.max_seq_length = args.tokens + 8
    proc, url = start(args.model, "--max-num-seqs", str(args.inputs), *args.server_args)
    rounds = []
    try:
        asyncio.run(embed_round(url, texts[:4]))  # warm up both
        st.encode(texts[:4], batch_size=4)
        for r in range(args.rounds):
            texts = texts_of(tok, args.inputs, args.tokens, salt=r + 1)
            dt, n = asyncio.run(embed_round(url, texts))
            t0 = time.perf_counter()
            st.encode(texts, batch_size=args.inputs)
            st_dt = time.perf_counter() - t0
            rounds.append({"tpserve_tok_s": n / dt, "st_tok_s": n / st_dt, "ratio": st_dt / dt, "tokens": n})
            print(f"round {r}: tpserve {n / dt:8.1f} tok/s   sentence-transformers {n / st_dt:8.1f} tok/s   "
                  f"ratio {st_dt / dt:.2f}", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    ratios = sorted(x["ratio"] for x in rounds)
    return {"bench": "embeddings", "cpu": cpu_name(), "model": args.model, "inputs": args.inputs,
            "tokens_per_input": args.tokens, "threads": args.threads, "server_args": args.server_args,
            "rounds": rounds, "median_ratio": ratios[len(ratios) // 2]}


def stream_once(url: str, endpoint: str, model: str, n: int) -> tuple[float, float, int]:
    """(seconds to the first token, tokens/s after it, tokens) of one streamed answer."""
    prompt = "Write a long story about a lighthouse keeper."
    if endpoint == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "max_tokens": n,
                                              "stream": True, "stream_options": {"include_usage": True}}
    else:
        path, body = "/v1/responses", {"input": prompt, "max_output_tokens": n, "stream": True}
    body.update(model=model, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    with httpx.stream("POST", url + path, json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            e = json.loads(line[6:])
            delta = (e.get("delta") if e.get("type") == "response.output_text.delta" else
                     (e["choices"][0]["delta"].get("content") if e.get("choices") else None))
            if delta:
                last = time.perf_counter()
                first = first or last
            usage = e.get("usage") or (e.get("response") or {}).get("usage")
            if usage:
                tokens = usage.get("completion_tokens") or usage.get("output_tokens") or tokens
    return first - t0, (tokens - 1) / (last - first), tokens


def bench_responses(args) -> dict:
    proc, url = start(args.model, *args.server_args)
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    rounds = []
    try:
        stream_once(url, "chat", model, 16)
        stream_once(url, "responses", model, 16)
        for r in range(args.rounds):
            order = ("chat", "responses") if r % 2 == 0 else ("responses", "chat")  # ABBA
            got = {name: stream_once(url, name, model, args.tokens) for name in order}
            rounds.append({name: {"ttft_s": v[0], "tok_s": v[1], "tokens": v[2]} for name, v in got.items()})
            print(f"round {r}: chat {got['chat'][1]:6.1f} tok/s  responses {got['responses'][1]:6.1f} tok/s  "
                  f"ratio {got['responses'][1] / got['chat'][1]:.3f}", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    ratios = sorted(x["responses"]["tok_s"] / x["chat"]["tok_s"] for x in rounds)
    return {"bench": "responses", "cpu": cpu_name(), "model": args.model, "tokens": args.tokens,
            "server_args": args.server_args, "rounds": rounds, "median_ratio": ratios[len(ratios) // 2]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("which", choices=["embeddings", "responses"])
    ap.add_argument("--model", help="checkpoint folder (default: the default model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inputs", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per input (embeddings) or per answer")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="passed to tpserve serve")
    ap.add_argument("--out", default=None, help="JSON file (default results/bench_<which>.json)")
    args = ap.parse_args(argv)
    if args.model is None:
        from loaders.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    result = (bench_embeddings if args.which == "embeddings" else bench_responses)(args)
    out = Path(args.out or ROOT / "results" / f"bench_{args.which}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"median ratio {result['median_ratio']:.3f} ({result['cpu']}); saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
