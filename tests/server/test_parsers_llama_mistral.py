"""The llama3_json, mistral and pythonic tool-call parsers, on what the real chat templates (llama.cpp's
models/templates, tests/helpers/templates.py) render for an assistant turn with tool calls: the text the model was
trained to write. Each recorded output is parsed whole, split at every character, in three pieces, and one
character at a time; malformed and cut calls; the forced-call grammars compiled and run by llguidance."""

from __future__ import annotations

import json
import random
import re

import llguidance
import llguidance.hf
import pytest
from tiny import make_tokenizer
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

from server.api.parsers.hermes import HermesParser
from server.api.parsers.llama3 import Llama3JsonParser
from server.api.parsers.mistral import MistralParser
from server.api.parsers.pythonic import PythonicParser
from tests.helpers.templates import template, templates_dir

LLAMA = ("meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct", "meta-llama-Llama-3.3-70B-Instruct")
MISTRAL_V11 = ("Mistral-Small-3.2-24B-Instruct-2506", "unsloth-mistral-Devstral-Small-2507",
               "mistralai-Ministral-3-14B-Reasoning-2512")
MISTRAL_OLD = "mistralai-Mistral-Nemo-Instruct-2407"
LFM = "LFM2.5-8B-A1B"
END_OF_TURN = ("<|eot_id|>", "</s>", "<|im_end|>\n")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time.", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}, "exact": {"type": "boolean"},
                                         "hint": {"type": ["string", "null"]}}}}},
]
WEATHER = ("get_weather", {"city": "Paris", "days": 3})
WEATHER_ODD = ("get_weather", {"city": 'São "Paulo" {x} [y]; \\ ok', "days": -2})
TIME = ("get_time", {"tz": "UTC", "exact": True, "hint": None})
ANY = {"type": "object"}  # an object schema for the values above that no tool declares


def render(name: str, calls: list[tuple[str, dict]], content: str = "", ids=None) -> str:
    """The text the template puts after the generation prompt for an assistant turn making `calls` (after
    `content`), without the end-of-turn token: what the model writes."""
    user = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
    turn = {"role": "assistant", "content": content, "tool_calls": [
        {"id": (ids or [f"call{i:05d}"] * len(calls))[i], "type": "function",
         "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(calls)]}
    text = template(name)
    kw = {"chat_template": text, "tools": TOOLS, "bos_token": "<s>", "eos_token": "</s>"}
    prompt = render_jinja_template([user], add_generation_prompt=True, **kw)[0][0]
    whole = render_jinja_template([user + [turn]], **kw)[0][0]
    assert whole.startswith(prompt), name
    out = whole[len(prompt):]
    for end in END_OF_TURN:
        if out.endswith(end):
            return out[: -len(end)]
    raise AssertionError(f"{name}: no end of turn in {out!r}")


def result(content: str, calls: list[dict]) -> tuple[str, list[tuple[str, object]]]:
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def parse(cls, text: str, cut: bool = False):
    p = cls()
    content, calls = p.feed(text)
    more, last = p.finish(cut)
    assert [c["id"] for c in calls + last] == [c["id"] for c in p.calls]
    return result(content + more, calls + last)


def parse_pieces(cls, pieces, cut: bool = False):
    p, content, calls = cls(), "", []
    for piece in pieces:
        c, k = p.feed(piece)
        content, calls = content + c, calls + k
    c, k = p.finish(cut)
    return result(content + c, calls + k)


def decoded(parsed):
    content, calls = parsed
    return content, [(n, json.loads(a)) for n, a in calls]


def check_splits(cls, text: str, cut: bool = False):
    """Every way of streaming `text` gives what it gives whole; returns that."""
    whole = parse(cls, text, cut)
    for i in range(len(text) + 1):
        assert parse_pieces(cls, [text[:i], text[i:]], cut) == whole, (text[:i], text[i:])
    rng = random.Random(len(text))
    for _ in range(60):
        i, j = sorted(rng.sample(range(len(text) + 1), 2))
        assert parse_pieces(cls, [text[:i], text[i:j], text[j:]], cut) == whole, (i, j)
    assert parse_pieces(cls, list(text), cut) == whole
    return whole


# ---- recorded outputs ------------------------------------------------------------------------------------------
def llama_outputs():
    out = []
    for name in LLAMA:
        one = render(name, [WEATHER])
        assert one == '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
        out.append((name, one, [WEATHER]))
        odd, time = render(name, [WEATHER_ODD]), render(name, [TIME])
        # the templates render one call a turn; models write several separated by "; " or newlines
        out.append((name + " x2 ;", odd + "; " + time, [WEATHER_ODD, TIME]))
        out.append((name + " x3 newline", f"{one}\n{time}\n{odd}\n", [WEATHER, TIME, WEATHER_ODD]))
        out.append((name + " python_tag", "<|python_tag|>" + time, [TIME]))
        out.append((name + " leading whitespace", " \n" + odd, [WEATHER_ODD]))
    return out


def mistral_outputs():
    out = []
    old = render(MISTRAL_OLD, [WEATHER, TIME], ids=["abcDEF123", "Z9y8X7w6V"])
    assert old.startswith('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}, "id": "abc')
    out.append((MISTRAL_OLD, old, "", [WEATHER, TIME]))
    out.append((MISTRAL_OLD + " odd", render(MISTRAL_OLD, [WEATHER_ODD], ids=["abcDEF123"]), "", [WEATHER_ODD]))
    for name in MISTRAL_V11:
        ids = ["abcDEF123", "Z9y8X7w6V", "000000000"]
        text = render(name, [WEATHER, TIME, WEATHER_ODD], ids=ids)
        assert text.startswith("[TOOL_CALLS]get_weather")
        assert ("[CALL_ID]abcDEF123[ARGS]" in text) == (name == "Mistral-Small-3.2-24B-Instruct-2506")
        out.append((name, text, "", [WEATHER, TIME, WEATHER_ODD]))
        with_content = render(name, [TIME], content="Let me look that up.", ids=ids[:1])
        if with_content.startswith("Let me"):  # (Mistral Small 3.2's template drops the content of a call turn)
            out.append((name + " content", with_content, "Let me look that up.", [TIME]))
    return out


def pythonic_outputs():
    lfm = render(LFM, [WEATHER, TIME])
    assert lfm == ("<|tool_call_start|>[get_weather(city='Paris', days=3), get_time(tz='UTC', exact=True, "
                   "hint=None)]<|tool_call_end|>")
    bare = lfm.removeprefix("<|tool_call_start|>").removesuffix("<|tool_call_end|>")  # its markers are special
    return [
        (LFM, lfm, [WEATHER, TIME]),
        (LFM + " bare", bare, [WEATHER, TIME]),
        (LFM + " one", render(LFM, [("get_time", {"tz": "Europe/Paris"})]), [("get_time", {"tz": "Europe/Paris"})]),
        # Llama 4's wrapper, and what a model writes with double quotes, escapes and nesting
        ("llama4", "<|python_start|>" + bare + "<|python_end|>", [WEATHER, TIME]),
        ("quotes", ('\n[get_weather(city="S\\u00e3o \\"Paulo\\" {x} [y]; \\\\ ok", days=-2),'
                    " get_time(tz='''U'T\"C''', exact=False, hint={'a': [1, 2.5, (3, None)]})]"),
         [WEATHER_ODD, ("get_time", {"tz": "U'T\"C", "exact": False, "hint": {"a": [1, 2.5, [3, None]]}})]),
    ]


LLAMA_CASES, MISTRAL_CASES, PYTHONIC_CASES = llama_outputs(), mistral_outputs(), pythonic_outputs()


@pytest.mark.parametrize("name,text,calls", LLAMA_CASES, ids=[c[0] for c in LLAMA_CASES])
def test_llama3_recorded(name, text, calls):
    assert decoded(check_splits(Llama3JsonParser, text)) == ("", calls)


@pytest.mark.parametrize("name,text,content,calls", MISTRAL_CASES, ids=[c[0] for c in MISTRAL_CASES])
def test_mistral_recorded(name, text, content, calls):
    assert decoded(check_splits(MistralParser, text)) == (content, calls)


@pytest.mark.parametrize("name,text,calls", PYTHONIC_CASES, ids=[c[0] for c in PYTHONIC_CASES])
def test_pythonic_recorded(name, text, calls):
    assert decoded(check_splits(PythonicParser, text)) == ("", calls)


def test_calls_render_back_to_what_was_parsed():
    """The parsed calls, as a client sends them back in the history, render to the text they were read from (and
    the Mistral templates take the 9-character ids)."""
    for name, cls in [(LLAMA[0], Llama3JsonParser), (MISTRAL_OLD, MistralParser), (MISTRAL_V11[0], MistralParser),
                      (MISTRAL_V11[1], MistralParser), (LFM, PythonicParser)]:
        text = render(name, [WEATHER, TIME] if cls is not Llama3JsonParser else [WEATHER], ids=["abcDEF123"] * 2)
        p = cls()
        calls = p.feed(text)[1] + p.finish()[1]
        again = render(name, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls],
                       ids=[c["id"] for c in calls])
        assert re.sub(r"\[CALL_ID\]\w{9}|\"id\": \"\w{9}\"", "", again) == \
            re.sub(r"\[CALL_ID\]\w{9}|\"id\": \"\w{9}\"", "", text)
    ids = [MistralParser().call_id() for _ in range(20)]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids) and len(set(ids)) == 20


# ---- content, malformed and cut calls -----------------------------------------------------------------------------
@pytest.mark.parametrize("cls,text", [
    (Llama3JsonParser, "The weather in Paris is sunny."),
    (Llama3JsonParser, 'Sure: {"name": "get_weather", "parameters": {"city": "Paris"}}'),  # not at the start
    (Llama3JsonParser, '{"answer": 42, "parameters": {}}'),  # JSON, but no call
    (Llama3JsonParser, '{"name": "get_weather", "parameters": [1]}'),
    (Llama3JsonParser, '<|python_tag|>print("hi")'),
    (Llama3JsonParser, "<|python_tag"),
    (Llama3JsonParser, "  "),
    (MistralParser, "No tools needed [TOOL_CALL"),
    (MistralParser, "[TOOL_CALLS]get weather[ARGS]{}"),
    (MistralParser, '[TOOL_CALLS]get_weather[ARGS]["Paris"]'),
    (MistralParser, '[TOOL_CALLS]get_weather[ARGS]{"city": Paris}'),
    (MistralParser, '[TOOL_CALLS][{"nam": "get_weather"}, 1]'),
    (MistralParser, "[TOOL_CALLS][]"),
    (PythonicParser, "[1] Paris is the capital of France."),
    (PythonicParser, "[Paris](https://en.wikipedia.org/wiki/Paris) is nice."),
    (PythonicParser, "[It's] sunny"),
    (PythonicParser, "Calling: [get_weather(city='Paris')]"),
    (PythonicParser, "[get_weather('Paris')]"),  # positional
    (PythonicParser, "[get_weather(city=PARIS)]"),  # not a literal
    (PythonicParser, "[get_weather(city=__import__('os').system('true'))]"),
    (PythonicParser, "[get_weather(**kw)]"),
    (PythonicParser, "[get_weather(city={1, 2})]"),  # a set is no JSON value
    (PythonicParser, "[get_weather(city='Paris'), 3]"),
    (PythonicParser, "[get_weather(city='Paris']"),
    (PythonicParser, "[]"),
])
def test_not_calls_are_content(cls, text):
    assert check_splits(cls, text) == (text, [])


@pytest.mark.parametrize("cls,text,content,calls", [
    # a call, then what is no call: content from there on (the call stays)
    (Llama3JsonParser, '{"name": "get_time", "parameters": {}}\n\nDone.', "\n\nDone.", [("get_time", {})]),
    (Llama3JsonParser, '{"name": "get_time", "parameters": {}}; {"bad": 1}', '; {"bad": 1}', [("get_time", {})]),
    (Llama3JsonParser, '{"name": "get_time", "parameters": {}}}', "}", [("get_time", {})]),
    (Llama3JsonParser, '{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"} ;\n ', "",
     [("get_time", {"tz": "UTC"})]),
    (MistralParser, 'Hi [TOOL_CALLS]nope nope [TOOL_CALLS]get_time[ARGS]{}  \n', "Hi [TOOL_CALLS]nope nope",
     [("get_time", {})]),
    (MistralParser, '[TOOL_CALLS]get_time{"tz": "UTC"} and then some', " and then some", [("get_time", {"tz": "UTC"})]),
    (MistralParser, '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"nam": "x"}]', '{"nam": "x"}]',
     [("get_time", {})]),
    (MistralParser, '[TOOL_CALLS]{"name": "get_time", "arguments": {}}', "", [("get_time", {})]),
    (PythonicParser, "[get_time()]\nThat is the call.", "\nThat is the call.", [("get_time", {})]),
    (PythonicParser, "<|python_start|>[get_time()] <|python_end|> \n", "", [("get_time", {})]),
])
def test_calls_then_content(cls, text, content, calls):
    assert decoded(check_splits(cls, text)) == (content, calls)


CUT = [
    # (parser, text cut by max_tokens, calls with cut=True: (name, arguments text as far as they came), content when
    # it was not cut: the unclosed call as text, after the calls that closed)
    (Llama3JsonParser, '{"name": "get_weather", "parameters": {"city": "Par', [("get_weather", '{"city": "Par')],
     None),
    (Llama3JsonParser, '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "para',
     [("get_time", "{}"), ("get_weather", "")], '; {"name": "get_weather", "para'),
    (Llama3JsonParser, '{"name": "get_wea', [], None),
    (MistralParser, 'Hm.[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Pa',
     [("get_time", "{}"), ("get_weather", '{"city": "Pa')], 'Hm.[TOOL_CALLS]get_weather[ARGS]{"city": "Pa'),
    (MistralParser, "[TOOL_CALLS]get_weather[CALL_ID]abc", [("get_weather", "")], None),
    (MistralParser, "[TOOL_CALLS]get_weather[AR", [("get_weather", "")], None),
    (MistralParser, "[TOOL_CALLS]get_weath", [], None),
    (MistralParser, '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"ci',
     [("get_time", "{}"), ("get_weather", '{"ci')], '{"name": "get_weather", "arguments": {"ci'),
    (PythonicParser, "[get_time(tz='UTC'), get_weather(city='Pa", [("get_time", '{"tz": "UTC"}'),
                                                                  ("get_weather", '{"city": "Pa')], None),
    (PythonicParser, "[get_weather(city='Paris', days=1", [("get_weather", '{"city": "Paris", "days": 1')], None),
    (PythonicParser, "[get_weather(city='Paris', days=", [("get_weather", '{"city": "Paris"')], None),
    (PythonicParser, "[get_weather(city='it\\'s", [("get_weather", '{"city": "it\'s')], None),
    (PythonicParser, "<|python_start|>[get_weather(", [("get_weather", "{")], None),
    (PythonicParser, "[get_weather(city='Paris')", [("get_weather", '{"city": "Paris"}')], None),
    (PythonicParser, "[get_wea", [], None),
]


@pytest.mark.parametrize("cls,text,calls,not_cut", CUT)
def test_cut_calls(cls, text, calls, not_cut):
    content, got = check_splits(cls, text, cut=True)
    assert got == calls
    assert content == ("Hm." if text.startswith("Hm.") else "" if calls else text)
    # not cut by max_tokens: an unclosed call is content (the calls that closed before it stay calls)
    content, got = check_splits(cls, text)
    assert content == (not_cut or text)
    assert [name for name, _ in got] == ([name for name, _ in calls[:-1]] if not_cut else [])


def test_long_answers_stream_as_they_gather():
    """Long answers fed ~a token at a time read as they do whole (their cost per token: scripts/bench_parsers.py)."""
    args = {"text": "Lorem ipsum dolor sit amet, \"consectetur\" {adipiscing} elit. " * 30, "n": list(range(50))}
    for cls, text in [(Llama3JsonParser, '{"name": "write", "parameters": ' + json.dumps(args) + "}"),
                      (MistralParser, "Writing. [TOOL_CALLS]write[ARGS]" + json.dumps(args)),
                      (PythonicParser, f"[write(text={args['text']!r}, n={args['n']!r})]"),
                      (MistralParser, "Plain text [with brackets] and {braces}, no call. " * 40)]:
        whole = cls()
        content, calls = whole.feed(text)
        more, last = whole.finish()
        p, got, got_calls = cls(), "", []
        for i in range(0, len(text), 4):
            c, k = p.feed(text[i:i + 4])
            got, got_calls = got + c, got_calls + k
        c, k = p.finish()
        assert (got + c, [x["function"] for x in got_calls + k]) == (content + more,
                                                                    [x["function"] for x in calls + last]), cls.name


# ---- registry facts ---------------------------------------------------------------------------------------------
def test_template_markers():
    names = sorted(p.stem for p in templates_dir().glob("*.jinja"))
    order = (MistralParser, HermesParser, PythonicParser, Llama3JsonParser)  # as AUTO_ORDER ranks them
    chosen = {}
    for name in names:
        text = template(name)
        chosen[name] = next((c.name for c in order if all(m in text for m in c.template_markers)), None)
    for name in LLAMA:
        assert chosen[name] == "llama3_json"
    for name in (MISTRAL_OLD,) + MISTRAL_V11:
        assert chosen[name] == "mistral"
    assert [n for n, c in chosen.items() if c in ("llama3_json", "mistral")] == sorted(LLAMA + MISTRAL_V11 +
                                                                                         (MISTRAL_OLD,))
    assert all(m in "you MUST put it in the format of [func_name1(params_name1=params_value1, ...), func_name2(" for m
               in PythonicParser.template_markers)
    assert Llama3JsonParser.needs_special_tokens and MistralParser.needs_special_tokens
    assert Llama3JsonParser.forced_format and MistralParser.forced_format and not PythonicParser.forced_format


# ---- forced-call grammars ---------------------------------------------------------------------------------------
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # as the server sets it


def call_schemas(tools=TOOLS) -> list[tuple[str, str]]:
    """What the server hands forced_lark: per tool, the schema of {"name": const, "arguments": parameters}."""
    out = []
    for t in tools:
        f = t["function"]
        params = dict(f["parameters"], additionalProperties=False)
        out.append((f["name"], json.dumps({
            "type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": COMPACT})))
    return out


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """A tiny byte-level tokenizer, as is (every marker is text) and with the markers as special tokens."""
    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    plain = PreTrainedTokenizerFast.from_pretrained(str(folder))
    special = PreTrainedTokenizerFast.from_pretrained(str(folder))
    special.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]",
                                                              "<|python_tag|>"]})
    return {"text": (plain, llguidance.hf.from_tokenizer(plain, n_vocab=len(plain)), json.dumps),
            "special": (special, llguidance.hf.from_tokenizer(special, n_vocab=len(special)),
                        lambda m: f"<[{special.convert_tokens_to_ids(m)}]>")}


def accepts(tokenizers, kind, lark: str, text: str) -> bool:
    tok, lltok, _ = tokenizers[kind]
    grammar = llguidance.grammar_from("lark", lark)
    assert llguidance.LLMatcher.validate_grammar(grammar, lltok) == ""
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()


@pytest.mark.parametrize("kind", ["text", "special"])
def test_forced_grammars_accept_recorded_calls(tokenizers, kind):
    atom = tokenizers[kind][2]
    one, both = call_schemas()[:1], call_schemas()
    weather = render(LLAMA[0], [WEATHER])
    time = render(LLAMA[0], [("get_time", {"tz": "UTC", "exact": True})])
    for parallel in (False, True):
        lark = Llama3JsonParser.forced_lark(both, parallel, atom)
        assert accepts(tokenizers, kind, lark, weather)
        assert accepts(tokenizers, kind, lark, weather + "; " + time) == parallel
        assert not accepts(tokenizers, kind, Llama3JsonParser.forced_lark(both, parallel, atom),
                           weather.replace("parameters", "arguments"))
        assert not accepts(tokenizers, kind, lark, weather.replace('"days"', '"weeks"'))
    assert not accepts(tokenizers, kind, Llama3JsonParser.forced_lark(call_schemas()[1:], True, atom), weather)
    assert accepts(tokenizers, kind, Llama3JsonParser.forced_lark(one, False, atom), weather)

    calls = [WEATHER, ("get_time", {"tz": "UTC", "exact": True})]
    v11 = render("unsloth-mistral-Devstral-Small-2507", calls)
    old = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, ' \
          '{"name": "get_time", "arguments": {"tz": "UTC", "exact": true}}]'
    assert parse(MistralParser, old) == parse(MistralParser, v11)
    for parallel in (False, True):
        lark = MistralParser.forced_lark(both, parallel, atom)
        assert accepts(tokenizers, kind, lark, v11) == parallel
        assert accepts(tokenizers, kind, lark, old) == parallel
        assert accepts(tokenizers, kind, lark, render("unsloth-mistral-Devstral-Small-2507", calls[:1]))
        assert accepts(tokenizers, kind, lark, old[:old.index("}}, ") + 2] + "]")
        assert not accepts(tokenizers, kind, lark, v11.replace("get_time", "get_times"))
        assert not accepts(tokenizers, kind, lark, "Sure. " + v11)
    if kind == "special":  # a special-token marker is matched by id, never as text
        assert not accepts(tokenizers, kind, MistralParser.forced_lark(one, False, json.dumps),
                           render("unsloth-mistral-Devstral-Small-2507", calls[:1]))


def test_forced_grammar_generates_what_the_parser_reads(tokenizers):
    """Walk each grammar with the tiny tokenizer, taking the first allowed token (strings closed and optional
    properties left out as soon as allowed): what comes out parses as a call of the tool (the grammar and the parser
    agree on the shape). Mistral's both ways: the pre-v11 list, and the v11 name (the list's "[" refused)."""
    import numpy as np
    tok, lltok, atom = tokenizers["special"]
    closing = tok.convert_tokens_to_ids(['"', "}", "]"])
    bracket = tok.convert_tokens_to_ids("[")
    texts = set()
    for cls, refuse in [(Llama3JsonParser, None), (MistralParser, None), (MistralParser, bracket)]:
        for schemas in (call_schemas()[:1], call_schemas()[1:]):
            lark = cls.forced_lark(schemas, False, atom)
            matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from("lark", lark), log_level=0)
            ids = []
            while not (matcher.is_stopped() or matcher.is_accepting()) and len(ids) < 200:
                bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
                allowed = [t for t in np.flatnonzero(bits[:len(tok)]).tolist() if t not in (tok.eos_token_id, refuse)]
                ids.append(([t for t in closing if t in allowed] or allowed)[0])
                assert matcher.consume_token(ids[-1])
            text = tok.decode(ids, skip_special_tokens=False)
            texts.add(text)
            content, calls = parse(cls, text)
            assert content == "" and [c[0] for c in calls] == [schemas[0][0]], text
    assert '[TOOL_CALLS]get_weather[ARGS]{"city": ""}' in texts
    assert '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": ""}}]' in texts
    assert '{"name": "get_weather", "parameters": {"city": ""}}' in texts
