"""The OpenAI request schemas (pydantic), their bounds, and OpenAI's error shape.

Everything a client can send is validated here, on rank 0, before anything reaches the engine or the other ranks.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
MAX_PROMPTS = 64
MAX_LOGIT_BIAS = 1024

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
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

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    disable_fallback: bool | None = None
    whitespace_pattern: str | None = None


class SamplingFields(BaseModel):
    """Parameters shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] = 1.0
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: StrictBool = False
    skip_special_tokens: bool = True
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # structured outputs: OpenAI's response_format, and vLLM's fields for the same job (server/structured.py)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
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
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids (strings of digits), not {key!r}")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v):
        if isinstance(v, str):
            if not v:
                raise ValueError("prompt must not be empty")
            return v
        if not v:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in v):
            return v
        if len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        if any((isinstance(x, str) and not x) or (isinstance(x, list) and not x) for x in v):
            raise ValueError("prompts must not be empty")
        return v


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
    parameters: dict[str, Any] | None = None
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


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[dict[str, Any]] | None = None  # the deprecated forms: refused with a pointer to tools
    function_call: Any = None
