"""CPU linears through oneDNN with weights packed once at load.

torch's default CPU path for `F.linear` (MKL sgemm/sgemv) streams SmolLM2's 538 MB of fp32 weights in ~47 ms per
batch-1 step on this 2-core machine (11 GB/s) and is slower still at 2 <= M <= 32 rows. The same products through
oneDNN with the weight reordered once into its blocked layout take ~29 ms, and 29 ms at M=8 where MKL takes 69
(scripts/bench_linear.py). The packed copy replaces the plain weight (same size); results equal F.linear to fp32
rounding (another summation order); in bf16 the bias may be added after rounding (within two bf16 roundings).

This is the kernel torch's own inductor uses for frozen CPU linears (`mkldnn._linear_pointwise`); it is used only on
CPU for float32/bfloat16 when oneDNN is available, and can be turned off with TPSERVE_PREPACK=0.
"""

from __future__ import annotations

import os

import torch

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and weight.dim() == 2
            and os.environ.get("TPSERVE_PREPACK", "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] weight -> oneDNN's blocked layout (no batch-size hint: it serves decode and prefill alike)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias) with a weight from `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
