"""POST /tokenize and /detokenize (vLLM's shapes) against a real server.

One server for the module: the tiny Llama checkpoint, its tokenizer made to add a BOS token (so add_special_tokens
shows), a chat template that renders tools, tool calls and a `note` template variable, --tool-call-parser hermes
(so a chat request with tools is served with tool_choice "auto") and an API key. The counts are checked against the
`usage.prompt_tokens` of the same /v1/completions and /v1/chat/completions requests.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tool_model import TOOL_TEMPLATE, WEATHER_TOOL, follow_up

KEY = "tok-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BOS = 1
# TOOL_TEMPLATE with a system line from the `note` variable (chat_template_kwargs)
TEMPLATE = "{%- if note %}<|im_start|>system\n{{ note }}<|im_end|>\n{% endif %}" + TOOL_TEMPLATE
TEXTS = ["The capital of France is Paris.", "日本語のテキスト", "Emoji: 😀 🚀 and café", "def add(a, b):\n    return a + b\n",
         "  spaces  and\ttabs\n\n", "x"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def folder(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenize") / "llama"
    shutil.copytree(checkpoints("llama"), out)
    spec = json.loads((out / "tokenizer.json").read_text())
    spec["post_processor"] = {  # "<s> $A": encode() adds a BOS unless add_special_tokens is false
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [BOS], "tokens": ["<s>"]}}}
    (out / "tokenizer.json").write_text(json.dumps(spec))
    (out / "chat_template.jinja").write_text(TEMPLATE)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 1024  # a prompt with the tools is ~330 tokens
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def srv(server_factory, folder):
    return server_factory(folder, 1, "--max-model-len", "1024", "--max-num-seqs", "4", "--api-key", KEY,
                          "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def hf_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def post(srv, path: str, body, headers=AUTH) -> httpx.Response:
    if isinstance(body, str):
        return httpx.post(srv.url + path, content=body, headers={**headers, "content-type": "application/json"},
                          timeout=60)
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60)


def tokenize(srv, **body) -> dict:
    r = post(srv, "/tokenize", {"model": srv.model_name, **body})
    assert r.status_code == 200, r.text
    return r.json()


def detokenize(srv, tokens: list[int]) -> str:
    r = post(srv, "/detokenize", {"model": srv.model_name, "tokens": tokens})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def chat_usage(srv, **body) -> int:
    r = post(srv, "/v1/chat/completions", {"model": srv.model_name, "max_tokens": 1, **body})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_round_trips_and_special_tokens(srv, hf_tokenizer):
    for text in TEXTS:
        plain = tokenize(srv, prompt=text, add_special_tokens=False)
        assert plain["tokens"] == hf_tokenizer.encode(text, add_special_tokens=False)
        assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == 1024
        assert detokenize(srv, plain["tokens"]) == text
        default = tokenize(srv, prompt=text)  # add_special_tokens defaults to true, as vLLM
        assert default["tokens"] == [BOS] + plain["tokens"] and default["count"] == plain["count"] + 1
        assert detokenize(srv, default["tokens"]) == "<s>" + text  # special tokens are kept, as vLLM
    assert detokenize(srv, []) == ""


def test_count_equals_completion_usage(srv):
    for text in TEXTS[:3]:
        r = post(srv, "/v1/completions", {"model": srv.model_name, "prompt": text, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert tokenize(srv, prompt=text)["count"] == r.json()["usage"]["prompt_tokens"]


def test_chat_count_equals_chat_usage(srv):
    with_prompt = tokenize(srv, messages=CHAT)
    assert with_prompt["count"] == chat_usage(srv, messages=CHAT)
    without = tokenize(srv, messages=CHAT, add_generation_prompt=False)
    assert without["count"] == chat_usage(srv, messages=CHAT, add_generation_prompt=False)
    assert detokenize(srv, with_prompt["tokens"]).endswith("<|im_start|>assistant")  # {%- ate the newline
    assert with_prompt["tokens"][: without["count"]] == without["tokens"] and with_prompt["count"] > without["count"]
    assert with_prompt["tokens"][0] != BOS  # the chat template writes the special tokens: none added
    # continue_final_message: the last (assistant) message is left open for the answer to continue
    partial = CHAT + [{"role": "assistant", "content": "The capital is"}]
    cont = tokenize(srv, messages=partial, add_generation_prompt=False, continue_final_message=True)
    assert detokenize(srv, cont["tokens"]).endswith("The capital is")
    assert cont["count"] == chat_usage(srv, messages=partial, add_generation_prompt=False,
                                       continue_final_message=True)
    # chat_template_kwargs reach the template, on both endpoints alike
    noted = tokenize(srv, messages=CHAT, chat_template_kwargs={"note": "Answer in French."})
    assert "Answer in French." in detokenize(srv, noted["tokens"]) and noted["count"] > with_prompt["count"]
    assert noted["count"] == chat_usage(srv, messages=CHAT, chat_template_kwargs={"note": "Answer in French."})


def test_tools_in_messages(srv):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    bare = tokenize(srv, messages=question)
    tooled = tokenize(srv, messages=question, tools=[WEATHER_TOOL])
    assert '"name": "get_weather"' in detokenize(srv, tooled["tokens"]) and tooled["count"] > bare["count"] + 20
    assert tooled["count"] == chat_usage(srv, messages=question, tools=[WEATHER_TOOL])  # tool_choice "auto"
    assert tooled["count"] == chat_usage(srv, messages=question, tools=[WEATHER_TOOL], tool_choice="required")
    # an earlier call and the tool's answer in the history
    history = follow_up("call_1")
    after = tokenize(srv, messages=history, tools=[WEATHER_TOOL])
    text = detokenize(srv, after["tokens"])
    assert "<tool_call>" in text and "sunny, 24 C" in text
    assert after["count"] == chat_usage(srv, messages=history, tools=[WEATHER_TOOL])


def test_return_token_strs(srv, hf_tokenizer):
    text = TEXTS[0]
    asked = tokenize(srv, prompt=text, return_token_strs=True)
    assert asked["token_strs"] == hf_tokenizer.convert_ids_to_tokens(asked["tokens"])
    assert len(asked["token_strs"]) == asked["count"] and asked["token_strs"][0] == "<s>"
    assert "token_strs" not in tokenize(srv, prompt=text)
    chat = tokenize(srv, messages=CHAT, return_token_strs=True)
    assert chat["token_strs"][0] == "<|im_start|>" and len(chat["token_strs"]) == chat["count"]


def test_longer_than_the_model_is_still_counted(srv):
    text = TEXTS[0] * 200
    r = tokenize(srv, prompt=text)
    assert r["count"] > r["max_model_len"] and detokenize(srv, r["tokens"][1:]) == text


def test_api_key_guards_both(srv):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = post(srv, path, body, headers)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert post(srv, path, body).status_code == 200


VOCAB = 387  # the tiny Llama's (384 tokenizer entries, padded)
BAD = [
    ("/tokenize", {}, 400, None),
    ("/tokenize", {"prompt": "hi", "messages": CHAT}, 400, None),
    ("/tokenize", {"prompt": ["hi"]}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "tools": [WEATHER_TOOL]}, 400, None),
    ("/tokenize", {"prompt": "hi", "add_generation_prompt": False}, 400, None),
    ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, 400, None),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ("/tokenize", {"messages": CHAT * 600}, 400, "messages"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, None),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}}, 400,
     "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "tools": [WEATHER_TOOL, WEATHER_TOOL]}, 400, "tools"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objekt"}}}]}, 400, "tools[0].function.parameters"),
    ("/tokenize", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", "{not json", 400, None),
    ("/tokenize", "[]", 400, None),
    ("/detokenize", {"tokens": [1, VOCAB]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**30]}, 400, None),
    ("/detokenize", {"tokens": [-1]}, 400, None),
    ("/detokenize", {"tokens": "hi"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "nope"}, 404, "model"),
]


def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(srv):
    for path, body, status, param in BAD:
        r = post(srv, path, body)
        assert r.status_code == status, (path, str(body)[:200], r.status_code, r.text[:300])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        if param is not None:
            assert err["param"] == param, err
        if status == 404:
            assert err["code"] == "model_not_found", err
    assert post(srv, "/detokenize", {"tokens": [VOCAB - 1]}).status_code == 200  # the last id is in
    assert httpx.get(srv.url + "/health", timeout=10).json() == {"status": "ok"}
    assert detokenize(srv, tokenize(srv, prompt="still here", add_special_tokens=False)["tokens"]) == "still here"
