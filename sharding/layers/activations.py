"""The MLP activations of the supported checkpoints, by the name config.json gives them (`hidden_act`,
`hidden_activation`, GPT-2's `activation_function`), each computed exactly as transformers' ACT2FN computes it.

A plain dict of functions instead of importing transformers.activations, which costs every rank ~4 s at start.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation of GELU, written out as transformers' NewGELUActivation."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": gelu_new,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(sorted(ACTIVATIONS))}") from None
