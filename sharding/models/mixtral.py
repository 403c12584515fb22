"""Mixtral: Mistral's attention and, in every layer, a sparse MoE feed-forward named `block_sparse_moe`: router
`gate`, experts `w1` (gate), `w3` (up), `w2` (down). Softmax over the experts, top-k, always renormalised."""

from __future__ import annotations

from sharding.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from sharding.layers.moe import Routing, check_moe_config, sparse_moe


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, prefix, dist, dtype, device):
        return sparse_moe(config, f"{prefix}.block_sparse_moe", config.num_local_experts, config.intermediate_size,
                          Routing(config.num_experts_per_tok, renormalize=True), dist, dtype, device,
                          names=("w1", "w3", "w2"))


class MixtralForCausalLM(LlamaForCausalLM):
    layer_cls = MixtralDecoderLayer
    has_experts = True

    def __init__(self, config, dist, dtype, device):
        check_moe_config(config, "MixtralForCausalLM")
        super().__init__(config, dist, dtype, device)
