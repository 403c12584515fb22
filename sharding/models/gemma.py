"""Gemma: the Llama layout with a GeGLU MLP (tanh-approximated GELU on the gate), RMSNorm scaling by (1 + w),
token embeddings multiplied by sqrt(hidden_size) (rounded to the embedding dtype, as transformers does) and, by
default, an LM head tied to the embedding."""

from __future__ import annotations

import torch

from sharding.layers.activations import activation
from sharding.layers.linear import RMSNorm
from sharding.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


def gemma_norm(name: str, config, dtype: torch.dtype, device: torch.device) -> RMSNorm:
    return RMSNorm(name, config.hidden_size, config.rms_norm_eps, dtype, device, offset=1.0)


class GemmaMLP(LlamaMLP):
    def __init__(self, config, prefix, dist, dtype, device):
        super().__init__(config, prefix, dist, dtype, device)
        # Gemma names it hidden_act, Gemma 2 hidden_activation; both mean gelu_pytorch_tanh in released checkpoints
        self.act_name = getattr(config, "hidden_activation", None) or config.hidden_act
        self.act_fn = activation(self.act_name)

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return self.act_fn(gate)

    def plan_activation(self) -> int | None:
        """1 (GELU, tanh approximation) for the released checkpoints' activations; None for another (the plan then
        runs this MLP as its module)."""
        return 1 if self.act_name in ("gelu_pytorch_tanh", "gelu_new") else None


class GemmaDecoderLayer(LlamaDecoderLayer):
    mlp_cls = GemmaMLP

    def __init__(self, config, prefix, dist, dtype, device):
        super().__init__(config, prefix, dist, dtype, device)
        self.input_layernorm = gemma_norm(f"{prefix}.input_layernorm.weight", config, dtype, device)
        self.post_attention_layernorm = gemma_norm(f"{prefix}.post_attention_layernorm.weight", config, dtype, device)


class GemmaForCausalLM(LlamaForCausalLM):
    layer_cls = GemmaDecoderLayer

    def __init__(self, config, dist, dtype, device):
        super().__init__(config, dist, dtype, device)
        if self.last_stage:
            self.norm = gemma_norm("model.norm.weight", config, dtype, device)
        self.embed_scale = config.hidden_size ** 0.5

    def embed(self, ids: torch.Tensor, scatter: bool = False) -> torch.Tensor:
        h = self.embed_tokens(ids, scatter=scatter)
        return h * torch.tensor(self.embed_scale, dtype=h.dtype)

    def plan_ends(self) -> None:
        """None: its embedding's rows are scaled (embed), and Gemma 2's logits soft-capped; the compiled decode step
        runs its layers only."""
        return None
