"""OpenAI's response shapes: the bodies of gathered answers, the chunks of streamed ones, usage and logprobs.

Streams are SSE (`data: {...}` then `data: [DONE]`). A chat answer is read by its output parser
(server/api/parsers/): with a reasoning parser its reasoning comes apart as `message.reasoning_content` (and
`reasoning`, vLLM's newer name; `delta.*` streamed) and usage counts `completion_tokens_details.reasoning_tokens`;
with tool calls read, it carries `message.tool_calls` and finish_reason "tool_calls"; streamed, each call arrives as
a `delta.tool_calls` entry (id, type and name first, then the arguments), the way OpenAI sends them.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import AsyncIterator

from fastapi.responses import Response

from server.api.state import PendingRequest, ServerState, failure, stream_events
from server.api.protocol import ChatCompletionRequest, CompletionRequest
from server.engine.request import Sequence
from server.api.parsers.hermes import HermesParser
from server.api.tool_calls import ToolPlan, new_call_id


_OPEN_CALL = re.compile(r"<tool_call>\s*(\{.*)\Z", re.S)
_CALL_NAME = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_CALL_ARGS = re.compile(r'"arguments"\s*:\s*(.*)\Z', re.S)


def truncated_call(content: str | None, body: ChatCompletionRequest) -> dict | None:
    """A forced tool call that max_tokens cut off: the call with its name and the arguments as far as they came, as
    OpenAI answers (finish_reason "length", arguments that do not parse), so a client sees a cut call instead of
    markup in the content. A name cut off too is the one tool_choice named (or the only tool); None otherwise."""
    text = (content or "").strip()
    m = _OPEN_CALL.search(text)
    if m is None and not (text and "<tool_call>".startswith(text)):  # (cut inside the opening tag itself)
        return None
    partial = m.group(1) if m is not None else ""
    name_match = _CALL_NAME.match(partial)
    name = None
    if name_match is not None:
        try:
            name = json.loads(f'"{name_match.group(1)}"')
        except ValueError:
            pass
    if name is None:
        choice = body.tool_choice
        name = choice.function.name if not isinstance(choice, str) else (
            body.tools[0].function.name if len(body.tools) == 1 else None)
    if name is None:
        return None
    args = _CALL_ARGS.search(partial)
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": args.group(1) if args else ""}}


def usage(prompts: list[list[int]], seqs: list[Sequence], reasoning_tokens: int | None = None) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(s.output_ids) for s in seqs)
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


class AnswerReader:
    """How a chat request's answers are read: a new output parser per choice (None: the text is the content), and
    what their reasoning cost in tokens."""

    def __init__(self, state: ServerState, plan: ToolPlan | None, start_state: str | None, tools=None) -> None:
        self.state, self.plan, self.start_state = state, plan, start_state
        self.tools = [t.model_dump(exclude_none=True) for t in tools or ()]
        self.reasoning = state.parsers.reasoning_cls is not None

    def cut_call(self, seq: Sequence, content: str, calls: list[dict], body: ChatCompletionRequest) -> dict | None:
        """A forced call that max_tokens cut off before the parser could read even its name: the call tool_choice
        named (or the only tool), with the arguments as far as they came when the format shows them (Hermes's)."""
        if calls or seq.finish_reason != "length" or self.plan is None or not self.plan.forced:
            return None
        if self.plan.parser is HermesParser:
            return truncated_call(content, body)
        choice = body.tool_choice
        name = choice.function.name if not isinstance(choice, str) else (
            body.tools[0].function.name if len(body.tools) == 1 else None)
        if name is None:
            return None
        return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}

    def new(self):
        return self.state.parsers.parser(self.plan.parser if self.plan else None, self.start_state, self.tools)

    def reasoning_tokens(self, seq: Sequence, reasoning: str) -> int:
        return self.state.parsers.reasoning_tokens(seq.output_ids, reasoning)

    @property
    def parses(self) -> bool:
        return self.reasoning or self.plan is not None

    def gate(self):
        """A new sequence's grammar gate: its constraint holds after the reasoning (None: from the first token). A
        harmony call forced by its own grammar spells the analysis channel itself."""
        harmony_call = self.plan is not None and self.plan.forced and self.state.parsers.harmony
        return self.state.parsers.gate(self.start_state, grammar_has_reasoning=harmony_call)


def answer_reader(state: ServerState, plan: ToolPlan | None, prompt_ids: list[int], tools, params) -> AnswerReader:
    """The reader of a chat request's answers; its answers keep their special tokens in their text when the
    parser reads markers that are special tokens (as vLLM does)."""
    start = None
    if state.parsers.reasoning_cls is not None:
        start = state.parsers.start_state(state.tokenizer.decode(prompt_ids[-64:], skip_special_tokens=False))
    reader = AnswerReader(state, plan, start, tools)
    cls = plan.parser if plan is not None else None
    if reader.parses and (state.parsers.needs_special_tokens or (cls is not None and cls.needs_special_tokens)):
        params.skip_special_tokens = False
    return reader


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


class EventStream(Response):
    """A streamed answer as server-sent events, sent by a plain ASGI loop: one JSON encoding and one `send` per chunk.

    Starlette's StreamingResponse would relay each chunk through one more generator and an anyio task group, and the
    route used to wait on its queue with a timer per token to notice a client that had gone away. Here a second task
    waits for the client to go away (`receive()` returns http.disconnect) and closes the request: its sequences are
    aborted, which frees their KV-cache blocks, and the stream ends. (What the served path costs per token, and where
    its floor is on a CPU whose cores run the decode: BENCHMARKS.md, section 13.)"""

    media_type = "text/event-stream"

    def __init__(self, req: PendingRequest, chunks: AsyncIterator[dict]):
        self.req, self.chunks = req, chunks
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    end = b"data: [DONE]\n\n"  # what closes the stream

    @staticmethod
    def encode(chunk: dict) -> bytes:
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()

    async def __call__(self, scope, receive, send) -> None:
        req = self.req

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            req.close()  # a no-op for finished sequences (uvicorn reports a disconnect after the last body too)

        watcher = asyncio.get_running_loop().create_task(watch())
        encode = self.encode
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": encode(chunk), "more_body": True})
            await send({"type": "http.response.body", "body": self.end, "more_body": False})
        finally:
            watcher.cancel()
            req.abort()  # a no-op for finished sequences; frees the slots of a stream cut short by anything
            await self.chunks.aclose()
        if self.background is not None:
            await self.background()


def error_chunk(state: ServerState, seq=None) -> dict:
    return failure(state, seq).body()


async def stream_completion(req: PendingRequest, body: CompletionRequest, rid: str, created: int, echo_text: list[str],
                            prompts: list[list[int]]):
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
    async for seq, text, finished, a, b in stream_events(req):
        if seq.finish_reason == "error":
            yield error_chunk(state, seq)
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


def finish_reason(seq: Sequence, calls: list[dict]) -> str | None:
    """OpenAI's "tool_calls" when an answer that ended by itself made calls."""
    return "tool_calls" if calls and seq.finish_reason == "stop" else seq.finish_reason


def completion_response(state: ServerState, req: PendingRequest, body: CompletionRequest, rid: str, created: int,
                        echo_text: list[str], prompts: list[list[int]]) -> dict:
    choices = []
    for seq in sorted(req.seqs, key=lambda s: req.index[s.seq_id]):
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
            "choices": choices, "usage": usage(prompts, req.seqs)}


def chat_response(state: ServerState, req: PendingRequest, body: ChatCompletionRequest, rid: str, created: int,
                  prompt_ids: list[int], reader: AnswerReader) -> dict:
    choices = []
    reasoning_tokens = 0
    for seq in sorted(req.seqs, key=lambda s: req.index[s.seq_id]):
        message: dict = {"role": "assistant", "content": seq.detok.text}
        calls: list[dict] = []
        parser = reader.new()
        if parser is not None:
            out = parser.parse(seq.detok.text, cut=seq.finish_reason == "length")
            calls = out.calls
            cut = reader.cut_call(seq, out.content, calls, body)
            if cut is not None:
                out.content, calls = "", [cut]
            message["content"] = out.content if out.content or not calls else None
            if reader.reasoning:
                message["reasoning_content"] = message["reasoning"] = out.reasoning or None
                reasoning_tokens += reader.reasoning_tokens(seq, out.reasoning)
            if calls:
                message["tool_calls"] = calls
        choices.append({"index": req.index[seq.seq_id], "message": message,
                        "logprobs": chat_logprobs(state, seq, 0, len(seq.output_ids)) if body.logprobs else None,
                        "finish_reason": finish_reason(seq, calls)})
    return {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
            "choices": choices,
            "usage": usage([prompt_ids], req.seqs, reasoning_tokens if reader.reasoning else None)}


async def stream_chat(req: PendingRequest, body: ChatCompletionRequest, rid: str, created: int, prompt_ids: list[int],
                      reader: AnswerReader):
    state = req.state

    def chunk(i: int, delta: dict, finish: str | None, logprobs=None) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    parsers = {seq.seq_id: reader.new() for seq in req.seqs}
    reasoning_tokens = 0
    for i in range(len(req.seqs)):
        yield chunk(i, {"role": "assistant", "content": ""}, None)
    async for seq, text, finished, a, b in stream_events(req):
        if seq.finish_reason == "error":
            yield error_chunk(state, seq)
            return
        i = req.index[seq.seq_id]
        lp = chat_logprobs(state, seq, a, b) if body.logprobs and b > a else None
        parser = parsers.get(seq.seq_id)
        if parser is None:
            if text or finished or lp:
                yield chunk(i, {"content": text} if text else {}, seq.finish_reason if finished else None, lp)
            continue
        out = parser.feed(text)
        if finished:
            out.add(parser.finish(cut=seq.finish_reason == "length"))
            cut = reader.cut_call(seq, out.content, parser.calls, body)
            if cut is not None:
                out.content, out.calls = "", [cut]
                parser.calls.append(cut)
            if reader.reasoning:
                reasoning_tokens += reader.reasoning_tokens(seq, parser.reasoning_text)
        if out.reasoning:
            yield chunk(i, {"reasoning_content": out.reasoning, "reasoning": out.reasoning}, None)
        if out.content or lp:
            yield chunk(i, {"content": out.content} if out.content else {}, None, lp)
        for call in out.calls:  # OpenAI's shape: id, type and name first, then the arguments
            k = parser.calls.index(call)
            fn = call["function"]
            yield chunk(i, {"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                            "function": {"name": fn["name"], "arguments": ""}}]}, None)
            yield chunk(i, {"tool_calls": [{"index": k, "function": {"arguments": fn["arguments"]}}]}, None)
        if finished:
            yield chunk(i, {}, finish_reason(seq, parser.calls))
    if body.stream_options and body.stream_options.include_usage:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
               "choices": [], "usage": usage([prompt_ids], req.seqs, reasoning_tokens if reader.reasoning else None)}
