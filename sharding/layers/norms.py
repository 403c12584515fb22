"""Norm and position layers that some architectures add to the shared ones in sharding/layers/linear.py.

All of them are replicated: every rank holds the whole (small) tensor and computes the same result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loaders.checkpoint import Checkpoint
from sharding.layers.linear import Replicated, _empty


class LayerNorm(Replicated):
    """LayerNorm with weight and bias (GPT-2's ln_1, ln_2, ln_f); `name` is the prefix without `.weight`."""

    def __init__(self, name: str, dim: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__(f"{name}.weight", (dim,), dtype, device)
        self.bias_name = f"{name}.bias"
        self.bias = _empty(dim, dtype=dtype, device=device)
        self.eps = eps

    def expected(self) -> dict[str, tuple[int, ...]]:
        return {self.name: tuple(self.weight.shape), self.bias_name: tuple(self.bias.shape)}

    def load(self, ckpt: Checkpoint) -> None:
        super().load(ckpt)
        self.bias.data.copy_(ckpt.read(self.bias_name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class PositionEmbedding(Replicated):
    """A learned table of absolute positions [max_positions, hidden] (GPT-2's wpe), looked up at each token's
    position in the step (`meta.positions`). Replicated: it is small next to the vocabulary table."""

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions, self.weight)
