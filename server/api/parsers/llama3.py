"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (`--tool-call-parser llama3_json`): what Meta's templates teach.

    {"name": "get_weather", "parameters": {"city": "Paris"}}

The answer is the call (the templates ask for "parameters"; "arguments" is read too), maybe after `<|python_tag|>`
(a special token), maybe several calls separated by `; ` or newlines. Only an answer that starts, after whitespace,
with `{` or `<|python_tag|>` is read for calls; any other answer is content. Each call goes out as soon as its object
closes; an object that is not a call turns the rest of the answer into content, as text (calls already handed out
stay), and so does text after a call that is not another call.
"""

from __future__ import annotations

import json
import re

from server.api.parsers.base import LeadingCallsParser, loads
from server.api.parsers.hermes import cut_json_call, json_call

TAG = "<|python_tag|>"
SEPARATORS = " \t\r\n;"
_OUTSIDE = re.compile(r'[\[\]{}"]')  # what changes the state of a JSON scan outside strings
_INSIDE = re.compile(r'["\\]')  # ... and inside one


class JsonScan:
    """Where a JSON object (or array) that begins at `start` ends, read a piece at a time: `run(text)` scans what
    was not scanned yet and gives the end (just past the closing bracket), or -1 while it is still open. Brackets
    are counted whatever their kind (a mismatch is for json.loads to find)."""

    __slots__ = ("depth", "in_str", "pos", "start")

    def __init__(self, start: int) -> None:
        self.start = self.pos = start
        self.depth = 0
        self.in_str = False

    def run(self, text: str) -> int:
        pos, n = self.pos, len(text)
        while pos < n:
            if self.in_str:
                m = _INSIDE.search(text, pos)
                if m is None:
                    pos = n
                    break
                if m.group() == "\\":
                    pos = m.end() + 1  # the escaped character (maybe still to come) is skipped
                    continue
                self.in_str, pos = False, m.end()
                continue
            m = _OUTSIDE.search(text, pos)
            if m is None:
                pos = n
                break
            c, pos = m.group(), m.end()
            if c == '"':
                self.in_str = True
            elif c in "[{":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    self.pos = pos
                    return pos
        self.pos = pos
        return -1


def read_call(text: str) -> tuple[str, dict] | None:
    """(name, arguments) of one call object's text, or None."""
    try:
        return json_call(loads(text))
    except ValueError:
        return None


def json_schema_renamed(schema_text: str, key: str) -> str:
    """A call's schema ({"name", "arguments"} object, JSON text) with "arguments" named `key`, order kept."""
    schema = json.loads(schema_text)
    props = schema.get("properties") if isinstance(schema, dict) else None
    if isinstance(props, dict) and "arguments" in props:
        schema["properties"] = {(key if k == "arguments" else k): v for k, v in props.items()}
        if isinstance(schema.get("required"), list):
            schema["required"] = [key if r == "arguments" else r for r in schema["required"]]
    return json.dumps(schema)


class Llama3JsonParser(LeadingCallsParser):
    name = "llama3_json"
    needs_special_tokens = True  # <|python_tag|>
    # the instruction the Llama 3.1/3.2/3.3 templates give when tools are passed
    template_markers = ('"parameters": dictionary of argument name and its value',)
    forced_format = True

    START, CALLS, CONTENT = "start", "calls", "content"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self.mode = self.START
        self.buf = ""  # text not handed out yet
        self.pos = 0  # in CALLS between objects: where the separators scan goes on
        self.scan: JsonScan | None = None  # the object being read

    @classmethod
    def forced_lark(cls, calls, parallel, atom):
        alternatives = " | ".join(f"call_{i}" for i in range(len(calls)))
        rules = "".join(f"call_{i}: %json {json_schema_renamed(schema, 'parameters')}\n"
                        for i, (_, schema) in enumerate(calls))
        repeat = ' ("; " call)*' if parallel else ""
        return f"start: call{repeat}\ncall: {alternatives}\n" + rules

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        if self.mode == self.CONTENT:
            return self._flush(), []
        if self.mode == self.START:
            s = self.buf.lstrip()
            if not s or (len(s) < len(TAG) and TAG.startswith(s)):
                return "", []  # not known yet
            if s.startswith(TAG):
                self.pos = len(self.buf) - len(s) + len(TAG)
            elif s[0] == "{":
                self.pos = len(self.buf) - len(s)
            else:
                return self._content(), []
            self.mode = self.CALLS
        calls: list[dict] = []
        while True:
            buf = self.buf
            if self.scan is None:  # between calls: separators, then an object
                i, n = self.pos, len(buf)
                while i < n and buf[i] in SEPARATORS:
                    i += 1
                self.pos = i
                if i == n:
                    return "", calls
                if buf[i] != "{":
                    return self._content(), calls
                self.scan = JsonScan(i)
            end = self.scan.run(buf)
            if end < 0:
                return "", calls
            call = read_call(buf[self.scan.start : end])
            if call is None:
                return self._content(), calls
            calls.append(self.make_call(*call))
            self.buf, self.pos, self.scan = buf[end:], 0, None

    def finish(self, cut: bool = False) -> tuple[str, list[dict]]:
        calls: list[dict] = []
        out = self.buf
        if self.mode == self.CALLS:
            if self.scan is not None:
                partial = cut_json_call(out[self.scan.start :]) if cut else None
                if partial is not None:
                    calls, out = [self.make_call(*partial)], ""
            elif self.calls and not out.strip(SEPARATORS):
                out = ""
        elif self.calls and not out.strip():
            out = ""
        self.buf, self.mode, self.scan = "", self.CONTENT, None
        return out, calls
