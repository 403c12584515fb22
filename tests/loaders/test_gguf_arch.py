"""GGUF files of the other architectures tpserve serves (loaders/gguf_file.py): qwen2moe, qwen3moe, olmoe, Mixtral
(GGUF "llama" with experts), phi3 (also with LongRoPE), gemma2.

Tiny random transformers models are converted here as llama.cpp's convert_hf_to_gguf.py converts them (`converted`:
conversion/qwen.py Qwen2MoeModel / Qwen3MoeModel, olmo.py OlmoeModel, llama.py LlamaModel for Mixtral, phi.py
Phi3MiniModel, gemma.py Gemma2Model): tensor names from gguf-py's own tensor map (the converter's), each layer's
experts stacked into one [experts, out, in] tensor per projection, Llama's q/k rows permuted, Gemma 2's norm weights
stored as 1 + w (added in the checkpoint's float16, as the converter adds), routers and norms kept F32, the
converter's metadata keys; then written with test_gguf's writer (the `gguf` package's GGUFWriter, no llama.cpp
needed), and served. (Converted F32 by llama.cpp's own convert_hf_to_gguf.py, the same checkpoints give files
byte-identical in tensors and architecture metadata, checked by hand: its tokenizer step needs a tokenizer it knows.)

- where transformers loads the architecture from GGUF (qwen2moe, qwen3moe, phi3, gemma2): quantized files (Q8_0 /
  Q4_0 experts, and a Q4_K_M Qwen3-MoE with Q4_K / Q6_K experts, read as blocks one expert at a time), greedy tokens
  equal transformers on the same file, log-probabilities within 1e-4. These run on torch's paths
  (TPSERVE_KERNELS=none: the blocks, repacked, dequantized in float32): the VNNI kernel's int8 activations turn
  one-ulp differences between two RMSNorm implementations into whole rounding steps, which moved a near-tie of
  these random models; the kernels' arithmetic on a file's expert blocks is checked layer by layer instead
  (test_quantized_experts_load_as_blocks);
- olmoe, Mixtral (transformers loads neither from GGUF), Qwen2-MoE as the current converter writes it (a [1, hidden]
  shared-expert gate, which transformers' GGUF loader cannot load) and Phi-3 LongRoPE (whose factors transformers'
  loader drops): float16 / float32 files, greedy tokens equal transformers on the
  original checkpoint, whose weights are float16 values (the file holds the same numbers).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import tiny
from llm_runner import run_llm
from test_gguf import error_of, int8_rounded, permute, random_blocks, write_gguf
from tiny import check_greedy, make_checkpoint

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

GGUF_ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "mixtral": "llama", "phi3": "phi3",
             "gemma2": "gemma2"}
# every linear's inputs, and each TP 2 shard's, are whole 32-input blocks; norms and biases randomised (randomize)
COMMON = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
SPECS: dict[str, dict] = {
    # a shared expert with its sigmoid gate, top-2 not renormalised (llama.cpp's qwen2moe), q/k/v biases
    "qwen2_moe": dict(cls="Qwen2MoeConfig", **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=64, norm_topk_prob=False),
    # per-head q/k norms, top-2 renormalised (llama.cpp's qwen3moe)
    "qwen3_moe": dict(cls="Qwen3MoeConfig", **COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=64, norm_topk_prob=True),
    # K-quant blocks come in 256 inputs: Qwen3-MoE at hidden size 256, as a Q4_K_M file (Q4_K gate/up experts, Q6_K
    # down experts, v and LM head)
    "qwen3_moe_256": dict(cls="Qwen3MoeConfig", **COMMON, hidden_size=256, head_dim=64, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True),
    # q/k norms over the whole projections; the converter writes rms eps 1e-5 whatever the config says
    "olmoe": dict(cls="OlmoeConfig", **{**COMMON, "intermediate_size": 64}, num_experts=4, num_experts_per_tok=2,
                  rms_norm_eps=1e-5),
    # w1/w3/w2 under block_sparse_moe, q/k rows permuted in the file
    "mixtral": dict(cls="MixtralConfig", **{**COMMON, "intermediate_size": 64}, num_local_experts=4,
                    num_experts_per_tok=2),
    # fused qkv_proj / gate_up_proj (ffn_up in the file), half the head dim rotated
    "phi3": dict(cls="Phi3Config", **COMMON, partial_rotary_factor=0.5),
    # LongRoPE within original_max_position_embeddings, where its short factors apply (tpserve's refusal past it)
    "phi3_longrope": dict(cls="Phi3Config", **COMMON, original_max_position_embeddings=64, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=64,
        short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
        long_factor=[1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 40.0])),
    # norms stored as 1 + w, soft-capping, alternating sliding (window 8, which the long prompt outgrows) and global
    # layers, tied head; GGUF has no query_pre_attn_scalar: llama.cpp scales by head_dim ** -0.5
    "gemma2": dict(cls="Gemma2Config", **COMMON, head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0, sliding_window=8, tie_word_embeddings=True),
}
ALWAYS_F32 = ("_norm.weight", ".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight")  # the converter's F32 tensors


def types_of(default, **by_name):
    """A write_gguf `types`: `default`, or by_name[key] for a GGUF name holding `key`; routers and norms F32."""
    def types(name, t):
        if name.endswith(ALWAYS_F32):
            return Q.F32
        return next((q for key, q in by_name.items() if key in name), default)
    return types


q8 = types_of(Q.Q8_0)
q4 = types_of(Q.Q4_0, attn_v=Q.Q8_0, token_embd=Q.Q8_0)  # a fused q/k/v mixing both: served as int8, exactly
q4_moe = types_of(Q.Q4_0, attn_v=Q.Q8_0, token_embd=Q.Q8_0, ffn_up_exps=Q.Q8_0)  # experts: int8 gate/up, int4 down


def q4_k_m(name, t):
    """llama-quantize's Q4_K_M choice: Q6_K for v and the LM head, Q4_K elsewhere (experts: kquant_experts)."""
    return Q.F32 if name.endswith(ALWAYS_F32) else Q.Q6_K if ".attn_v." in name or name == "output.weight" else Q.Q4_K


f16 = types_of(Q.F16)
f32 = types_of(Q.F32)

# name: (checkpoint, types, converter options); "hf": compared with transformers on the original checkpoint
FILES = {
    "qwen2moe-q8": ("qwen2_moe", q8, dict(squeeze_shexp_gate=True)),
    "qwen3moe-q4": ("qwen3_moe", q4_moe, {}),
    "qwen3moe-q4km": ("qwen3_moe_256", q4_k_m, dict(kquant_experts=True)),
    "phi3-q4": ("phi3", q4, {}),
    "gemma2-q8": ("gemma2", q8, {}),
    "olmoe-f16": ("olmoe", f16, {}),
    "mixtral-f16": ("mixtral", f16, {}),
    "qwen2moe-f16": ("qwen2_moe", f16, {}),
    "phi3_longrope-f32": ("phi3_longrope", f32, {}),
}
VS_HF = {"olmoe-f16", "mixtral-f16", "qwen2moe-f16", "phi3_longrope-f32"}
# what transformers' GGUF config mapping leaves out (it would use its config class's defaults)
TRANSFORMERS_EXTRA = {
    "qwen2moe-q8": dict(moe_intermediate_size=64, shared_expert_intermediate_size=64),
    "qwen3moe-q4": dict(moe_intermediate_size=64),
    "qwen3moe-q4km": dict(moe_intermediate_size=256),
    "phi3-q4": dict(partial_rotary_factor=0.5),
    "gemma2-q8": dict(query_pre_attn_scalar=16, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
}
JOB_OPTIONS = {"phi3_longrope-f32": {"max_model_len": 64}}
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(30, 50))]
MAX_TOKENS = 10


def randomize(folder: Path) -> None:
    """Random values for the 1-D tensors (norms, biases: transformers initialises them to 1 or 0, which would hide a
    norm offset or a missing bias), in the checkpoint's dtype."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if t.dim() == 1:
            tensors[name] = (t.float() + 0.3 * torch.randn(t.shape, generator=gen)).to(t.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})


def converted(hf: Path, squeeze_shexp_gate: bool = False) -> tuple[str, dict[str, np.ndarray], dict]:
    """(GGUF architecture, tensors under their GGUF names, metadata beyond write_gguf's common keys), as
    convert_hf_to_gguf.py makes them from the checkpoint in `hf` (its modify_tensors / set_gguf_parameters for the
    architecture; names by gguf-py's tensor map, which the converter maps with). `squeeze_shexp_gate`: Qwen2-MoE's
    shared-expert gate as [hidden], as older converters wrote it (transformers' GGUF loader expects that)."""
    from safetensors.numpy import load_file

    cfg = json.loads((hf / "config.json").read_text())
    model_type, layers = cfg["model_type"], cfg["num_hidden_layers"]
    arch = GGUF_ARCH[model_type]
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], layers)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, t in load_file(str(hf / "model.safetensors")).items():
        if t.dtype not in (np.float16, np.float32):  # (the converter's transforms run in float16 or float32)
            t = t.astype(np.float32)
        if name == "lm_head.weight" and (model_type == "gemma2" or cfg.get("tie_word_embeddings")):
            continue  # Gemma2Model.filter_tensors; a tied head is not in the checkpoint
        if model_type == "mixtral" and name.endswith(("q_proj.weight", "k_proj.weight")):  # LlamaModel.permute
            t = permute(t, heads if ".q_proj." in name else kv_heads)
        if model_type == "gemma2" and name.endswith("norm.weight"):  # Gemma2Model.modify_tensors
            t = t + t.dtype.type(1)
        m = re.fullmatch(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight", name)
        if m:  # stacked per layer and projection, experts in order
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = t
            continue
        base, suffix = name.rsplit(".", 1)
        out[f"{names.get_name(base)}.{suffix}"] = t.astype(np.float32)
    for (bid, proj), by_expert in sorted(experts.items()):
        merged = (f"layers.{bid}.feed_forward.experts.{proj}" if model_type == "mixtral"
                  else f"model.layers.{bid}.mlp.experts.{proj}")
        out[f"{names.get_name(merged)}.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)]).astype(np.float32)
    for bid in range(layers if squeeze_shexp_gate else 0):
        out[f"blk.{bid}.ffn_gate_inp_shexp.weight"] = out[f"blk.{bid}.ffn_gate_inp_shexp.weight"].reshape(-1)
    meta: dict = {}
    experts_count = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts_count:  # TextModel.set_gguf_parameters
        meta.update({f"{arch}.expert_count": experts_count, f"{arch}.expert_used_count": cfg["num_experts_per_tok"]})
    if cfg.get("head_dim") and model_type != "phi3":
        meta[f"{arch}.attention.key_length"] = meta[f"{arch}.attention.value_length"] = cfg["head_dim"]
    if model_type in ("qwen2_moe", "qwen3_moe"):
        meta[f"{arch}.expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    if model_type == "qwen2_moe":
        meta[f"{arch}.expert_shared_feed_forward_length"] = cfg["shared_expert_intermediate_size"]
    elif model_type == "mixtral":
        meta.update({"llama.vocab_size": cfg["vocab_size"], "llama.rope.dimension_count": cfg.get("head_dim")
                     or cfg["hidden_size"] // heads})
    elif model_type == "olmoe":
        meta["olmoe.attention.layer_norm_rms_epsilon"] = 1e-5
    elif model_type == "phi3":
        rope = cfg["rope_parameters"]
        rot = int(rope.get("partial_rotary_factor", 1.0) * cfg["hidden_size"]) // heads
        meta.update({"phi3.rope.scaling.original_context_length": cfg.get("original_max_position_embeddings") or
                     rope.get("original_max_position_embeddings"), "phi3.rope.dimension_count": rot,
                     "phi3.attention.sliding_window": cfg.get("sliding_window") or 0})
        if rope.get("rope_type") == "longrope":  # Phi3MiniModel.generate_extra_tensors
            original = rope["original_max_position_embeddings"]
            scale = cfg["max_position_embeddings"] / original
            meta["phi3.rope.scaling.attn_factor"] = float(np.sqrt(1 + np.log(scale) / np.log(original)))
            out["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
            out["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    elif model_type == "gemma2":  # (its own set_gguf_parameters: no rope.freq_base)
        meta.update({"gemma2.rope.freq_base": None,
                     "gemma2.attn_logit_softcapping": float(cfg["attn_logit_softcapping"]),
                     "gemma2.final_logit_softcapping": float(cfg["final_logit_softcapping"]),
                     "gemma2.attention.sliding_window": cfg["sliding_window"]})
    return arch, out, meta


def convert(hf: Path, out: Path, types, kquant_experts: bool = False, **options) -> Path:
    """The checkpoint in `hf` as llama.cpp's converter would write it (converted), at `out`. `kquant_experts`: the
    experts in Q4_K (gate, up) and Q6_K (down), llama-quantize's Q4_K_M choice: random blocks, as test_gguf writes
    K-quants (gguf-py cannot quantize to them)."""
    arch, tensors, meta = converted(hf, **options)
    blocks = {}
    for name, t in tensors.items():
        if kquant_experts and "_exps." in name:
            qtype = Q.Q6_K if "_down_" in name else Q.Q4_K
            seed = sum(map(ord, name))
            blocks[name] = (np.stack([random_blocks(qtype, t.shape[1:], seed + e) for e in range(len(t))]), qtype)
    return write_converted(hf, out, arch, tensors, meta, types, blocks)


def write_converted(hf: Path, out: Path, arch: str, tensors: dict[str, np.ndarray], meta: dict, types,
                    blocks: dict | None = None) -> Path:
    """test_gguf's writer on converted tensors (staged next to `out` with the checkpoint's config and tokenizer);
    `blocks`: GGUF name -> (raw blocks, type), written instead."""
    from safetensors.numpy import save_file

    staged = out.parent / "staged"
    staged.mkdir(parents=True)
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(hf / f, staged / f)
    save_file(tensors, str(staged / "model.safetensors"))
    path = write_gguf(staged, out, types, arch=arch, meta=meta, replace=blocks)
    shutil.rmtree(staged)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-arch")
    hf = {}
    with pytest.MonkeyPatch.context() as mp:
        for name, spec in SPECS.items():
            mp.setitem(tiny.ARCHS, name, spec)
            # float16 values: an F16 file holds exactly the checkpoint's numbers
            hf[name] = make_checkpoint(root / f"hf-{name}", name, dtype=torch.float16)
            randomize(hf[name])
    out = {key: convert(hf[src], root / key / f"{key}.gguf", types, **options)
           for key, (src, types, options) in FILES.items()}
    return hf, out


def reference(key: str, path: Path, prompts: list[list[int]]) -> tuple[Path, list]:
    """transformers' greedy tokens and log-probabilities for each prompt (tiny.check_greedy's reference entry): on the
    GGUF file (dequantized by transformers), or for VS_HF files on the original checkpoint at `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(dtype=torch.float32, experts_implementation="eager")  # its experts loop: tpserve's order of sums
    if key in VS_HF:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
    else:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        config.pad_token_id = None  # (Phi3Config's default, 32000, is outside the tiny vocabulary)
        for field, value in TRANSFORMERS_EXTRA[key].items():
            if field == "partial_rotary_factor":  # a rope parameter in transformers 5
                config.rope_parameters[field] = value
            setattr(config, field, value)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config, **kw)
    model.generation_config.eos_token_id = None
    runs = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only wait for each other (seconds when the cores are busy)
    try:
        with torch.inference_mode():
            for prompt in prompts:
                out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long), output_logits=True,
                                     return_dict_in_generate=True)
                runs.append((out.sequences[0, len(prompt):].tolist(),
                             torch.log_softmax(torch.stack(out.logits, 0)[:, 0].float(), dim=-1)))
    finally:
        torch.set_num_threads(threads)
    return path, runs


def serve(keys: list[str], out: dict, tp: int = 1, **llm) -> list[dict]:
    """run_llm on the files `keys`, the quantized ones on torch's paths (module docstring)."""
    jobs = [{"model": str(out[key]), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "logprobs": 5, "llm": llm,
             **JOB_OPTIONS.get(key, {})} for key in keys]
    env = None if set(keys) <= VS_HF else {"TPSERVE_KERNELS": "none"}
    return run_llm(tp, jobs, timeout=400, env=env)


def test_greedy_tokens_equal_transformers(files):
    hf, out = files
    keys = [k for k in FILES if k not in VS_HF] + [k for k in FILES if k in VS_HF]
    results = serve(keys[:-len(VS_HF)], out) + serve(keys[-len(VS_HF):], out)
    differ = {}
    for key, result in zip(keys, results, strict=True):
        ref = {key: reference(key, hf[FILES[key][0]] if key in VS_HF else out[key], PROMPTS)}
        try:  # the same greedy tokens, the top log-probabilities within 1e-4
            check_greedy(key, result, ref)
        except AssertionError as e:
            differ[key] = (str(e)[:300], [o["token_ids"] for o in result.get("outputs", [])],
                           [tokens for tokens, _ in ref[key][1]])
    assert not differ, differ


@pytest.mark.slow
def test_moe_at_tp2_equals_transformers(files):
    """Qwen3-MoE at TP 2, each expert's intermediate dimension split over the ranks (each reads its rows of every
    expert's gate/up blocks and its input blocks of every down: Q4_0's 32 whole, Q6_K's 256 cut in two, read whole and
    zero-padded), and whole experts per rank (expert parallelism)."""
    _, out = files
    keys = ["qwen3moe-q4", "qwen3moe-q4km"]
    ref = {key: reference(key, out[key], PROMPTS) for key in keys}
    for ep in (False, True):
        for key, result in zip(keys, serve(keys, out, tp=2, enable_expert_parallel=ep), strict=True):
            check_greedy(key, result, ref)
            assert result["bytes_read"] < result["checkpoint_bytes"] * 0.8, (key, ep, result["bytes_read"])


def test_an_expert_is_read_from_its_own_bytes(files):
    """Each expert of a stacked [experts, out, in] tensor is a tensor of its own: its blocks (Q8_0, Q4_0) dequantize
    bit-equal to gguf-py's dequantization of that expert, its floats equal it, and a read costs that expert's bytes
    only."""
    from loaders.gguf_file import GGUFCheckpoint
    from sharding.layers import quant

    _, out = files
    cases = [("qwen2moe-q8", "blk.1.ffn_gate_exps.weight", "model.layers.1.mlp.experts.2.gate_proj.weight", 0, 0),
             ("qwen3moe-q4", "blk.0.ffn_down_exps.weight", "model.layers.0.mlp.experts.3.down_proj.weight", 1, 0),
             ("qwen2moe-f16", "blk.0.ffn_up_exps.weight", "model.layers.0.mlp.experts.1.up_proj.weight", 0, 0),
             ("mixtral-f16", "blk.1.ffn_down_exps.weight", "model.layers.1.block_sparse_moe.experts.0.w2.weight", 1, 0)]
    for key, stacked, name, dim, row in cases:
        reader = gguf.GGUFReader(out[key])
        t = next(t for t in reader.tensors if t.name == stacked)
        full = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type).astype(np.float32))
        expert = int(name.split(".experts.")[1].split(".")[0])
        want = full[expert, row:row + 64]
        with GGUFCheckpoint(out[key]) as ckpt:
            info = ckpt.tensors[name]
            assert info.shape == tuple(want.shape) and info.nbytes == int(t.n_bytes) // full.shape[0] // (
                full.shape[1] // 64), (key, info)
            if ckpt.quant_type(name):
                got = quant.dequantize(quant.read_blocks(ckpt, [(name, dim, [(32, 64)])]))
                assert torch.equal(got, want.narrow(dim, 32, 32)), key
                assert ckpt.bytes_read == info.nbytes // 2, (key, ckpt.bytes_read)
            else:
                assert torch.equal(ckpt.read(name).float(), want), key
                assert ckpt.bytes_read == info.nbytes, key
                # `index`: the slice along dimension 0, its bytes only (as a safetensors Checkpoint reads it)
                assert torch.equal(ckpt.read(name, 0, [(8, 40)], index=5).float(), want[5, 8:40]), key
                assert ckpt.bytes_read == info.nbytes + 32 * info.nbytes // info.shape[0] // info.shape[1]


def test_quantized_experts_load_as_blocks(files):
    """Every expert linear of a Q8_0 / Q4_0 file holds the file's blocks (int8 / int4; a gate and up mixing Q4_0 and
    Q8_0 as int8), and no float weight; the MoE layers compute, on the compiled kernels (int8 activations where the
    CPU has VNNI) and on the loop alike, what the dequantized blocks compute."""
    import torch.nn.functional as F

    from sharding.cpu import kernels
    from sharding.layers import quant
    from sharding.layers.moe import ExpertLinear, SparseMoe
    from tests.helpers.in_process import loaded_model

    _, out = files
    rounded = kernels.build_kernels() and quant.int8_activations()
    for key, modes in (("qwen2moe-q8", {"int8"}), ("qwen3moe-q4", {"int8", "int4"})):
        model = loaded_model(out[key])
        experts = [m for m in model.modules() if isinstance(m, ExpertLinear)]
        assert len(experts) == 2 * 2 * 4 and all(m.weight is None for m in experts), key
        assert {m.qweight.mode for m in experts} == modes, key
        if key == "qwen3moe-q4":  # gate/up: Q4_0 gate and Q8_0 up, served as int8; down Q4_0, int4
            for m in experts:
                assert m.qweight.mode == ("int4" if m.blocks[0].tensor.endswith("down_proj.weight") else "int8")
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
        for moe in (m for m in model.modules() if isinstance(m, SparseMoe)):
            weights, ids = moe.routing(moe.router(x))
            want = torch.zeros_like(x)
            for t, j in np.ndindex(*ids.shape):
                e = moe.experts[int(ids[t, j])]
                h = (int8_rounded(x[t:t + 1]) if rounded else x[t:t + 1]) @ quant.dequantize(e.gate_up.qweight).T
                gate, up = h.chunk(2, dim=-1)
                act = F.silu(gate) * up
                act = int8_rounded(act) if rounded else act
                want[t] += weights[t, j] * (act @ quant.dequantize(e.down.qweight).T)[0]
            got = moe.routed(x)
            moe._compiled = None  # the loop over the experts' linears
            assert torch.allclose(got, want, atol=1e-5) and torch.allclose(moe.routed(x), want, atol=1e-5), key
        if moe.shared is not None:  # Qwen2-MoE's shared expert: int8 blocks as well
            assert moe.shared.gate_up_proj.qweight.mode == moe.shared.down_proj.qweight.mode == "int8"


def test_config_from_metadata_matches_the_original(files):
    """hf_config: what the file's metadata says, and what llama.cpp assumes where it says nothing."""
    from transformers import AutoConfig

    from loaders.gguf_file import GGUFCheckpoint

    hf, out = files
    fields = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
              "shared_expert_intermediate_size", "norm_topk_prob", "query_pre_attn_scalar", "attn_logit_softcapping",
              "final_logit_softcapping", "sliding_window", "layer_types", "tie_word_embeddings", "rms_norm_eps",
              "original_max_position_embeddings")
    for key, (src, _, _) in FILES.items():
        with GGUFCheckpoint(out[key]) as ckpt:
            ours = ckpt.hf_config()
        theirs = AutoConfig.from_pretrained(str(hf[src]))
        assert ours.architectures == theirs.architectures, key
        for field in fields:
            if hasattr(theirs, field) and field != "head_dim" or field == "head_dim" and "head_dim" in SPECS[src]:
                want = getattr(theirs, field)
                if field == "rms_norm_eps":  # stored as float32
                    want = float(np.float32(want))
                assert getattr(ours, field) == want, (key, field, getattr(ours, field), want)
        for k, v in theirs.rope_parameters.items():  # partial rotary, LongRoPE factors, theta
            assert ours.rope_parameters.get(k) == pytest.approx(v), (key, k)


@pytest.fixture(scope="module")
def bad(files, tmp_path_factory):
    hf, _ = files
    root = tmp_path_factory.mktemp("gguf-arch-bad")
    made = {}
    arch, tensors, meta = converted(hf["mixtral"])
    for bid in range(2):  # convert_hf_to_gguf.py --fuse-qkv
        tensors[f"blk.{bid}.attn_qkv.weight"] = np.concatenate(
            [tensors.pop(f"blk.{bid}.attn_{p}.weight") for p in "qkv"])
    made["qkv"] = write_converted(hf["mixtral"], root / "qkv" / "qkv.gguf", arch, tensors, meta, f16)
    arch, tensors, meta = converted(hf["mixtral"])
    made["no-count"] = write_converted(hf["mixtral"], root / "no-count" / "no-count.gguf", arch, tensors,
                                       {**meta, "llama.expert_count": 0}, f16)
    made["arch"] = write_converted(hf["mixtral"], root / "arch" / "arch.gguf", "deepseek2", tensors,
                                   {k.replace("llama.", "deepseek2."): v for k, v in meta.items()}, f16)
    return made


def test_what_is_not_served_is_refused_with_one_line(bad):
    msg = error_of(bad["qkv"])
    assert "attn_qkv" in msg and "--fuse-qkv" in msg and "phi3" in msg, msg
    msg = error_of(bad["no-count"])
    assert "ffn_down_exps" in msg and "llama.expert_count" in msg, msg
    msg = error_of(bad["arch"])
    assert "'deepseek2' is not served; served: llama, qwen2, qwen3, qwen2moe, qwen3moe, olmoe, phi3, gemma2" in msg, msg


def test_the_tokenizer_of_an_architecture_transformers_does_not_load(files):
    """olmoe: transformers' GGUF loader refuses the architecture, the tokenizer is built from the file alone."""
    from transformers import AutoTokenizer

    from loaders.gguf_file import load_tokenizer

    hf, out = files
    ours, theirs = load_tokenizer(out["olmoe-f16"]), AutoTokenizer.from_pretrained(str(hf["olmoe"]))
    for text in tiny.TEXT:
        assert ours.encode(text) == theirs.encode(text), text
    assert ours.chat_template == tiny.CHAT_TEMPLATE and ours.eos_token == theirs.eos_token
