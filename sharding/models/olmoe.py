"""OLMoE: the Llama layout with an RMSNorm over the whole query and the whole key projection (not per head) before
rotary, optional clipping of q/k/v (`clip_qkv`), and a sparse MoE feed-forward in every layer (router `mlp.gate`,
softmax over the experts, top-k, renormalised only when `norm_topk_prob`, which OLMoE leaves off).

Under tensor parallelism a rank holds only its heads, so the norm's mean of squares over the whole projection takes
one small all-reduce of each token's two sums of squares (query, key). A KV head that several ranks hold (more
ranks than KV heads) counts once: each holder adds its share 1 / holders."""

from __future__ import annotations

import torch

from loaders.checkpoint import Checkpoint
from loaders.partition import shard_heads
from sharding.layers.linear import Replicated
from sharding.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from sharding.layers.moe import Routing, check_moe_config, sparse_moe


class _NormSlice(Replicated):
    """Elements [start, stop) of a 1-D norm weight of `full` elements."""

    def __init__(self, name: str, full: int, start: int, stop: int, dtype, device):
        super().__init__(name, (stop - start,), dtype, device)
        self.full, self.start, self.stop = full, start, stop

    def expected(self) -> dict[str, tuple[int, ...]]:
        return {self.name: (self.full,)}

    def load(self, ckpt: Checkpoint) -> None:
        self.weight.data.copy_(ckpt.read(self.name, 0, [(self.start, self.stop)]))


class OlmoeAttention(LlamaAttention):
    def __init__(self, config, prefix, dist, dtype, device):
        super().__init__(config, prefix, dist, dtype, device)
        hd, tp = self.head_dim, dist.world_size
        heads = shard_heads(self.total_num_heads, self.total_num_kv_heads, tp, dist.rank)
        self.q_norm = _NormSlice(f"{prefix}.q_norm.weight", self.total_num_heads * hd, heads.q_start * hd,
                                 heads.q_stop * hd, dtype, device)
        self.k_norm = _NormSlice(f"{prefix}.k_norm.weight", self.total_num_kv_heads * hd, heads.kv_start * hd,
                                 heads.kv_stop * hd, dtype, device)
        holders = [0] * self.total_num_kv_heads
        for r in range(tp):
            s = shard_heads(self.total_num_heads, self.total_num_kv_heads, tp, r)
            for j in range(s.kv_start, s.kv_stop):
                holders[j] += 1
        self.kv_share = torch.tensor([1.0 / holders[j] for j in range(heads.kv_start, heads.kv_stop)],
                                     dtype=torch.float32, device=device)
        self.eps = config.rms_norm_eps
        self.clip = getattr(config, "clip_qkv", None)
        self.dist = dist

    def project_qkv(self, x):
        q, k, v = super().project_qkv(x)
        if self.clip is not None:  # transformers clips after the norms; v is not normed, so here is the same
            v = v.clamp(-self.clip, self.clip)
        return q, k, v

    def plan_whole_qk_norms(self):
        """norm_qk and the clip of project_qkv, for the CPU decode plan: at TP 1, where this rank holds the whole
        projections (False otherwise: the plan has no cross-rank reduction)."""
        if self.dist.world_size != 1:
            return False
        return self.q_norm.weight, self.k_norm.weight, self.eps, float(self.clip or 0.0)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype, hd = q.dtype, self.head_dim
        q32, k32 = q.float(), k.float()
        sums = torch.stack([q32.pow(2).sum((1, 2)), (k32.pow(2).sum(-1) * self.kv_share).sum(-1)], dim=1)
        sums = self.dist.all_reduce(sums)  # [n, 2]: over the whole projections
        rq = torch.rsqrt(sums[:, 0] / (self.total_num_heads * hd) + self.eps).view(-1, 1, 1)
        rk = torch.rsqrt(sums[:, 1] / (self.total_num_kv_heads * hd) + self.eps).view(-1, 1, 1)
        q = self.q_norm.weight.view(-1, hd) * (q32 * rq).to(dtype)
        k = self.k_norm.weight.view(-1, hd) * (k32 * rk).to(dtype)
        if self.clip is not None:
            q, k = q.clamp(-self.clip, self.clip), k.clamp(-self.clip, self.clip)
        return q, k


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = OlmoeAttention

    def make_mlp(self, config, prefix, dist, dtype, device):
        routing = Routing(config.num_experts_per_tok, renormalize=bool(getattr(config, "norm_topk_prob", False)))
        return sparse_moe(config, f"{prefix}.mlp", config.num_experts, config.intermediate_size, routing, dist, dtype,
                          device)


class OlmoeForCausalLM(LlamaForCausalLM):
    layer_cls = OlmoeDecoderLayer
    has_experts = True

    def __init__(self, config, dist, dtype, device):
        check_moe_config(config, "OlmoeForCausalLM")
        super().__init__(config, dist, dtype, device)

    def sliding_window(self) -> int | None:
        return None
