"""vLLM's `POST /tokenize` and `POST /detokenize`: clients count tokens and trim context with them.

- /tokenize takes a prompt, `{model, prompt, add_special_tokens}` (add_special_tokens true by default), or a
  conversation, `{model, messages, add_generation_prompt, continue_final_message, tools, chat_template_kwargs}`,
  and answers `{count, max_model_len, tokens}`, plus `token_strs` (the tokens' vocabulary strings) when the body
  has `return_token_strs: true`. A conversation is rendered by the very code /v1/chat/completions uses
  (server/api/preprocess.py, render_chat, on a ChatCompletionRequest built from the same fields), so `count` is the
  `usage.prompt_tokens` of that chat request; a prompt's is that of the same /v1/completions request. The tools
  are checked as the chat endpoint checks them. `add_special_tokens: true` is refused with messages: the chat
  template writes the model's special tokens itself, and the chat endpoint adds none.
- /detokenize takes `{model, tokens}` and answers `{prompt}`, the text of the ids (special tokens kept); an id
  outside the model's vocabulary is a 400.

A prompt or a conversation longer than the max model length is still counted (that is what a client asks to know);
the body is bounded by --max-body-bytes, a conversation by MAX_MESSAGES and MAX_TOOLS, its JSON values by
MAX_JSON_DEPTH (server/api/protocol.py). Tokenizing runs in the server's bounded CpuPool (server/api/state.py; the
tokenizer drops the GIL), so a large prompt does not stall the event loop that streams other requests' tokens, and a
flood of them is answered 429 instead of queueing without end. Both paths are behind the API key, like /v1/
(server/api/app.py, KEYED_PATHS).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from server.api.state import ServerState
from server.api.preprocess import check_model, decode_prompt, render_chat
from server.api.protocol import (MAX_MESSAGES, APIError, ChatCompletionRequest, ChatMessage, ChatTemplateFields,
                             RequestBody, TokenId)
from server.api.tool_calls import check_tools

CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")


class TokenizeRequest(RequestBody, ChatTemplateFields):
    """A prompt or a conversation (exactly one of `prompt` and `messages`), as vLLM's two /tokenize bodies."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool | None = None  # a prompt: true unless false; messages: false (true is refused)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt (a string) or messages (a conversation)")
        if self.prompt is not None:
            given = [f for f in CHAT_ONLY if f in self.model_fields_set]
            if given:
                raise ValueError(f"{given[0]} applies to messages, not to a prompt")
        elif self.add_special_tokens:
            raise ValueError("add_special_tokens cannot be true with messages: the chat template writes the "
                             "model's special tokens, and /v1/chat/completions adds none")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # only when asked for (return_token_strs)


class DetokenizeRequest(RequestBody):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(state: ServerState, body: TokenizeRequest) -> TokenizeResponse:
    """The prompt's token ids, as /v1/completions or /v1/chat/completions would have them (in a worker thread)."""
    if body.prompt is not None:
        add = body.add_special_tokens is not False
        ids = list(state.tokenizer(body.prompt, add_special_tokens=add)["input_ids"])
    else:
        try:
            chat = ChatCompletionRequest(messages=body.messages, tools=body.tools,
                                         add_generation_prompt=body.add_generation_prompt,
                                         continue_final_message=body.continue_final_message,
                                         chat_template_kwargs=body.chat_template_kwargs)
        except ValidationError as e:  # cannot happen: the same fields passed the same checks
            raise APIError(400, f"invalid conversation: {e.errors()[0].get('msg')}", param="messages") from None
        if chat.tools:
            check_tools(chat.tools)
        ids = render_chat(state, chat, refuse_long=False)  # (a conversation too long for the model is counted)
    strs = None
    if body.return_token_strs:
        strs = [t if t is not None else "" for t in state.tokenizer.convert_ids_to_tokens(ids)]
    return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)


def detokenize(state: ServerState, tokens: list[int]) -> str:
    """The text of the ids, each checked against the vocabulary (in the CpuPool: a body holds ~800k ids)."""
    bad = [t for t in tokens if t >= state.vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {state.vocab_size})", param="tokens")
    return decode_prompt(state, tokens)


def add_routes(app: FastAPI, state: ServerState) -> None:
    """Register POST /tokenize and POST /detokenize on `app` (after build_app's error handlers and guard)."""

    @app.post("/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True)
    async def tokenize_route(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        check_model(state, body.model)
        size = len(body.prompt) if body.prompt is not None else sum(len(m.text()) for m in body.messages)
        return await state.cpu.run(size, tokenize, state, body, gone=request.is_disconnected)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize_route(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        check_model(state, body.model)
        return DetokenizeResponse(prompt=await state.cpu.run(len(body.tokens), detokenize, state, body.tokens,
                                                             gone=request.is_disconnected))
