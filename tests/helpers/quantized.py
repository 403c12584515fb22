"""Tiny pre-quantized Hugging Face checkpoints, written the way the real tools write them, and their float references.

Every writer takes a float checkpoint (a tiny Llama from `make_source`, i.e. tests/tiny.py's make_checkpoint) and writes
a quantized copy into another folder: the tokenizer files copied, config.json with the format's `quantization_config`.

    from helpers.quantized import make_source, make_compressed_tensors, make_awq, make_gptq, make_gpt_oss_mxfp4
    src = make_source(tmp / "src")                       # bf16 Llama: hidden 256, intermediate 384, 8 heads, 4 KV heads
    ct = make_compressed_tensors(src, tmp / "w4", "W4A16")
    awq = make_awq(src, tmp / "awq")
    gptq = make_gptq(src, tmp / "gptq", desc_act=True)
    oss = make_gpt_oss_mxfp4(tmp / "oss", source=tmp / "oss-bf16")
    ref = reference_float(ct, tmp / "w4-f32")            # float32 checkpoint holding the exact dequantized weights

Formats (W is the nn.Linear weight [out, in]; "exact" means computed in float32, where every product below is exact):

* compressed-tensors, written by compressed-tensors itself (QuantizationConfig / apply_quantization_config /
  calculate_qparams / ModelCompressor, as llm-compressor's `oneshot` with a round-to-nearest QuantizationModifier
  does: a memoryless min-max observer per weight, see `make_compressed_tensors`). Scales are in the source dtype.
    pack-quantized (int4 / int8 weights, no or 16-bit activations): `weight_packed` int32 [out, ceil(in*bits/32)],
      32/bits codes per int32 along the input dim, element j of a word at bits [bits*j, bits*j+bits) (low first),
      each code stored as q + 2^(bits-1) (unsigned); `weight_scale` [out, in/group] (group) or [out, 1] (channel);
      `weight_shape` int64 [2] = (out, in); asymmetric only: `weight_zero_point` int32 [ceil(out*bits/32), in/group or
      1], the signed zero points packed the same way but along the OUTPUT dim (dim 0).
      W[o, i] = (q[o, i] - zp[o, g(i)]) * scale[o, g(i)], q and zp signed (in [-2^(bits-1), 2^(bits-1))), zp = 0 if sym.
    naive-quantized / int-quantized (W8A8): `weight` int8 [out, in], `weight_scale` [out, 1]; W = (q - zp) * scale.
    float-quantized (FP8): `weight` float8_e4m3fn [out, in], `weight_scale` [out, 1] (channel) or [1] (tensor);
      W = float(q) * scale. Dynamic activation quantization stores nothing.
* AWQ GEMM (`make_awq`), AutoAWQ's layout: `qweight` int32 [in, out/8], `qzeros` int32 [in/group, out/8], `scales`
  float16 [in/group, out]; nibble k (bits 4k..4k+3) of int32 column c holds output column 8c + [0,2,4,6,1,3,5,7][k].
  W[o, i] = (q[i, o] - z[i/group, o]) * s[i/group, o], q and z unsigned in [0, 15].
* GPTQ (`make_gptq`), auto-gptq / GPTQModel's layout: `qweight` int32 [in/8, out], nibble k of row r holds input row
  8r + k (low bits first); `qzeros` int32 [groups, out/8], nibble k of column c holds output column 8c + k; `scales`
  float16 [groups, out]; `g_idx` int32 [in]. v1 (checkpoint_format "gptq") stores the zero points minus one (GPTQModel
  subtracts 0x11111111 from each packed word; loaders add it back), v2 ("gptq_v2") stores them as they are.
  W[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o], z = stored + 1 for v1 (sym: z = 8, stored 7).
* MXFP4 gpt-oss experts (`make_gpt_oss_mxfp4`), see its docstring.

The float references (`dequantized_state`, `reference_float`) hold exactly these float32 values; `rounding=` rounds
them once to a dtype instead, which is what the libraries' own dequantizers return: compressed-tensors' decompress()
computes in the scale's dtype (bf16 here: transformers' CompressedTensorsConfig(dequantize=True) load gives the
bf16-rounded values; its default route, which decompresses into a float32 model's float32 scales on the first forward,
gives the exact ones), AutoAWQ's dequantize_gemm and GPTQModel's dequantize_weight compute in float16. MXFP4's values
are exact in any float dtype wide enough.

The libraries' own pack / unpack code for AWQ and GPTQ comes from their sdists on PyPI (neither installs here: both
want CUDA builds), downloaded at first use and cached in $TPSERVE_HOME/sdist-<name>-<version>/ (default
~/.cache/tpserve) under a file lock (tests/helpers/sdist.py, as the chat templates are): `awq_library()` imports AutoAWQ's
awq/utils/packing_utils.py and awq/modules/linear/gemm.py (pure torch), `gptq_library()` compiles GPTQModel's own
pack / dequantize / v1<->v2 functions out of its sources (its package does not import without its compiled
dependencies) onto a small stand-in for its QuantLinear.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from helpers import sdist

# hidden 256 = 2 groups of 128, intermediate 384 = 3 groups of 128 (one per rank at TP 3); 8 heads / 4 KV heads of 32
LLAMA_SIZES = dict(hidden_size=256, intermediate_size=384, num_attention_heads=8, num_key_value_heads=4, head_dim=32)

_WEIGHT_FILES = ("config.json", "model.safetensors.index.json")


# ----------------------------------------------------------------------------------------------------------- common


@contextlib.contextmanager
def single_threaded():
    """torch on one intra-op thread for the duration: these tensors are tiny, and two threads only spin against the
    suite's other workers on a 2-core machine (4x slower under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def make_source(folder: Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16, **overrides) -> Path:
    """The float source: tests/tiny.py's random Llama at LLAMA_SIZES (overridable), in `dtype`."""
    from tiny import make_checkpoint

    return make_checkpoint(Path(folder), "llama", dtype=dtype, seed=seed, **{**LLAMA_SIZES, **overrides})


def read_state(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint folder (all shards)."""
    state = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


def read_config(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def _write(folder: Path, state: dict[str, torch.Tensor], config: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.safetensors"):
        old.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    tensors = {k: v.contiguous() for k, v in state.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def _copy_side_files(src: Path, dst: Path, overwrite: bool = True) -> None:
    """Tokenizer, generation config and the like: every file but the weights and config.json."""
    for path in Path(src).iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in _WEIGHT_FILES:
            if overwrite or not (dst / path.name).exists():
                shutil.copy2(path, dst / path.name)


def linear_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The decoder layers' projections (q/k/v/o, gate/up/down): what every format quantizes (lm_head never)."""
    return sorted(k[: -len(".weight")] for k, t in state.items()
                  if k.startswith("model.layers.") and k.endswith("_proj.weight") and t.dim() == 2)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words holding 32-bit patterns -> int32 with the same bits."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., n] -> int64 [..., n * 32/bits] unsigned codes, element j of a word at bits [bits*j, bits*j+bits)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    codes = (words.to(torch.int64).unsqueeze(-1) >> shifts) & (2**bits - 1)
    return codes.reshape(*words.shape[:-1], words.shape[-1] * per)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of _unpack along the last dim: codes [..., n] (unsigned) -> int32 [..., n * bits/32]."""
    per = 32 // bits
    codes = codes.to(torch.int64).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    return _to_int32((codes << shifts).sum(-1))


def _round_to(t: torch.Tensor, rounding: torch.dtype | None) -> torch.Tensor:
    return t if rounding is None else t.to(rounding).float()


# ------------------------------------------------------------------------------------------------ compressed-tensors

# name -> (weights, input activations, kv_cache_scheme, forced format, 2:4 sparsity), see ct_scheme()
CT_SCHEMES = ("W4A16", "W4A16_ASYM", "W4A16_G32", "W4A16_G64", "W4A16_CHANNEL", "W8A16", "W8A16_G128", "W8A16_ASYM",
              "FP8", "FP8_TENSOR", "NAIVE_INT8", "W8A8", "W4A16_KV8", "SPARSE_2_4")


def ct_scheme(name: str) -> dict:
    """The compressed-tensors quantization of scheme `name`: dict(weights=QuantizationArgs, input_activations=
    QuantizationArgs | None, kv_cache_scheme=QuantizationArgs | None, format=str | None, sparse_2_4=bool).

    W4A16 and W4A16_ASYM are compressed-tensors' presets as llm-compressor's `scheme="W4A16"` takes them (int4 group
    128, sym / asym), FP8 is the FP8_DYNAMIC preset (float8 e4m3 weights with per-channel scales, dynamic per-token
    float8 activations) and W8A8 the INT8 preset (int8 channel weights, dynamic per-token int8 activations). Note
    that compressed-tensors 0.20's own "W8A16" preset is int8 group 128 (our W8A16_G128): our W8A16 is int8
    channel, as llm-compressor's W8A16 preset used to be. FP8_TENSOR: FP8_DYNAMIC with a per-tensor weight scale.
    NAIVE_INT8: W8A16's int8 channel weights saved in the naive-quantized format (a plain int8 `weight`).
    W4A16_KV8: W4A16 with llm-compressor's usual kv_cache_scheme (float8, per tensor, static: `k_scale`, `v_scale`).
    SPARSE_2_4: W4A16 of 2:4-pruned weights, with a `sparsity_config` (see make_compressed_tensors)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    def preset(key):
        return copy.deepcopy(PRESET_SCHEMES[key])

    def ints(bits, strategy, group=None, symmetric=True):
        return QuantizationArgs(num_bits=bits, type="int", strategy=strategy, group_size=group, symmetric=symmetric,
                                dynamic=False)

    fp8_dynamic = preset("FP8_DYNAMIC")
    fp8_tensor = copy.deepcopy(fp8_dynamic)
    fp8_tensor["weights"] = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
    table = {
        "W4A16": (preset("W4A16"), None),
        "W4A16_ASYM": (preset("W4A16_ASYM"), None),
        "W4A16_G32": (dict(weights=ints(4, "group", 32)), None),
        "W4A16_G64": (dict(weights=ints(4, "group", 64)), None),
        "W4A16_CHANNEL": (dict(weights=ints(4, "channel")), None),
        "W8A16": (dict(weights=ints(8, "channel")), None),
        "W8A16_G128": (dict(weights=ints(8, "group", 128)), None),
        "W8A16_ASYM": (dict(weights=ints(8, "channel", symmetric=False)), None),
        "FP8": (fp8_dynamic, None),
        "FP8_TENSOR": (fp8_tensor, None),
        "NAIVE_INT8": (dict(weights=ints(8, "channel")), "naive-quantized"),
        "W8A8": (preset("W8A8"), None),
        "W4A16_KV8": (preset("W4A16"), None),
        "SPARSE_2_4": (preset("W4A16"), None),
    }
    if name not in table:
        raise KeyError(f"unknown scheme {name!r}: {list(table)}")
    args, fmt = table[name]
    kv = None
    if name == "W4A16_KV8":
        kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
    return dict(weights=args["weights"], input_activations=args.get("input_activations"), kv_cache_scheme=kv,
                format=fmt, sparse_2_4=name == "SPARSE_2_4")


def _weight_min_max(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """llm-compressor's weight observation (observers/helpers.py flatten_for_calibration + the memoryless min-max
    observer): the weight reshaped to (1, *qparam_shape, elements) and reduced over the first and last dims."""
    strategy = str(args.strategy)
    if strategy == "tensor":
        observed = weight.reshape(1, 1, -1)
    elif strategy == "channel":
        observed = weight.unsqueeze(-2).unsqueeze(0)
    elif strategy in ("group", "tensor_group"):
        observed = weight.unflatten(-1, (-1, args.group_size)).unsqueeze(0)
    else:
        raise NotImplementedError(strategy)
    return torch.amin(observed, dim=(0, -1)), torch.amax(observed, dim=(0, -1))


def _prune_2_4(weight: torch.Tensor) -> torch.Tensor:
    """2:4 magnitude pruning along the input dim: of every 4 consecutive inputs the 2 smallest |w| become 0."""
    groups = weight.reshape(weight.shape[0], -1, 4)
    keep = groups.abs().float().topk(2, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return (groups * mask).reshape(weight.shape)


@contextlib.contextmanager
def _quiet_compressed_tensors():
    from loguru import logger

    logger.disable("compressed_tensors")
    try:
        yield
    finally:
        logger.enable("compressed_tensors")


def _calibration_ids(src: Path) -> list[torch.Tensor]:
    from tiny import TEXT
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    return [torch.tensor([tok(line)["input_ids"]]) for line in TEXT]


def make_compressed_tensors(src: Path, dst: Path, scheme: str) -> Path:
    """A compressed-tensors checkpoint of `src` quantized with `scheme` (see ct_scheme, CT_SCHEMES), ignore
    ["lm_head"], written as llm-compressor's oneshot(QuantizationModifier(scheme=..., ignore=["lm_head"])) with no
    calibration data (round to nearest) writes it, by compressed-tensors itself:

    1. the model loaded in the source dtype; apply_quantization_config(QuantizationConfig(config_groups={"group_0":
       QuantizationScheme(targets=["Linear"], ...)}, ignore=["lm_head"])) as the modifier does;
    2. each weight observed as llm-compressor's memoryless min-max observer does (`_weight_min_max`), its scale and
       zero point from compressed_tensors.quantization.utils.calculate_qparams (so in the weights' dtype, bf16),
       written into the module's weight_scale / weight_zero_point;
    3. W4A16_KV8: each attention's `k_scale` / `v_scale` [1] (bf16) from a min-max observation of its post-RoPE keys
       and its values over tests/tiny.py's TEXT lines, through calculate_qparams (see _calibrate_kv: compressed-tensors
       0.20 cannot hook transformers 5.24's attention itself), and the config's kv_cache_scheme;
    4. ModelCompressor.from_pretrained_model(model, quantization_format) -> compress_model(model) ->
       model.save_pretrained(dst) -> compressor.update_config(dst), llm-compressor's save_pretrained wrapper.

    config.json's quantization_config is then compressed-tensors': quant_method "compressed-tensors", format
    ("pack-quantized", "float-quantized", "naive-quantized", "int-quantized"), config_groups {"group_0": {targets,
    weights, input_activations, output_activations, format}}, ignore ["lm_head"], kv_cache_scheme, quantization_status
    "compressed", sparsity_config {}, transform_config {}, version.

    SPARSE_2_4: compressed-tensors 0.20 no longer writes sparsity configs (update_config always writes
    "sparsity_config": {}, and sparse compressors were removed after 0.14), so the weights are 2:4-pruned before the
    W4A16 quantization and the sparsity_config is filled in afterwards from compressed-tensors' own
    SparsityCompressionConfig model (format "dense": the 2:4 weights are stored dense (packed int4), as llm-compressor
    writes a sparse model it does not sparse-compress): {"format": "dense", "global_sparsity": ..., "ignore":
    ["lm_head"], "sparsity_structure": "2:4", "targets": ["Linear"]}."""
    from compressed_tensors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationScheme, QuantizationStatus,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from compressed_tensors.utils import update_offload_parameter
    from transformers import AutoModelForCausalLM

    src, dst = Path(src), Path(dst)
    spec = ct_scheme(scheme)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype="auto")
    model.eval()
    if spec["sparse_2_4"]:
        with torch.no_grad():
            for name, module in model.named_modules():
                if isinstance(module, torch.nn.Linear) and name != "lm_head":
                    module.weight.copy_(_prune_2_4(module.weight))
    group = QuantizationScheme(targets=["Linear"], weights=spec["weights"], input_activations=spec["input_activations"])
    config = QuantizationConfig(config_groups={"group_0": group}, quantization_status=QuantizationStatus.INITIALIZED,
                                ignore=["lm_head"])  # the KV cache scheme: _calibrate_kv
    apply_quantization_config(model, config, show_progress=False)

    with torch.no_grad():
        quantized = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None]
        for module in quantized:
            args = module.quantization_scheme.weights
            if args is None or not isinstance(module, torch.nn.Linear):
                continue
            scale, zero_point = calculate_qparams(*_weight_min_max(module.weight, args), args)
            update_offload_parameter(module, "weight_scale", scale)
            if hasattr(module, "weight_zero_point"):
                update_offload_parameter(module, "weight_zero_point", zero_point)
        if spec["kv_cache_scheme"] is not None:
            _calibrate_kv(model, _calibration_ids(src), spec["kv_cache_scheme"])
        for module in quantized:
            module.quantization_status = QuantizationStatus.FROZEN

    with _quiet_compressed_tensors():  # NAIVE_INT8: "the provided format does not match the inferred", as intended
        compressor = ModelCompressor.from_pretrained_model(model, quantization_format=spec["format"])
        compressor.compress_model(model)
    if spec["kv_cache_scheme"] is not None:  # what QuantizationConfig.from_pretrained finds on hooked attentions
        compressor.quantization_config.kv_cache_scheme = spec["kv_cache_scheme"]
    shutil.rmtree(dst, ignore_errors=True)
    model.save_pretrained(str(dst))
    compressor.update_config(str(dst))
    _copy_side_files(src, dst, overwrite=False)

    if spec["sparse_2_4"]:
        from compressed_tensors.config import DenseSparsityConfig

        state = read_state(src)
        total = sum(t.numel() for t in state.values())
        zeros = sum(t.numel() // 2 for name, t in state.items() if name.endswith("_proj.weight"))
        sparsity = DenseSparsityConfig(targets=["Linear"], ignore=["lm_head"], global_sparsity=zeros / total,
                                       sparsity_structure="2:4")
        cfg = read_config(dst)
        cfg["quantization_config"]["sparsity_config"] = sparsity.model_dump()
        (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return dst


def _calibrate_kv(model, batches: list[torch.Tensor], args) -> None:
    """Static per-tensor k/v scales, registered on each attention as compressed-tensors' initialize_qparams does
    (`k_scale`, `v_scale` [1] in the weights' dtype, no zero point for symmetric) and computed by calculate_qparams
    from a min-max observation of the post-RoPE keys and the values over `batches` (llm-compressor's calibration,
    with the weights already fake-quantized). compressed-tensors 0.20 cannot hook transformers 5.24's attention for
    this (it looks for a `past_key_values` argument, renamed `cache`), so the states are observed through the cache's
    update(), which every attention calls with them."""
    import inspect

    from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams
    from compressed_tensors.quantization.utils import calculate_qparams
    from compressed_tensors.utils import update_offload_parameter
    from transformers import DynamicCache

    stats: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    class RecordingCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *rest, **kwargs):
            for kind, states in (("k", key_states), ("v", value_states)):
                lo, hi = states.amin().reshape(1), states.amax().reshape(1)
                if (layer_idx, kind) in stats:
                    lo, hi = torch.minimum(lo, stats[layer_idx, kind][0]), torch.maximum(hi, stats[layer_idx, kind][1])
                stats[layer_idx, kind] = (lo, hi)
            return super().update(key_states, value_states, layer_idx, *rest, **kwargs)

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    for ids in batches:
        model(ids, use_cache=True, **{name: RecordingCache(config=model.config)})
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    for layer in model.model.layers:
        attn = layer.self_attn
        for kind in ("k", "v"):
            initialize_qparams(attn, kind, args, observed_shape=(text.num_key_value_heads, None, head_dim),
                               observed_dtype=attn.k_proj.weight.dtype, force_zero_point=False)
            scale, _ = calculate_qparams(*stats[attn.layer_idx, kind], args)
            update_offload_parameter(attn, f"{kind}_scale", scale)


def _ct_weights_args(quantization_config: dict) -> dict:
    groups = list(quantization_config["config_groups"].values())
    if len(groups) != 1:
        raise NotImplementedError("one config group")
    return groups[0]["weights"]


def dequantize_ct(state: dict[str, torch.Tensor], quantization_config: dict, prefix: str) -> torch.Tensor:
    """The float32 weight [out, in] of module `prefix` of a compressed-tensors checkpoint, exactly (q - zp) * scale
    (see the module docstring), implemented here from the format, independently of compressed-tensors."""
    args = _ct_weights_args(quantization_config)
    bits = args["num_bits"]
    scale = state[f"{prefix}.weight_scale"].float()
    zp = state.get(f"{prefix}.weight_zero_point")
    if f"{prefix}.weight_packed" in state:
        if 32 % bits:
            raise NotImplementedError(f"{bits}-bit packing")
        out, inp = state[f"{prefix}.weight_shape"].tolist()
        offset = 2 ** (bits - 1)
        q = _unpack(state[f"{prefix}.weight_packed"], bits)[:, :inp] - offset
        if zp is not None:  # packed along the output dim
            zp = _unpack(zp.t(), bits)[:, :out].t() - offset
    else:
        q = state[f"{prefix}.weight"]
        out, inp = q.shape
    q = q.float()
    zp = torch.zeros(1) if zp is None else zp.float()
    if scale.dim() == 2 and scale.shape[1] > 1:  # groups
        group = inp // scale.shape[1]
        scale = scale.repeat_interleave(group, dim=1)
        zp = zp.repeat_interleave(group, dim=1) if zp.dim() == 2 else zp
    return (q - zp) * scale


# ----------------------------------------------------------------------------------------------------------------- AWQ

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble k of an int32 holds column 8c + AWQ_ORDER[k]


def awq_quantize(weight: torch.Tensor, group: int, zero_point: bool = True):
    """AutoAWQ's round-to-nearest (awq/quantize/quantizer.py pseudo_quantize_tensor) of an nn.Linear weight
    [out, in], without the activation-aware scale search (which only rescales W before this step): per group of
    `group` inputs, zero_point: s = max(max - min, 1e-5) / 15, z = clamp(-round(min / s), 0, 15); else s =
    max(|w|max, 1e-5) / 7 and z = 8 (the symmetric codes shifted to unsigned). The scale is rounded to float16 (its
    stored dtype) first, and z and the codes q = clamp(round(w / s) + z, 0, 15) made with it.
    Returns (q [out, in], z [out, in/group], s [out, in/group] float16), q and z int64."""
    out, inp = weight.shape
    w = weight.float().reshape(out, inp // group, group)
    if zero_point:
        hi, lo = w.amax(-1), w.amin(-1)
        s = ((hi - lo).clamp(min=1e-5) / 15).half()
        z = (-torch.round(lo / s.float())).clamp(0, 15)
    else:
        s = (w.abs().amax(-1).clamp(min=1e-5) / 7).half()
        z = torch.full(s.shape, 8.0)
    q = (torch.round(w / s.float().unsqueeze(-1)) + z.unsqueeze(-1)).clamp(0, 15)
    return q.reshape(out, inp).long(), z.long(), s


def awq_pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [rows, cols] (unsigned 4-bit) -> int32 [rows, cols/8] in AWQ's interleaved order."""
    rows, cols = codes.shape
    return _pack(codes.reshape(rows, cols // 8, 8)[:, :, AWQ_ORDER].reshape(rows, cols), 4)


def awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols/8] -> codes [rows, cols] (inverse of awq_pack)."""
    rows = words.shape[0]
    nibbles = _unpack(words, 4).reshape(rows, -1, 8)
    codes = torch.empty_like(nibbles)
    codes[:, :, AWQ_ORDER] = nibbles
    return codes.reshape(rows, -1)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 nn.Linear weight [out, in]: W[o, i] = (q[i, o] - z[i/group, o]) * s[i/group, o], exactly."""
    group = qweight.shape[0] // scales.shape[0]
    q = awq_unpack(qweight).float()
    z = awq_unpack(qzeros).float().repeat_interleave(group, dim=0)
    return ((q - z) * scales.float().repeat_interleave(group, dim=0)).t().contiguous()


def make_awq(src: Path, dst: Path, group: int = 128, zero_point: bool = True) -> Path:
    """An AutoAWQ GEMM checkpoint of `src`: per projection `qweight` int32 [in, out/8], `qzeros` int32 [in/group,
    out/8], `scales` float16 [in/group, out] (awq_quantize, awq_pack; AutoAWQ's WQLinear_GEMM.from_linear layout, see
    awq_library), no `weight`; everything else as in `src`. quantization_config as AutoAWQ writes it: {"quant_method":
    "awq", "version": "gemm", "bits": 4, "group_size": group, "zero_point": zero_point, "modules_to_not_convert":
    null}. zero_point=False is for refusal tests: AutoAWQ's GEMM packing needs zero points (from_linear asserts them),
    so the symmetric codes are stored with qzeros = 8, which dequantizes right under either reading."""
    src, dst = Path(src), Path(dst)
    state = read_state(src)
    for p in linear_names(state):
        q, z, s = awq_quantize(state.pop(f"{p}.weight"), group, zero_point)
        state[f"{p}.qweight"] = awq_pack(q.t())
        state[f"{p}.qzeros"] = awq_pack(z.t())
        state[f"{p}.scales"] = s.t().contiguous()
    cfg = read_config(src)
    cfg["quantization_config"] = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": group,
                                  "zero_point": zero_point, "modules_to_not_convert": None}
    shutil.rmtree(dst, ignore_errors=True)
    _write(dst, state, cfg)
    _copy_side_files(src, dst)
    return dst


# ---------------------------------------------------------------------------------------------------------------- GPTQ


def gptq_g_idx(columns: int, group: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """g_idx [columns] int32: column i's group. Without act-order i // group; with it (columns quantized in the order
    perm) the position of i in perm // group, as GPTQ's desc_act writes it."""
    if perm is None:
        return (torch.arange(columns) // group).to(torch.int32)
    position = torch.empty(columns, dtype=torch.long)
    position[perm] = torch.arange(columns)
    return (position // group).to(torch.int32)


def gptq_quantize(weight: torch.Tensor, g_idx: torch.Tensor, sym: bool = True):
    """Round to nearest with GPTQ's quantizer parameters (GPTQModel quantization/quantizer.py Quantizer.find_params,
    4 bits, maxq 15) per group of columns (g_idx): xmin = min(w.min, 0), xmax = max(w.max, 0); sym: xmax = max(|xmin|,
    xmax), xmin = -xmax (if < 0), z = 8; an all-zero group gets (-1, 1); s = (xmax - xmin) / 15, rounded to float16
    (its stored dtype) before asym z = round(-xmin / s) and the codes q = clamp(round(w / s) + z, 0, 15) are made.
    Returns (q [out, in], z [out, groups], s [out, groups] float16), q and z int64."""
    out, inp = weight.shape
    w = weight.float()
    groups = int(g_idx.max()) + 1
    z = torch.empty(out, groups)
    s = torch.empty(out, groups, dtype=torch.float16)
    q = torch.empty(out, inp)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        wg = w[:, cols]
        xmin = wg.amin(1).clamp(max=0)
        xmax = wg.amax(1).clamp(min=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = torch.where(xmin < 0, -xmax, xmin)
        zero = (xmin == 0) & (xmax == 0)
        xmin, xmax = torch.where(zero, xmin - 1, xmin), torch.where(zero, xmax + 1, xmax)
        s[:, g] = ((xmax - xmin) / 15).half()
        sg = s[:, g].float()
        z[:, g] = torch.full_like(sg, 8.0) if sym else torch.round(-xmin / sg)
        q[:, cols] = (torch.round(wg / sg[:, None]) + z[:, g, None]).clamp(0, 15)
    return q.long(), z.long(), s


def gptq_pack(q: torch.Tensor, z: torch.Tensor, version: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight int32 [in/8, out], qzeros int32 [groups, out/8]) from q [out, in] and z [out, groups]: qweight packs 8
    input rows per int32 (row 8r + k at bits 4k), qzeros 8 output columns (column 8c + k at bits 4k); v1 subtracts
    0x11111111 from every packed zero word, as GPTQModel's convert_gptq_v2_to_v1_format_module does (the zero
    points minus one). A zero point of 0 would borrow across nibbles there, which loaders that add the 1 back per
    nibble (auto-gptq) misread: refused, so both readings agree on every fixture."""
    if version == 1 and bool((z == 0).any()):
        raise ValueError("a zero point of 0 has no per-nibble v1 encoding")
    qweight = _pack(q.t().reshape(-1, 8, q.shape[0]).transpose(1, 2), 4).reshape(-1, q.shape[0])
    qzeros = _pack(z.t(), 4)
    if version == 1:
        qzeros = _to_int32(qzeros.to(torch.int64) - 0x11111111)
    return qweight, qzeros


def gptq_unpack(qweight: torch.Tensor, qzeros: torch.Tensor, version: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [in, out], z [groups, out]) codes from the packed tensors (v1: 0x11111111 added back to each zero word)."""
    if version == 1:
        qzeros = _to_int32(qzeros.to(torch.int64) + 0x11111111)
    q = _unpack(qweight.t(), 4).t()
    return q, _unpack(qzeros, 4)


def dequantize_gptq(qweight, qzeros, scales, g_idx, version: int = 1) -> torch.Tensor:
    """The float32 nn.Linear weight [out, in]: W[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o], exactly."""
    q, z = gptq_unpack(qweight, qzeros, version)
    g = g_idx.long()
    return ((q.float() - z[g].float()) * scales.float()[g]).t().contiguous()


def gptq_config(group: int, sym: bool, desc_act: bool, version: int = 1) -> dict:
    """quantization_config (and quantize_config.json) as GPTQModel 7 writes it (QuantizeConfig.to_dict, for v1 its
    `checkpoint_format` / `format` "gptq" as auto-gptq wrote them)."""
    fmt = "gptq" if version == 1 else "gptq_v2"
    return {"bits": 4, "group_size": group, "desc_act": desc_act, "sym": sym, "lm_head": False, "quant_method": "gptq",
            "method": "gptq", "checkpoint_format": fmt, "format": fmt, "pack_dtype": "int32", "damp_percent": 0.05,
            "static_groups": False, "true_sequential": True,
            "meta": {"quantizer": ["gptqmodel:7.7.0"], "damp_percent": 0.05, "static_groups": False,
                     "true_sequential": True, "mse": 0.0}}


def make_gptq(src: Path, dst: Path, group: int = 128, sym: bool = True, desc_act: bool = False, version: int = 1,
              seed: int = 0) -> Path:
    """A GPTQ checkpoint of `src` (round to nearest, gptq_quantize): per projection `qweight` int32 [in/8, out],
    `qzeros` int32 [in/group, out/8] (v1: zero points minus one), `scales` float16 [in/group, out], `g_idx` int32
    [in], no `weight`; everything else as in `src`; config.json's quantization_config and quantize_config.json from
    gptq_config. desc_act=True quantizes each projection's columns in a random order (seeded per projection, as
    act-order's Hessian-diagonal order would be), so groups are scattered: g_idx[i] = position of i // group."""
    src, dst = Path(src), Path(dst)
    state = read_state(src)
    for n, p in enumerate(linear_names(state)):
        w = state.pop(f"{p}.weight")
        perm = None
        if desc_act:
            perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(seed * 1000 + n))
        g_idx = gptq_g_idx(w.shape[1], group, perm)
        q, z, s = gptq_quantize(w, g_idx, sym)
        state[f"{p}.qweight"], state[f"{p}.qzeros"] = gptq_pack(q, z, version)
        state[f"{p}.scales"] = s.t().contiguous()
        state[f"{p}.g_idx"] = g_idx
    cfg = read_config(src)
    cfg["quantization_config"] = gptq_config(group, sym, desc_act, version)
    shutil.rmtree(dst, ignore_errors=True)
    _write(dst, state, cfg)
    (dst / "quantize_config.json").write_text(json.dumps(cfg["quantization_config"], indent=2))
    _copy_side_files(src, dst)
    return dst


# --------------------------------------------------------------------------------------------------- gpt-oss MXFP4

# the tiny gpt-oss of tests/sharding/test_gpt_oss.py (SPEC), with an intermediate size that MXFP4's 32-element blocks
# divide (192 = 6 blocks: down_proj's input splits into whole blocks at TP 1, 2 and 3) and 2 layers (one sliding, one
# full) to stay small
GPT_OSS_SPEC = dict(cls="GptOssConfig", num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_local_experts=5,
                    num_experts_per_tok=2, intermediate_size=192, sliding_window=8, num_hidden_layers=2,
                    swiglu_limit=1.5,
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False, original_max_position_embeddings=64))
# the released gpt-oss-20b / -120b config.json's quantization_config
GPT_OSS_MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def mxfp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of w [..., rows, K] along its last dim (blocks of 32), as triton_kernels' downcast_to_mxfp_torch
    (numerics_details/mxfp.py, the reference transformers' quantize_to_mxfp4 calls; ROUND_UP scales) computes it:
    scale = 2^ceil(log2(max|w| / 6)) per block (its float32 bits rounded up to a power of two, so nothing clips),
    stored as its biased exponent (e8m0, uint8); each w / scale rounded to e2m1 by that function's bit arithmetic;
    two codes a byte, the even element in the low nibble. Returns (blocks uint8 [..., rows, K/32, 16], scales uint8
    [..., rows, K/32])."""
    src = weight.float()
    *lead, k = src.shape
    groups = src.reshape(*lead, k // 32, 32)
    dequant_scale = groups.abs().amax(-1, keepdim=True) / 6.0
    ds_int = dequant_scale.view(torch.int32)
    ds_int_rounded = (ds_int + 0x007FFFFF) & 0x7F800000
    rounded = ds_int_rounded.view(torch.float32)
    quant_scale = torch.where(rounded == 0, torch.zeros(()), 1.0 / rounded)
    q_int = (groups * quant_scale).reshape(*lead, k).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    signs = q_int & 0x80000000
    exponents = (q_int >> 23) & 0xFF
    mantissas = q_int & 0x7FFFFF
    mantissas = torch.where(exponents < 127, (0x400000 | (mantissas >> 1)) >> (126 - exponents).clamp(0, 62),
                            mantissas)
    exponents = exponents.clamp(min=126) - 126
    e2m1 = ((((exponents << 2) | (mantissas >> 21)) + 1) >> 1).clamp(max=7)
    codes = ((signs >> 28) | e2m1).to(torch.uint8).reshape(*lead, k // 2, 2)
    blocks = (codes[..., 0] | (codes[..., 1] << 4)).reshape(*lead, k // 32, 16)
    scales = (ds_int_rounded.squeeze(-1) >> 23).to(torch.uint8)
    return blocks, scales


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., rows, K/32, 16], scales uint8 [..., rows, K/32] -> float32 [..., K, rows] (transposed, the
    layout of transformers' bf16 gpt-oss parameters): value = FP4_VALUES[nibble] * 2^(scale - 127), the low nibble
    the even element; exact in float32. The same computation as transformers' convert_moe_packed_tensors."""
    lut = torch.tensor(FP4_VALUES)
    lo, hi = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack((lo, hi), -1).reshape(*blocks.shape[:-1], 32)
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1).float())
    return values.reshape(*blocks.shape[:-2], -1).transpose(-1, -2).contiguous()


def _randomize_gpt_oss(state: dict[str, torch.Tensor], seed: int) -> None:
    """tests/sharding/test_gpt_oss.py's randomize(): random 1-D tensors and biases, sinks of about +-2."""
    gen = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if name.endswith(".sinks"):
            state[name] = (2 * torch.randn(t.shape, generator=gen)).to(t.dtype)
        elif t.dim() == 1 or name.endswith("_bias"):
            state[name] = (t.float() + 0.3 * torch.randn(t.shape, generator=gen)).to(t.dtype)


def make_gpt_oss_mxfp4(dst: Path, seed: int = 0, source: Path | None = None, **overrides) -> Path:
    """A tiny gpt-oss (GPT_OSS_SPEC, overridable) stored as the released gpt-oss checkpoints are: everything bf16
    except the experts' two weights, which are MXFP4 (mxfp4_quantize):

        model.layers.N.mlp.experts.gate_up_proj_blocks  uint8 [E, 2I, H/32, 16]   out-major: row r = output r of the
        model.layers.N.mlp.experts.gate_up_proj_scales  uint8 [E, 2I, H/32]       fused gate/up, interleaved (even
                                                                                  rows gate, odd rows up), blocks of
                                                                                  32 along the input (hidden) dim
        model.layers.N.mlp.experts.down_proj_blocks     uint8 [E, H, I/32, 16]    row r = output (hidden) r, blocks
        model.layers.N.mlp.experts.down_proj_scales     uint8 [E, H, I/32]        along the input (intermediate) dim
        model.layers.N.mlp.experts.{gate_up,down}_proj_bias   bf16 [E, 2I], [E, H]

    while transformers' bf16 parameters are input-major: gate_up_proj [E, H, 2I] and down_proj [E, I, H] (x @ W), so
    dequantize_mxfp4(blocks, scales) (and transformers' convert_moe_packed_tensors) returns the transpose of the
    blocks' [E, rows, cols] matrix. config.json: GptOssConfig's, with quantization_config GPT_OSS_MXFP4_CONFIG. The
    bf16 model is tiny.make_checkpoint's GptOss with test_gpt_oss.py's randomization (biases, norms, sinks);
    `source`, if given, receives it (the unquantized bf16 checkpoint)."""
    import tiny

    dst = Path(dst)
    with tempfile.TemporaryDirectory() as work:
        folder = Path(work) / "bf16"
        tiny.ARCHS["_gpt_oss_mxfp4"] = copy.deepcopy(GPT_OSS_SPEC)
        try:
            tiny.make_checkpoint(folder, "_gpt_oss_mxfp4", dtype=torch.bfloat16, seed=seed, **overrides)
        finally:
            del tiny.ARCHS["_gpt_oss_mxfp4"]
        state = read_state(folder)
        _randomize_gpt_oss(state, seed + 1)
        cfg = read_config(folder)
        if source is not None:
            shutil.rmtree(source, ignore_errors=True)
            _write(Path(source), state, cfg)
            _copy_side_files(folder, Path(source))
        for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            w = state.pop(name)  # [E, in, out]
            # one expert at a time: the quantizer's int64 temporaries of a real-geometry [E, 2I, H] would take ~20 GB
            blocks, scales = zip(*(mxfp4_quantize(w[e].t()) for e in range(w.shape[0])))
            state[f"{name}_blocks"], state[f"{name}_scales"] = torch.stack(blocks), torch.stack(scales)
        cfg["quantization_config"] = copy.deepcopy(GPT_OSS_MXFP4_CONFIG)
        shutil.rmtree(dst, ignore_errors=True)
        _write(dst, state, cfg)
        _copy_side_files(folder, dst)
    return dst


# ------------------------------------------------------------------------------------------------- float references


def dequantized_state(folder: Path, rounding: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a quantized checkpoint (any format above) in float32, under transformers' parameter names: each
    quantized weight replaced by its exact dequantization (rounded once to `rounding` if given), the quantization's
    other tensors (scales, zero points, shapes, g_idx, k/v scales) dropped, the rest widened."""
    state = read_state(folder)
    qc = read_config(folder).get("quantization_config") or {}
    method = qc.get("quant_method")
    out: dict[str, torch.Tensor] = {}
    if method == "compressed-tensors":
        prefixes = {k[: -len(".weight_scale")] for k in state if k.endswith(".weight_scale")}
        for p in sorted(prefixes):
            out[f"{p}.weight"] = _round_to(dequantize_ct(state, qc, p), rounding)
        drop = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape", ".input_scale",
                ".input_zero_point", ".k_scale", ".v_scale", ".k_zero_point", ".v_zero_point")
        rest = {k: v for k, v in state.items() if not k.endswith(drop) and k not in out}
    elif method == "awq":
        for p in sorted(k[: -len(".qweight")] for k in state if k.endswith(".qweight")):
            out[f"{p}.weight"] = _round_to(dequantize_awq(state.pop(f"{p}.qweight"), state.pop(f"{p}.qzeros"),
                                                          state.pop(f"{p}.scales")), rounding)
        rest = state
    elif method == "gptq":
        version = 2 if qc.get("checkpoint_format", "gptq") == "gptq_v2" else 1
        for p in sorted(k[: -len(".qweight")] for k in state if k.endswith(".qweight")):
            out[f"{p}.weight"] = _round_to(dequantize_gptq(state.pop(f"{p}.qweight"), state.pop(f"{p}.qzeros"),
                                                           state.pop(f"{p}.scales"), state.pop(f"{p}.g_idx"),
                                                           version), rounding)
        rest = state
    elif method == "mxfp4":
        for p in sorted(k[: -len("_blocks")] for k in state if k.endswith("_blocks")):
            out[p] = _round_to(dequantize_mxfp4(state.pop(f"{p}_blocks"), state.pop(f"{p}_scales")), rounding)
        rest = state
    else:
        raise ValueError(f"not a quantized checkpoint: {method!r}")
    out.update({k: v.float() for k, v in rest.items()})
    return out


def reference_float(quantized: Path, dst: Path, rounding: torch.dtype | None = None) -> Path:
    """A float32 checkpoint at `dst` whose weights are exactly `quantized`'s dequantized values (dequantized_state):
    config.json without quantization_config, dtype float32; tokenizer files copied. For tiny.hf_greedy references."""
    quantized, dst = Path(quantized), Path(dst)
    state = dequantized_state(quantized, rounding)
    cfg = read_config(quantized)
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "float32"
    cfg.pop("torch_dtype", None)
    shutil.rmtree(dst, ignore_errors=True)
    _write(dst, state, cfg)
    _copy_side_files(quantized, dst)
    (dst / "quantize_config.json").unlink(missing_ok=True)
    return dst


# ----------------------------------------------------------------------------------- the libraries' own pack / unpack

AUTOAWQ_VERSION = os.environ.get("AUTOAWQ_VERSION", "0.2.9")
GPTQMODEL_VERSION = os.environ.get("GPTQMODEL_VERSION", "7.7.0")


def _sdist_sources(project: str, version: str, package: str) -> Path:
    """The *.py files of `package` in `project`'s sdist on PyPI, extracted once into $TPSERVE_HOME/sdist-<project>-
    <version>/ (helpers/sdist.py)."""
    return sdist.cached_files(sdist.home() / f"sdist-{project}-{version}", project, version,
                              lambda name: name if name.startswith(package + "/") and name.endswith(".py") else None)


_LIBRARIES: dict[str, types.SimpleNamespace] = {}


def awq_library() -> types.SimpleNamespace:
    """AutoAWQ's own code from its sdist: `.packing_utils` (awq/utils/packing_utils.py: unpack_awq,
    reverse_awq_order, dequantize_gemm, AWQ_ORDER, AWQ_REVERSE_ORDER) and `.WQLinear_GEMM` (awq/modules/linear/
    gemm.py, whose from_linear packs a layer; it falls back to dequantize_gemm without awq_ext / triton). The awq
    package's __init__ (which imports its model zoo) is not run: its subpackages are mapped to the sdist's folders
    just for the import, then taken back out of sys.modules."""
    if "awq" in _LIBRARIES:
        return _LIBRARIES["awq"]
    root = _sdist_sources("autoawq", AUTOAWQ_VERSION, "awq")
    spec = importlib.util.spec_from_file_location("_autoawq_packing_utils", root / "awq/utils/packing_utils.py")
    packing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(packing)
    saved = {k: v for k, v in sys.modules.items() if k == "awq" or k.startswith("awq.")}
    for k in saved:
        del sys.modules[k]
    try:
        for pkg in ("awq", "awq.utils", "awq.modules", "awq.modules.linear"):
            stub = types.ModuleType(pkg)
            stub.__path__ = [str(root / pkg.replace(".", "/"))]
            sys.modules[pkg] = stub
        with contextlib.redirect_stderr(open(os.devnull, "w")):
            gemm = importlib.import_module("awq.modules.linear.gemm")
    finally:
        for k in [k for k in sys.modules if k == "awq" or k.startswith("awq.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    lib = types.SimpleNamespace(root=root, packing_utils=packing, gemm=gemm, WQLinear_GEMM=gemm.WQLinear_GEMM)
    _LIBRARIES["awq"] = lib
    return lib


def awq_library_dequantize(qweight, qzeros, scales) -> torch.Tensor:
    """AutoAWQ's dequantize_gemm(qweight, qzeros, scales, 4, group): float16 [in, out]."""
    group = qweight.shape[0] // scales.shape[0]
    return awq_library().packing_utils.dequantize_gemm(qweight, qzeros, scales, 4, group)


def awq_library_pack(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int):
    """AutoAWQ's WQLinear_GEMM.from_linear on an nn.Linear holding `weight` [out, in] (already on the quantization
    grid, as AutoAWQ hands it over), with scales / zeros [in/group, out] as its quantizer passes them: (qweight,
    qzeros, scales) as it stores them."""
    out, inp = weight.shape
    linear = torch.nn.Linear(inp, out, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight.float())
    layer = awq_library().WQLinear_GEMM.from_linear(linear, 4, group, scales=scales.float(), zeros=zeros.float())
    return layer.qweight, layer.qzeros, layer.scales


class _ShimLog:
    def __getattr__(self, name):
        return self

    def __call__(self, *args, **kwargs):
        return self


class _GPTQModelLayer(torch.nn.Module):
    """What GPTQModel's PackableQuantLinear methods read of their layer (4 bits, int32 packing, no planar)."""

    def __init__(self, in_features: int, out_features: int, group: int, g_idx: torch.Tensor):
        super().__init__()
        self.bits, self.group_size, self.in_features, self.out_features = 4, group, in_features, out_features
        self.pack_dtype, self.pack_dtype_bits = torch.int32, 32
        self.pack_np_dtype, self.pack_np_math_dtype = np.int32, np.uint32
        self.pack_factor, self.maxq, self.planar = 8, 15, False
        self.enable_wf_unsqueeze, self.dequant_dtype = True, torch.int8  # TorchQuantLinear's, for 4 bits
        self._qzeros_format = 2
        self.register_buffer("g_idx", g_idx.to(torch.int32))

    def qzero_format(self, format: int | None = None) -> int:
        if format is not None:
            self._qzeros_format = format
        return self._qzeros_format


def _compile_functions(path: Path, wanted: dict[str, str | None], namespace: dict) -> None:
    """Compile functions of `path` (name -> enclosing class or None) into `namespace`, annotations and decorators
    dropped (their names need the rest of the package)."""
    tree = ast.parse(path.read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and wanted.get(node.name, "?") is None:
            found[node.name] = node
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and wanted.get(item.name) == node.name:
                    found[item.name] = item
    missing = set(wanted) - set(found)
    if missing:
        raise LookupError(f"{path}: no {sorted(missing)}")
    for node in found.values():
        node.decorator_list = []
        node.returns = None
        for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
            a.annotation = None
        for a in (node.args.vararg, node.args.kwarg):
            if a is not None:
                a.annotation = None
        module = ast.Module(body=[node], type_ignores=[])
        exec(compile(ast.fix_missing_locations(module), str(path), "exec"), namespace)


def gptq_library() -> types.SimpleNamespace:
    """GPTQModel's own functions from its sdist, compiled from its sources (gptqmodel's package imports its compiled
    dependencies - pypcre, logbar, device-smi - and CUDA kernels, so it is not imported): from
    gptqmodel/nn_modules/qlinear/__init__.py, PackableQuantLinear.pack_original (its reference packer) and
    dequantize_weight / _dequantize_from_codes / _init_wf_unsqueeze_buffers (the torch kernel's unpacking) with the
    module-level shift helpers; from gptqmodel/utils/model.py, convert_gptq_v1_to_v2_format_module and
    convert_gptq_v2_to_v1_format_module (the checkpoint's zero-point convention). They run as methods of
    `.Layer(in_features, out_features, group, g_idx)`, a stand-in with the attributes they read."""
    if "gptq" in _LIBRARIES:
        return _LIBRARIES["gptq"]
    import transformers

    root = _sdist_sources("gptqmodel", GPTQMODEL_VERSION, "gptqmodel")
    ns = {"t": torch, "torch": torch, "np": np, "math": math, "nn": torch.nn, "transformers": transformers,
          "_ConvNd": torch.nn.modules.conv._ConvNd, "log": _ShimLog(), "BaseQuantLinear": _GPTQModelLayer,
          "THREADPOOLCTL": types.SimpleNamespace(threadpool_limits=lambda *a, **k: contextlib.nullcontext())}
    methods = ["_wf_device", "_init_wf_unsqueeze_buffers", "dequantize_weight", "_dequantize_from_codes",
               "pack_original"]
    _compile_functions(root / "gptqmodel/nn_modules/qlinear/__init__.py",
                       {"_torch_shift_factor": None, "_torch_right_shift": None, "_torch_left_shift": None,
                        **{m: "PackableQuantLinear" for m in methods}}, ns)
    _compile_functions(root / "gptqmodel/utils/model.py", {"convert_gptq_v1_to_v2_format_module": None,
                                                           "convert_gptq_v2_to_v1_format_module": None}, ns)
    layer = type("GPTQModelLayer", (_GPTQModelLayer,), {m: ns[m] for m in methods})
    lib = types.SimpleNamespace(root=root, Layer=layer, namespace=ns,
                                v1_to_v2=ns["convert_gptq_v1_to_v2_format_module"],
                                v2_to_v1=ns["convert_gptq_v2_to_v1_format_module"])
    _LIBRARIES["gptq"] = lib
    return lib


def gptq_library_pack(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
                      group: int, version: int = 1):
    """GPTQModel's pack_original on an nn.Linear holding `weight` [out, in] (on the quantization grid, as GPTQ hands
    it over), scales / zeros [out, groups] as its quantizer makes them; then, for v1, its v2 -> v1 conversion (as its
    save does): (qweight, qzeros, scales)."""
    lib = gptq_library()
    out, inp = weight.shape
    linear = torch.nn.Linear(inp, out, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight.float())
    layer = lib.Layer(inp, out, group, g_idx)
    layer.pack_original(linear, scales.float(), zeros.float(), g_idx.to(torch.int32))
    if version == 1:
        lib.v2_to_v1(layer, types.SimpleNamespace(bits=4, pack_dtype=torch.int32))
    return layer.qweight, layer.qzeros, layer.scales


def gptq_library_dequantize(qweight, qzeros, scales, g_idx, version: int = 1) -> torch.Tensor:
    """GPTQModel's torch-kernel dequantization: (v1: its v1 -> v2 zero-point conversion, as its loader does, then)
    dequantize_weight(): float16 [in, out]."""
    lib = gptq_library()
    group = qweight.shape[0] * 8 // scales.shape[0]
    layer = lib.Layer(qweight.shape[0] * 8, scales.shape[1], group, g_idx)
    layer.register_buffer("qweight", qweight.clone())
    layer.register_buffer("qzeros", qzeros.clone())
    layer.register_buffer("scales", scales.clone())
    if version == 1:
        lib.v1_to_v2(layer, 4, torch.int32)
    return layer.dequantize_weight()


def library_dequantized_weight(folder: Path, prefix: str) -> torch.Tensor:
    """The library's own dequantization of projection `prefix` (e.g. "model.layers.0.mlp.down_proj") of an AWQ or
    GPTQ checkpoint folder, as an nn.Linear weight [out, in] in float32 holding the library's float16 values:
    AutoAWQ's dequantize_gemm (awq_library_dequantize) or GPTQModel's dequantize_weight after its v1 -> v2
    conversion (gptq_library_dequantize). Equal to dequantized_state(folder, rounding=torch.float16)[prefix + ".weight"]
    (tests/loaders/test_quantized_fixtures.py checks it on every projection)."""
    state = read_state(folder)
    qc = read_config(folder)["quantization_config"]
    qweight, qzeros, scales = (state[f"{prefix}.{n}"] for n in ("qweight", "qzeros", "scales"))
    if qc["quant_method"] == "awq":
        weight = awq_library_dequantize(qweight, qzeros, scales)
    elif qc["quant_method"] == "gptq":
        version = 2 if qc.get("checkpoint_format", "gptq") == "gptq_v2" else 1
        weight = gptq_library_dequantize(qweight, qzeros, scales, state[f"{prefix}.g_idx"], version)
    else:
        raise ValueError(f"not AWQ or GPTQ: {qc['quant_method']!r}")
    return weight.t().float().contiguous()
