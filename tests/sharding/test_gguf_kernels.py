"""GGUF block types served in their own blocks (sharding/layers/gguf_quant.py, core/kquant_linear.cpp,
core/kquant_pack.cpp), on random blocks (any bytes are valid blocks; the float16 fields are set to sane scales):

- the values and scales split from the file's blocks dequantize bit-equal to gguf-py's `dequantize`;
- the kernel's layout holds them losslessly (unpacked again: the same values and scales), and the compiled packer
  writes the same bytes as the torch one;
- the compiled kernel equals a float64 product of the dequantized weights with the activations rounded as it
  rounds them (int8 per row and block of 32), within float32 rounding, at 1 to 9 rows and output sizes with tails;
- a weight mixing types (quant.mixed) is its parts side by side.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sharding.cpu import kernels
from sharding.layers import gguf_quant, quant

gguf = pytest.importorskip("gguf")

HALF_FIELDS = {"Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(name: str, rows: int, blocks: int, seed: int = 0) -> torch.Tensor:
    t = gguf_quant.TYPES[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks, t.block_bytes), dtype=np.uint8)
    for o in HALF_FIELDS[name]:
        h = (rng.uniform(0.5, 1.5, (rows, blocks)) * 2.0 ** -8 * rng.choice([-1, 1], (rows, blocks))).astype(np.float16)
        raw[..., o:o + 2] = h.view(np.uint8).reshape(rows, blocks, 2)
    return torch.from_numpy(raw)


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    g = x.reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    q = torch.round(g * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    return (q * (amax / 127)).reshape(x.shape)


@pytest.mark.parametrize("name", list(gguf_quant.TYPES))
def test_blocks_split_and_packed_losslessly(name):
    t = gguf_quant.TYPES[name]
    rows, blocks = 21, 512 // t.block
    raw = random_blocks(name, rows, blocks)
    q, s = gguf_quant.unpack(name, raw)
    ref = gguf.quants.dequantize(raw.reshape(rows, -1).numpy(), gguf.GGMLQuantizationType[name]).reshape(rows, -1)
    ours = gguf_quant.dequantize_unpacked(name, q, s).numpy()
    assert ours.dtype == np.float32 and np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    w, sc = gguf_quant.pack(name, q, s)
    q2, s2 = gguf_quant.unpack_packed(name, w, sc, q.shape[1])
    assert torch.equal(q2[:rows], q) and not q2[rows:].any()
    for k in s:
        assert torch.equal(s2[k][:rows].view(torch.uint8), s[k].view(torch.uint8)), k
    if kernels.build_kernels():
        w2, sc2 = torch.ops.tpserve.kq_pack(raw.contiguous(), t.code, q.shape[1])
        assert torch.equal(w, w2) and torch.equal(sc, sc2)


@pytest.mark.parametrize("name", list(gguf_quant.TYPES))
def test_the_kernel_equals_the_dequantized_product(name):
    if not kernels.build_kernels():
        pytest.skip("no compiled kernels")
    t = gguf_quant.TYPES[name]
    torch.manual_seed(0)
    for rows, k, m in ((37, 512, 1), (16, 256, 3), (50, 1024, 9)):
        if k % t.block:
            continue
        raw = random_blocks(name, rows, k // t.block, seed=rows)
        qw = quant._one_type(name, [raw])
        assert qw.kernel is not None and qw.mode == name
        w = quant.dequantize(qw)
        assert torch.equal(w, gguf_quant.dequantize_unpacked(name, *gguf_quant.unpack(name, raw)))
        x = torch.randn(m, k)
        y = quant.linear(x, qw)
        ref = (int8_rounded(x).double() @ w.double().T).float()
        assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item()), (rows, k, m)
        # and the rounding is the only difference from the float product
        assert (y - x @ w.T).abs().max() < 0.05 * (x @ w.T).abs().max()


def test_a_mixed_weight_is_its_parts_side_by_side():
    parts = [quant._one_type("Q4_K", [random_blocks("Q4_K", 48, 2, seed=1)]),
             quant._one_type("Q6_K", [random_blocks("Q6_K", 20, 2, seed=2)])]
    qw = quant.mixed(parts)
    x = torch.randn(3, 512)
    y = quant.linear(x, qw, bias=torch.arange(68.0))
    assert y.shape == (3, 68)
    assert torch.equal(y, torch.cat([quant.linear(x, p) for p in parts], -1) + torch.arange(68.0))
    assert torch.equal(quant.dequantize(qw), torch.cat([quant.dequantize(p) for p in parts]))
    assert qw.nbytes() == sum(p.nbytes() for p in parts)
