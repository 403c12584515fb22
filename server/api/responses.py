"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel.

A request is translated into the chat request it means (instructions -> a system message; message items, function
calls and their outputs -> chat messages; tools, tool_choice and text.format -> their chat forms) and runs through the
same preparation as /v1/chat/completions (server/api/preprocess.py): the chat template, the grammar engine for text.format
and forced tool calls, the output parsers (server/api/parsers/) for reasoning and tool calls. What comes back is
shaped as output items: a `reasoning` item first when the model reasoned (its text as `reasoning_text` content, and
as the summary when `reasoning.summary` asks for one: this server does not summarize), a `message` with
`output_text` parts, and one `function_call` item per call. Streamed, the typed events come in OpenAI's order, each
with its `sequence_number`. `reasoning.effort` reaches chat templates that read it (gpt-oss's).

Stored responses (`store`, default true as OpenAI) keep the conversation they end, so `previous_response_id` continues
it. The store is bounded in bytes and in count, least recently used first out, and each API key to its share of both
(ResponseStore); a response is visible only to the API key that made it (a response of another key is "not found",
never "forbidden": ids do not leak). It is in memory only: a restart forgets it. A `previous_response_id` with no
conversation to continue is OpenAI's 400 previous_response_not_found; a response that did not finish (its client gone,
cancelled, failed) keeps its input; a DELETE while the response runs is not undone when the run ends.

What is not implemented is refused with a 400 naming the field: background, built-in tools, reasoning options a model
has no switch for, conversation, prompt templates, truncation "auto", item references, images and files.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ConfigDict, ValidationError

from server.engine.structured.grammar import Grammars
from server.api.state import PendingRequest, ServerState, admit, gather, stream_events
from server.api.preprocess import (check_length, check_model, output_constraint, render_chat, render_cost,
                                   sampling_params)
from server.api.protocol import APIError, ChatCompletionRequest, RequestBody
from server.api.bodies import AnswerReader, EventStream, answer_reader, chat_logprobs
from server.engine.request import Sequence
from server.defaults import DEFAULT_STORE_KEY_SHARE  # (in a light module: the CLI shows it)

MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
DEFAULT_STORE_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_STORE_MAX_COUNT = 10_000
BUILTIN_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "mcp", "computer_use_preview",
                 "image_generation", "local_shell", "custom")


class ResponsesRequest(RequestBody):
    """The Responses API's request body. Fields are typed loosely here and checked in `to_chat` with messages that
    name the field; unknown fields are ignored as on the other endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    # accepted, change nothing in the answer: service_tier, prompt_cache_key, safety_identifier, stream_options
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extras, as on chat
    seed: int | None = None
    top_k: int | None = None
    ignore_eos: bool = False


def _refuse(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param=param)


def _check_unsupported(body: ResponsesRequest) -> None:
    if body.background:
        raise _refuse("background", "background responses are not supported by this server; send stream or wait "
                                    "for the answer")
    if body.reasoning:
        unknown = sorted(set(body.reasoning) - {"effort", "summary", "generate_summary"})
        if unknown:
            raise _refuse("reasoning", f"unknown option {unknown[0]!r} (effort and summary are read)")
        summary = body.reasoning.get("summary", body.reasoning.get("generate_summary"))
        if summary not in (None, "auto", "concise", "detailed"):
            raise _refuse("reasoning.summary", "must be auto, concise or detailed")
    if body.conversation is not None:
        raise _refuse("conversation", "the Conversations API is not supported; chain with previous_response_id")
    if body.prompt is not None:
        raise _refuse("prompt", "stored prompt templates are not supported; send input and instructions")
    if body.truncation not in (None, "disabled"):
        raise _refuse("truncation", 'only "disabled" is supported: a conversation longer than the context is a 400')
    if body.max_tool_calls is not None:
        raise _refuse("max_tool_calls", "not supported; use parallel_tool_calls=false for at most one call")
    fmt = (body.text or {}).get("verbosity")
    if fmt not in (None, "medium"):
        raise _refuse("text.verbosity", "this model has no verbosity control")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise _refuse("top_logprobs", "must be between 0 and 20")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise _refuse("max_output_tokens", "must be at least 1")
    if body.metadata is not None:  # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512
        if len(body.metadata) > MAX_METADATA_PAIRS:
            raise _refuse("metadata", f"at most {MAX_METADATA_PAIRS} key-value pairs (got {len(body.metadata)})")
        for k, v in body.metadata.items():
            if len(k) > MAX_METADATA_KEY:
                raise _refuse("metadata", f"keys are at most {MAX_METADATA_KEY} characters (one has {len(k)})")
            if len(v) > MAX_METADATA_VALUE:
                raise _refuse("metadata", f"values are at most {MAX_METADATA_VALUE} characters (the one of {k!r} "
                                          f"has {len(v)})")
    for inc in body.include or []:
        if inc not in ("message.output_text.logprobs", "reasoning.encrypted_content"):
            raise _refuse("include", f"{inc!r} is not supported (supported: message.output_text.logprobs, and "
                                     "reasoning.encrypted_content, which is empty for this model)")


def _text(content, where: str) -> str:
    """The text of a message's content: a string, or input_text / output_text / refusal parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(where, "content must be a string or a list of parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                raise _refuse(f"{where}[{j}].text", "must be a string")
            out.append(part["text"])
        elif kind == "refusal":
            out.append(str(part.get("refusal", "")))
        elif kind in ("input_image", "input_file", "input_audio"):
            raise _refuse(f"{where}[{j}].type", f"{kind} is not supported: this server serves a text-only model")
        else:
            raise _refuse(f"{where}[{j}].type", f"unknown content part type {kind!r}")
    return "".join(out)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict]:
    """Input items as chat messages (OpenAI's chat shapes): consecutive function calls become one assistant message
    with several tool_calls (after the assistant's text, if any), and each call's output a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    reasoning = ""  # a reasoning item's text, until the assistant message or call it came before
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _refuse(f"input[{i}]", "an input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _refuse(f"input[{i}].role", f"unknown role {role!r}")
            messages.append({"role": role, "content": _text(item.get("content"), f"input[{i}].content")})
            if role == "assistant" and reasoning:
                messages[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise _refuse(f"input[{i}].{key}", "a function_call item needs call_id, name and arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":  # its text, or the calls before it
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if reasoning:
                messages[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _refuse(f"input[{i}].call_id", "a function_call_output item needs the call_id it answers")
            out = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": out if isinstance(out, str) else _text(out, f"input[{i}].output")})
        elif kind == "reasoning":  # the next assistant turn's reasoning (what a template may render back)
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise _refuse(f"input[{i}].content", "a reasoning item's content (or summary) is a list of text parts")
            reasoning = "".join(p["text"] for p in parts)
        elif kind == "item_reference":
            raise _refuse(f"input[{i}].type", "items are not referenced by id by this server: send the item")
        else:
            raise _refuse(f"input[{i}].type", f"unknown input item type {kind!r}")
    return messages


def _tools(body: ResponsesRequest) -> list[dict] | None:
    if body.tools is None:
        return None
    out = []
    for i, tool in enumerate(body.tools):
        kind = tool.get("type")
        if kind in BUILTIN_TOOLS or (isinstance(kind, str) and kind.startswith(BUILTIN_TOOLS)):
            raise _refuse(f"tools[{i}].type", f"the built-in tool {kind!r} is not supported by this server; "
                                              "only function tools")
        if kind != "function":
            raise _refuse(f"tools[{i}].type", f"unknown tool type {kind!r}")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _refuse("tool_choice", f"unsupported tool_choice {choice!r}: send none, auto, required or "
                                 '{"type": "function", "name": ...}')


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    raise _refuse("text.format.type", f"unknown format {kind!r} (supported: text, json_object, json_schema)")


# the chat request's field names, as a Responses client knows them (errors name the field the client sent)
CHAT_NAMES = (("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
              ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
              ("messages", "input"), ("reasoning_effort", "reasoning.effort"))


def responses_error(e: APIError) -> APIError:
    """An error of the chat preparation, with the Responses API's names for the fields."""
    msg, param = e.message, e.param
    for chat, ours in CHAT_NAMES:
        msg = msg.replace(chat, ours)
        if param is not None and param.startswith(chat):
            param = ours + param[len(chat):]
    if param is not None and param.startswith("tools"):  # tools[i].function.parameters -> tools[i].parameters
        param = param.replace(".function.", ".")
        msg = msg.replace(".function.parameters", ".parameters")
    e.message, e.param = msg, param
    return e


def to_chat(body: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request this Responses request means, and the conversation's messages without the instructions
    (what a stored response keeps for previous_response_id)."""
    _check_unsupported(body)
    messages = history + input_messages(body.input)
    if not messages:
        raise _refuse("input", "the input is empty")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields = {"messages": system + messages, "max_tokens": body.max_output_tokens, "temperature": body.temperature,
              "top_p": body.top_p, "tools": _tools(body), "tool_choice": _tool_choice(body.tool_choice),
              "response_format": _response_format(body.text), "user": body.user, "seed": body.seed,
              "top_k": body.top_k, "ignore_eos": body.ignore_eos, "logprobs": body.top_logprobs is not None or bool(
                  body.include and "message.output_text.logprobs" in body.include),
              "top_logprobs": body.top_logprobs, "reasoning_effort": (body.reasoning or {}).get("effort")}
    if body.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        raise APIError(400, f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")), param=loc or None) from None
    return chat, messages


# ---- the store ----------------------------------------------------------------------------------------------------
@dataclass
class Stored:
    response: dict
    messages: list[dict]  # the conversation up to and including this response's output (no instructions)
    owner: str | None
    size: int = 0
    pending: PendingRequest | None = None  # while in progress: what cancel aborts
    running: bool = False  # put while its run goes on: the run stores it again when it ends


class ResponseStore:
    """Responses by id, bounded in bytes (their JSON) and in count; the least recently used leave first. Each API key
    may fill at most `key_share` of either bound (once the server has several keys, `shared_by`): past it, that key's
    own least recently used responses leave, so one client storing a lot pushes out its own history, not everyone's.

    A response deleted while its run goes on leaves a tombstone, so the run's last store does not bring it back. The
    store is in memory only: a restart forgets every response (a client chaining from one then gets a 400,
    previous_response_not_found)."""

    def __init__(self, max_bytes: int = DEFAULT_STORE_MAX_BYTES, max_count: int = DEFAULT_STORE_MAX_COUNT,
                 metrics=None, key_share: float = DEFAULT_STORE_KEY_SHARE):
        if not 0 < key_share <= 1:
            raise ValueError(f"the share of the responses store one API key may fill must be in (0, 1], got "
                             f"{key_share}")
        self.max_bytes, self.max_count, self.key_share = max_bytes, max_count, key_share
        self.per_key = False  # whether key_share applies (shared_by)
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._by_owner: dict[str | None, OrderedDict[str, None]] = {}  # each owner's ids, least recently used first
        self._owner_bytes: dict[str | None, int] = {}
        self._deleted: OrderedDict[str, str | None] = OrderedDict()  # id -> owner: deleted while its run went on
        self.bytes = 0
        self.evicted = 0
        self._lock = threading.Lock()
        self.metrics = metrics

    def shared_by(self, keys: int) -> None:
        """The number of API keys the server takes: with two or more, each key is held to its share; with one key
        or none every client is the same owner, and the whole store is theirs."""
        self.per_key = keys > 1 and self.key_share < 1

    @property
    def key_max_bytes(self) -> int:
        return int(self.max_bytes * self.key_share) if self.per_key else self.max_bytes

    @property
    def key_max_count(self) -> int:
        return max(1, int(self.max_count * self.key_share)) if self.per_key else self.max_count

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, entry: Stored) -> bool:
        """Store (or replace) a response; False when it was deleted while its run went on (it stays deleted)."""
        entry.size = len(json.dumps(entry.response)) + len(json.dumps(entry.messages))
        with self._lock:
            if self._deleted.get(rid, ()) == entry.owner:  # deleted while its run went on: stays deleted
                if not entry.running:
                    del self._deleted[rid]  # (the run's last store: nothing more comes for this id)
                return False
            self._remove(rid)
            self._items[rid] = entry
            self._by_owner.setdefault(entry.owner, OrderedDict())[rid] = None
            self._owner_bytes[entry.owner] = self._owner_bytes.get(entry.owner, 0) + entry.size
            self.bytes += entry.size
            own = self._by_owner[entry.owner]
            while own and (self._owner_bytes[entry.owner] > self.key_max_bytes or len(own) > self.key_max_count):
                self._evict(next(iter(own)))  # past its key's share: that key's least recently used first
            while self._items and (self.bytes > self.max_bytes or len(self._items) > self.max_count):
                self._evict(next(iter(self._items)))
            self._sync()
            return rid in self._items

    def get(self, rid: str, owner: str | None) -> Stored:
        with self._lock:
            entry = self._items.get(rid)
            if entry is None or entry.owner != owner:
                raise APIError(404, f"no response with id {rid!r} (never stored, deleted, or evicted from this "
                                    "server's bounded store)", "not_found_error", param="response_id",
                               code="response_not_found")
            self._items.move_to_end(rid)
            self._by_owner[owner].move_to_end(rid)
            return entry

    def conversation(self, rid: str, owner: str | None) -> list[dict]:
        """The messages a request with previous_response_id=rid continues; a 400 naming the field (OpenAI's
        previous_response_not_found) when there is none to continue: never stored (store=false), deleted, evicted,
        forgotten by a restart, another key's, still in progress, or stored without its conversation."""
        try:
            entry = self.get(rid, owner)
        except APIError:
            raise APIError(400, f"Previous response with id {rid!r} not found (never stored, deleted, evicted from "
                                "this server's bounded store, or lost in a restart: the store is in memory only)",
                           param="previous_response_id", code="previous_response_not_found") from None
        if entry.response["status"] == "in_progress":
            raise _refuse("previous_response_id", f"the response {rid!r} is still in progress")
        if not entry.messages:
            raise APIError(400, f"previous_response_id: the response {rid!r} has no stored conversation to continue",
                           param="previous_response_id", code="previous_response_not_found")
        return [dict(m) for m in entry.messages]

    def delete(self, rid: str, owner: str | None) -> None:
        with self._lock:
            entry = self._items.get(rid)
            if entry is None or entry.owner != owner:
                raise APIError(404, f"no response with id {rid!r} (never stored, deleted, or evicted from this "
                                    "server's bounded store)", "not_found_error", param="response_id",
                               code="response_not_found")
            self._remove(rid)
            if entry.running:  # its run stores it again when it ends: that store is dropped
                self._deleted[rid] = owner
                while len(self._deleted) > self.max_count:  # (a run that never stored again: forgotten in turn)
                    self._deleted.popitem(last=False)
            self._sync()

    def _remove(self, rid: str) -> Stored | None:
        entry = self._items.pop(rid, None)
        if entry is not None:
            self.bytes -= entry.size
            own = self._by_owner[entry.owner]
            del own[rid]
            self._owner_bytes[entry.owner] -= entry.size
            if not own:
                del self._by_owner[entry.owner], self._owner_bytes[entry.owner]
        return entry

    def _evict(self, rid: str) -> None:
        self._remove(rid)
        self.evicted += 1
        if self.metrics is not None:
            self.metrics.responses_evicted.inc()

    def _sync(self) -> None:
        if self.metrics is not None:
            self.metrics.responses_stored.set(len(self._items))
            self.metrics.responses_store_bytes.set(self.bytes)


# ---- shapes -------------------------------------------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(prompt_ids: list[int], seq: Sequence, reasoning_tokens: int = 0) -> dict:
    n_in, n_out = len(prompt_ids), len(seq.output_ids)
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": seq.num_cached_prompt},
            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": n_in + n_out}


def reasoning_item(rid: str, text: str, status: str, summary: bool) -> dict:
    """The model's reasoning as an output item: its text as reasoning_text content, and as the summary when one was
    asked for (reasoning.summary; the text as it came, not summarized)."""
    return {"type": "reasoning", "id": rid, "status": status,
            "summary": [{"type": "summary_text", "text": text}] if summary and text else [],
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(mid: str, text: str, status: str, logprobs: list | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"type": "message", "id": mid, "status": status, "role": "assistant", "content": [part]}


def call_item(call: dict, status: str = "completed", arguments: str | None = None) -> dict:
    fn = call["function"]
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"] if arguments is None else arguments, "status": status}


@dataclass
class Run:
    """One Responses request on its way: the chat request it became, and what its response object says."""

    state: ServerState
    body: ResponsesRequest
    chat: ChatCompletionRequest
    messages: list[dict]
    prompt_ids: list[int]
    reader: AnswerReader
    owner: str | None
    rid: str = field(default_factory=lambda: _new_id("resp"))
    created: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[dict], seq: Sequence | None = None, error: dict | None = None) -> dict:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        text_format = (b.text or {}).get("format") or {"type": "text"}
        out_text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "error": error, "incomplete_details": incomplete, "instructions": b.instructions,
                "max_output_tokens": b.max_output_tokens, "model": self.state.model_name, "output": output,
                "output_text": out_text, "parallel_tool_calls": self.chat.parallel_tool_calls,
                "previous_response_id": b.previous_response_id,
                "reasoning": {"effort": self.chat.reasoning_effort, "summary": self.summary_mode},
                "store": b.store, "temperature": 1.0 if b.temperature is None else b.temperature,
                "text": {"format": text_format}, "tool_choice": b.tool_choice or ("auto" if b.tools else "none"),
                "tools": b.tools or [], "top_p": 1.0 if b.top_p is None else b.top_p, "truncation": "disabled",
                "usage": usage(self.prompt_ids, seq, self.reasoning_tokens) if seq is not None else None,
                "user": b.user,
                "metadata": b.metadata or {}, "background": False, "top_logprobs": b.top_logprobs}

    reasoning_tokens: int = 0

    @property
    def summary_mode(self) -> str | None:
        r = self.body.reasoning or {}
        return r.get("summary", r.get("generate_summary"))

    def output(self, seq: Sequence, mid: str) -> list[dict]:
        text = seq.detok.text
        calls: list[dict] = []
        items = []
        parser = self.reader.new()
        if parser is not None:
            out = parser.parse(text, cut=seq.finish_reason == "length")
            text, calls = out.content, out.calls
            cut = self.reader.cut_call(seq, text, calls, self.chat)
            if cut is not None:
                text, calls = "", [cut]
            if out.reasoning:
                self.reasoning_tokens = self.reader.reasoning_tokens(seq, out.reasoning)
                items.append(reasoning_item(_new_id("rs"), out.reasoning, "completed", self.summary_mode is not None))
        if text or not calls:
            lp = chat_logprobs(self.state, seq, 0, len(seq.output_ids))["content"] if self.chat.logprobs else None
            items.append(message_item(mid, text or "", "completed" if seq.finish_reason != "length" else "incomplete",
                                      lp))
        items.extend(call_item(c) for c in calls)
        return items

    def status(self, seq: Sequence) -> str:
        if seq.finish_reason == "error":
            return "failed"
        if seq.finish_reason == "abort":
            return "cancelled"
        return "incomplete" if seq.finish_reason == "length" else "completed"

    def store(self, response: dict, pending: PendingRequest | None = None) -> None:
        if not self.body.store:
            return
        messages = self.messages + input_messages(response["output"])  # output items are valid input items
        self.state.responses.put(self.rid, Stored(response, messages, self.owner, pending=pending))


class ResponseStream:
    """The typed events of one streamed response, in OpenAI's order: created, in_progress, then per output item
    added -> (content_part.added -> output_text.delta... -> output_text.done -> content_part.done | arguments.delta
    -> arguments.done) -> item done, and last completed / incomplete / failed. Every event has its sequence_number."""

    def __init__(self, run: Run, req: PendingRequest):
        self.run, self.req = run, req
        self.number = 0
        self.output: list[dict] = []
        self.text: list[str] = []
        self.logprobs: list = []
        self.mid = _new_id("msg")
        self.msg_index: int | None = None
        self.parser = run.reader.new()
        self.rs_id = _new_id("rs")
        self.rs_index: int | None = None  # the reasoning item, while open
        self.reasoning: list[str] = []

    def event(self, kind: str, **fields) -> dict:
        self.number += 1
        return {"type": kind, "sequence_number": self.number - 1, **fields}

    def open_message(self) -> list[dict]:
        self.msg_index = k = len(self.output)
        self.output.append(message_item(self.mid, "", "in_progress"))
        return [self.event("response.output_item.added", output_index=k,
                           item=message_item(self.mid, "", "in_progress") | {"content": []}),
                self.event("response.content_part.added", item_id=self.mid, output_index=k, content_index=0,
                           part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def close_message(self, status: str) -> list[dict]:
        k, full = self.msg_index, "".join(self.text)
        item = message_item(self.mid, full, status, self.logprobs if self.run.chat.logprobs else None)
        self.output[k] = item
        return [self.event("response.output_text.done", item_id=self.mid, output_index=k, content_index=0,
                           text=full, logprobs=item["content"][0]["logprobs"]),
                self.event("response.content_part.done", item_id=self.mid, output_index=k, content_index=0,
                           part=item["content"][0]),
                self.event("response.output_item.done", output_index=k, item=item)]

    def open_reasoning(self) -> list[dict]:
        if self.reasoning:  # (reasoning again after the answer began, as harmony may: an item of its own)
            self.rs_id, self.reasoning = _new_id("rs"), []
        self.rs_index = k = len(self.output)
        item = reasoning_item(self.rs_id, "", "in_progress", False)
        self.output.append(item)
        return [self.event("response.output_item.added", output_index=k, item=item)]

    def close_reasoning(self) -> list[dict]:
        k, full = self.rs_index, "".join(self.reasoning)
        self.rs_index = None
        summary = self.run.summary_mode is not None
        item = reasoning_item(self.rs_id, full, "completed", summary)
        self.output[k] = item
        events = [self.event("response.reasoning_text.done", item_id=self.rs_id, output_index=k, content_index=0,
                             text=full)]
        if summary:
            part = {"type": "summary_text", "text": full}
            events += [self.event("response.reasoning_summary_part.added", item_id=self.rs_id, output_index=k,
                                  summary_index=0, part={"type": "summary_text", "text": ""}),
                       self.event("response.reasoning_summary_text.delta", item_id=self.rs_id, output_index=k,
                                  summary_index=0, delta=full),
                       self.event("response.reasoning_summary_text.done", item_id=self.rs_id, output_index=k,
                                  summary_index=0, text=full),
                       self.event("response.reasoning_summary_part.done", item_id=self.rs_id, output_index=k,
                                  summary_index=0, part=part)]
        return events + [self.event("response.output_item.done", output_index=k, item=item)]

    def message_open(self) -> bool:
        return self.msg_index is not None and self.output[self.msg_index]["status"] == "in_progress"

    def call(self, call: dict) -> list[dict]:
        events = self.close_message("completed") if self.message_open() else []
        k, item = len(self.output), call_item(call)
        self.output.append(item)
        return events + [
            self.event("response.output_item.added", output_index=k, item=call_item(call, "in_progress", "")),
            self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                       delta=item["arguments"]),
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                       arguments=item["arguments"], name=item["name"]),
            self.event("response.output_item.done", output_index=k, item=item)]

    async def events(self):
        run, finished_response = self.run, False
        try:
            async for e in self._events():
                finished_response |= e["type"] in ("response.completed", "response.incomplete", "response.failed")
                yield e
        finally:
            if not finished_response and run.body.store:  # the client left mid-stream: not left "in_progress"
                run.store(run.response("cancelled", self.output))

    async def _events(self):
        run, state, seq = self.run, self.run.state, self.req.seqs[0]
        yield self.event("response.created", response=run.response("in_progress", []))
        yield self.event("response.in_progress", response=run.response("in_progress", []))
        if self.parser is None:  # plain text: the message opens at once
            for e in self.open_message():
                yield e
        async for seq, new, finished, a, b in stream_events(self.req):
            if seq.finish_reason == "error":
                error = {"code": "server_error", "message": f"the engine failed: {state.engine.dead}"}
                response = run.response("failed", self.output, seq, error)
                run.store(response)
                yield self.event("response.failed", response=response)
                return
            lp = chat_logprobs(state, seq, a, b)["content"] if run.chat.logprobs and b > a else []
            self.logprobs.extend(lp)
            calls: list[dict] = []
            if self.parser is not None:
                out = self.parser.feed(new)
                if finished:
                    out.add(self.parser.finish(cut=seq.finish_reason == "length"))
                    cut = run.reader.cut_call(seq, out.content, self.parser.calls, run.chat)
                    if cut is not None:
                        out.content, out.calls = "", [cut]
                    if self.parser.reasoning_text:
                        run.reasoning_tokens = run.reader.reasoning_tokens(seq, self.parser.reasoning_text)
                new, calls = out.content, out.calls
                if out.reasoning:
                    if self.rs_index is None:
                        for e in self.open_reasoning():
                            yield e
                    self.reasoning.append(out.reasoning)
                    yield self.event("response.reasoning_text.delta", item_id=self.rs_id, output_index=self.rs_index,
                                     content_index=0, delta=out.reasoning)
                if self.rs_index is not None and (new or lp or calls or finished):
                    for e in self.close_reasoning():
                        yield e
            if new or lp:
                if self.msg_index is None:
                    for e in self.open_message():
                        yield e
                self.text.append(new)
                yield self.event("response.output_text.delta", item_id=self.mid, output_index=self.msg_index,
                                 content_index=0, delta=new, logprobs=lp)
            for call in calls:
                for e in self.call(call):
                    yield e
        status = run.status(seq)
        if not self.output:  # an empty answer still has its message
            for e in self.open_message():
                yield e
        if self.message_open():
            for e in self.close_message("incomplete" if status == "incomplete" else "completed"):
                yield e
        response = run.response(status, self.output, seq)
        run.store(response)
        # OpenAI has no "cancelled" event: a response stopped by /cancel ends as incomplete, with status "cancelled"
        kind = {"failed": "response.failed", "completed": "response.completed"}.get(status, "response.incomplete")
        yield self.event(kind, response=response)


class ResponseEvents(EventStream):
    """Server-sent events with the event name on an `event:` line, as OpenAI streams responses (no [DONE])."""

    end = b""

    @staticmethod
    def encode(event: dict) -> bytes:
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request):
        lora = check_model(state, body.model)
        owner = state.owner(request)
        history: list[dict] = []
        if body.previous_response_id is not None:
            history = state.responses.conversation(body.previous_response_id, owner)
        try:
            chat, messages = to_chat(body, history)
            constraint, plan = output_constraint(state, chat)
            ids = await state.cpu.run(render_cost(state, chat), render_chat, state, chat,  # off the event loop
                                      gone=request.is_disconnected)
            max_tokens = chat.max_tokens or (state.max_model_len - len(ids))
            top = chat.top_logprobs or 0
            params = sampling_params(chat, max_tokens, top if chat.logprobs else None)
            check_length(state, ids, max_tokens)
            reader = answer_reader(state, plan, ids, chat.tools, params)
            compiled = await state.engine.grammars.compile(constraint, state.owner(request, by_host=True),
                                                           request.is_disconnected) if constraint else None
        except APIError as e:
            raise responses_error(e) from None
        run = Run(state, body, chat, messages, ids, reader, owner)
        req = PendingRequest(state, asyncio.get_running_loop(), body.stream)
        req.lora = lora
        req.add(ids, params, 0, Grammars.state(compiled, reader.gate()) if compiled else None)
        admit(state, req)
        if body.store:  # visible (in progress) at once: GET shows it, cancel can stop it
            state.responses.put(run.rid, Stored(run.response("in_progress", []), [], owner, pending=req,
                                                running=True))
        if body.stream:
            return ResponseEvents(req, ResponseStream(run, req).events())
        try:
            await gather(req, request)
        except BaseException as e:  # the engine failed, or the client went away: the stored response says so,
            if body.store:  # and keeps its input, so a request that continues it loses no history
                status = "failed" if isinstance(e, APIError) else "cancelled"
                state.responses.put(run.rid, Stored(run.response(status, [], req.seqs[0]), list(run.messages), owner))
            raise
        seq = req.seqs[0]
        response = run.response(run.status(seq), run.output(seq, _new_id("msg")), seq)
        run.store(response)
        return response

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request):
        return state.responses.get(response_id, state.owner(request)).response

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request):
        state.responses.delete(response_id, state.owner(request))
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, request: Request):
        entry = state.responses.get(response_id, state.owner(request))
        if entry.response["status"] != "in_progress" or entry.pending is None:
            raise APIError(400, f"the response is {entry.response['status']}: only a response in progress can be "
                                "cancelled", param="response_id")
        entry.pending.abort()
        entry.response = dict(entry.response, status="cancelled")
        entry.pending = None
        return entry.response
