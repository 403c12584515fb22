"""Hugging Face quantized weights laid out for the kernels (sharding/layers/stored.py): every kind of stored group
becomes a weight whose values are the stored ones, and whose kernel multiplies by them.

The reading of each format (its packing, zero points, orientation) is checked against the libraries in
tests/loaders/test_hf_quant.py; here a Grouped is made directly, so every layout is covered on its own."""

from __future__ import annotations

import pytest
import torch

from loaders.checkpoint import CheckpointError
from loaders.hf_quant import E2M1, Grouped
from sharding.cpu import kernels
from sharding.layers import quant, stored
from test_quant import as_kernel_sees


def grouped(kind: str, bits: int, group: int, rows: int = 37, cols: int = 256, asym: bool = False,
            seed: int = 0) -> Grouped:
    """Random codes and bfloat16-valued scales (as checkpoints store them) of one kind."""
    torch.manual_seed(seed)
    n = cols // group
    scale = (torch.rand(rows, n) * 0.02 + 0.001).bfloat16().float()
    if kind == "mxfp4":
        return Grouped("mxfp4", torch.randint(0, 16, (rows, cols), dtype=torch.uint8),
                       torch.ldexp(torch.ones(rows, n), torch.randint(-10, 2, (rows, n))), 32, 4)
    if kind == "fp8":
        codes = (torch.randn(rows, cols) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        return Grouped("fp8", codes, scale, group, 8)
    codes = torch.randint(0, 1 << bits, (rows, cols), dtype=torch.uint8)
    zero = torch.randint(0, 1 << bits, (rows, n), dtype=torch.uint8) if asym else None
    return Grouped("int", codes, scale, group, bits, zero)


CASES = {
    # name: (Grouped, the mode it is served in, exact values)
    "int4 group 128": (dict(kind="int", bits=4, group=128), "int4", True),
    "int4 group 64": (dict(kind="int", bits=4, group=64), "int4", True),
    "int4 group 32": (dict(kind="int", bits=4, group=32), "int4", True),
    "int4 channel": (dict(kind="int", bits=4, group=256), "int4", True),
    "int4 asymmetric": (dict(kind="int", bits=4, group=128, asym=True), "Q4_Z", True),
    "int4 asymmetric group 32": (dict(kind="int", bits=4, group=32, asym=True), "Q4_Z", True),
    "int8 channel": (dict(kind="int", bits=8, group=256), "int8", False),  # (-128 -> -127)
    "int8 group 128": (dict(kind="int", bits=8, group=128), "int8", False),
    "int8 asymmetric": (dict(kind="int", bits=8, group=128, asym=True), "bf16", False),
    "fp8 channel": (dict(kind="fp8", bits=8, group=256), "bf16", False),
    "mxfp4": (dict(kind="mxfp4", bits=4, group=32), "MXFP4", True),
}


@pytest.mark.parametrize("case", CASES)
def test_served_values_are_the_stored_ones(case):
    assert kernels.build_kernels()  # (the compiled kernels' int8 layout holds no -128)
    spec, mode, exact = CASES[case]
    g = grouped(**spec)
    qw = stored.convert(g)
    assert qw.mode == mode
    want = g.dequantize()
    got = quant.dequantize(qw)
    if exact:
        assert torch.equal(got, want)
    elif mode == "bf16":  # each value rounded to bfloat16, nothing more
        assert torch.equal(got, want.bfloat16().float())
    elif mode == "int8":  # every stored value but -128, which the compiled kernels serve as -127
        edge = g.codes == 0
        assert torch.equal(got[~edge], want[~edge])
        step = g.scale.repeat_interleave(g.group, dim=1)
        assert torch.equal(got[edge], want[edge] + step[edge])
    else:
        raise AssertionError(mode)


@pytest.mark.parametrize("case", CASES)
def test_kernel_multiplies_by_the_stored_values(case):
    """The compiled kernel of each served layout against the product of the same values (activations rounded as the
    kernel rounds them), at the row counts of its blocks and tails."""
    assert kernels.build_kernels()
    spec, mode, _ = CASES[case]
    g = grouped(**spec, rows=45)
    qw = stored.convert(g)
    assert qw.kernel is not None, "served off the compiled kernels"
    w = quant.dequantize(qw).double()
    torch.manual_seed(1)
    for m in (1, 3, 4, 7, 16, 33):
        x = torch.randn(m, 256)
        kind = "int8" if mode in ("int4", "int8", "Q4_Z", "MXFP4") else "bf16"
        want = (as_kernel_sees(x, kind).double() @ w.T).float()
        got = quant.linear(x, qw)
        close = torch.isclose(got, want, atol=2e-4, rtol=1e-4).all(dim=1)
        # an activation within float32 rounding of a rounding boundary may go the other way in the kernel (its
        # products summed in another order): one step of that row's rounding, times the weights, at most
        assert int((~close).sum()) <= 1, (m, (got - want).abs().max())
        step = x.abs().amax(dim=1) / 127 if kind == "int8" else x.abs().amax(dim=1) * 2 ** -8
        bound = step[:, None] * w.abs().amax(dim=1).float()[None, :] + 2e-4
        assert ((got - want).abs() <= bound).all()


def test_parts_stored_alike_are_one_weight_and_others_side_by_side():
    a, b = grouped("int", 4, 128, rows=16), grouped("int", 4, 128, rows=8, seed=1)
    one = stored.from_grouped([a, b])
    assert one.mode == "int4" and one.out_features == 24
    assert torch.equal(quant.dequantize(one), torch.cat([a.dequantize(), b.dequantize()]))
    c = grouped("int", 4, 128, rows=8, asym=True, seed=2)
    both = stored.from_grouped([a, c])  # a symmetric part joins an asymmetric one: zero 8 made explicit
    assert both.mode == "Q4_Z" and torch.equal(quant.dequantize(both), torch.cat([a.dequantize(), c.dequantize()]))
    m = stored.from_grouped([a, grouped("mxfp4", 4, 32, rows=8)])
    assert m.mode == "mixed" and [p.mode for p in m.parts] == ["int4", "MXFP4"]


def test_mxfp4_values_are_e2m1_times_a_power_of_two():
    g = grouped("mxfp4", 4, 32, rows=4, cols=64)
    w = g.dequantize()
    values = set(torch.tensor(E2M1).abs().tolist())
    ratio = (w / g.scale.repeat_interleave(32, dim=1)).abs()
    assert set(ratio.unique().tolist()) <= values


def test_mxfp4_scales_over_e8m0s_range(caplog):
    """Every MXFP4 scale whose half is a normal float32 is served exactly, 2^-125 to 2^127 (e8m0's 2 to 254);
    2^-127 and 2^-126 (e = 0, 1) are served as zero, with a warning; a scale that is not a power of two is refused."""
    rows, cols = 253, 64
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.uint8)
    scale = torch.ldexp(torch.ones(rows, 2), torch.arange(-125, 128).view(rows, 1).expand(rows, 2))
    g = Grouped("mxfp4", codes, scale, 32, 4)
    qw = stored.convert(g)
    assert qw.mode == "MXFP4" and qw.scale.shape[1] == 2 * 16
    assert torch.equal(quant.dequantize(qw), g.dequantize()) and not caplog.records
    tiny = Grouped("mxfp4", codes[:1], torch.tensor([[2.0 ** -126, 1.0]]), 32, 4)
    w = quant.dequantize(stored.convert(tiny))
    assert not w[:, :32].any() and torch.equal(w[:, 32:], tiny.dequantize()[:, 32:])
    assert "1 MXFP4 scales below" in caplog.text
    with pytest.raises(CheckpointError, match="powers of two"):
        stored.convert(Grouped("mxfp4", codes[:1], torch.tensor([[0.75, 1.0]]), 32, 4))


def test_zero_points_beyond_4_bits_fall_back_to_q5_0():
    """A zero point no 4-bit format writes (16): Q4_Z cannot hold it, Q5_0's q - z + 16 does, exactly."""
    g = grouped("int", 4, 128, asym=True)
    g = Grouped("int", g.codes, g.scale, g.group, g.bits, torch.full_like(g.zero, 16))
    qw = stored.convert(g)
    assert qw.mode == "Q5_0" and torch.equal(quant.dequantize(qw), g.dequantize())
