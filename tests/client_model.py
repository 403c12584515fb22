"""A tiny checkpoint for the client-library tests: trained here, in seconds, to answer a few conversations.

Like tests/tool_model.py (whose tokenizer, texts and check it reuses), but its chat template renders only the *names*
of the tools: each library spells the same tool differently (pydantic-ai adds `additionalProperties` and `strict`,
the Agents SDK sends `strict: false`, instructor rewrites the description), and an overfitted model only answers
the exact prompt it learned. With names only, `get_weather` is the same prompt whichever library sends it.

Greedy decoding reproduces, for the question "What is the weather in Paris?":

    tools [get_weather]                         -> a get_weather call {"city": "Paris"}
      + that call + its answer "sunny, 24 C"    -> "It is sunny in Paris."
    tools [get_weather, final_result]           -> the same get_weather call (pydantic-ai's output tool is there)
      + that call + its answer                  -> a final_result call {"city": "Paris", "sky": "sunny"}

and for "Give me the weather report as JSON.", an object with a key that the Report schema does not list (as small
models do), so a test can see whether the server lets an unlisted key through:

    no tools                                    -> {"city": "Paris", "sky": "sunny", "note": "warm"}
    tools [Report] (a forced call)              -> a Report call with the same three keys
"""

from __future__ import annotations

import json
from pathlib import Path


from tiny import TEXT, make_tokenizer
from tool_model import ANSWER, CALL_TEXT, QUESTION, TOOL_RESULT, follow_up, train_checkpoint

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant"
    "{%- for c in m['tool_calls'] %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

REPORT_QUESTION = [{"role": "user", "content": "Give me the weather report as JSON."}]
REPORT = {"city": "Paris", "sky": "sunny"}  # what the Report schema lists
REPORT_WITH_NOTE = {**REPORT, "note": "warm"}  # what the model writes when nothing stops it


def tool(name: str) -> dict:
    """A tool as the server passes it to the template (only the name is rendered)."""
    return {"type": "function", "function": {"name": name}}


def call_text(name: str, arguments: dict) -> str:
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(arguments) + "}\n</tool_call>"


FINAL_CALL = call_text("final_result", REPORT)
WEATHER, FINAL_RESULT = tool("get_weather"), tool("final_result")

CASES = [  # (messages, tools, the answer the model learns)
    (QUESTION, [WEATHER], CALL_TEXT),
    (follow_up("call_x"), [WEATHER], ANSWER),
    (QUESTION, [WEATHER, FINAL_RESULT], CALL_TEXT),
    (follow_up("call_x"), [WEATHER, FINAL_RESULT], FINAL_CALL),
    (REPORT_QUESTION, None, json.dumps(REPORT_WITH_NOTE)),
    (REPORT_QUESTION, [tool("Report")], call_text("Report", REPORT_WITH_NOTE)),
]


def render(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The prompt exactly as the server renders it (server/api/tool_calls.py's rendering of the messages)."""
    from server.api.protocol import ChatMessage
    from server.api.tool_calls import render_messages

    msgs = render_messages([ChatMessage.model_validate(m) for m in messages], True)
    kw = {"tools": tools} if tools else {}
    return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False,
                                              **kw))


def make_client_checkpoint(folder: Path, max_steps: int = 800) -> Path:
    import transformers
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    texts = TEXT + [ANSWER, TOOL_RESULT, QUESTION[0]["content"], REPORT_QUESTION[0]["content"], "Tools:"]
    texts += [answer for _, _, answer in CASES]
    make_tokenizer(folder, vocab_size=512, texts=texts, eos="<|im_end|>", template=TEMPLATE)
    tok = AutoTokenizer.from_pretrained(str(folder))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cases = [(render(tok, m, t), tok.encode(a) + [eos]) for m, t, a in CASES]
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1,
                                      eos_token_id=eos, pad_token_id=eos, rms_norm_eps=1e-6)
    return train_checkpoint(folder, config, cases, max_steps, "the client model")
