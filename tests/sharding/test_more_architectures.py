"""Phi-3, GPT-2, Gemma and Gemma 2, and a Llama checkpoint whose only tokenizer is a SentencePiece tokenizer.model:
greedy tokens equal transformers' at TP 1-4 (where TP does not exceed the heads) and log-probabilities within 1e-4
(fp32). Each TP degree runs every checkpoint in one fresh process (llm_runner.run_llm).

The random checkpoints come from tiny.make_checkpoint; their 1-D tensors (norm weights, biases) are then randomised,
because transformers initialises them to 0 or 1, which would hide a norm offset or a missing bias.
"""

import io
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

import tiny
from llm_runner import run_llm
from tiny import CHAT_TEMPLATE, TEXT, config_variant, hf_greedy, make_checkpoint

PROMPTS = ["The capital of France is", "Hello world! How are you today? I am fine, thank you. Tensor"]
MAX_TOKENS = 32

# name: tiny.make_checkpoint spec (config class and overrides)
SPECS: dict[str, dict] = {
    # fused qkv_proj / gate_up_proj, GQA with KV heads replicated at TP 3 and 4, half the head dim rotated
    "phi3": dict(cls="Phi3Config", num_attention_heads=8, num_key_value_heads=2, partial_rotary_factor=0.5),
    # LongRoPE (Phi-3-*-128k), served within original_max_position_embeddings, where its short factors apply
    "phi3_longrope": dict(cls="Phi3Config", num_attention_heads=4, num_key_value_heads=4,
                          original_max_position_embeddings=64, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=64,
        short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8], long_factor=[1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 40.0])),
    # Conv1D [in, out], fused c_attn, learned positions, LayerNorm, tied head, a vocabulary no TP degree divides
    "gpt2": dict(cls="GPT2Config", n_head=4, n_embd=64, n_layer=2, n_positions=256, vocab_size=50257,
                 layer_norm_epsilon=1e-5, tie_word_embeddings=True),
    # the other attention scalings GPT-2's config allows, exact GELU, and the layout of the original GPT-2
    # checkpoints (saved from GPT2Model: `h.0...`, `wte.weight`, with the causal-mask buffers `h.N.attn.bias`)
    "gpt2_variant": dict(cls="GPT2Config", n_head=4, n_embd=64, n_layer=2, n_positions=256, layer_norm_epsilon=1e-5,
                         scale_attn_weights=False, scale_attn_by_inverse_layer_idx=True, activation_function="gelu",
                         tie_word_embeddings=True),
    # multi-query attention (1 KV head on every rank), GeGLU, (1 + w) norms, scaled embeddings, tied head
    "gemma": dict(cls="GemmaConfig", num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                  tie_word_embeddings=True),
    # soft-capping small enough to matter, query_pre_attn_scalar != head_dim, alternating sliding/global layers
    # with a window of 8 that both prompts outgrow (the second already in its prefill)
    "gemma2": dict(cls="Gemma2Config", num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                   query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                   sliding_window=8, tie_word_embeddings=True),
}
# the TP degrees each checkpoint runs at: up to its head count; the variants (and the SentencePiece tokenizer on
# a plain Llama, which test_equivalence covers) only at 1 and 2, since each launch costs seconds
TPS = {"phi3": (1, 2, 3, 4), "phi3_longrope": (1, 2), "gpt2": (1, 2, 3, 4), "gpt2_variant": (1, 2),
       "gemma": (1, 2, 3, 4), "gemma2": (1, 2, 3, 4), "llama_spm": (1, 2)}
JOB_OPTIONS = {"phi3_longrope": {"max_model_len": 64}}


def randomize_vectors(folder, seed: int = 1) -> None:
    """Give every 1-D tensor (norm weights, biases) random values, in place."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if t.dim() == 1:
            tensors[name] = (t + 0.3 * torch.randn(t.shape, generator=gen)).to(t.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})


def as_original_gpt2(folder) -> None:
    """Rename GPT2LMHeadModel's tensors as the original GPT-2 checkpoints have them and add their mask buffers."""
    path = folder / "model.safetensors"
    tensors = {name.removeprefix("transformer."): t for name, t in load_file(str(path)).items()}
    n = json.loads((folder / "config.json").read_text())["n_positions"]
    for i in range(json.loads((folder / "config.json").read_text())["n_layer"]):
        tensors[f"h.{i}.attn.bias"] = torch.ones(1, 1, n, n).tril()
    save_file(tensors, str(path), metadata={"format": "pt"})


def make_arch_checkpoint(folder, arch: str):
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tiny.ARCHS, arch, SPECS[arch])
        make_checkpoint(folder, arch)
    randomize_vectors(folder)
    if arch == "gpt2_variant":
        as_original_gpt2(folder)
    return folder


def train_sentencepiece(folder, byte_fallback: bool) -> None:
    """tokenizer.model trained here on tiny.TEXT, and a tokenizer_config.json naming LlamaTokenizer (no
    tokenizer.json). With byte_fallback, rare characters become <0x..> byte tokens, as in Llama 2's tokenizer."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT * 4), model_writer=model, vocab_size=420 if byte_fallback else 160,
        model_type="bpe", byte_fallback=byte_fallback, character_coverage=0.98 if byte_fallback else 1.0,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, hard_vocab_limit=False, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,  # as Llama 2's tokenizer.model
        user_defined_symbols=["<|im_start|>", "<|im_end|>"])
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False, "chat_template": CHAT_TEMPLATE}))


def make_sentencepiece_checkpoint(folder):
    """A Llama checkpoint whose only tokenizer is a SentencePiece tokenizer.model.

    Without byte fallback, so that every token sequence a random model emits is valid text: the served text can
    then be compared exactly (invalid UTF-8 decodes to U+FFFD differently depending on where decoding starts)."""
    make_checkpoint(folder, "llama", vocab_size=420, num_attention_heads=4, num_key_value_heads=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    train_sentencepiece(folder, byte_fallback=False)
    assert not (folder / "tokenizer.json").exists()
    return folder


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = {}
    for arch in SPECS:
        folder = make_arch_checkpoint(tmp_path_factory.mktemp(arch), arch)
        tok = AutoTokenizer.from_pretrained(str(folder))
        prompts = [tok.encode(p) for p in PROMPTS]
        ref[arch] = (folder, prompts, [hf_greedy(folder, p, MAX_TOKENS) for p in prompts])
    folder = make_sentencepiece_checkpoint(tmp_path_factory.mktemp("llama_spm"))
    tok = AutoTokenizer.from_pretrained(str(folder))
    prompts = [tok.encode(p) for p in PROMPTS]
    prompts.append(list(tok.apply_chat_template([{"role": "user", "content": "Hello world"}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)))
    ref["llama_spm"] = (folder, prompts, [hf_greedy(folder, p, MAX_TOKENS) for p in prompts])
    return ref


def check(arch, result, ref):
    folder, prompts, expected = ref[arch]
    assert "error" not in result, (arch, result)
    for out, (tokens, logprobs) in zip(result["outputs"], expected, strict=True):
        assert out["token_ids"] == tokens, arch
        worst = max(abs(float(logprobs[i, t]) - v) for i, step in enumerate(out["top_logprobs"]) for t, v in step)
        assert worst < 1e-4, (arch, worst)


def continuation(tok, prompt: list[int], output: list[int]) -> str:
    """What the output adds to the prompt's text, leading space included."""
    before = tok.decode(prompt, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    after = tok.decode(prompt + output, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert after.startswith(before)
    return after[len(before):]


def rejected_variants(ref, tmp_path) -> list[tuple[dict, str]]:
    """Checkpoints (as run_llm jobs) that must be refused at start, with a piece of the expected message."""
    cases = []

    def variant(arch: str, name: str, **config) -> str:
        return config_variant(ref[arch][0], tmp_path / name, **config)

    cases.append(({"model": str(ref["phi3_longrope"][0])}, "max_model_len (256) must not exceed 64"))
    cases.append(({"model": variant("gpt2", "gpt2_upcast", reorder_and_upcast_attn=True)}, "reorder_and_upcast_attn"))
    cases.append(({"model": variant("gpt2", "gpt2_cross", add_cross_attention=True)}, "cross-attention"))
    return cases


@pytest.mark.parametrize("tp", [1, *(pytest.param(tp, marks=pytest.mark.slow) for tp in (2, 3, 4))])
def test_greedy_equals_transformers(reference, tp, tmp_path):
    archs = [a for a in reference if tp in TPS[a]]
    jobs = [{"model": str(reference[a][0]), "prompts": reference[a][1], "max_tokens": MAX_TOKENS, "logprobs": 5,
             **JOB_OPTIONS.get(a, {})} for a in archs]
    rejected = rejected_variants(reference, tmp_path) if tp == 1 else []
    results = run_llm(tp, jobs + [job for job, _ in rejected], timeout=600)
    for arch, result in zip(archs, results):
        check(arch, result, reference)
        share = result["bytes_read"] / result["checkpoint_bytes"]
        if tp == 1:  # every tensor once (the original GPT-2 layout's mask buffers are not read)
            assert share == 1.0 or (arch == "gpt2_variant" and share < 1.0), (arch, share)
        else:
            assert share < 1 / tp + 0.1, (arch, tp, share)
    for (job, message), result in zip(rejected, results[len(jobs):], strict=True):
        assert "error" in result and message in result["error"], (job, result)
    # the SentencePiece checkpoint: the server's incremental detokenizer gives the text transformers decodes
    if "llama_spm" not in archs:
        return
    tok = AutoTokenizer.from_pretrained(str(reference["llama_spm"][0]))
    for prompt, out in zip(reference["llama_spm"][1], results[archs.index("llama_spm")]["outputs"]):
        assert out["text"] == continuation(tok, prompt, out["token_ids"])


@pytest.mark.parametrize("byte_fallback", [False, True])
def test_sentencepiece_tokenizer(tmp_path, byte_fallback):
    """tokenizer.model alone loads through transformers' SentencePiece conversion, renders the chat template, and
    the incremental detokenizer reproduces tokenizer.decode token by token, leading spaces and multi-byte
    characters (split into byte-fallback tokens) included."""
    from server.engine.detokenizer import IncrementalDetokenizer
    from server.engine.tokenizer import load_tokenizer

    train_sentencepiece(tmp_path, byte_fallback)
    tok = load_tokenizer(str(tmp_path))
    assert not (tmp_path / "tokenizer.json").exists()
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2
    byte_tokens = 0
    for line in TEXT:
        ids = tok.encode(line)
        assert tok.decode(ids, skip_special_tokens=True) == line
        byte_tokens += sum(t.startswith("<0x") for t in tok.convert_ids_to_tokens(ids))
        for cut in range(1, len(ids)):
            prompt, output = ids[:cut], ids[cut:]
            if tok.decode(prompt).endswith("\ufffd"):
                continue  # a prompt that ends inside a character has no text of its own to continue
            detok = IncrementalDetokenizer(tok, prompt, [])
            for t in output:
                detok.add(t)
            assert detok.text == continuation(tok, prompt, output), (line, cut)
    assert (byte_tokens > 0) == byte_fallback


@pytest.mark.parametrize("arch, quantization", [("phi3", None), ("gemma", None), ("gemma2", None),
                                                 ("gemma2", "int8")])
def test_decode_plan_paths(reference, arch, quantization):
    """Phi-3 (fused projections, half the head rotated), Gemma (GELU-tanh MLP, (1 + w) norms) and Gemma 2 (its four
    norms, soft-capped scores, a window on every other layer) on the CPU decode plan: the one compiled call equals the
    plan's Python loop bit for bit, and the modules to rounding (tests/sharding/test_perf_paths.py)."""
    from test_perf_paths import three_decode_paths

    three_decode_paths(reference[arch][0], quantization)
