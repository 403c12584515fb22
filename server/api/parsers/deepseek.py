"""DeepSeek's tool calls (`--tool-call-parser deepseek_v3`): DeepSeek-V3, R1 and their distills, and V3.1.

V3 and R1 (and the R1 distills' templates) write each call's type, its name and its arguments in a fenced JSON block:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 (vLLM's deepseek_v31) drops the type and the fence:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>...

Both are read, call by call (a block may even mix them). The markers are special tokens (needs_special_tokens). Text
before the block is content; the block is handed out whole at `<｜tool▁calls▁end｜>`. Arguments must be a JSON object
(or a JSON string holding one, as the R1 templates render string arguments). A forced call may take either form
(the grammar leaves the choice to the model: a V3.1 model writes the name first, an R1 model the type).
"""

from __future__ import annotations

import json
import re

from server.api.parsers.base import BlockToolParser, loads, partial_suffix

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# V3's part after the separator: the name, then the arguments fenced (```json ... ```)
_FENCED = re.compile(r"[ \t]*([^\n`<>]+?)[ \t]*\n```(?:json)?[ \t]*\n?(.*?)\n?```\s*\Z", re.DOTALL)
_FENCE_OPEN = "```json\n"


def _args(text: str) -> dict | None:
    try:
        args = loads(text.strip())
        if isinstance(args, str):
            args = loads(args)
    except ValueError:
        return None
    return args if isinstance(args, dict) else None


def _name(text: str) -> str | None:
    name = text.strip()
    return name if name and not any(c in name for c in "\n<>`") else None


def parse_call(head: str, tail: str) -> tuple[str, dict] | None:
    """(name, arguments) of one call: `head` the text before its separator, `tail` after it."""
    if head.strip() == "function" and (m := _FENCED.match(tail)):  # V3 / R1
        args = _args(m.group(2))
        return (m.group(1), args) if args is not None and _name(m.group(1)) else None
    name, args = _name(head), _args(tail)  # V3.1
    return (name, args) if name is not None and args is not None else None


def cut_call(head: str, tail: str | None) -> tuple[str, str] | None:
    """(name, arguments as far as they came) of a call max_tokens cut off, or None when its name is not whole."""
    if tail is None:
        return None  # no separator yet: neither form's name is known whole
    tail = tail[: len(tail) - partial_suffix(tail, CALL_END)]
    if head.strip() == "function" and not tail.lstrip().startswith("{"):  # V3 / R1: the name ends at its newline
        name, newline, rest = tail.partition("\n")
        if not newline or _name(name) is None:
            return None
        for fence in (_FENCE_OPEN, "```\n"):
            if rest.startswith(fence):
                rest = rest[len(fence) :]
                break
        else:
            if _FENCE_OPEN.startswith(rest):
                rest = ""  # still inside the fence's opening
        if rest.rstrip().endswith("```"):
            rest = rest.rstrip()[:-3]
        rest = rest[: len(rest) - partial_suffix(rest, "\n```")]
        return name.strip(), rest.strip()
    name = _name(head)
    return (name, tail.strip()) if name is not None else None


def _split(body: str) -> tuple[list[tuple[str, str | None, bool]], str]:
    """The calls of a block body, [(head, tail or None before a separator, closed)], and the text after the last
    closed one when it is not a call."""
    calls, pos = [], 0
    while True:
        start = body.find(CALL_BEGIN, pos)
        if start < 0:
            return calls, body[pos:]
        if body[pos:start].strip():
            return calls, body[pos:]
        end = body.find(CALL_END, start)
        inner = body[start + len(CALL_BEGIN) : end if end >= 0 else len(body)]
        head, sep, tail = inner.partition(SEP)
        calls.append((head, tail if sep else None, end >= 0))
        if end < 0:
            return calls, ""
        pos = end + len(CALL_END)


class DeepSeekV3Parser(BlockToolParser):
    name = "deepseek_v3"
    open, close = CALLS_BEGIN, CALLS_END
    needs_special_tokens = True
    template_markers = (CALLS_BEGIN, SEP)
    forced_format = True

    def parse_block(self, body: str):
        parts, rest = _split(body)
        if not parts or rest.strip():
            return None
        calls = []
        for head, tail, closed in parts:
            call = parse_call(head, tail) if closed and tail is not None else None
            if call is None:
                return None
            calls.append(call)
        return calls

    def _cut(self, body: str) -> list[tuple[str, object]]:
        """The calls of a block max_tokens cut off: the whole ones, then the last as far as it came."""
        parts, rest = _split(body)
        rest = rest.strip()
        if not parts or rest and not (CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest)):
            return []
        calls: list[tuple[str, object]] = []
        for head, tail, closed in parts:
            call = (parse_call(head, tail) if tail is not None else None) if closed else cut_call(head, tail)
            if call is None:
                return calls if not closed else []
            calls.append(call)
        return calls

    def parse_cut(self, body: str):
        calls = self._cut(body)
        return calls[0] if calls else None

    def finish(self, cut: bool = False) -> tuple[str, list[dict]]:
        # every call of a block max_tokens cut off (the base class hands out only the first)
        if cut and self.in_block:
            calls = self._cut(self.pending[len(self.open) :])
            if calls:
                self.pending, self.in_block = "", False
                return "", self._emit(calls)
        return super().finish(cut)

    @classmethod
    def forced_lark(cls, calls, parallel, atom):
        """`<｜tool▁calls▁begin｜>` call(s) `<｜tool▁calls▁end｜>`, each call in V3's form or V3.1's."""
        lines = []
        for i, (name, schema) in enumerate(calls):
            lines.append(f"call_{i}: {json.dumps('function')} {atom(SEP)} {json.dumps(name + chr(10) + _FENCE_OPEN)} "
                         f'args_{i} "\\n```" | {json.dumps(name)} {atom(SEP)} args_{i}\n')
            lines.append(f"args_{i}: %json {json.dumps(arguments_schema(schema))}\n")
        repeat = ' ("\\n"? tool_call)*' if parallel else ""
        return (f"start: {atom(CALLS_BEGIN)} tool_call{repeat} {atom(CALLS_END)}\n"
                f"tool_call: {atom(CALL_BEGIN)} call {atom(CALL_END)}\n"
                f"call: {' | '.join(f'call_{i}' for i in range(len(calls)))}\n" + "".join(lines))


def arguments_schema(schema: str) -> dict:
    """The "arguments" part of a forced call's {"name", "arguments"} schema, as its own schema (keeping the options
    and definitions its root carried)."""
    whole = json.loads(schema)
    args = dict(whole.get("properties", {}).get("arguments", {}))
    for key in ("x-guidance", "$defs", "definitions"):
        if key in whole and key not in args:
            args[key] = whole[key]
    return args
