"""Request preparation on rank 0: everything a request becomes before the engine sees it.

Prompts are tokenized (or token ids checked against the vocabulary), conversations rendered through the model's chat
template (with tools, when the request has them), lengths checked against the max model length, sampling parameters
built, and the output constraint resolved: from response_format / guided_* / structured_outputs
(server/engine/structured/constraint.py) or from tool_choice (server/api/tool_calls.py), then compiled (server/engine/structured/grammar.py). Anything
wrong is a 400 here, so a bad request never reaches the other ranks.

Tokenizing and rendering run in the server's CpuPool (server/api/state.py), never on the event loop: the routes
call `tokenize_prompts` and `render_chat` through `state.cpu.run`. A prompt whose length in characters already
proves it longer than the max model length (server/engine/tokenizer.py, length_bound) is refused before it is
tokenized: on the event loop for a prompt (`refuse_long_prompts`), after rendering for a conversation.
"""

from __future__ import annotations

from dataclasses import replace

from server.engine.structured.grammar import Constraint
from server.api.state import ServerState
from server.api.protocol import APIError, ChatCompletionRequest, SamplingFields
from server.engine.sampler import SamplingParams
from server.engine.structured.constraint import constraint_from_request
from server.api.parsers import generic
from server.api.parsers.generic import GenericToolParser
from server.api.parsers.hermes import HermesParser
from server.api.tool_calls import (ToolPlan, check_tool_schemas, check_tools, generic_constraint, render_messages,
                                   tools_constraint)

REASONING_EFFORTS = ("low", "medium", "high")


def check_model(state: ServerState, name: str | None):
    """The request's LoRA adapter (server/engine/lora_registry.py Adapter) when `model` names one, None for the base model; 404 for
    any other name."""
    if name is None or name == state.model_name:
        return None
    adapter = state.loras.resolve(name) if state.loras is not None else None
    if adapter is None:
        also = f" (or one of its LoRA adapters: {', '.join(a.name for a in state.loras.models())})" if (
            state.loras is not None and state.loras.models()) else ""
        raise APIError(404, f"The model `{name}` does not exist. This server serves `{state.model_name}`{also}.",
                       "not_found_error", param="model", code="model_not_found")
    return adapter


def _prompt_list(prompt) -> list:
    return [prompt] if isinstance(prompt, str) or all(isinstance(x, int) for x in prompt) else list(prompt)


def prompt_chars(prompt) -> int:
    """The size of a prompt field (characters, or token ids): what its tokenizing costs the CpuPool."""
    return sum(len(p) for p in _prompt_list(prompt))


def length_limit(state: ServerState) -> str:
    """Why no more tokens fit: the max model length (and the KV cache, when that is what bounds it)."""
    limit = state.max_model_len
    why = f"this server's max model length is {limit}"
    if state.engine.replicas.pool_tokens <= limit:
        why += f" (its whole KV cache holds {state.engine.replicas.pool_tokens} tokens)"
    return why


def too_long(state: ServerState, n: int, param: str, where: str, at_least: bool, hint: str = "") -> APIError:
    """The 400 of a prompt longer than the max model length (`at_least`: counted from its length in characters)."""
    why = length_limit(state)
    count = f"at least {n} tokens (counted from its length in characters)" if at_least else f"{n} tokens"
    return APIError(400, f"{where} has {count}; {why}{hint}", param=param, code="context_length_exceeded")


def refuse_long_prompts(state: ServerState, prompt, param: str = "prompt", refuse_at: int | None = None,
                        hint: str = "") -> None:
    """On the event loop, before any tokenizing: a prompt of `refuse_at` tokens or more (default the max model
    length, which leaves no room for an answer) is refused when its token ids say so, or when its length in
    characters proves it (ServerState.min_tokens: a bound, never an estimate). A 4 MB prompt costs a length, or a
    few str.count calls."""
    refuse_at = state.max_model_len if refuse_at is None else refuse_at
    raw = _prompt_list(prompt)
    for i, p in enumerate(raw):
        n = len(p) if not isinstance(p, str) else state.min_tokens(p)
        if n >= refuse_at:
            where = param if len(raw) == 1 else f"{param}[{i}]"
            raise too_long(state, n, param, where, at_least=isinstance(p, str), hint=hint)


def tokenize_prompts(state: ServerState, prompt, param: str = "prompt",
                     add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each prompt in one of OpenAI's four shapes (server/api/protocol.py, check_prompts): strings
    tokenized, token ids checked against the vocabulary. Runs in the CpuPool (state.cpu.run)."""
    raw = _prompt_list(prompt)
    out = []
    for i, p in enumerate(raw):
        where = param if len(raw) == 1 else f"{param}[{i}]"
        if isinstance(p, str):
            ids = state.tokenizer.encode(p, add_special_tokens=add_special_tokens)
            if not ids:
                raise APIError(400, f"{where} encodes to zero tokens", param=param)
        else:
            bad = [t for t in p if not 0 <= t < state.vocab_size]
            if bad:
                raise APIError(400, f"{where}: token id {bad[0]} is outside the vocabulary [0, {state.vocab_size})",
                               param=param)
            ids = list(p)
        out.append(ids)
    return out


def chat_chars(body: ChatCompletionRequest) -> int:
    """The size of a conversation (its messages' text and earlier calls' arguments), in characters."""
    n = 0
    for m in body.messages:
        n += len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content or ())
        n += sum(len(c.function.arguments) for c in m.tool_calls or ())
    return n


def render_cost(state: ServerState, body: ChatCompletionRequest) -> int:
    """What rendering and tokenizing a conversation costs the CpuPool, in characters: a rendering too long for the
    model is refused before it is tokenized (render_chat), so no more than the characters that can fit."""
    n = chat_chars(body)
    if state.length_bound is not None:
        n = min(n, state.max_model_len * state.length_bound.chars_per_token)
    return n


def render_chat(state: ServerState, body: ChatCompletionRequest, refuse_long: bool = True) -> list[int]:
    """The conversation's prompt tokens, through the model's chat template (what /tokenize counts, too, with
    refuse_long=False). The template is rendered to text, then tokenized without special tokens, as transformers'
    apply_chat_template(tokenize=True) does; between the two, a rendering whose length in characters proves it longer
    than the max model length is refused untokenized. The tools' parameters are checked against their metaschema
    here first, but for those the output grammar holds (its compile checks them). Runs in the CpuPool
    (state.cpu.run)."""
    if body.tools:  # (their cheap checks were made on the event loop: output_constraint, check_tools)
        check_tool_schemas(body.tools, skip=tools_in_grammar(body))
    in_template = state.tools_in_template
    messages = render_messages(body.messages, in_template)
    extra = dict(body.chat_template_kwargs or {})  # no key the server sets itself (protocol.CHAT_TEMPLATE_RESERVED)
    if body.continue_final_message:
        extra["continue_final_message"] = True
    effort = getattr(body, "reasoning_effort", None)
    if effort is not None:  # (refuse_unsupported checked that the template reads it)
        extra["reasoning_effort"] = effort
    choice = tool_choice(body)
    if body.tools and in_template and choice != "none":
        extra["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    elif body.tools and choice != "none":  # the generic format: the tools and the answer's form, as a system message
        described = generic.instructions([t.model_dump(exclude_none=True) for t in body.tools],
                                         body.parallel_tool_calls, choice != "auto")
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + described}
        else:
            messages.insert(0, {"role": "system", "content": described})
    try:
        text = state.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                   tokenize=False, **extra)
    except Exception as e:  # noqa: BLE001 - a template that rejects the conversation (e.g. role order)
        raise APIError(400, f"cannot render the chat template for these messages: {e}", param="messages") from None
    if refuse_long:
        n = state.min_tokens(text)
        if n >= state.max_model_len:
            raise too_long(state, n, "messages", "the conversation", at_least=True)
    ids = list(state.tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise APIError(400, "the conversation renders to zero tokens", param="messages")
    return ids


def check_length(state: ServerState, ids: list[int], max_tokens: int) -> None:
    """prompt + max_tokens must fit the max model length, which never exceeds what the whole KV cache holds (the
    server refuses to start otherwise, or lowers a default length to the cache): a request that passes always fits."""
    limit = state.max_model_len
    if len(ids) >= limit:
        raise too_long(state, len(ids), "prompt", "the prompt", at_least=False)
    if len(ids) + max_tokens > limit:
        raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds {limit} tokens: "
                            f"{length_limit(state)}; "
                            f"lower max_tokens to at most {limit - len(ids)}", param="max_tokens",
                       code="context_length_exceeded")


def logit_bias(state: ServerState, body: SamplingFields) -> dict[int, float]:
    """The request's logit bias by token id. The token ids of its sampling fields (logit_bias and stop_token_ids)
    are checked against the vocabulary here: the engine indexes the logits with them."""
    bias = {int(k): float(v) for k, v in (body.logit_bias or {}).items()}
    bad = [t for t in bias if t >= state.vocab_size]
    if bad:
        raise APIError(400, f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {state.vocab_size})",
                       param="logit_bias")
    bad = [t for t in body.stop_token_ids or () if t >= state.vocab_size]
    if bad:
        raise APIError(400, f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {state.vocab_size})",
                       param="stop_token_ids")
    return bias


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None,
                    bias: dict[int, float] | None = None) -> SamplingParams:
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
        logit_bias=bias or {},
    )


def with_seed(params: SamplingParams, choice: int) -> SamplingParams:
    """Choice i of a seeded request uses seed + i, so n > 1 choices differ yet each is reproducible."""
    if params.seed is None or choice == 0:
        return params
    return replace(params, seed=params.seed + choice)


def decode_prompt(state: ServerState, ids: list[int]) -> str:
    return state.tokenizer.decode(ids, skip_special_tokens=False)


def tool_choice(body: ChatCompletionRequest):
    """OpenAI's default: "auto" when the request has tools, "none" otherwise."""
    if body.tool_choice is not None:
        return body.tool_choice
    return "auto" if body.tools else "none"


def tools_in_grammar(body: ChatCompletionRequest) -> set[int]:
    """The indices of the tools whose parameters the output grammar holds (output_constraint, tools_constraint), so
    whose metaschema checks run in its compile: every tool for "required", the named one for a named function,
    none for "auto" or "none"."""
    choice = tool_choice(body)
    if choice == "required":
        return set(range(len(body.tools or ())))
    if isinstance(choice, str):
        return set()
    return {i for i, t in enumerate(body.tools or ()) if t.function.name == choice.function.name}


def refuse_unsupported(state: ServerState, body: SamplingFields) -> None:
    """OpenAI fields that ask for what this server cannot give, refused with the field's name (never ignored)."""
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of (generating more choices and returning the best) is not supported; send n",
                       param="best_of")
    if body.reasoning_effort is not None:
        if not isinstance(body, ChatCompletionRequest) or "reasoning_effort" not in state.template:
            raise APIError(400, "reasoning_effort: this model's chat template has no reasoning effort to set",
                           param="reasoning_effort")
        if body.reasoning_effort not in REASONING_EFFORTS:
            raise APIError(400, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, not "
                                f"{body.reasoning_effort[:40]!r}", param="reasoning_effort")
    if body.modalities is not None and any(m != "text" for m in body.modalities):
        raise APIError(400, "modalities: this server answers text only", param="modalities")
    if body.audio is not None:
        raise APIError(400, "audio output is not supported: this server answers text only", param="audio")
    if body.web_search_options is not None:
        raise APIError(400, "web_search_options: this server has no web search", param="web_search_options")


def output_constraint(state: ServerState, body: SamplingFields) -> tuple[Constraint | None, ToolPlan | None]:
    """The request's output constraint (or None), and how its tool calls are served (None: not read)."""
    refuse_unsupported(state, body)
    constraint = constraint_from_request(body)
    if not isinstance(body, ChatCompletionRequest):
        return constraint, None
    if body.functions is not None or body.function_call is not None:
        raise APIError(400, "functions and function_call are deprecated and not supported; send tools and "
                            "tool_choice", param="functions" if body.functions is not None else "function_call")
    choice = tool_choice(body)
    if not body.tools:
        if choice not in ("none", "auto"):
            raise APIError(400, "tool_choice names a function or requires a call, but the request has no tools",
                           param="tool_choice")
        return constraint, None
    check_tools(body.tools)  # (bounds only: their metaschema checks run in the compile, or in render_chat)
    if choice == "none":
        return constraint, None
    if constraint is not None:
        raise APIError(400, f"{constraint.param} cannot be combined with tools when tool_choice is {choice!r}; "
                            "send tool_choice \"none\" to constrain the message, or drop it", param=constraint.param)
    name = None
    if choice not in ("required", "auto"):
        name = choice.function.name
        if name not in {t.function.name for t in body.tools}:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not among the request's tools",
                           param="tool_choice")
    if not state.tools_in_template:  # the generic format (server/api/parsers/generic.py)
        return (generic_constraint(body.tools, name, body.parallel_tool_calls, choice != "auto"),
                ToolPlan(GenericToolParser, forced=choice != "auto"))
    fmt = state.parsers.tool_cls
    if choice == "auto":
        if fmt is None:
            raise APIError(400, 'tool_choice "auto" needs a server started with --tool-call-parser (auto picks the '
                                "format this model's chat template teaches); or send tool_choice \"required\" or a "
                                "named function", param="tool_choice")
        return None, ToolPlan(fmt)
    if fmt is None or not fmt.forced_format:
        fmt = HermesParser  # (a format without a grammar: the call is forced in Hermes's, and read so)
    return (tools_constraint(body.tools, name, body.parallel_tool_calls, fmt, state.atom),
            ToolPlan(fmt, forced=True))
