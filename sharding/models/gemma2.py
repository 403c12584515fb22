"""Gemma 2: Gemma plus a norm after attention and around the MLP (post_attention, pre/post_feedforward), attention
scale query_pre_attn_scalar**-0.5, tanh soft-capping of attention scores and of the final logits, and every other
layer a sliding-window layer.

Sliding windows: tpserve applies one causal mask to every layer, which equals the sliding-window mask as long as no
sequence is longer than the window. So a Gemma 2 checkpoint is accepted when max_model_len <= sliding_window
(released checkpoints: window 4096, tpserve's default max_model_len 2048) and rejected at start otherwise.
"""

from __future__ import annotations

import torch

from sharding.attention import AttentionMetadata, KVCache, apply_rotary, attend
from sharding.models.gemma import GemmaDecoderLayer, GemmaForCausalLM, gemma_norm
from sharding.models.llama import LlamaAttention


class Gemma2Attention(LlamaAttention):
    def __init__(self, config, prefix, dist, dtype, device):
        super().__init__(config, prefix, dist, dtype, device)
        self.scale = config.query_pre_attn_scalar ** -0.5
        self.softcap = getattr(config, "attn_logit_softcapping", None)
        layer_idx = int(prefix.split(".")[-2])  # model.layers.{i}.self_attn
        layer_types = getattr(config, "layer_types", None) or []
        sliding = layer_idx < len(layer_types) and layer_types[layer_idx] == "sliding_attention"
        self.window: int | None = config.sliding_window if sliding else None

    @property
    def cache(self) -> KVCache | None:
        return self._cache

    @cache.setter
    def cache(self, cache: KVCache | None) -> None:
        """The runner sizes the cache by max_model_len: here is where a too-long context is refused at start."""
        window = getattr(self, "window", None)
        if cache is not None and window is not None and cache.k.shape[2] > window:
            raise ValueError(
                f"Gemma 2 alternates sliding-window layers (window {window}) with global ones, and tpserve does not "
                f"apply per-layer windows: max_model_len ({cache.k.shape[2]}) must not exceed sliding_window; "
                f"pass --max-model-len {window} or less")
        self._cache = cache

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        q, k = apply_rotary(q, meta.cos, meta.sin), apply_rotary(k, meta.cos, meta.sin)
        self.cache.write(meta, k, v)
        return self.o_proj(attend(q, self.cache, meta, self.kv_for_q, self.scale, softcap=self.softcap))


class Gemma2DecoderLayer(GemmaDecoderLayer):
    attention_cls = Gemma2Attention

    def __init__(self, config, prefix, dist, dtype, device):
        super().__init__(config, prefix, dist, dtype, device)
        self.pre_feedforward_layernorm = gemma_norm(f"{prefix}.pre_feedforward_layernorm.weight", config, dtype, device)
        self.post_feedforward_layernorm = gemma_norm(f"{prefix}.post_feedforward_layernorm.weight", config, dtype,
                                                     device)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), meta))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma2ForCausalLM(GemmaForCausalLM):
    layer_cls = Gemma2DecoderLayer

    def __init__(self, config, dist, dtype, device):
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 2 with use_bidirectional_attention=true (an embedding model) is not supported")
        super().__init__(config, dist, dtype, device)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    def sliding_window(self) -> int | None:
        return None  # every layer causal; see the module docstring and Gemma2Attention.cache

    def forward(self, ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        logits = super().forward(ids, meta)
        if logits is not None and self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
