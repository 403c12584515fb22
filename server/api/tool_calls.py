"""Tool calling: the grammar that forces a call, the parser that reads calls out of text, and rendering history.

The format is Hermes's, which Qwen2/Qwen2.5/Qwen3 and SmolLM-style chat templates teach (`--tool-call-parser
hermes`, as vLLM names it): each call is

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- tool_choice "required" or a named function: the output is constrained to one or more such calls (one when
  parallel_tool_calls is false) whose arguments validate against the function's JSON schema (`tools_constraint`).
- tool_choice "auto": the model writes freely; `ToolCallParser` takes calls out of the text as it streams. Text
  before the first call is the message's content; a block that does not parse stays content, as text.

Bounds (server/api/protocol.py): at most MAX_TOOLS tools, each one's parameters a JSON schema within MAX_JSON_DEPTH and
MAX_SPEC_CHARS, and all their parameters together within MAX_SPEC_CHARS (all checked before any metaschema check,
which runs off the event loop: check_tools); earlier calls' arguments in the history nest at most MAX_JSON_DEPTH
levels.
"""

from __future__ import annotations

import json
import uuid

from server.engine.structured.grammar import Constraint
from server.api.protocol import MAX_JSON_DEPTH, MAX_SPEC_CHARS, APIError, ChatMessage, Tool, json_depth, too_deep
from server.engine.structured.constraint import (COMPACT_JSON, check_metaschema, closed_objects, deferred_checks,
                                                schema_shape)

TOOL_CALL_PARSERS = ("hermes",)
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def template_supports_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(template.values())
    return isinstance(template, str) and "tools" in template


def _field(i: int) -> str:
    return f"tools[{i}].function.parameters"


def _parameters(tool: Tool) -> dict:
    """A tool's parameters as its calls are generated (closed objects); check_tools bounded them first."""
    params = tool.function.parameters
    if params is None:  # OpenAI: no parameters is a function with an empty parameter list
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return closed_objects(params)


def check_tools(tools: list[Tool]) -> None:
    """The cheap checks of a request's tools, made on the event loop before anything slow: unique names, each tool's
    parameters a JSON schema object within MAX_JSON_DEPTH and MAX_SPEC_CHARS, and all of them together within
    MAX_SPEC_CHARS (summed as they are measured: a list past the bound is refused before the rest of it is even
    serialized). No metaschema check here (slow Python, ~0.3 s for an 86 KB schema): that runs off the event loop,
    in the compile of the grammar that holds the tool (tools_constraint) or in the request's CpuPool job
    (check_tool_schemas, from server/api/preprocess.py render_chat)."""
    names = [t.function.name for t in tools]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise APIError(400, f"tool names must be unique; repeated: {sorted(dup)}", param="tools")
    total = 0
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            total += len(schema_shape(tool.function.parameters, _field(i)))
            if total > MAX_SPEC_CHARS:
                raise APIError(400, f"the tools' parameters add up to at least {total} characters of JSON schema; at "
                                    f"most {MAX_SPEC_CHARS} are allowed (this server's limit)", param="tools")


def tool_schemas(tools: list[Tool], only=None) -> tuple[tuple[str, dict], ...]:
    """(field, parameters) of each tool that has parameters (of those whose index is in `only`, if given): what is
    validated against its metaschema."""
    return tuple((_field(i), t.function.parameters) for i, t in enumerate(tools)
                 if t.function.parameters is not None and (only is None or i in only))


def check_tool_schemas(tools: list[Tool], skip=()) -> None:
    """The slow half of checking tools: each one's parameters (but those whose index is in `skip`, which their
    grammar's compile checks) against its metaschema; a 400 naming the field. Runs in the CpuPool."""
    for param, schema in tool_schemas(tools, [i for i in range(len(tools)) if i not in skip]):
        check_metaschema(schema, param)


def tools_constraint(tools: list[Tool], name: str | None, parallel: bool) -> Constraint:
    """Output constrained to Hermes tool calls: of the named function, or of any of `tools` ("required"). The
    tools must have passed check_tools."""
    chosen = [i for i, t in enumerate(tools) if name is None or t.function.name == name]
    alternatives = [{"type": "object",
                     "properties": {"name": {"const": tools[i].function.name}, "arguments": _parameters(tools[i])},
                     "required": ["name", "arguments"], "additionalProperties": False} for i in chosen]
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    schema = {**schema, "x-guidance": COMPACT_JSON}
    repeat = ' ("\\n" tool_call)*' if parallel else ""
    lark = (f"start: tool_call{repeat}\n"
            f'tool_call: "{OPEN}\\n" call "\\n{CLOSE}"\n'
            f"call: %json {json.dumps(schema)}\n")
    # the chosen tools' metaschema checks run in this grammar's compile, on a compile thread (check_tools bounded them)
    return Constraint("lark", lark, "", "tools", deferred_checks(tool_schemas(tools, chosen)))


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _loads(text: str):
    """json.loads, or ValueError for anything it cannot read: not JSON, an integer longer than Python reads (4300
    digits), or nesting past Python's recursion limit (RecursionError)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _call(body: str) -> dict | None:
    try:
        obj = _loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = _loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


class ToolCallParser:
    """Splits the text of an answer, as it streams, into content and complete tool calls.

    `feed(text)` returns (content to send now, calls completed now); `finish()` flushes what was held back. Content
    that could still turn into the start of a call, and whitespace that might precede one, is held back until
    it is known which it is. The whole answer goes through the same steps, so a streamed answer and a gathered one
    are the same."""

    def __init__(self) -> None:
        self.pending = ""  # text not yet handed out
        self.in_call = False
        self.ws_before = ""
        self.calls: list[dict] = []
        self.content = ""  # all content handed out

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        out, calls = "", []
        while True:
            if self.in_call:
                end = self.pending.find(CLOSE)
                if end < 0:
                    break
                raw = self.pending[: end + len(CLOSE)]
                call = _call(self.pending[len(OPEN) : end].strip())
                self.pending = self.pending[end + len(CLOSE) :]
                self.in_call = False
                if call is not None:
                    calls.append(call)
                    self.calls.append(call)
                else:
                    out += self.ws_before + raw  # ...unless the call does not parse: then all is text
                continue
            start = self.pending.find(OPEN)
            if start >= 0:
                before = self.pending[:start]
                out += before.rstrip()  # whitespace just before a call is not content...
                self.ws_before = before[len(before.rstrip()) :]
                self.pending = self.pending[start:]
                self.in_call = True
                continue
            # no call begins in pending: send all but what may start one, and trailing whitespace (it may
            # precede a call)
            keep = _partial_suffix(self.pending, OPEN)
            sendable = self.pending[: len(self.pending) - keep].rstrip()
            out += sendable
            self.pending = self.pending[len(sendable) :]
            break
        self.content += out
        return out, calls

    def finish(self) -> str:
        """What was held back, as content (an unclosed call, or trailing whitespace after text)."""
        out = self.pending
        if self.calls and not out.strip():
            out = ""
        self.pending = ""
        self.content += out
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """A whole answer as (content or None, tool calls)."""
    parser = ToolCallParser()
    content, calls = parser.feed(text)
    content += parser.finish()
    return (content if content or not calls else None), calls


def render_messages(messages: list[ChatMessage], tools_in_template: bool) -> list[dict]:
    """Messages as the chat template takes them. Earlier calls go to the template as `tool_calls` with their
    arguments as objects (what Hermes-style templates serialize); a template without tool support gets them as
    Hermes text in the assistant's content, so the conversation still shows them."""
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        msg: dict = {"role": role, "content": m.text()}
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                param = f"messages.{i}.tool_calls.{j}.function.arguments"
                try:
                    args = _loads(c.function.arguments)
                except ValueError:
                    args = c.function.arguments
                if json_depth(args) > MAX_JSON_DEPTH:
                    raise APIError(400, too_deep(param), param=param)
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                          "arguments": args}})
            if tools_in_template:
                msg["tool_calls"] = calls
            else:
                text = "\n".join(f"{OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                           "arguments": c["function"]["arguments"]},
                                                          ensure_ascii=False) + f"\n{CLOSE}" for c in calls)
                msg["content"] = (msg["content"] + "\n" if msg["content"] else "") + text
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
            if m.name:
                msg["name"] = m.name
        out.append(msg)
    return out
