"""Pythonic tool calls (`--tool-call-parser pythonic`): what Llama 3.2's and Llama 4's pythonic templates teach (and
LFM2's templates, between <|tool_call_start|> and <|tool_call_end|>).

    [get_weather(city="Paris"), get_time(tz="UTC")]

A Python list of calls with keyword arguments whose values are literals (True/False/None are JSON's
true/false/null), maybe wrapped in `<|python_start|>` ... `<|python_end|>`. Only an answer that starts, after
whitespace, with `[` (or the wrapper) is read for calls, and only when the whole list is calls; anything else is
content. The list is read with `ast` and each value with `ast.literal_eval`: nothing is ever evaluated. No grammar
of its own: a forced call is generated in Hermes's format.
"""

from __future__ import annotations

import ast
import json
import re

from server.api.parsers.base import LeadingCallsParser

WRAPPERS = {"<|python_start|>": "<|python_end|>", "<|tool_call_start|>": "<|tool_call_end|>"}
WS = " \t\r\n"
_IDENT_START = re.compile(r"[A-Za-z_]")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OUTSIDE = re.compile(r"""[\[\](){}'"]""")
_OUTSIDE_COMMAS = re.compile(r"""[\[\](){}'",]""")
_INSIDE = {q: re.compile(r"\\|" + re.escape(q)) for q in ("'", '"', "'''", '"""')}
_CUT_CALL = re.compile(r"[\s,]*([A-Za-z_][A-Za-z0-9_]*)\s*\(")
_CUT_STRING = re.compile(r"""\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(['"])(.*)\Z""", re.DOTALL)


class PyScan:
    """Where a bracketed Python expression that begins at `start` ends, read a piece at a time (strings, triple
    quoted too, and their escapes skipped). `run(text)` gives the end (just past the closing bracket) or -1.
    With `commas`, the places of the commas at depth `commas` (1: the top level inside the brackets) are kept, and
    of the brackets closing back to that depth."""

    __slots__ = ("commas", "depth", "marks", "pos", "quote", "start")

    def __init__(self, start: int, commas: int = 0) -> None:
        self.start = self.pos = start
        self.depth = 0
        self.quote = ""
        self.commas = commas
        self.marks: list[tuple[str, int]] = []

    def run(self, text: str) -> int:
        pos, n = self.pos, len(text)
        outside = _OUTSIDE_COMMAS if self.commas else _OUTSIDE
        while pos < n:
            if self.quote:
                m = _INSIDE[self.quote].search(text, pos)
                if m is None:  # (a closing triple quote may have come in part)
                    pos = max(pos, n - len(self.quote) + 1)
                    break
                if m.group() == "\\":
                    pos = m.end() + 1
                    continue
                self.quote, pos = "", m.end()
                continue
            m = outside.search(text, pos)
            if m is None:
                pos = n
                break
            c, at = m.group(), m.start()
            if c in "'\"":
                if text.startswith(c * 3, at):
                    self.quote, pos = c * 3, at + 3
                elif n - at < 3 and text[at:] == c * (n - at):
                    break  # an opening quote or two at the end: a triple one may be coming
                else:
                    self.quote, pos = c, at + 1
                continue
            pos = at + 1
            if c == ",":
                if self.depth == self.commas:
                    self.marks.append((",", at))
            elif c in "[({":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == self.commas and self.commas:
                    self.marks.append((")", pos))
                if self.depth <= 0:
                    self.pos = pos
                    return pos
        self.pos = pos
        return -1


def _value(node):
    value = ast.literal_eval(node)
    json.dumps(value, allow_nan=False)  # JSON's values only (no sets, bytes, complex numbers)
    return value


def _kwargs(call: ast.Call) -> dict | None:
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
        return None
    args = {}
    for kw in call.keywords:
        if kw.arg is None:
            return None
        try:
            args[kw.arg] = _value(kw.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    return args


def parse_calls(text: str) -> list[tuple[str, dict]] | None:
    """[(name, arguments)] of a list of calls, or None when it is anything else."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    out = []
    for node in tree.body.elts:
        args = _kwargs(node)
        if args is None:
            return None
        out.append((node.func.id, args))
    return out


def _one_call_args(text: str) -> dict | None:
    """The keyword arguments `text` (what is between the parentheses of a call) as a dict, or None."""
    try:
        tree = ast.parse(f"f({text})", mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    return _kwargs(tree.body)


def cut_arguments(text: str) -> str:
    """The JSON text, as far as it came, of the arguments of a call cut off after `text` (what follows its "(")."""
    scan = PyScan(0, commas=1)
    scan.depth = 1  # inside the call's parentheses
    scan.run(text)
    commas = [at for kind, at in scan.marks if kind == ","]
    last = commas[-1] if commas else -1
    args = _one_call_args(text[:last]) if last >= 0 else {}
    if args is None:
        args = {}
    rest = text[last + 1 :]
    partial = ""
    if rest.strip():
        whole = _one_call_args(rest)
        if whole:
            args.update(whole)
        elif (m := _CUT_STRING.match(rest)) and not rest[m.start(2) :].startswith(m.group(2) * 3):
            raw = m.group(3)
            for tail in (raw, raw[:-1]):
                try:
                    value = ast.literal_eval(m.group(2) + tail + m.group(2))
                    break
                except (ValueError, SyntaxError):
                    continue
            else:
                value = raw
            if isinstance(value, str):
                partial = json.dumps(m.group(1)) + ": " + json.dumps(value, ensure_ascii=False)[:-1]
    head = json.dumps(args, ensure_ascii=False)[:-1]
    return head + (", " if args else "") + partial if partial else head


class PythonicParser(LeadingCallsParser):
    name = "pythonic"
    # the instruction of the pythonic Llama 3.2 / Llama 4 templates
    template_markers = ("[func_name1(",)
    forced_format = False

    START, LIST, AFTER, CONTENT = "start", "list", "after", "content"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self.mode = self.START
        self.buf = ""
        self.close = ""  # the wrapper's closing marker, when the list was wrapped
        self.scan: PyScan | None = None

    def _start(self) -> str | None:
        """Whether the answer is a list of calls: None to wait, "" when it may be (the scan begins), else content."""
        b, n = self.buf, len(self.buf)
        i = len(b) - len(b.lstrip())
        if i == n:
            return None
        for opener, closer in WRAPPERS.items():
            if b.startswith(opener, i):
                i += len(opener)
                while i < n and b[i] in WS:
                    i += 1
                self.close = closer
                break
            if n - i < len(opener) and opener.startswith(b[i:]):
                return None
        if i == n:
            return None
        if b[i] != "[":
            return self._content()
        # "[" name "(": anything else is content from here (a list, a link, a citation)
        j = i + 1
        while j < n and b[j] in WS:
            j += 1
        if j == n:
            return None
        if not _IDENT_START.match(b, j):
            return self._content()
        j = _IDENT.match(b, j).end()
        while j < n and b[j] in WS:
            j += 1
        if j == n:
            return None
        if b[j] != "(":
            return self._content()
        self.mode, self.scan = self.LIST, PyScan(i)
        return ""

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        if self.mode == self.CONTENT:
            return self._flush(), []
        calls: list[dict] = []
        if self.mode == self.START:
            step = self._start()
            if step is None or self.mode == self.CONTENT:
                return step or "", calls
        if self.mode == self.LIST:
            end = self.scan.run(self.buf)
            if end < 0:
                return "", calls
            parsed = parse_calls(self.buf[self.scan.start : end])
            if parsed is None:
                return self._content(), calls
            calls = [self.make_call(name, args) for name, args in parsed]
            self.buf, self.scan, self.mode = self.buf[end:], None, self.AFTER
        # AFTER: the wrapper's closing marker (if it was wrapped) is dropped; what follows is content
        if self.close:
            s = self.buf.lstrip()
            if not s or (len(s) < len(self.close) and self.close.startswith(s)):
                return "", calls
            if s.startswith(self.close):
                self.buf = s[len(self.close) :]
            self.close = ""
        return self._content(), calls

    def finish(self, cut: bool = False) -> tuple[str, list[dict]]:
        calls: list[dict] = []
        out = self.buf
        if self.mode == self.LIST and cut:
            calls = self._cut(out[self.scan.start :])
            if calls:
                out = ""
        if (self.calls or calls) and not out.strip():
            out = ""
        self.buf, self.mode, self.scan, self.close = "", self.CONTENT, None, ""
        return out, calls

    def _cut(self, text: str) -> list[dict]:
        """The calls of a list cut off by max_tokens: the whole ones, then the one cut, its arguments as far as they
        came (none when the list is not calls as far as it goes)."""
        scan = PyScan(0, commas=1)
        scan.run(text)
        ends = [at for kind, at in scan.marks if kind == ")"]
        whole: list[tuple[str, object]] = []
        if ends:
            whole = parse_calls(text[: ends[-1]] + "]") or []
            if not whole:
                return []
        rest = text[ends[-1] :] if ends else text[1:]
        m = _CUT_CALL.match(rest)
        if m is not None:
            whole.append((m.group(1), cut_arguments(rest[m.end() :])))
        elif rest.strip(WS + ","):
            return []
        return [self.make_call(name, args) for name, args in whole]
