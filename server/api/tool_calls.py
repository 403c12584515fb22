"""Tool calling on rank 0: checking a request's tools, the grammar that forces a call, and rendering history.

Each family writes its calls in its own format; reading them out of the answer is the output parsers' job
(server/api/parsers/). Here:

- tool_choice "required" or a named function: the output is constrained to one or more calls (one when
  parallel_tool_calls is false) whose arguments validate against the function's JSON schema (`tools_constraint`),
  in the format of the server's --tool-call-parser when that format has a grammar, else in Hermes's.
- tool_choice "auto": the model writes freely and the tool parser takes calls out of the text as it streams.
- A chat template that cannot describe tools gets the generic format (server/api/parsers/generic.py): a system
  message lists the tools and a grammar holds the answer to a call object or a response object.

Bounds (server/api/protocol.py): at most MAX_TOOLS tools, each one's parameters a JSON schema within MAX_JSON_DEPTH and
MAX_SPEC_CHARS, and all their parameters together within MAX_SPEC_CHARS (all checked before any metaschema check,
which runs off the event loop: check_tools); earlier calls' arguments in the history nest at most MAX_JSON_DEPTH
levels.
"""

from __future__ import annotations

import json
import uuid

from dataclasses import dataclass

from server.api.parsers import generic, template_text
from server.api.parsers.base import loads as _loads
from server.api.protocol import MAX_JSON_DEPTH, MAX_SPEC_CHARS, APIError, ChatMessage, Tool, json_depth, too_deep
from server.engine.structured.constraint import (COMPACT_JSON, check_metaschema, closed_objects, deferred_checks,
                                                schema_shape)
from server.engine.structured.grammar import Constraint


PROBE_TOOL = {"type": "function", "function": {"name": "tpserve_probe_tool", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}


def template_supports_tools(tokenizer) -> bool:
    """Whether the chat template tells the model about tools: rendering a conversation with a probe tool shows the
    tool's name (as llama.cpp probes a template's capabilities). A template that merely mentions tools, or renders
    only earlier calls (DeepSeek-R1's), does not; it gets the generic format. The server asks once, at start
    (ServerState.tools_in_template)."""
    if "tools" not in template_text(tokenizer):
        return False
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[PROBE_TOOL],
                                                 add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render this probe: no tool support to use
        return False
    return "tpserve_probe_tool" in rendered


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's tools are served: `parser` reads the calls out of the answer (a ToolParser class;
    GenericToolParser when the template cannot describe tools); `forced`: a grammar makes the answer calls
    (tool_choice "required" or a named function)."""

    parser: type
    forced: bool = False


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


def call_schemas(tools: list[Tool], name: str | None) -> tuple[list[int], list[tuple[str, str]]]:
    """The tools a forced call may name (the named one, or all), and per tool (name, the JSON schema of a
    {"name": <it>, "arguments": <its parameters>} object, as JSON text with llguidance's compact-JSON option)."""
    chosen = [i for i, t in enumerate(tools) if name is None or t.function.name == name]
    out = []
    for i in chosen:
        schema = {"type": "object", "properties": {"name": {"const": tools[i].function.name},
                                                   "arguments": _parameters(tools[i])},
                  "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": COMPACT_JSON}
        out.append((tools[i].function.name, json.dumps(schema)))
    return chosen, out


def tools_constraint(tools: list[Tool], name: str | None, parallel: bool, fmt, atom) -> Constraint:
    """Output constrained to calls in the format of `fmt` (a ToolParser class with a grammar): of the named function,
    or of any of `tools` ("required"). The tools must have passed check_tools; `atom` spells a marker in Lark."""
    chosen, calls = call_schemas(tools, name)
    lark = fmt.forced_lark(calls, parallel, atom)
    # the chosen tools' metaschema checks run in this grammar's compile, on a compile thread (check_tools bounded them)
    return Constraint("lark", lark, "", "tools", deferred_checks(tool_schemas(tools, chosen)))


def generic_constraint(tools: list[Tool], name: str | None, parallel: bool, required: bool) -> Constraint:
    """The generic format's grammar: a call object (of the named function, or any), or with `required` false a
    response object too."""
    chosen, calls = call_schemas(tools, name)
    schema = {**generic.schema(calls, parallel, required), "x-guidance": COMPACT_JSON}
    return Constraint("lark", f"start: %json {json.dumps(schema)}\n", "", "tools",
                      deferred_checks(tool_schemas(tools, chosen)))


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def render_messages(messages: list[ChatMessage], tools_in_template: bool) -> list[dict]:
    """Messages as the chat template takes them. Earlier calls go to the template as `tool_calls` with their
    arguments as objects (what the families' templates serialize); an assistant's earlier reasoning as
    `reasoning_content` (Qwen3's templates) and `thinking` (gpt-oss's). A template without tool support gets the
    generic format (server/api/parsers/generic.py): calls as the JSON answer that made them, tool results as user
    messages."""
    out = []
    names: dict[str, str] = {}  # call id -> function name, for the generic format's tool results
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        msg: dict = {"role": role, "content": m.text()}
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning and m.role == "assistant":
            msg["reasoning_content"] = msg["thinking"] = reasoning
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
                names[c.id] = c.function.name
            if tools_in_template:
                msg["tool_calls"] = calls
            else:
                text = generic.render_call(calls)
                msg["content"] = (msg["content"] + "\n" if msg["content"] else "") + text
        if m.role == "tool":
            if tools_in_template:
                msg["tool_call_id"] = m.tool_call_id
                if m.name:
                    msg["name"] = m.name
            else:
                msg = {"role": "user", "content": generic.render_result(m.name or names.get(m.tool_call_id),
                                                                         msg["content"])}
        out.append(msg)
    return out
