"""The Hermes tool-call parser and the tool-call grammar, in pure Python (the server tests cover them end to end)."""

import json
import random

import pytest

from server.api.protocol import ChatMessage, Tool
from server.api.tool_calls import ToolCallParser, parse_tool_calls, render_messages, tools_constraint

CALL_F = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
CALL_G = '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'


def streamed(text: str, seed: int) -> tuple[str, list[dict]]:
    rng, parser, content, calls, i = random.Random(seed), ToolCallParser(), "", [], 0
    while i < len(text):
        j = i + rng.randint(1, 9)
        c, k = parser.feed(text[i:j])
        content, calls, i = content + c, calls + k, j
    return content + parser.finish(), calls


@pytest.mark.parametrize("text,content,names", [
    ("Let me check.\n" + CALL_F + "\n" + CALL_G, "Let me check.", ["f", "g"]),
    (CALL_F, None, ["f"]),
    ("No tools needed.\n", "No tools needed.\n", []),
    ("a <tool_call> not json </tool_call> b", "a <tool_call> not json </tool_call> b", []),
    ('<tool_call>\n{"name": "f", "arguments": {"a"', '<tool_call>\n{"name": "f", "arguments": {"a"', []),  # cut
    ("x < y and <tool_", "x < y and <tool_", []),
    ('<tool_call>{"name": "f", "parameters": "{\\"a\\": 2}"}</tool_call>', None, ["f"]),
])
def test_whole_and_streamed_agree(text, content, names):
    got_content, calls = parse_tool_calls(text)
    assert got_content == content
    assert [c["function"]["name"] for c in calls] == names
    for c in calls:
        assert c["id"].startswith("call_") and c["type"] == "function"
        assert isinstance(json.loads(c["function"]["arguments"]), dict)
    for seed in range(30):  # any split of the text into stream chunks gives the same content and calls
        s_content, s_calls = streamed(text, seed)
        assert s_content == (content or "")
        assert [c["function"] for c in s_calls] == [c["function"] for c in calls]


def test_tool_grammar_names_functions_and_their_schemas():
    tools = [Tool.model_validate({"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}) for n in ("f", "g")]
    one = tools_constraint(tools, "g", parallel=False)
    assert '"const": "g"' in one.spec and '"const": "f"' not in one.spec and ")*" not in one.spec
    both = tools_constraint(tools, None, parallel=True)
    assert '"const": "f"' in both.spec and '"const": "g"' in both.spec and ")*" in both.spec


def test_history_renders_calls_for_templates_with_and_without_tools():
    msgs = [ChatMessage.model_validate(m) for m in (
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"})]
    with_tools = render_messages(msgs, True)
    assert with_tools[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}  # an object, for the template
    assert with_tools[2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    plain = render_messages(msgs, False)
    assert "tool_calls" not in plain[1]
    assert parse_tool_calls(plain[1]["content"])[1][0]["function"]["arguments"] == '{"a": 1}'
