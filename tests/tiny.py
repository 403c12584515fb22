"""Tiny random checkpoints and a tiny tokenizer, made with transformers and tokenizers in a temporary folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TEXT = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello world! How are you today? I am fine, thank you.",
    "Tensor parallelism splits every weight matrix over several ranks.",
    "日本語のテキストも少し含めます。中文也有一点。",
    "Emoji: 😀 🚀 🌍 ✨ and accents: café, naïve, Ærø.",
    "def add(a, b):\n    return a + b\n",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000",
]

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(folder: Path, vocab_size: int = 384, texts: list[str] | None = None, eos: str = "</s>",
                   template: str = CHAT_TEMPLATE) -> None:
    """A byte-level BPE tokenizer trained on a few lines, saved as tokenizer.json with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((texts or TEXT) * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token=eos,
                                   pad_token=eos)
    fast.chat_template = template
    fast.save_pretrained(str(folder))


ARCHS: dict[str, dict] = {
    # name: (transformers config class name, config overrides)
    "llama": dict(cls="LlamaConfig", num_attention_heads=8, num_key_value_heads=4),
    "mistral": dict(cls="MistralConfig", num_attention_heads=8, num_key_value_heads=2, sliding_window=4096),
    "qwen2": dict(cls="Qwen2Config", num_attention_heads=6, num_key_value_heads=2),
    "qwen3": dict(cls="Qwen3Config", num_attention_heads=8, num_key_value_heads=4, head_dim=16),
    "llama_mha_bias": dict(cls="LlamaConfig", num_attention_heads=4, num_key_value_heads=4, attention_bias=True,
                           mlp_bias=True),
    "llama_tied": dict(cls="LlamaConfig", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # room for the generic tool format's system message (server/api/parsers/generic.py) in this tiny vocabulary
    "llama_long": dict(cls="LlamaConfig", num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024),
}


def make_checkpoint(folder: Path, arch: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0,
                    max_shard_size: str | None = None, **overrides) -> Path:
    """A random model of `arch` (see ARCHS), saved with save_pretrained(safe_serialization=True) plus the tokenizer."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    spec = dict(ARCHS[arch])
    cls = getattr(transformers, spec.pop("cls"))
    kw = dict(vocab_size=vocab + 3, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=2, rms_norm_eps=1e-6)
    kw.update(spec)
    kw.update(overrides)
    config = cls(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    save_kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), safe_serialization=True, **save_kw)
    return folder


def hf_greedy(folder: Path, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation (EOS ignored) and the log-softmax of its logits at every step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = torch.log_softmax(torch.stack(out.logits, 0)[:, 0].float(), dim=-1)
    return tokens, logprobs


def config_variant(src: Path, dst: Path, **config) -> str:
    """A copy of checkpoint `src` at `dst` with config.json's fields overridden (a config to be refused)."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def check_greedy(name: str, result: dict, ref: dict) -> None:
    """A run_llm result equals transformers' (ref[name][1]: (tokens, logprobs) per prompt): the same greedy tokens,
    the top log-probabilities within 1e-4 (fp32)."""
    assert "error" not in result, (name, result)
    for out, (tokens, logprobs) in zip(result["outputs"], ref[name][1], strict=True):
        assert out["token_ids"] == tokens, name
        worst = max(abs(float(logprobs[i, t]) - v) for i, step in enumerate(out["top_logprobs"]) for t, v in step)
        assert worst < 1e-4, (name, worst)


def check_whole_steps(folder, quantization=None, check_model=lambda model: True) -> None:
    """The CPU decode plan's whole step in one call (DecodePlan.step: the embedding, the layers and the LM head) gives
    the same tokens, logprobs and prompt logprobs, bit for bit, as the same compiled layers between the model's own
    embedding and head: three prompts together, then one alone (one-row steps), each prompt in one step or in chunks
    of 7 tokens, with prompt logprobs (every prompt row returns logits) and without (the last of each prompt; the
    chunks before it none). `check_model(model)` must hold of the served model once its plan is built."""
    from server.engine.sampler import SamplingParams
    from server.llm import LLM

    prompts = [[5, 6, 7, 8, 9, 10], list(range(30, 50)), [3, 4]]
    runs = []
    for chunk in (None, 7):
        llm = LLM(str(folder), max_num_seqs=4, kv_cache_memory=8 << 20, quantization=quantization,
                  enable_prefix_caching=False, max_num_batched_tokens=chunk)
        try:
            model = llm.executor.model
            for asked in (SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2),
                          SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)):
                whole = llm.generate(prompts, asked) + llm.generate(prompts[:1], asked)
                plan = model._plan
                assert plan.compiled is not None and plan.run_step is not None  # (it ran them in one call)
                assert check_model(model)
                plan.run_step = None  # the layers' call between the embedding and the head from here on
                split = llm.generate(prompts, asked) + llm.generate(prompts[:1], asked)
                plan.invalidate()  # (compiled again at the next step, ends and all)
                runs.append((whole, split))
        finally:
            llm.close()
    for whole, split in runs:
        for a, b in zip(whole, split, strict=True):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
            assert a.prompt_logprobs == b.prompt_logprobs and a.prompt_top_logprobs == b.prompt_top_logprobs
