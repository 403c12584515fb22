"""The qwen3_coder, deepseek_v3 and harmony (openai / gpt_oss) output parsers, on answers recorded by rendering
assistant turns through the real chat templates (llama.cpp's models/templates, tests/helpers/templates.py): the
template with the turn, less the template without it (the generation prompt), less the end-of-turn token the engine
strips. Every answer is also read split at every character and one character at a time: a streamed answer and a
gathered one must be the same. The forced-call grammars compile with llguidance and accept the recorded calls."""

from __future__ import annotations

import json
import re
from functools import cache

import pytest
from helpers.templates import template

from server.api.parsers import ParserConfig, auto_tool_parser, reasoning_parser_class, tool_parser_class
from server.api.parsers.base import OutputParser, Parsed
from server.api.parsers.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP, DeepSeekV3Parser
from server.api.parsers.harmony import MAX_HEADER, HarmonyParser
from server.api.parsers.qwen3_coder import Qwen3CoderParser, schema_types, typed_value
from server.api.parsers.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city.", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
            "opts": {"type": "object"}, "zip": {"type": "string"}, "ratio": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}}, "note": {"type": ["string", "null"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "run_code", "description": "Runs Python.", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}},
]
WEATHER = {"city": "Paris", "days": 3, "metric": True, "opts": {"a": [1, 2]}, "zip": "75001", "ratio": 0.5,
           "tags": ["x", "y"], "note": None}
CODE = {"code": "def f():\n    return 1  # <b>\n"}
CALLS = [("get_weather", WEATHER), ("run_code", CODE)]


def tool_calls(calls, as_text: bool = False) -> list[dict]:
    return [{"id": f"c{i}", "type": "function",
             "function": {"name": n, "arguments": json.dumps(a) if as_text else a}} for i, (n, a) in enumerate(calls)]


def render(name: str, messages: list[dict], generation_prompt: bool) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], tools=TOOLS, chat_template=template(name),
                                        add_generation_prompt=generation_prompt)
    return rendered[0]


USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@cache
def recorded(name: str, turn_json: str, after: str | None = None, end: str = "") -> str:
    """The answer that is `turn` in template `name`: the rendering with it less the one without it (or, for templates
    whose history differs from their generation prompt, what follows the last `after`), less `end`."""
    turn = json.loads(turn_json)
    full = render(name, USER + [turn], False)
    prompt = render(name, USER, True)
    if after is None:
        assert full.startswith(prompt), (prompt[-80:], full[len(prompt) - 80 :])
        text = full[len(prompt) :]
    else:
        text = full[full.rindex(after) + len(after) :]
    assert text.endswith(end), text[-40:]
    return text[: len(text) - len(end)]


def turn(content=None, calls=(), as_text=False, **extra) -> str:
    message = {"role": "assistant", "content": content, **extra}
    if calls:
        message["tool_calls"] = tool_calls(calls, as_text)
    return json.dumps(message)


# ---- running a parser -----------------------------------------------------------------------------------------

def summary(parsed: Parsed) -> tuple[str, str, list[tuple[str, object]]]:
    for call in parsed.calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
    return (parsed.reasoning, parsed.content,
            [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.calls])


def streamed(make, pieces, cut=False) -> Parsed:
    parser, out = make(), Parsed()
    for piece in pieces:
        out.add(parser.feed(piece))
    out.add(parser.finish(cut))
    assert parser.calls == out.calls
    return out


def whole(make, text, cut=False):
    return summary(streamed(make, [text], cut))


def check_splits(make, text, cut=False, every: int = 1):
    """The whole answer, and the same split at every character, one character at a time, and in 3s."""
    expected = whole(make, text, cut)
    for i in range(0, len(text) + 1, every):
        assert summary(streamed(make, [text[:i], text[i:]], cut)) == expected, i
    assert summary(streamed(make, list(text), cut)) == expected
    assert summary(streamed(make, [text[i : i + 3] for i in range(0, len(text), 3)], cut)) == expected
    return expected


def args_of(result):
    return [(n, json.loads(a)) for n, a in result[2]]


def qwen(tools=TOOLS, reasoning=None):
    return lambda: OutputParser(reasoning() if reasoning else None, Qwen3CoderParser(tools))


def deepseek(reasoning=None):
    return lambda: OutputParser(reasoning() if reasoning else None, DeepSeekV3Parser())


def harmony(parse_tools=True):
    return lambda: HarmonyParser(parse_tools=parse_tools)


# ---- qwen3_coder ------------------------------------------------------------------------------------------------

QWEN_TURN = turn("Let me check.", CALLS)


def test_qwen3_coder_recorded_turn_is_typed_by_the_schema():
    text = recorded("Qwen3-Coder", QWEN_TURN, end="<|im_end|>\n")
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in text and "True" in text
    result = check_splits(qwen(), text)
    assert result[:2] == ("", "Let me check.")
    assert args_of(result) == CALLS  # 3 an int, True a bool, "75001" still a string, None null
    assert not re.search(r"\s$", result[1])


@pytest.mark.parametrize("name,after", [("Qwen3.5-4B", None), ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
                                                                  "<|im_start|>assistant\n<think></think>")])
def test_qwen3_coder_other_families_templates(name, after):
    text = recorded(name, QWEN_TURN, after, end="<|im_end|>\n")
    if after is None:  # the prompt opened the reasoning: the answer closes it
        assert text.startswith("\n</think>")
        make = qwen(reasoning=lambda: Qwen3ReasoningParser(Qwen3ReasoningParser.REASONING))
    else:
        make = qwen()
    result = check_splits(make, text)
    assert result[:2] == ("", "Let me check.") and args_of(result) == CALLS


def test_qwen3_coder_with_reasoning():
    text = recorded("Qwen3.5-4B", turn("Let me check.", CALLS[:1], reasoning_content="The user wants weather."),
                    end="<|im_end|>\n")
    result = check_splits(qwen(reasoning=lambda: Qwen3ReasoningParser(Qwen3ReasoningParser.REASONING)), text)
    assert result[:2] == ("The user wants weather.", "Let me check.") and args_of(result) == CALLS[:1]


def test_qwen3_coder_without_calls_is_content():
    text = recorded("Qwen3-Coder", turn("Plain answer, a < b and <tool> tags."), end="<|im_end|>\n")
    assert check_splits(qwen(), text) == ("", "Plain answer, a < b and <tool> tags.", [])


@pytest.mark.parametrize("value,types,expected", [
    ("Paris", {"string"}, "Paris"), ("75001", {"string"}, "75001"), ("true", {"string"}, "true"),
    ("3", {"integer"}, 3), ("3", {"number"}, 3), ("2.5", {"number"}, 2.5), ("three", {"integer"}, "three"),
    ("True", {"boolean"}, True), ("false", {"boolean"}, False), ("yes", {"boolean"}, "yes"),
    ('{"a": 1}', {"object"}, {"a": 1}), ("[1, 2]", {"array"}, [1, 2]), ("{'a': 1}", {"object"}, "{'a': 1}"),
    ("None", {"null"}, None), ("null", {"string", "null"}, None), ("Paris", {"string", "null"}, "Paris"),
    ("7", {"string", "integer"}, 7), ('"q"', {"string", "integer"}, '"q"'), ("7", {"string", "boolean"}, "7"),
    ("NaN", {"number"}, "NaN"), ("42", None, 42), ("hello", None, "hello"), ("True", None, "True"),
    ('{"x": [1]}', None, {"x": [1]}),
])
def test_qwen3_coder_typed_values(value, types, expected):
    got = typed_value(value, types)
    assert got == expected and type(got) is type(expected)


def test_qwen3_coder_schema_types():
    assert schema_types({"type": "string"}) == {"string"}
    assert schema_types({"type": ["integer", "null"]}) == {"integer", "null"}
    assert schema_types({"enum": ["a", "b"]}) == {"string"}
    assert schema_types({"anyOf": [{"type": "integer"}, {"type": "null"}]}) == {"integer", "null"}
    assert schema_types({"anyOf": [{"type": "integer"}, {}]}) is None
    assert schema_types({"description": "anything"}) is None


def test_qwen3_coder_unknown_tool_and_parameter():
    text = ("<tool_call>\n<function=other>\n<parameter=n>\n42\n</parameter>\n<parameter=s>\nhi there\n</parameter>\n"
            "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=extra>\n[1]\n</parameter>\n"
            "<parameter=days>\n4\n</parameter>\n</function>\n</tool_call>")
    result = check_splits(qwen(), text)
    assert args_of(result) == [("other", {"n": 42, "s": "hi there"}), ("get_weather", {"extra": [1], "days": 4})]
    assert args_of(whole(qwen(tools=None), text))[1] == ("get_weather", {"extra": [1], "days": 4})


def test_qwen3_coder_lenient_where_models_slip():
    # no </parameter> before the next parameter nor before </function>; no </function>; values on the tag's line
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</function>\n"
            "</tool_call>\n<tool_call><function=run_code><parameter=code>x = 1</parameter></tool_call>")
    assert args_of(check_splits(qwen(), text)) == [("get_weather", {"city": "Paris", "days": 2}),
                                                   ("run_code", {"code": "x = 1"})]


def test_qwen3_coder_reads_a_hermes_call_too():
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    assert args_of(check_splits(qwen(), text)) == [("get_weather", {"city": "Paris", "days": 2})]


def test_qwen3_coder_two_functions_in_one_block():
    text = ("<tool_call>\n<function=run_code>\n<parameter=code>\na\n</parameter>\n</function>\n"
            "<function=run_code>\n<parameter=code>\nb\n</parameter>\n</function>\n</tool_call>")
    assert args_of(check_splits(qwen(), text)) == [("run_code", {"code": "a"}), ("run_code", {"code": "b"})]


@pytest.mark.parametrize("text", [
    "See <tool_call>not a function</tool_call> here.",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\njunk\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n</function>\ntrailing words\n</tool_call>",
    "<tool_call>\n<function=>\n</function>\n</tool_call>",
    "<tool_call>\n<function=a b\nc>\n</function>\n</tool_call>",
    "Before.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",  # unclosed, not cut
])
def test_qwen3_coder_malformed_is_content(text):
    assert check_splits(qwen(), text) == ("", text, [])


def test_qwen3_coder_cut():
    text = recorded("Qwen3-Coder", QWEN_TURN, end="<|im_end|>\n")
    at = text.index("<parameter=opts>") + len("<parameter=opts>\n{\"a\": [1")
    result = check_splits(qwen(), text[:at], cut=True)
    assert result[1] == "Let me check."
    assert args_of(result) == [("get_weather", {"city": "Paris", "days": 3, "metric": True, "opts": '{"a": [1'})]
    # cut inside the closing tag: the value is whole
    at = text.index("</parameter>") + 4
    assert args_of(whole(qwen(), text[:at], cut=True)) == [("get_weather", {"city": "Paris"})]
    # cut in the second block: the first went out whole, the second as far as it came
    at = text.index("<parameter=code>") + len("<parameter=code>\ndef f")
    assert args_of(check_splits(qwen(), text[:at], cut=True, every=5)) == [CALLS[0], ("run_code", {"code": "def f"})]
    # a name not yet whole: content, as without cut
    at = text.index("<function=get_weather>") + 8
    assert whole(qwen(), text[:at], cut=True) == ("", text[:at], [])


def test_qwen3_coder_every_prefix_streams_as_it_gathers():
    text = recorded("Qwen3-Coder", QWEN_TURN, end="<|im_end|>\n")
    for i in range(len(text) + 1):
        for cut in (False, True):
            expected = whole(qwen(), text[:i], cut)
            assert summary(streamed(qwen(), [text[: i // 2], text[i // 2 : i]], cut)) == expected, (i, cut)
            assert {n for n, _ in expected[2]} <= {"get_weather", "run_code"}


# ---- deepseek_v3 --------------------------------------------------------------------------------------------------

# (llama-cpp-deepseek-r1 renders the same calls, but its `tools | map(...) | tojson` does not run in transformers)
R1_TEMPLATES = ["deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B"]
V3_CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "New York"})]


@pytest.mark.parametrize("name,as_text", [(R1_TEMPLATES[0], True), (R1_TEMPLATES[0], False),
                                          (R1_TEMPLATES[1], True)])  # (the Llama one takes arguments as text only)
def test_deepseek_r1_recorded(name, as_text):
    text = recorded(name, turn(None, V3_CALLS, as_text=as_text), after="<｜Assistant｜>", end="<｜end▁of▁sentence｜>")
    assert text.startswith(CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "get_weather\n```json\n")
    result = check_splits(deepseek(), text)
    assert result[:2] == ("", "") and args_of(result) == V3_CALLS


def test_deepseek_v31_recorded():
    text = recorded("deepseek-ai-DeepSeek-V3.1", turn("Let me check.", V3_CALLS), end="<｜end▁of▁sentence｜>")
    assert text.startswith("Let me check." + CALLS_BEGIN + CALL_BEGIN + "get_weather" + SEP + "{")
    result = check_splits(deepseek(), text)
    assert result[:2] == ("", "Let me check.") and args_of(result) == V3_CALLS


def test_deepseek_r1_answer_with_reasoning():
    """An R1 answer: the prompt opened <think>; reasoning, then content, then the calls."""
    calls = recorded(R1_TEMPLATES[0], turn(None, V3_CALLS[:1]), after="<｜Assistant｜>", end="<｜end▁of▁sentence｜>")
    text = "The user wants the weather.\n</think>\n\nI'll look it up.\n\n" + calls
    make = deepseek(reasoning=lambda: DeepSeekR1ReasoningParser(DeepSeekR1ReasoningParser.REASONING))
    result = check_splits(make, text)
    assert result[:2] == ("The user wants the weather.", "I'll look it up.") and args_of(result) == V3_CALLS[:1]


def test_deepseek_mixed_forms_and_no_calls():
    text = (CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "a\n```\n{}\n```" + CALL_END + "\n"
            + CALL_BEGIN + "function" + SEP + '{"x": 1}' + CALL_END + CALLS_END + "\n")  # V3.1: a tool "function"
    assert args_of(check_splits(deepseek(), text)) == [("a", {}), ("function", {"x": 1})]
    assert check_splits(deepseek(), "No calls: <｜tool▁ here.") == ("", "No calls: <｜tool▁ here.", [])


@pytest.mark.parametrize("text", [
    "x " + CALLS_BEGIN + CALL_BEGIN + "get_weather" + SEP + '{"city": Paris}' + CALL_END + CALLS_END,
    CALLS_BEGIN + CALL_BEGIN + "get_weather" + SEP + '["Paris"]' + CALL_END + CALLS_END,
    CALLS_BEGIN + CALL_BEGIN + "get_weather" + CALL_END + CALLS_END,
    CALLS_BEGIN + "junk" + CALL_BEGIN + "get_weather" + SEP + "{}" + CALL_END + CALLS_END,
    CALLS_BEGIN + CALL_BEGIN + "function" + SEP + 'get_weather\n```json\n{"city": "Paris"}' + CALL_END + CALLS_END,
    CALLS_BEGIN + CALL_BEGIN + "get_weather" + SEP + '{"city": "Paris"}' + CALL_END,  # unclosed, not cut
])
def test_deepseek_malformed_is_content(text):
    assert check_splits(deepseek(), text) == ("", text, [])


def test_deepseek_cut():
    r1 = recorded(R1_TEMPLATES[0], turn(None, V3_CALLS), after="<｜Assistant｜>", end="<｜end▁of▁sentence｜>")
    second = r1.rindex(CALL_BEGIN)
    at = r1.index('"New', second) + 4
    result = check_splits(deepseek(), r1[:at], cut=True)
    assert result[2] == [("get_weather", json.dumps(V3_CALLS[0][1])), ("get_weather", '{"city": "New')]
    at = r1.index("```json", second) + 4  # inside the fence's opening
    assert whole(deepseek(), r1[:at], cut=True)[2][1] == ("get_weather", "")
    at = r1.index("get_weather", second) + 3  # the name not yet whole: the first call only
    assert whole(deepseek(), r1[:at], cut=True)[2] == [("get_weather", json.dumps(V3_CALLS[0][1]))]
    assert whole(deepseek(), r1[:at], cut=False) == ("", r1[:at], [])
    v31 = recorded("deepseek-ai-DeepSeek-V3.1", turn(None, V3_CALLS), end="<｜end▁of▁sentence｜>")
    at = v31.index('"Paris"') + 3
    assert whole(deepseek(), v31[:at], cut=True)[2] == [("get_weather", '{"city": "Pa')]
    at = v31.index(SEP)  # no separator yet
    assert whole(deepseek(), v31[:at], cut=True) == ("", v31[:at], [])


def test_deepseek_every_prefix_streams_as_it_gathers():
    text = recorded(R1_TEMPLATES[0], turn(None, V3_CALLS), after="<｜Assistant｜>", end="<｜end▁of▁sentence｜>")
    text = "Checking.\n\n" + text
    for i in range(len(text) + 1):
        for cut in (False, True):
            expected = whole(deepseek(), text[:i], cut)
            assert summary(streamed(deepseek(), [text[: i // 2], text[i // 2 : i]], cut)) == expected, (i, cut)


# ---- harmony ------------------------------------------------------------------------------------------------------

def harmony_recorded(message: dict, end: str) -> str:
    return recorded("openai-gpt-oss-120b", json.dumps(message), end=end)


def test_harmony_recorded_call_with_reasoning():
    text = harmony_recorded({"role": "assistant", "thinking": "User wants weather.",
                             "tool_calls": tool_calls(CALLS[:1])}, end="<|call|>")
    assert "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>" in text
    result = check_splits(harmony(), text)
    assert result[:2] == ("User wants weather.", "") and args_of(result) == CALLS[:1]
    assert check_splits(harmony(), text + "<|call|>") == result  # the stop token kept
    # calls not parsed: the arguments are content
    assert check_splits(harmony(parse_tools=False), text) == ("User wants weather.", json.dumps(WEATHER), [])


def test_harmony_recorded_final_answer():
    text = harmony_recorded({"role": "assistant", "thinking": "Easy.", "content": "It is sunny."}, end="<|return|>")
    assert text == "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny."
    assert check_splits(harmony(), text) == ("Easy.", "It is sunny.", [])
    assert check_splits(harmony(), text + "<|return|>") == ("Easy.", "It is sunny.", [])


def test_harmony_model_style_call_with_preamble():
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>Checking the forecast.<|end|>"
            '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city":"Paris","days":2}<|call|>')
    result = check_splits(harmony(), text)
    assert result[:2] == ("Need the weather.", "Checking the forecast.")
    assert args_of(result) == [("get_weather", {"city": "Paris", "days": 2})]


def test_harmony_messages_of_one_kind_join_and_builtin_tools_are_reasoning():
    text = ("<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis to=python code"
            "<|message|>print(1)<|call|><|start|>assistant<|channel|>analysis<|message|>Then.<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>Pre.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Done <b>.<|return|>")
    assert check_splits(harmony(), text) == ("First.\nprint(1)\nThen.", "Pre.\nDone <b>.", [])


@pytest.mark.parametrize("text,expected", [
    ("Just text, no harmony at all.", ("", "Just text, no harmony at all.", [])),
    ("<|channel|>final<|message|>" + "x" * 20, ("", "x" * 20, [])),
    ("<|message|>no channel", ("", "no channel", [])),
    ("x" * (MAX_HEADER + 40) + "<|message|>y", ("", "x" * (MAX_HEADER + 40) + "<|message|>y", [])),
    ("<|channel|>" + "z" * (MAX_HEADER + 5) + "<|end|><|start|>assistant<|channel|>final<|message|>ok",
     ("", "<|channel|>" + "z" * (MAX_HEADER + 5) + "\nok", [])),
    ("<|channel|>analysis<|message|>thinking, cut", ("thinking, cut", "", [])),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>fin", ("a", "", [])),
    # arguments that are not a JSON object: content
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{bad<|call|>", ("", "{bad", [])),
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>[1]", ("", "[1]", [])),
    # the channel left out between two messages
    ("<|channel|>analysis<|message|>a<|channel|>final<|message|>b", ("a", "b", [])),
])
def test_harmony_odd_answers(text, expected):
    assert check_splits(harmony(), text) == expected


def test_harmony_cut():
    text = ('<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Par')
    assert check_splits(harmony(), text, cut=True) == ("Hm.", "", [("get_weather", '{"city": "Par')])
    assert check_splits(harmony(), text, cut=False) == ("Hm.", '{"city": "Par', [])
    head = text[: text.index("<|message|>", text.index("commentary"))]
    assert whole(harmony(), head, cut=True) == ("Hm.", "", [("get_weather", "")])
    name_cut = text[: text.index("get_weather") + 3]
    assert whole(harmony(), name_cut, cut=True) == ("Hm.", "", [])
    whole_args = text + 'is"}'
    assert whole(harmony(), whole_args, cut=True)[2] == [("get_weather", '{"city": "Paris"}')]


def test_harmony_every_prefix_streams_as_it_gathers():
    text = ("<|channel|>analysis<|message|>Need <it>.<|end|><|start|>assistant<|channel|>commentary<|message|>"
            "Pre.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            '{"city": "Paris"}<|call|>')
    for i in range(len(text) + 1):
        for cut in (False, True):
            expected = whole(harmony(), text[:i], cut)
            assert summary(streamed(harmony(), [text[: i // 2], text[i // 2 : i]], cut)) == expected, (i, cut)


def test_harmony_interface_and_registry():
    config = ParserConfig("gpt_oss", "openai")
    assert config.harmony and config.needs_special_tokens
    assert reasoning_parser_class("gpt_oss") is HarmonyParser is tool_parser_class("openai")
    parser = HarmonyParser(parse_tools=True, tools=TOOLS)
    out = parser.parse('<|channel|>analysis<|message|>r<|end|><|start|>assistant<|channel|>commentary '
                       'to=functions.f <|constrain|>json<|message|>{}')
    assert parser.calls == out.calls and len(out.calls) == 1 and parser.reasoning_text == "r"
    assert not HarmonyParser(parse_tools=False).parse_tools
    assert HarmonyParser.start_state("anything") is None and HarmonyParser.name == "openai"


# ---- the registry, template markers -----------------------------------------------------------------------------

class _Tok:
    def __init__(self, name):
        self.chat_template = template(name)


@pytest.mark.parametrize("name,parser", [
    ("openai-gpt-oss-120b", "openai"), ("Qwen3-Coder", "qwen3_coder"), ("Qwen3.5-4B", "qwen3_coder"),
    ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "qwen3_coder"), ("deepseek-ai-DeepSeek-V3.1", "deepseek_v3"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek_v3"), ("llama-cpp-deepseek-r1", "deepseek_v3"),
])
def test_auto_picks_the_family(name, parser):
    text = template(name)
    assert all(m in text for m in tool_parser_class(parser).template_markers)
    if "tools" in text:  # (DeepSeek's own templates render past calls but never the tools: auto finds no format)
        assert auto_tool_parser(_Tok(name)) == parser


@pytest.mark.parametrize("name", ["Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "deepseek-ai-DeepSeek-V3.2",
                                  "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "meta-llama-Llama-3.1-8B-Instruct"])
def test_markers_are_not_in_other_families_templates(name):
    text = template(name)
    for cls in (HarmonyParser, Qwen3CoderParser, DeepSeekV3Parser):
        assert not all(m in text for m in cls.template_markers), cls.name


def test_registry_classes():
    assert tool_parser_class("qwen3_coder") is Qwen3CoderParser and not Qwen3CoderParser.forced_format
    assert tool_parser_class("deepseek_v3") is DeepSeekV3Parser and DeepSeekV3Parser.needs_special_tokens
    assert tool_parser_class("openai") is HarmonyParser and HarmonyParser.forced_format


# ---- forced calls: the grammars compile and accept the recorded calls ----------------------------------------------

SPECIALS = ["<|channel|>", "<|message|>", "<|constrain|>", "<|start|>", "<|end|>", "<|call|>", "<|return|>",
            CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP]


class ByteTokenizer:
    """Bytes as tokens, and (when `specials`) the markers as special tokens, for llguidance."""

    eos_token_id, bos_token_id = 256, None

    def __init__(self, specials: bool) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"] + [b"\xff" + s.encode() for s in SPECIALS]
        self.special_token_ids = list(range(256, 257 + len(SPECIALS)))
        self.split = re.compile("(" + "|".join(map(re.escape, SPECIALS)) + ")") if specials else None

    def __call__(self, data) -> list[int]:
        text = data.decode() if isinstance(data, bytes) else data
        if self.split is None:
            return list(text.encode())
        ids: list[int] = []
        for part in self.split.split(text):
            ids += [257 + SPECIALS.index(part)] if part in SPECIALS else list(part.encode())
        return ids

    @staticmethod
    def atom(marker: str) -> str:
        return f"<[{257 + SPECIALS.index(marker)}]>"


def forced_schemas(names=("get_weather", "run_code")) -> list[tuple[str, str]]:
    """As the server gives them: {"name": <const>, "arguments": <parameters>} objects, as JSON text."""
    out = []
    for tool in TOOLS:
        fn = tool["function"]
        if fn["name"] in names:
            out.append((fn["name"], json.dumps({
                "type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False,
                "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}})))
    return out


def accepts(lark: str, text: str, specials: bool) -> bool:
    import llguidance

    tok = ByteTokenizer(specials)
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer(llguidance.TokenizerWrapper(tok)),
                                   llguidance.grammar_from("lark", lark), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tok(text)) and matcher.is_accepting()


DS_WEATHER = {"city": "Paris", "days": 3}


@pytest.mark.parametrize("specials", [True, False])
def test_deepseek_forced_grammar(specials):
    atom = ByteTokenizer.atom if specials else json.dumps
    parallel = DeepSeekV3Parser.forced_lark(forced_schemas(), True, atom)
    single = DeepSeekV3Parser.forced_lark(forced_schemas(["get_weather"]), False, atom)
    r1 = recorded(R1_TEMPLATES[0], turn(None, [("get_weather", DS_WEATHER), CALLS[1]]), after="<｜Assistant｜>",
                  end="<｜end▁of▁sentence｜>")
    v31 = recorded("deepseek-ai-DeepSeek-V3.1", turn(None, [("get_weather", DS_WEATHER), CALLS[1]]),
                   end="<｜end▁of▁sentence｜>")
    for text in (r1, v31):
        assert accepts(parallel, text, specials)
        assert args_of(whole(deepseek(), text)) == [("get_weather", DS_WEATHER), CALLS[1]]
    first_only = r1[: r1.index(CALL_END) + len(CALL_END)] + CALLS_END
    assert accepts(single, first_only, specials) and not accepts(single, r1, specials)
    assert not accepts(parallel, r1.replace('"days": 3', '"days": "3"'), specials)  # the schema holds
    assert not accepts(single, first_only.replace("get_weather", "run_code"), specials)


def test_harmony_forced_grammar():
    atom = ByteTokenizer.atom
    lark = HarmonyParser.forced_lark(forced_schemas(), True, atom)
    call = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city":"Paris","days":3}')  # (compact, as gpt-oss writes its arguments)
    thought = "<|channel|>analysis<|message|>Weather, so <the> tool.\n<|end|><|start|>assistant"
    for text in (call, thought + call):
        assert accepts(lark, text, True)
        result = whole(harmony(), text)
        assert args_of(result) == [("get_weather", DS_WEATHER)]
    assert not accepts(lark, call.replace("get_weather", "nope"), True)
    assert not accepts(lark, call.replace('"days":3', '"days":true'), True)
    assert not accepts(lark, call.replace('"days":3', '"days": 3'), True)
    assert accepts(HarmonyParser.forced_lark(forced_schemas(), False, json.dumps), call, False)  # as text markers


# ---- long answers --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make,text", [
    (qwen(), "Some content here. " * 200 + recorded("Qwen3-Coder", QWEN_TURN, end="<|im_end|>\n")),
    (deepseek(), "Some content here. " * 200 + recorded("deepseek-ai-DeepSeek-V3.1", turn("x", V3_CALLS),
                                                          end="<｜end▁of▁sentence｜>")),
    (harmony(), "<|channel|>analysis<|message|>" + "thinking <hard> " * 200 + "<|end|><|start|>assistant"
     "<|channel|>final<|message|>" + "The answer <b>is</b> this. " * 200),
])
def test_long_answers_stream_as_they_gather(make, text):
    """Long answers fed ~a token at a time read as they do whole (their cost per token: scripts/bench_parsers.py)."""
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]  # ~ a token each
    assert summary(streamed(make, pieces)) == whole(make, text)
