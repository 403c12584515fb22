"""Mixtral: Mistral's attention and, in every layer, a sparse MoE feed-forward named `block_sparse_moe`: router
`gate`, experts `w1` (gate), `w3` (up), `w2` (down). Softmax over the experts, top-k, always renormalised."""

from __future__ import annotations

from sharding.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from sharding.moe import ReplicatedLinear, Routing, SparseMoe, check_moe_config, routed_experts


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, prefix, dist, dtype, device):
        prefix, e = f"{prefix}.block_sparse_moe", config.num_local_experts
        experts = routed_experts(config, f"{prefix}.experts", e, config.intermediate_size, dist, dtype, device,
                                 names=("w1", "w3", "w2"))
        return SparseMoe(ReplicatedLinear(f"{prefix}.gate", e, config.hidden_size, False, device),
                         Routing(config.num_experts_per_tok, renormalize=True), experts, e, dist, config.hidden_size)


class MixtralForCausalLM(LlamaForCausalLM):
    layer_cls = MixtralDecoderLayer
    has_experts = True

    def __init__(self, config, dist, dtype, device):
        check_moe_config(config, "MixtralForCausalLM")
        super().__init__(config, dist, dtype, device)
