"""Reasoning and tool calls end to end, per model family: a tiny model trained (tests/family_model.py) to speak the
family's format through its REAL chat template, served by a real `tpserve serve` with the family's
--reasoning-parser / --tool-call-parser, and driven by the official `openai` client and the OpenAI Agents SDK.

For each family (one server per family, started by a module-scope fixture):

- the server renders the conversation as the model was trained (/tokenize), and the model writes its format (a raw
  /v1/completions of the rendered prompt, special tokens kept): what the parsers are then given is the real thing;
- a two-turn tool loop over chat completions, tool_choice "auto", gathered and streamed: the call (name, arguments,
  finish_reason "tool_calls", no markup in the content, the reasoning apart), then with the call, its reasoning and
  the tool's result sent back, the answer "It is sunny in Paris." (finish_reason "stop");
- usage.completion_tokens_details.reasoning_tokens: the reasoning's tokens, not the call's;
- tool_choice "required" and a named function: the grammar-forced call in the family's format;
- the same loop over the Responses API (a reasoning item, a function_call item; then function_call_output ->
  message);
- the Agents SDK over chat completions (OpenAIChatCompletionsModel) and over the Responses API (OpenAIResponsesModel)
  with a get_weather function tool, run and run_streamed, with what it sent checked through a logging proxy;
- a JSON schema that holds after the reasoning only, and Qwen3's enable_thinking switch.

What is asserted is deterministic (greedy decoding of an overfitted model). The fast tier runs qwen3 and gpt-oss;
the other families are marked slow.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time

import httpx
import pytest

import family_model as fm
from family_model import ANSWER, ARGUMENTS, FAMILIES, QUESTION, QUESTION_TEXT, REASONING_ANSWER, REASONING_CALL

os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"  # the Agents SDK exports traces to OpenAI unless told not to

FAST = ("qwen3", "gpt-oss")
TIMEOUT = 60  # seconds, every request
MAX_TOKENS = 120

pytestmark = pytest.mark.timeout(240)


def _param(name: str):
    return pytest.param(name, id=name, marks=() if name in FAST else pytest.mark.slow)


class Served:
    """A family's trained checkpoint, its server, and an openai client of it."""

    def __init__(self, family: fm.Family, server, folder):
        import openai

        self.family, self.server, self.folder = family, server, folder
        self.client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=TIMEOUT)
        self.model = server.model_name


@pytest.fixture(scope="module", params=[_param(n) for n in FAMILIES])
def served(request, server_factory, tmp_path_factory):
    family = FAMILIES[request.param]
    start = time.monotonic()
    folder = fm.make_family_checkpoint(tmp_path_factory.mktemp(family.name), family.name)
    print(f"\n{family.name}: trained in {time.monotonic() - start:.1f} s")
    server = server_factory(folder, 1, *family.flags, "--max-model-len", "1024")
    yield Served(family, server, folder)
    server.stop()  # (the next family's server starts after this one is gone)


def _tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def chat_kwargs(served: Served, mode: fm.Mode) -> dict:
    """A chat request's fields but its messages: the tool, tool_choice "auto", greedy, the mode's template kwargs."""
    kw = {"model": served.model, "tools": [fm.WEATHER_TOOL], "tool_choice": "auto", "temperature": 0,
          "max_tokens": MAX_TOKENS}
    if mode.template_kwargs:
        kw["extra_body"] = {"chat_template_kwargs": mode.template_kwargs}
    return kw


def reasoning_of(obj) -> str | None:
    """A message's (or a delta's) reasoning_content: an extra field of the openai client's models."""
    return (obj.model_extra or {}).get("reasoning_content")


def follow_up_messages(call: dict, reasoning: str | None) -> list[dict]:
    assistant = {"role": "assistant", "content": None, "tool_calls": [call]}
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    return QUESTION + [assistant, {"role": "tool", "tool_call_id": call["id"], "content": fm.TOOL_RESULT}]


def check_call_id(served: Served, call_id: str) -> None:
    assert call_id
    if served.family.name == "mistral":  # its template refuses any other id in the history
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call_id), call_id


# ---- the model speaks its format ---------------------------------------------------------------------------------
def test_server_renders_and_the_model_writes_the_family_format(served):
    """/tokenize renders both conversations to the ids the model was trained on, and a raw completion of them (special
    tokens kept) is the family's trained answer, its end-of-turn token stripped: the parsers get the real format.
    A family served with `--tool-call-parser auto` has the format the template teaches named at start."""
    fam, tok = served.family, _tokenizer(served.folder)
    if "auto" in fam.flags:
        found = {"qwen3": "hermes"}.get(fam.name, fam.name)
        assert f"tool calls: {found} format (--tool-call-parser auto, from the chat template)" in \
            served.server.log.read_text()
    mode = fam.modes[0]
    for messages, expected in [(QUESTION, fam.call_text(mode)),
                               (fm.follow_up(fam.call_ids[0], REASONING_CALL if mode.reasoning else None),
                                fam.answer_text(mode))]:
        body = {"model": served.model, "messages": messages, "tools": [fm.WEATHER_TOOL]}
        if mode.template_kwargs:
            body["chat_template_kwargs"] = mode.template_kwargs
        r = httpx.post(served.server.url + "/tokenize", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        ids = fm.render(tok, messages, mode.template_kwargs)
        assert r.json()["tokens"] == ids
        r = httpx.post(served.server.v1 + "/completions", timeout=TIMEOUT, json={
            "model": served.model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
            "skip_special_tokens": False})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (expected, "stop")


# ---- chat completions -------------------------------------------------------------------------------------------
def test_chat_tool_loop(served):
    fam = served.family
    mode = fam.modes[0]
    kw = chat_kwargs(served, mode)
    first = served.client.chat.completions.create(messages=QUESTION, **kw)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGUMENTS
    check_call_id(served, call.id)
    assert not choice.message.content, choice.message.content
    if mode.reasoning:
        assert reasoning_of(choice.message) == REASONING_CALL
        assert choice.message.model_extra.get("reasoning") == REASONING_CALL
        assert first.usage.completion_tokens_details.reasoning_tokens > 0
    else:
        assert not reasoning_of(choice.message)

    messages = follow_up_messages(call.model_dump(), reasoning_of(choice.message))
    second = served.client.chat.completions.create(messages=messages, **kw)
    choice = second.choices[0]
    assert (choice.message.content, choice.finish_reason) == (ANSWER, "stop"), choice
    assert not choice.message.tool_calls
    if mode.reasoning:
        assert reasoning_of(choice.message) == REASONING_ANSWER
        assert 0 < second.usage.completion_tokens_details.reasoning_tokens < second.usage.completion_tokens
    else:
        assert not reasoning_of(choice.message)


def _stream(served: Served, messages: list[dict], kw: dict) -> dict:
    """A streamed chat answer gathered: its reasoning and content deltas joined, its tool_calls deltas, the finish
    reason and the usage."""
    out = {"reasoning": [], "content": [], "calls": [], "finish": None, "usage": None}
    stream = served.client.chat.completions.create(messages=messages, stream=True,
                                                   stream_options={"include_usage": True}, **kw)
    with stream:
        for chunk in stream:
            if chunk.usage is not None:
                out["usage"] = chunk.usage
            for choice in chunk.choices:
                delta = choice.delta
                if reasoning_of(delta):
                    out["reasoning"].append(reasoning_of(delta))
                if delta.content:
                    out["content"].append(delta.content)
                for c in delta.tool_calls or []:
                    out["calls"].append(c)
                if choice.finish_reason is not None:
                    out["finish"] = choice.finish_reason
    return out


def test_chat_tool_loop_streamed(served):
    fam = served.family
    mode = fam.modes[0]
    kw = chat_kwargs(served, mode)
    first = _stream(served, QUESTION, kw)
    assert first["finish"] == "tool_calls"
    assert "".join(first["content"]) == ""
    deltas = first["calls"]
    assert deltas and all(d.index == 0 for d in deltas)
    head, rest = deltas[0], deltas[1:]
    assert head.id and head.type == "function" and head.function.name == "get_weather"  # the name first
    check_call_id(served, head.id)
    assert all(d.function.name is None and not d.id for d in rest)  # then only arguments
    arguments = (head.function.arguments or "") + "".join(d.function.arguments or "" for d in rest)
    assert json.loads(arguments) == ARGUMENTS
    reasoning = "".join(first["reasoning"])
    if mode.reasoning:
        assert reasoning == REASONING_CALL
        assert first["usage"].completion_tokens_details.reasoning_tokens > 0
    else:
        assert reasoning == ""

    call = {"id": head.id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    second = _stream(served, follow_up_messages(call, reasoning or None), kw)
    assert ("".join(second["content"]), second["finish"]) == (ANSWER, "stop")
    assert second["calls"] == []
    assert "".join(second["reasoning"]) == (REASONING_ANSWER if mode.reasoning else "")


# tool_choice "required" or a named function: a grammar writes the call in the family's format (where it has one),
# over the same prompt as "auto" (the templates render the tools alike), so the model's trained call fits it
NOT_FORCED = {  # why a family is not asked for a forced call
    "qwen3_coder": "its calls are forced in Hermes's format, which this model was not trained to write",
    "deepseek_r1": "the generic format's system message for a forced call differs from the trained one",
}


@pytest.mark.parametrize("how", ["required", "named"])
def test_forced_call(served, how):
    fam = served.family
    if fam.name in NOT_FORCED:
        pytest.skip(NOT_FORCED[fam.name])
    mode = fam.modes[0]
    choice = "required" if how == "required" else {"type": "function", "function": {"name": "get_weather"}}
    r = served.client.chat.completions.create(messages=QUESTION, **chat_kwargs(served, mode) | {
        "tool_choice": choice, "max_tokens": 60})
    answer = r.choices[0]
    (call,) = answer.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS
    assert answer.finish_reason in ("tool_calls", "stop") and not answer.message.content
    check_call_id(served, call.id)
    if mode.reasoning:
        assert reasoning_of(answer.message) == REASONING_CALL


def test_reasoning_tokens_count_the_reasoning_only(served):
    """usage.completion_tokens_details.reasoning_tokens of the call turn: the reasoning's tokens, its end marker
    included (`</think>`; harmony, whose answer has no final channel here: at least the analysis text's tokens, at most
    up to the call's `<|message|>`), never the call's."""
    fam = served.family
    mode = fam.modes[0]
    if not mode.reasoning:
        pytest.skip("the family does not reason")
    tok = _tokenizer(served.folder)
    ids = tok(fam.call_text(mode), add_special_tokens=False)["input_ids"]
    if fam.name == "gpt-oss":  # (no final channel to end at: the analysis text's own tokens, its markup at most)
        least = len(tok(REASONING_CALL, add_special_tokens=False)["input_ids"])
        most = len(ids) - ids[::-1].index(tok.convert_tokens_to_ids("<|message|>"))
    else:
        least = most = ids.index(tok.convert_tokens_to_ids("</think>")) + 1
    first = served.client.chat.completions.create(messages=QUESTION, **chat_kwargs(served, mode))
    assert first.choices[0].finish_reason == "tool_calls"
    # (+ the end-of-turn token; a grammar that completed may end the answer without one: the generic format's)
    assert first.usage.completion_tokens in (len(ids), len(ids) + 1)
    assert least <= first.usage.completion_tokens_details.reasoning_tokens <= most, (least, most)


# ---- the Responses API ------------------------------------------------------------------------------------------
RESPONSES_TOOL = {"type": "function", **fm.WEATHER_TOOL["function"]}


def test_responses_tool_loop(served):
    """Without chat_template_kwargs (the Responses API has none): the template's default mode."""
    fam = served.family
    mode = fam.mode_without_kwargs()
    assert mode is not None
    kw = {"model": served.model, "tools": [RESPONSES_TOOL], "tool_choice": "auto", "temperature": 0,
          "max_output_tokens": MAX_TOKENS}
    first = served.client.responses.create(input=QUESTION_TEXT, **kw)
    assert first.status == "completed", first
    kinds = [item.type for item in first.output]
    assert kinds == (["reasoning", "function_call"] if mode.reasoning else ["function_call"]), first.output
    call = first.output[-1]
    assert call.name == "get_weather" and json.loads(call.arguments) == ARGUMENTS
    check_call_id(served, call.call_id)
    if mode.reasoning:
        assert [(c.type, c.text) for c in first.output[0].content] == [("reasoning_text", REASONING_CALL)]
        assert first.usage.output_tokens_details.reasoning_tokens > 0

    items = [{"role": "user", "content": QUESTION_TEXT}] + [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": fm.TOOL_RESULT})
    second = served.client.responses.create(input=items, **kw)
    assert second.status == "completed", second
    assert [item.type for item in second.output] == (["reasoning", "message"] if mode.reasoning else ["message"])
    assert second.output_text == ANSWER
    if mode.reasoning:
        assert second.output[0].content[0].text == REASONING_ANSWER


# ---- the OpenAI Agents SDK --------------------------------------------------------------------------------------
def test_agents_sdk_tool_is_the_trained_one():
    """The SDK spells the get_weather tool as family_model.WEATHER_TOOL (key order included): the prompt it gets
    rendered is the trained one."""
    from agents.models.chatcmpl_converter import Converter

    assert json.dumps(Converter.tool_to_openai(_weather_tool([]))) == json.dumps(fm.WEATHER_TOOL)


def _weather_tool(calls: list):
    from agents import function_tool

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city"""
        calls.append(city)
        return fm.TOOL_RESULT

    return get_weather


def run_agent(served: Served, make_model, streamed: bool, calls: list[str]):
    """Run an Agents SDK agent with the get_weather tool on the model `make_model(client)` makes, through a logging
    proxy: (final output, the streamed text and reasoning deltas, the proxy's log)."""
    import openai
    from agents import Agent, Runner, set_tracing_disabled

    from wire_log import WireLog

    set_tracing_disabled(True)
    mode = served.family.modes[0]
    deltas = {"response.output_text.delta": "", "response.reasoning_text.delta": ""}

    async def run(base_url: str):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=TIMEOUT)
        model, settings = make_model(client, mode)
        agent = Agent(name="weather", model=model, tools=[_weather_tool(calls)], model_settings=settings)
        try:
            if not streamed:
                return (await Runner.run(agent, QUESTION_TEXT, max_turns=4)).final_output
            result = Runner.run_streamed(agent, QUESTION_TEXT, max_turns=4)
            async for event in result.stream_events():
                kind = getattr(event.data, "type", "") if event.type == "raw_response_event" else ""
                if kind in deltas:
                    deltas[kind] += event.data.delta
            return result.final_output
        finally:
            await client.close()

    with WireLog(served.server.url) as wire:
        output = asyncio.run(asyncio.wait_for(run(wire.v1), 3 * TIMEOUT))
    return output, deltas["response.output_text.delta"], deltas["response.reasoning_text.delta"], wire


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_agents_sdk_over_chat_completions(served, streamed):
    """OpenAIChatCompletionsModel with a function tool: the call, the tool run, the answer. The SDK replays an
    assistant's reasoning as reasoning_content when told to (by default only for DeepSeek's models): the model was
    trained with its reasoning sent back. A logging proxy (tests/wire_log.py) shows what the SDK sent."""
    from agents import ModelSettings, OpenAIChatCompletionsModel

    def make(client, mode):
        model = OpenAIChatCompletionsModel(model=served.model, openai_client=client,
                                           should_replay_reasoning_content=lambda context: True)
        return model, ModelSettings(temperature=0, max_tokens=MAX_TOKENS, extra_body={
            "chat_template_kwargs": mode.template_kwargs} if mode.template_kwargs else None)

    calls: list[str] = []
    output, text, _, wire = run_agent(served, make, streamed, calls)
    assert (output, calls) == (ANSWER, ["Paris"])
    assert text == (output if streamed else "")  # the streamed deltas add up to the answer
    mode = served.family.modes[0]
    posts = wire.to("/v1/chat/completions")
    assert [(e.status, e.body.get("stream", False), e.body["tool_choice"] if "tool_choice" in e.body else "auto")
            for e in posts] == [(200, streamed, "auto")] * 2
    assert posts[0].body["tools"] == [fm.WEATHER_TOOL]
    kinds = [(m["role"], bool(m.get("tool_calls"))) for m in posts[1].body["messages"]]
    assert kinds == [("user", False), ("assistant", True), ("tool", False)]
    assert posts[1].body["messages"][1].get("reasoning_content") == (REASONING_CALL if mode.reasoning else None)


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}


def test_a_json_schema_holds_after_the_reasoning_only(served):
    """response_format with a reasoning model: the reasoning is free (the trained one comes back whole), the grammar
    holds from the end of the reasoning on, and the content is the schema's JSON. Streamed, the same. (The model
    opens its reasoning itself: the grammar's first token may be `<think>` or the JSON's.)"""
    fam = served.family
    mode = next((m for m in fam.modes if m.reasoning), None)
    if fam.name != "qwen3":  # (the others were trained on prompts that list the tools; this request lists none)
        pytest.skip("qwen3's model reasons the same with or without the tools in its prompt")
    kw = chat_kwargs(served, mode)
    kw.pop("tools"), kw.pop("tool_choice")
    kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    messages = fm.follow_up(fam.call_ids[0], REASONING_CALL)
    r = served.client.chat.completions.create(messages=messages, **kw)
    msg = r.choices[0].message
    assert json.loads(msg.content).keys() == {"city"} and "<" not in msg.content, msg.content
    reasoning = reasoning_of(msg)
    assert reasoning == REASONING_ANSWER, reasoning  # the model reasoned as trained: nothing masked it
    details = r.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < r.usage.completion_tokens
    text, thought = "", ""
    for chunk in served.client.chat.completions.create(messages=messages, stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            thought += reasoning_of(chunk.choices[0].delta) or ""
    assert (text, thought) == (msg.content, reasoning)


def test_thinking_switched_off(served):
    """chat_template_kwargs {"enable_thinking": false} reaches Qwen3's template, which closes an empty reasoning block
    in the prompt."""
    if served.family.name != "qwen3":
        pytest.skip("Qwen3's switch")
    body = {"model": served.model, "messages": QUESTION, "tools": [fm.WEATHER_TOOL]}
    on = httpx.post(served.server.url + "/tokenize", json=body, timeout=TIMEOUT).json()["count"]
    off = httpx.post(served.server.url + "/tokenize", timeout=TIMEOUT, json={
        **body, "chat_template_kwargs": {"enable_thinking": False}}).json()["count"]
    assert off > on  # (the closed <think></think> block)
    r = served.client.chat.completions.create(messages=QUESTION, **chat_kwargs(served, served.family.modes[0]) | {
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}, "max_tokens": 40})
    msg = r.choices[0].message  # (an untrained prompt for this model: what it says is not asserted, how it is read is)
    # this model, trained only to think, opens a block anyway: it is read as reasoning (as vLLM's parser does), and
    # counted; the grammar of a constrained request would hold from the first token (tests/server/test_tool_parser.py)
    assert reasoning_of(msg) == REASONING_CALL and not msg.content.startswith("<think>")
    assert r.usage.completion_tokens_details.reasoning_tokens > 0

@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_agents_sdk_over_the_responses_api(served, streamed):
    """The SDK's default model (OpenAIResponsesModel): a function_call item, the tool run, function_call_output, the
    answer; a reasoning family's reasoning item goes back with its turn. The template's default mode (the Responses
    API carries no chat_template_kwargs)."""
    from agents import ModelSettings, OpenAIResponsesModel

    def make(client, _mode):
        return (OpenAIResponsesModel(model=served.model, openai_client=client),
                ModelSettings(temperature=0, max_tokens=MAX_TOKENS))

    calls: list[str] = []
    mode = served.family.mode_without_kwargs()
    output, text, reasoning, wire = run_agent(served, make, streamed, calls)
    assert (output, calls) == (ANSWER, ["Paris"])
    if streamed:
        assert text == output and reasoning == ((REASONING_CALL + REASONING_ANSWER) if mode.reasoning else "")
    posts = wire.to("/v1/responses")
    assert [(e.status, e.body.get("stream", False)) for e in posts] == [(200, streamed)] * 2
    kinds = [item.get("type", "message") for item in posts[1].body["input"]]
    assert kinds == (["message", "reasoning", "function_call", "function_call_output"] if mode.reasoning else
                     ["message", "function_call", "function_call_output"])
