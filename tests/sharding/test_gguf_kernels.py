"""GGUF block types served in their own blocks (sharding/layers/gguf_quant.py, core/kquant_linear.cpp,
core/kquant_pack.cpp), on random blocks (any bytes are valid blocks; the float16 fields are set to sane scales, MXFP4's
e8m0 ones to those a float16 d holds):

- the values and scales split from the file's blocks dequantize bit-equal to gguf-py's `dequantize`;
- the kernel's layout holds them losslessly (unpacked again: the same values and scales), and the compiled packer
  writes the same bytes as the torch one (MXFP4: for every e, the clamped ones included);
- Q4_Z, which has no file form, from random values, scales and zero points: packed losslessly, W = d * (q - z);
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

HALF_FIELDS = {"Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
               "MXFP4": []}
FILE_TYPES = [name for name, t in gguf_quant.TYPES.items() if t.block_bytes]  # all but Q4_Z


def random_blocks(name: str, rows: int, blocks: int, seed: int = 0) -> torch.Tensor:
    t = gguf_quant.TYPES[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks, t.block_bytes), dtype=np.uint8)
    if name == "MXFP4":  # e: 2^(e - 128) from 2^-28 to 2^32 (products and sums of every test stay finite)
        raw[..., 0] = rng.integers(100, 161, (rows, blocks))
    for o in HALF_FIELDS[name]:
        h = (rng.uniform(0.5, 1.5, (rows, blocks)) * 2.0 ** -8 * rng.choice([-1, 1], (rows, blocks))).astype(np.float16)
        raw[..., o:o + 2] = h.view(np.uint8).reshape(rows, blocks, 2)
    return torch.from_numpy(raw)


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    g = x.reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    q = torch.round(g * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    return (q * (amax / 127)).reshape(x.shape)


def random_q4_z(rows: int, k: int, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Q4_Z's values (0..15) and scales: d float16 of either sign, z 0..15, per 32 inputs."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, k), generator=g, dtype=torch.uint8)
    sign = torch.randint(0, 2, (rows, k // 32), generator=g) * 2 - 1
    d = ((torch.rand(rows, k // 32, generator=g) + 0.5) * 2.0 ** -8 * sign).half()
    return q, {"d": d, "z": torch.randint(0, 16, (rows, k // 32), generator=g, dtype=torch.uint8)}


@pytest.mark.parametrize("name", FILE_TYPES)
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


def test_mxfp4_scale_bytes_are_exact_alike():
    """Every e8m0 byte: d = 2^(e - 128) exactly for e in [2, 254] (gguf-py's values), 0 for e = 0 and 1 (below
    float32's normal range), the same in the torch unpacker and the compiled packer (loaders/gguf_file.py refuses
    255, e8m0's NaN); every one of those values dequantizes as gguf-py does."""
    e = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    d = gguf_quant.exponent_value(gguf_quant.e8m0_exponent(e))
    want = torch.ldexp(torch.ones(256, dtype=torch.float64), e.long() - 128)
    inside = (e >= 2) & (e <= 254)
    assert torch.equal(d[inside].double(), want[inside]) and not d[:2].any()
    raw = random_blocks("MXFP4", 16, 16)
    raw[..., 0] = e.reshape(16, 16)
    q, s = gguf_quant.unpack("MXFP4", raw)
    assert torch.equal(gguf_quant.exponent_value(s["e"]), d.reshape(16, 16))
    ok = raw.clone()
    ok[..., 0] = ok[..., 0].clamp(2, 254)
    ref = gguf.quants.dequantize(ok.reshape(16, -1).numpy(), gguf.GGMLQuantizationType.MXFP4).reshape(16, -1)
    ours = gguf_quant.dequantize_unpacked("MXFP4", *gguf_quant.unpack("MXFP4", ok)).numpy()
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    if kernels.build_kernels():
        w, sc = gguf_quant.pack("MXFP4", q, s)
        w2, sc2 = torch.ops.tpserve.kq_pack(raw.contiguous(), gguf_quant.TYPES["MXFP4"].code, 512)
        assert torch.equal(w, w2) and torch.equal(sc, sc2)


def test_gguf_file_checks_mxfp4_scales(caplog):
    """loaders/gguf_file.py serves MXFP4 (gguf-py's block size) and checks its scales as it reads them: e in
    [2, 254] exactly; 0 and 1, a warning (served as zero); 255 (e8m0's NaN), refused."""
    from pathlib import Path
    from types import SimpleNamespace

    from loaders.checkpoint import CheckpointError
    from loaders.gguf_file import GGUFCheckpoint

    assert gguf_quant.TYPES["MXFP4"].block_bytes == 17 and gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.MXFP4] == (
        32, 17)
    fake = SimpleNamespace(path=Path("oss.gguf"))
    GGUFCheckpoint._check_mxfp4_scales(fake, "w", torch.tensor([2, 128, 254], dtype=torch.uint8))
    assert not caplog.records
    GGUFCheckpoint._check_mxfp4_scales(fake, "w", torch.tensor([1, 128], dtype=torch.uint8))
    assert "1 MXFP4 scales below" in caplog.text
    with pytest.raises(CheckpointError, match="NaN"):
        GGUFCheckpoint._check_mxfp4_scales(fake, "w", torch.tensor([255], dtype=torch.uint8))


def test_q4_z_packed_losslessly():
    """Q4_Z (no file form): pack / unpack_packed keep every value, d and z; the weight is d * (q - z); the compiled
    packer, which reads file blocks, refuses it."""
    rows, k = 21, 512
    q, s = random_q4_z(rows, k)
    w, sc = gguf_quant.pack("Q4_Z", q, s)
    t = gguf_quant.TYPES["Q4_Z"]
    assert w.shape == (2, k // 32 * t.chunk_bytes) and sc.shape == (2, k // 32 * 48)
    q2, s2 = gguf_quant.unpack_packed("Q4_Z", w, sc, k)
    assert torch.equal(q2[:rows], q) and not q2[rows:].any()
    for name in s:
        assert torch.equal(s2[name][:rows].view(torch.uint8), s[name].view(torch.uint8)), name
    want = s["d"].float().repeat_interleave(32, dim=1) * (q.float() - s["z"].float().repeat_interleave(32, dim=1))
    assert torch.equal(gguf_quant.dequantize_unpacked("Q4_Z", q, s), want)
    with pytest.raises(ValueError):
        gguf_quant.unpack("Q4_Z", torch.zeros(1, 1, 19, dtype=torch.uint8))
    if kernels.build_kernels():
        with pytest.raises(RuntimeError, match="no file blocks"):
            torch.ops.tpserve.kq_pack(torch.zeros(1, 1, 0, dtype=torch.uint8), t.code, 32)


@pytest.mark.parametrize("name", list(gguf_quant.TYPES))
def test_the_kernel_equals_the_dequantized_product(name):
    if not kernels.build_kernels():
        pytest.skip("no compiled kernels")
    t = gguf_quant.TYPES[name]
    torch.manual_seed(0)
    for rows, k, m in ((37, 512, 1), (16, 256, 3), (50, 1024, 9)):
        if k % t.block:
            continue
        if t.block_bytes:
            raw = random_blocks(name, rows, k // t.block, seed=rows)
            qw = quant._one_type(name, [raw])
            unpacked = gguf_quant.unpack(name, raw)
        else:  # Q4_Z: from values and scales
            unpacked = random_q4_z(rows, k, seed=rows)
            qw = quant.from_gguf(name, *unpacked)
        assert qw.kernel is not None and qw.mode == name
        w = quant.dequantize(qw)
        assert torch.equal(w, gguf_quant.dequantize_unpacked(name, *unpacked))
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
