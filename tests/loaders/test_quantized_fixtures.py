"""Self-check of the quantized-checkpoint factory (tests/helpers/quantized.py): for each format the checkpoint is
written with the layout and config the real tools give it; transformers loads it (compressed-tensors, MXFP4) to
exactly the helper's dequantization, or AutoAWQ's / GPTQModel's own pack and unpack code (from their sdists) agree
with the helper bit for bit (AWQ, GPTQ); and every dequantized weight is within one quantization step of the float
source."""

from __future__ import annotations

import pytest
import torch

from helpers import quantized as Q

IDS = torch.tensor([[5, 9, 31, 7, 120, 64, 3, 250, 11, 42]])


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with Q.single_threaded():
        yield


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = Q.make_source(tmp_path_factory.mktemp("quantized") / "src")
    return folder, Q.read_state(folder)


def _load(folder, **kw):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kw)
    model.eval()
    return model


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _library_and_reference_agree(folder, tmp_path, deq: dict, library_linear: str, float_linear: str) -> None:
    """The library's own dequantization of one linear is the helper's, rounded to float16 as the library computes;
    the float reference checkpoint holds the exact values, and transformers runs it to finite logits."""
    library = Q.library_dequantized_weight(folder, library_linear)
    assert torch.equal(library, Q.dequantized_state(folder, torch.float16)[f"{library_linear}.weight"])
    model = _load(Q.reference_float(folder, tmp_path / "ref"))
    assert torch.equal(model.state_dict()[f"{float_linear}.weight"], deq[f"{float_linear}.weight"])
    assert torch.isfinite(_logits(model)).all()


def _expand(scale: torch.Tensor, shape) -> torch.Tensor:
    """A scale [out, groups] / [out, 1] / [1] broadcast to the weight's [out, in]."""
    scale = scale.float()
    if scale.dim() == 2 and scale.shape[1] > 1:
        scale = scale.repeat_interleave(shape[1] // scale.shape[1], dim=1)
    return scale.expand(shape)


# ---------------------------------------------------------------------------------------------- compressed-tensors

# scheme: (format, bits, type, strategy, group, symmetric, dynamic input activations)
CT_EXPECT = {
    "W4A16": ("pack-quantized", 4, "int", "group", 128, True, None),
    "W4A16_ASYM": ("pack-quantized", 4, "int", "group", 128, False, None),
    "W4A16_G32": ("pack-quantized", 4, "int", "group", 32, True, None),
    "W4A16_G64": ("pack-quantized", 4, "int", "group", 64, True, None),
    "W4A16_CHANNEL": ("pack-quantized", 4, "int", "channel", None, True, None),
    "W8A16": ("pack-quantized", 8, "int", "channel", None, True, None),
    "W8A16_G128": ("pack-quantized", 8, "int", "group", 128, True, None),
    "W8A16_ASYM": ("pack-quantized", 8, "int", "channel", None, False, None),
    "FP8": ("float-quantized", 8, "float", "channel", None, True, "float"),
    "FP8_TENSOR": ("float-quantized", 8, "float", "tensor", None, True, "float"),
    "NAIVE_INT8": ("naive-quantized", 8, "int", "channel", None, True, None),
    "W8A8": ("int-quantized", 8, "int", "channel", None, True, "int"),
    "W4A16_KV8": ("pack-quantized", 4, "int", "group", 128, True, None),
    "SPARSE_2_4": ("pack-quantized", 4, "int", "group", 128, True, None),
}


def test_every_scheme_is_checked():
    assert set(CT_EXPECT) == set(Q.CT_SCHEMES)


# the fast tier: transformers' own loading of W4A16 (the formats' readers are checked against these helpers in
# test_hf_quant.py); the slow tier every scheme
FAST_SCHEMES = {"W4A16"}


@pytest.mark.parametrize("scheme", [s if s in FAST_SCHEMES else pytest.param(s, marks=pytest.mark.slow)
                                    for s in CT_EXPECT])
def test_compressed_tensors(source, tmp_path, scheme):
    from transformers import CompressedTensorsConfig

    src, src_state = source
    fmt, bits, kind, strategy, group, sym, act = CT_EXPECT[scheme]
    folder = Q.make_compressed_tensors(src, tmp_path / scheme, scheme)
    assert (folder / "tokenizer.json").exists()
    qc = Q.read_config(folder)["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == fmt and qc["ignore"] == ["lm_head"]
    assert qc["quantization_status"] == "compressed"
    (grp,) = qc["config_groups"].values()
    assert grp["targets"] == ["Linear"] and grp["format"] == fmt
    w = grp["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"], w["symmetric"], w["dynamic"]) == \
        (bits, kind, strategy, group, sym, False)
    if act is None:
        assert grp["input_activations"] is None
    else:
        a = grp["input_activations"]
        assert (a["num_bits"], a["type"], a["strategy"], a["dynamic"]) == (8, act, "token", True)
    kv = qc["kv_cache_scheme"]
    sparsity = qc["sparsity_config"]
    if scheme == "W4A16_KV8":
        assert (kv["num_bits"], kv["type"], kv["strategy"], kv["dynamic"]) == (8, "float", "tensor", False)
    else:
        assert kv is None
    if scheme == "SPARSE_2_4":
        assert sparsity["sparsity_structure"] == "2:4" and sparsity["format"] == "dense"
        assert sparsity["targets"] == ["Linear"] and sparsity["ignore"] == ["lm_head"]
    else:
        assert sparsity == {}

    state = Q.read_state(folder)
    assert state["lm_head.weight"].dtype == torch.bfloat16 and "lm_head.weight_scale" not in state
    deq = Q.dequantized_state(folder)
    for p in Q.linear_names(src_state):
        source_w = src_state[f"{p}.weight"].float()
        out, inp = source_w.shape
        scale = state[f"{p}.weight_scale"]
        assert scale.dtype == torch.bfloat16
        shapes = {"group": (out, inp // (group or 1)), "channel": (out, 1), "tensor": (1,)}
        assert tuple(scale.shape) == shapes[strategy]
        if fmt == "pack-quantized":
            assert f"{p}.weight" not in state
            assert state[f"{p}.weight_packed"].dtype == torch.int32
            assert tuple(state[f"{p}.weight_packed"].shape) == (out, inp * bits // 32)
            assert state[f"{p}.weight_shape"].tolist() == [out, inp]
            if sym:
                assert f"{p}.weight_zero_point" not in state
            else:  # packed along the output dim
                zp = state[f"{p}.weight_zero_point"]
                assert zp.dtype == torch.int32 and tuple(zp.shape) == (out * bits // 32, scale.shape[1])
        else:
            assert state[f"{p}.weight"].dtype == (torch.float8_e4m3fn if kind == "float" else torch.int8)
            assert tuple(state[f"{p}.weight"].shape) == (out, inp)
        # within one quantization step of the source (of the 2:4-pruned source for SPARSE_2_4)
        if scheme == "SPARSE_2_4":
            source_w = Q._prune_2_4(source_w)
            assert ((deq[f"{p}.weight"].reshape(out, -1, 4) == 0).sum(-1) >= 2).all()
        error = (deq[f"{p}.weight"] - source_w).abs()
        step = _expand(scale, (out, inp))
        if kind == "float":
            assert (error <= source_w.abs() / 8 + step * 2**-9).all(), p
        else:
            # compressed-tensors computes the qparams in the weights' dtype (bf16), as llm-compressor's observers
            # hand them over: an int8 zero point near +-128 comes out of bf16 arithmetic up to about 1 off, moving
            # the grid's clipped end by that much more (1.22 steps at worst here)
            assert (error <= (1.5 if bits == 8 and not sym else 1.0) * step).all(), p
    if scheme == "W4A16_KV8":
        for layer in range(2):
            for name in ("k_scale", "v_scale"):
                t = state[f"model.layers.{layer}.self_attn.{name}"]
                assert t.dtype == torch.bfloat16 and t.shape == (1,) and float(t) > 0

    # transformers' dequantizing load: compressed-tensors' decompression, in the scales' dtype (bf16)
    model = _load(folder, quantization_config=CompressedTensorsConfig(dequantize=True))
    loaded = model.state_dict()
    for name, t in Q.dequantized_state(folder, rounding=torch.bfloat16).items():
        assert torch.equal(loaded[name], t), name
    assert torch.isfinite(_logits(model)).all()


def test_compressed_tensors_default_route_and_reference(source, tmp_path):
    """transformers' default (compressed) route decompresses a symmetric W4A16 checkpoint in float32 on the first
    forward: exactly the float reference's weights, so the same logits."""
    src, _ = source
    folder = Q.make_compressed_tensors(src, tmp_path / "ct", "W4A16")
    model = _load(folder)
    logits = _logits(model)
    reference = _load(Q.reference_float(folder, tmp_path / "ref"))
    assert torch.equal(logits, _logits(reference))
    loaded = model.state_dict()
    for name, t in reference.state_dict().items():
        assert torch.equal(loaded[name], t), name


# ---------------------------------------------------------------------------------------------------------------- AWQ


@pytest.mark.slow  # (test_hf_quant.py checks the fast tier's AWQ against AutoAWQ's own unpacking)
@pytest.mark.parametrize("group,zero_point", [(128, True), (64, True), (128, False)])
def test_awq(source, tmp_path, group, zero_point):
    src, src_state = source
    folder = Q.make_awq(src, tmp_path / "awq", group=group, zero_point=zero_point)
    assert Q.read_config(folder)["quantization_config"] == {
        "quant_method": "awq", "version": "gemm", "bits": 4, "group_size": group, "zero_point": zero_point,
        "modules_to_not_convert": None}
    state, deq = Q.read_state(folder), Q.dequantized_state(folder)
    for p in Q.linear_names(src_state):
        source_w = src_state[f"{p}.weight"]
        out, inp = source_w.shape
        qweight, qzeros, scales = state[f"{p}.qweight"], state[f"{p}.qzeros"], state[f"{p}.scales"]
        assert f"{p}.weight" not in state
        assert (qweight.dtype, tuple(qweight.shape)) == (torch.int32, (inp, out // 8))
        assert (qzeros.dtype, tuple(qzeros.shape)) == (torch.int32, (inp // group, out // 8))
        assert (scales.dtype, tuple(scales.shape)) == (torch.float16, (inp // group, out))
        # AutoAWQ's own unpacking, bit for bit (it dequantizes in float16)
        assert torch.equal(Q.awq_library_dequantize(qweight, qzeros, scales), deq[f"{p}.weight"].t().half()), p
        # AutoAWQ's own packing (WQLinear_GEMM.from_linear) of the same codes
        _, z, s = Q.awq_quantize(source_w, group, zero_point)
        packed = Q.awq_library_pack(deq[f"{p}.weight"], s.t(), z.t(), group)
        assert all(torch.equal(a, b) for a, b in zip(packed, (qweight, qzeros, scales))), p
        step = scales.float().repeat_interleave(group, dim=0).t()
        assert ((deq[f"{p}.weight"] - source_w.float()).abs() <= step).all(), p
    if group == 128 and zero_point:
        _library_and_reference_agree(folder, tmp_path, deq, "model.layers.1.self_attn.k_proj",
                                     "model.layers.1.mlp.down_proj")


# --------------------------------------------------------------------------------------------------------------- GPTQ


@pytest.mark.slow  # (test_hf_quant.py checks the fast tier's GPTQ against GPTQModel's own unpacking)
@pytest.mark.parametrize("group,sym,desc_act,version", [(128, True, False, 1), (128, False, True, 1),
                                                         (64, True, True, 1), (128, False, False, 2)])
def test_gptq(source, tmp_path, group, sym, desc_act, version):
    src, src_state = source
    folder = Q.make_gptq(src, tmp_path / "gptq", group=group, sym=sym, desc_act=desc_act, version=version)
    qc = Q.read_config(folder)["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"]) == \
        ("gptq", 4, group, sym, desc_act)
    assert qc["checkpoint_format"] == ("gptq" if version == 1 else "gptq_v2")
    assert Q.read_config(folder)["quantization_config"] == Q.gptq_config(group, sym, desc_act, version)
    state, deq = Q.read_state(folder), Q.dequantized_state(folder)
    for p in Q.linear_names(src_state):
        source_w = src_state[f"{p}.weight"]
        out, inp = source_w.shape
        qweight, qzeros, scales, g_idx = (state[f"{p}.{n}"] for n in ("qweight", "qzeros", "scales", "g_idx"))
        assert f"{p}.weight" not in state
        assert (qweight.dtype, tuple(qweight.shape)) == (torch.int32, (inp // 8, out))
        assert (qzeros.dtype, tuple(qzeros.shape)) == (torch.int32, (inp // group, out // 8))
        assert (scales.dtype, tuple(scales.shape)) == (torch.float16, (inp // group, out))
        assert (g_idx.dtype, tuple(g_idx.shape)) == (torch.int32, (inp,))
        assert torch.bincount(g_idx.long()).tolist() == [group] * (inp // group)
        sequential = torch.equal(g_idx, (torch.arange(inp) // group).to(torch.int32))
        assert sequential != desc_act
        if sym and version == 1:
            assert (qzeros == 0x77777777).all()  # zero point 8, stored minus one
        # GPTQModel's own unpacking (its v1 -> v2 conversion, then dequantize_weight), bit for bit (float16)
        library = Q.gptq_library_dequantize(qweight, qzeros, scales, g_idx, version)
        assert torch.equal(library, deq[f"{p}.weight"].t().half()), p
        # GPTQModel's own packing (pack_original, then for v1 its v2 -> v1 conversion) of the same codes
        _, z, s = Q.gptq_quantize(source_w, g_idx, sym)
        packed = Q.gptq_library_pack(deq[f"{p}.weight"], s, z, g_idx, group, version)
        assert all(torch.equal(a, b) for a, b in zip(packed, (qweight, qzeros, scales))), p
        step = scales.float()[g_idx.long()].t()
        assert ((deq[f"{p}.weight"] - source_w.float()).abs() <= step).all(), p
    if desc_act and not sym:
        _library_and_reference_agree(folder, tmp_path, deq, "model.layers.1.mlp.up_proj",
                                     "model.layers.0.self_attn.o_proj")


# ------------------------------------------------------------------------------------------------------ gpt-oss MXFP4


def test_gpt_oss_mxfp4(tmp_path):
    from transformers import Mxfp4Config
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder = Q.make_gpt_oss_mxfp4(tmp_path / "mxfp4", source=tmp_path / "bf16")
    cfg = Q.read_config(folder)
    assert cfg["quantization_config"] == Q.GPT_OSS_MXFP4_CONFIG
    experts, hidden, inter = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    state, source = Q.read_state(folder), Q.read_state(tmp_path / "bf16")
    deq = Q.dequantized_state(folder)
    shapes = {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, (rows, cols) in shapes.items():
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            blocks, scales = state[f"{name}_blocks"], state[f"{name}_scales"]
            assert name not in state
            assert (blocks.dtype, tuple(blocks.shape)) == (torch.uint8, (experts, rows, cols // 32, 16))
            assert (scales.dtype, tuple(scales.shape)) == (torch.uint8, (experts, rows, cols // 32))
            assert state[f"{name}_bias"].dtype == torch.bfloat16
            # transformers' own dequantization; [E, in, out] like the bf16 parameter
            assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), deq[name])
            assert deq[name].shape == source[name].shape
            # e2m1 rounds to nearest: at most half the widest grid gap (4 -> 6), one scale unit
            unit = torch.exp2(scales.float() - 127).repeat_interleave(32, -1).transpose(-1, -2)
            assert ((deq[name] - source[name].float()).abs() <= unit).all(), name
    assert state["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16

    model = _load(folder, quantization_config=Mxfp4Config(dequantize=True))
    loaded = model.state_dict()
    for name, t in deq.items():
        assert torch.equal(loaded[name], t), name
    logits = _logits(model)
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, _logits(_load(Q.reference_float(folder, tmp_path / "ref"))))
