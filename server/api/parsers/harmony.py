"""gpt-oss's harmony format (`--tool-call-parser openai`, `--reasoning-parser gpt_oss`: one parser, both names).

The prompt ends in `<|start|>assistant`; the answer is one or more messages, each a header, `<|message|>`, a body and
an end marker, the next opened by `<|start|>assistant`:

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

(without the line breaks). The recipient (`to=functions.get_weather`) may also stand before the channel, right after
the role, as the chat template renders history (`<|start|>assistant to=functions.get_weather<|channel|>commentary
json<|message|>`). The last end marker is missing when it was the stop token (`<|return|>`, `<|call|>`), which the
engine strips. The markers are special tokens (needs_special_tokens): this parser reads text, not token ids.

Where each message goes:
  - analysis channel: reasoning.
  - final channel (and a message with no channel or an unknown one): content.
  - a `functions.NAME` recipient (whatever the channel): a tool call, when the request's calls are parsed
    (`parse_tools`), handed out at its end marker, or at the end of the answer, its arguments a JSON object (re-
    serialized). Arguments that are not a JSON object make the message content, as text; max_tokens cutting it
    (finish(cut=True)) gives the call as far as its arguments came, once its name is whole. When calls are not
    parsed (a server without --tool-call-parser, tool_choice "none"), the arguments' text is content, as with the
    other formats, where unparsed call markup is content.
  - commentary without a recipient (a preamble before calls): content.
  - any other recipient (a built-in tool: python, browser.*): reasoning (it is the model's work, not the answer).
Two messages that go to the same place (two analysis messages, a preamble and a final answer) are joined with "\n".
Text with no header at all (a model ignoring the format) is content once it is clearly not a header: more than
MAX_HEADER characters without `<|message|>`, or at the end of the answer without any `<|` markup in it.

Forced calls (forced_lark): an optional analysis message, then `<|channel|>commentary to=functions.NAME
<|constrain|>json<|message|>` and the arguments. One call only, whatever `parallel`: `<|call|>` ends the answer, so
harmony has no parallel calls. openai-harmony's own StreamableParser is not used: it reads token ids of its own o200k
vocabulary, which it downloads on first use (it cannot load offline).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import ClassVar

from server.api.parsers.base import Parsed, loads, partial_suffix

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
# what ends a body: an end marker (consumed), or the start of the next message's header (kept for it)
ENDS = (END, CALL, RETURN)
OPENS = (START, CHANNEL)
STOPS = ENDS + OPENS
MAX_HEADER = 512  # characters before `<|message|>` past which the text is not a header
_RECIPIENT = re.compile(r"to=([^\s<]+)(?=\s|<\||\Z)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
FUNCTIONS = "functions."


def compact(schema: dict) -> dict:
    """The arguments as gpt-oss writes them: JSON without spaces after `,` and `:` (as OpenAI's harmony examples)."""
    return {**schema, "x-guidance": {**schema.get("x-guidance", {}), "item_separator": ",", "key_separator": ":"}}

HEADER, BODY = "header", "body"
REASONING, CONTENT, TOOL = "reasoning", "content", "call"


class HarmonyParser:
    name: ClassVar[str] = "openai"
    needs_special_tokens: ClassVar[bool] = True
    template_markers: ClassVar[tuple[str, ...]] = ("<|channel|>", "<|message|>", "<|start|>")
    forced_format: ClassVar[bool] = True

    def __init__(self, parse_tools: bool = True, tools: list[dict] | None = None) -> None:
        self.parse_tools = parse_tools
        self.tools = tools or []
        self.calls: list[dict] = []  # every call handed out so far
        self.reasoning_text = ""  # all reasoning handed out (what the Responses API stores)
        self.content_text = ""  # all content handed out
        self.pending = ""  # text not yet read
        self.state = HEADER
        self.kind = CONTENT  # where the current message's body goes
        self.function = ""  # the current call's name
        self.body = ""  # the current call's arguments so far
        self.fresh = True  # the current message has handed out nothing yet
        self.raw = False  # a body that had no header: a stop marker at its very start does not end it

    @classmethod
    def start_state(cls, prompt_text: str) -> None:
        return None  # the channels say where each part of the answer goes

    # ---- reading ----
    def _open(self, header: str) -> None:
        recipient = _RECIPIENT.search(header)
        to = recipient.group(1) if recipient else ""
        channel = _CHANNEL.search(header)
        channel = channel.group(1) if channel else ""
        if to.startswith(FUNCTIONS) and len(to) > len(FUNCTIONS):
            self.kind, self.function = TOOL, to[len(FUNCTIONS) :]
        elif channel == "analysis" or to:
            self.kind = REASONING
        else:
            self.kind = CONTENT
        self.state, self.body, self.fresh = BODY, "", True

    def _hand(self, kind: str, text: str, out: Parsed) -> None:
        if not text:
            return
        if self.fresh:
            self.fresh = False
            if kind == REASONING and self.reasoning_text or kind == CONTENT and self.content_text:
                text = "\n" + text
        if kind == REASONING:
            out.reasoning += text
            self.reasoning_text += text
        else:
            out.content += text
            self.content_text += text

    def _body(self, text: str, out: Parsed) -> None:
        if self.kind == TOOL:
            self.body += text
        else:
            self._hand(self.kind, text, out)

    def _close(self, out: Parsed, cut: bool = False) -> None:
        """The end of a message (its end marker, or the end of the answer)."""
        if self.kind == TOOL:
            if not self.parse_tools:
                self._hand(CONTENT, self.body, out)
            elif cut:
                out.calls.append(self.make_call(self.function, self._arguments(self.body) or self.body.strip()))
            elif (args := self._arguments(self.body)) is not None:
                out.calls.append(self.make_call(self.function, args))
            else:
                self._hand(CONTENT, self.body, out)
        self.state, self.kind, self.body, self.function, self.fresh = HEADER, CONTENT, "", "", True

    @staticmethod
    def _arguments(text: str) -> str | None:
        try:
            args = loads(text)
        except ValueError:
            return None
        return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self.pending += text
        while self.pending:
            if self.state == HEADER:
                at = self.pending.find(MESSAGE, 0, MAX_HEADER + len(MESSAGE))
                if at >= 0:
                    self._open(self.pending[:at])
                    self.pending = self.pending[at + len(MESSAGE) :]
                    continue
                if len(self.pending) < MAX_HEADER + len(MESSAGE):
                    break  # not yet known
                # no header: content, up to the next message (past what opens this one)
                self.state, self.kind, self.body, self.fresh, self.raw = BODY, CONTENT, "", True, True
                continue
            # body: up to the first stop marker
            pending = self.pending
            at, stop = -1, ""
            if "<|" in pending:
                for s in STOPS:
                    i = pending.find(s, 1 if self.raw else 0)
                    if i >= 0 and (at < 0 or i < at):
                        at, stop = i, s
            if at >= 0:
                self._body(pending[:at], out)
                self.pending = pending[at + len(stop) :] if stop in ENDS else pending[at:]
                self.raw = False
                self._close(out)
                continue
            keep = 0
            if "<" in pending[-12:]:
                keep = max(partial_suffix(pending, s) for s in STOPS)
            self._body(pending[: len(pending) - keep], out)
            self.pending = pending[len(pending) - keep :]
            self.raw = False
            break
        return out

    def finish(self, cut: bool = False) -> Parsed:
        out = Parsed()
        if self.state == HEADER:
            header = self.pending
            recipient = _RECIPIENT.search(header)
            # (a name is known whole once something follows it)
            to = recipient.group(1) if recipient and recipient.end() < len(header) else ""
            if cut and self.parse_tools and to.startswith(FUNCTIONS) and len(to) > len(FUNCTIONS):
                out.calls.append(self.make_call(to[len(FUNCTIONS) :], ""))  # cut before its arguments
            elif header.strip() and "<|" not in header:
                self._hand(CONTENT, header, out)  # plain text, no harmony at all
            self.state, self.fresh = HEADER, True
        else:
            self._body(self.pending, out)
            self._close(out, cut)
        self.pending, self.raw = "", False
        return out

    def parse(self, text: str, cut: bool = False) -> Parsed:
        """A whole answer at once."""
        return self.feed(text).add(self.finish(cut))

    def make_call(self, name: str, arguments: str) -> dict:
        call = {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": name, "arguments": arguments}}
        self.calls.append(call)
        return call

    # ---- forced calls ----
    @classmethod
    def forced_lark(cls, calls: list[tuple[str, str]], parallel: bool, atom) -> str:
        """An optional analysis message, then one call: `<|channel|>commentary to=functions.NAME <|constrain|>json
        <|message|>` and its arguments (the answer then ends: <|call|> is a stop token, so `parallel` changes
        nothing). Each tool's arguments schema is the "arguments" part of the {"name", "arguments"} schema given."""
        from server.api.parsers.deepseek import arguments_schema

        rules = []
        for i, (name, schema) in enumerate(calls):
            rules.append(f"call_{i}: {atom(CHANNEL)} {json.dumps('commentary to=' + FUNCTIONS + name + ' ')} "
                         f"{atom(CONSTRAIN)} \"json\" {atom(MESSAGE)} args_{i}\n"
                         f"args_{i}: %json {json.dumps(compact(arguments_schema(schema)))}\n")
        return ("start: analysis? call\n"
                f'analysis: {atom(CHANNEL)} "analysis" {atom(MESSAGE)} THOUGHT {atom(END)} {atom(START)} "assistant"\n'
                "THOUGHT: /(?s:.*)/\n"
                f"call: {' | '.join(f'call_{i}' for i in range(len(calls)))}\n" + "".join(rules))
