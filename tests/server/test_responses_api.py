"""The Responses API (/v1/responses) through the official `openai` client against a real server.

Greedy answers are compared with the chat completion the request means (the same prompt tokens, so the same text);
the tool round trip runs on the tiny model trained to call a tool (tests/tool_model.py). The store's own cases (each
key's share, a DELETE while the response runs, a client that goes away) run in process, at the end.
"""

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

import tool_model

KEY, OTHER = "key-one", "key-two"


@pytest.fixture(scope="module")
def srv(server_factory, checkpoints):
    return server_factory(checkpoints("llama_long"), 1, "--max-model-len", "768", "--max-num-seqs", "8",
                          "--api-key", f"{KEY},{OTHER}", "--responses-store-max-count", "6",
                          "--responses-store-key-share", "1")  # (each key's share: in process, below)


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.v1, api_key=KEY, max_retries=0, timeout=120)


def chat_text(client, srv, messages, **kw):
    return client.chat.completions.create(model=srv.model_name, messages=messages, temperature=0, **kw)


def test_text_answer_equals_the_chat_completion(client, srv):
    r = client.responses.create(model=srv.model_name, input="Hello world!", instructions="Be brief.",
                                max_output_tokens=12, temperature=0)
    c = chat_text(client, srv, [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hello world!"}], max_tokens=12)
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    if c.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    assert r.id.startswith("resp_") and r.model == srv.model_name and r.instructions == "Be brief."


def test_stream_events_in_order_with_sequence_numbers(client, srv):
    kw = dict(model=srv.model_name, input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
              max_output_tokens=10, temperature=0)
    full = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    end = "response.incomplete" if full.status == "incomplete" else "response.completed"
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", end]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == full.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == full.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    # the raw stream names each event on an `event:` line, as OpenAI's does
    with httpx.stream("POST", srv.v1 + "/responses", headers={"Authorization": f"Bearer {KEY}"},
                      json={**kw, "stream": True}, timeout=60) as raw:
        lines = [line for line in raw.iter_lines() if line]
    assert lines[0] == "event: response.created" and json.loads(lines[1][6:])["type"] == "response.created"


def test_json_schema_format(client, srv):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model=srv.model_name, input="A person as JSON", max_output_tokens=80, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_forced_function_call_streamed_and_not(client, srv):
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
              "additionalProperties": False}  # bounded: a random model's string must end within max_output_tokens
    tool = {"type": "function", "name": "get_weather", "description": "weather", "parameters": params, "strict": True}
    kw = dict(model=srv.model_name, input="Weather?", tools=[tool], max_output_tokens=120, temperature=0,
              tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), tool["parameters"])
    events = list(client.responses.create(stream=True, **kw))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == calls[0].arguments
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert added and added[0].item.status == "in_progress"
    assert events[-1].type == "response.completed"


def test_previous_response_id_continues_the_conversation(client, srv):
    first = client.responses.create(model=srv.model_name, input="Hello", max_output_tokens=6, temperature=0)
    second = client.responses.create(model=srv.model_name, input="More", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    explicit = chat_text(client, srv, [{"role": "user", "content": "Hello"},
                                       {"role": "assistant", "content": first.output_text},
                                       {"role": "user", "content": "More"}], max_tokens=6)
    assert second.output_text == explicit.choices[0].message.content
    assert second.usage.input_tokens == explicit.usage.prompt_tokens
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's blocks came from the prefix cache
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_store_false_delete_and_per_key_isolation(client, srv):
    other = openai.OpenAI(base_url=srv.v1, api_key=OTHER, max_retries=0, timeout=60)
    r = client.responses.create(model=srv.model_name, input="Hello", max_output_tokens=3, temperature=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)  # another key's response does not exist for this one
    with pytest.raises(openai.BadRequestError) as e:  # OpenAI's 400 for a previous response it does not have
        other.responses.create(model=srv.model_name, input="x", previous_response_id=r.id, max_output_tokens=2)
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert e.value.body["param"] == "response_id"
    unstored = client.responses.create(model=srv.model_name, input="Hello", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    assert httpx.get(f"{srv.v1}/responses/{unstored.id}").status_code == 401  # no key at all
    # the scheme is case-insensitive (RFC 7235), and the owner is the key, however the scheme was spelled
    kept = client.responses.create(model=srv.model_name, input="Hello", max_output_tokens=2,
                                   metadata={f"k{i}": "v" * 512 for i in range(16)})  # (at OpenAI's limits)
    r = httpx.get(f"{srv.v1}/responses/{kept.id}", headers={"Authorization": f"bearer {KEY}"})
    assert r.status_code == 200 and len(r.json()["metadata"]) == 16


def test_the_store_evicts_the_least_recently_used(client, srv):
    ids = [client.responses.create(model=srv.model_name, input=f"n{i}", max_output_tokens=2).id for i in range(4)]
    client.responses.retrieve(ids[0])  # now the most recently used of the four
    for i in range(5):  # the store holds 6: five more push out the older ones, ids[0] last of them
        client.responses.create(model=srv.model_name, input=f"m{i}", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=srv.model_name, input="x", previous_response_id=ids[1], max_output_tokens=2)
    assert "evicted" in e.value.body["message"] and e.value.body["code"] == "previous_response_not_found"
    lines = httpx.get(srv.url + "/metrics").text.splitlines()
    evicted = [float(x.split()[-1]) for x in lines if x.startswith("tpserve_responses_evicted_total")]
    stored = [float(x.split()[-1]) for x in lines if x.startswith("tpserve_responses_stored ")]
    assert evicted and evicted[0] >= 3 and stored == [6.0]


def test_cancel_a_streaming_response(client, srv):
    stream = client.responses.create(model=srv.model_name, input="Tell a long story", max_output_tokens=200,
                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
    events = iter(stream)
    rid = next(events).response.id
    assert client.responses.retrieve(rid).status == "in_progress"
    cancelled = httpx.post(f"{srv.v1}/responses/{rid}/cancel", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert cancelled["status"] == "cancelled"
    rest = list(events)
    assert rest[-1].response.status == "cancelled" and rest[-1].response.usage.output_tokens < 200
    again = httpx.post(f"{srv.v1}/responses/{rid}/cancel", headers={"Authorization": f"Bearer {KEY}"})
    assert again.status_code == 400 and "cancelled" in again.json()["error"]["message"]


@pytest.mark.parametrize("extra, param", [
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["x"]}]}, "tools[0].type"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # (this model's template has no effort to set)
    ({"reasoning": {"summary": "verbose"}}, "reasoning.summary"),
    ({"input": [{"type": "mystery"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"previous_response_id": "resp_never"}, "previous_response_id"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"truncation": "auto"}, "truncation"),
    # OpenAI's metadata limits: 16 pairs, keys up to 64 characters, values up to 512
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
])
def test_unsupported_and_bad_fields_get_4xx(srv, extra, param):
    body = {"model": srv.model_name, "input": "Hello", "max_output_tokens": 2, **extra}
    r = httpx.post(srv.v1 + "/responses", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
    ok = httpx.post(srv.v1 + "/responses", json={"input": "Hi", "max_output_tokens": 2},
                    headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["status"] in ("completed", "incomplete")


def test_tool_round_trip_with_the_tool_model(server_factory, tool_checkpoint):
    s = server_factory(tool_checkpoint, 1, "--tool-call-parser", "hermes")
    client = openai.OpenAI(base_url=s.v1, api_key="x", max_retries=0, timeout=120)
    fn = tool_model.WEATHER_TOOL["function"]
    tools = [{"type": "function", "name": fn["name"], "description": fn["description"],
              "parameters": fn["parameters"]}]
    kw = dict(model=s.model_name, tools=tools, temperature=0, max_output_tokens=60)
    r = client.responses.create(input=tool_model.QUESTION[0]["content"], **kw)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert not [o for o in r.output if o.type == "message"] and r.status == "completed"
    # the same turn streamed: one function_call item, no text
    events = list(client.responses.create(input=tool_model.QUESTION[0]["content"], stream=True, **kw))
    assert not [e for e in events if e.type == "response.output_text.delta"]
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [call.arguments]
    # the tool's output sent back: by previous_response_id, and as the whole conversation in input
    output = {"type": "function_call_output", "call_id": call.call_id, "output": tool_model.TOOL_RESULT}
    chained = client.responses.create(input=[output], previous_response_id=r.id, **kw)
    assert chained.output_text == tool_model.ANSWER and chained.status == "completed"
    whole = client.responses.create(input=[{"role": "user", "content": tool_model.QUESTION[0]["content"]},
                                           {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                            "arguments": call.arguments}, output], **kw)
    assert whole.output_text == tool_model.ANSWER


def test_a_forced_call_cut_by_max_tokens_is_still_a_call(client, srv):
    """OpenAI's answer to a forced call that max_tokens cuts: the call, with the arguments as far as they came."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    kw = dict(model=srv.model_name, messages=[{"role": "user", "content": "Weather?"}], tools=[tool], max_tokens=60,
              temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    early = client.chat.completions.create(**{**kw, "max_tokens": 6}).choices[0]  # cut inside the name
    assert early.finish_reason == "length" and early.message.content is None
    assert [(c.function.name, c.function.arguments) for c in early.message.tool_calls] == [("get_weather", "")]
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    resp = client.responses.create(model=srv.model_name, input="Weather?", max_output_tokens=60, temperature=0,
                                   tools=[{"type": "function", **tool["function"]}],
                                   tool_choice={"type": "function", "name": "get_weather"})
    assert resp.status == "incomplete"
    assert [(o.type, o.arguments) for o in resp.output] == [("function_call", call.function.arguments)]


@pytest.mark.parametrize("path, extra, param", [
    ("/completions", {"best_of": 3}, "best_of"),
    ("/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/chat/completions", {"web_search_options": {}}, "web_search_options"),
])
def test_openai_fields_a_text_model_cannot_honour_are_refused(srv, path, extra, param):
    body = {"prompt": "Hi"} if path == "/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    r = httpx.post(srv.v1 + path, json={**body, "max_tokens": 2, **extra}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = {**body, "max_tokens": 2, "best_of": 1, "modalities": ["text"], "prediction": {"type": "content",
                                                                                      "content": "x"}}
    assert httpx.post(srv.v1 + path, json=ok, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


# ---- the store, in process: the real app over the fake engine paced like a model (tests/helpers/live_app.py) --------
K1, K2 = "k-one", "k-two"


@pytest.fixture(scope="module")
def paced(tmp_path_factory):
    from transformers import AutoTokenizer

    from server.api.responses import ResponseStore
    from tests.helpers.live_app import paced_app
    from tiny import make_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    store = ResponseStore(max_count=8, key_share=0.25)  # (two responses per key)
    with paced_app(tokenizer, str(folder), api_key=f"{K1},{K2},k-three", responses=store) as (app, state):
        yield app, state, tokenizer


def call(app, method: str, path: str, key: str = K1, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
            return await client.request(method, path, **kw)

    return asyncio.run(go())


def create(app, key: str = K1, **body) -> dict:
    r = call(app, "POST", "/v1/responses", key, json={"model": "fake", "max_output_tokens": 2, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_each_key_holds_at_most_its_share_of_the_store(paced):
    app, state, _ = paced
    theirs = create(app, K2, input="theirs")["id"]
    mine = [create(app, input=f"mine {i}")["id"] for i in range(3)]
    assert call(app, "GET", f"/v1/responses/{mine[0]}").status_code == 404  # K1's own oldest left first
    assert all(call(app, "GET", f"/v1/responses/{rid}").status_code == 200 for rid in mine[1:])
    assert call(app, "GET", f"/v1/responses/{theirs}", K2).status_code == 200  # untouched by K1's
    r = call(app, "POST", "/v1/responses", json={"input": "x", "previous_response_id": mine[0]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"


def test_the_share_bounds_bytes_too():
    from server.api.responses import ResponseStore, Stored

    store = ResponseStore(max_bytes=40_000, max_count=100, key_share=0.25)
    store.shared_by(2)
    assert (store.key_max_bytes, store.key_max_count) == (10_000, 25)
    for i in range(3):  # ~4 kB each: the third takes "a" past its 10 kB, and its oldest leaves
        store.put(f"a{i}", Stored({"status": "completed", "x": "y" * 4000}, [{"role": "user", "content": "z"}], "a"))
    store.put("b0", Stored({"status": "completed", "x": "y" * 4000}, [{"role": "user", "content": "z"}], "b"))
    assert [rid for rid in ("a0", "a1", "a2", "b0") if rid in store._items] == ["a1", "a2", "b0"]
    store.shared_by(1)  # one key (or none): every client is the same owner, and the whole store is theirs
    assert (store.key_max_bytes, store.key_max_count) == (40_000, 100)


def test_a_response_deleted_while_it_runs_stays_deleted(paced):
    from tests.helpers.live_app import drive

    app, state, _ = paced
    seen: dict = {}

    async def on_chunk(chunk: bytes):
        if "id" not in seen:  # the first event, response.created: delete the response while it runs
            event = json.loads(chunk.decode().split("data: ", 1)[1])
            seen["id"] = event["response"]["id"]
            status, body = await drive(app, "DELETE", f"/v1/responses/{seen['id']}",
                                       headers={"Authorization": f"Bearer {K1}"})
            seen["delete"] = status, json.loads(body)

    status, body = asyncio.run(drive(app, "POST", "/v1/responses", {
        "model": "fake", "input": "Hello", "max_output_tokens": 8, "stream": True, "ignore_eos": True},
        headers={"Authorization": f"Bearer {K1}"}, on_chunk=on_chunk))
    assert status == 200 and b"response.completed" in body or b"response.incomplete" in body
    assert seen["delete"] == (200, {"id": seen["id"], "object": "response.deleted", "deleted": True})
    assert call(app, "GET", f"/v1/responses/{seen['id']}").status_code == 404  # the run's last store was dropped
    r = call(app, "POST", "/v1/responses", json={"input": "x", "previous_response_id": seen["id"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert seen["id"] not in state.responses._deleted  # (the tombstone went with that last store)


def test_a_response_whose_client_went_away_keeps_its_input(paced):
    """A gathered (non-streamed) response whose client leaves is stored "cancelled" with its conversation, so a
    request that continues it keeps the history; before, it was stored without one, and the history was lost."""
    from tests.helpers.live_app import drive

    app, state, tokenizer = paced
    before = set(state.responses._items)
    status, _ = asyncio.run(drive(app, "POST", "/v1/responses", {
        "model": "fake", "input": "Tell a long story", "max_output_tokens": 1000, "ignore_eos": True},
        headers={"Authorization": f"Bearer {K2}"}, disconnect_after_body=True))
    (rid,) = set(state.responses._items) - before
    gone = call(app, "GET", f"/v1/responses/{rid}", K2).json()
    assert gone["status"] == "cancelled" and gone["usage"]["output_tokens"] < 1000
    r = call(app, "POST", "/v1/responses", K2, json={"model": "fake", "input": "More", "previous_response_id": rid,
                                                     "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    both = tokenizer.apply_chat_template([{"role": "user", "content": "Tell a long story"},
                                          {"role": "user", "content": "More"}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
    assert r.json()["usage"]["input_tokens"] == len(both)


def test_a_previous_response_that_is_not_stored_is_a_400_naming_it(paced):
    app, _, _ = paced
    unstored = create(app, input="Hello", store=False)["id"]
    kept = create(app, input="Hello")["id"]
    for rid, key in ((unstored, K1), ("resp_never", K1), (kept, K2)):  # (another key's: not found for this one)
        r = call(app, "POST", "/v1/responses", key, json={"input": "x", "previous_response_id": rid})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "previous_response_id", r.text
        assert err["code"] == "previous_response_not_found" and rid in err["message"]
