"""What every output parser shares: reading a chat answer, as it streams, into reasoning, content and tool calls.

A model family writes its reasoning and its tool calls in its own markup (server/api/parsers/__init__.py lists the
families). Parsers read the answer's *text* (special tokens kept when the family's markers are special tokens:
`needs_special_tokens`), one piece at a time as the detokenizer hands it out, and hand back what can be sent now:

    parser.feed(text) -> Parsed(reasoning, content, calls)     (any number of times)
    parser.finish(cut) -> Parsed(...)                          (once, at the end; cut: max_tokens ended it)

Text that could still turn out to be markup (the first characters of `<tool_call>`, whitespace before a call) is
held back until it is known which it is. A gathered answer goes through the same calls in one piece, so a streamed
answer and a gathered one are the same, whatever the chunk boundaries (the tests split recorded outputs at every
character).

A tool call is OpenAI's dict: {"id", "type": "function", "function": {"name", "arguments": JSON text}}. A parser
hands out a call whole, once its markup is closed; streamed, it goes out as the name, then the arguments
(server/api/bodies.py). A call that max_tokens cut off comes back as the call with the arguments as far as they
came (`finish(cut=True)`), as OpenAI answers it, with finish_reason "length".
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(slots=True)
class Parsed:
    """What a piece of an answer turned into."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)

    def add(self, other: "Parsed") -> "Parsed":
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


def loads(text: str):
    """json.loads, or ValueError for anything it cannot read: not JSON, an integer longer than Python reads (4300
    digits), or nesting past Python's recursion limit (RecursionError)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`: what must be held back in case the
    next piece completes the tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def held_back(text: str, tags: tuple[str, ...]) -> int:
    """How much of the tail of `text` to hold back: what may begin any of `tags`, and the whitespace before it."""
    keep = max((partial_suffix(text, t) for t in tags), default=0)
    head = text[: len(text) - keep]
    return len(text) - len(head.rstrip())


class ToolParser:
    """Reads one family's tool calls out of the answer text that is not reasoning. Subclasses set `name` (vLLM's
    name for the format, what --tool-call-parser takes) and implement feed and finish."""

    name: ClassVar[str] = ""
    # the format's markers are special tokens that plain detokenizing drops: the request keeps them in its text
    needs_special_tokens: ClassVar[bool] = False
    # text whose presence in a chat template says the template teaches this format (--tool-call-parser auto);
    # every one of them must be there
    template_markers: ClassVar[tuple[str, ...]] = ()

    # a forced call (tool_choice "required" or a named function) is generated in this format by a grammar
    # (`forced_lark`); a format without one is forced in Hermes's, which the server then reads with HermesParser
    forced_format: ClassVar[bool] = False

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools or []  # the request's tools (OpenAI's dicts), for formats whose values are typed by them
        self.calls: list[dict] = []  # every call handed out so far

    @classmethod
    def forced_lark(cls, calls: list[tuple[str, str]], parallel: bool, atom) -> str:
        """A Lark grammar (llguidance's dialect) whose every sentence is one call (several when `parallel`) in this
        format, for the tools `calls`: [(name, the JSON schema of a {"name": <const>, "arguments": <parameters>}
        object, as JSON text)] -- use `%json {...}` on it, or on the "arguments" part of it. `atom(marker)` is the
        Lark atom of a marker text: a quoted string, or `<[id]>` when the marker is one special token of the
        model's tokenizer (special tokens are matched by id, never as text). Only for forced_format = True."""
        raise NotImplementedError

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content to send now, calls completed now)"""
        raise NotImplementedError

    def finish(self, cut: bool = False) -> tuple[str, list[dict]]:
        """What was held back: content, and a call left open when `cut` (max_tokens ended the answer) and its name
        was complete; an unclosed call otherwise is content, as text."""
        raise NotImplementedError

    # ---- helpers for subclasses ----
    def call_id(self) -> str:
        return "call_" + uuid.uuid4().hex[:24]

    def make_call(self, name: str, arguments) -> dict:
        """A call with `arguments` as JSON text (a dict is serialized; a string is kept as the model wrote it, for a
        cut call). Recorded in self.calls."""
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        call = {"id": self.call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
        self.calls.append(call)
        return call


class LeadingCallsParser(ToolParser):
    """A format whose calls open the answer (Llama 3 JSON, pythonic): the subclass scans `buf` in `mode` and, once it
    knows the rest is not calls, turns to CONTENT: then the held text goes out, but the whitespace after a call (the
    answer may end there)."""

    CONTENT: ClassVar[str] = "content"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self.buf = ""  # text not handed out yet
        self.scan = None  # the call being read

    def _content(self) -> str:
        """Everything from here on is content; what was held goes out as text."""
        self.mode, self.scan = self.CONTENT, None
        return self._flush()

    def _flush(self) -> str:
        keep = len(self.buf) - len(self.buf.rstrip()) if self.calls else 0
        out = self.buf[: len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep :]
        return out


ALNUM = string.ascii_letters + string.digits


def short_call_id(n: int = 9) -> str:
    """Mistral's call ids: 9 letters and digits (its templates refuse any other)."""
    return "".join(secrets.choice(ALNUM) for _ in range(n))


class BlockToolParser(ToolParser):
    """A format whose calls sit between an opening and a closing marker (`close` None: the block runs to the end of
    the answer), with content around them. Subclasses give the markers and `parse_block(body)`: the calls in one
    block's body, or None when it does not parse (then the block stays content, as text). Whitespace just before a
    block is not content; a block that does not parse keeps it."""

    open: ClassVar[str] = ""
    close: ClassVar[str | None] = None
    # no content once a call was made (the format puts calls last): what follows the last block is dropped if it
    # is only whitespace
    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self.pending = ""
        self.in_block = False
        self.ws_before = ""
        self.scanned = 0  # in a block: where the search for its closing marker goes on

    def parse_block(self, body: str) -> list[tuple[str, object]] | None:
        """[(name, arguments)] of the calls in a block body, or None if it does not parse."""
        raise NotImplementedError

    def parse_cut(self, body: str) -> tuple[str, str] | None:
        """(name, arguments as far as they came) of the first call of a block that max_tokens cut off, or None when
        not even its name is whole. Default: none."""
        return None

    def _emit(self, parsed: list[tuple[str, object]]) -> list[dict]:
        return [self.make_call(name, args) for name, args in parsed]

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        out, calls = "", []
        while True:
            if self.in_block:
                if self.close is None:
                    break  # the block runs to the end of the answer
                end = self.pending.find(self.close, self.scanned)
                if end < 0:  # (the next search starts where this one could not have missed the marker)
                    self.scanned = max(len(self.open), len(self.pending) - len(self.close) + 1)
                    break
                self.scanned = 0
                raw = self.pending[: end + len(self.close)]
                parsed = self.parse_block(self.pending[len(self.open) : end])
                self.pending = self.pending[end + len(self.close) :]
                self.in_block = False
                if parsed:
                    calls += self._emit(parsed)
                else:
                    out += self.ws_before + raw
                continue
            start = self.pending.find(self.open)
            if start >= 0:
                before = self.pending[:start]
                out += before.rstrip()
                self.ws_before = before[len(before.rstrip()) :]
                self.pending = self.pending[start:]
                self.in_block = True
                continue
            keep = held_back(self.pending, (self.open,))
            out += self.pending[: len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep :]
            break
        return out, calls

    def finish(self, cut: bool = False) -> tuple[str, list[dict]]:
        calls: list[dict] = []
        out = self.pending
        if self.in_block:
            body = self.pending[len(self.open) :]
            parsed = self.parse_block(body) if self.close is None else None
            if parsed:
                calls, out = self._emit(parsed), ""
            elif cut and (partial := self.parse_cut(body)) is not None:
                calls, out = self._emit([partial]), ""
            else:
                out = self.ws_before + out
        if (self.calls or calls) and not out.strip():
            out = ""
        self.pending, self.in_block = "", False
        return out, calls


class ReasoningParser:
    """Splits an answer into the reasoning before the content. Subclasses give the markers; `start_state` says,
    from the end of the rendered prompt, where the answer begins: inside the reasoning (the template opened it),
    maybe (the model opens it itself, or not), or after it (the template closed it: thinking switched off)."""

    name: ClassVar[str] = ""
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    needs_special_tokens: ClassVar[bool] = False
    # an answer in which the reasoning never ended: all reasoning when the template opened it (DeepSeek-R1), or
    # content when the model was to open it itself and did not
    REASONING, MAYBE, CONTENT = "reasoning", "maybe", "content"

    def __init__(self, state: str = MAYBE) -> None:
        self.state = state
        self.pending = ""
        self.lead = True  # at the start of a part: leading newlines are dropped

    @classmethod
    def start_state(cls, prompt_text: str) -> str:
        """Where an answer to this rendered prompt begins."""
        tail = prompt_text[-200:]
        opened, closed = tail.rfind(cls.start), tail.rfind(cls.end)
        if opened >= 0 and closed < opened:
            return cls.REASONING
        if closed >= 0 and closed > opened and not tail[closed + len(cls.end) :].strip():
            return cls.CONTENT
        return cls.MAYBE

    @property
    def ended(self) -> bool:
        return self.state == self.CONTENT

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) to send now."""
        self.pending += text
        reasoning = content = ""
        while self.pending:
            if self.state == self.MAYBE:
                stripped = self.pending.lstrip()
                if not stripped or (self.start.startswith(stripped) and len(stripped) < len(self.start)):
                    break  # not yet known whether it opens
                if stripped.startswith(self.start):
                    self.pending = stripped[len(self.start) :]
                    self.state, self.lead = self.REASONING, True
                else:
                    self.state, self.lead = self.CONTENT, True
                continue
            if self.state == self.REASONING:
                if self.lead:
                    self.pending = self.pending.lstrip("\n")
                    if not self.pending:
                        break
                    self.lead = False
                end = self.pending.find(self.end)
                if end >= 0:
                    reasoning += self.pending[:end].rstrip()
                    self.pending = self.pending[end + len(self.end) :]
                    self.state, self.lead = self.CONTENT, True
                    continue
                keep = held_back(self.pending, (self.end,))
                reasoning += self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep :]
                break
            # content
            if self.lead:
                self.pending = self.pending.lstrip()
                if not self.pending:
                    break
                self.lead = False
            content += self.pending
            self.pending = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        out, self.pending = self.pending, ""
        if self.state == self.REASONING:
            return out.rstrip() if not self.lead else out.strip("\n"), ""
        return "", out if not self.lead else out.lstrip()


class OutputParser:
    """One answer's parser: its reasoning parser (if the server has one), then its tool parser (if the request's
    calls are parsed) on what is not reasoning."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning, self.tools = reasoning, tools
        self.reasoning_text = ""  # all reasoning handed out (what the Responses API stores)

    @property
    def calls(self) -> list[dict]:
        return self.tools.calls if self.tools is not None else []

    def _content(self, text: str, out: Parsed) -> None:
        if self.tools is None:
            out.content += text
        elif text:
            content, calls = self.tools.feed(text)
            out.content += content
            out.calls += calls

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        if self.reasoning is not None:
            out.reasoning, text = self.reasoning.feed(text)
        self._content(text, out)
        self.reasoning_text += out.reasoning
        return out

    def finish(self, cut: bool = False) -> Parsed:
        out = Parsed()
        text = ""
        if self.reasoning is not None:
            out.reasoning, text = self.reasoning.finish()
        self._content(text, out)
        if self.tools is not None:
            content, calls = self.tools.finish(cut)
            out.content += content
            out.calls += calls
        self.reasoning_text += out.reasoning
        return out

    def parse(self, text: str, cut: bool = False) -> Parsed:
        """A whole answer at once."""
        return self.feed(text).add(self.finish(cut))
