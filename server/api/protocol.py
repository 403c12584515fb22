"""The OpenAI request schemas (pydantic), their bounds, and OpenAI's error shape.

Everything a client can send is validated here, on rank 0, before anything reaches the engine or the other ranks.

The limits on what one request may ask for are the module-level MAX_* constants below, all in this one place. Each is
refused with a 400 in OpenAI's shape that names the field and the limit; none of them is meant to bind a reasonable
client. They exist so that no body, however built, reaches a 500 or fails the engine thread: a JSON schema nested
300 levels deep used to raise RecursionError in the metaschema check, and a `top_k` past 2**63 or an
out-of-vocabulary stop token id (with min_tokens) failed the engine step itself, so every later request got a 503.
The total size of a body is bounded before any of this by the server's --max-body-bytes (413).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator
from pydantic_core import PydanticCustomError

# ---- limits -------------------------------------------------------------------------------------------------------
MAX_N = 16  # choices per request
MAX_LOGPROBS = 20  # logprobs / top_logprobs
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 256
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_MESSAGES = 2048  # messages in one conversation (/v1/chat/completions, /tokenize)
MAX_TOOLS = 128  # tools in one request (OpenAI's limit)
# Integers the engine puts into tensors or compares with token ids (top_k, min_tokens, max_tokens, stop_token_ids,
# /detokenize's tokens): at most int32's maximum, far past any vocabulary or context length.
MAX_INT = 2**31 - 1
# How deeply any free-form JSON value in a request may nest objects and arrays: JSON schemas (response_format,
# guided_json, structured_outputs.json, tool parameters), tool-call arguments in the history, chat_template_kwargs.
# Real schemas nest a few levels (pydantic's use $defs); llguidance's JSON reader stops at 128, and the metaschema
# check (jsonschema) recurses several Python frames per level.
MAX_JSON_DEPTH = 64
# The text of one output constraint: a JSON schema (serialized), a regex, a grammar, the choices, or the tools'
# parameters together. A grammar's compile is also bounded in time (server/engine/structured/grammar.py, --grammar-compile-timeout).
MAX_SPEC_CHARS = 200_000
# How deeply a regex or a grammar may nest its groups, (...) and Lark's [...] (server/engine/structured/constraint.py, pattern_depth):
# llguidance refuses Lark nested past ~28 levels itself, its regex parser past 250, and its GBNF converter recurses
# in Python.
MAX_PATTERN_DEPTH = 32
# guided_choice / structured_outputs.choice alternatives: llguidance's parser holds at most 2000 items in a row, and
# choices that share a prefix all land in one row once it is generated (the compile probe, server/engine/structured/grammar.py)
MAX_CHOICES = 1024
# chat_template_kwargs may not set what the server itself passes to the template (or to apply_chat_template)
CHAT_TEMPLATE_RESERVED = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception",
    "strftime_now"})

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Count = Annotated[int, Field(ge=1, le=MAX_INT)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """How deeply `value` nests dicts and lists (a scalar is 0, {} is 1), counted without recursion, so any value
    is safe to measure; it stops counting once past `limit`."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            items = v.values()
        elif isinstance(v, list):
            items = v
        else:
            continue
        if d > deepest:
            deepest = d
            if deepest > limit:
                return deepest
        stack.extend((x, d + 1) for x in items)
    return deepest


def too_deep(what: str) -> str:
    return f"{what} is nested deeper than {MAX_JSON_DEPTH} levels of objects and arrays (this server's limit)"


def _bounded_json(value):
    """Free-form JSON from a request nests at most MAX_JSON_DEPTH levels (a 400 naming the field otherwise)."""
    if json_depth(value) > MAX_JSON_DEPTH:
        raise PydanticCustomError("json_too_deep", "nested deeper than {limit} levels of objects and arrays "
                                                   "(this server's limit)", {"limit": MAX_JSON_DEPTH})
    return value


JsonObject = Annotated[dict[str, Any], AfterValidator(_bounded_json)]
JsonObjectOrText = Annotated[dict[str, Any] | str, AfterValidator(_bounded_json)]  # text: parsed, then checked


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class RequestBody(BaseModel):
    """The base of a request body's model: every string in the body must be Unicode text. JSON lets a client send a
    lone UTF-16 surrogate ("\\ud800"), which Python reads into a str that no tokenizer, grammar compiler or JSON
    response can encode (the tokenizer raised, a 500)."""

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data):
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise PydanticCustomError("unicode", "the request holds a lone UTF-16 surrogate ({char}), which is not "
                                                 "Unicode text", {"char": f"\\u{ord(e.object[e.start]):04x}"})
        except (RecursionError, TypeError, ValueError):
            pass  # not JSON data as such (e.g. a model built in code): the fields' own checks apply
        return data


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: JsonObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _needs_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object ({name, schema, strict})")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs object: exactly one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="forbid")

    json_: JsonObjectOrText | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    disable_fallback: bool | None = None
    whitespace_pattern: str | None = None


class SamplingFields(RequestBody):
    """Parameters shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    # OpenAI fields this server answers as OpenAI would for a text model without reasoning (server/api/preprocess.py,
    # refuse_unsupported): refused where they ask for something it cannot do, accepted where they change nothing
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    reasoning_effort: str | None = None
    modalities: Annotated[list[str], Field(max_length=8)] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] = 1.0
    min_tokens: Annotated[int, Field(ge=0, le=MAX_INT)] = 0
    ignore_eos: StrictBool = False
    skip_special_tokens: bool = True
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # structured outputs: OpenAI's response_format, and vLLM's fields for the same job (server/engine/structured/constraint.py)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    response_format: ResponseFormat | None = None
    guided_json: JsonObjectOrText | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # which engine: tpserve has one, so any value means llguidance
    structured_outputs: StructuredOutputs | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(len(s) > MAX_STOP_LEN for s in stops):
            raise ValueError(f"a stop string may be at most {MAX_STOP_LEN} characters long")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v):
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed")
        for key in v:
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"logit_bias keys are token ids (strings of at most 10 digits 0-9), not "
                                 f"{key[:20]!r}")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def check_prompts(v, what: str, limit: int):
    """A prompt field of OpenAI's four shapes (a string, strings, token ids, lists of token ids): none empty, at
    most `limit` of them (/v1/completions' prompt, /v1/embeddings' input)."""
    if not v:
        raise ValueError(f"{what} must not be empty")
    if isinstance(v, str) or all(isinstance(x, int) for x in v):
        return v
    if len(v) > limit:
        raise ValueError(f"at most {limit} {what}s per request")
    if any(not x for x in v):
        raise ValueError(f"no {what} may be empty")
    return v


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Count | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v):
        return check_prompts(v, "prompt", MAX_PROMPTS)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's shape)


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call
    # an assistant's earlier reasoning, as this server (and vLLM) returned it: back to templates that render it
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _roles(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


def _template_kwargs(v: dict | None):
    if v:
        reserved = sorted(CHAT_TEMPLATE_RESERVED & set(v))
        if reserved:
            raise ValueError(f"{reserved[0]!r} is set by the server, not by chat_template_kwargs")
    return v


ChatTemplateKwargs = Annotated[JsonObject, AfterValidator(_template_kwargs)]


class ChatTemplateFields(BaseModel):
    """How a conversation is rendered through the chat template: shared by /v1/chat/completions and /tokenize, so
    both render a conversation alike (server/api/preprocess.py, render_chat)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the answer continues the last (assistant) message, as vLLM
    chat_template_kwargs: ChatTemplateKwargs | None = None  # extra variables for the template, as vLLM
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None

    @model_validator(mode="after")
    def _continue_or_prompt(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: send "
                             "add_generation_prompt false to continue the last message")
        return self


class ChatCompletionRequest(ChatTemplateFields, SamplingFields):
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[JsonObject] | None = None  # the deprecated forms: refused with a pointer to tools
    function_call: Any = None


LORA_NAME = r"^[^\x00-\x1f\x7f]+$"  # an adapter's name: no control characters (it lands in logs and metric labels)


class LoadLoraAdapterRequest(RequestBody):
    """POST /v1/load_lora_adapter (vLLM's shape): a name for the adapter and its local PEFT folder, inside the
    server's --lora-root (server/engine/lora_registry.py: LoraRegistry.runtime_path)."""

    lora_name: str = Field(min_length=1, max_length=256, pattern=LORA_NAME)
    lora_path: str = Field(min_length=1, max_length=4096)
    base_model_name: str | None = Field(default=None, max_length=4096)


class UnloadLoraAdapterRequest(RequestBody):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's; the name decides here
