"""Grammar engines for structured outputs, side by side: xgrammar against llguidance.

For a realistic JSON schema (nested objects, arrays with bounds, enums, bounded numbers) and the model's tokenizer it
measures: building the tokenizer tables once, compiling the schema cold and again (cached), and the per-token cost
of computing the allowed-token bitmask while walking a valid answer token by token, at batch 1 and 32 (32 matchers
filling their rows of one bitmask each step), plus applying the bitmask to a [B, vocab] logits tensor.

    pip install xgrammar          # not a tpserve dependency (it pulls triton, ~1 GB): for this comparison only
    python scripts/bench_grammar.py [--model PATH] [--rounds 3] [--out results/bench_grammar.json]

Both engines must pass a correctness check first: the valid answer's tokens are all allowed and the matcher accepts
at the end. Results print as a table and are saved as JSON.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 40},
                "email": {"type": "string"},
                "tier": {"enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "gift": {"type": "boolean"},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["order_id", "customer", "items"],
    "additionalProperties": False,
}

ANSWER = {
    "order_id": "ABC-1234",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "pro"},
    "items": [{"sku": "X-1", "quantity": 2, "price": 9.5}, {"sku": "Y-22", "quantity": 1, "price": 120.0}],
    "gift": False,
    "notes": None,
}


def default_model() -> str:
    from loaders.default_model import ensure_default_model  # noqa: PLC0415

    return str(ensure_default_model())


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.setup_s = time.perf_counter() - t0
        self.version = importlib.metadata.version("xgrammar")

    def compile(self, schema: str, cached: bool):
        if not cached:
            self.compiler.clear_cache()
        return self.compiler.compile_json_schema(schema, any_whitespace=False)

    def matchers(self, compiled, n: int):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def allocate(self, n: int, vocab: int):
        return self.xgr.allocate_token_bitmask(n, vocab)

    def fill(self, matchers, bitmask):
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def accept(self, matchers, token: int) -> bool:
        return all(m.accept_token(token) for m in matchers)

    def done(self, m) -> bool:
        return m.is_terminated() or m.is_completed()

    def apply(self, logits, bitmask):
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        t0 = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.setup_s = time.perf_counter() - t0
        self.version = importlib.metadata.version("llguidance")

    def compile(self, schema: str, cached: bool):
        # llguidance has no ahead-of-time compile: building the matcher (which validates the grammar) is the cost;
        # its lexer and token tables are built lazily, so the first mask is measured as part of "compile"
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        m = self.llg.LLMatcher(self.tok, grammar)
        bm = self.llg.torch.allocate_token_bitmask(1, self.tok.vocab_size)
        self.llg.torch.fill_next_token_bitmask(m, bm, 0)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matchers(self, grammar, n: int):
        return [self.llg.LLMatcher(self.tok, grammar) for _ in range(n)]

    def allocate(self, n: int, vocab: int):
        return self.llg.torch.allocate_token_bitmask(n, vocab)

    def fill(self, matchers, bitmask):
        # one row after another, as tpserve does: llguidance's thread-pool executor (fill_next_token_bitmask_par)
        # cost more than it saved on a 2-core host
        for i, m in enumerate(matchers):
            self.llg.torch.fill_next_token_bitmask(m, bitmask, i)

    def accept(self, matchers, token: int) -> bool:
        return all(m.consume_token(token) for m in matchers)

    def done(self, m) -> bool:
        return m.is_accepting()

    def apply(self, logits, bitmask):
        self.llg.torch.apply_token_bitmask_inplace(logits, bitmask)


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((bitmask[row, token // 32].item() >> (token % 32)) & 1)


def walk(engine, compiled, tokens: list[int], batch: int, vocab: int, eos: int) -> float:
    """Seconds per token to fill `batch` rows of the bitmask, walking the answer; checks every token is allowed."""
    matchers = engine.matchers(compiled, batch)
    bitmask = engine.allocate(batch, vocab)
    fill_s = 0.0
    for t in tokens + [eos]:
        t0 = time.perf_counter()
        engine.fill(matchers, bitmask)
        fill_s += time.perf_counter() - t0
        if not allowed(bitmask, 0, t):
            raise AssertionError(f"{engine.name}: token {t} of the valid answer was masked")
        if t == eos:
            break
        if not engine.accept(matchers, t):
            raise AssertionError(f"{engine.name}: token {t} was rejected")
    return fill_s / (len(tokens) + 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="results/bench_grammar.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoConfig, AutoTokenizer

    path = args.model or default_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    schema = json.dumps(SCHEMA)
    tokens = tokenizer.encode(json.dumps(ANSWER, separators=(", ", ": ")), add_special_tokens=False)
    eos = tokenizer.eos_token_id
    engines = [XGrammar(tokenizer, vocab), LLGuidance(tokenizer, vocab)]
    results = {"cpu": platform.processor() or platform.machine(), "model": os.path.basename(path.rstrip("/")),
               "vocab": vocab, "answer_tokens": len(tokens), "engines": {}}
    rows = {e.name: {"setup_s": e.setup_s, "version": e.version, "compile_cold_s": [], "compile_cached_s": [],
                     "mask_b1_us": [], "mask_b32_us": [], "apply_b32_us": []} for e in engines}
    for _ in range(args.rounds):  # interleaved rounds
        for e in engines:
            r = rows[e.name]
            t0 = time.perf_counter()
            compiled = e.compile(schema, cached=False)
            r["compile_cold_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            compiled = e.compile(schema, cached=True)
            r["compile_cached_s"].append(time.perf_counter() - t0)
            r["mask_b1_us"].append(walk(e, compiled, tokens, 1, vocab, eos) * 1e6)
            r["mask_b32_us"].append(walk(e, compiled, tokens, 32, vocab, eos) * 1e6)
            logits = torch.randn(32, vocab)
            bm = e.allocate(32, vocab)
            e.fill(e.matchers(compiled, 32), bm)
            t0 = time.perf_counter()
            for _ in range(20):
                e.apply(logits, bm)
            r["apply_b32_us"].append((time.perf_counter() - t0) / 20 * 1e6)
    print(f"{'engine':12} {'setup s':>8} {'cold ms':>8} {'cached ms':>10} {'mask b1 us':>11} {'mask b32 us':>12} "
          f"{'apply b32 us':>13}")
    for name, r in rows.items():
        med = {k: statistics.median(v) for k, v in r.items() if isinstance(v, list)}
        print(f"{name:12} {r['setup_s']:8.2f} {med['compile_cold_s'] * 1e3:8.1f} {med['compile_cached_s'] * 1e3:10.2f} "
              f"{med['mask_b1_us']:11.1f} {med['mask_b32_us']:12.1f} {med['apply_b32_us']:13.1f}")
        results["engines"][name] = {**r, "median": med}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
