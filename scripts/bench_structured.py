"""Structured outputs, measured on a served model: decode speed with a JSON schema against unconstrained, and the
grammar compile time as a client sees it (a new schema's first request against the same schema again).

    python scripts/bench_structured.py                      # default model, c = 1 and 8, 3 interleaved rounds
    python scripts/bench_structured.py --levels 1:4,8:16,32:64 --rounds 2
    python scripts/bench_structured.py --offline            # the same through the offline LLM (batch = c)

Both kinds of request stream 128 tokens: the free one ignores EOS, the constrained one answers a schema that needs
more than 128 tokens (an array of 40 short strings), so both end by max_tokens. In each round the same server
runs the free load then the constrained one at every level. Decode speed is output tokens / wall time of the level;
ITL is the gap between streamed chunks. Compile latency: TTFT of a request with a schema never seen before (cold:
llguidance builds its matcher) against the same request again (cached), both alone. Writes
results/structured.json. Nothing asserts on timings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_paged import Server, cpu_model, load_avg, load_stats, print_table, run_load  # noqa: E402

LONG_SCHEMA = {"type": "object", "properties": {"words": {
    "type": "array", "minItems": 40, "maxItems": 40, "items": {"type": "string", "minLength": 3, "maxLength": 12}}},
    "required": ["words"], "additionalProperties": False}
TOPICS = ("the sea", "mountains", "cities", "music", "trees", "food", "sports", "space")


def bodies(model: str, n: int, output_len: int, constrained: bool) -> list[dict]:
    out = []
    for i in range(n):
        body = {"model": model, "temperature": 0, "max_tokens": output_len,
                "messages": [{"role": "user", "content": f"List words about {TOPICS[i % len(TOPICS)]} as JSON."}]}
        if constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "words", "schema": LONG_SCHEMA}}
        else:
            body["ignore_eos"] = True
        out.append(body)
    return out


def compile_latency(url: str, model: str, k: int) -> dict:
    """TTFT of a schema never seen before, then of the same request again (the compiled grammar is cached)."""
    cold, warm = [], []
    for i in range(k):
        schema = {"type": "object", "properties": {f"field_{i}_{j}": {"type": "integer"} for j in range(6)},
                  "required": [f"field_{i}_0"], "additionalProperties": False}
        body = {"model": model, "temperature": 0, "max_tokens": 1,
                "messages": [{"role": "user", "content": "Give me JSON."}],
                "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}}
        for times in (cold, warm):
            results, _, _ = asyncio.run(run_load(url, [body], 1, 120))
            times.append(results[0]["ttft"])
    return {"cold_ttft_ms": round(statistics.median(cold) * 1000, 1),
            "cached_ttft_ms": round(statistics.median(warm) * 1000, 1)}


def offline(model: str, levels: list[tuple[int, int]], output_len: int, rounds: int) -> dict:
    """The same comparison through the offline LLM (no HTTP, no load generator): the engine's own cost."""
    from server.llm import LLM
    from server.engine.sampler import SamplingParams

    out: dict[str, list[float]] = {}
    with LLM(model) as llm:
        def prompts(n):
            return [list(llm.tokenizer.apply_chat_template(b["messages"], add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)) for b in bodies("", n, 1, False)]

        free = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        cons = SamplingParams(max_tokens=output_len, temperature=0)
        llm.generate(prompts(1), cons, json_schema=LONG_SCHEMA)  # warm-up
        for r in range(rounds):
            for conc, _ in levels:
                for kind in ("free", "json"):
                    t0 = time.perf_counter()
                    done = llm.generate(prompts(conc), free if kind == "free" else cons,
                                        **({"json_schema": LONG_SCHEMA} if kind == "json" else {}))
                    tok_s = sum(len(c.token_ids) for c in done) / (time.perf_counter() - t0)
                    out.setdefault(f"{kind}@{conc}", []).append(round(tok_s, 2))
                    print(f"offline round {r + 1} batch {conc} {kind:4}: {tok_s:.1f} tok/s")
    summary = {}
    for conc, _ in levels:
        per_round = [j / f for f, j in zip(out[f"free@{conc}"], out[f"json@{conc}"])]
        summary[conc] = {"ratio": round(statistics.median(per_round), 3),
                         "ratio_per_round": [round(x, 3) for x in per_round]}
        print(f"offline batch {conc}: json/free {summary[conc]['ratio']} (per round {summary[conc]['ratio_per_round']})")
    return {"runs": out, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: the default model)")
    ap.add_argument("--levels", default="1:4,8:16", help="CONCURRENCY:NUM_REQUESTS,...")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flags", default="", help="more `tpserve serve` flags, one quoted string")
    ap.add_argument("--offline", action="store_true", help="measure through the offline LLM instead of a server")
    ap.add_argument("--out", default="results/structured.json")
    args = ap.parse_args(argv)
    from loaders.default_model import ensure_default_model

    model = args.model or str(ensure_default_model())
    levels = [tuple(int(x) for x in lv.split(":")) for lv in args.levels.split(",")]
    runs: dict[str, list[dict]] = {}
    cpu = cpu_model()
    print(f"CPU: {cpu}; load {load_avg()}")
    if args.offline:
        result = offline(model, levels, args.output_len, args.rounds)
        out = Path(args.out.replace(".json", "_offline.json"))
        out.write_text(json.dumps({"cpu": cpu, "levels": levels, **result}, indent=2))
        print(f"saved {out}")
        return 0
    with Server(model, args.flags.split(), ROOT / "results" / "logs" / "structured.log") as srv:
        name = json.loads(asyncio.run(asyncio.to_thread(
            lambda: __import__("urllib.request").request.urlopen(srv.url + "/v1/models").read())))["data"][0]["id"]
        asyncio.run(run_load(srv.url, bodies(name, 1, 8, True), 1, 120))  # warm-up (and the tokenizer tables)
        for r in range(args.rounds):
            for conc, n in levels:
                for kind in ("free", "json"):
                    results, wall, _ = asyncio.run(run_load(srv.url, bodies(name, n, args.output_len, kind == "json"),
                                                            conc, 600))
                    stats = load_stats(results, wall)
                    runs.setdefault(f"{kind}@{conc}", []).append(stats)
                    print(f"round {r + 1} c={conc} {kind:4}: {stats['output_tok_s']} tok/s, ITL p50 "
                          f"{stats['itl_ms'].get('p50') if stats['itl_ms'] else None} ms, failed {stats['failed']}; "
                          f"load {load_avg()}")
        compile_stats = compile_latency(srv.url, name, 5)
    rows, summary = [], {}
    for conc, _ in levels:
        free = statistics.median(s["output_tok_s"] for s in runs[f"free@{conc}"])
        cons = statistics.median(s["output_tok_s"] for s in runs[f"json@{conc}"])
        itl_f = statistics.median(s["itl_ms"]["p50"] for s in runs[f"free@{conc}"])
        itl_c = statistics.median(s["itl_ms"]["p50"] for s in runs[f"json@{conc}"])
        # the host drifts between rounds: the ratio is taken within each round (free and json back to back)
        per_round = [j["output_tok_s"] / f["output_tok_s"] for f, j in zip(runs[f"free@{conc}"], runs[f"json@{conc}"])]
        summary[conc] = {"free_tok_s": free, "json_tok_s": cons, "ratio_per_round": [round(x, 3) for x in per_round],
                         "ratio": round(statistics.median(per_round), 3), "free_itl_p50_ms": itl_f,
                         "json_itl_p50_ms": itl_c}
        rows.append([conc, free, cons, f"{statistics.median(per_round):.3f} ({', '.join(f'{x:.2f}' for x in per_round)})",
                     itl_f, itl_c])
    print_table(f"Decode with a JSON schema vs unconstrained ({cpu}, medians of {args.rounds} rounds)",
                ["concurrency", "free tok/s", "json tok/s", "json/free (per round)", "free ITL p50 ms",
                 "json ITL p50 ms"], rows)
    print(f"\ncompile as a client sees it (TTFT, 1 output token): new schema {compile_stats['cold_ttft_ms']} ms, "
          f"same schema again {compile_stats['cached_ttft_ms']} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu, "model": os.path.basename(model.rstrip("/")), "levels": levels,
                               "summary": summary, "compile": compile_stats, "runs": runs,
                               "time": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
