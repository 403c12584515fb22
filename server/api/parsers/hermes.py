"""Hermes tool calls (`--tool-call-parser hermes`): what Qwen2.5, Qwen3, Hermes 2/3 and SmolLM-style templates teach.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

One JSON object per block, any number of blocks; text before the first is content. Some models write the arguments
as a JSON string, or under "parameters": both are read.
"""

from __future__ import annotations

import json
import re

from server.api.parsers.base import BlockToolParser, loads

_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*(.*)\Z', re.S)


def json_call(obj) -> tuple[str, dict] | None:
    """(name, arguments) of a call written as {"name": ..., "arguments" or "parameters": {...}}, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], args


def cut_json_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as far as they came) of a {"name": ..., "arguments": ...} object cut off mid-way."""
    m = _NAME.match(body)
    if m is None:
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None
    args = _ARGS.search(body, m.end())
    return name, args.group(1) if args else ""


class HermesParser(BlockToolParser):
    name = "hermes"
    open, close = "<tool_call>", "</tool_call>"
    template_markers = ("<tool_call>",)

    def parse_block(self, body: str):
        try:
            call = json_call(loads(body.strip()))
        except ValueError:
            return None
        return [call] if call is not None else None

    def parse_cut(self, body: str):
        return cut_json_call(body)

    forced_format = True

    @classmethod
    def forced_lark(cls, calls, parallel, atom):
        alternatives = " | ".join(f"call_{i}" for i in range(len(calls)))
        rules = "".join(f"call_{i}: %json {schema}\n" for i, (_, schema) in enumerate(calls))
        repeat = ' ("\\n" tool_call)*' if parallel else ""
        return (f"start: tool_call{repeat}\n"
                f'tool_call: {atom(cls.open)} "\\n" call "\\n" {atom(cls.close)}\n'
                f"call: {alternatives}\n" + rules)
