"""Mistral tool calls (`--tool-call-parser mistral`). `[TOOL_CALLS]` (and `[ARGS]`, `[CALL_ID]` in v11+ tokenizers)
are control tokens, kept in the text for this parser. Both shapes are read:

    v11+ (Mistral Small 3.1/3.2, Devstral, Magistral, Ministral 3):
        [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}
        [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}      (Mistral Small 3.2's template)
        [TOOL_CALLS]get_weather{"city": "Paris"}                              ([ARGS] dropped)
    pre-v11 (Mistral 7B v0.3, Mistral Nemo):
        [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

Text before `[TOOL_CALLS]` is content (the whitespace just before it is not). A call goes out as soon as its
arguments object closes (in a pre-v11 list, each element as it closes). Call ids are 9 letters and digits: Mistral's
templates refuse any other in the history. A forced call is generated in either shape, the model choosing which
after `[TOOL_CALLS]`: a v11 model writes the name, an older one the list.
"""

from __future__ import annotations

import json
import re

from server.api.parsers.base import ToolParser, held_back, loads, short_call_id
from server.api.parsers.hermes import cut_json_call
from server.api.parsers.llama3 import JsonScan, read_call

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
WS = " \t\r\n"
LIST_SEPARATORS = WS + ","
MAX_NAME = 256
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ID = re.compile(r"[A-Za-z0-9]*")

OUT, HEAD, ARGS_OBJECT, LIST, LIST_OBJECT, OBJECT = "out", "head", "args", "list", "list_object", "object"


def _waiting_for(text: str, pos: int, marker: str) -> bool:
    """The text from `pos` is a proper prefix of `marker` (the rest may still come)."""
    return len(text) - pos < len(marker) and marker.startswith(text[pos:])


class MistralParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True
    template_markers = (TOOL_CALLS,)
    forced_format = True

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self.mode = OUT
        # text not handed out; in a call it begins at [TOOL_CALLS] (or, in a pre-v11 list, after the last call)
        self.buf = ""
        self.ws_before = ""  # the whitespace before [TOOL_CALLS]: content again if the call does not parse
        self.pos = 0  # in LIST: where the scan for the next element goes on
        self.name: str | None = None  # v11: the call's name, once it is known to be whole
        self.scan: JsonScan | None = None
        self.listed = False  # in a pre-v11 list: a call of it went out

    def call_id(self) -> str:
        return short_call_id()

    @classmethod
    def forced_lark(cls, calls, parallel, atom):
        tc, args = atom(TOOL_CALLS), atom(ARGS)
        rules = []
        for i, (name, schema_text) in enumerate(calls):
            schema = json.loads(schema_text)
            arguments = dict(schema["properties"]["arguments"])
            for k, v in schema.items():  # e.g. x-guidance, $defs: they belong to the whole schema
                if k not in ("type", "properties", "required", "additionalProperties") and k not in arguments:
                    arguments[k] = v
            rules.append(f"v11_{i}: {tc} {json.dumps(name)} {args} args_{i}\n"
                         f"args_{i}: %json {json.dumps(arguments)}\n"
                         f"obj_{i}: %json {schema_text}\n")
        n = range(len(calls))
        more, listed = ("+", ' (", " obj)*') if parallel else ("", "")
        v11_calls = " | ".join(f"v11_{i}" for i in n)
        objs = " | ".join(f"obj_{i}" for i in n)
        return (f"start: v11 | legacy\n"
                f"v11: v11_call{more}\n"
                f"v11_call: {v11_calls}\n"
                f'legacy: {tc} "[" obj{listed} "]"\n'
                f"obj: {objs}\n" + "".join(rules))

    # ---- reading ----
    def _fail(self, at: int) -> str:
        """The call does not parse: its text up to `at` is content; reading goes on after it."""
        text = self.buf[:at]
        out = self.ws_before + (text.lstrip(LIST_SEPARATORS) if self.listed else text)
        self.buf, self.ws_before, self.mode, self.scan, self.name = self.buf[at:], "", OUT, None, None
        self.listed = False
        return out

    def _head(self) -> str | None:
        """After [TOOL_CALLS]: which shape, and the v11 name. None: wait for more; "" to go on; else content."""
        b, n = self.buf, len(self.buf)
        i = len(TOOL_CALLS)
        while i < n and b[i] in WS:
            i += 1
        if i == n:
            return None
        if b[i] == "[":
            self.mode, self.pos = LIST, i + 1
            return ""
        if b[i] == "{":
            self.mode, self.scan = OBJECT, JsonScan(i)
            return ""
        m = _NAME.match(b, i)
        if m is None or m.end() - i > MAX_NAME:
            return self._fail(i)
        j = m.end()
        if j == n:
            return None  # the name may go on
        self.name = m.group()
        if b.startswith(CALL_ID, j):
            j = _ID.match(b, j + len(CALL_ID)).end()
            if j == n:
                return None
        elif _waiting_for(b, j, CALL_ID):
            return None
        if b.startswith(ARGS, j):
            j += len(ARGS)
        elif _waiting_for(b, j, ARGS):
            return None
        while j < n and b[j] in WS:
            j += 1
        if j == n:
            return None
        if b[j] != "{":
            return self._fail(j)
        self.mode, self.scan = ARGS_OBJECT, JsonScan(j)
        return ""

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        out, calls = "", []
        while True:
            if self.mode == OUT:
                start = self.buf.find(TOOL_CALLS)
                if start < 0:
                    keep = held_back(self.buf, (TOOL_CALLS,))
                    out += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep :]
                    return out, calls
                before = self.buf[:start]
                out += before.rstrip()
                self.ws_before = before[len(before.rstrip()) :]
                self.buf, self.mode, self.name = self.buf[start:], HEAD, None
                continue
            if self.mode == HEAD:
                step = self._head()
                if step is None:
                    return out, calls
                out += step
                continue
            if self.mode == LIST:  # between the elements of a pre-v11 list
                b, i = self.buf, self.pos
                while i < len(b) and b[i] in LIST_SEPARATORS:
                    i += 1
                self.pos = i
                if i == len(b):
                    return out, calls
                if b[i] == "{":
                    self.mode, self.scan = LIST_OBJECT, JsonScan(i)
                elif self.listed:  # after a call of the list: what follows its separators is no call
                    self.buf = b[i + 1 :] if b[i] == "]" else b[i:]  # (a closing bracket is dropped)
                    self.mode, self.listed = OUT, False
                else:  # nothing parsed yet: the block is content ("[TOOL_CALLS][]" too)
                    out += self._fail(i + 1 if b[i] == "]" else i)
                continue
            # ARGS_OBJECT, LIST_OBJECT, OBJECT: an object being read
            end = self.scan.run(self.buf)
            if end < 0:
                return out, calls
            body = self.buf[self.scan.start : end]
            if self.mode == ARGS_OBJECT:
                try:
                    args = loads(body)
                except ValueError:
                    args = None
                call = (self.name, args) if isinstance(args, dict) else None
            else:
                call = read_call(body)
            if call is None:
                out += self._fail(end)
                continue
            calls.append(self.make_call(*call))
            self.buf, self.ws_before, self.scan = self.buf[end:], "", None
            self.listed = self.mode == LIST_OBJECT
            self.mode, self.pos = (LIST, 0) if self.listed else (OUT, 0)

    def finish(self, cut: bool = False) -> tuple[str, list[dict]]:
        calls: list[dict] = []
        out = self.buf
        if self.mode != OUT:
            partial = None
            if cut:
                if self.mode == HEAD and self.name is not None:
                    partial = (self.name, "")
                elif self.mode == ARGS_OBJECT:
                    partial = (self.name, out[self.scan.start :])
                elif self.mode in (LIST_OBJECT, OBJECT):
                    partial = cut_json_call(out[self.scan.start :])
            if partial is not None:
                calls, out = [self.make_call(*partial)], ""
            elif self.mode == LIST and self.listed and not out.strip(LIST_SEPARATORS):
                out = ""  # a list whose calls all went out, left open
            else:
                out = self.ws_before + (out.lstrip(LIST_SEPARATORS) if self.listed else out)
        if (self.calls or calls) and not out.strip():
            out = ""
        self.buf, self.ws_before, self.mode, self.scan, self.name, self.listed = "", "", OUT, None, None, False
        return out, calls
