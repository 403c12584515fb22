"""The request limits (server/api/protocol.py, MAX_*): each is a 400 in OpenAI's shape that names the field and the
limit, and the server keeps serving. Several of these bodies used to get a 500 (a 300-deep schema: RecursionError in
the metaschema check; a 5000-digit or superscript logit_bias key: int() raised; a lone UTF-16 surrogate in a prompt
or a model name) or failed the engine step itself, so that every later request got a 503 (top_k past 2**63;
stop_token_ids outside the vocabulary with min_tokens)."""

from __future__ import annotations

import json

import httpx
import pytest

from server.api.protocol import (MAX_CHOICES, MAX_INT, MAX_JSON_DEPTH, MAX_LOGIT_BIAS, MAX_MESSAGES,
                             MAX_PATTERN_DEPTH, MAX_SPEC_CHARS, MAX_STOP_TOKEN_IDS, MAX_TOOLS)

MSGS = [{"role": "user", "content": "hi"}]
VOCAB = 387  # the tiny Llama's


def nested(levels: int, leaf=None) -> dict:
    """A schema `levels` deep in JSON objects: arrays of arrays of ... strings."""
    schema = leaf or {"type": "string", "maxLength": 2}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    return schema


def properties(levels: int) -> dict:
    """The issue's 300-deep schema: objects in objects, two JSON levels each."""
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def fmt(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def tool(schema, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": schema}}


def nested_list(levels: int) -> str:
    return "[" * levels + "]" * levels


DEEP = f"nested deeper than {MAX_JSON_DEPTH} levels"
GROUPS = f"deeper than {MAX_PATTERN_DEPTH} levels"
CALL = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
    "name": "f", "arguments": json.dumps(json.loads(nested_list(100)))}}]}

# (endpoint, extra body fields, the error's param, words in its message)
CASES = [
    # JSON schemas: depth, in every field that takes one
    ("chat", fmt(properties(300)), "response_format.json_schema.schema", DEEP),
    ("chat", fmt(nested(MAX_JSON_DEPTH + 1)), "response_format.json_schema.schema", DEEP),
    ("chat", {"tools": [tool(properties(300))], "tool_choice": "required"}, "tools.0.function.parameters", DEEP),
    ("chat", {"tools": [tool(properties(300))], "tool_choice": "none"}, "tools.0.function.parameters", DEEP),
    ("chat", {"structured_outputs": {"json": properties(300)}}, "structured_outputs.json", DEEP),
    ("cmpl", {"guided_json": properties(300)}, "guided_json", DEEP),
    ("cmpl", {"guided_json": json.dumps(properties(300))}, "guided_json", DEEP),  # a string: parsed, then checked
    ("cmpl", {"guided_json": nested_list(5000)}, "guided_json", DEEP),  # past Python's own recursion limit
    ("cmpl", {"structured_outputs": {"json": json.dumps(properties(300))}}, "structured_outputs.json", DEEP),
    ("cmpl", {"guided_json": '{"maximum": ' + "9" * 5000 + "}"}, "guided_json", "not valid JSON"),
    ("chat", {"functions": [properties(300)]}, "functions.0", DEEP),
    ("chat", {"chat_template_kwargs": {"x": json.loads(nested_list(100))}}, "chat_template_kwargs", DEEP),
    ("chat", {"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs", "set by the server"),
    ("chat", {"messages": MSGS + [CALL, {"role": "tool", "tool_call_id": "c1", "content": "x"}] + MSGS},
     "messages.1.tool_calls.0.function.arguments", DEEP),
    # JSON schemas: size
    ("chat", fmt({"enum": [f"v{i}" for i in range(MAX_SPEC_CHARS // 5)]}), "response_format.json_schema.schema",
     f"longer than {MAX_SPEC_CHARS} characters"),
    ("cmpl", {"guided_json": " " * (MAX_SPEC_CHARS + 1) + "{}"}, "guided_json", f"longer than {MAX_SPEC_CHARS}"),
    ("chat", {"tools": [tool({"enum": [f"v{i}" for i in range(MAX_SPEC_CHARS // 20)]}, f"f{j}") for j in range(5)],
              "tool_choice": "required"}, "tools", f"at most {MAX_SPEC_CHARS} are allowed"),
    ("chat", {"tools": [tool(None, f"f{j}") for j in range(MAX_TOOLS + 1)], "tool_choice": "required"}, "tools",
     f"at most {MAX_TOOLS} items"),
    ("chat", fmt({"$ref": "#"}), "response_format", "admits no output"),  # a $ref loop: nothing to generate
    # regexes and grammars
    ("cmpl", {"guided_regex": "(" * 40 + "a" + ")" * 40}, "guided_regex", GROUPS),
    ("cmpl", {"guided_regex": "(" * 100_000}, "guided_regex", GROUPS),
    ("cmpl", {"guided_regex": "a" * (MAX_SPEC_CHARS + 1)}, "guided_regex", f"longer than {MAX_SPEC_CHARS}"),
    ("cmpl", {"guided_regex": "a{1000}{1000}"}, "guided_regex", "too many expressions"),  # its lexer explodes
    ("cmpl", {"guided_regex": "(?<=a)b"}, "guided_regex", "cannot compile"),
    ("cmpl", {"guided_grammar": "root ::= " + "(" * 3000 + '"a"' + ")" * 3000}, "guided_grammar", GROUPS),
    ("cmpl", {"structured_outputs": {"grammar": "start: " + "(" * 40 + '"a"' + ")" * 40}},
     "structured_outputs.grammar", GROUPS),
    ("chat", {"guided_json": {"type": "object"}, "guided_whitespace_pattern": "(" * 40 + " " + ")" * 40},
     "guided_whitespace_pattern", GROUPS),
    ("cmpl", {"guided_choice": [f"c{i}" for i in range(MAX_CHOICES + 1)]}, "guided_choice",
     f"at most {MAX_CHOICES}"),
    # sampling fields
    ("cmpl", {"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias", str(MAX_LOGIT_BIAS)),
    ("cmpl", {"logit_bias": {"9" * 5000: 1}}, "logit_bias", "at most 10 digits"),
    ("cmpl", {"logit_bias": {"²": 1}}, "logit_bias", "at most 10 digits"),
    ("cmpl", {"logit_bias": {"5": [[[1]]]}}, "logit_bias.5", "valid number"),
    ("cmpl", {"top_k": 10**30}, "top_k", str(MAX_INT)),
    ("cmpl", {"min_tokens": 10**30}, "min_tokens", str(MAX_INT)),
    ("cmpl", {"max_tokens": 10**30}, "max_tokens", str(MAX_INT)),
    ("cmpl", {"stop_token_ids": [10**30]}, "stop_token_ids.0", str(MAX_INT)),
    ("cmpl", {"stop_token_ids": [VOCAB], "min_tokens": 1}, "stop_token_ids", "outside the vocabulary"),
    ("cmpl", {"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids", str(MAX_STOP_TOKEN_IDS)),
    # conversations
    ("chat", {"messages": MSGS * (MAX_MESSAGES + 1)}, "messages", f"at most {MAX_MESSAGES} items"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": [["x"]]}]}]},
     "messages.0.content.str", "valid string"),
]


@pytest.fixture(scope="module")
def srv(server_factory, checkpoints):
    return server_factory(checkpoints("llama"), 1, "--max-model-len", "64", "--max-num-seqs", "4")


def post(srv, endpoint: str, extra: dict) -> httpx.Response:
    body = {"model": srv.model_name, "max_tokens": 3, **extra}
    if endpoint == "chat":
        body.setdefault("messages", MSGS)
        return httpx.post(srv.v1 + "/chat/completions", json=body, timeout=120)
    return httpx.post(srv.v1 + "/completions", json={"prompt": "hi", **body}, timeout=120)


def test_each_limit_is_a_400_that_names_it(srv):
    for endpoint, extra, param, words in CASES:
        r = post(srv, endpoint, extra)
        what = (endpoint, json.dumps(extra)[:120])
        assert r.status_code == 400, (what, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
        assert err["param"] == param and words in err["message"], (what, err)
        assert len(err["message"]) < 1000, err  # llguidance's dumps of state and grammar are cut
    assert httpx.get(srv.url + "/health", timeout=10).json() == {"status": "ok"}  # the engine never saw them


def test_at_the_limits_is_served(srv):
    """The limits bind only past them: a schema exactly MAX_JSON_DEPTH deep (as a response format and as tool
    parameters), a regex nested MAX_PATTERN_DEPTH deep, MAX_CHOICES choices, the largest top_k and the last token id
    as a stop token are all answered."""
    ok = [
        ("chat", fmt(nested(MAX_JSON_DEPTH))),
        ("chat", {"tools": [tool(nested(MAX_JSON_DEPTH))], "tool_choice": "required"}),
        ("cmpl", {"guided_regex": "(" * MAX_PATTERN_DEPTH + "ab" + ")" * MAX_PATTERN_DEPTH}),
        ("cmpl", {"guided_choice": [f"c{i}" for i in range(MAX_CHOICES)]}),
        ("cmpl", {"top_k": MAX_INT, "stop_token_ids": [VOCAB - 1], "min_tokens": 1}),
        ("chat", {"messages": MSGS * 3, "chat_template_kwargs": {"x": json.loads(nested_list(MAX_JSON_DEPTH - 1))}}),
    ]
    for endpoint, extra in ok:
        r = post(srv, endpoint, extra)
        if "tools" in extra and r.status_code == 400:  # past every check; only this 64-token context is too short for
            # the tool's description (the generic tool format puts it in a system message)
            assert r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
            continue
        assert r.status_code == 200, (endpoint, json.dumps(extra)[:120], r.text[:300])
        assert r.json()["usage"]["completion_tokens"] >= 1


def test_a_deep_body_is_refused_in_openai_shape(srv):
    """A body nested past what the JSON reader takes is refused before any route runs."""
    for depth in (900, 100_000):
        body = '{"prompt": "hi", "max_tokens": 2, "guided_json": {"a": ' + nested_list(depth) + "}}"
        r = httpx.post(srv.v1 + "/completions", content=body, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 400, r.text[:300]
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = post(srv, "cmpl", {})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


def test_lone_surrogates_and_non_numbers_are_refused(srv):
    """JSON can spell what is not Unicode text (a lone surrogate, "\\ud800") and, as Python reads it, numbers that
    are not numbers (NaN, 1e400): a 400 wherever they are, never a 500."""
    surrogate = "a\\ud800b"  # the JSON escape, as the client sends it
    bodies = [
        ("/v1/completions", '{"prompt": "%s", "max_tokens": 2}' % surrogate),
        ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "model": "%s"}' % surrogate),
        ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "stop": ["%s"]}' % surrogate),
        ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "guided_regex": "%s"}' % surrogate),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "%s"}], "max_tokens": 2}' % surrogate),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                                 '"chat_template_kwargs": {"x": "%s"}}' % surrogate),
        ("/tokenize", '{"prompt": "%s"}' % surrogate),
        ("/tokenize", '{"messages": [{"role": "user", "content": "%s"}]}' % surrogate),
        ("/detokenize", '{"tokens": [5], "model": "%s"}' % surrogate),
    ]
    for path, body in bodies:
        r = httpx.post(srv.url + path, content=body.encode(), headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 400 and "lone UTF-16 surrogate (\\ud800)" in r.json()["error"]["message"], \
            (path, body, r.status_code, r.text[:300])
    for value in ("NaN", "1e400", "-Infinity"):
        for path, body in (("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "temperature": %s}'),
                           ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": %s}}'),
                           ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "guided_json": {"maximum": %s}}'),
                           ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": '
                                                    '2, "tools": [{"type": "function", "function": {"name": "f", '
                                                    '"parameters": {"minimum": %s}}}], "tool_choice": "required"}')):
            r = httpx.post(srv.url + path, content=(body % value).encode(), headers={
                "content-type": "application/json"}, timeout=60)
            assert r.status_code == 400, (body % value, r.text[:300])
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(srv.url + "/health", timeout=10).json() == {"status": "ok"}
