"""The HTTP API's shapes in one process: the real FastAPI app over a real Engine stepping on its own thread, against
the fake executor (tests/helpers/fake_executor.py), through httpx.ASGITransport: no sockets, no ranks, no model.
The answers are checked against the fake model's reference tokens, decoded by the same tokenizer."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from server.api.app import ServerState, build_app
from tests.helpers.fake_executor import make_engine, reference
from tests.tiny import make_tokenizer

MESSAGES = [{"role": "user", "content": "Hello world! How are you today?"}]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    engine, runner = make_engine((tokenizer, str(folder)), num_blocks=96)
    engine.start()
    state = ServerState(engine, tokenizer, "fake", runner.vocab)
    yield build_app(state), tokenizer, runner
    engine.stop()


def call(app, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=30) as client:
            return await client.request(method, path, **kw)

    return asyncio.run(go())


def expected_text(tokenizer, runner, n: int) -> tuple[str, int]:
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
    return tokenizer.decode(reference(prompt, n, runner.vocab)), len(prompt)


def test_chat_completion_body(api):
    app, tokenizer, runner = api
    r = call(app, "POST", "/v1/chat/completions", json={"model": "fake", "messages": MESSAGES, "max_tokens": 6,
                                                        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    text, prompt_len = expected_text(tokenizer, runner, 6)
    assert body["object"] == "chat.completion" and body["model"] == "fake" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"] == text
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert body["usage"]["prompt_tokens"] == prompt_len and body["usage"]["completion_tokens"] == 6
    assert body["usage"]["total_tokens"] == prompt_len + 6


def test_streamed_chunks_add_up_to_the_same_text(api):
    app, tokenizer, runner = api
    r = call(app, "POST", "/v1/chat/completions", json={
        "model": "fake", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == expected_text(tokenizer, runner, 6)[0]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_bad_requests_get_openai_errors(api):
    app, _, _ = api
    r = call(app, "POST", "/v1/chat/completions", json={"model": "fake", "messages": MESSAGES, "max_tokens": -1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and "max_tokens" in err["message"]
    r = call(app, "POST", "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = call(app, "POST", "/v1/chat/completions", json={"model": "other", "messages": MESSAGES})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_models_health_and_completions(api):
    app, tokenizer, runner = api
    assert [m["id"] for m in call(app, "GET", "/v1/models").json()["data"]] == ["fake"]
    assert call(app, "GET", "/health").status_code == 200
    prompt = tokenizer("Hello world")["input_ids"]
    r = call(app, "POST", "/v1/completions", json={"model": "fake", "prompt": "Hello world", "max_tokens": 4,
                                                   "temperature": 0, "ignore_eos": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == tokenizer.decode(reference(prompt, 4, runner.vocab))
    assert len(choice["logprobs"]["tokens"]) == 4 and all(len(t) <= 2 for t in choice["logprobs"]["top_logprobs"])
