"""Generic tool calls, for models whose chat template cannot describe tools (the default SmolLM2 among them), as
llama.cpp serves them: a system message lists the tools and the answer's format, and a grammar holds the model to it.
The answer is one JSON object:

    {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}      a call
    {"tool_calls": [{"name": ..., "arguments": ...}, ...]}                     several (parallel_tool_calls)
    {"response": "It is sunny in Paris."}                                       an answer in words

With tool_choice "auto" either is allowed; "required" or a named function allow only calls. A streamed "response"
goes out as its text, decoded from JSON as it comes. Earlier calls in the conversation are rendered back in the same
form, and tool results as user messages holding {"tool_response": {"name", "content"}} (a template without tool
support may refuse a "tool" role).
"""

from __future__ import annotations

import json
import re

from server.api.parsers.base import ToolParser, loads
from server.api.parsers.hermes import cut_json_call, json_call

_HEAD = re.compile(r'\s*\{\s*"(response|tool_calls?)"\s*:\s*')
_PARTIAL_ESCAPE = re.compile(r'\\(u[0-9a-fA-F]{0,3})?\Z|\\u[dD][89abAB][0-9a-fA-F]{2}\Z')


def instructions(tools: list[dict], parallel: bool, required: bool) -> str:
    """The system message that describes the tools and the answer's format."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    text = (f"You are a function calling AI model. You have access to these functions:\n{listed}\n\n"
            'For each request, answer with a JSON object: {"tool_call": {"name": <function name>, "arguments": '
            "<arguments>}} to call a function")
    if parallel:
        text += ' (or {"tool_calls": [<call>, ...]} for several at once)'
    if required:
        return text + "."
    return text + ', or {"response": <text>} to answer the user when no function is needed or with the results.'


def render_call(calls: list[dict]) -> str:
    """An assistant's earlier calls (arguments as objects) as the generic answer that made them."""
    objs = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
    return json.dumps({"tool_call": objs[0]} if len(objs) == 1 else {"tool_calls": objs}, ensure_ascii=False)


def render_result(name: str | None, content: str) -> str:
    return json.dumps({"tool_response": {"name": name, "content": content}}, ensure_ascii=False)


def schema(calls: list[tuple[str, str]], parallel: bool, required: bool) -> dict:
    """The JSON schema of a generic answer; `calls`: (name, the schema of {"name", "arguments"}) per tool."""
    alternatives = [{k: v for k, v in json.loads(s).items() if k != "x-guidance"} for _, s in calls]
    one = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    forms = [{"type": "object", "properties": {"tool_call": one}, "required": ["tool_call"],
              "additionalProperties": False}]
    if parallel:
        forms.append({"type": "object", "properties": {"tool_calls": {"type": "array", "items": one, "minItems": 1}},
                      "required": ["tool_calls"], "additionalProperties": False})
    if not required:
        forms.append({"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                      "additionalProperties": False})
    return forms[0] if len(forms) == 1 else {"anyOf": forms}


class GenericToolParser(ToolParser):
    name = "generic"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self.text = ""
        self.kind: str | None = None  # "response", "tool_call", "tool_calls", or "text" (not the format)
        self.body_at = 0  # where the value begins in self.text
        self.scanned = 0  # of the response string: raw characters looked at
        self.escaped = False
        self.closed = False
        self.sent = 0  # decoded characters handed out

    def _head(self) -> None:
        m = _HEAD.match(self.text)
        if m is not None:
            self.kind, self.body_at = m.group(1), m.end()
            if self.kind == "response":
                if self.body_at < len(self.text) and self.text[self.body_at] != '"':
                    self.kind = "text"
                elif self.body_at < len(self.text):
                    self.body_at += 1
                    self.scanned = self.body_at
                else:
                    self.kind = None  # (the opening quote has not come yet)
        elif self.text.strip() and not re.match(r'\s*\{?\s*"?[a-z_]*"?\s*:?\s*\Z', self.text):
            self.kind = "text"  # not the format: the answer is content as it came

    def _response(self) -> str:
        """The response string's newly decoded characters."""
        text, i = self.text, self.scanned
        while i < len(text) and not self.closed:
            c = text[i]
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.closed = True
                break
            i += 1
        self.scanned = i
        raw = text[self.body_at : i]
        while not self.closed and (m := _PARTIAL_ESCAPE.search(raw)) is not None:
            raw = raw[: m.start()]  # (an escape not yet whole, or the first half of a surrogate pair)
        try:
            decoded = json.loads(f'"{raw}"')
        except ValueError:
            return ""
        out, self.sent = decoded[self.sent :], len(decoded)
        return out

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.text += text
        if self.kind is None:
            self._head()
        if self.kind == "response":
            return self._response(), []
        if self.kind == "text":
            out, self.sent = self.text[self.sent :], len(self.text)
            return out, []
        return "", []  # a call: read whole at the end

    def finish(self, cut: bool = False) -> tuple[str, list[dict]]:
        if self.kind == "response":
            out = self._response()
            return out, []
        if self.kind in ("tool_call", "tool_calls"):
            try:
                obj = loads(self.text)
            except ValueError:
                obj = None
            items = obj.get(self.kind) if isinstance(obj, dict) else None
            items = [items] if self.kind == "tool_call" else items
            parsed = [json_call(i) for i in items] if isinstance(items, list) and items else [None]
            if all(p is not None for p in parsed):
                return "", [self.make_call(name, args) for name, args in parsed]
            if cut:
                return "", self._cut_calls()
        out, self.sent = self.text[self.sent :], len(self.text)
        return out, []

    def _cut_calls(self) -> list[dict]:
        """The calls of an answer max_tokens cut off: each whole one, then the last as far as it came."""
        decoder, text, calls = json.JSONDecoder(), self.text, []
        i = self.body_at
        if self.kind == "tool_calls":
            i = text.find("[", i) + 1
        while i < len(text):
            while i < len(text) and text[i] in " \n\t,":
                i += 1
            try:
                obj, end = decoder.raw_decode(text, i)
            except (ValueError, RecursionError):
                partial = cut_json_call(text[i:])
                if partial is not None:
                    calls.append(self.make_call(*partial))
                break
            call = json_call(obj)
            if call is None:
                break
            calls.append(self.make_call(*call))
            i = end
            if self.kind == "tool_call":
                break
        return calls
