"""Linears stored quantized in the checkpoint, read into the kernels' layouts without a float copy.

Two sources: a GGUF file's blocks (quant.read_blocks) and a Hugging Face folder's groups (loaders/hf_quant.py:
compressed-tensors, AWQ, GPTQ, FP8, MXFP4), which `read_weight` turns into the layout of the kernel that serves
them exactly (same values, same scales):

| stored | served as | how |
|---|---|---|
| int4, symmetric (zero 8) | int4 (group 128 where the groups are whole multiples of 128, else 32) | nibbles kept; float16 scales repeated over the layout's groups |
| int4 with zero points (AWQ, GPTQ sym=false, compressed-tensors asymmetric) | Q4_Z (d = s, z per 32 inputs; q kept) | exact: W = d * (q - z), the kernel's int32 dot is sum(x q) - z sum(x) |
| int8, symmetric | int8 (Q8_0's blocks of 32) | bytes kept (the compiled kernels take -128 as -127, as for GGUF's Q8_0) |
| int8 with zero points | bf16 | s * (q - z) rounded to bfloat16 (no int8 kernel takes zero points) |
| float8 e4m3 (per tensor, channel or block) | bf16 | q * s rounded to bfloat16 |
| MXFP4 (e2m1 values, e8m0 scales per 32) | MXFP4 (codes kept; d = 2^(e - 128) kept as its float32 exponent byte) | exact: every e2m1 value doubled is an integer in [-12, 12], the kernel's table; scales below 2^-126 (e < 2) are served as zero, with a warning |

MXFP4 takes 4.25 bits per weight in its layout (4 + a byte per 32, as the checkpoint stores it) and Q4_Z 4.75 (4 + d
and a byte z per 32), where Q5_0, which served both exactly before them (2 * value + 16; q - z + 16), takes 5.5; Q5_0
stays the fallback for zero points beyond 4 bits.

Scales are stored as float16 by these layouts: a bfloat16 or float16 scale converts exactly (within float16's range),
a float32 one rounds to 11 bits. The conversions run once, at load, on this rank's block of each weight.
"""

from __future__ import annotations

import logging

import torch

from loaders.checkpoint import CheckpointError
from loaders.hf_quant import Grouped
from sharding.layers import quant
from sharding.layers.quant import QuantizedWeight

logger = logging.getLogger(__name__)


def read_weight(ckpt, parts: list[tuple[str, int, list[tuple[int, int]]]]) -> QuantizedWeight | None:
    """The weight made of `parts` (tensor name, dim, ranges; concatenated by output rows) laid out for its kernel, if
    the checkpoint stores it quantized (Hugging Face groups or GGUF blocks); None for float tensors."""
    stored = [ckpt.stored(name) for name, _, _ in parts]
    if not any(stored):
        return quant.read_blocks(ckpt, parts)
    if not all(stored):
        raise CheckpointError(f"{', '.join(name for name, _, _ in parts)}: one linear mixing float and quantized "
                              "tensors is not served")
    return from_grouped([ckpt.read_grouped(name, dim, ranges) for name, dim, ranges in parts])


def from_grouped(parts: list[Grouped]) -> QuantizedWeight:
    """Blocks of rows (q, k and v; gate and up) as one weight: one layout when they are stored alike, else each in its
    own, side by side (quant.mixed)."""
    first = parts[0]
    if len(parts) > 1 and all((p.kind, p.bits, p.group) == (first.kind, first.bits, first.group) for p in parts):
        zeros = None
        if any(p.zero is not None for p in parts):
            zeros = torch.cat([p.zero if p.zero is not None else torch.full_like(p.scale, 1 << (p.bits - 1),
                                                                                  dtype=torch.uint8) for p in parts])
        first = Grouped(first.kind, torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                        first.group, first.bits, zeros, first.label)
        parts = [first]
    if len(parts) > 1:
        return quant.mixed([convert(p) for p in parts])
    return convert(first)


def _half(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales as float16 (the layouts' type): exact for bfloat16 / float16 ones within float16's range."""
    if bool((scale.abs() > 65504).any()):
        raise CheckpointError(f"a scale of {float(scale.abs().max()):g} is beyond float16's range (65504)")
    return scale.half()


def convert(g: Grouped) -> QuantizedWeight:
    rows, cols = g.codes.shape
    if cols % 32:  # (the integer layouts are made of blocks of 32 inputs)
        return quant.quantize(g.dequantize(), "bf16")
    if g.kind == "mxfp4":
        # the codes as they are: MXFP4's kernel maps them to kvalues_mxfp4 (E2M1 doubled), so d is half the scale,
        # kept as its float32 exponent field (0 where d is below float32's normal range: served as zero)
        bits = (g.scale.float() / 2).contiguous().view(torch.int32)
        field = (bits >> 23) & 0xFF
        if bool((bits < 0).any() or (field == 255).any() or ((field > 0) & ((bits & 0x7FFFFF) != 0)).any()):
            raise CheckpointError(f"{g.label or 'an MXFP4 linear'}: MXFP4 scales must be finite powers of two (e8m0)")
        small = (field == 0) & (g.scale != 0)
        if bool(small.any()):
            logger.warning("%d MXFP4 scales below 2^-126 served as zero", int(small.sum()))
        return quant.from_gguf("MXFP4", g.codes.contiguous(), {"e": field.to(torch.uint8)})
    if g.kind == "fp8":
        return quant.quantize(g.dequantize(), "bf16")
    per32 = g.group // 32 if g.group % 32 == 0 else 0
    symmetric = g.zero is None or bool((g.zero == 1 << (g.bits - 1)).all())
    if not per32 or (g.bits == 8 and not symmetric):
        return quant.quantize(g.dequantize(), "bf16")
    if g.bits == 8:
        values = (g.codes.to(torch.int16) - 128).to(torch.int8)
        return quant.from_blocks("int8", values, _half(g.scale.repeat_interleave(per32, dim=1)))
    if symmetric:
        group = 128 if g.group % 128 == 0 else 32
        scale = _half(g.scale.repeat_interleave(g.group // group, dim=1))
        return quant.bind(quant.int4_layout(g.codes, scale, group, quant.kernel_rows("int4", g.codes.device)))
    # Q4_Z: the codes and zero points as they are, d the scale, W = d * (q - z). Exact, where Q4_1 (d * q + m) would
    # round m = -s * z to float16 and move the weights by up to 2^-11 of it: enough to change a greedy token of a
    # tiny test model.
    d = _half(g.scale.repeat_interleave(per32, dim=1))
    if g.bits == 4 and bool((g.zero < 16).all()):
        return quant.from_gguf("Q4_Z", g.codes.contiguous(), {"d": d, "z": g.zero.repeat_interleave(per32, dim=1)})
    # (a zero point beyond 4 bits, which no 4-bit format writes) q - z + 16 in Q5_0's 5 bits, where it fits
    zero = g.zero.to(torch.int16).repeat_interleave(g.group, dim=1)
    codes = g.codes.to(torch.int16) - zero + 16
    if bool(((codes < 0) | (codes > 31)).any()):
        return quant.quantize(g.dequantize(), "bf16")
    return quant.from_gguf("Q5_0", codes.to(torch.uint8), {"d": d})


def read_rows(ckpt, blocks) -> tuple[QuantizedWeight | None, tuple[int, int] | None]:
    """An expert's weight from blocks of a fused [E, ...] tensor (sharding/layers/moe.py Block: `index`,
    `transposed`, `interleaved`) stored quantized (gpt-oss's MXFP4), and the zeros its inputs get around them (a
    block split by inputs is read in whole groups: quant.whole_blocks); (None, None) for float tensors."""
    if not all(ckpt.stored(b.tensor) is not None for b in blocks):
        return None, None
    parts, pad = [], None
    for b in blocks:
        by_inputs = b.dim == (0 if b.transposed else 1)
        start, stop = b.start, b.stop
        if by_inputs:
            start, stop, pad = quant.whole_blocks(ckpt, b.tensor, b.start, b.stop)
        g = ckpt.read_grouped(b.tensor, b.dim, [(start, stop)], b.index)
        if b.interleaved:  # rows g0 u0 g1 u1 ... -> g0 g1 ... u0 u1 ...
            n = g.codes.shape[0]
            order = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])
            g = Grouped(g.kind, g.codes[order], g.scale[order], g.group, g.bits,
                        None if g.zero is None else g.zero[order], g.label)
        parts.append(g)
    return from_grouped(parts), pad
