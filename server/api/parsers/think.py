"""`<think>…</think>` reasoning (`--reasoning-parser qwen3` and `deepseek_r1`).

Qwen3 writes `<think>\n…\n</think>\n\n` before its answer; with `chat_template_kwargs: {"enable_thinking": false}`
its template closes an empty block in the prompt and the answer is all content. DeepSeek-R1's distills (and the
newer Qwen3 thinking templates) open the block in the prompt, so the answer starts inside the reasoning and holds
only `</think>`. Which of these an answer is follows from the end of its rendered prompt (ReasoningParser.start_state),
not from the parser's name: the two names differ only in what an answer whose reasoning never ends is, when the
template left it to the model to open the block (qwen3: content, as vLLM; deepseek_r1: the same, as the R1 templates
always open it).
"""

from __future__ import annotations

from server.api.parsers.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
