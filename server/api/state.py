"""A request in flight: the server state it runs against, its engine sequences, and waiting for their output.

Each HTTP request becomes one engine Sequence per (prompt, choice). The engine thread hands each step's new text to
`PendingRequest.emit`, which moves it onto the request's asyncio queue; the route gathers it (`gather`) or streams it
(`stream_events`), and a client that goes away has its sequences aborted, which frees their KV-cache blocks.

The event loop shares the machine (and, through the GIL, the engine thread's Python) with the decode, so the work
per token is kept small: a gathered request is woken only when a sequence finishes, and a streamed one waits on its
queue with no timer (its response watches for the client going away instead; server/api/bodies.py, EventStream).
The work per request that grows with its size (tokenizing, chat templates, token-id checks) runs in `CpuPool`, a
thread beside the loop with a bound on what waits, so a flood of large prompts never stalls the streams.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import hmac
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import Request

from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.core import Engine
from server.engine.structured.grammar import GrammarState
from server.api.metrics import Metrics
from server.api.parsers import ParserConfig, special_atom, template_text
from server.api.protocol import APIError
from server.engine.sampler import SamplingParams
from server.engine.request import Sequence
from server.engine.tokenizer import LengthBound, length_bound

DISCONNECT_POLL_S = 0.5


@dataclass
class ServerState:
    engine: Engine
    tokenizer: object
    model_name: str
    vocab_size: int
    api_key: str | None = None
    metrics_key: str | None = None  # --metrics-key: /metrics then wants `Authorization: Bearer <it>`
    max_queued_requests: int = 256
    max_body_bytes: int = 4 * 1024 * 1024
    tool_call_parser: str | None = None  # --tool-call-parser: tool_choice "auto" reads calls out of the answer
    reasoning_parser: str | None = None  # --reasoning-parser: reasoning apart from content (server/api/parsers/)
    pooling: object = None  # /v1/embeddings' pooling (server/api/embeddings.py PoolingConfig; build_app resolves it)
    responses: object = None  # stored responses (server/api/responses.py ResponseStore; build_app makes one)
    metrics: Metrics = field(default_factory=Metrics)
    supervisor: object = None  # server/engine/supervisor.py, when this process spawned the ranks
    loras: object = None  # server/engine/lora_registry.py LoraRegistry, with --enable-lora
    draining: bool = False
    cpu: CpuPool | None = None  # tokenizing and chat templates off the event loop (default: one thread, see CpuPool)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        # --api-key may name several keys, comma-separated: each client its own (stored responses are per key)
        self.api_keys = frozenset(k.strip() for k in (self.api_key or "").split(",") if k.strip())
        if self.cpu is None:
            self.cpu = CpuPool(max_pending_chars=4 * self.max_body_bytes, max_pending=self.max_queued_requests)
        # what a prompt's length in characters proves about its token count (None: nothing; tokenize to know)
        self.length_bound: LengthBound | None = length_bound(self.tokenizer)
        # the output parsers (`auto` resolved from the chat template), and how grammars spell the format's markers
        self.parsers = ParserConfig(self.reasoning_parser, self.tool_call_parser, self.tokenizer)
        self.template = template_text(self.tokenizer)
        self.atom = special_atom(self.tokenizer)
        from server.api.tool_calls import template_supports_tools  # (renders a probe tool once: not on the loop)

        self.tools_in_template = template_supports_tools(self.tokenizer)

    def min_tokens(self, text: str) -> int:
        """A number of tokens `text` encodes to at least (0 when the tokenizer gives no bound): O(1) for most
        tokenizers, so a prompt too long for the model is refused on the event loop before any tokenizing."""
        return self.length_bound.min_tokens(text) if self.length_bound is not None else 0

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def owner(self, request: Request, by_host: bool = False) -> str | None:
        """Who makes `request`, as one string for every per-client bound and store: a hash of its API key (the
        credentials of `Authorization: Bearer`, scheme in any case), None without one. `by_host`: on a server
        without keys, the client's address instead ("host:<address>"; such a server accepts any token, so a token
        would be a fresh quota for the asking)."""
        if by_host and not self.api_keys:
            return "host:" + (request.client.host if request.client is not None else "")
        return key_owner(bearer_token(request.headers.get("authorization", "")))

    def key_ok(self, authorization: str) -> bool:
        """Whether an Authorization header carries one of the API keys (any server without keys: yes)."""
        return not self.api_keys or carries_key(authorization, self.api_keys)

    def metrics_key_ok(self, authorization: str) -> bool:
        """Whether an Authorization header may read /metrics: --metrics-key, when one is set."""
        return not self.metrics_key or carries_key(authorization, (self.metrics_key,))


def carries_key(authorization: str, keys) -> bool:
    """Whether an `Authorization: Bearer` header carries one of `keys`. Each key is compared in constant time, so a
    response's timing says nothing about how much of a guess was right."""
    token = bearer_token(authorization)
    if token is None:
        return False
    given = token.encode()
    return any([hmac.compare_digest(given, k.encode()) for k in keys])  # (every key, no early exit)


class CpuPool:
    """The work of a request that grows with its size, off the event loop: tokenizing (Hugging Face's fast tokenizers
    encode in Rust with the GIL released, so the loop keeps streaming meanwhile), chat templates, token-id checks.
    One thread by default (vLLM's tokenizer executor has one too): a tokenizer thread per core would take the cores
    the decode runs on. A 4 MB prompt takes seconds to tokenize, so what may wait is bounded: past `max_pending`
    jobs or `max_pending_chars` characters waiting or running, a request gets a 429 at once (a lone job always
    runs, whatever its size). A job still waiting for the thread is dropped when its coroutine is cancelled, or when
    the `gone` it was submitted with (e.g. Starlette's request.is_disconnected, polled every DISCONNECT_POLL_S while
    it waits: uvicorn does not cancel a request's task when its client leaves) says the client has left; a job
    already running runs to its end."""

    def __init__(self, workers: int = 1, max_pending_chars: int = 16 * 1024 * 1024, max_pending: int = 256):
        self.workers, self.max_pending_chars, self.max_pending = workers, max_pending_chars, max_pending
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tpserve-cpu")
        self._lock = threading.Lock()
        self.jobs = 0  # waiting or running
        self.chars = 0

    async def run(self, chars: int, fn, *args, gone: Callable[[], Awaitable[bool]] | None = None):
        """fn(*args) on the pool's thread; `chars` is the job's size (its prompts' characters). `gone`: polled while
        the job waits for the thread; once it says the client has left, the job is dropped (CancelledError)."""
        with self._lock:
            if self.jobs and (self.jobs >= self.max_pending or self.chars + chars > self.max_pending_chars):
                raise APIError(429, f"the server is busy tokenizing other requests ({self.jobs} of them, "
                                    f"{self.chars} characters); retry shortly", "rate_limit_error",
                               code="queue_full", headers={"Retry-After": "1"})
            self.jobs += 1
            self.chars += chars
        try:
            future = self._pool.submit(fn, *args)
        except BaseException:
            self._release(chars)
            raise
        future.add_done_callback(lambda _: self._release(chars))  # (run or cancelled: either way it is done)
        waiting = asyncio.wrap_future(future)
        try:
            while gone is not None and not future.running() and not future.done():
                await asyncio.wait((waiting,), timeout=DISCONNECT_POLL_S)
                if not future.running() and not future.done() and await gone():
                    raise asyncio.CancelledError("client disconnected")
            return await waiting
        finally:  # a job not started yet is dropped (now: its place is free at once); a running one runs on
            future.cancel()
            waiting.cancel()

    def _release(self, chars: int) -> None:
        with self._lock:
            self.jobs -= 1
            self.chars -= chars

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def key_owner(token: str | None) -> str | None:
    """A hash of an API key (None for none): what stored responses, runtime LoRA adapters and grammar-compile quotas
    record as their owner (ServerState.owner)."""
    return hashlib.sha256(token.encode()).hexdigest()[:32] if token is not None else None


def bearer_token(authorization: str) -> str | None:
    """The credentials of an `Authorization: Bearer <token>` header (the scheme is case-insensitive, RFC 7235)."""
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class Outbox:
    """Engine events bound for one event loop, handed over in batches. The engine thread emits one event per sequence
    per step; a call_soon_threadsafe each (a write to the loop's wake-up pipe, and often a wake-up of the loop) cost
    the engine thread ~2.4 % of a 32-stream decode step (py-spy). Here the first event of a batch schedules one
    delivery, and the events that arrive before it runs ride along."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: list[tuple[asyncio.Queue, tuple]] = []
        self._lock = threading.Lock()

    def put(self, queue: asyncio.Queue, item: tuple) -> None:  # engine thread
        with self._lock:
            self._items.append((queue, item))
            if len(self._items) > 1:
                return  # a delivery is already scheduled
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:  # the loop's thread
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


_outboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def outbox_for(loop: asyncio.AbstractEventLoop) -> Outbox:
    box = _outboxes.get(loop)
    if box is None:
        box = _outboxes[loop] = Outbox(loop)
    return box


class PendingRequest:
    """One HTTP request's sequences and the queue their output arrives on."""

    def __init__(self, state: ServerState, loop: asyncio.AbstractEventLoop, stream: bool = False):
        self.state = state
        self.loop = loop
        self.stream = stream  # every step's text is wanted; otherwise only the end of each sequence
        self.outbox = outbox_for(loop)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.seqs: list[Sequence] = []
        self.index: dict[int, int] = {}  # seq_id -> choice index
        self.emitted_tokens: dict[int, int] = {}
        self.token_times: dict[int, float] = {}  # seq_id -> when its latest token came
        self.lora = None  # the LoRA adapter the request's `model` named (server/api/preprocess.py check_model)

    def emit(self, seq: Sequence, text: str, finished: bool) -> None:  # engine thread
        n = len(seq.output_ids)
        t, prev = seq.last_token_time, self.token_times.get(seq.seq_id)
        if t is not None and t != prev:
            if prev is not None:
                self.state.metrics.itl.observe(t - prev)  # every gap between two tokens of a sequence
            self.token_times[seq.seq_id] = t
        if self.stream or finished:
            self.outbox.put(self.queue, (seq, text, finished, n))

    def close(self) -> None:
        """The client went away: abort the sequences and end the stream without waiting for the engine."""
        self.abort()
        self.queue.put_nowait(None)

    def add(self, prompt_ids: list[int], params: SamplingParams, choice: int,
            grammar: GrammarState | None = None) -> None:
        detok = IncrementalDetokenizer(self.state.tokenizer, prompt_ids, params.stop, params.skip_special_tokens)
        seq = Sequence(prompt_ids, params, detok, emit=self.emit, grammar=grammar, lora=self.lora)
        self.index[seq.seq_id] = choice
        self.emitted_tokens[seq.seq_id] = 0
        self.seqs.append(seq)

    def submit(self) -> None:
        for seq in self.seqs:
            self.state.engine.add(seq)
        self.state.metrics.prompt_tokens.inc(sum(len(s.prompt_ids) for s in self.seqs))

    def abort(self) -> None:
        for seq in self.seqs:
            if not seq.finished:
                self.state.engine.abort(seq)

    def observe_finish(self, seq: Sequence) -> None:
        m = self.state.metrics
        m.finished.labels(seq.finish_reason).inc()
        m.generation_tokens.inc(len(seq.output_ids))
        if seq.first_token_time is not None:
            m.ttft.observe(seq.first_token_time - seq.arrival)
            m.e2e.observe(seq.last_token_time - seq.arrival)


def admit(state: ServerState, req: PendingRequest) -> None:
    """Queue the request's sequences, or answer 429 when the queue is full; a request that could never fit the queue,
    even an empty one, is a 400 that names the limit (a 429 would have its client retry it for ever)."""
    if len(req.seqs) > state.max_queued_requests:
        raise APIError(400, f"this request makes {len(req.seqs)} sequences (prompts x n, or embedding inputs), more "
                            f"than the {state.max_queued_requests} this server queues at once "
                            "(--max-queued-requests): send it in parts", code="too_many_sequences")
    if state.engine.num_waiting + len(req.seqs) > state.max_queued_requests:
        raise APIError(429, f"the server is at capacity ({state.max_queued_requests} queued sequences); retry "
                            "shortly", "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    req.submit()


# ---- waiting for output ---------------------------------------------------------------------------------------
if sys.version_info >= (3, 11):
    async def _get(queue: asyncio.Queue):
        async with asyncio.timeout(DISCONNECT_POLL_S):  # a timer on this task (wait_for wraps a new task per call)
            return await queue.get()
else:  # pragma: no cover - Python 3.10
    async def _get(queue: asyncio.Queue):
        return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)


async def next_event(req: PendingRequest, request: Request):
    """The next engine event (a gathered request gets one per sequence, when it finishes); every DISCONNECT_POLL_S
    without one, a client that has gone away has the request's sequences aborted."""
    while True:
        if not req.queue.empty():
            return req.queue.get_nowait()
        try:
            return await _get(req.queue)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                req.abort()
                raise asyncio.CancelledError("client disconnected")


async def gather(req: PendingRequest, request: Request) -> list[Sequence]:
    pending = len(req.seqs)
    try:
        while pending:
            seq, _, finished, _ = await next_event(req, request)
            if finished:
                pending -= 1
                req.observe_finish(seq)
    except BaseException:
        req.abort()
        raise
    failed = next((s for s in req.seqs if s.finish_reason == "error"), None)
    if failed is not None:
        raise failure(req.state, failed)
    return req.seqs


def failure(state: ServerState, seq: Sequence | None = None) -> APIError:
    """The error a sequence finished with: its own (an adapter that could not be read), else the engine's."""
    if seq is not None and seq.error:
        return APIError(503, seq.error, "service_unavailable",
                        code="lora_load_failed" if seq.lora is not None else "request_failed")
    return APIError(503, f"the engine failed while serving this request: {state.engine.dead}", "service_unavailable",
                    code="engine_failed")


async def stream_events(req: PendingRequest):
    """(seq, new text, finished, first token index, end token index) for every engine event, until all finish or the
    client goes away (`PendingRequest.close`, called by the response that watches the connection). The response
    aborts whatever is still running when it ends, however it ends (server/api/bodies.py, EventStream)."""
    pending = len(req.seqs)
    queue = req.queue
    while pending:
        event = queue.get_nowait() if not queue.empty() else await queue.get()
        if event is None:
            return
        seq, text, finished, n = event
        a = req.emitted_tokens[seq.seq_id]
        req.emitted_tokens[seq.seq_id] = n
        if finished:
            pending -= 1
            req.observe_finish(seq)
        yield seq, text, finished, a, n
