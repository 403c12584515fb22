"""Structured outputs and tool calling through a real server and the official openai client.

The default model answers 20 JSON schemas (gathered and streamed), choices, regexes, grammars and forced tool calls;
a tiny checkpoint trained here to speak Hermes tool calls (tests/tool_model.py) covers tool_choice "auto" and the
follow-up turn; every bad input gets a 400 in OpenAI's shape and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

import tool_model

S = {"type": "string", "maxLength": 24}  # bounded strings: a 135M model may otherwise ramble up to max_tokens


def obj(props: dict, required: list[str] | None = None, closed: bool = True) -> dict:
    out = {"type": "object", "properties": props, "required": list(props) if required is None else required}
    if closed:
        out["additionalProperties"] = False
    return out


SCHEMAS = [
    ("a person", obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a person and their address", obj({"name": S, "address": obj({"city": S, "zip": {
        "type": "string", "pattern": "^[0-9]{5}$"}})})),
    ("two to four lucky numbers", obj({"numbers": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                              "maximum": 99},
                                                   "minItems": 2, "maxItems": 4}})),
    ("the color of the sky", obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("the weather", obj({"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                         "humidity": {"type": "integer", "minimum": 0, "maximum": 100}})),
    ("a ticket, the note is optional", obj({"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "note": S},
                                           required=["id"])),
    ("a book", obj({"title": S, "author": S, "pages": {"type": "integer", "minimum": 1, "maximum": 2000}})),
    ("a shopping cart", obj({"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": obj({
        "sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}})}})),
    ("a status", obj({"ok": {"type": "boolean"}, "error": {"type": ["string", "null"], "maxLength": 20}})),
    ("a date", obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}})),
    ("one to three fruits", {"type": "array", "items": {"enum": ["apple", "pear", "plum"]}, "minItems": 1,
                             "maxItems": 3}),
    ("a versioned name", obj({"version": {"const": 2}, "name": S})),
    ("a value", obj({"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}]}})),
    ("a 2x2 matrix", obj({"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}})),
    ("a line from a to b", {"$defs": {"pt": obj({"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                 "y": {"type": "integer", "minimum": 0, "maximum": 9}})},
                            **obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}})}),
    ("a price", obj({"price": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1000}})),
    ("a log entry", obj({"level": {"enum": [1, 2, 3]}, "message": S})),
    ("a short code", obj({"code": {"type": "string", "minLength": 3, "maxLength": 6}})),
    ("a nested flag", obj({"a": obj({"b": obj({"c": obj({"d": {"type": "boolean"}})})})})),
    ("a movie", obj({"title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                     "genres": {"type": "array", "items": S, "maxItems": 2}}, required=["title"])),
]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": obj({"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}}, required=["city"])}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": obj({"timezone": S})}}


@pytest.fixture(scope="module")
def smol(server_factory):
    return server_factory(None, 1, "--max-model-len", "1024", "--max-num-seqs", "24", ready_timeout=600)


@pytest.fixture(scope="module")
def client(smol):
    return openai.OpenAI(base_url=smol.v1, api_key="x", max_retries=0, timeout=300)


def ask(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply in JSON only. Give {topic}."}]


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


async def _all_schemas(smol, stream: bool, every: int = 1) -> list[tuple[str, str]]:
    client = openai.AsyncOpenAI(base_url=smol.v1, api_key="x", max_retries=0, timeout=300)

    async def one(topic, schema):
        kw = dict(model=smol.model_name, messages=ask(topic), temperature=0, max_tokens=300,
                  response_format=response_format(schema))
        if not stream:
            r = await client.chat.completions.create(**kw)
            return r.choices[0].message.content, r.choices[0].finish_reason
        text, finish = "", None
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    try:
        return await asyncio.gather(*(one(t, s) for t, s in SCHEMAS[::every]))
    finally:
        await client.close()


def test_twenty_schemas_validate_streamed_and_not(smol):
    """All twenty gathered; every other one streamed too (the same text: a stream is the same grammar's steps)."""
    gathered = asyncio.run(_all_schemas(smol, stream=False))
    streamed = asyncio.run(_all_schemas(smol, stream=True, every=2))
    for (topic, schema), (text, finish) in zip(SCHEMAS, gathered):
        assert finish == "stop", (topic, text)
        jsonschema.validate(json.loads(text), schema)
    for (topic, _), (text, finish), (s_text, s_finish) in zip(SCHEMAS[::2], gathered[::2], streamed):
        assert (s_text, s_finish) == (text, finish), topic


def test_openai_parse_returns_a_pydantic_object(client, smol):
    class City(BaseModel):
        city: str
        country: str

    r = client.chat.completions.parse(model=smol.model_name, temperature=0, max_tokens=100, response_format=City,
                                      messages=[{"role": "user", "content": "Which city is the capital of France?"}])
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.city


def test_json_object_with_n_and_seed(client, smol):
    schema = obj({"animal": {"type": "string", "maxLength": 12}, "legs": {"type": "integer", "minimum": 0,
                                                                          "maximum": 8}})
    kw = dict(model=smol.model_name, messages=ask("an animal"), n=3, temperature=1.0, seed=7, max_tokens=60,
              response_format=response_format(schema))
    first = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    for c in first.choices:
        jsonschema.validate(json.loads(c.message.content), schema)
    msgs = [{"role": "user", "content": 'Reply with a JSON object with the key "color". Which color is the sky?'}]
    r = client.chat.completions.create(model=smol.model_name, messages=msgs, temperature=0, max_tokens=100,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_max_tokens_cuts_json_with_finish_length(client, smol):
    r = client.chat.completions.create(model=smol.model_name, messages=ask("a book"), temperature=0, max_tokens=4,
                                       response_format=response_format(SCHEMAS[6][1]))
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)


def test_choice_regex_and_grammar_on_both_endpoints(client, smol):
    choices = ["yes", "no", "maybe"]
    r = client.chat.completions.create(model=smol.model_name, temperature=0, extra_body={"guided_choice": choices},
                                       messages=[{"role": "user", "content": "Is Paris in France?"}])
    assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    r = client.completions.create(model=smol.model_name, prompt="Call us at ", temperature=0, max_tokens=30,
                                  extra_body={"guided_regex": phone})
    assert re.fullmatch(phone, r.choices[0].text), r.choices[0].text
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=smol.model_name, prompt="My favorite fruit:", temperature=0, max_tokens=10, stream=True,
        extra_body={"structured_outputs": {"choice": ["apple", "banana"]}}))
    assert text in ("apple", "banana")
    gbnf = 'root ::= answer ", because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{1,30}'
    r = client.chat.completions.create(model=smol.model_name, temperature=0, max_tokens=40,
                                       extra_body={"guided_grammar": gbnf},
                                       messages=[{"role": "user", "content": "Is the sky blue?"}])
    assert re.fullmatch(r"(yes|no), because [a-z ]{1,30}", r.choices[0].message.content)


def test_forced_tool_calls_validate(client, smol):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=smol.model_name, messages=msgs, tools=[WEATHER, TIME],
                                       tool_choice="required", temperature=0, max_tokens=200)
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = {"type": "function", "function": {"name": "get_time"}}
    stream = client.chat.completions.create(model=smol.model_name, messages=msgs, tools=[WEATHER, TIME],
                                            tool_choice=named, parallel_tool_calls=False, temperature=0,
                                            max_tokens=200, stream=True)
    names, args, finish = [], "", None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.function.name:
                names.append(d.function.name)
            args += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_time"] and finish == "tool_calls"
    jsonschema.validate(json.loads(args), schemas["get_time"])
    # the call goes back in the history (this template has no tool support: it is rendered in the generic format)
    r = client.chat.completions.create(model=smol.model_name, temperature=0, max_tokens=20, tools=[WEATHER, TIME],
                                       tool_choice="none", messages=msgs + [
                                           {"role": "assistant", "tool_calls": [c.model_dump() for c in calls]},
                                           {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}])
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


def test_constrained_and_free_requests_batched(smol):
    """8 concurrent requests, half constrained: the free ones are the same as alone (greedy)."""
    free = [f"Tell me about {x}." for x in ("the sea", "mountains", "rivers", "forests")]
    schema = SCHEMAS[0][1]

    async def run():
        client = openai.AsyncOpenAI(base_url=smol.v1, api_key="x", max_retries=0, timeout=300)

        async def one(prompt, constrained):
            kw = {"response_format": response_format(schema)} if constrained else {}
            r = await client.chat.completions.create(model=smol.model_name, temperature=0, max_tokens=24,
                                                     messages=[{"role": "user", "content": prompt}], **kw)
            return r.choices[0].message.content

        try:
            alone = [await one(p, False) for p in free]
            together = await asyncio.gather(*(one(p, c) for p in free for c in (False, True)))
            return alone, together
        finally:
            await client.close()

    alone, together = asyncio.run(run())
    assert together[0::2] == alone
    for text in together[1::2]:
        jsonschema.validate(json.loads(text), schema)


BAD = [
    ({"response_format": response_format({"type": "objekt"})}, "response_format.json_schema.schema",
     "not a valid JSON schema"),
    ({"response_format": response_format({"type": "array", "uniqueItems": True})}, "response_format",
     "uniqueItems"),
    ({"guided_regex": "(ab"}, "guided_regex", "regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "missing"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "one output constraint"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "nope"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "unique"),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
]


@pytest.mark.parametrize("extra,param,words", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_structured_requests_get_400(smol, extra, param, words):
    body = {"model": smol.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra}
    r = httpx.post(smol.v1 + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_server_serves_after_bad_input(client, smol):
    r = client.chat.completions.create(model=smol.model_name, messages=ask("a color"), temperature=0,
                                       max_tokens=20, response_format=response_format(SCHEMAS[3][1]))
    assert json.loads(r.choices[0].message.content)["color"] in ("red", "green", "blue")


# ---- tool_choice "auto" on a checkpoint that speaks Hermes -----------------------------------------------------
@pytest.fixture(scope="module")
def tool_server(server_factory, tool_checkpoint):
    return server_factory(tool_checkpoint, 1, "--tool-call-parser", "hermes")


def test_auto_tool_call_and_follow_up(tool_server):
    client = openai.OpenAI(base_url=tool_server.v1, api_key="x", max_retries=0, timeout=120)
    kw = dict(model=tool_server.model_name, tools=[tool_model.WEATHER_TOOL], temperature=0, max_tokens=60)
    r = client.chat.completions.create(messages=tool_model.QUESTION, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    streamed = client.chat.completions.create(messages=tool_model.QUESTION, stream=True, **kw)
    deltas = [c.choices[0] for c in streamed]
    calls = [d for c in deltas for d in (c.delta.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].index == 0
    assert "".join(d.function.arguments or "" for d in calls) == call.function.arguments
    assert deltas[-1].finish_reason == "tool_calls"
    assert not "".join(c.delta.content or "" for c in deltas)
    r = client.chat.completions.create(messages=tool_model.follow_up(call.id, call.function.arguments), **kw)
    assert r.choices[0].message.content == tool_model.ANSWER and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.tool_calls is None
    # with tool_choice "none" the tools stay out of the prompt and nothing is parsed
    r = client.chat.completions.create(messages=tool_model.QUESTION, tool_choice="none", **kw)
    assert r.choices[0].message.tool_calls is None


def test_slow_compile_is_refused_then_cached(server_factory, checkpoints):
    s = server_factory(checkpoints("llama"), 1, "--grammar-compile-timeout", "0.000001")
    body = {"model": s.model_name, "prompt": "a", "max_tokens": 3, "guided_regex": "[a-z]{3}"}
    r = httpx.post(s.v1 + "/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_too_complex", r.text
    deadline = time.monotonic() + 30
    while True:  # the compile finished in the background and was cached: the same request now passes
        r = httpx.post(s.v1 + "/completions", json=body, timeout=60)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200 and re.fullmatch("[a-z]{3}", r.json()["choices"][0]["text"]), r.text


def test_generic_tools_on_a_template_without_tool_support(client, smol):
    """SmolLM2's template cannot describe tools: the generic format does (server/api/parsers/generic.py). Under
    tool_choice "auto" the model answers with a call whose arguments validate, streamed and not; the call and the
    tool's result go back through the same format, and a final answer comes as text. (A {"response": ...} answer
    streamed as its decoded text: tests/server/test_tool_parser.py, at every split.)"""
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=smol.model_name, messages=msgs, tools=[WEATHER], temperature=0,
                                       max_tokens=60)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(client.chat.completions.create(model=smol.model_name, messages=msgs, tools=[WEATHER], temperature=0,
                                                 max_tokens=60, stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and "".join(d.function.arguments for d in deltas) == \
        call.function.arguments
    follow = msgs + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    r2 = client.chat.completions.create(model=smol.model_name, messages=follow, tools=[WEATHER], temperature=0,
                                        max_tokens=60)
    again = r2.choices[0].message.tool_calls  # (a 135M model calls again: whatever it answers is in the format)
    for c in again or []:
        jsonschema.validate(json.loads(c.function.arguments), WEATHER["function"]["parameters"])
    assert again or r2.choices[0].message.content
    final = client.chat.completions.create(model=smol.model_name, messages=follow, tools=[WEATHER], temperature=0,
                                           max_tokens=12, tool_choice="none")
    assert final.choices[0].message.content and final.choices[0].message.tool_calls is None


def test_an_agent_loop_with_generic_tools(smol):
    """The OpenAI Agents SDK over chat completions on SmolLM2 with a function tool: its call comes with arguments
    that validate; the tool's output ends the run (stop_on_first_tool: a 135M model does not reliably answer after
    a tool result)."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city"""
        seen.append(city)
        return "sunny, 24 C"

    async def run():
        client = openai.AsyncOpenAI(base_url=smol.v1, api_key="x", max_retries=0, timeout=120)
        try:
            agent = Agent(name="weather", model=OpenAIChatCompletionsModel(model=smol.model_name, openai_client=client),
                          tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                          model_settings=ModelSettings(temperature=0, max_tokens=60))
            return (await Runner.run(agent, "What is the weather in Paris?", max_turns=3)).final_output
        finally:
            await client.close()

    assert asyncio.run(run()) == "sunny, 24 C" and seen == ["Paris"]
