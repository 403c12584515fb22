"""Grammar-constrained decoding on rank 0, on llguidance.

A `Constraint` (server/engine/structured/constraint.py) compiles to a llguidance grammar once: off the engine thread and off the
event loop, in a worker thread of its own (llguidance drops the GIL while it builds a matcher), under a time limit,
and cached by its text. Its size and nesting were bounded before (server/api/protocol.py, MAX_SPEC_CHARS,
MAX_JSON_DEPTH, MAX_PATTERN_DEPTH); what llguidance still refuses is a 400 with its reason (the first lines of it:
its messages can carry a Rust backtrace and the whole grammar). A compiled grammar is also probed before it is
cached: a lexer that explodes (a regex like a{1000}{1000}) builds fine and fails only on its first token, so the
probe computes the first mask and consumes one allowed token, and such a grammar is refused here rather than cut
short in the engine. Each constrained sequence then gets its own `GrammarState`, a copy of the compiled matcher
in its start state, which advances with every token the sequence samples.

Each step, the engine asks the constrained rows for their allowed-token bitmasks (one bit per token of the model's
vocabulary, padded past the tokenizer's), and the sampler adds -1e30 to every forbidden logit of those rows only:
unconstrained rows pay nothing. Why llguidance and not xgrammar: BENCHMARKS.md, "Structured outputs".
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from server.api.protocol import APIError

logger = logging.getLogger(__name__)

MASKED = -1e30  # added to a forbidden token's logit: exp() of it underflows to 0 at any temperature
DEFAULT_COMPILE_TIMEOUT_S = 10.0
CACHE_ENTRIES = 512
MAX_ERROR_CHARS = 600  # of llguidance's message, in the 400


def short_error(message: str) -> str:
    """llguidance's message without its backtrace, parser state or grammar dump, and at most MAX_ERROR_CHARS long."""
    for cut in ("<backtrace>", "<state>", "<grammar>"):
        message = message.split(cut, 1)[0]
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + "..."


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request constrains its output to. `kind`: json (a JSON schema, `spec` its canonical text),
    regex, choice (a JSON list of strings), grammar (Lark or GBNF/EBNF text), or lark (tpserve's own grammars,
    e.g. tool calls). `options`: the JSON compile options as canonical JSON (whitespace, separators)."""

    kind: str
    spec: str
    options: str = ""
    param: str = "response_format"  # the request field it came from, for error messages

    @property
    def key(self) -> tuple[str, str, str]:
        return self.kind, self.spec, self.options


class GrammarState:
    """One sequence's matcher: which tokens may come next, and advancing over the one that came."""

    __slots__ = ("matcher",)

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        return self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (not even whitespace): the answer is whole."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class Grammars:
    """Compiles constraints for one tokenizer, caches them, and builds the per-step bitmasks."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids=(), compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S):
        self.hf_tokenizer = tokenizer
        # the model's vocabulary, padded past the tokenizer's (or the tokenizer's, if it is the larger)
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.eos_ids = sorted(eos_ids)
        self.compile_timeout = compile_timeout
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tpserve-grammar")
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self._llg = None
        self._tokenizer = None
        self._bias: torch.Tensor | None = None  # the engine thread's buffer for the logit bias

    # ---- compiling (worker thread) ---------------------------------------------------------------------------
    def _setup(self) -> None:
        """The tokenizer tables (~0.5 s for a 49k vocabulary): built on first use, in the worker thread."""
        if self._tokenizer is None:
            import llguidance
            import llguidance.hf

            self._llg = llguidance
            self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=self.eos_ids or None)

    def _grammar_text(self, c: Constraint) -> str:
        llg = self._llg
        if c.kind == "json":
            options = json.loads(c.options) if c.options else None
            return llg.LLMatcher.grammar_from_json_schema(c.spec, defaults=options)
        if c.kind == "regex":
            return llg.grammar_from("regex", c.spec)
        if c.kind == "choice":
            return llg.grammar_from("choice", c.spec)
        if c.kind == "grammar":
            return llg.grammar_from("grammar", c.spec)
        if c.kind == "lark":
            return llg.grammar_from("lark", c.spec)
        raise AssertionError(f"unknown constraint kind {c.kind}")

    def _compile(self, c: Constraint):
        self._setup()
        try:
            text = self._grammar_text(c)
        except Exception as e:  # noqa: BLE001 - the converters (GBNF to Lark, ...) raise plain exceptions on bad input
            raise APIError(400, f"cannot compile {c.param}: {short_error(str(e))}", param=c.param) from None
        matcher = self._llg.LLMatcher(self._tokenizer, text, log_level=0)
        if matcher.is_error():
            raise APIError(400, f"cannot compile {c.param}: {short_error(matcher.get_error())}", param=c.param)
        self._probe(matcher, c)
        return matcher

    def _probe(self, matcher, c: Constraint) -> None:
        """Compute the first mask of a copy of `matcher` and consume its first allowed token that is not EOS, then
        compute the next mask: a grammar whose lexer gives up on either is refused with llguidance's reason."""
        probe = matcher.deep_copy()
        mask = probe.compute_bitmask()
        if not probe.is_error():
            bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[: self.vocab_size]
            allowed = [t for t in np.flatnonzero(bits)[: len(self.eos_ids) + 1].tolist() if t not in self.eos_ids]
            if allowed and probe.consume_token(allowed[0]) and not probe.is_stopped():
                probe.compute_bitmask()
        if probe.is_error():
            reason = short_error(probe.get_error())
            if reason == "NoExtensionBias":  # e.g. a schema that is only a $ref to itself
                reason = "it admits no output at all (llguidance: NoExtensionBias)"
            raise APIError(400, f"cannot compile {c.param}: {reason}", param=c.param, code="grammar_too_complex")

    # ---- the request side (event loop) -------------------------------------------------------------------------
    async def compile(self, c: Constraint):
        """The compiled matcher (in its start state) for `c`: from the cache, or compiled in the worker thread.
        A compile that outlasts the time limit is refused (it finishes in the background and is cached)."""
        with self._lock:
            hit = self._cache.get(c.key)
            if hit is not None:
                self._cache.move_to_end(c.key)
                return hit
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self._compile_and_cache, c)
        # a compile that outlives its request may still fail: its error is read here, not logged as unretrieved
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.compile_timeout)
        except asyncio.TimeoutError:
            raise APIError(400, f"{c.param} took longer than {self.compile_timeout:g} s to compile; simplify it",
                           param=c.param, code="grammar_too_complex") from None

    def _compile_and_cache(self, c: Constraint):
        with self._lock:
            hit = self._cache.get(c.key)
        if hit is not None:
            return hit
        matcher = self._compile(c)
        with self._lock:
            self._cache[c.key] = matcher
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return matcher

    @staticmethod
    def state(compiled) -> GrammarState:
        return GrammarState(compiled.deep_copy())

    def compile_sync(self, c: Constraint) -> GrammarState:
        """Compile in the caller's thread (the offline LLM path) and return a fresh state; a ValueError if the
        constraint does not compile."""
        try:
            return self.state(self._compile_and_cache(c))
        except APIError as e:
            raise ValueError(e.message) from None

    # ---- the engine side (engine thread) -----------------------------------------------------------------------
    def mask_logits(self, logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
        """Add MASKED to every logit that rows[i]'s grammar forbids, in place.

        The matchers fill one int32 bitmask row each (a few us per row; llguidance's thread-pool executor costs more
        than it saves at these batch sizes on a 2-core host), numpy unpacks the bits, and the bias goes through a
        buffer kept between steps: a fresh [rows, vocab] float tensor per step paid more in page faults than in
        arithmetic (BENCHMARKS.md, "Structured outputs")."""
        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty(len(rows), words, dtype=torch.int32)
        base, stride = bitmask.data_ptr(), words * 4
        for i, st in enumerate(states):
            st.matcher.unsafe_compute_mask_ptr(base + i * stride, stride)
        vocab = min(logits.shape[-1], words * 32)
        bits = torch.from_numpy(np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, count=vocab,
                                              bitorder="little"))
        if self._bias is None or self._bias.shape[0] < len(rows) or self._bias.shape[1] != vocab \
                or self._bias.dtype != logits.dtype:
            self._bias = torch.empty(max(len(rows), 8), vocab, dtype=logits.dtype)
        bias = self._bias[: len(rows)]
        bias.copy_(bits).sub_(1).mul_(-MASKED)  # 0 where allowed, MASKED elsewhere
        if logits.shape[-1] > vocab:  # logits wider than the bitmask: the extra ids are never allowed
            logits[rows, vocab:] = MASKED
        if len(rows) == logits.shape[0]:
            logits[:, :vocab].add_(bias)
        else:
            for i, r in enumerate(rows):
                logits[r, :vocab].add_(bias[i])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
