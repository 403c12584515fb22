"""Qwen3: the Llama layout plus an RMSNorm over each query and key head before rotary (q_norm, k_norm)."""

from __future__ import annotations

import torch

from sharding.layers.linear import RMSNorm
from sharding.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from sharding.models.qwen2 import reject_sliding_layers


class Qwen3Attention(LlamaAttention):
    # per-head q/k RMSNorms (norm_qk), which the CPU decode plan computes too (plan_qk_norms)
    def __init__(self, config, prefix, dist, dtype, device):
        super().__init__(config, prefix, dist, dtype, device)
        self.q_norm = RMSNorm(f"{prefix}.q_norm.weight", self.head_dim, config.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(f"{prefix}.k_norm.weight", self.head_dim, config.rms_norm_eps, dtype, device)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)

    def plan_qk_norms(self) -> tuple[RMSNorm, RMSNorm]:
        return self.q_norm, self.k_norm


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer

    def __init__(self, config, dist, dtype, device):
        reject_sliding_layers(config)
        super().__init__(config, dist, dtype, device)

    def sliding_window(self) -> int | None:
        return None
