"""Gemma 2: Gemma plus a norm after attention and around the MLP (post_attention, pre/post_feedforward), attention
scale query_pre_attn_scalar**-0.5, tanh soft-capping of attention scores and of the final logits, and every other
layer a sliding-window layer (`layer_types`).

Sliding windows are per layer here: the step's metadata (built by the runner, causal for every layer) is narrowed
to the window once per step for the sliding layers, and only when some token of the step sees past the window.
"""

from __future__ import annotations

import torch

from sharding.layers.attention import AttentionMetadata, stage_output
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

    def plan_norms(self):
        """forward's four norms, for the CPU decode plan: pre-feedforward into the MLP, post-attention and
        post-feedforward on the two outputs before their residual adds."""
        return self.pre_feedforward_layernorm, self.post_attention_layernorm, self.post_feedforward_layernorm


class Gemma2ForCausalLM(GemmaForCausalLM):
    layer_cls = Gemma2DecoderLayer
    supports_sequence_parallel = False  # its four norms per layer are not split (yet)

    def __init__(self, config, dist, dtype, device):
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 2 with use_bidirectional_attention=true (an embedding model) is not supported")
        super().__init__(config, dist, dtype, device)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    def sliding_window(self) -> int | None:
        return None  # the runner's metadata is causal for every layer; the sliding layers narrow it (window_meta)

    def forward(self, ids: torch.Tensor, meta: AttentionMetadata, hidden: torch.Tensor | None = None):
        if self.lora is not None:  # LoRA adapter rows of this step (sharding/layers/lora.py)
            self.lora.rows = meta.lora
        plan = self.plan_for(meta)  # a decode step on the CPU decode plan (each sliding layer with its window)
        if plan is not None:
            return self.on_plan(plan, ids, meta, self._head)
        windows = {layer.self_attn.window for layer in self.layers} - {None}
        metas = {None: meta, **{w: window_meta(meta, w) for w in windows}}
        h = self.embed(ids) if self.first_stage else hidden
        for layer in self.layers:
            h = layer(h, metas[layer.self_attn.window])
        if not self.last_stage:
            return h
        return stage_output(h, meta, self._head, self.norm)

    def _head(self, x: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(x)
        if logits is not None and self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def window_meta(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """The step's causal metadata narrowed to a sliding window (AttentionMetadata.windowed), unless no token of the
    step sees past the window (causal is the same thing then)."""
    if not meta.positions.numel() or int(meta.positions.max()) < window:
        return meta
    return meta.windowed(window)
