"""The OpenAI-compatible HTTP API (FastAPI), served by rank 0 only.

Each request is validated and tokenized here, becomes one engine Sequence per (prompt, choice), and is answered
from the text the engine emits, streamed as SSE or gathered. Every error is answered in OpenAI's JSON shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.detokenize import IncrementalDetokenizer
from server.engine import Engine
from server.metrics import Metrics
from server.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingFields
from server.sampling import SamplingParams
from server.scheduler import Sequence

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5


@dataclass
class ServerState:
    engine: Engine
    tokenizer: object
    model_name: str
    vocab_size: int
    api_key: str | None = None
    max_queued_requests: int = 256
    max_body_bytes: int = 4 * 1024 * 1024
    metrics: Metrics = field(default_factory=Metrics)
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    msg = e.get("msg", "invalid value")
    if e.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    return (f"{param}: {msg}" if param else msg), param


class PendingRequest:
    """One HTTP request's sequences and the queue their output arrives on."""

    def __init__(self, state: ServerState, loop: asyncio.AbstractEventLoop):
        self.state = state
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.seqs: list[Sequence] = []
        self.index: dict[int, int] = {}  # seq_id -> choice index
        self.emitted_tokens: dict[int, int] = {}
        self.token_times: dict[int, float] = {}  # seq_id -> when its latest token came

    def emit(self, seq: Sequence, text: str, finished: bool) -> None:  # engine thread
        n = len(seq.output_ids)
        t, prev = seq.last_token_time, self.token_times.get(seq.seq_id)
        if t is not None and t != prev:
            if prev is not None:
                self.state.metrics.itl.observe(t - prev)  # every gap between two tokens of a sequence
            self.token_times[seq.seq_id] = t
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (seq, text, finished, n))

    def add(self, prompt_ids: list[int], params: SamplingParams, choice: int) -> None:
        detok = IncrementalDetokenizer(self.state.tokenizer, prompt_ids, params.stop, params.skip_special_tokens)
        seq = Sequence(prompt_ids, params, detok, emit=self.emit)
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


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="tpserve", version="0.1.0", description="OpenAI-compatible tensor-parallel LLM server")
    app.state.tpserve = state

    # ---- errors: always OpenAI's shape ---------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return error_response(APIError(400, msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        kinds = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}
        return error_response(APIError(exc.status_code, str(exc.detail), kinds.get(exc.status_code, "api_error"),
                                       headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        logger.exception("unhandled error")
        return error_response(APIError(500, "internal server error", "internal_error"))

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        path = request.url.path
        if path.startswith("/v1/"):
            if state.api_key is not None:
                auth = request.headers.get("authorization", "")
                if auth != f"Bearer {state.api_key}":
                    return error_response(APIError(401, "invalid or missing API key (send Authorization: Bearer "
                                                        "<key>)", "authentication_error", code="invalid_api_key"))
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > state.max_body_bytes:
                return error_response(APIError(413, f"request body larger than {state.max_body_bytes} bytes"))
            if request.method == "POST" and (state.draining or state.engine.dead):
                why = "the server is shutting down" if state.draining else "the server has failed"
                return error_response(APIError(503, why, "service_unavailable", code="unavailable"))
        return await call_next(request)

    # ---- plain endpoints -----------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if state.engine.dead:
            return JSONResponse({"status": "failed", "reason": state.engine.dead}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        m, e = state.metrics, state.engine
        m.running.set(e.num_running)
        m.waiting.set(e.num_waiting)
        m.kv_usage.set(e.kv_usage())
        m.sync_counter(m.prefix_queries, "prefix_queries", e.blocks.prefix_query_tokens)
        m.sync_counter(m.prefix_hits, "prefix_hits", e.blocks.prefix_hit_tokens)
        m.sync_counter(m.preemptions, "preemptions", e.scheduler.num_preemptions)
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "tpserve", "max_model_len": state.max_model_len}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(state, model_id)
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "tpserve"}

    # ---- completions ---------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(state, body.model)
        prompts = tokenize_prompts(state, body.prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        params = sampling_params(body, max_tokens, body.logprobs)
        if body.echo and body.logprobs is not None:  # the prompt's tokens get logprobs too, as OpenAI's legacy API
            params.prompt_logprobs = body.logprobs
        req = PendingRequest(state, asyncio.get_running_loop())
        for p_i, ids in enumerate(prompts):
            check_length(state, ids, max_tokens)
            for c in range(body.n):
                req.add(ids, with_seed(params, c), p_i * body.n + c)
        admit(state, req)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo_text = [decode_prompt(state, ids) if body.echo else "" for ids in prompts]
        if body.stream:
            return sse(stream_completion(req, request, body, rid, created, echo_text, prompts))
        seqs = await gather(req, request)
        choices = []
        for seq in sorted(seqs, key=lambda s: req.index[s.seq_id]):
            i = req.index[seq.seq_id]
            echo = echo_text[i // body.n]
            lp = None
            if body.logprobs is not None:
                lp = completion_logprobs(state, seq, 0, len(seq.output_ids), base=len(echo))
                if body.echo:
                    lp = join_logprobs(prompt_logprobs(state, seq), lp)
            choices.append({"index": i, "text": echo + seq.detok.text, "logprobs": lp,
                            "finish_reason": seq.finish_reason})
        return {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                "choices": choices, "usage": usage(prompts, seqs)}

    # ---- chat ----------------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(state, body.model)
        ids = render_chat(state, body)
        max_tokens = body.max_completion_tokens or body.max_tokens or (state.max_model_len - len(ids))
        top = body.top_logprobs if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        params = sampling_params(body, max_tokens, (top or 0) if body.logprobs else None)
        check_length(state, ids, max_tokens)
        req = PendingRequest(state, asyncio.get_running_loop())
        for c in range(body.n):
            req.add(ids, with_seed(params, c), c)
        admit(state, req)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return sse(stream_chat(req, request, body, rid, created, ids))
        seqs = await gather(req, request)
        choices = []
        for seq in sorted(seqs, key=lambda s: req.index[s.seq_id]):
            choices.append({"index": req.index[seq.seq_id],
                            "message": {"role": "assistant", "content": seq.detok.text},
                            "logprobs": chat_logprobs(state, seq, 0, len(seq.output_ids)) if body.logprobs else None,
                            "finish_reason": seq.finish_reason})
        return {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
                "choices": choices, "usage": usage([ids], seqs)}

    return app


# ---- request preparation (all on rank 0, before the engine sees anything) -----------------------------------
def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(404, f"The model `{name}` does not exist. This server serves `{state.model_name}`.",
                       "not_found_error", param="model", code="model_not_found")


def tokenize_prompts(state: ServerState, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        raw = [prompt]
    elif all(isinstance(x, int) for x in prompt):
        raw = [prompt]
    else:
        raw = list(prompt)
    out = []
    for p in raw:
        if isinstance(p, str):
            ids = state.tokenizer.encode(p)
            if not ids:
                raise APIError(400, "prompt encodes to zero tokens", param="prompt")
        else:
            bad = [t for t in p if not 0 <= t < state.vocab_size]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {state.vocab_size})",
                               param="prompt")
            ids = list(p)
        out.append(ids)
    return out


def render_chat(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    try:
        ids = state.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                  tokenize=True, return_dict=False)
    except Exception as e:  # noqa: BLE001 - a template that rejects the conversation (e.g. role order)
        raise APIError(400, f"cannot render the chat template for these messages: {e}", param="messages") from None
    ids = list(ids)
    if not ids:
        raise APIError(400, "the conversation renders to zero tokens", param="messages")
    return ids


def check_length(state: ServerState, ids: list[int], max_tokens: int) -> None:
    """prompt + max_tokens must fit the max model length, which never exceeds what the whole KV cache holds (the
    server refuses to start otherwise, or lowers a default length to the cache): a request that passes always fits."""
    limit = state.max_model_len
    why = f"this server's max model length is {limit}"
    if state.engine.pool_tokens <= limit:
        why += f" (its whole KV cache holds {state.engine.pool_tokens} tokens)"
    if len(ids) >= limit:
        raise APIError(400, f"the prompt has {len(ids)} tokens; {why}", param="prompt", code="context_length_exceeded")
    if len(ids) + max_tokens > limit:
        raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds {limit} tokens: {why}; "
                            f"lower max_tokens to at most {limit - len(ids)}", param="max_tokens",
                       code="context_length_exceeded")


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        stop=body.stop_list(),
        stop_token_ids=list(body.stop_token_ids or []),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logprobs=logprobs,
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
    )


def with_seed(params: SamplingParams, choice: int) -> SamplingParams:
    """Choice i of a seeded request uses seed + i, so n > 1 choices differ yet each is reproducible."""
    if params.seed is None or choice == 0:
        return params
    from dataclasses import replace

    return replace(params, seed=params.seed + choice)


def admit(state: ServerState, req: PendingRequest) -> None:
    """Queue the request's sequences, or answer 429 when the queue is full."""
    if state.engine.num_waiting + len(req.seqs) > state.max_queued_requests:
        raise APIError(429, f"the server is at capacity ({state.max_queued_requests} queued sequences); retry "
                            "shortly", "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    req.submit()


def decode_prompt(state: ServerState, ids: list[int]) -> str:
    return state.tokenizer.decode(ids, skip_special_tokens=False)


def usage(prompts: list[list[int]], seqs: list[Sequence]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(s.output_ids) for s in seqs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def token_str(state: ServerState, t: int) -> str:
    return state.tokenizer.decode([t])


def top_dict(state: ServerState, alts: list[tuple[int, float]]) -> dict[str, float]:
    """Alternatives as OpenAI's {token text: logprob}; ids that decode to the same text share a key, which keeps the
    higher logprob (alts come best first)."""
    out: dict[str, float] = {}
    for t, lp in alts:
        out.setdefault(token_str(state, t), lp)
    return out


def _offsets(tokens: list[str], start: int) -> list[int]:
    offsets, pos = [], start
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return offsets


def completion_logprobs(state: ServerState, seq: Sequence, a: int, b: int, base: int = 0) -> dict:
    """Legacy-completions logprobs of output tokens a..b; `base` is the length of the echoed prompt text."""
    tokens = [token_str(state, t) for t in seq.output_ids[a:b]]
    return {"tokens": tokens, "token_logprobs": seq.token_logprobs[a:b],
            "top_logprobs": [top_dict(state, alts) for alts in seq.top_logprobs[a:b]],
            "text_offset": _offsets(tokens, base + (len(seq.detok.text) if a else 0))}


def prompt_logprobs(state: ServerState, seq: Sequence) -> dict:
    """Logprobs of the prompt's tokens (echo): the first token has none, as in OpenAI's legacy API."""
    tokens = [token_str(state, t) for t in seq.prompt_ids]
    top = [top_dict(state, alts) for alts in seq.prompt_top_logprobs or []]
    return {"tokens": tokens, "token_logprobs": [None] + (seq.prompt_logprobs or []),
            "top_logprobs": [None] + top, "text_offset": _offsets(tokens, 0)}


def join_logprobs(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(state: ServerState, seq: Sequence, a: int, b: int) -> dict:
    def entry(t: int, lp: float) -> dict:
        s = token_str(state, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = []
    for t, lp, alts in zip(seq.output_ids[a:b], seq.token_logprobs[a:b], seq.top_logprobs[a:b]):
        content.append({**entry(t, lp), "top_logprobs": [entry(u, v) for u, v in alts]})
    return {"content": content}


# ---- waiting for output ---------------------------------------------------------------------------------------
async def next_event(req: PendingRequest, request: Request):
    """The next engine event; aborts the request's sequences if the client has gone away meanwhile."""
    while True:
        try:
            return await asyncio.wait_for(req.queue.get(), DISCONNECT_POLL_S)
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
    if any(s.finish_reason == "error" for s in req.seqs):
        raise APIError(503, f"the engine failed while serving this request: {req.state.engine.dead}",
                       "service_unavailable", code="engine_failed")
    return req.seqs


def sse(gen: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        async for chunk in gen:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def stream_events(req: PendingRequest, request: Request):
    """(seq, new text, finished, first token index, end token index) for every engine event, until all finish."""
    pending = len(req.seqs)
    try:
        while pending:
            seq, text, finished, n = await next_event(req, request)
            a = req.emitted_tokens[seq.seq_id]
            req.emitted_tokens[seq.seq_id] = n
            if finished:
                pending -= 1
                req.observe_finish(seq)
            yield seq, text, finished, a, n
    finally:
        req.abort()  # a no-op for finished sequences; frees the slots of a client that went away


def error_chunk(state: ServerState) -> dict:
    return APIError(503, f"the engine failed while serving this request: {state.engine.dead}",
                    "service_unavailable", code="engine_failed").body()


async def stream_completion(req: PendingRequest, request: Request, body: CompletionRequest, rid: str, created: int,
                            echo_text: list[str], prompts: list[list[int]]):
    state = req.state

    def chunk(i: int, text: str, finish: str | None, logprobs=None) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    echo_later = set()  # with logprobs, the echo chunk waits for the prompt's logprobs (after the prefill)
    for i in range(len(req.seqs)):
        if echo_text[i // body.n]:
            if body.logprobs is None:
                yield chunk(i, echo_text[i // body.n], None)
            else:
                echo_later.add(i)
    async for seq, text, finished, a, b in stream_events(req, request):
        if seq.finish_reason == "error":
            yield error_chunk(state)
            return
        i = req.index[seq.seq_id]
        if i in echo_later:
            echo_later.discard(i)
            yield chunk(i, echo_text[i // body.n], None, prompt_logprobs(state, seq))
        if text or finished or (body.logprobs is not None and b > a):
            lp = None
            if body.logprobs is not None:
                lp = completion_logprobs(state, seq, a, b, base=len(echo_text[i // body.n]))
            yield chunk(i, text, seq.finish_reason if finished else None, lp)
    if body.stream_options and body.stream_options.include_usage:
        yield {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
               "choices": [], "usage": usage(prompts, req.seqs)}


async def stream_chat(req: PendingRequest, request: Request, body: ChatCompletionRequest, rid: str, created: int,
                      prompt_ids: list[int]):
    state = req.state

    def chunk(i: int, delta: dict, finish: str | None, logprobs=None) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    for i in range(len(req.seqs)):
        yield chunk(i, {"role": "assistant", "content": ""}, None)
    async for seq, text, finished, a, b in stream_events(req, request):
        if seq.finish_reason == "error":
            yield error_chunk(state)
            return
        if text or finished or (body.logprobs and b > a):
            lp = chat_logprobs(state, seq, a, b) if body.logprobs else None
            yield chunk(req.index[seq.seq_id], {"content": text} if text else {},
                        seq.finish_reason if finished else None, lp)
    if body.stream_options and body.stream_options.include_usage:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
               "choices": [], "usage": usage([prompt_ids], req.seqs)}
