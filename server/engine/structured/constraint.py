"""Structured outputs: the request fields that constrain what the answer must be, turned into one `Constraint`.

OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema"}), vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and its newer `structured_outputs` object all land here, on rank 0,
before anything reaches the engine. A request may ask for one constraint; a schema must be a valid JSON schema,
checked against its metaschema with `jsonschema` (slow Python: ~0.3 s for a 70 KB schema), never on the event loop:
a request's output schema in its compile, on a compile thread and only on a cache miss (`Constraint.checks`); tool
parameters in the compile of the grammar that holds them, else in the request's CpuPool job (server/api/tool_calls.py
check_tools); each text once. Whatever llguidance cannot compile is refused with its reason when the grammar compiles
(server/engine/structured/grammar.py). Tool calls build their own constraint (server/api/tool_calls.py).

Every constraint is bounded before it is compiled (the limits live in server/api/protocol.py): a JSON schema nests at
most MAX_JSON_DEPTH levels and serializes to at most MAX_SPEC_CHARS characters, checked in that order and before the
metaschema check (which recurses); a regex or grammar is at most MAX_SPEC_CHARS characters and nests its groups at
most MAX_PATTERN_DEPTH levels; a choice has at most MAX_CHOICES alternatives. Each is a 400 that names the field and
the limit.

JSON output is compact by default (", " and ": " between items, no other whitespace): a small model that may emit
free whitespace can spend its whole budget on newlines. `guided_whitespace_pattern`, `structured_outputs.
whitespace_pattern` or `structured_outputs.disable_any_whitespace: false` allow whitespace between tokens.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

from server.engine.structured.grammar import Constraint
from server.api.protocol import (MAX_CHOICES, MAX_JSON_DEPTH, MAX_PATTERN_DEPTH, MAX_SPEC_CHARS, APIError,
                             SamplingFields, json_depth, too_deep)

COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
VALID_SCHEMAS = 4096  # digests of schema texts that passed the metaschema check, most recently used kept
_valid: OrderedDict[bytes, None] = OrderedDict()
_valid_lock = threading.Lock()  # (the event loop and the compile threads)


def too_long(param: str) -> APIError:
    return APIError(400, f"{param} is longer than {MAX_SPEC_CHARS} characters (this server's limit)", param=param)


def check_json_bounds(value: Any, param: str) -> str:
    """`value` nests at most MAX_JSON_DEPTH levels and serializes to at most MAX_SPEC_CHARS characters; its compact
    JSON text (key order kept) is returned. Safe on any value: depth is measured without recursion, first."""
    if json_depth(value) > MAX_JSON_DEPTH:
        raise APIError(400, too_deep(param), param=param)
    try:
        spec = json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError) as e:  # not JSON data (the offline LLM path takes Python objects)
        raise APIError(400, f"{param} is not JSON data: {e}", param=param) from None
    if len(spec) > MAX_SPEC_CHARS:
        raise too_long(param)
    return spec


def check_schema(schema: Any, param: str) -> dict:
    """A JSON schema must be an object, within the depth and size limits, that validates against its own
    metaschema."""
    check_metaschema(schema, param, schema_shape(schema, param))
    return schema


def schema_shape(schema: Any, param: str) -> str:
    """The cheap half of check_schema: an object within the depth and size limits; its compact JSON text."""
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON schema object", param=param)
    return check_json_bounds(schema, param)


def check_metaschema(schema: dict, param: str, text: str | None = None) -> None:
    """The slow half: `schema` (of compact JSON `text`) validates against its metaschema. A text that passed once
    is not checked again (a tool list comes with every turn of a conversation)."""
    digest = hashlib.sha256((text or json.dumps(schema, separators=(",", ":"))).encode()).digest()
    with _valid_lock:
        if digest in _valid:
            _valid.move_to_end(digest)
            return
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        message = e.message if len(e.message) <= 500 else e.message[:500] + "..."
        raise APIError(400, f"{param} is not a valid JSON schema: {message}" + (f" (at /{where})" if where else ""),
                       param=param) from None
    with _valid_lock:
        _valid[digest] = None
        while len(_valid) > VALID_SCHEMAS:
            _valid.popitem(last=False)


def _no_additional_properties(schema: Any) -> Any:
    """Every object schema that does not say otherwise gets additionalProperties: false (vLLM's option)."""
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """The default for every schema a request gives (response_format, guided_json, structured_outputs.json, tool
    parameters): an object that lists its `properties` and says nothing of others gets no others
    (additionalProperties: false), as vLLM's default backend (xgrammar's strict mode) generates. JSON Schema would
    allow any extra key, and a model then adds keys the client's pydantic model never declared (instructor's and
    langchain's function-calling schemas say nothing of them). An explicit `additionalProperties` or
    `patternProperties` is kept, and an object without listed properties stays open (`{"type": "object"}` is
    any object)."""
    if isinstance(schema, dict):
        out = {}
        for k, v in schema.items():
            if k in SCHEMA_MAPS and isinstance(v, dict):  # name -> schema: only the schemas are schemas
                out[k] = {name: closed_objects(sub) for name, sub in v.items()}
            elif k in ("const", "enum", "default", "examples"):  # values, not schemas
                out[k] = v
            else:
                out[k] = closed_objects(v)
        if out.get("properties") and "additionalProperties" not in out and "patternProperties" not in out \
                and "unevaluatedProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed_objects(v) for v in schema]
    return schema


def deferred_checks(checks) -> tuple:
    """`Constraint.checks` of (field, schema) pairs: each schema validated against its metaschema when (if) the
    constraint compiles, on a compile thread."""
    return tuple(functools.partial(check_metaschema, s, f) for f, s in checks)


def json_constraint(schema: dict, param: str, options: dict | None = None, checks: tuple = ()) -> Constraint:
    """`checks`: (field, schema) pairs to validate against their metaschema when (if) the constraint compiles."""
    spec = check_json_bounds(schema, param)  # key order kept: properties are generated in it
    return Constraint("json", spec, json.dumps(options or COMPACT_JSON, sort_keys=True), param,
                      deferred_checks(checks))


def pattern_depth(text: str, kind: str) -> int:
    """How deeply a regex (kind "regex") or a grammar (GBNF, or Lark) nests its groups.

    A scan, not a parse. Groups are (...) (and Lark's optional [...]); skipped are escapes, character classes
    [...] (regex, GBNF), string literals "..." (GBNF, Lark), /regex/ literals (Lark) and comments (# in GBNF, // in
    Lark). A bracket that is really a literal may be miscounted, which matters only near MAX_PATTERN_DEPTH, where no
    real pattern goes; the compiler's own errors stand behind this check."""
    mode = kind if kind == "regex" else ("gbnf" if "::=" in text else "lark")
    opening = "([" if mode == "lark" else "("
    closing = ")]" if mode == "lark" else ")"
    depth = deepest = 0
    i, n = 0, len(text)

    def skip_to(i: int, end: str) -> int:  # index of the unescaped `end` (or the line's end) from i
        while i < n and text[i] != end and text[i] != "\n":
            i += 2 if text[i] == "\\" else 1
        return i

    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 1
        elif ch == "[" and mode != "lark":  # a character class; its first ] (or ^]) is a literal
            i += 1
            if text.startswith("^", i):
                i += 1
            if text.startswith("]", i):
                i += 1
            i = skip_to(i, "]")
        elif mode == "gbnf" and ch == "#" or mode == "lark" and text.startswith("//", i):
            i = skip_to(i, "\n")
        elif mode != "regex" and ch == '"' or mode == "lark" and ch == "/":
            i = skip_to(i + 1, ch)
        elif ch in opening:
            depth += 1
            deepest = max(deepest, depth)
        elif ch in closing:
            depth = max(depth - 1, 0)
        i += 1
    return deepest


def check_pattern(kind: str, value: str, param: str) -> str:
    """A regex or grammar text: not empty, at most MAX_SPEC_CHARS characters, groups nested at most
    MAX_PATTERN_DEPTH levels."""
    if not value:
        raise APIError(400, f"{param} must not be empty", param=param)
    if len(value) > MAX_SPEC_CHARS:
        raise too_long(param)
    if pattern_depth(value, kind) > MAX_PATTERN_DEPTH:
        raise APIError(400, f"{param} nests its groups deeper than {MAX_PATTERN_DEPTH} levels (this server's limit)",
                       param=param)
    return value


def _text(kind: str, value: str, param: str) -> Constraint:
    return Constraint(kind, check_pattern(kind, value, param), "", param)


def _parse_json_field(value: dict | str, param: str) -> dict:
    if isinstance(value, str):
        if len(value) > MAX_SPEC_CHARS:
            raise too_long(param)
        try:
            value = json.loads(value)
        except RecursionError:
            raise APIError(400, too_deep(param), param=param) from None
        except ValueError as e:  # JSONDecodeError, or an integer longer than Python reads (4300 digits)
            raise APIError(400, f"{param} is not valid JSON: {e}", param=param) from None
    schema_shape(value, param)
    return value  # (its metaschema check: in its compile, `Constraint.checks`)


def _choice(choices: list[str], param: str) -> Constraint:
    if not choices or any(not isinstance(c, str) or not c for c in choices):
        raise APIError(400, f"{param} must be a non-empty list of non-empty strings", param=param)
    if len(choices) > MAX_CHOICES:
        raise APIError(400, f"{param} has {len(choices)} choices; at most {MAX_CHOICES} are allowed (this server's "
                            "limit)", param=param)
    spec = json.dumps(choices)
    if len(spec) > MAX_SPEC_CHARS:
        raise too_long(param)
    return Constraint("choice", spec, "", param)


def json_options(body: SamplingFields) -> dict:
    so = body.structured_outputs
    if body.guided_whitespace_pattern:
        pattern = check_pattern("regex", body.guided_whitespace_pattern, "guided_whitespace_pattern")
    elif so is not None and so.whitespace_pattern:
        pattern = check_pattern("regex", so.whitespace_pattern, "structured_outputs.whitespace_pattern")
    else:
        pattern = None
    if pattern:
        return {"whitespace_flexible": True, "whitespace_pattern": pattern}
    if so is not None and so.disable_any_whitespace is False:
        return {"whitespace_flexible": True}
    return COMPACT_JSON


def constraint_from_request(body: SamplingFields) -> Constraint | None:
    """The one constraint a request asks for, or None; a 400 for two, or for one that is not well formed."""
    found: list[Constraint] = []
    options = json_options(body)
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(json_constraint({"type": "object"}, "response_format", options))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_
        if schema is None:
            raise APIError(400, "response_format.json_schema.schema is required", param="response_format")
        param = "response_format.json_schema.schema"
        schema_shape(schema, param)
        found.append(json_constraint(closed_objects(schema), "response_format", options, ((param, schema),)))
    if body.guided_json is not None:
        schema = _parse_json_field(body.guided_json, "guided_json")
        found.append(json_constraint(closed_objects(schema), "guided_json", options, (("guided_json", schema),)))
    if body.guided_regex is not None:
        found.append(_text("regex", body.guided_regex, "guided_regex"))
    if body.guided_choice is not None:
        found.append(_choice(body.guided_choice, "guided_choice"))
    if body.guided_grammar is not None:
        found.append(_text("grammar", body.guided_grammar, "guided_grammar"))
    so = body.structured_outputs
    if so is not None:
        if so.structural_tag is not None:
            raise APIError(400, "structured_outputs.structural_tag is not supported by this server; use json, "
                                "regex, choice or grammar", param="structured_outputs.structural_tag")
        if so.json_ is not None:
            schema = _parse_json_field(so.json_, "structured_outputs.json")
            checks = (("structured_outputs.json", schema),)
            schema = _no_additional_properties(schema) if so.disable_additional_properties else closed_objects(schema)
            found.append(json_constraint(schema, "structured_outputs.json", options, checks))
        if so.regex is not None:
            found.append(_text("regex", so.regex, "structured_outputs.regex"))
        if so.choice is not None:
            found.append(_choice(so.choice, "structured_outputs.choice"))
        if so.grammar is not None:
            found.append(_text("grammar", so.grammar, "structured_outputs.grammar"))
        if so.json_object:
            found.append(json_constraint({"type": "object"}, "structured_outputs.json_object", options))
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise APIError(400, f"a request may ask for one output constraint; this one has {len(found)} ({names})",
                       param=found[1].param)
    return found[0] if found else None
