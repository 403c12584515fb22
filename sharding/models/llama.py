"""Llama and the models that share its layout: Llama 2/3, SmolLM2, Mistral (same file, same names).

Per layer: input RMSNorm -> fused q/k/v (column-parallel, by heads) -> rotary -> attention over the KV cache ->
o_proj (row-parallel, all-reduce) -> residual -> RMSNorm -> fused gate/up (column-parallel) -> SiLU(gate) * up ->
down_proj (row-parallel, all-reduce) -> residual. Two all-reduces per layer, one more for the embedding.

Decode fast path (CPU, float32): a step of decode tokens, and one with prompt chunks as rows of it, runs through the CPU
decode plan (sharding/cpu/decode_plan.py), the same arithmetic as the modules in a few compiled ops. Each of the three
classes below declares, in `llama_shaped`, that it computes what the plan computes; a subclass that changes its forward
(or the methods the plan replaces: project_qkv and norm_qk, act) without declaring the change says False, and its model
takes the module path (OLMoE's whole-projection q/k norms). Declared to the plan: per-head q/k RMSNorms (Qwen 3) by
plan_qk_norms, attention sinks (gpt-oss) by attention_sinks, a layer's own window by `window`, soft-capped scores
(Gemma 2) by `softcap`, the MLP's activation (Gemma's GELU) by plan_activation, norms around the attention's and the
feed-forward's outputs (Gemma 2) by plan_norms. An MLP that is not llama_shaped, or an MoE layer, runs as its own module
inside the plan's Python loop (an MoE layer offers itself to the one compiled call: SparseMoe.plan_moe).
tests/test_layout.py checks each registered model's declarations against its overrides.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from loaders.partition import shard_heads, split_evenly
from sharding.cpu import decode_plan, kernels
from sharding.layers.attention import (AttentionMetadata, GroupedHeads, PagedKVCache, apply_rotary, attend,
                                stage_output)
from sharding.dist import Dist
from sharding.layers.linear import (ColumnParallelLinear, ParallelLMHead, Piece, RMSNorm, RowParallelLinear,
                             VocabParallelEmbedding)
from sharding.models.interface import CausalLM


class LlamaAttention(nn.Module):
    qkv_bias_default = False
    # forward, project_qkv and norm_qk compute what the CPU decode plan computes (sharding/cpu/decode_plan.py)
    llama_shaped: ClassVar[bool] = True

    def __init__(self, config, prefix: str, dist: Dist, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = getattr(config, "num_key_value_heads", None) or self.total_num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.total_num_heads
        heads = shard_heads(self.total_num_heads, self.total_num_kv_heads, dist.world_size, dist.rank)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        same = heads.num_heads == heads.num_kv_heads
        self.groups = GroupedHeads(None if same else heads.kv_for_q, device)
        hd, hidden = self.head_dim, config.hidden_size
        self.qkv_proj = ColumnParallelLinear(hidden, self.qkv_pieces(config, prefix, heads), self.qkv_bias(config),
                                             dtype, device)
        self.o_proj = RowParallelLinear(
            Piece(f"{prefix}.o_proj", heads.q_start * hd, heads.q_stop * hd, (hidden, self.total_num_heads * hd)),
            bias=getattr(config, "attention_bias", False), dist=dist, dtype=dtype, device=device)
        self.scale = self.head_dim ** -0.5
        self.softcap: float | None = None  # tanh soft-capping of attention scores (Gemma 2)
        # this layer's own sliding window (gpt-oss, Gemma 2: set where the layers alternate; the model narrows the
        # metadata to it), None: the model's (its metadata's `window`)
        self.window: int | None = None
        self.cache: PagedKVCache | None = None
        # the compiled in-place rotary, looked up at the first call (built at start); None: none
        self._rotary: kernels.Op | Literal[False] | None = False

    def qkv_bias(self, config) -> bool:
        return bool(getattr(config, "attention_bias", self.qkv_bias_default))

    def qkv_pieces(self, config, prefix: str, heads) -> list[Piece]:
        hd, hidden = self.head_dim, config.hidden_size
        q_full, kv_full = (self.total_num_heads * hd, hidden), (self.total_num_kv_heads * hd, hidden)
        return [
            Piece(f"{prefix}.q_proj", heads.q_start * hd, heads.q_stop * hd, q_full),
            Piece(f"{prefix}.k_proj", heads.kv_start * hd, heads.kv_stop * hd, kv_full),
            Piece(f"{prefix}.v_proj", heads.kv_start * hd, heads.kv_stop * hd, kv_full),
        ]

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        return (q.reshape(n, self.num_heads, self.head_dim), k.reshape(n, self.num_kv_heads, self.head_dim),
                v.reshape(n, self.num_kv_heads, self.head_dim))

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head normalisation of queries and keys before rotary (none for Llama)."""
        return q, k

    def attention_sinks(self) -> torch.Tensor | None:
        """One learned logit per local query head that joins every softmax's denominator (gpt-oss), or None."""
        return None

    def plan_whole_qk_norms(self) -> tuple[torch.Tensor, torch.Tensor, float, float] | None | Literal[False]:
        """What norm_qk computes where it norms the whole projections (OLMoE), for the CPU decode plan
        (decode_plan.PlanAttention); None: it does not."""
        return None

    def plan_qk_norms(self) -> tuple[RMSNorm, RMSNorm] | None:
        """What norm_qk computes, for the CPU decode plan: the RMSNorms over each query and key head, or None (a
        subclass that overrides norm_qk with per-head RMSNorms returns them here and stays llama_shaped)."""
        return None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        q, k = self.norm_qk(q, k)
        if self._rotary is False:
            self._rotary = kernels.rotary_op() if x.device.type == "cpu" else None
        if (self._rotary is not None and meta.cos is not None and q.dtype == torch.float32
                and meta.cos.shape[-1] == self.head_dim == k.shape[-1]):
            self._rotary(q, k, meta.cos, meta.sin)  # in place, one dispatch (sharding/cpu/csrc/rotary.cpp)
        elif meta.cos is not None and q.shape[-1] == k.shape[-1]:
            # one rotary pass over the query and key heads together (elementwise, so identical to two passes)
            qk = apply_rotary(torch.cat([q, k], dim=1), meta.cos, meta.sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q, k = apply_rotary(q, meta.cos, meta.sin), apply_rotary(k, meta.cos, meta.sin)
        out = attend(q, k, v, self.cache, meta, self.groups, self.scale, softcap=self.softcap,
                     sinks=self.attention_sinks())
        return self.o_proj(out, scatter=meta.seq_parallel)


class LlamaMLP(nn.Module):
    llama_shaped: ClassVar[bool] = True  # forward and act (SiLU(gate) * up) compute what the CPU decode plan computes
    def __init__(self, config, prefix: str, dist: Dist, dtype: torch.dtype, device: torch.device,
                 inter: int | None = None):
        super().__init__()
        hidden, inter = config.hidden_size, inter or config.intermediate_size
        a, b = split_evenly(inter, dist.world_size, dist.rank)
        bias = getattr(config, "mlp_bias", False)
        self.local_inter = b - a
        self.gate_up_proj = ColumnParallelLinear(hidden, self.gate_up_pieces(prefix, a, b, inter, hidden), bias,
                                                 dtype, device)
        self.down_proj = RowParallelLinear(Piece(f"{prefix}.down_proj", a, b, (hidden, inter)), bias, dist, dtype,
                                           device)

    def gate_up_pieces(self, prefix: str, a: int, b: int, inter: int, hidden: int) -> list[Piece]:
        return [Piece(f"{prefix}.gate_proj", a, b, (inter, hidden)), Piece(f"{prefix}.up_proj", a, b, (inter, hidden))]

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate)

    def plan_activation(self) -> int | None:
        """What act computes, for the CPU decode plan (decode_plan.PlanMLP): 0, SiLU."""
        return 0

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all-reduce (a shared expert joins its MoE layer's reduce)."""
        gate, up = self.gate_up_proj(x).split([self.local_inter, self.local_inter], dim=-1)
        return self.down_proj.matmul(self.act(gate).mul_(up))

    def forward(self, x: torch.Tensor, scatter: bool = False) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.local_inter, self.local_inter], dim=-1)
        return self.down_proj(self.act(gate).mul_(up), scatter=scatter)


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention
    mlp_cls = LlamaMLP
    llama_shaped: ClassVar[bool] = True  # forward computes what the CPU decode plan computes (Llama's order of norms)

    def __init__(self, config, prefix: str, dist: Dist, dtype: torch.dtype, device: torch.device):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(f"{prefix}.input_layernorm.weight", config.hidden_size, eps, dtype, device)
        self.self_attn = self.attention_cls(config, f"{prefix}.self_attn", dist, dtype, device)
        self.post_attention_layernorm = RMSNorm(f"{prefix}.post_attention_layernorm.weight", config.hidden_size, eps,
                                                dtype, device)
        self.layer_idx = int(prefix.rsplit(".", 1)[1])
        self.mlp = self.make_mlp(config, prefix, dist, dtype, device)
        self.dist = dist

    def make_mlp(self, config, prefix: str, dist: Dist, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """This layer's feed-forward (`forward(x, scatter)`, one all-reduce inside): a dense MLP, or in MoE models
        for the layers the config makes sparse, a sharding.layers.moe.SparseMoe."""
        return self.mlp_cls(config, f"{prefix}.mlp", dist, dtype, device)

    def on_decode_plan(self) -> bool:
        """This layer and its attention declare the decode plan's shape (sharding/cpu/decode_plan.py PlanLayer); its
        feed-forward is any module whose forward(x) gives the reduced output (a dense MLP or an MoE layer)."""
        return self.llama_shaped and self.self_attn.llama_shaped

    def dense_mlp(self) -> bool:
        """Its feed-forward is the plan's own MLP with an activation the plan computes (make_mlp may give an MoE
        layer instead)."""
        return isinstance(self.mlp, LlamaMLP) and self.mlp.llama_shaped and self.mlp.plan_activation() is not None

    def plan_norms(self) -> tuple[RMSNorm, RMSNorm | None, RMSNorm | None]:
        """What forward norms around the feed-forward (decode_plan.PlanLayer): the post-attention norm into it."""
        return self.post_attention_layernorm, None, None

    def forward(self, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.seq_parallel:
            # Megatron sequence parallelism: h holds this rank's tokens only; the norms and residual adds run on
            # them, an all-gather feeds each column-parallel block, a reduce-scatter ends each row-parallel one
            n = meta.positions.numel()
            h = h + self.self_attn(self.dist.all_gather_tokens(self.input_layernorm(h), n), meta)
            return h + self.mlp(self.dist.all_gather_tokens(self.post_attention_layernorm(h), n), scatter=True)
        h = h + self.self_attn(self.input_layernorm(h), meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(CausalLM):
    """This rank's part of the model: its TP shard of its pipeline stage's layers (all of them without PP), plus the
    embedding on the first stage and the final norm and LM head on the last. `forward` takes token ids (first stage)
    or the previous stage's hidden states, and returns hidden states for the next stage, or the last stage's
    logits (float32, full vocabulary, on the stage's TP rank 0; None on its other ranks)."""

    layer_cls = LlamaDecoderLayer
    supports_sequence_parallel = True
    supports_lora = True  # sharding/layers/lora.py: every linear of its layers is a column- or row-parallel one

    def __init__(self, config, dist: Dist, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config = config
        self.dist = dist
        self.first_stage, self.last_stage = dist.first_stage, dist.last_stage
        tied_head = getattr(config, "tie_word_embeddings", False)
        self.start_layer, self.stop_layer = dist.stage_layers(config.num_hidden_layers)
        # a tied LM head on a later stage still needs the embedding's rows: that stage loads them too
        self.embed_tokens = None
        if self.first_stage or (tied_head and self.last_stage):
            self.embed_tokens = VocabParallelEmbedding("model.embed_tokens.weight", config.vocab_size,
                                                       config.hidden_size, dist, dtype, device)
        self.layers = nn.ModuleList(self.layer_cls(config, f"model.layers.{i}", dist, dtype, device)
                                    for i in range(self.start_layer, self.stop_layer))
        self.norm = self.lm_head = None
        if self.last_stage:
            self.norm = RMSNorm("model.norm.weight", config.hidden_size, config.rms_norm_eps, dtype, device)
            self.lm_head = ParallelLMHead("lm_head", config.vocab_size, config.hidden_size, dist, dtype, device,
                                          self.embed_tokens if tied_head else None)

    # what the engine needs to know to build the cache and the metadata
    @property
    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.layers]

    def sliding_window(self) -> int | None:
        return getattr(self.config, "sliding_window", None)

    def ignored_tensors(self) -> set[str]:
        """Checkpoint tensors that are fine to skip (a tied head stored anyway)."""
        return {"lm_head.weight"} if getattr(self.config, "tie_word_embeddings", False) else set()

    def embed(self, ids: torch.Tensor, scatter: bool = False) -> torch.Tensor:
        return self.embed_tokens(ids, scatter=scatter)

    # the CPU decode plan (sharding/cpu/decode_plan.py), None where it does not apply; looked up at first use
    _plan: decode_plan.DecodePlan | Literal[False] | None = False

    def _decode_plan(self) -> decode_plan.DecodePlan | None:
        return decode_plan.build(self.layers, self.norm, self.first_stage and self.last_stage, self.dist.world_size,
                                 self.plan_ends())

    def plan_ends(self) -> tuple[torch.Tensor | None, ParallelLMHead] | None:
        """The embedding table and the LM head that the compiled decode step may run itself (DecodePlan.step), where
        `embed` is the plain lookup of a whole table on this rank and the head's output is the logits. The table is
        None where it is kept in GGUF blocks: `embed` looks the rows up and the call takes them from there. None
        where the step keeps its ends (split over ranks; Gemma scales its rows and overrides this)."""
        e, head = self.embed_tokens, self.lm_head
        if self.dist.world_size != 1 or e is None or head is None or (e.blocks is None and e.weight is None):
            return None
        return (e.weight if e.blocks is None else None), head

    def lora_changed(self) -> None:
        """An adapter was loaded or unloaded (sharding/layers/lora.py): the compiled decode step, which holds the adapters'
        tensors, is rebuilt at its next use."""
        if self._plan:
            self._plan.invalidate()

    def plan_for(self, meta: AttentionMetadata) -> decode_plan.DecodePlan | None:
        """The CPU decode plan where this step runs on it (decode rows only, or prompt chunks as rows of it:
        DecodePlan.takes), else None (the modules run it)."""
        if not meta.seq_parallel and meta.cos is not None:  # (which steps it takes: DecodePlan.takes)
            if self._plan is False:
                self._plan = self._decode_plan()
            plan = self._plan
            if plan is not None and meta.cos.shape[-1] <= plan.head_dim and plan.takes(meta):  # (partial rotary)
                return plan
        return None

    def on_plan(self, plan: decode_plan.DecodePlan, ids: torch.Tensor, meta: AttentionMetadata, head) -> torch.Tensor:
        """A step on the CPU decode plan: in one compiled call from ids to logits where the plan holds this model's
        ends (DecodePlan.step), else the plan's layers between `embed` and `head` (stage_output)."""
        logits = plan.step(ids, meta, self.embed)
        return logits if logits is not None else stage_output(plan.forward(self.embed(ids), meta), meta, head)

    def forward(self, ids: torch.Tensor, meta: AttentionMetadata, hidden: torch.Tensor | None = None):
        if self.lora is not None:
            self.lora.rows = meta.lora
        plan = self.plan_for(meta)
        if plan is not None:  # (the stage's output: None on the TP ranks other than 0)
            return self.on_plan(plan, ids, meta, self.lm_head)
        h = self.embed(ids, scatter=meta.seq_parallel) if self.first_stage else hidden
        for layer in self.layers:
            h = layer(h, meta)
        if not self.last_stage:
            return h
        if meta.seq_parallel:
            h = self.dist.all_gather_tokens(h, meta.positions.numel())
        return stage_output(h, meta, self.lm_head, self.norm)
