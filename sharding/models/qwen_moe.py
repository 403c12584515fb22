"""Qwen2-MoE and Qwen3-MoE: Qwen2's / Qwen3's attention, and a sparse MoE feed-forward in the layers the config
makes sparse (`decoder_sparse_step`, `mlp_only_layers`; the others keep a dense MLP of `intermediate_size`).

Router: softmax over the experts, top-k, renormalised when `norm_topk_prob`. Qwen2-MoE adds a shared expert (a
dense MLP of `shared_expert_intermediate_size`, tensor-parallel under either split) scaled by
sigmoid(shared_expert_gate(x)); its share joins the layer's one all-reduce.
"""

from __future__ import annotations

from sharding.models.llama import LlamaForCausalLM, LlamaMLP
from sharding.models.qwen2 import Qwen2Attention, Qwen2DecoderLayer, reject_sliding_layers
from sharding.models.qwen3 import Qwen3DecoderLayer
from sharding.layers.moe import ReplicatedLinear, Routing, SparseMoe, check_moe_config, sparse_moe


def is_sparse(config, layer_idx: int) -> bool:
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


def qwen_moe(config, prefix: str, dist, dtype, device, shared: bool) -> SparseMoe:
    routing = Routing(config.num_experts_per_tok, renormalize=bool(getattr(config, "norm_topk_prob", False)))
    shared_mlp = shared_gate = None
    if shared and getattr(config, "shared_expert_intermediate_size", 0):
        shared_mlp = LlamaMLP(config, f"{prefix}.shared_expert", dist, dtype, device,
                              inter=config.shared_expert_intermediate_size)
        shared_gate = ReplicatedLinear(f"{prefix}.shared_expert_gate", 1, config.hidden_size, False, device)
    return sparse_moe(config, prefix, config.num_experts, config.moe_intermediate_size, routing, dist, dtype, device,
                      shared=shared_mlp, shared_gate=shared_gate)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config, prefix, dist, dtype, device):
        if is_sparse(config, self.layer_idx):
            return qwen_moe(config, f"{prefix}.mlp", dist, dtype, device, shared=False)
        return super().make_mlp(config, prefix, dist, dtype, device)


class Qwen2MoeAttention(Qwen2Attention):
    def qkv_bias(self, config) -> bool:
        return bool(getattr(config, "qkv_bias", True))


class Qwen2MoeDecoderLayer(Qwen2DecoderLayer):
    attention_cls = Qwen2MoeAttention

    def make_mlp(self, config, prefix, dist, dtype, device):
        if is_sparse(config, self.layer_idx):
            return qwen_moe(config, f"{prefix}.mlp", dist, dtype, device, shared=True)
        return super().make_mlp(config, prefix, dist, dtype, device)


class _QwenMoeForCausalLM(LlamaForCausalLM):
    def __init__(self, config, dist, dtype, device):
        reject_sliding_layers(config)
        check_moe_config(config, type(self).__name__)
        super().__init__(config, dist, dtype, device)

    @property
    def has_experts(self) -> bool:
        return any(is_sparse(self.config, i) for i in range(self.config.num_hidden_layers))

    def sliding_window(self) -> int | None:
        return None


class Qwen3MoeForCausalLM(_QwenMoeForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen2MoeForCausalLM(_QwenMoeForCausalLM):
    layer_cls = Qwen2MoeDecoderLayer
