"""Hugging Face quantized folders (loaders/hf_quant.py): each format, written by its own tool (tests/helpers/
quantized.py), is read exactly, by byte ranges, refused with its reason where it is not served, and served at TP 1-3
with the greedy tokens of transformers running the same values.

The served runs use torch's paths (TPSERVE_KERNELS=none: the weight dequantized in chunks for F.linear), so that the
products are float32's and the tokens can be compared with transformers' exactly; the kernels' layouts of the same
groups are checked on their own in tests/sharding/test_stored.py."""

from __future__ import annotations

import json
import re

import pytest
import torch

from helpers import quantized as hq
from llm_runner import run_llm
from loaders.checkpoint import CheckpointError
from loaders.gguf_file import open_checkpoint
from tiny import check_greedy, hf_greedy

SERVED = ["W4A16", "W4A16_ASYM", "W4A16_G64", "W4A16_CHANNEL", "W8A16", "W8A16_ASYM", "FP8", "FP8_TENSOR",
          "NAIVE_INT8", "AWQ", "GPTQ", "GPTQ_ASYM", "GPTQ_V2", "GPTQ_ACT_ORDER_SEQUENTIAL"]
BF16_SERVED = {"W8A16_ASYM", "FP8", "FP8_TENSOR"}  # served as bfloat16 weights: the reference rounds them alike
# the fast tier: one of each way of being served (int4 as stored, int4 with zero points, int8, float8 as bfloat16)
# and the two formats with their own packing (AWQ; GPTQ with zero points); the slow tier every format
FAST_FORMATS = ["W4A16", "W8A16", "FP8", "AWQ", "GPTQ_ASYM"]


def tier(names: list[str]) -> list:
    return [n if n in FAST_FORMATS else pytest.param(n, marks=pytest.mark.slow) for n in names]


def make(name: str, src, dst):
    if name == "AWQ":
        return hq.make_awq(src, dst)
    if name == "GPTQ_ACT_ORDER_SEQUENTIAL":  # desc_act=true whose groups happen to follow the inputs
        folder = hq.make_gptq(src, dst)
        cfg = hq.read_config(folder)
        cfg["quantization_config"]["desc_act"] = True
        (folder / "config.json").write_text(json.dumps(cfg))
        return folder
    if name.startswith("GPTQ"):
        return hq.make_gptq(src, dst, sym=name != "GPTQ_ASYM", version=2 if name == "GPTQ_V2" else 1)
    return hq.make_compressed_tensors(src, dst, name)


class Made(dict):
    """Each format's folder, written at its first use (a test of the fast tier writes only what it uses)."""

    def __init__(self, root, src):
        super().__init__()
        self.root, self.src = root, src

    def __missing__(self, name: str):
        self[name] = make(name, self.src, self.root / name)
        return self[name]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfq")
    src = hq.make_source(root / "src")
    return src, Made(root, src)


@pytest.mark.parametrize("name", tier(SERVED))
def test_every_linear_reads_as_its_exact_values_by_byte_ranges(folders, name):
    """The stand-in `X.weight` of each quantized linear reads as the format's exact dequantization (the helpers'
    formulas, themselves checked against the libraries' unpacking in test_quantized_fixtures.py), whole or by
    blocks of rows and of whole groups of inputs; a block costs its own bytes only."""
    _, made = folders
    want = hq.dequantized_state(made[name])
    with open_checkpoint(made[name]) as ckpt:
        assert ckpt.linears, "no linear found quantized"
        for lin in ckpt.linears:
            full = ckpt.read(lin)
            assert torch.equal(full, want[lin]), lin
            out_f, in_f = full.shape
            assert torch.equal(ckpt.read(lin, 0, [(8, out_f - 8)]), full[8:-8])
            unit = ckpt.stored(lin).split_unit
            if in_f >= 2 * unit:
                assert torch.equal(ckpt.read(lin, 1, [(unit, in_f)]), full[:, unit:])
        lin = "model.layers.0.mlp.down_proj.weight"  # [256, 384]: half its rows cost about half its bytes
        stored = sum(ckpt.parts[p].nbytes for p in ckpt.stored(lin).parts.values())
        before = ckpt.bytes_read
        ckpt.read_grouped(lin, 0, [(0, 128)])
        assert ckpt.bytes_read - before <= stored // 2 + 64


def test_awq_and_gptq_unpack_as_the_libraries_do(folders):
    """AutoAWQ's and GPTQModel's own dequantization (from their sdists) of the same tensors: float16, so equal to
    ours rounded once to float16."""
    _, made = folders
    lin = "model.layers.1.mlp.down_proj"
    for name, lib in (("AWQ", hq.awq_library_dequantize), ("GPTQ", hq.gptq_library_dequantize),
                      ("GPTQ_ASYM", hq.gptq_library_dequantize)):
        state = hq.read_state(made[name])
        args = [state[f"{lin}.{t}"] for t in ("qweight", "qzeros", "scales")]
        if lib is hq.gptq_library_dequantize:
            args.append(state[f"{lin}.g_idx"])
        theirs = lib(*args).t()  # (they return [in, out])
        with open_checkpoint(made[name]) as ckpt:
            ours = ckpt.read(f"{lin}.weight")
        assert torch.equal(ours.half(), theirs.half()), name


REFUSED = {
    "W8A8": "activation quantization",
    "W4A16_KV8": "kv_cache_scheme",
}


def _edit_quantization_config(folder, **fields) -> None:
    cfg = hq.read_config(folder)
    cfg["quantization_config"].update(fields)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_refused_schemes_say_why(folders, tmp_path):
    src, _ = folders
    for scheme, why in REFUSED.items():
        folder = hq.make_compressed_tensors(src, tmp_path / scheme, scheme)
        with pytest.raises(CheckpointError, match=why):
            open_checkpoint(folder)
    # 2:4-sparse weights stored densely (compressed-tensors 0.20's choice for W4A16) are served as the values they
    # are; stored in a sparse format, they are refused
    sparse = hq.make_compressed_tensors(src, tmp_path / "sparse", "SPARSE_2_4")
    assert hq.read_config(sparse)["quantization_config"]["sparsity_config"]["format"] == "dense"
    with open_checkpoint(sparse) as ckpt:
        assert torch.equal(ckpt.read("model.layers.0.mlp.up_proj.weight"),
                           hq.dequantized_state(sparse)["model.layers.0.mlp.up_proj.weight"])
    _edit_quantization_config(sparse, sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"})
    with pytest.raises(CheckpointError, match="sparsity_config format 'sparse-24-bitmask'"):
        open_checkpoint(sparse)
    permuted = hq.make_gptq(src, tmp_path / "act", desc_act=True)
    with pytest.raises(CheckpointError, match=re.escape("act-order (desc_act) with its groups out of input order")):
        open_checkpoint(permuted)
    for method, why in (({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes' is not served"),
                        ({"quant_method": "awq", "version": "gemv", "bits": 4, "group_size": 128},
                         "version 'gemv' is not served")):
        folder = hq.make_awq(src, tmp_path / f"m{len(why)}")
        cfg = hq.read_config(folder)
        cfg["quantization_config"] = method
        (folder / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(CheckpointError, match=re.escape(why)):
            open_checkpoint(folder)


PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(30, 50))]
# TP 2 and 3 split the rows of q/k/v and gate/up and the inputs of o_proj and down_proj (at TP 3: 128 of down's 384)
FAST = {1: FAST_FORMATS}  # (tensor parallelism in the fast tier: gpt-oss's MXFP4 experts at TP 2, below)
SLOW = {tp: [n for n in SERVED if n not in FAST.get(tp, ())] for tp in (1, 2, 3)}


@pytest.fixture(scope="module")
def references(folders, tmp_path_factory):
    """transformers' greedy tokens on a float32 folder holding each format's values (rounded to bfloat16 where the
    server serves bfloat16 weights)."""
    _, made = folders
    root = tmp_path_factory.mktemp("hfq_ref")

    class References(dict):  # made at first use, as the folders are
        def __missing__(self, name: str):
            ref = hq.reference_float(made[name], root / name, rounding=torch.bfloat16 if name in BF16_SERVED else None)
            self[name] = (ref, [hf_greedy(ref, p, 16) for p in PROMPTS])
            return self[name]

    return References()


def _serve(folders, references, tp: int, names: list[str]) -> None:
    _, made = folders
    jobs = [{"model": str(made[n]), "prompts": PROMPTS, "max_tokens": 16, "logprobs": 5, "dtype": "float32",
             "llm": {"quantization": None}} for n in names]
    results = run_llm(tp, jobs, timeout=300, env={"TPSERVE_KERNELS": "none"})
    for name, result in zip(names, results):
        check_greedy(name, result, references)


@pytest.mark.parametrize("tp", sorted(FAST))
def test_served_at_tp_equals_transformers(folders, references, tp):
    _serve(folders, references, tp, FAST[tp])


@pytest.mark.slow
@pytest.mark.parametrize("tp", sorted(SLOW))
def test_served_at_tp_equals_transformers_all_formats(folders, references, tp):
    _serve(folders, references, tp, SLOW[tp])


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """gpt-oss with its experts in MXFP4 as released, and transformers' greedy tokens on a float32 copy of its values
    (transformers' own Mxfp4Config(dequantize=True) gives the same values: test_quantized_fixtures.py)."""
    root = tmp_path_factory.mktemp("oss")
    folder = hq.make_gpt_oss_mxfp4(root / "mxfp4")
    ref = hq.reference_float(folder, root / "f32")
    return folder, {"oss": (ref, [hf_greedy(ref, p, 16) for p in PROMPTS])}


@pytest.mark.parametrize("tp,ep", [(2, False), pytest.param(1, False, marks=pytest.mark.slow),
                                   pytest.param(2, True, marks=pytest.mark.slow),
                                   pytest.param(3, False, marks=pytest.mark.slow)])
def test_gpt_oss_mxfp4_served_as_released(gpt_oss, tp, ep):
    """The experts' blocks and scales are read per expert and per rank (an expert's rows under tensor parallelism,
    whole experts under expert parallelism) and served exactly (the MXFP4 layout); the rest is bfloat16 as stored."""
    folder, ref = gpt_oss
    with open_checkpoint(folder) as ckpt:
        assert {s.fmt for s in ckpt.linears.values()} == {"mxfp4"} and len(ckpt.linears) == 4
    job = {"model": str(folder), "prompts": PROMPTS, "max_tokens": 16, "logprobs": 5, "dtype": "float32",
           "llm": {"enable_expert_parallel": ep}}
    (result,) = run_llm(tp, [job], timeout=300, env={"TPSERVE_KERNELS": "none"})
    check_greedy("oss", result, ref)
