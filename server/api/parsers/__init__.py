"""Output parsers: a chat answer's reasoning, content and tool calls, in the format of the model's family.

    --reasoning-parser   qwen3 | deepseek_r1 | gpt_oss
    --tool-call-parser   hermes | llama3_json | mistral | pythonic | qwen3_coder | deepseek_v3 | openai | auto

The names are vLLM's. gpt-oss's harmony format carries both (its channels): `gpt_oss` and `openai` are one parser
(server/api/parsers/harmony.py). `auto` reads the chat template and picks the tool format it teaches (the server says
which at start). The interface every parser follows: server/api/parsers/base.py.
"""

from __future__ import annotations

import importlib
import json

from server.api.parsers.base import OutputParser, Parsed, ReasoningParser, ToolParser

# name -> "module:class" (imported when chosen)
TOOL_PARSERS = {
    "hermes": "server.api.parsers.hermes:HermesParser",
    "llama3_json": "server.api.parsers.llama3:Llama3JsonParser",
    "mistral": "server.api.parsers.mistral:MistralParser",
    "pythonic": "server.api.parsers.pythonic:PythonicParser",
    "qwen3_coder": "server.api.parsers.qwen3_coder:Qwen3CoderParser",
    "deepseek_v3": "server.api.parsers.deepseek:DeepSeekV3Parser",
    "openai": "server.api.parsers.harmony:HarmonyParser",
}
REASONING_PARSERS = {
    "qwen3": "server.api.parsers.think:Qwen3ReasoningParser",
    "deepseek_r1": "server.api.parsers.think:DeepSeekR1ReasoningParser",
    "gpt_oss": "server.api.parsers.harmony:HarmonyParser",
}
HARMONY = ("openai", "gpt_oss")
HARMONY_FINAL = "<|channel|>final<|message|>"  # where a harmony answer's reasoning has ended (its grammar starts)
# --tool-call-parser auto: the first whose template markers are all in the template (most specific first)
AUTO_ORDER = ("openai", "qwen3_coder", "deepseek_v3", "mistral", "hermes", "pythonic", "llama3_json")


def load(path: str):
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def tool_parser_class(name: str) -> type[ToolParser]:
    return load(TOOL_PARSERS[name])


def reasoning_parser_class(name: str):
    return load(REASONING_PARSERS[name])


def template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(template.values())
    return template if isinstance(template, str) else ""


def auto_tool_parser(tokenizer) -> str | None:
    """The tool format the model's chat template teaches, or None when it teaches none this server reads."""
    text = template_text(tokenizer)
    for name in AUTO_ORDER:
        markers = tool_parser_class(name).template_markers
        if markers and all(m in text for m in markers):
            return name
    return None


def special_atom(tokenizer):
    """How a grammar spells a marker: an added token of the tokenizer (special or not: llguidance treats every added
    token as special, Qwen's non-special `<tool_call>` too) by its id, as llguidance matches them only so; any other
    text as a quoted string."""
    special = set(getattr(tokenizer, "all_special_ids", ()))
    added = {t.content: i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}

    def atom(marker: str) -> str:
        if marker in added:
            return f"<[{added[marker]}]>"
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and ids[0] in special:
            return f"<[{ids[0]}]>"
        return json.dumps(marker)

    return atom


class ParserConfig:
    """The server's parsers (from --reasoning-parser and --tool-call-parser, `auto` resolved from the template),
    with what they need of the tokenizer: the reasoning's end marker as token ids (where a grammar starts)."""

    def __init__(self, reasoning: str | None, tools: str | None, tokenizer=None) -> None:
        if tools == "auto":
            tools = auto_tool_parser(tokenizer)
        self.reasoning_name, self.tool_name = reasoning, tools
        self.harmony = reasoning in HARMONY or tools in HARMONY
        self.reasoning_cls = reasoning_parser_class(reasoning) if reasoning else None
        self.tool_cls = tool_parser_class(tools) if tools else None
        self.tokenizer = tokenizer
        self._end_ids: tuple[int, ...] | None = None
        self._start_id: int | None = None
        if self.reasoning_cls is not None and tokenizer is not None:
            end = HARMONY_FINAL if self.harmony else self.reasoning_cls.end
            self._end_ids = tuple(tokenizer.encode(end, add_special_tokens=False))
            if not self.harmony:
                start_ids = tokenizer.encode(self.reasoning_cls.start, add_special_tokens=False)
                self._start_id = start_ids[0] if len(start_ids) == 1 else None

    @property
    def needs_special_tokens(self) -> bool:
        return any(c is not None and c.needs_special_tokens for c in (self.reasoning_cls, self.tool_cls))

    def start_state(self, prompt_text: str) -> str | None:
        """Where the answer to this rendered prompt begins, for the reasoning parser (None without one)."""
        if self.reasoning_cls is None:
            return None
        if self.harmony:  # (the answer may open with its analysis channel, until the final one)
            return ReasoningParser.REASONING
        return self.reasoning_cls.start_state(prompt_text)

    def gate(self, start_state: str | None, grammar_has_reasoning: bool = False):
        """Where a constrained answer's grammar begins (server/engine/structured/grammar.py Gate), a new one per
        sequence: after the reasoning's end marker, or None when it applies from the first token (no reasoning
        parser, thinking switched off, or a grammar that spells the reasoning itself: `grammar_has_reasoning`)."""
        from server.engine.structured.grammar import Gate

        if start_state is None or start_state == ReasoningParser.CONTENT or grammar_has_reasoning or not self._end_ids:
            return None
        if start_state == ReasoningParser.MAYBE:
            if self._start_id is None:
                return None  # (an opening marker of several tokens: the grammar holds from the start)
            return Gate(self._end_ids, "maybe", self._start_id)
        return Gate(self._end_ids)

    def reasoning_tokens(self, output_ids: list[int], reasoning: str) -> int:
        """How many of an answer's tokens were reasoning: up to and including the end marker when the reasoning
        ended in one; else (cut off, or a harmony answer that went on to a call) its text's own tokens."""
        if not reasoning:
            return 0
        if self._end_ids:
            end, n = self._end_ids, len(self._end_ids)
            for i in range(len(output_ids) - n + 1):
                if output_ids[i] == end[0] and tuple(output_ids[i : i + n]) == end:
                    return i + n
        if self.tokenizer is None:
            return 0
        return min(len(output_ids), len(self.tokenizer.encode(reasoning, add_special_tokens=False)))

    def parser(self, tool_cls: type | None, start_state: str | None, tools: list[dict] | None = None):
        """A new answer's parser, reading its calls with `tool_cls` (None: calls are not read); None when there is
        nothing to parse."""
        if self.harmony and (tool_cls is None or tool_cls is self.tool_cls):
            cls = self.tool_cls if self.tool_cls is not None else self.reasoning_cls
            return cls(parse_tools=tool_cls is not None, tools=tools)
        # (a prompt that closed the reasoning, thinking switched off: a model that thinks anyway still has its
        # reasoning read, as vLLM's; only a grammar holds from the first token then)
        state = ReasoningParser.MAYBE if start_state in (None, ReasoningParser.CONTENT) else start_state
        reasoning = self.reasoning_cls(state) if self.reasoning_cls is not None and not self.harmony else None
        calls = tool_cls(tools) if tool_cls is not None else None
        if reasoning is None and calls is None:
            return None
        return OutputParser(reasoning, calls)


__all__ = ["OutputParser", "Parsed", "ReasoningParser", "ToolParser", "TOOL_PARSERS", "REASONING_PARSERS",
           "ParserConfig", "auto_tool_parser"]
