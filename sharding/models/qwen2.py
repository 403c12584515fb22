"""Qwen2: the Llama layout with a bias on q/k/v (not on o_proj)."""

from __future__ import annotations

from sharding.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


def reject_sliding_layers(config) -> None:
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError("checkpoints with sliding-window layers (use_sliding_window=true) are not supported yet")


class Qwen2Attention(LlamaAttention):
    def qkv_bias(self, config) -> bool:
        return True


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2DecoderLayer

    def __init__(self, config, dist, dtype, device):
        reject_sliding_layers(config)
        super().__init__(config, dist, dtype, device)

    def sliding_window(self) -> int | None:
        return None
