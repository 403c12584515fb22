"""What reading reasoning and tool calls out of a streamed answer costs per token, against a batch-1 decode step.

Each family's parser (server/api/parsers/) is fed a representative answer -- reasoning, a sentence, two tool calls in
the family's markup -- one detokenized piece at a time, the pieces being the default model's (SmolLM2-135M) tokens of
that text, as the API hands them to the parser; the cost per piece is the median of --rounds. The batch-1 step is the
default model's decode step in float32, measured in the same run with the offline LLM (one rank, 128 tokens greedy).
Prints a table and writes results/parsers.json.

    python scripts/bench_parsers.py [--rounds 20] [--no-step]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

REASONING = "The user wants the weather in Paris and the time there. I will call both tools, then answer briefly."
ANSWER = "Let me look both up."
ARGS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})]


def texts() -> dict[str, tuple[str | None, str, str]]:
    """family -> (reasoning parser, tool parser, the answer's text in its markup)"""
    def js(a):
        return json.dumps(a)

    hermes = "".join(f'\n<tool_call>\n{{"name": "{n}", "arguments": {js(a)}}}\n</tool_call>' for n, a in ARGS)
    coder = "".join(f"\n<tool_call>\n<function={n}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n"
                                                                 for k, v in a.items()) + "</function>\n</tool_call>"
                    for n, a in ARGS)
    return {
        "qwen3 + hermes": ("qwen3", "hermes", f"<think>\n{REASONING}\n</think>\n\n{ANSWER}{hermes}"),
        "llama3_json": (None, "llama3_json", "; ".join(f'{{"name": "{n}", "parameters": {js(a)}}}' for n, a in ARGS)),
        "mistral": (None, "mistral", ANSWER + "".join(f"[TOOL_CALLS]{n}[ARGS]{js(a)}" for n, a in ARGS)),
        "pythonic": (None, "pythonic", "[" + ", ".join(
            f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in ARGS) + "]"),
        "qwen3_coder": (None, "qwen3_coder", ANSWER + coder),
        "deepseek_r1 + deepseek_v3": ("deepseek_r1", "deepseek_v3", f"{REASONING}\n</think>\n\n{ANSWER}"
                                      "<｜tool▁calls▁begin｜>" + "".join(
                                          f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{js(a)}\n```"
                                          "<｜tool▁call▁end｜>" for n, a in ARGS) + "<｜tool▁calls▁end｜>"),
        "gpt_oss + openai": ("gpt_oss", "openai", f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant"
                             f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                             f"{js(ARGS[0][1])}"),
    }


def pieces(tokenizer, text: str) -> list[str]:
    """The text as the detokenizer hands it out: one piece per token, empty while a character is incomplete."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    out, sent = [], 0
    for i in range(1, len(ids) + 1):
        cur = tokenizer.decode(ids[:i])
        if cur.endswith("\ufffd"):  # (the rest of the character comes with a later token)
            out.append("")
            continue
        out.append(cur[sent:])
        sent = len(cur)
    assert "".join(out) == text
    return out


def per_token_us(reasoning: str | None, tool: str, chunks: list[str], rounds: int) -> tuple[float, dict]:
    from server.api.parsers import ParserConfig

    cfg = ParserConfig(reasoning, tool)
    start = "maybe" if reasoning == "qwen3" else "reasoning" if reasoning else None
    times, out = [], None
    for _ in range(rounds):
        parser = cfg.parser(cfg.tool_cls, start)
        t0 = time.perf_counter()
        got = parser.feed("")
        for c in chunks:
            got.add(parser.feed(c))
        got.add(parser.finish())
        times.append((time.perf_counter() - t0) / len(chunks))
        out = got
    return statistics.median(times) * 1e6, {"reasoning": len(out.reasoning), "content": out.content,
                                            "calls": [c["function"]["name"] for c in out.calls]}


def step_ms() -> float:
    from server.engine.sampler import SamplingParams
    from server.llm import LLM

    llm = LLM(None, 1, max_num_seqs=1)
    try:
        params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
        llm.generate([[1, 2, 3]], params)  # warm
        t0 = time.perf_counter()
        llm.generate([[1, 2, 3, 4]], params)
        return (time.perf_counter() - t0) / 128 * 1e3
    finally:
        llm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--no-step", action="store_true", help="skip the decode step measurement")
    ap.add_argument("--output", default="results/parsers.json")
    args = ap.parse_args()
    from loaders.default_model import ensure_default_model
    from server.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(str(ensure_default_model()))
    step = None if args.no_step else step_ms()
    rows = []
    for family, (reasoning, tool, text) in texts().items():
        chunks = pieces(tok, text)
        us, parsed = per_token_us(reasoning, tool, chunks, args.rounds)
        rows.append({"family": family, "tokens": len(chunks), "us_per_token": round(us, 2),
                     "share_of_step": None if step is None else round(us / (step * 1e3), 5), "parsed": parsed})
    cpu = platform.processor() or platform.machine()
    print(f"batch-1 decode step (SmolLM2-135M float32, 1 rank): {step:.2f} ms" if step else "(no step measured)")
    print(f"{'family':28} {'tokens':>6} {'us/token':>9} {'of a step':>10}  parsed")
    for r in rows:
        share = f"{r['share_of_step'] * 100:.3f} %" if r["share_of_step"] is not None else "-"
        print(f"{r['family']:28} {r['tokens']:6} {r['us_per_token']:9.2f} {share:>10}  {r['parsed']['calls']}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu, "step_ms": step, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
