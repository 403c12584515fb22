"""The OpenAI-compatible HTTP API (FastAPI), served by rank 0 only: a thin router from a request to the engine.

A route validates its body (server/api/protocol.py), prepares what the engine needs (server/api/preprocess.py: tokens, chat
rendering, sampling parameters, the output constraint compiled off the engine thread), queues one engine Sequence
per (prompt, choice) (server/api/state.py), and answers in OpenAI's shape, gathered or streamed (server/api/bodies.py).
Every error is answered in OpenAI's JSON shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api import embeddings, responses as responses_api, tokenize as tokenize_api
from server.api.embeddings import pooling_config
from server.engine.structured.grammar import Grammars
from server.api.state import PendingRequest, ServerState, admit, bearer_token, gather
from server.api.preprocess import (check_length, check_model, decode_prompt, logit_bias, output_constraint,
                            prompt_chars, refuse_long_prompts, render_chat, render_cost, sampling_params,
                            tokenize_prompts, with_seed)
from server.engine.lora_registry import RUNTIME_UPDATES_ENV, LoraRefused, runtime_updates_allowed
from server.api.protocol import (APIError, ChatCompletionRequest, CompletionRequest, LoadLoraAdapterRequest,
                             UnloadLoraAdapterRequest)
from server.api.bodies import (EventStream, answer_reader, chat_response, completion_response, stream_chat,
                              stream_completion)
from server.api.responses import ResponseStore

logger = logging.getLogger(__name__)

__all__ = ["ServerState", "build_app"]

# the paths behind the API key (and the body-size and draining guards): the OpenAI API, vLLM's /tokenize and
# /detokenize, which reveal as much about the served model as /v1/models does, and the API's own description
# (/docs, /redoc, /openapi.json); /health stays open for probes, and /metrics for scrapers unless --metrics-key is set
KEYED_PATHS = ("/v1/", "/tokenize", "/detokenize", "/docs", "/redoc", "/openapi.json")


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
        kinds = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                 413: "invalid_request_error"}
        return error_response(APIError(exc.status_code, str(exc.detail), kinds.get(exc.status_code, "api_error"),
                                       headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        logger.exception("unhandled error")
        return error_response(APIError(500, "internal server error", "internal_error"))

    def refusal(scope) -> APIError | None:
        """Why a /v1/ request is turned away before its route runs (key, body size, draining), or None; /metrics
        wants --metrics-key when one is set (open by default, as vLLM's)."""
        path = scope.get("path", "")
        if state.metrics_key and (path == "/metrics" or path.startswith("/metrics/")):
            if not state.metrics_key_ok(Headers(scope=scope).get("authorization", "")):
                return APIError(401, "invalid or missing metrics key (send Authorization: Bearer <key>)",
                                "authentication_error", code="invalid_api_key")
            return None
        if not path.startswith(KEYED_PATHS):
            return None
        headers = Headers(scope=scope)
        if not state.key_ok(headers.get("authorization", "")):
            return APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                            "authentication_error", code="invalid_api_key")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > state.max_body_bytes:
            return APIError(413, f"request body larger than {state.max_body_bytes} bytes")
        if scope.get("method") == "POST" and (state.draining or state.engine.dead):
            why = "the server is shutting down" if state.draining else "the server has failed"
            return APIError(503, why, "service_unavailable", code="unavailable")
        return None

    class Guard:
        """A plain ASGI middleware, not @app.middleware("http"): Starlette's BaseHTTPMiddleware relays every chunk
        of a streamed response through a memory stream and another task, which cost the event loop CPU on every
        token of every stream (433 -> 276 µs of event-loop CPU per token; BENCHMARKS.md section 9)."""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http":
                err = refusal(scope)
                if err is not None:
                    await error_response(err)(scope, receive, send)
                    return
                if scope.get("method") in ("POST", "PUT", "PATCH") and scope.get("path", "").startswith(KEYED_PATHS):
                    receive = await self.bounded_body(scope, receive, send)
                    if receive is None:
                        return
            await self.app(scope, receive, send)

        @staticmethod
        async def bounded_body(scope, receive, send):
            """Read the request body here, counting bytes as they arrive: past --max-body-bytes the request gets a
            413 and nothing more is read, whether or not Content-Length announced the size (a chunked body never
            does). Returns a receive that hands the app the body, then the client's later messages (disconnects);
            None if the request was answered or the client left."""
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] != "http.request":  # the client went away mid-body
                    return None
                body = message.get("body", b"")
                size += len(body)
                if size > state.max_body_bytes:
                    await error_response(APIError(413, f"request body larger than {state.max_body_bytes} bytes"))(
                        scope, receive, send)
                    return None
                chunks.append(body)
                if not message.get("more_body", False):
                    break
            whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

            async def replay():
                nonlocal whole
                if whole is not None:
                    message, whole = whole, None
                    return message
                return await receive()
            return replay

    app.add_middleware(Guard)

    # ---- plain endpoints -----------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if state.engine.dead:
            return JSONResponse({"status": "failed", "reason": state.engine.dead}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        e = state.engine
        if not e.replicas.down:
            return {"status": "ok"}
        # a replica is out of rotation (server/engine/supervisor.py): still healthy while another one serves
        body = {"status": "degraded" if e.replicas.alive else "recovering", "replicas": len(e.replicas.pools),
                "replicas_alive": e.replicas.alive, "down": {str(r): why for r, why in sorted(e.replicas.down.items())},
                "replica_failures": e.replicas.failures}
        if state.supervisor is not None:
            body["restarting"] = sorted(state.supervisor.restarting)
        return JSONResponse(body, status_code=200 if e.replicas.alive else 503)

    @app.get("/metrics")
    async def metrics():
        m, e = state.metrics, state.engine
        m.running.set(e.replicas.num_running)
        m.waiting.set(e.num_waiting)
        m.kv_usage.set(e.replicas.kv_usage())
        for replica in range(len(e.replicas.pools)):
            running, waiting = e.replicas.replica_load(replica)
            m.replica_running.labels(str(replica)).set(running)
            m.replica_waiting.labels(str(replica)).set(waiting)
            m.replica_kv_usage.labels(str(replica)).set(e.replicas.kv_usage(replica))
        m.sync_counter(m.prefix_queries, "prefix_queries", e.replicas.prefix_query_tokens)
        m.sync_counter(m.prefix_hits, "prefix_hits", e.replicas.prefix_hit_tokens)
        m.replicas_alive.set(e.replicas.alive)
        if state.loras is not None:
            m.lora_loaded.set(state.loras.loaded)
            running: dict[str, int] = {a.name: 0 for a in state.loras.models()}
            for lane in e.lanes:
                for seq in list(lane.scheduler.running):
                    if seq.lora is not None:
                        running[seq.lora.name] = running.get(seq.lora.name, 0) + 1
            m.lora_running.clear()  # (an unloaded adapter's label goes: names are the clients' to choose)
            for name, n in running.items():
                m.lora_running.labels(name).set(n)
        m.sync_counter(m.replica_failures, "replica_failures", e.replicas.failures)
        m.sync_counter(m.preemptions, "preemptions", e.replicas.num_preemptions)
        if e.speculator is not None:
            m.sync_counter(m.spec_drafts, "spec_drafts", e.speculator.num_drafts)
            m.sync_counter(m.spec_draft_tokens, "spec_draft_tokens", e.speculator.num_draft_tokens)
            m.sync_counter(m.spec_accepted_tokens, "spec_accepted_tokens", e.speculator.num_accepted_tokens)
            for pos, n in enumerate(e.speculator.accepted_per_position):
                m.sync_counter(m.spec_accepted_per_pos.labels(str(pos)), f"spec_accepted_{pos}", n)
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    def lora_card(adapter) -> dict:
        return {"id": adapter.name, "object": "model", "created": state.created, "owned_by": "tpserve",
                "root": adapter.path, "parent": state.model_name, "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def models():
        data = [{"id": state.model_name, "object": "model", "created": state.created, "owned_by": "tpserve",
                 "root": state.model_name, "parent": None, "max_model_len": state.max_model_len}]
        if state.loras is not None:
            data += [lora_card(a) for a in state.loras.models()]
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        adapter = check_model(state, model_id)
        if adapter is not None:
            return lora_card(adapter)
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "tpserve"}

    # ---- LoRA adapters at runtime (server/engine/lora_registry.py; vLLM's endpoints, behind its switch) -------------------------
    def runtime_lora() -> None:
        if not runtime_updates_allowed():
            raise APIError(404, f"runtime LoRA updating is off (set {RUNTIME_UPDATES_ENV}=1 to enable "
                                "/v1/load_lora_adapter and /v1/unload_lora_adapter)", "not_found_error",
                           code="not_found")
        if state.loras is None:
            raise APIError(400, "this server was started without --enable-lora", code="lora_disabled")

    def lora_caller(request: Request) -> tuple[str | None, bool]:
        """Who asks (ServerState.owner: a hash of its API key; None without --api-key) and whether it may unload any
        adapter (the --lora-admin-key; everyone on a server without keys)."""
        if not state.api_keys:
            return None, True
        return state.owner(request), state.loras.is_admin(bearer_token(request.headers.get("authorization", "")))

    def lora_refusal(e: LoraRefused) -> APIError:
        kind = "permission_error" if e.status == 403 else "invalid_request_error"
        return APIError(e.status, str(e), kind, param=e.param, code=e.code)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request):
        runtime_lora()
        owner, _ = lora_caller(request)
        try:  # rank 0's check of the folder (inside --lora-root; headers only), off the event loop
            state.loras.room_for(owner)
            adapter = await run_in_threadpool(state.loras.check, body.lora_name, body.lora_path,
                                              body.base_model_name, True)
            state.loras.register(adapter, owner, runtime=True)
        except LoraRefused as e:
            raise lora_refusal(e) from None
        except (ValueError, OSError) as e:  # LoraError, CheckpointError: the folder, named
            raise APIError(400, str(e), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request):
        runtime_lora()
        owner, admin = lora_caller(request)
        try:
            adapter = state.loras.retire(body.lora_name, owner, admin)
        except KeyError:
            raise APIError(404, f"The LoRA adapter '{body.lora_name}' is not loaded", "not_found_error",
                           param="lora_name", code="lora_not_found") from None
        except LoraRefused as e:
            raise lora_refusal(e) from None
        await asyncio.wrap_future(state.engine.call_soon(lambda: state.engine.loras.retire(adapter)))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    # ---- completions ---------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        lora = check_model(state, body.model)
        if body.suffix:
            raise APIError(400, "suffix (text insertion) is not supported by this server", param="suffix")
        refuse_long_prompts(state, body.prompt)  # (a prompt whose length proves it too long: before tokenizing)

        def prepare() -> tuple[list[list[int]], list[str]]:  # in the CpuPool, off the event loop
            ids = tokenize_prompts(state, body.prompt)
            return ids, [decode_prompt(state, p) if body.echo else "" for p in ids]

        prompts, echo_text = await state.cpu.run(prompt_chars(body.prompt), prepare, gone=request.is_disconnected)
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        params = sampling_params(body, max_tokens, body.logprobs, logit_bias(state, body))
        if body.echo and body.logprobs is not None:  # the prompt's tokens get logprobs too, as OpenAI's legacy API
            params.prompt_logprobs = body.logprobs
        for ids in prompts:
            check_length(state, ids, max_tokens)
        constraint, _ = output_constraint(state, body)
        compiled = await state.engine.grammars.compile(constraint, state.owner(request, by_host=True),
                                                       request.is_disconnected) if constraint else None
        req = PendingRequest(state, asyncio.get_running_loop(), body.stream)
        req.lora = lora
        for p_i, ids in enumerate(prompts):
            for c in range(body.n):
                req.add(ids, with_seed(params, c), p_i * body.n + c, Grammars.state(compiled) if compiled else None)
        admit(state, req)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return EventStream(req, stream_completion(req, body, rid, created, echo_text, prompts))
        await gather(req, request)
        return completion_response(state, req, body, rid, created, echo_text, prompts)

    # ---- chat ----------------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        lora = check_model(state, body.model)
        constraint, plan = output_constraint(state, body)
        ids = await state.cpu.run(render_cost(state, body), render_chat, state, body,  # off the event loop
                                  gone=request.is_disconnected)
        max_tokens = body.max_completion_tokens or body.max_tokens or (state.max_model_len - len(ids))
        top = body.top_logprobs if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        params = sampling_params(body, max_tokens, (top or 0) if body.logprobs else None, logit_bias(state, body))
        check_length(state, ids, max_tokens)
        reader = answer_reader(state, plan, ids, body.tools, params)
        compiled = await state.engine.grammars.compile(constraint, state.owner(request, by_host=True),
                                                       request.is_disconnected) if constraint else None
        req = PendingRequest(state, asyncio.get_running_loop(), body.stream)
        req.lora = lora
        for c in range(body.n):
            req.add(ids, with_seed(params, c), c, Grammars.state(compiled, reader.gate()) if compiled else None)
        admit(state, req)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return EventStream(req, stream_chat(req, body, rid, created, ids, reader))
        await gather(req, request)
        return chat_response(state, req, body, rid, created, ids, reader)

    state.metrics.watch_experts(state.engine.executor.model)

    # ---- endpoint modules ----------------------------------------------------------------------------------
    if state.pooling is None:
        state.pooling = pooling_config(state.engine.executor.cfg.model, state.engine.executor.config)
    embeddings.add_routes(app, state)
    if state.responses is None:
        state.responses = ResponseStore(metrics=state.metrics)
    elif state.responses.metrics is None:
        state.responses.metrics = state.metrics
    state.responses.shared_by(len(state.api_keys))  # (each key held to its share once there are several)
    responses_api.add_routes(app, state)
    tokenize_api.add_routes(app, state)
    return app
