"""Speculative decoding on rank 0: the configuration, the proposers, and how many tokens each sequence proposes.

A proposer guesses the next k tokens of a sequence from text it has already seen; the engine verifies them in the
sequence's next step (server/engine/core.py) and keeps the longest prefix the target model agrees with, plus the target's
own next token, so the output is exactly what decoding without speculation gives (greedy), or has exactly its
distribution (sampling: rejection sampling with the proposal's probability 1, Leviathan et al.).

- `ngram` (prompt lookup): the longest suffix of the sequence (prompt and output, `prompt_lookup_max` down to
  `prompt_lookup_min` tokens) that occurred earlier in it; the proposal is what followed. Ties between earlier
  occurrences of the same n-gram go to the most recent one (text being rewritten is usually copied from close by).
- `suffix`: the same lookup, then, when the sequence itself has no match, a suffix trie over earlier requests'
  outputs (bounded by `suffix_max_tokens`): the longest suffix of the context found in the trie, followed along its
  most frequent continuations (suffix decoding: repeated agentic and code outputs).
- `draft_model`: a smaller checkpoint with the same tokenizer decodes k tokens greedily on rank 0 alone
  (`draft_tensor_parallel_size` 1), from a paged pool of its own (server/engine/spec_decode/draft_model.py).

How many: k starts at `num_speculative_tokens` and follows each sequence's recent acceptance (an exponential average
of accepted / proposed): a sequence whose proposals keep failing proposes fewer tokens and then none for a while
(probing again later), so low-overlap text pays almost nothing. The running sequences also share a step's cheap
rows (Speculator.STEP_ROWS): with 4 running, one draft each; with 8, none. Above `disable_by_batch_size` running sequences, no
sequence proposes: a wide batch is already compute-bound on a CPU, and verification rows would only add work.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

METHODS = ("ngram", "suffix", "draft_model")


@dataclass(slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = 8
    suffix_max_tokens: int = 1 << 20  # tokens of earlier outputs the suffix trie indexes (oldest dropped first)
    suffix_max_depth: int = 24  # longest context the trie matches
    model: str | None = None  # draft_model: the draft checkpoint
    draft_tensor_parallel_size: int | None = None

    def describe(self) -> str:
        what = {"ngram": f"n-gram lookup of {self.prompt_lookup_min}-{self.prompt_lookup_max} tokens",
                "suffix": f"suffix trie over earlier outputs ({self.suffix_max_tokens} tokens) and n-gram lookup",
                "draft_model": f"draft model {self.model} on rank 0"}[self.method]
        cap = f", off above {self.disable_by_batch_size} running" if self.disable_by_batch_size else ""
        return f"speculative decoding: {what}, up to {self.num_speculative_tokens} tokens, adaptive{cap}"


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """--speculative-config JSON (vLLM's keys), or a ValueError that says what is wrong."""
    if text is None or not text.strip():
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("--speculative-config must be a JSON object, e.g. "
                         '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"--speculative-config: unknown key(s) {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(known))})")
    method = raw.get("method")
    if method not in METHODS:
        raise ValueError(f"--speculative-config: method must be one of {', '.join(METHODS)} (got {method!r})")
    cfg = SpeculativeConfig(**raw)
    for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "suffix_max_tokens",
                 "suffix_max_depth"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"--speculative-config: {name} must be a positive integer (got {v!r})")
    if cfg.num_speculative_tokens > 16:
        raise ValueError("--speculative-config: num_speculative_tokens is at most 16")
    if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
        raise ValueError("--speculative-config: prompt_lookup_min must not exceed prompt_lookup_max")
    d = cfg.disable_by_batch_size
    if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
        raise ValueError(f"--speculative-config: disable_by_batch_size must be a positive integer (got {d!r})")
    if method == "draft_model":
        if not isinstance(cfg.model, str) or not os.path.isdir(cfg.model):
            raise ValueError("--speculative-config: draft_model needs \"model\", the folder of a smaller checkpoint "
                             f"with the served model's tokenizer (got {cfg.model!r})")
        if cfg.draft_tensor_parallel_size not in (None, 1):
            raise ValueError("--speculative-config: draft_tensor_parallel_size 1 is what this server runs (the draft "
                             f"decodes on rank 0 alone); got {cfg.draft_tensor_parallel_size!r}")
    elif cfg.model is not None or cfg.draft_tensor_parallel_size is not None:
        raise ValueError(f"--speculative-config: model and draft_tensor_parallel_size apply to draft_model, not "
                         f"{method}")
    return cfg


class NgramIndex:
    """Prompt lookup over one sequence's tokens: for every n in [lo, hi], where each n-gram last started."""

    __slots__ = ("lo", "hi", "tokens", "last", "_registered")

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.tokens: list[int] = []
        self.last: list[dict[tuple, int]] = [{} for _ in range(hi + 1)]
        self._registered = 0  # n-grams ending before this index are in `last`

    def extend(self, tokens: list[int]) -> None:
        """The sequence's tokens so far (a longer list than last time; only the new ones are read)."""
        self.tokens = tokens

    def _register(self, end: int) -> None:
        """Index the n-grams that end right before position `end`, i.e. tokens[end - n : end]."""
        t = self.tokens
        for n in range(self.lo, self.hi + 1):
            if end >= n:
                self.last[n][tuple(t[end - n : end])] = end - n

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        t, length = self.tokens, len(self.tokens)
        while self._registered < length - 1:  # every n-gram that ends before the last token
            self._registered += 1
            self._register(self._registered)
        for n in range(min(self.hi, length - 1), self.lo - 1, -1):
            start = self.last[n].get(tuple(t[length - n :]))
            if start is not None:
                return t[start + n : start + n + k]
        return []


class SuffixTrie:
    """Earlier requests' outputs as a trie of their suffixes (each at most `depth` tokens deep), with counts: the
    context's longest suffix found in it, continued along the most frequent children. Bounded: past `max_tokens`
    indexed tokens, the oldest outputs are taken out again (their counts decremented)."""

    def __init__(self, max_tokens: int, depth: int):
        self.max_tokens, self.depth = max_tokens, depth
        self.root: dict = {}  # token -> [count, children]
        self.outputs: list[list[int]] = []
        self.size = 0

    def _walk(self, tokens: list[int], delta: int) -> None:
        for i in range(len(tokens)):
            node = self.root
            for tok in tokens[i : i + self.depth]:
                entry = node.get(tok)
                if entry is None:
                    if delta < 0:
                        break
                    entry = node[tok] = [0, {}]
                entry[0] += delta
                if entry[0] <= 0:
                    del node[tok]
                    break
                node = entry[1]

    def add(self, tokens: list[int]) -> None:
        if not tokens or len(tokens) > self.max_tokens:
            return
        self._walk(tokens, 1)
        self.outputs.append(list(tokens))
        self.size += len(tokens)
        while self.size > self.max_tokens:
            old = self.outputs.pop(0)
            self._walk(old, -1)
            self.size -= len(old)

    def propose(self, context: list[int], k: int, min_match: int) -> list[int]:
        for n in range(min(self.depth - 1, len(context)), min_match - 1, -1):
            node = self.root
            for tok in context[len(context) - n :]:
                entry = node.get(tok)
                if entry is None:
                    node = None
                    break
                node = entry[1]
            if node:  # matched, and something followed
                out = []
                while node and len(out) < k:
                    tok, entry = max(node.items(), key=lambda kv: kv[1][0])
                    out.append(tok)
                    node = entry[1]
                return out
        return []


@dataclass(slots=True)
class SpecState:
    """One sequence's speculation: its lookup index, and its recent acceptance."""

    index: NgramIndex
    acceptance: float = 1.0  # exponential average of accepted / proposed
    cooldown: int = 0  # steps left without proposals after acceptance fell too low
    proposed: int = 0
    accepted: int = 0
    draft_row: int = -1  # draft_model: its row of the draft's block table
    draft_computed: int = 0  # tokens whose K/V are in the draft's cache
    draft_base: int = 0  # the sequence's length when the draft last proposed


class Speculator:
    """Proposals for the engine, one sequence at a time, and what their verification said."""

    # Rows a step takes at about the cost of one: the running sequences share what is left (1 running may propose
    # up to 7, 2 up to 3 each, 4 one each, 8 none). Measured (BENCHMARKS.md section 15): at 8 running, one draft
    # each (16 rows) made SmolLM2 0.87x in float32 and 0.90x in int4 at 55-70 % acceptance, while one stream
    # gained 1.2-1.4x on the same chat: a CPU step of 8 rows is already compute-bound for a small model.
    STEP_ROWS = 8
    ALPHA = 0.3  # weight of the latest verification in the acceptance average
    OFF_BELOW = 0.15  # acceptance below which a sequence stops proposing for COOLDOWN steps
    COOLDOWN = 16

    def __init__(self, cfg: SpeculativeConfig, draft=None):
        self.cfg = cfg
        self.trie = SuffixTrie(cfg.suffix_max_tokens, cfg.suffix_max_depth) if cfg.method == "suffix" else None
        self.draft = draft  # draft_model: server/engine/spec_decode/draft_model.py DraftModel
        # what verification found (server/api/metrics.py exports these as vLLM's spec_decode counters)
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * cfg.num_speculative_tokens

    def drafts_for(self, seq, running: int, budget: int, max_model_len: int) -> list[int]:
        """Draft tokens for a decoding sequence (the scheduler asks, with the step's token budget left): never more
        than max_tokens or the context leaves, and for a constrained sequence only the drafts its grammar allows."""
        if seq.pooling is not None or seq.finished:
            return []
        room = min(seq.params.max_tokens - len(seq.output_ids), max_model_len - len(seq.token_ids), budget + 1) - 1
        drafts = self.propose(seq, running, room)
        if drafts and seq.grammar is not None:
            if seq.grammar.gate is not None:  # (no drafts until the grammar applies: see GrammarState)
                return []
            m = seq.grammar.matcher
            n = m.try_consume_tokens(drafts)
            m.rollback(n)
            drafts = drafts[:n]
        return drafts

    def state(self, seq) -> SpecState:
        st = seq.spec
        if st is None:
            st = seq.spec = SpecState(NgramIndex(self.cfg.prompt_lookup_min, self.cfg.prompt_lookup_max))
        return st

    def budget(self, st: SpecState) -> int:
        """Tokens this sequence may propose now: num_speculative_tokens scaled by its acceptance."""
        if st.cooldown > 0:
            st.cooldown -= 1
            return 0
        return max(1, round(self.cfg.num_speculative_tokens * min(1.0, st.acceptance * 1.25)))

    def propose(self, seq, running: int, room: int) -> list[int]:
        """Draft tokens for `seq` (possibly none): at most `room` (what max_tokens and the context leave)."""
        cfg = self.cfg
        if room <= 0 or (cfg.disable_by_batch_size is not None and running > cfg.disable_by_batch_size):
            return []
        st = self.state(seq)
        k = min(self.budget(st), room, (self.STEP_ROWS - running) // max(running, 1))
        if k <= 0:
            return []
        if self.draft is not None:
            return self.draft.propose(seq, st, k)
        st.index.extend(seq.token_ids)
        drafts = st.index.propose(k)
        if not drafts and self.trie is not None:
            drafts = self.trie.propose(seq.token_ids, k, cfg.prompt_lookup_min)
        return drafts

    def verified(self, seq, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_position[j] += 1
        st = self.state(seq)
        st.proposed += proposed
        st.accepted += accepted
        st.acceptance = (1 - self.ALPHA) * st.acceptance + self.ALPHA * (accepted / proposed)
        if self.draft is not None:
            self.draft.verified(st, proposed, accepted)
        if st.acceptance < self.OFF_BELOW:
            st.cooldown, st.acceptance = self.COOLDOWN, self.OFF_BELOW * 2  # probe again after the cooldown

    def finished(self, seq) -> None:
        if self.trie is not None and seq.output_ids:
            self.trie.add(seq.output_ids)
        self.release(seq)

    def release(self, seq) -> None:
        """The sequence is done (finished or aborted): what the draft holds for it goes back."""
        if self.draft is not None and seq.spec is not None:
            self.draft.release(seq, seq.spec)
