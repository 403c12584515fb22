"""gpt-oss: Llama's layout with q/k/v/o biases, a learned attention sink per head, sliding-window and full layers
alternating (`layer_types`, `sliding_window`), YaRN rotary, and in every layer a sparse MoE feed-forward:

- router `mlp.router` (weight [E, H] and bias [E]): top-k of the logits, then a softmax over those k;
- experts fused and transposed: `mlp.experts.gate_up_proj` [E, H, 2I] with gate and up interleaved along the last
  dimension (even columns gate, odd columns up), `gate_up_proj_bias` [E, 2I], `down_proj` [E, I, H],
  `down_proj_bias` [E, H];
- a clamped SwiGLU: gate clamped above at `swiglu_limit`, up to [-limit, limit], out = (up + 1) * gate *
  sigmoid(`swiglu_alpha` * gate).

The sinks: softmax over [scores..., sink] with the sink's column dropped after it (sharding.layers.attention.attend,
`sinks`); each rank holds its query heads' sinks, in float32.

Experts split as sharding/layers/moe.py splits them (tensor parallel: the slice [a, b) of every expert's intermediate
dimension, i.e. the gate_up columns [2a, 2b) and the down rows [a, b); expert parallel: whole experts), each read by
byte ranges. The down bias is added once over the group: by TP rank 0 under tensor parallelism (the other ranks do
not read it), by the owning rank under expert parallelism.

Sliding windows are per layer, as in Gemma 2 (gemma2.window_meta). On the CPU decode plan (sharding/cpu/decode_plan.py):
the attention op takes each layer's sinks and window, the MoE feed-forward runs as its module (the experts in the
compiled grouped kernel, the clamped SwiGLU included).
"""

from __future__ import annotations

import torch
from torch import nn

from loaders.partition import shard_heads
from sharding.layers.attention import AttentionMetadata, stage_output
from sharding.dist import Dist
from sharding.layers.linear import Replicated
from sharding.models.gemma2 import window_meta
from sharding.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from sharding.models.phi3 import longrope_limit
from sharding.layers.moe import (Block, Expert, ExpertLinear, ReplicatedLinear, Routing, SparseMoe, check_moe_config,
                          local_experts, local_inter)

LAYER_TYPES = ("sliding_attention", "full_attention")


class HeadSlice(Replicated):
    """Elements [start, stop) of a per-head vector of `full` elements (this rank's query heads' sinks), float32."""

    def __init__(self, name: str, full: int, start: int, stop: int, device: torch.device):
        super().__init__(name, (stop - start,), torch.float32, device)
        self.full, self.start, self.stop = full, start, stop

    def expected(self) -> dict[str, tuple[int, ...]]:
        return {self.name: (self.full,)}

    def load(self, ckpt) -> None:
        self.weight.data.copy_(ckpt.read(self.name, 0, [(self.start, self.stop)]))


class GptOssAttention(LlamaAttention):
    qkv_bias_default = True  # transformers' GptOssConfig defaults attention_bias to true

    def __init__(self, config, prefix, dist, dtype, device):
        super().__init__(config, prefix, dist, dtype, device)
        heads = shard_heads(self.total_num_heads, self.total_num_kv_heads, dist.world_size, dist.rank)
        self.sinks = HeadSlice(f"{prefix}.sinks", self.total_num_heads, heads.q_start, heads.q_stop, device)
        layer_idx = int(prefix.split(".")[-2])  # model.layers.{i}.self_attn
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.window = config.sliding_window if sliding else None

    def attention_sinks(self) -> torch.Tensor:
        return self.sinks.weight


def gpt_oss_experts(config, prefix: str, dist: Dist, dtype: torch.dtype, device: torch.device
                    ) -> tuple[list[Expert], set[str]]:
    """This rank's experts of `{prefix}` (`model.layers.{i}.mlp.experts`) and the tensors it may not read at all
    (every rank reads a part of the four fused tensors, except a rank that owns no expert under expert parallelism,
    and the down bias, which only the ranks adding it read)."""
    e_all, hidden, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
    gu, gu_bias, down, down_bias = (f"{prefix}.{n}" for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                                               "down_proj_bias"))
    a, b = local_inter(inter, dist)
    add_down_bias = dist.expert_parallel or dist.rank == 0
    experts = []
    for e in range(*local_experts(e_all, dist)):
        # [H, 2I] slice of expert e, columns [2a, 2b): gate/up pairs a..b-1, transposed, then gate rows, up rows
        gate_up = ExpertLinear(2 * (b - a), hidden,
                               [Block(gu, (e_all, hidden, 2 * inter), 2 * a, 2 * b, dim=1, index=e, transposed=True,
                                      interleaved=True)],
                               [Block(gu_bias, (e_all, 2 * inter), 2 * a, 2 * b, index=e, interleaved=True)],
                               dtype, device)
        down_lin = ExpertLinear(hidden, b - a, [Block(down, (e_all, inter, hidden), a, b, index=e, transposed=True)],
                                [Block(down_bias, (e_all, hidden), 0, hidden, index=e)] if add_down_bias else None,
                                dtype, device)
        experts.append(Expert(e, gate_up, down_lin, add_down_bias))
    return experts, {gu, gu_bias, down, down_bias}


class ClampedSwiGLU(nn.Module):
    """gpt-oss's expert activation on [n, 2I] gate|up rows -> [n, I], as transformers' GptOssExperts._apply_gate."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu

    def plan_activation(self) -> tuple[int, float, float]:
        """The same activation in the compiled experts (decode_glue.cpp MoeExperts.set_activation: kind 1)."""
        return 1, self.alpha, self.limit


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention

    def make_mlp(self, config, prefix, dist, dtype, device):
        prefix, e = f"{prefix}.mlp", config.num_local_experts
        router = ReplicatedLinear(f"{prefix}.router", e, config.hidden_size, True, device)
        experts = gpt_oss_experts(config, f"{prefix}.experts", dist, dtype, device)
        return SparseMoe(router, Routing(config.num_experts_per_tok, topk_softmax=True), experts, e, dist,
                         config.hidden_size, act=ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit))


def check_gpt_oss_config(config) -> None:
    """Refuse, with the field's name, what this implementation does not compute as transformers does."""
    name = "GptOssForCausalLM"
    check_moe_config(config, name)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or len(layer_types) != config.num_hidden_layers:
        raise ValueError(f"{name}: config field layer_types must name each of the {config.num_hidden_layers} layers")
    other = sorted(set(layer_types) - set(LAYER_TYPES))
    if other:
        raise ValueError(f"{name}: config field layer_types holds {other}; supported: {', '.join(LAYER_TYPES)}")
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in layer_types and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{name}: config field sliding_window={window!r} must be a positive integer for its "
                         "sliding_attention layers")
    params = getattr(config, "rope_parameters", None) or {}
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):  # gpt-oss rotates the whole head
        raise ValueError(f"{name}: config field partial_rotary_factor={partial!r} is not supported")
    for field in ("swiglu_alpha", "swiglu_limit"):
        value = getattr(config, field, None)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{name}: config field {field}={value!r} must be a number")


class GptOssForCausalLM(LlamaForCausalLM):
    layer_cls = GptOssDecoderLayer
    has_experts = True

    def __init__(self, config, dist, dtype, device):
        check_gpt_oss_config(config)
        super().__init__(config, dist, dtype, device)

    def sliding_window(self) -> int | None:
        return None  # the runner's metadata is causal for every layer; the sliding layers narrow it (window_meta)

    def check_max_model_len(self, n: int) -> None:
        """LongRoPE, as for Phi-3 (sharding/models/phi3.py): only within original_max_position_embeddings."""
        limit = longrope_limit(self.config)
        if limit is not None and n > limit:
            raise ValueError(f"GptOssForCausalLM: config field rope_parameters has LongRoPE, whose long factors apply "
                             f"past original_max_position_embeddings ({limit}); tpserve applies the short factors "
                             f"only, so max_model_len ({n}) must not exceed {limit}")

    def forward(self, ids: torch.Tensor, meta: AttentionMetadata, hidden: torch.Tensor | None = None):
        if self.lora is not None:  # LoRA adapter rows of this step (sharding/layers/lora.py)
            self.lora.rows = meta.lora
        plan = self.plan_for(meta)  # the CPU decode plan (each layer's window and sinks its own)
        if plan is not None:
            return self.on_plan(plan, ids, meta, self.lm_head)
        windows = {layer.self_attn.window for layer in self.layers} - {None}
        metas = {None: meta, **{w: window_meta(meta, w) for w in windows}}
        h = self.embed(ids, scatter=meta.seq_parallel) if self.first_stage else hidden
        for layer in self.layers:
            h = layer(h, metas[layer.self_attn.window])
        if not self.last_stage:
            return h
        if meta.seq_parallel:
            h = self.dist.all_gather_tokens(h, meta.positions.numel())
        return stage_output(h, meta, self.lm_head, self.norm)
