"""The chat templates today's families ship (llama.cpp's models/templates, fetched at test time: tests/helpers/
templates.py) render a conversation with tool calls, tool results and earlier reasoning through the server exactly as
transformers renders the same conversation written the way each template documents it; a template that raises is a
400 naming its message; `--tool-call-parser auto` and the generic format follow what the template can do."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from templates import template  # noqa: E402

from server.api.parsers import auto_tool_parser  # noqa: E402
from server.api.protocol import ChatMessage, Tool  # noqa: E402
from server.api.tool_calls import render_messages, template_supports_tools  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL_ID = "a1B2c3D4e"  # 9 letters and digits: Mistral's templates refuse any other id
ARGS = {"city": "Paris"}
# the conversation as a client sends it (OpenAI's shapes; the assistant's reasoning as this server returned it)
CLIENT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "I should look it up.", "tool_calls": [
        {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": "sunny, 24 C"},
    {"role": "assistant", "content": "It is sunny.", "reasoning_content": "The tool said sunny."},
    {"role": "user", "content": "Thanks. And tomorrow?"},
]

# name: (the template, the key its documentation reads an assistant's reasoning from, or None, and the tool format)
FAMILIES = {
    "qwen3": ("Qwen-Qwen3-0.6B", "reasoning_content", "hermes"),
    "qwen3_coder": ("Qwen3-Coder", None, "qwen3_coder"),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct", None, "llama3_json"),
    "mistral_nemo": ("mistralai-Mistral-Nemo-Instruct-2407", None, "mistral"),
    "mistral_small_3.2": ("Mistral-Small-3.2-24B-Instruct-2506", None, "mistral"),
    "gpt_oss": ("openai-gpt-oss-120b", "thinking", "openai"),
    "hermes3": ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", None, "hermes"),
    "deepseek_r1": ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", None, "deepseek_v3"),
}


def tokenizer_for(tmp_path_factory, name: str):
    from tiny import make_tokenizer
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp(name.replace(".", "_"))
    make_tokenizer(folder, template=template(FAMILIES[name][0]))
    return AutoTokenizer.from_pretrained(str(folder))


def documented(messages: list[dict], reasoning_key: str | None) -> list[dict]:
    """The conversation as the template's own documentation writes it: arguments as objects, the reasoning under the
    template's key (none where it has no place for it), no content on a call-only turn but an empty string."""
    out = []
    for m in copy.deepcopy(messages):
        if m.get("tool_calls"):
            for c in m["tool_calls"]:
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
        reasoning = m.pop("reasoning_content", None)
        if reasoning and reasoning_key:
            m[reasoning_key] = reasoning
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    return out


@pytest.mark.parametrize("turns", [len(CLIENT), 4], ids=["after-answer", "after-tool-result"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_history_renders_as_transformers_renders_it(tmp_path_factory, name, turns):
    tok = tokenizer_for(tmp_path_factory, name)
    _, key, fmt = FAMILIES[name]
    tools = [Tool.model_validate(WEATHER).model_dump(exclude_none=True)]
    in_template = template_supports_tools(tok)
    assert auto_tool_parser(tok) == fmt
    convo = CLIENT[:turns]
    ours = render_messages([ChatMessage.model_validate(m) for m in convo], in_template)
    kw = {"tools": tools} if in_template else {}
    got = tok.apply_chat_template(ours, add_generation_prompt=True, tokenize=False, **kw)
    if not in_template:  # DeepSeek-R1's template renders earlier calls but cannot describe tools: generic format
        assert name == "deepseek_r1" and '{"tool_call": {"name": "get_weather"' in got
        return
    want = tok.apply_chat_template(documented(convo, key), add_generation_prompt=True, tokenize=False, **kw)
    assert got == want
    assert "get_weather" in got and "sunny, 24 C" in got
    if key and turns == 4:  # the turn in progress keeps its reasoning, where the template has a place for it
        assert "I should look it up." in got

def test_a_template_that_raises_is_a_400_naming_its_message(tmp_path_factory):
    """gpt-oss's template refuses an assistant turn with both content and thinking next to tool calls: the 400
    carries the template's own words; the server keeps serving."""
    from live_app import paced_app, serve

    tok = tokenizer_for(tmp_path_factory, "gpt_oss")
    bad = copy.deepcopy(CLIENT[:4])
    bad[2]["content"] = "Let me check."
    with paced_app(tok, tok.name_or_path, max_model_len=4096, tool_call_parser="openai",
                   reasoning_parser="gpt_oss") as (app, state), serve(app) as url:
        body = {"model": "fake", "messages": bad, "tools": [WEATHER], "max_tokens": 2}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and "Cannot pass both content and thinking" in err["message"]
        ok = httpx.post(url + "/v1/chat/completions", timeout=60,
                        json={**body, "messages": CLIENT[:4], "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_reasoning_effort_reaches_a_template_that_reads_it_and_is_refused_elsewhere(tmp_path_factory):
    from live_app import paced_app, serve

    oss = tokenizer_for(tmp_path_factory, "gpt_oss")
    with paced_app(oss, oss.name_or_path, max_model_len=4096, reasoning_parser="gpt_oss") as (app, _), \
            serve(app) as url:
        counts = {}
        for effort in ("low", "high"):
            r = httpx.post(url + "/tokenize", timeout=60, json={"model": "fake", "messages": CLIENT[:2]})
            assert r.status_code == 200
            c = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": "fake", "messages": CLIENT[:2], "max_tokens": 1, "reasoning_effort": effort})
            assert c.status_code == 200, c.text
            counts[effort] = c.json()["usage"]["prompt_tokens"]
        low = oss.apply_chat_template(CLIENT[:2], add_generation_prompt=True, tokenize=False, reasoning_effort="low")
        assert "Reasoning: low" in low and counts["low"] == len(oss(low, add_special_tokens=False)["input_ids"])
        bad = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "fake", "messages": CLIENT[:2], "reasoning_effort": "extreme"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
    qwen = tokenizer_for(tmp_path_factory, "qwen3")
    with paced_app(qwen, qwen.name_or_path, max_model_len=4096) as (app, _), serve(app) as url:
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "fake", "messages": CLIENT[:2], "reasoning_effort": "low"})
        assert r.status_code == 400 and "no reasoning effort" in r.json()["error"]["message"]
