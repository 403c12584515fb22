"""Grammar-constrained decoding on rank 0, on llguidance.

A `Constraint` (server/engine/structured/constraint.py) compiles to a llguidance grammar once: off the engine thread and off the
event loop, in a small pool of compile threads (llguidance drops the GIL while it builds a matcher), under a time
limit, and cached by its text. The pool is shared by every client, so it is scheduled for them (`Grammars.compile`):
each owner (API key) has a bound on its unfinished compiles, owners take turns, one owner never holds every thread,
and a request's time limit counts from its compile's start, not from its place in the queue. A constraint's size and
nesting were bounded before (server/api/protocol.py, MAX_SPEC_CHARS, MAX_JSON_DEPTH, MAX_PATTERN_DEPTH); what
llguidance still refuses is a 400 with its reason (the first lines of it: its messages can carry a Rust backtrace
and the whole grammar). A compiled grammar is also probed before it is cached: a lexer that explodes (a regex like
a{1000}{1000}) builds fine and fails only on its first token, so the probe computes the first mask and consumes one
allowed token, and such a grammar is refused here rather than cut short in the engine. Each constrained sequence
then gets its own `GrammarState`, a copy of the compiled matcher in its start state, which advances with every token
the sequence samples.

Each step, the engine asks the constrained rows for their allowed-token bitmasks (one bit per token of the model's
vocabulary, padded past the tokenizer's), and the sampler adds -1e30 to every forbidden logit of those rows only:
unconstrained rows pay nothing. Why llguidance and not xgrammar: BENCHMARKS.md, "Structured outputs".
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from server.api.protocol import APIError
from server.defaults import DEFAULT_COMPILE_WORKERS  # (in a light module: the CLI shows it)

logger = logging.getLogger(__name__)

MASKED = -1e30  # added to a forbidden token's logit: exp() of it underflows to 0 at any temperature
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_COMPILES_PER_OWNER = 32  # one owner's compiles not yet finished (queued, running, or running on after a timeout)
MAX_QUEUED_COMPILES = 128  # all owners' compiles waiting for a thread, past which only an owner's first is queued
GONE_POLL_S = 0.5  # how often a queued compile asks whether its client is still there
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
    e.g. tool calls). `options`: the JSON compile options as canonical JSON (whitespace, separators). `checks`:
    calls that validate what the constraint came from (a schema against its metaschema: slow in Python, ~0.3 s for
    a 70 KB schema), run in the compile on a compile thread, once per text (not on a cache hit), not on the event
    loop; not part of the key (a schema and its closed form are valid or not together)."""

    kind: str
    spec: str
    options: str = ""
    param: str = "response_format"  # the request field it came from, for error messages
    checks: tuple = field(default=(), compare=False, repr=False)

    @property
    def key(self) -> tuple[str, str, str]:
        return self.kind, self.spec, self.options


class GrammarState:
    """One sequence's matcher: which tokens may come next, and advancing over the one that came.

    With a reasoning model the constraint holds only for what follows the reasoning (as vLLM does): a `Gate` keeps
    the matcher waiting, unconstrained, until the sequence's output ends with the reasoning's end marker (token ids),
    and from the next token on the grammar applies. A gate in the "maybe" phase (the model may open its reasoning
    or answer at once) lets the first token be either the opening marker or what the grammar allows."""

    __slots__ = ("matcher", "gate")

    def __init__(self, matcher, gate: "Gate | None" = None) -> None:
        self.matcher = matcher
        self.gate = gate

    @property
    def active(self) -> bool:
        """The grammar applies to the next token (no gate, or its reasoning has ended)."""
        return self.gate is None or self.gate.phase == "maybe"

    def accept(self, token: int) -> bool:
        gate = self.gate
        if gate is not None:
            if gate.phase == "maybe":
                if token == gate.start:
                    gate.phase = "reasoning"
                    return True
                self.gate = None
            else:
                gate.seen.append(token)
                end = gate.end
                if len(gate.seen) >= len(end) and tuple(gate.seen[-len(end):]) == end:
                    self.gate = None
                elif len(gate.seen) > 4 * len(end):
                    del gate.seen[: -len(end)]
                return True
        return self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (not even whitespace): the answer is whole."""
        return self.gate is None and self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


@dataclass(slots=True)
class Gate:
    """Where a constrained sequence's grammar begins: after `end` (token ids) in its output. phase "reasoning": the
    output is inside the reasoning; "maybe": its first token may be `start` (which opens the reasoning) or the
    grammar's."""

    end: tuple[int, ...]
    phase: str = "reasoning"
    start: int | None = None
    seen: list[int] = field(default_factory=list)


class _Job:
    """One compile in the pool: queued, then running on a thread, then finished (or dropped while still queued, once
    every request waiting for it has gone). `started` holds the monotonic time a thread took it; `done`, the matcher
    or the error. Both futures are marked running at once, so no waiter's cancellation can cancel them."""

    __slots__ = ("constraint", "done", "owner", "started", "state", "waiters")

    def __init__(self, c: Constraint, owner: str | None):
        self.constraint, self.owner = c, owner
        self.waiters = 1
        self.state = "queued"
        self.started: Future = Future()
        self.done: Future = Future()
        self.started.set_running_or_notify_cancel()
        self.done.set_running_or_notify_cancel()


class Grammars:
    """Compiles constraints for one tokenizer, caches them, and builds the per-step bitmasks."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids=(), compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S,
                 workers: int = DEFAULT_COMPILE_WORKERS, per_owner: int = DEFAULT_COMPILES_PER_OWNER,
                 max_queued: int = MAX_QUEUED_COMPILES):
        self.hf_tokenizer = tokenizer
        # the model's vocabulary, padded past the tokenizer's (or the tokenizer's, if it is the larger)
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.eos_ids = sorted(eos_ids)
        self.compile_timeout = compile_timeout
        self.workers = workers  # (read when the first compile starts the threads: --grammar-compile-workers)
        self.per_owner = per_owner  # --grammar-compile-queue
        self.max_queued = max_queued
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()  # the cache and the scheduler below
        self._wake = threading.Condition(self._lock)
        self._queues: OrderedDict[str | None, deque[_Job]] = OrderedDict()  # owner -> its queued jobs, in turn order
        self._running: dict[str | None, int] = {}  # owner -> its jobs on a thread (timed out or not)
        self._inflight: dict[tuple, _Job] = {}  # constraint key -> its queued or running job
        self._queued = 0
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._setup_lock = threading.Lock()
        self._llg = None
        self._tokenizer = None
        self._bias: torch.Tensor | None = None  # the engine thread's buffer for the logit bias
        self._unusable: str | None = None  # why llguidance could not load the tokenizer, once it failed

    # ---- compiling (worker thread) ---------------------------------------------------------------------------
    def _setup(self) -> None:
        """The tokenizer tables (~0.5 s for a 49k vocabulary): built on first use, in a compile thread."""
        with self._setup_lock:
            if self._unusable is not None:
                raise APIError(400, self._unusable, param="response_format", code="grammar_unavailable")
            if self._tokenizer is None:
                import llguidance
                import llguidance.hf

                self._llg = llguidance
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                                   eos_token=self.eos_ids or None)
                except BaseException as e:  # noqa: BLE001 - a Rust panic is a BaseException (pyo3's PanicException)
                    if isinstance(e, (KeyboardInterrupt, SystemExit)):
                        raise
                    logger.error("llguidance cannot load this model's tokenizer: %s", e)
                    self._unusable = ("structured outputs and forced tool calls are unavailable on this server: the "
                                      f"grammar engine cannot load the model's tokenizer ({short_error(str(e))})")
                    raise APIError(400, self._unusable, param="response_format", code="grammar_unavailable") from None

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
        for check in c.checks:  # e.g. a schema against its metaschema (raises APIError 400)
            check()
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

    # ---- the compile threads and their queue ---------------------------------------------------------------------
    def _owner_limit(self) -> int:
        """How many threads one owner's jobs may hold at once: all but one (so another owner's compile, however small,
        finds a thread after at most one compile of its own turn), or the only one."""
        return max(1, self.workers - 1)

    def _next_job(self) -> _Job | None:
        """The next job to run (under the lock): owners take turns, one job each, skipping those at their limit."""
        limit = self._owner_limit()
        for owner, queue in self._queues.items():
            if self._running.get(owner, 0) < limit:
                job = queue.popleft()
                if queue:
                    self._queues.move_to_end(owner)  # its next job waits for the others' turns
                else:
                    del self._queues[owner]
                self._queued -= 1
                return job
        return None

    def _work(self) -> None:
        while True:
            with self._wake:
                job = self._next_job()
                while job is None:
                    if self._closed:
                        return
                    self._wake.wait()
                    job = self._next_job()
                job.state = "running"
                self._running[job.owner] = self._running.get(job.owner, 0) + 1
            job.started.set_result(time.monotonic())
            result = error = None
            try:
                result = self._compile_and_cache(job.constraint)
            except BaseException as e:  # noqa: BLE001 - an APIError (400) or a crash: the waiters get it
                error = e
            with self._wake:  # a compile whose requests timed out counted against its owner until here
                job.state = "finished"
                if self._running[job.owner] == 1:
                    del self._running[job.owner]
                else:
                    self._running[job.owner] -= 1
                if self._inflight.get(job.constraint.key) is job:
                    del self._inflight[job.constraint.key]
                self._wake.notify_all()  # (an owner below its limit again may have a job waiting)
            if error is None:  # (after the accounting: a waiter that sees the result sees its owner's place free)
                job.done.set_result(result)
            else:
                job.done.set_exception(error)
            del result, error, job  # (no reference kept while this thread waits for the next job)

    def _submit(self, c: Constraint, owner: str | None):
        """(cached matcher, None) or (None, the job to wait for): a job compiling the same text is joined; a new one
        is queued, or refused with a 429 when its owner has `per_owner` unfinished, or when `max_queued` wait and it
        has any (so others' load never refuses an owner's first compile)."""
        with self._wake:
            hit = self._cache.get(c.key)
            if hit is not None:
                self._cache.move_to_end(c.key)
                return hit, None
            job = self._inflight.get(c.key)
            if job is not None:
                job.waiters += 1
                return None, job
            if self._closed:
                raise APIError(503, "the server is shutting down", "service_unavailable", code="unavailable")
            mine = len(self._queues.get(owner, ())) + self._running.get(owner, 0)
            if mine >= self.per_owner:
                raise APIError(429, f"this client has {mine} grammar compiles unfinished, the most this server allows "
                                    f"(--grammar-compile-queue {self.per_owner}); retry when one has finished",
                               "rate_limit_error", param=c.param, code="grammar_queue_full",
                               headers={"Retry-After": "1"})
            if self._queued >= self.max_queued and mine:  # (an owner's first compile is always queued)
                raise APIError(429, f"{self._queued} grammar compiles are waiting, the most this server queues; retry "
                                    "shortly", "rate_limit_error", param=c.param, code="grammar_queue_full",
                               headers={"Retry-After": "1"})
            job = _Job(c, owner)
            self._queues.setdefault(owner, deque()).append(job)
            self._queued += 1
            self._inflight[c.key] = job
            while len(self._threads) < self.workers:
                t = threading.Thread(target=self._work, name=f"tpserve-grammar-{len(self._threads)}", daemon=True)
                t.start()
                self._threads.append(t)
            self._wake.notify()
            return None, job

    def _leave(self, job: _Job) -> None:
        """A request stops waiting for `job`: a job still queued that nobody waits for any more is dropped."""
        with self._wake:
            job.waiters -= 1
            if job.waiters or job.state != "queued":
                return
            queue = self._queues[job.owner]
            queue.remove(job)
            if not queue:
                del self._queues[job.owner]
            self._queued -= 1
            del self._inflight[job.constraint.key]
            job.state = "dropped"

    # ---- the request side (event loop) -------------------------------------------------------------------------
    async def compile(self, c: Constraint, owner: str | None = None,
                      gone: Callable[[], Awaitable[bool]] | None = None):
        """The compiled matcher (in its start state) for `c`: from the cache at once, else compiled on one of the
        compile threads (`_submit` for the queue's rules; the same text compiling for another request is joined).

        The time limit starts when a thread takes the compile (or when this request joins it, if later): a compile
        that outlasts it is refused, and finishes in the background, counted against `owner`, and is cached, so a
        retry is served. `gone` (e.g. Starlette's request.is_disconnected): polled while queued, and a client that
        has gone away gives up its place. A request cancelled while queued gives it up too."""
        hit, job = self._submit(c, owner)
        if job is None:
            return hit
        joined = time.monotonic()
        started = asyncio.wrap_future(job.started)
        done = asyncio.wrap_future(job.done)
        try:
            while not started.done():
                await asyncio.wait((started,), timeout=GONE_POLL_S if gone is not None else None)
                if not started.done() and await gone():
                    raise asyncio.CancelledError("client disconnected")
            deadline = max(started.result(), joined) + self.compile_timeout
            await asyncio.wait((done,), timeout=max(0.0, deadline - time.monotonic()))
            if not done.done():
                raise APIError(400, f"{c.param} took longer than {self.compile_timeout:g} s to compile; simplify it",
                               param=c.param, code="grammar_too_complex")
            e = done.exception()
            if isinstance(e, APIError):  # each request its own copy (the routes edit theirs), naming its own field
                message, param = e.message, e.param
                if param == job.constraint.param != c.param:  # (a job joined from another field)
                    message, param = message.replace(param, c.param), c.param
                raise APIError(e.status, message, e.type, param, e.code, e.headers) from None
            return done.result()
        finally:
            started.cancel()  # (the job's own futures cannot be cancelled: only this request's views of them)
            done.cancel()
            self._leave(job)

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
    def state(compiled, gate: Gate | None = None) -> GrammarState:
        """A new sequence's matcher in its start state (`gate`: its own, a new one per sequence)."""
        return GrammarState(compiled.deep_copy(), gate)

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
        if any(not st.active for st in states):  # (inside their reasoning: nothing forbidden yet)
            rows, states = [r for r, st in zip(rows, states) if st.active], [st for st in states if st.active]
            if not rows:
                return
        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty(len(rows), words, dtype=torch.int32)
        base, stride = bitmask.data_ptr(), words * 4
        for i, st in enumerate(states):
            st.matcher.unsafe_compute_mask_ptr(base + i * stride, stride)
            if st.gate is not None and st.gate.start is not None:  # "maybe": the reasoning may open here
                w, b = divmod(st.gate.start, 32)
                bitmask.numpy().view(np.uint32)[i, w] |= np.uint32(1 << b)
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
        """Stop the compile threads once idle (a running compile finishes first); queued jobs fail with a 503."""
        with self._wake:
            self._closed = True
            for queue in self._queues.values():
                for job in queue:
                    job.state = "dropped"
                    self._inflight.pop(job.constraint.key, None)
                    job.started.set_result(time.monotonic())
                    job.done.set_exception(APIError(503, "the server is shutting down", "service_unavailable",
                                                    code="unavailable"))
            self._queues.clear()
            self._queued = 0
            self._wake.notify_all()
