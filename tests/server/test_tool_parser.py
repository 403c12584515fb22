"""The Hermes and generic tool-call parsers, the <think> reasoning parser, the tool-call grammars and the grammar's
reasoning gate, in pure Python (the server tests cover them end to end; each other family's parser has its own file)."""

import json
import random

import pytest

from server.api.parsers.base import OutputParser, ReasoningParser
from server.api.parsers.generic import GenericToolParser
from server.api.parsers.hermes import HermesParser
from server.api.parsers.think import Qwen3ReasoningParser
from server.api.protocol import ChatMessage, Tool
from server.api.tool_calls import generic_constraint, render_messages, tools_constraint


def parse_tool_calls(text: str, cls=HermesParser, cut: bool = False) -> tuple[str | None, list[dict]]:
    out = OutputParser(None, cls()).parse(text, cut)
    return (out.content if out.content or not out.calls else None), out.calls

CALL_F = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
CALL_G = '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'


def streamed(text: str, seed: int, cls=HermesParser) -> tuple[str, list[dict]]:
    rng, parser, content, calls, i = random.Random(seed), cls(), "", [], 0
    while i < len(text):
        j = i + rng.randint(1, 9)
        c, k = parser.feed(text[i:j])
        content, calls, i = content + c, calls + k, j
    c, k = parser.finish()
    return content + c, calls + k


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
    one = tools_constraint(tools, "g", False, HermesParser, json.dumps)
    assert '"const": "g"' in one.spec and '"const": "f"' not in one.spec and ")*" not in one.spec
    both = tools_constraint(tools, None, True, HermesParser, json.dumps)
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
    plain = render_messages(msgs, False)  # the generic format: the call as the answer that made it
    assert "tool_calls" not in plain[1]
    assert parse_tool_calls(plain[1]["content"], GenericToolParser)[1][0]["function"]["arguments"] == '{"a": 1}'
    assert plain[2] == {"role": "user", "content": '{"tool_response": {"name": "f", "content": "42"}}'}


GENERIC = [
    ('{"response": "It is \\"sunny\\" \\u00e9\\ud83d\\ude00 in Paris.\\n"}', 'It is "sunny" \u00e9\U0001f600 in Paris.\n', []),
    ('{"tool_call": {"name": "f", "arguments": {"a": 1}}}', None, ["f"]),
    ('{"tool_calls": [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": [1]}}]}', None, ["f", "g"]),
    ("plain words", "plain words", []),
]


@pytest.mark.parametrize("text,content,names", GENERIC)
def test_generic_format_whole_and_at_every_split(text, content, names):
    got, calls = parse_tool_calls(text, GenericToolParser)
    assert got == content and [c["function"]["name"] for c in calls] == names
    for i in range(len(text) + 1):  # every split point: the response text streams as it is decoded
        parser = GenericToolParser()
        a, k1 = parser.feed(text[:i])
        b, k2 = parser.feed(text[i:])
        c, k3 = parser.finish()
        assert (a + b + c, [x["function"] for x in k1 + k2 + k3]) == (content or "", [x["function"] for x in calls])
    parser = GenericToolParser()  # one character at a time
    pieces = [parser.feed(ch)[0] for ch in text]
    assert "".join(pieces) + parser.finish()[0] == (content or "")


def test_generic_cut_call_and_grammar():
    content, calls = parse_tool_calls('{"tool_call": {"name": "f", "arguments": {"a": 1', GenericToolParser, cut=True)
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1'}
    content, calls = parse_tool_calls('{"tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "argu',
                                      GenericToolParser, cut=True)  # each whole call, then the cut one
    assert [c["function"] for c in calls] == [{"name": "f", "arguments": '{"a": 1}'}, {"name": "g", "arguments": ""}]
    tools = [Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}})]
    auto = json.loads(generic_constraint(tools, None, False, False).spec.split("%json ", 1)[1])
    assert {"response", "tool_call"} == {next(iter(alt["properties"])) for alt in auto["anyOf"]}
    forced = json.loads(generic_constraint(tools, "f", True, True).spec.split("%json ", 1)[1])
    assert [alt["required"] for alt in forced["anyOf"]] == [["tool_call"], ["tool_calls"]]
    assert forced["anyOf"][1]["properties"]["tool_calls"]["minItems"] == 1
    single = json.loads(generic_constraint(tools, "f", False, True).spec.split("%json ", 1)[1])
    assert single["required"] == ["tool_call"]


THINK = "<think>\nThe user asks.\nCheck weather.\n</think>\n\nSure." + "\n" + CALL_F


@pytest.mark.parametrize("state,text,expect", [
    ("maybe", THINK, ("The user asks.\nCheck weather.", "Sure.", ["f"])),
    ("maybe", "No thinking.", ("", "No thinking.", [])),
    ("reasoning", "Thinking only, cut", ("Thinking only, cut", "", [])),
    ("reasoning", "R1 style\n</think>\n\nAnswer", ("R1 style", "Answer", [])),
    ("content", "<think> is text here", ("", "<think> is text here", [])),
])
def test_think_reasoning_with_hermes_at_every_split(state, text, expect):
    def run(pieces):
        parser = OutputParser(Qwen3ReasoningParser(state), HermesParser())
        out = parser.feed("")
        for piece in pieces:
            out.add(parser.feed(piece))
        out.add(parser.finish())
        return out.reasoning, out.content, [c["function"]["name"] for c in out.calls]

    assert run([text]) == expect
    for i in range(len(text) + 1):
        assert run([text[:i], text[i:]]) == expect, i
    assert run(list(text)) == expect


def test_the_start_state_follows_the_rendered_prompt():
    assert ReasoningParser.start_state("<|im_start|>assistant\n") == "maybe"
    assert ReasoningParser.start_state("<|im_start|>assistant\n<think>\n") == "reasoning"
    assert ReasoningParser.start_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "content"


def test_the_grammar_gate_waits_for_the_end_of_the_reasoning():
    from server.engine.structured.grammar import Gate, GrammarState

    class Matcher:
        def __init__(self):
            self.got = []

        def consume_token(self, t):
            self.got.append(t)
            return True

        def is_stopped(self):
            return False

    m = Matcher()
    st = GrammarState(m, Gate((7, 8), "maybe", 5))
    assert st.active  # "maybe": the first token may open the reasoning or be the grammar's
    assert st.accept(5) and not st.active and m.got == []  # opened: free text until 7 8
    for t in (1, 7, 2, 7, 8):
        assert st.accept(t)
    assert st.active and st.gate is None and m.got == []
    assert st.accept(3) and m.got == [3]
    st = GrammarState(m := Matcher(), Gate((7,), "maybe", 5))
    assert st.accept(4) and st.gate is None and m.got == [4]  # no reasoning: the grammar held from the first token


def test_the_cli_names_every_parser_and_each_loads():
    from server.api.parsers import REASONING_PARSERS, TOOL_PARSERS, reasoning_parser_class, tool_parser_class
    from server.defaults import REASONING_PARSER_NAMES, TOOL_PARSER_NAMES

    assert set(TOOL_PARSERS) == set(TOOL_PARSER_NAMES) and set(REASONING_PARSERS) == set(REASONING_PARSER_NAMES)
    for name in TOOL_PARSERS:
        assert tool_parser_class(name).name == name or name == "openai"
    for name in REASONING_PARSERS:
        assert reasoning_parser_class(name).name == name or name == "gpt_oss"
