"""Weight-only quantization of the linears (`--quantization int8|int4`).

Each rank quantizes its own shard right after reading it, so it never holds more than one layer's weight in the
checkpoint's precision next to the quantized model. Activations stay in the model's dtype; the products are computed
in float32.

- int8: symmetric, one float32 scale per output channel: W[n, k] ~= q[n, k] * scale[n], q in [-127, 127].
- int4: symmetric, one float32 scale per group of `group` (32 or 128; 32 where the input size is not a multiple of
  128) inputs, as llama.cpp's Q4_0: the input of
  largest magnitude m in a group maps to -8, so scale = m / -8 and q = round(W / scale) clamped to [-8, 7]; stored
  as q + 8 in a nibble, two per byte. Within each run of 32 inputs, byte j holds input j (low nibble) and input
  j + 16 (high nibble), the layout the kernel unpacks with one AND and one shift.

Kernels: on CPU, sharding/csrc/quant_linear.cpp (`torch.ops.tpserve.int8_linear/int4_linear`) for every step: it
streams the quantized bytes once and converts them to float32 in registers, 4 weight rows x 6 activation rows at a
time (or, opted in, multiplies them with int8 activations: see quantize_activations). It beat dequantizing to float32
for `F.linear` at every batch size measured (1 to 512 rows; scripts/bench_quant.py --linears). Without the kernel (no
compiler, another device: CUDA included) the weight is dequantized in chunks of output rows for `F.linear`: correct,
not fast. All paths compute the same products up to float32 summation order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sharding import kernels

MODES = ("int8", "int4")
INT4_GROUP_SIZES = (32, 128)
DEQUANT_CHUNK = 1024  # output rows dequantized at a time on the fallback path (bounded transient memory)


@dataclass(slots=True)
class QuantizedWeight:
    """A quantized [out, in] weight: `data` int8 [out, in] (int8) or uint8 [out, in/2] (int4); `scale` float32 [out]
    (int8) or [out, in/group] (int4)."""

    mode: str
    data: torch.Tensor
    scale: torch.Tensor
    in_features: int
    group: int = 0
    kernel: tuple | None = None  # (op, its arguments after x): see bind

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()


def check(mode: str | None, group: int) -> None:
    if mode is not None and mode not in MODES:
        raise ValueError(f"--quantization must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "int4" and group not in INT4_GROUP_SIZES:
        raise ValueError(f"--quantization-group-size must be one of {INT4_GROUP_SIZES} for int4, not {group}")


def group_for(in_features: int, group: int) -> int:
    """The int4 group a linear gets: `group`, or 32 where the input size is not a multiple of it (SmolLM2's 576)."""
    return group if in_features % group == 0 else 32


def supported(mode: str, in_features: int, group: int) -> bool:
    """Whether a linear with this many inputs can be quantized (the kernels need whole vectors / groups)."""
    return in_features % (16 if mode == "int8" else group_for(in_features, group)) == 0


def quantize(weight: torch.Tensor, mode: str, group: int = 32) -> QuantizedWeight:
    w = weight.detach().float()
    out_features, in_features = w.shape
    if mode == "int8":
        scale = w.abs().amax(dim=1) / 127.0
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round(w * inv[:, None]).clamp_(-127, 127).to(torch.int8)
        return bind(QuantizedWeight(mode, q.contiguous(), scale.contiguous(), in_features))
    group = group_for(in_features, group)
    g = w.reshape(out_features, in_features // group, group)
    idx = g.abs().argmax(dim=-1, keepdim=True)
    scale = (torch.gather(g, -1, idx) / -8.0).squeeze(-1)  # [out, in/group]
    inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    q = (torch.round(g * inv[..., None]).clamp_(-8, 7) + 8).to(torch.uint8)  # [out, in/group, group]
    q = q.reshape(out_features, in_features // 32, 2, 16)  # runs of 32: inputs j and j + 16 share byte j
    packed = q[:, :, 0, :] | (q[:, :, 1, :] << 4)
    return bind(QuantizedWeight(mode, packed.reshape(out_features, in_features // 2).contiguous(),
                                scale.contiguous(), in_features, group))


def dequantize(qw: QuantizedWeight, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Float32 rows [start, stop) of the weight."""
    data, scale = qw.data[start:stop], qw.scale[start:stop]
    if qw.mode == "int8":
        return data.float() * scale[:, None]
    n = data.shape[0]
    b = data.reshape(n, qw.in_features // 32, 16)
    q = torch.stack([b & 0x0F, b >> 4], dim=2).reshape(n, qw.in_features // qw.group, qw.group)
    return ((q.float() - 8.0) * scale[..., None]).reshape(n, qw.in_features)


def quantize_activations() -> bool:
    """TPSERVE_QUANT_ACTIVATIONS=1: the kernel quantizes the activations to int8 per block of 32 for AVX-512 VNNI dot
    products, as llama.cpp's Q8_0/Q4_0 do. Off by default: decode streams the weights from memory either way, and on
    Zen 4 it was no faster in a decode step (int8 15.8 vs 16.3 ms/token, int4 13.2 vs 13.0) while it costs int8
    accuracy (SmolLM2 perplexity +0.136 instead of +0.037; BENCHMARKS.md)."""
    return os.environ.get("TPSERVE_QUANT_ACTIVATIONS", "0") == "1"


def bind(qw: QuantizedWeight) -> QuantizedWeight:
    """Resolve, once, the compiled op and its arguments (the settings above are read here, at load: a decode step
    makes ~120 of these calls, and each lookup per call cost microseconds)."""
    ops = kernels.quant_linear_ops() if qw.data.device.type == "cpu" else None
    if ops is None:
        qw.kernel = None
    elif qw.mode == "int8":
        qw.kernel = (ops[0], (qw.data, qw.scale, quantize_activations()))
    else:
        qw.kernel = (ops[1], (qw.data, qw.scale, qw.group, quantize_activations()))
    return qw


def linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ dequant(W)^T (+ bias), in x's dtype."""
    if qw.kernel is not None and x.dim() == 2 and x.dtype == torch.float32:
        op, args = qw.kernel  # the fast path: every step of a float32 model
        y = op(x, *args)
        return y + bias if bias is not None else y
    shape, dtype = x.shape, x.dtype
    x2 = x.reshape(-1, shape[-1]).float()
    if qw.kernel is not None:
        op, args = qw.kernel
        y = op(x2, *args)
    elif qw.out_features <= DEQUANT_CHUNK:
        y = F.linear(x2, dequantize(qw))
    else:
        y = torch.cat([F.linear(x2, dequantize(qw, a, a + DEQUANT_CHUNK))
                       for a in range(0, qw.out_features, DEQUANT_CHUNK)], dim=-1)
    y = y.to(dtype).reshape(*shape[:-1], qw.out_features)
    return y + bias if bias is not None else y
