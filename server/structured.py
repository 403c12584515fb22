"""Structured outputs: the request fields that constrain what the answer must be, turned into one `Constraint`.

OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema"}), vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and its newer `structured_outputs` object all land here, on rank 0,
before anything reaches the engine. A request may ask for one constraint; a schema must be a valid JSON schema
(checked against its metaschema with `jsonschema`); whatever llguidance cannot compile is refused with its reason
when the grammar compiles (server/grammar.py). Tool calls build their own constraint (server/tool_parser.py).

JSON output is compact by default (", " and ": " between items, no other whitespace): a small model that may emit
free whitespace can spend its whole budget on newlines. `guided_whitespace_pattern`, `structured_outputs.
whitespace_pattern` or `structured_outputs.disable_any_whitespace: false` allow whitespace between tokens.
"""

from __future__ import annotations

import json
from typing import Any

from server.grammar import Constraint
from server.protocol import APIError, SamplingFields

COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SPEC_CHARS = 200_000


def check_schema(schema: Any, param: str) -> dict:
    """A JSON schema must be an object that validates against its own metaschema."""
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON schema object", param=param)
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise APIError(400, f"{param} is not a valid JSON schema: {e.message}" + (f" (at /{where})" if where else ""),
                       param=param) from None
    return schema


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


def json_constraint(schema: dict, param: str, options: dict | None = None) -> Constraint:
    spec = json.dumps(schema, separators=(",", ":"))  # key order kept: properties are generated in it
    if len(spec) > MAX_SPEC_CHARS:
        raise APIError(400, f"{param} is longer than {MAX_SPEC_CHARS} characters", param=param)
    return Constraint("json", spec, json.dumps(options or COMPACT_JSON, sort_keys=True), param)


def _text(kind: str, value: str, param: str) -> Constraint:
    if not value:
        raise APIError(400, f"{param} must not be empty", param=param)
    if len(value) > MAX_SPEC_CHARS:
        raise APIError(400, f"{param} is longer than {MAX_SPEC_CHARS} characters", param=param)
    return Constraint(kind, value, "", param)


def _parse_json_field(value: dict | str, param: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise APIError(400, f"{param} is not valid JSON: {e}", param=param) from None
    return check_schema(value, param)


def _choice(choices: list[str], param: str) -> Constraint:
    if not choices or any(not isinstance(c, str) or not c for c in choices):
        raise APIError(400, f"{param} must be a non-empty list of non-empty strings", param=param)
    return Constraint("choice", json.dumps(choices), "", param)


def json_options(body: SamplingFields) -> dict:
    so = body.structured_outputs
    pattern = body.guided_whitespace_pattern or (so.whitespace_pattern if so else None)
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
        found.append(json_constraint(check_schema(schema, "response_format.json_schema.schema"),
                                     "response_format", options))
    if body.guided_json is not None:
        found.append(json_constraint(_parse_json_field(body.guided_json, "guided_json"), "guided_json", options))
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
            if so.disable_additional_properties:
                schema = _no_additional_properties(schema)
            found.append(json_constraint(schema, "structured_outputs.json", options))
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
