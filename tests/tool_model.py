"""A tiny checkpoint that speaks Hermes tool calls: trained here, in seconds, to answer one conversation.

A random model never writes `<tool_call>` by itself, so tool_choice "auto" would go untested. This one is a tiny
Llama with a byte-level tokenizer and a Qwen-style chat template that renders `tools`, assistant `tool_calls` and
`tool` messages; it is overfitted (teacher forcing, loss on the answers only) until greedy decoding reproduces:

    user "What is the weather in Paris?"            -> a get_weather call with {"city": "Paris"}
    ... + that call + the tool's answer "sunny, 24 C" -> "It is sunny in Paris."

The prompts are rendered with the server's own rendering (server/api/tool_calls.py), so the server sees exactly the
tokens the model was trained on.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tiny import TEXT, make_tokenizer

TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n<tools>\n"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n</tools>\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n{% endif %}'
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

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_RESULT = "sunny, 24 C"
ANSWER = "It is sunny in Paris."


def follow_up(call_id: str, arguments: str = '{"city": "Paris"}') -> list[dict]:
    """The conversation after the model's call and the tool's answer (OpenAI's message shapes)."""
    return QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT},
    ]


def render(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt exactly as the server renders it for this request."""
    from server.api.protocol import ChatMessage, Tool
    from server.api.tool_calls import render_messages

    msgs = render_messages([ChatMessage.model_validate(m) for m in messages], True)
    tools = [Tool.model_validate(WEATHER_TOOL).model_dump(exclude_none=True)]
    return list(tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def make_tool_checkpoint(folder: Path, max_steps: int = 600) -> Path:
    import transformers
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    texts = TEXT + [CALL_TEXT, ANSWER, json.dumps(WEATHER_TOOL), TOOL_RESULT, QUESTION[0]["content"]]
    make_tokenizer(folder, vocab_size=512, texts=texts, eos="<|im_end|>", template=TOOL_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(str(folder))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cases = [(render(tok, QUESTION), tok.encode(CALL_TEXT) + [eos]),
             (render(tok, follow_up("call_x")), tok.encode(ANSWER) + [eos])]
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1,
                                      eos_token_id=eos, pad_token_id=eos, rms_norm_eps=1e-6)
    return train_checkpoint(folder, config, cases, max_steps, "the tool model")


def train_checkpoint(folder: Path, config, cases, max_steps: int, what: str) -> Path:
    """Overfit a fresh Llama of `config` on (prompt, answer) id lists until greedy decoding reproduces every answer,
    and save it to `folder`. On one thread: a model this small only waits on a second one, and on a loaded machine
    OpenMP's waiting made a step ~30x slower (6.7 ms -> 221 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(folder, config, cases, max_steps, what)
    finally:
        torch.set_num_threads(threads)


def _train(folder: Path, config, cases, max_steps: int, what: str) -> Path:
    import transformers

    eos = config.eos_token_id
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    batch = []
    for prompt, answer in cases:
        ids = torch.tensor([prompt + answer])
        labels = ids.clone()
        labels[0, : len(prompt)] = -100  # learn the answers only
        batch.append((ids, labels))
    for step in range(max_steps):
        opt.zero_grad()
        loss = sum(model(input_ids=ids, labels=labels).loss for ids, labels in batch)
        loss.backward()
        opt.step()
        if step % 25 == 24 and loss.item() < 0.05 and _reproduces(model, cases):
            break
    else:
        raise RuntimeError(f"{what} did not learn its answers in {max_steps} steps (loss {loss.item():.3f})")
    model.generation_config.eos_token_id = eos
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def _reproduces(model, cases) -> bool:
    model.eval()
    try:
        with torch.inference_mode():
            for prompt, answer in cases:
                out = model.generate(torch.tensor([prompt]), max_new_tokens=len(answer), do_sample=False,
                                     pad_token_id=answer[-1], attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
                if out[0, len(prompt):].tolist() != answer:
                    return False
        return True
    finally:
        model.train()
