"""Tiny checkpoints that speak one model family's chat format through the family's REAL chat template: trained here,
in seconds, to answer one tool conversation the way that family's models answer it.

tests/tool_model.py trains a model on a Hermes-style template of its own; these use the templates the families ship
(llama.cpp's copies of them: tests/helpers/templates.py), a tokenizer whose markers are single tokens, special or not
as in the family's own tokenizer, the family's end-of-turn token(s) as EOS (every one of them in the config's
eos_token_id), and answers in the family's own output format, reasoning included for the reasoning families. Greedy
decoding reproduces, with the get_weather tool as the OpenAI Agents SDK spells it (WEATHER_TOOL: the SDK and a raw
client then send the same prompt):

    user "What is the weather in Paris?"                 -> [reasoning] + a get_weather call {"city": "Paris"}
    ... + that call [+ its reasoning] + "sunny, 24 C"    -> [reasoning] + "It is sunny in Paris."

The prompts are rendered exactly as the server renders them (server/api/preprocess.py render_chat): the messages
through server.api.tool_calls.render_messages, the template to text with the tools (and the request's
chat_template_kwargs), then the text tokenized without special tokens.

    from family_model import FAMILIES, make_family_checkpoint
    folder = make_family_checkpoint(tmp / "qwen3", "qwen3")      # 2-5 s on 2 cores
    server_factory(folder, 1, *FAMILIES["qwen3"].flags, ...)

Families (FAMILIES), each with the flags vLLM would be given for it (Family.flags):

    qwen3        Qwen3's template; the model opens <think> itself; Hermes calls
                 --reasoning-parser qwen3 --tool-call-parser hermes
    gpt-oss      harmony: an analysis message, then a commentary call to=functions.get_weather ending in <|call|>, or a
                 final message ending in <|return|> (both EOS)
                 --reasoning-parser gpt_oss --tool-call-parser openai
    llama3       Llama 3.1: the JSON call {"name", "parameters"} ending in <|eom_id|>, the answer in <|eot_id|>
                 --tool-call-parser llama3_json
    mistral      Mistral Small 3.2 (v11 calls: [TOOL_CALLS]name[ARGS]{...}); its history renders [CALL_ID] with the
                 9-character id the server made, so the model is trained on several ids and answers whatever the id
                 --tool-call-parser mistral
    qwen3_coder  Qwen3-Coder's XML calls
                 --tool-call-parser qwen3_coder
    deepseek_r1  DeepSeek-R1-Distill-Qwen: its template renders earlier calls but never the tools, so the server
                 serves tools in the generic format (server/api/parsers/generic.py: a system message and a grammar),
                 whatever --tool-call-parser says; its generation prompt closes <think> unless chat_template_kwargs
                 enable_thinking is true, so it is trained both ways (modes[0]: thinking; modes[1]: the default)
                 --reasoning-parser deepseek_r1 --tool-call-parser deepseek_v3

gpt-oss's and Mistral Small's templates render today's date: a checkpoint answers prompts rendered on the day it was
trained.
"""

from __future__ import annotations

import json
import random
import string
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "helpers"))  # `import templates`

# the get_weather tool exactly as the OpenAI Agents SDK sends it for `def get_weather(city: str)` (its chat
# completions converter's output, key order included: the templates serialize a tool as it comes)
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"properties": {"city": {"title": "City", "type": "string"}}, "required": ["city"],
                   "title": "get_weather_args", "type": "object", "additionalProperties": False},
    "strict": True}}
QUESTION_TEXT = "What is the weather in Paris?"
QUESTION = [{"role": "user", "content": QUESTION_TEXT}]
ARGUMENTS = {"city": "Paris"}
TOOL_RESULT = "sunny, 24 C"
ANSWER = "It is sunny in Paris."
REASONING_CALL = "The user wants the weather in Paris. I should call get_weather for it."
REASONING_ANSWER = "The tool says it is sunny and 24 C in Paris."
TRAIN_CALL_ID = "call_x"  # (no template but Mistral's renders call ids)


@dataclass(frozen=True)
class Mode:
    """How a family's conversation is asked for: the chat_template_kwargs the requests send, and whether the model
    reasons (writes REASONING_CALL / REASONING_ANSWER) and is sent its reasoning back."""

    template_kwargs: dict = field(default_factory=dict)
    reasoning: bool = False


@dataclass(frozen=True)
class Family:
    """One family: its template, its tokenizer's markers, its flags, and how it writes its two answers."""

    name: str
    template: str  # llama.cpp's models/templates/<template>.jinja
    special: tuple[str, ...]  # added tokens flagged special (plain detokenizing drops them)
    added: tuple[str, ...]  # added tokens that are not special (kept in plain detokenizing)
    eos: tuple[str, ...]  # end-of-turn tokens: eos[0] is the tokenizer's eos_token; all in the config
    call_eos: str  # the token that ends the call turn
    answer_eos: str  # ... and the answer turn
    call_body: str  # the call, in the family's output format
    flags: tuple[str, ...]  # `tpserve serve` flags
    # the whole turn, from its reasoning (None: none) and its body (the call, or the answer's text)
    turn: Callable[[str | None, str], str] = lambda reasoning, body: body
    answer_body: str = ANSWER
    modes: tuple[Mode, ...] = (Mode(),)  # modes[0] is what the chat tests ask for
    bos: str | None = None
    unk: str | None = None
    call_ids: tuple[str, ...] = (TRAIN_CALL_ID,)  # ids the history is trained with (a template may render them)
    generic: bool = False  # the template cannot describe tools: the server's generic format
    # the tokenizer splits text into words before BPE, as real ones do; False: BPE merges across words too (tokens
    # of at most 48 characters: llguidance's token trie refuses much longer ones), which packs a long fixed system
    # prompt into fewer tokens (Mistral Small's default one is ~550 word tokens, ~60 so)
    words: bool = True
    vocab_size: int = 1024

    @property
    def reasoning(self) -> bool:
        return self.modes[0].reasoning

    @property
    def tokens(self) -> tuple[str, ...]:
        return self.special + self.added

    def mode_without_kwargs(self) -> Mode | None:
        """The mode a request without chat_template_kwargs is in (what a Responses API request renders)."""
        return next((m for m in self.modes if not m.template_kwargs), None)

    def call_text(self, mode: Mode) -> str:
        return self.turn(REASONING_CALL if mode.reasoning else None, self.call_body)

    def answer_text(self, mode: Mode) -> str:
        return self.turn(REASONING_ANSWER if mode.reasoning else None, self.answer_body)


def _think(reasoning: str | None, body: str) -> str:  # Qwen3: the model opens the block itself
    return body if reasoning is None else f"<think>\n{reasoning}\n</think>\n\n{body}"


def _harmony(reasoning: str | None, body: str) -> str:
    """gpt-oss: the analysis message, then `body` (a commentary call, or a message on the final channel)."""
    if not body.startswith("<|channel|>"):
        body = f"<|channel|>final<|message|>{body}"
    return body if reasoning is None else f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant{body}"


def _opened_think(reasoning: str | None, body: str) -> str:  # DeepSeek-R1: the prompt opened <think> (or closed it)
    return body if reasoning is None else f"{reasoning}\n</think>{body}"


def _mistral_ids(n: int) -> tuple[str, ...]:
    """n call ids of 9 letters and digits, each letter and digit in at least one: the model learns that the id in
    its history does not change its answer (the server makes a new random one for every call)."""
    rng = random.Random(1)
    alnum = list(string.ascii_letters + string.digits)
    pool: list[str] = []
    while len(pool) < 9 * n:
        rng.shuffle(alnum)
        pool += alnum
    return tuple("".join(pool[9 * i : 9 * i + 9]) for i in range(n))


def _generic(obj: dict) -> str:  # the generic format's answer, as its grammar spells JSON (compact: ", " and ": ")
    return json.dumps(obj)


DS = {k: "<｜" + k.replace(" ", "▁") + "｜>" for k in (
    "begin of sentence", "end of sentence", "User", "Assistant", "tool calls begin", "tool calls end",
    "tool call begin", "tool call end", "tool sep", "tool outputs begin", "tool outputs end", "tool output begin",
    "tool output end")}

FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family(
        name="qwen3", template="Qwen-Qwen3-0.6B",
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        added=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        eos=("<|im_end|>", "<|endoftext|>"), call_eos="<|im_end|>", answer_eos="<|im_end|>",
        call_body="<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": ARGUMENTS}) + "\n</tool_call>",
        turn=_think, modes=(Mode(reasoning=True),),
        # (`auto`: the server finds hermes in the template; test_families checks the start line names it)
        flags=("--reasoning-parser", "qwen3", "--tool-call-parser", "auto")),
    Family(
        name="gpt-oss", template="openai-gpt-oss-120b",
        special=("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                 "<|constrain|>", "<|return|>", "<|call|>"),
        added=(),
        eos=("<|return|>", "<|call|>", "<|endoftext|>"), call_eos="<|call|>", answer_eos="<|return|>",
        # (the model's own header order; the template renders history as `<|start|>assistant to=functions.NAME
        # <|channel|>commentary json<|message|>`)
        call_body='<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}',
        turn=_harmony, modes=(Mode(reasoning=True),),
        flags=("--reasoning-parser", "gpt_oss", "--tool-call-parser", "openai")),
    Family(
        name="llama3", template="meta-llama-Llama-3.1-8B-Instruct",
        special=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                 "<|eom_id|>", "<|python_tag|>"),
        added=(), bos="<|begin_of_text|>",
        eos=("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"), call_eos="<|eom_id|>", answer_eos="<|eot_id|>",
        call_body=json.dumps({"name": "get_weather", "parameters": ARGUMENTS}),
        flags=("--tool-call-parser", "llama3_json")),
    Family(
        name="mistral", template="Mistral-Small-3.2-24B-Instruct-2506",
        special=("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                 "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "[SYSTEM_PROMPT]",
                 "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]"),
        added=(), bos="<s>", unk="<unk>",
        eos=("</s>",), call_eos="</s>", answer_eos="</s>",
        call_body='[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
        # (`auto`: the server finds the format in the template; test_families checks the start line names it)
        flags=("--tool-call-parser", "auto"), call_ids=_mistral_ids(4), words=False, vocab_size=3000),
    Family(
        name="qwen3_coder", template="Qwen3-Coder",
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        added=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        eos=("<|im_end|>", "<|endoftext|>"), call_eos="<|im_end|>", answer_eos="<|im_end|>",
        call_body="<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                  "</tool_call>",
        flags=("--tool-call-parser", "qwen3_coder")),
    Family(
        name="deepseek_r1", template="deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
        special=(DS["begin of sentence"], DS["end of sentence"]),
        added=(DS["User"], DS["Assistant"], "<think>", "</think>", DS["tool calls begin"], DS["tool calls end"],
               DS["tool call begin"], DS["tool call end"], DS["tool sep"], DS["tool outputs begin"],
               DS["tool outputs end"], DS["tool output begin"], DS["tool output end"]),
        bos=DS["begin of sentence"],
        eos=(DS["end of sentence"],), call_eos=DS["end of sentence"], answer_eos=DS["end of sentence"],
        call_body=_generic({"tool_call": {"name": "get_weather", "arguments": ARGUMENTS}}),
        answer_body=_generic({"response": ANSWER}), generic=True,
        turn=_opened_think, modes=(Mode({"enable_thinking": True}, reasoning=True), Mode()),
        flags=("--reasoning-parser", "deepseek_r1", "--tool-call-parser", "deepseek_v3")),
]}


def follow_up(call_id: str, reasoning: str | None = None, arguments: str = '{"city": "Paris"}') -> list[dict]:
    """The conversation after the model's call (its reasoning sent back, if given) and the tool's answer."""
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    return QUESTION + [assistant, {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT}]


def render_text(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> str:
    """The prompt text exactly as the server renders it for a request with these messages, the WEATHER_TOOL (tool_choice
    auto) and these chat_template_kwargs (server/api/preprocess.py render_chat)."""
    from server.api.parsers import generic
    from server.api.protocol import ChatMessage, Tool
    from server.api.tool_calls import render_messages, template_supports_tools

    in_template = template_supports_tools(tokenizer)
    msgs = render_messages([ChatMessage.model_validate(m) for m in messages], in_template)
    tool = Tool.model_validate(WEATHER_TOOL).model_dump(exclude_none=True)
    extra = dict(template_kwargs or {})
    if in_template:
        extra["tools"] = [tool]
    else:  # the generic format: the tools and the answer's form as a system message
        described = generic.instructions([tool], True, False)  # (parallel_tool_calls defaults to true)
        if msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + described}
        else:
            msgs.insert(0, {"role": "system", "content": described})
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **extra)


def render(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    return list(tokenizer(render_text(tokenizer, messages, template_kwargs), add_special_tokens=False)["input_ids"])


def _tokenizer(folder: Path, family: Family, texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on `texts`, the family's markers added as single tokens (special or not, as
    in the family's tokenizer), saved to `folder` with the family's real chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from templates import template

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=family.words)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(family.special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
                                  max_token_length=None if family.words else 48)
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    kw = {"eos_token": family.eos[0], "pad_token": family.eos[0]}
    if family.bos:
        kw["bos_token"] = family.bos
    if family.unk:
        kw["unk_token"] = family.unk
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kw)
    extra = [t for t in family.special if t not in (family.bos, family.eos[0], family.unk)]
    fast.add_special_tokens({"additional_special_tokens": extra})
    fast.chat_template = template(family.template)
    fast.save_pretrained(str(folder))
    return fast


def _conversations(family: Family) -> list[tuple[list[dict], Mode, bool]]:
    """(messages, mode, is the call turn) of every training case."""
    out = []
    for mode in family.modes:
        out.append((QUESTION, mode, True))
        for call_id in family.call_ids:
            out.append((follow_up(call_id, REASONING_CALL if mode.reasoning else None), mode, False))
    return out


def training_cases(tok, family: Family) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids ending in the turn's EOS) of every training case."""
    def ids(text: str, eos: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"]) + [tok.convert_tokens_to_ids(eos)]

    return [(render(tok, messages, mode.template_kwargs),
             ids(family.call_text(mode), family.call_eos) if call else ids(family.answer_text(mode), family.answer_eos))
            for messages, mode, call in _conversations(family)]


def make_family_checkpoint(folder: Path, family: str, max_steps: int = 800) -> Path:
    """A checkpoint of `family` (a key of FAMILIES) in `folder`, trained until greedy decoding reproduces every case."""
    import transformers

    from tool_model import train_checkpoint

    fam = FAMILIES[family]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # the tokenizer learns from every prompt and answer, rendered with a provisional tokenizer of the same markers
    # (rendering reads only the template and the marker strings)
    probe = _tokenizer(folder, fam, [QUESTION_TEXT], 300)
    texts = [render_text(probe, messages, mode.template_kwargs) for messages, mode, _ in _conversations(fam)]
    texts += [fam.call_text(m) for m in fam.modes] + [fam.answer_text(m) for m in fam.modes]
    tok = _tokenizer(folder, fam, texts * 4, fam.vocab_size)
    split = [t for t in fam.tokens if len(tok(t, add_special_tokens=False)["input_ids"]) != 1]
    assert not split, f"markers that are not one token: {split}"
    cases = training_cases(tok, fam)
    eos_ids = [tok.convert_tokens_to_ids(t) for t in fam.eos]
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=2048, tie_word_embeddings=False,
                                      bos_token_id=tok.bos_token_id,
                                      eos_token_id=eos_ids if len(eos_ids) > 1 else eos_ids[0],
                                      pad_token_id=eos_ids[0], rms_norm_eps=1e-6)
    return train_checkpoint(folder, config, cases, max_steps, f"the {family} family model")
