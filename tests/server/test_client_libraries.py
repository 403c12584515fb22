"""The client libraries people use, unchanged, against one real `tpserve serve`: langchain-openai, instructor,
pydantic-ai, the OpenAI Agents SDK and litellm (issue 27).

One server for the module: a tiny checkpoint trained here (tests/client_model.py) to make a get_weather call, answer
after the tool's result, and finish a pydantic-ai output tool; served with `--tool-call-parser hermes`. What is
asserted is deterministic: greedy text equal between a library's gathered and streamed paths and a raw request,
the trained conversations' calls and answers, and JSON that the grammar engine forces to fit a schema. A logging
proxy (tests/wire_log.py) sits between the libraries and the server, so the tests also check what each library
sends. No library may reach the internet: the opt-outs are set below, and an audit hook fails any test during which
something outside this machine was looked up or connected to.

The Responses API tests run on server/api/responses.py (POST /v1/responses), the litellm embedding test on
/v1/embeddings.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, Field

import client_model
import tool_model
from wire_log import WireLog

# no phoning home: litellm fetches its model cost map from GitHub at import unless told to use its bundled copy; the
# Agents SDK exports traces to OpenAI (whenever OPENAI_API_KEY is set) unless tracing is off; langsmith traces when
# its variables say so
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
os.environ["LANGCHAIN_TRACING_V2"] = "false"
os.environ["LANGSMITH_TRACING"] = "false"

QUESTION = tool_model.QUESTION[0]["content"]
HELLO = [{"role": "user", "content": "Hello world!"}]


class Report(BaseModel):
    city: str = Field(max_length=12)
    sky: Literal["sunny", "rainy"]


EXPECTED_REPORT = Report(**client_model.REPORT)


# ---- what leaves this machine --------------------------------------------------------------------------------
_external: list[tuple] = []
_LOCAL = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def _audit(event: str, args: tuple) -> None:
    if event == "socket.getaddrinfo":
        host = args[0].decode() if isinstance(args[0], bytes) else args[0]
        if host and host not in _LOCAL:
            _external.append((event, host, args[1]))
    elif event == "socket.connect":
        addr = args[1]
        if isinstance(addr, tuple) and addr and addr[0] not in _LOCAL:
            _external.append((event, addr))


sys.addaudithook(_audit)  # cannot be removed; it only appends to a list


@pytest.fixture(autouse=True)
def no_internet():
    before = len(_external)
    yield
    if len(_external) > before:
        pytest.fail(f"a client library reached outside this machine: {_external[before:]}")


# ---- the server and the proxy ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv(server_factory, tmp_path_factory):
    folder = client_model.make_client_checkpoint(tmp_path_factory.mktemp("clientmodel"))
    return server_factory(folder, 1, "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def wire_log(srv):
    with WireLog(srv.url) as w:
        yield w


@pytest.fixture
def wire(wire_log):
    wire_log.clear()
    return wire_log


def raw_chat(srv, messages: list[dict], **kw) -> dict:
    body = {"model": srv.model_name, "messages": messages, "temperature": 0, **kw}
    r = httpx.post(srv.v1 + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def chat_posts(wire: WireLog) -> list[dict]:
    exchanges = wire.to("/v1/chat/completions")
    assert all(e.status == 200 for e in exchanges), [(e.status, e.answer) for e in exchanges]
    return [e.body for e in exchanges]


# ---- langchain-openai ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(srv, wire_log):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=srv.model_name, base_url=wire_log.v1, api_key="x", temperature=0, max_tokens=60,
                      max_retries=0, timeout=120)


def test_langchain_invoke_and_stream_equal_greedy(srv, wire, chat_model):
    expected = raw_chat(srv, HELLO, max_tokens=60)["choices"][0]["message"]["content"]
    assert expected
    message = chat_model.invoke(HELLO[0]["content"])
    assert message.content == expected
    assert message.response_metadata["finish_reason"] in ("stop", "length")
    assert "".join(chunk.content for chunk in chat_model.stream(HELLO[0]["content"])) == expected
    gathered, streamed = chat_posts(wire)
    assert (gathered["stream"], streamed["stream"]) == (False, True)
    assert gathered["max_completion_tokens"] == 60  # langchain sends the newer name, not max_tokens


def test_langchain_bind_tools_round_trip(wire, chat_model):
    from langchain_core.messages import HumanMessage, ToolMessage

    bound = chat_model.bind_tools([tool_model.WEATHER_TOOL])
    ai = bound.invoke([HumanMessage(QUESTION)])
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert ai.content == "" and ai.response_metadata["finish_reason"] == "tool_calls"
    answer = bound.invoke([HumanMessage(QUESTION), ai, ToolMessage(tool_model.TOOL_RESULT,
                                                                   tool_call_id=ai.tool_calls[0]["id"])])
    assert answer.content == tool_model.ANSWER and not answer.tool_calls
    # streamed: the call arrives as chunks that add up to the same call
    merged = None
    for chunk in bound.stream([HumanMessage(QUESTION)]):
        merged = chunk if merged is None else merged + chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("get_weather", {"city": "Paris"})]
    first, follow, streamed = chat_posts(wire)
    assert "tool_choice" not in first  # tool_choice "auto" is the default: the trained model chooses to call
    assert follow["messages"][1]["tool_calls"][0]["id"] == ai.tool_calls[0]["id"]
    assert follow["messages"][2] == {"role": "tool", "content": tool_model.TOOL_RESULT,
                                     "tool_call_id": ai.tool_calls[0]["id"]}


def test_langchain_structured_output_json_schema(wire, chat_model):
    report = chat_model.with_structured_output(Report, method="json_schema").invoke(
        client_model.REPORT_QUESTION[0]["content"])
    assert report == EXPECTED_REPORT  # the grammar closed the object where the model wanted one more key
    (body,) = chat_posts(wire)
    fmt = body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    assert fmt["json_schema"]["schema"]["additionalProperties"] is False


def test_langchain_structured_output_function_calling(wire, chat_model):
    structured = chat_model.with_structured_output(Report, method="function_calling", include_raw=True)
    out = structured.invoke(client_model.REPORT_QUESTION[0]["content"])
    assert out["parsing_error"] is None and out["parsed"] == EXPECTED_REPORT
    (body,) = chat_posts(wire)
    assert body["tool_choice"] == {"type": "function", "function": {"name": "Report"}}
    assert body["parallel_tool_calls"] is False


def test_langchain_responses_api_equals_chat_completions(srv, wire):
    """ChatOpenAI(use_responses_api=True): POST /v1/responses, gathered and streamed, answers what chat completions
    answers for the same conversation (greedy)."""
    from langchain_openai import ChatOpenAI

    expected = raw_chat(srv, HELLO, max_tokens=60)["choices"][0]["message"]["content"]
    llm = ChatOpenAI(model=srv.model_name, base_url=wire.v1, api_key="x", temperature=0, max_tokens=60,
                     max_retries=0, timeout=120, use_responses_api=True)
    assert llm.invoke(HELLO[0]["content"]).text == expected
    merged = None
    for chunk in llm.stream(HELLO[0]["content"]):
        merged = chunk if merged is None else merged + chunk
    assert merged.text == expected
    posts = wire.to("/v1/responses")
    assert [(e.status, e.body["stream"]) for e in posts] == [(200, False), (200, True)]
    assert posts[0].body["max_output_tokens"] == 60


# ---- instructor ------------------------------------------------------------------------------------------------
def instructor_client(wire, mode_name: str):
    import openai

    instructor = pytest.importorskip("instructor", reason="instructor is installed apart, with pip install --no-deps "
                                     "instructor>=1.17 (its jiter<0.15 pin would take openai back to 3.3)")

    client = openai.OpenAI(base_url=wire.v1, api_key="x", max_retries=0, timeout=120)
    return instructor.from_openai(client, mode=getattr(instructor.Mode, mode_name))


def instructor_report(srv, wire, mode_name: str):
    return instructor_client(wire, mode_name).chat.completions.create_with_completion(
        model=srv.model_name, response_model=Report, messages=client_model.REPORT_QUESTION, temperature=0,
        max_tokens=60, max_retries=0)


def test_instructor_tools(srv, wire):
    report, completion = instructor_report(srv, wire, "TOOLS")
    assert isinstance(report, Report) and report.model_dump() == client_model.REPORT  # a subclass of Report
    assert completion.choices[0].finish_reason == "tool_calls"
    (body,) = chat_posts(wire)
    assert body["tool_choice"] == {"type": "function", "function": {"name": "Report"}}


def test_instructor_json_schema(srv, wire):
    report, completion = instructor_report(srv, wire, "JSON_SCHEMA")
    assert isinstance(report, Report) and report.model_dump() == client_model.REPORT
    assert completion.choices[0].finish_reason == "stop"
    (body,) = chat_posts(wire)
    assert body["response_format"]["type"] == "json_schema"


def _raw_object(srv, wire, client: str) -> dict:
    """The JSON object the server produced for a Report whose schema does not say additionalProperties."""
    if client == "langchain-function_calling":
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(model=srv.model_name, base_url=wire.v1, api_key="x", temperature=0, max_tokens=60,
                         max_retries=0)
        out = llm.with_structured_output(Report, method="function_calling", include_raw=True).invoke(
            client_model.REPORT_QUESTION[0]["content"])
        return out["raw"].tool_calls[0]["args"]
    _, completion = instructor_report(srv, wire, client.split("-")[1])
    message = completion.choices[0].message
    return json.loads(message.tool_calls[0].function.arguments if message.tool_calls else message.content)


@pytest.mark.parametrize("client", ["instructor-TOOLS", "instructor-JSON_SCHEMA", "langchain-function_calling"])
def test_schema_without_additional_properties_gets_no_unlisted_keys(srv, wire, client):
    """These clients send pydantic's schema as it is, without additionalProperties: false (instructor always;
    langchain unless strict=True). The model writes an unlisted "note" key when nothing stops it; tpserve closes
    objects that list their properties by default, as vLLM's default backend does (server/engine/structured/constraint.py,
    closed_objects), so the answer has only the declared keys."""
    obj = _raw_object(srv, wire, client)
    (body,) = chat_posts(wire)
    schema = (body["response_format"]["json_schema"]["schema"] if "response_format" in body
              else body["tools"][0]["function"]["parameters"])
    assert "additionalProperties" not in schema
    assert set(obj) == {"city", "sky"}, obj


# ---- pydantic-ai -----------------------------------------------------------------------------------------------
def pydantic_ai_agent(srv, wire, calls: list, **kw):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    def get_weather(city: str) -> str:
        """Current weather in a city"""
        calls.append(city)
        return tool_model.TOOL_RESULT

    model = OpenAIChatModel(srv.model_name, provider=OpenAIProvider(base_url=wire.v1, api_key="x"))
    return Agent(model, tools=[get_weather], model_settings={"temperature": 0, "max_tokens": 100}, **kw)


def test_pydantic_ai_agent_with_output_type_and_tool(srv, wire):
    calls: list[str] = []
    result = pydantic_ai_agent(srv, wire, calls, output_type=Report).run_sync(QUESTION)
    assert result.output == EXPECTED_REPORT and calls == ["Paris"]
    first, second = chat_posts(wire)
    # the output is a tool too ("final_result"), so every turn must call one: tool_choice "required"
    assert first["tool_choice"] == second["tool_choice"] == "required"
    assert [t["function"]["name"] for t in first["tools"]] == ["get_weather", "final_result"]
    assert all(t["function"]["strict"] is True for t in first["tools"])
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": second["messages"][1]["tool_calls"][0]["id"],
                                      "content": tool_model.TOOL_RESULT}


def test_pydantic_ai_agent_with_tool_and_text_output(srv, wire):
    calls: list[str] = []
    result = pydantic_ai_agent(srv, wire, calls).run_sync(QUESTION)
    assert result.output == tool_model.ANSWER and calls == ["Paris"]
    assert [b["tool_choice"] for b in chat_posts(wire)] == ["auto", "auto"]


# ---- the OpenAI Agents SDK -------------------------------------------------------------------------------------
def agents_run(srv, wire, api: str, streamed: bool) -> tuple[str, list[str]]:
    import openai
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city"""
        calls.append(city)
        return tool_model.TOOL_RESULT

    client = openai.AsyncOpenAI(base_url=wire.v1, api_key="x", max_retries=0, timeout=120)
    model_cls = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(name="weather", model=model_cls(model=srv.model_name, openai_client=client), tools=[get_weather],
                  model_settings=ModelSettings(temperature=0, max_tokens=60))

    async def run():
        try:
            if not streamed:
                return (await Runner.run(agent, QUESTION)).final_output
            result = Runner.run_streamed(agent, QUESTION)
            text = ""
            async for event in result.stream_events():
                kind = getattr(event.data, "type", "") if event.type == "raw_response_event" else ""
                if kind == "response.output_text.delta":
                    text += event.data.delta
            assert text == result.final_output  # the streamed deltas add up to the answer
            return result.final_output
        finally:
            await client.close()

    return asyncio.run(run()), calls


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_openai_agents_function_tool_over_chat_completions(srv, wire, streamed):
    """The SDK's OpenAIChatCompletionsModel, which users of other OpenAI-compatible servers often pick."""
    output, calls = agents_run(srv, wire, "chat", streamed)
    assert output == tool_model.ANSWER and calls == ["Paris"]
    assert len(chat_posts(wire)) == 2


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_openai_agents_function_tool_over_responses_api(srv, wire, streamed):
    """The SDK's default model: POST /v1/responses, a function_call item, then function_call_output."""
    output, calls = agents_run(srv, wire, "responses", streamed)
    assert output == tool_model.ANSWER and calls == ["Paris"]
    posts = wire.to("/v1/responses")
    assert [(e.status, e.body.get("stream", False)) for e in posts] == [(200, streamed)] * 2
    # what the SDK sends besides input: include [] and strict tools (its own schema, additionalProperties false)
    assert posts[0].body["include"] == [] and posts[0].body["tools"][0]["strict"] is True
    kinds = [item.get("type", "message") for item in posts[1].body["input"]]
    assert kinds == ["message", "function_call", "function_call_output"]


# ---- litellm ---------------------------------------------------------------------------------------------------
def test_litellm_completion_and_stream_equal_greedy(srv, wire):
    import litellm

    expected = raw_chat(srv, HELLO, max_tokens=24)["choices"][0]["message"]["content"]
    kw = dict(model="openai/" + srv.model_name, api_base=wire.v1, api_key="x", messages=HELLO, temperature=0,
              max_tokens=24)
    r = litellm.completion(**kw)
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(stream=True, **kw))
    assert streamed == expected
    gathered, stream_body = chat_posts(wire)
    assert gathered["model"] == srv.model_name  # the "openai/" prefix is litellm's, not sent
    assert gathered["max_tokens"] == 24 and stream_body["stream"] is True


def test_litellm_embedding(srv, wire):
    import litellm

    texts = ["Hello world!", "The capital of France is Paris."]
    r = litellm.embedding(model="openai/" + srv.model_name, api_base=wire.v1, api_key="x", input=texts)
    vectors = [d["embedding"] for d in r.data]
    raw = httpx.post(srv.v1 + "/embeddings", timeout=60,
                     json={"model": srv.model_name, "input": texts, "encoding_format": "float"}).json()
    assert vectors == [pytest.approx(d["embedding"], abs=1e-6) for d in raw["data"]]
    assert len(vectors) == 2 and len(vectors[0]) == 64 and vectors[0] != vectors[1]  # the model's hidden size
    assert all(math.isclose(math.fsum(x * x for x in v), 1.0, rel_tol=1e-4) for v in vectors)  # L2-normalized
    assert r.usage.prompt_tokens == raw["usage"]["prompt_tokens"] > 0
    (sent,) = wire.bodies("/v1/embeddings")
    assert sent["input"] == texts and sent["model"] == srv.model_name
