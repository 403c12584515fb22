"""Qwen3-Coder's XML tool calls (`--tool-call-parser qwen3_coder`): what Qwen3-Coder, Qwen3.5, Nemotron-3-Nano and
StepFun-3.5 templates teach.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

One function per block as the templates write it (several are read), any number of blocks; text before the first is
content. A value is the text between its tags less one newline on each side, typed by the request's tool schema: a
string parameter keeps the text as written; integer, number, boolean, object, array and null parameters are read as
JSON (the templates write Python's True/False/None for booleans and null, which are read too), and stay the text
when that fails; a parameter the schema does not know is JSON if it reads as JSON, else the text. Lenient where the
models are known to slip: a missing `</parameter>` ends at the next `<parameter=` (or `</function>`), a missing
`</function>` at the end of the block; a block holding a Hermes JSON call instead is read as one. Anything else in a
block (text outside the tags) makes it content.

Calls are forced in Hermes's format (forced_format False): the server reads those with HermesParser.
"""

from __future__ import annotations

import json

from server.api.parsers.base import BlockToolParser, loads, partial_suffix
from server.api.parsers.hermes import json_call

FUNC, FUNC_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", dict: "object", list: "array",
               type(None): "null"}
_WORDS = {"true": True, "false": False, "null": None, "none": None}  # Python's spelling, as the templates render it


def _strict_loads(text: str):
    """json.loads without NaN/Infinity (not JSON for a client), or ValueError."""
    def no_constant(name):
        raise ValueError(name)

    try:
        return json.loads(text, parse_constant=no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    return _JSON_TYPES.get(type(value), "string")


def schema_types(spec) -> set[str] | None:
    """The JSON types a parameter's schema admits, or None when it does not say."""
    if not isinstance(spec, dict):
        return None
    t = spec.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list) and all(isinstance(x, str) for x in t) and t:
        return set(t)
    if isinstance(spec.get("enum"), list) and spec["enum"]:
        return {_json_type(v) for v in spec["enum"]}
    if "const" in spec:
        return {_json_type(spec["const"])}
    found: set[str] = set()
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in spec.get(key) or ():
            sub_types = schema_types(sub)
            if sub_types is None:
                return None
            found |= sub_types
    return found or None


def typed_value(text: str, types: set[str] | None):
    """A parameter's text as the value its schema types say (see the module's docstring)."""
    if types is not None and types <= {"string"}:
        return text
    try:
        value = _strict_loads(text)
    except ValueError:
        word = text.strip().lower()
        if types is None or word not in _WORDS or _json_type(_WORDS[word]) not in types:
            return text
        return _WORDS[word]
    if types is None:
        return value
    kind = _json_type(value)
    if "string" in types and kind == "string":
        return text  # a JSON string for a string parameter: the text is the value, quotes and all
    if kind in types or (kind == "integer" and "number" in types) or "string" not in types:
        return value
    return text


def _trim(value: str) -> str:
    """The value between a parameter's tags: one newline off each side (the templates put them there)."""
    value = value.removeprefix("\n")
    value = value.removesuffix("\n")
    return value


def _name(text: str) -> str | None:
    name = text.strip()
    return name if name and not any(c in name for c in "\n<>") else None


class Qwen3CoderParser(BlockToolParser):
    name = "qwen3_coder"
    open, close = "<tool_call>", "</tool_call>"
    template_markers = ("<tool_call>", "<function=", "<parameter=")
    forced_format = False

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._schemas: dict[str, dict] | None = None

    # ---- typing by the request's tools ----
    def _properties(self, function: str) -> dict | None:
        if self._schemas is None:
            self._schemas = {}
            for tool in self.tools:
                fn = tool.get("function", tool) if isinstance(tool, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                    params = fn.get("parameters")
                    props = params.get("properties") if isinstance(params, dict) else None
                    self._schemas[fn["name"]] = props if isinstance(props, dict) else {}
        return self._schemas.get(function)

    def _typed(self, function: str, raw: dict[str, str]) -> dict:
        props = self._properties(function) or {}
        return {k: typed_value(v, schema_types(props[k]) if k in props else None) for k, v in raw.items()}

    # ---- reading ----
    @staticmethod
    def _params(inner: str, cut: bool) -> dict[str, str] | None:
        """{name: text} of a function's parameters; None when something else is in it (unless `cut`: then what came
        is read as far as it goes)."""
        out: dict[str, str] = {}
        pos = 0
        while True:
            start = inner.find(PARAM, pos)
            if start < 0:
                break
            if inner[pos:start].strip() and not cut:
                return None
            end = inner.find(">", start)
            pname = _name(inner[start + len(PARAM) : end]) if end >= 0 else None
            if pname is None:
                return None if not cut else out
            close = inner.find(PARAM_END, end)
            following = inner.find(PARAM, end)
            if close >= 0 and (following < 0 or close < following):
                out[pname] = _trim(inner[end + 1 : close])
                pos = close + len(PARAM_END)
            elif following >= 0:  # no </parameter>: the value runs to the next parameter
                out[pname] = _trim(inner[end + 1 : following])
                pos = following
            elif not cut:  # no </parameter> and the last one: it runs to </function>
                out[pname] = _trim(inner[end + 1 :])
                pos = len(inner)
            else:  # cut inside the value: as far as it came, less what may begin its closing tag
                value = inner[end + 1 :]
                value = value[: len(value) - partial_suffix(value, "\n" + PARAM_END)]
                out[pname] = value.removeprefix("\n")
                pos = len(inner)
        if inner[pos:].strip() and not cut:
            return None
        return out

    def _functions(self, body: str, cut: bool) -> list[tuple[str, object]] | None:
        calls: list[tuple[str, object]] = []
        pos = 0
        while True:
            start = body.find(FUNC, pos)
            if start < 0:
                break
            if body[pos:start].strip():
                return None
            end = body.find(">", start)
            fname = _name(body[start + len(FUNC) : end]) if end >= 0 else None
            if fname is None:
                return None if not cut else calls
            close = body.find(FUNC_END, end)
            inner = body[end + 1 : close if close >= 0 else len(body)]
            params = self._params(inner, cut and close < 0)
            if params is None:
                return None
            calls.append((fname, self._typed(fname, params)))
            if close < 0:
                pos = len(body)
                break
            pos = close + len(FUNC_END)
        if body[pos:].strip() and not cut:  # (cut: what follows the last whole function is dropped)
            return None
        return calls or None

    def parse_block(self, body: str):
        if FUNC not in body:  # a Hermes JSON call in the same tags (what a forced call looks like)
            try:
                call = json_call(loads(body.strip()))
            except ValueError:
                return None
            return [call] if call is not None else None
        return self._functions(body, cut=False)

    def parse_cut(self, body: str):
        calls = self._functions(body, cut=True)
        return calls[0] if calls else None

    def finish(self, cut: bool = False) -> tuple[str, list[dict]]:
        # every call of a block max_tokens cut off (the base class hands out only the first)
        if cut and self.in_block:
            calls = self._functions(self.pending[len(self.open) :], cut=True)
            if calls:
                self.pending, self.in_block = "", False
                return "", self._emit(calls)
        return super().finish(cut)
