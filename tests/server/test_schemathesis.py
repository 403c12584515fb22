"""Property-based requests: no input may produce a 5xx, and the server keeps serving.

- schemathesis generates requests from our own /openapi.json: every GET, POST and DELETE operation, each POST's
  body from its pydantic model, both valid bodies (positive) and bodies that break the schema (negative).
- hypothesis generates JSON schemas (nested objects, arrays and combinators, weird and invalid types, huge enums,
  $ref loops, bad and explosive patterns, nesting past the depth limit) and sends each as a response_format
  json_schema, as a tool's parameters (tool_choice "required", so it is compiled) and as guided_json text.

After every request the server must still be healthy: an input that fails the engine step (a 503 for every later
request) is as bad as a 500. The server runs with an API key, as an exposed one would: every request carries it,
and none may be turned away as unauthenticated.
"""

from __future__ import annotations

import json

import httpx
import pytest

from server.api.protocol import MAX_JSON_DEPTH, MAX_SPEC_CHARS

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from hypothesis.errors import Unsatisfiable  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

BODIES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")  # at least these are fuzzed
KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)


@pytest.fixture(scope="module")
def srv(server_factory, checkpoints):
    return server_factory(checkpoints("llama"), 1, "--max-model-len", "64", "--max-num-seqs", "4", "--api-key", KEY)


def healthy(srv) -> bool:
    return httpx.get(srv.url + "/health", timeout=30).status_code == 200


# examples per operation: the slow tier goes deeper over the same (derandomized) start
@pytest.mark.parametrize("examples", [6, pytest.param(20, marks=pytest.mark.slow)])
def test_no_5xx_from_generated_requests(srv, examples):
    assert httpx.get(srv.url + "/openapi.json").status_code == 401  # the schema itself is behind the key
    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json", headers=AUTH)
    failures, fuzzed = [], set()

    @settings(max_examples=examples, **SETTINGS)
    def check(case):
        response = case.call(base_url=srv.url, headers=AUTH, timeout=60)
        if response.status_code >= 500 or response.status_code == 401 or not healthy(srv):
            failures.append((case.method, case.path, case.body, response.status_code, response.text[:200]))

    for op in schema.get_all_operations():
        operation = op.ok()
        method = operation.method.upper()
        if method not in ("GET", "POST", "DELETE"):
            continue
        body = operation.definition.raw.get("requestBody")
        if body is not None:  # a body is described by its model in the OpenAPI schema
            assert "$ref" in body["content"]["application/json"]["schema"], (operation.path, body)
        if operation.path in BODIES:
            assert method == "POST" and body is not None, operation.path
        given(operation.as_strategy())(check)()
        fuzzed.add((method, operation.path, "positive"))
        try:
            given(operation.as_strategy(generation_mode=schemathesis.GenerationMode.NEGATIVE))(check)()
            fuzzed.add((method, operation.path, "negative"))
        except Unsatisfiable:  # nothing to break: no body, no parameter a wrong value exists for (GET /health)
            assert body is None, operation.path
    for path in BODIES:
        assert {("POST", path, "positive"), ("POST", path, "negative")} <= fuzzed, (path, fuzzed)
    assert not failures, failures[:5]
    assert srv.proc.poll() is None and healthy(srv)  # still serving


# ---- generated JSON schemas ------------------------------------------------------------------------------------
NAMES = st.text(alphabet="abcxyz_$", min_size=1, max_size=5)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**40, 10**40), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=6))
SMALL = st.integers(0, 6)
# schemas llguidance takes (or may take)
VALID = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "object",
                                                    "array"])}),
    st.fixed_dictionaries({"type": st.just(["string", "null"])}),
    st.fixed_dictionaries({"enum": st.lists(SCALARS, min_size=1, max_size=5)}),
    st.integers(1, MAX_SPEC_CHARS // 4).map(lambda n: {"enum": [f"v{i}" for i in range(n)]}),  # huge enums
    st.fixed_dictionaries({"const": SCALARS}),
    st.fixed_dictionaries({"type": st.just("string"), "pattern": st.sampled_from(
        ["^[a-z]{1,4}$", r"^\d+$", "^(ab|cd)+$", "^((a|aa)*b)*c$", "^(x{20}){20}$"])}),
    st.builds(lambda lo, extra, fmt: {"type": "string", "minLength": lo, "maxLength": lo + extra, **fmt}, SMALL,
              SMALL, st.sampled_from([{}, {"format": "date-time"}, {"format": "email"}, {"format": "uuid"}])),
    st.builds(lambda lo, extra, kind: {"type": kind, "minimum": lo, "maximum": lo + extra}, st.integers(-10**6, 10**6),
              st.integers(0, 10**6), st.sampled_from(["integer", "number"])),
    st.just({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),  # a $ref loop
    st.just({"$ref": "#"}),
    st.just({}),
    st.booleans(),
)
# schemas that are invalid, or use what llguidance does not implement
WEIRD = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["strnig", 7, None, [], ["integer", "integer"]])}),
    st.fixed_dictionaries({"type": st.just("string"), "pattern": st.sampled_from(
        ["(ab", "[z-a]", "(?=a)b", r"\p{L}+", "a{3,1}", "", "\\", "[^\\s\\S]", "a{1000}{1000}"])}),
    st.fixed_dictionaries({"type": st.just("string"), "minLength": st.integers(-2, 40),
                           "maxLength": st.integers(-2, 40), "format": st.just("nonsense")}),
    st.fixed_dictionaries({"type": st.sampled_from(["integer", "number"]), "minimum": SCALARS,
                           "multipleOf": st.sampled_from([0, -1, 0.5, 10**30])}),
    st.fixed_dictionaries({"$ref": st.sampled_from(["#/$defs/missing", "#/properties/a", "http://example.com/s",
                                                    "#/items"])}),
    SCALARS,  # not a schema at all
)


def _extend(children, weird: bool):
    objects = st.fixed_dictionaries(
        {"type": st.just("object"), "properties": st.dictionaries(NAMES, children, max_size=4)},
        optional={"required": st.lists(NAMES, max_size=3), "additionalProperties": st.one_of(st.booleans(), children)})
    arrays = st.fixed_dictionaries({"type": st.just("array"), "items": children},
                                   optional={"minItems": st.integers(0, 2), "maxItems": st.integers(2, 4)})
    combined = st.builds(lambda key, subs: {key: subs}, st.sampled_from(["anyOf", "oneOf", "allOf"]),
                         st.lists(children, min_size=1, max_size=3))
    defs = st.builds(lambda sub, ref: {"$defs": {"a": sub}, "$ref": ref}, children, st.sampled_from(["#/$defs/a", "#"]))
    if not weird:
        return st.one_of(objects, arrays, combined, defs)
    return st.one_of(
        objects, arrays, combined, defs,
        st.builds(lambda key, sub: {key: sub}, st.sampled_from(["not", "contains", "propertyNames"]), children),
        st.builds(lambda c, t, e: {"if": c, "then": t, "else": e}, children, children, children),
        st.builds(lambda sub, n: {"type": "array", "items": sub, "minItems": n, "uniqueItems": True}, children,
                  st.integers(-1, 3)),
        st.builds(lambda subs: {"anyOf": subs}, st.lists(children, max_size=0)),  # an empty anyOf
    )


def _wrap(schema, levels: int, how: str):
    for _ in range(levels):
        schema = {"items": {"type": "array", "items": schema},
                  "properties": {"type": "object", "properties": {"a": schema}, "required": ["a"]},
                  "anyOf": {"anyOf": [schema, {"type": "null"}]}, "not": {"not": schema}}[how]
    return schema


GOOD = st.recursive(VALID, lambda c: _extend(c, weird=False), max_leaves=8)  # valid schemas (llguidance may refuse)
ANY = st.recursive(st.one_of(VALID, WEIRD), lambda c: _extend(c, weird=True), max_leaves=8)  # often invalid
# nested past the depth limit, at it, and below it
DEEP = st.builds(_wrap, GOOD, st.one_of(st.integers(0, 300), st.integers(0, MAX_JSON_DEPTH // 2), st.sampled_from(
    [MAX_JSON_DEPTH // 2 - 2, MAX_JSON_DEPTH // 2, MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH])),
    st.sampled_from(["items", "properties", "anyOf", "not"]))
SCHEMAS = st.one_of(GOOD, GOOD, ANY, DEEP)


# examples: the fast tier a derandomized start, the slow tier goes on from it
@pytest.mark.parametrize("examples", [25, pytest.param(90, marks=pytest.mark.slow)])
def test_generated_json_schemas_never_get_a_5xx(srv, examples):
    failures, statuses = [], {}
    msgs = [{"role": "user", "content": "hi"}]

    def bodies(schema, strict):
        tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
        yield "/v1/chat/completions", {"messages": msgs, "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": strict}}}
        yield "/v1/chat/completions", {"messages": msgs, "tools": [tool], "tool_choice": "required"}
        yield "/v1/completions", {"prompt": "hi", "guided_json": json.dumps(schema)}

    @settings(max_examples=examples, **SETTINGS)
    @given(schema=SCHEMAS, strict=st.booleans())
    def check(schema, strict):
        for path, body in bodies(schema, strict):
            r = httpx.post(srv.url + path, json={"model": srv.model_name, "max_tokens": 3, **body}, timeout=120,
                           headers=AUTH)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            ok = r.status_code == 200 or (400 <= r.status_code < 500 and set(r.json()["error"]) == {
                "message", "type", "param", "code"})
            if not ok or not healthy(srv):
                failures.append((path, json.dumps(body)[:300], r.status_code, r.text[:300]))

    check()
    print("statuses of the generated-schema requests:", statuses)
    assert not failures, failures[:5]
    assert statuses.get(200) and statuses.get(400), statuses  # both outcomes were reached
    assert set(statuses) <= {200, 400}, statuses
    r = httpx.post(srv.v1 + "/chat/completions", timeout=60, headers=AUTH, json={
        "model": srv.model_name, "messages": msgs, "max_tokens": 40, "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "schema": {"enum": ["yes", "no"]}}}})
    assert r.status_code == 200 and json.loads(r.json()["choices"][0]["message"]["content"]) in ("yes", "no")
