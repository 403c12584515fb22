"""Llama and the models that share its layout: Llama 2/3, SmolLM2, Mistral (same file, same names).

Per layer: input RMSNorm -> fused q/k/v (column-parallel, by heads) -> rotary -> attention over the KV cache ->
o_proj (row-parallel, all-reduce) -> residual -> RMSNorm -> fused gate/up (column-parallel) -> SiLU(gate) * up ->
down_proj (row-parallel, all-reduce) -> residual. Two all-reduces per layer, one more for the embedding.

Decode fast path (CPU, float32): a step of decode tokens only runs each layer as its four linears with three
compiled ops between them (sharding/cpu/csrc/decode_glue.cpp), instead of ~40 torch ops and the module calls around them:
the same arithmetic, without the per-op dispatch that dominated everything but the linears at batch 1. At TP=1 the
layers run as one compiled call instead (decode_layers: one OpenMP team through every phase of every layer; see
_compile_plan), bitwise the same (LoRA adapter rows: within float32 rounding, their deltas summed in another order).
Models whose layers differ from Llama's between the linears (Qwen 3's q/k norms,
Gemma's) take the module path; see _decode_plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from loaders.partition import shard_heads, split_evenly
from sharding.cpu import kernels
from sharding.layers.attention import (AttentionMetadata, GroupedHeads, PagedKVCache, apply_rotary, attend,
                                stage_output)
from sharding.dist import Dist
from sharding.layers.linear import (ColumnParallelLinear, ParallelLMHead, Piece, RMSNorm, RowParallelLinear,
                             VocabParallelEmbedding)
from sharding.models.interface import CausalLM

logger = logging.getLogger(__name__)


class LlamaAttention(nn.Module):
    qkv_bias_default = False

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
        out = attend(q, k, v, self.cache, meta, self.groups, self.scale, softcap=self.softcap)
        return self.o_proj(out, scatter=meta.seq_parallel)


class LlamaMLP(nn.Module):
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

    def forward(self, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.seq_parallel:
            # Megatron sequence parallelism: h holds this rank's tokens only; the norms and residual adds run on
            # them, an all-gather feeds each column-parallel block, a reduce-scatter ends each row-parallel one
            n = meta.positions.numel()
            h = h + self.self_attn(self.dist.all_gather_tokens(self.input_layernorm(h), n), meta)
            return h + self.mlp(self.dist.all_gather_tokens(self.post_attention_layernorm(h), n), scatter=True)
        h = h + self.self_attn(self.input_layernorm(h), meta)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass(slots=True)
class _FastLayer:
    """What the decode fast path needs of one layer, looked up once."""

    attn: LlamaAttention
    qkv: ColumnParallelLinear
    o_proj: RowParallelLinear
    gate_up: ColumnParallelLinear
    down: RowParallelLinear
    q_index: torch.Tensor | None
    out_index: torch.Tensor | None
    post_norm: RMSNorm
    next_norm: RMSNorm  # the next layer's input norm, or the final norm after the last layer


@dataclass(slots=True)
class _DecodePlan:
    ops: tuple
    first_norm: RMSNorm
    layers: list[_FastLayer]
    head_dim: int
    compiled: object = None  # torch.classes.tpserve.DecodeLayers: every layer in one call (TP=1, see _compile_plan)
    run: object = None  # torch.ops.tpserve.decode_layers
    pool: torch.Tensor | None = None  # the first layer's cache pool when `compiled` was made


def _compile_plan(plan: _DecodePlan, world_size: int) -> object:
    """The layers as one compiled DecodeLayers (sharding/cpu/csrc/decode_glue.cpp), where every linear has a compiled
    kernel and there is no all-reduce between them (TP=1); else None (the Python loop of _decode_fast)."""
    ops = kernels.decode_layers_ops()
    if ops is None or world_size != 1 or any(f.q_index is not None for f in plan.layers):
        return None
    linears = [[kernels.plan_linear(lin) for lin in (f.qkv, f.o_proj, f.gate_up, f.down)] for f in plan.layers]
    if any(spec is None for layer in linears for spec in layer):
        return None
    compiled = ops[0]()
    try:
        for f, specs in zip(plan.layers, linears):
            for spec in specs:
                compiled.add_linear(*spec)
            a = f.attn
            compiled.add_layer(a.cache.pool, a.num_heads, a.num_kv_heads, a.scale, f.post_norm.weight,
                               f.post_norm.eps, f.next_norm.weight, f.next_norm.eps)
            for which, lin in enumerate((f.qkv, f.o_proj, f.gate_up, f.down)):  # LoRA adapters (sharding/layers/lora.py)
                for slot, w in enumerate(lin.lora.slots if lin.lora is not None else ()):
                    if w is not None:
                        compiled.set_lora(compiled.size() - 1, which, slot, *w)
    except RuntimeError as e:  # a layout the compiled step does not take: the Python loop serves it
        logger.warning("decode layers not compiled (%s); the per-op decode path runs", str(e).splitlines()[0][:200])
        return None
    return compiled


def _plain_rms_norm(norm) -> bool:
    return type(norm) is RMSNorm and not norm.offset and norm.weight.dtype == torch.float32


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

    _plan: object = False  # the decode fast path (_DecodePlan), None where it does not apply; looked up at first use

    def _decode_plan(self) -> _DecodePlan | None:
        """The fast path applies to a whole model (one pipeline stage holding every layer) on CPU in float32 whose
        layers are Llama's between the linears: these methods not overridden, plain RMSNorms, no soft-capping."""
        ops = kernels.decode_glue_ops()
        if (ops is None or not (self.first_stage and self.last_stage) or not self.layers
                or self.norm.weight.device.type != "cpu" or not _plain_rms_norm(self.norm)):
            return None
        layers = []
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if (type(layer).forward is not LlamaDecoderLayer.forward
                    or type(attn).forward is not LlamaAttention.forward
                    or type(attn).project_qkv is not LlamaAttention.project_qkv
                    or type(attn).norm_qk is not LlamaAttention.norm_qk or attn.softcap is not None
                    or type(mlp).forward is not LlamaMLP.forward or type(mlp).act is not LlamaMLP.act
                    or not _plain_rms_norm(layer.input_layernorm) or not _plain_rms_norm(layer.post_attention_layernorm)
                    or attn.head_dim != self.layers[0].self_attn.head_dim):
                return None
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            layers.append(_FastLayer(attn, attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj,
                                     attn.groups.q_index, attn.groups.out_index, layer.post_attention_layernorm, nxt))
        return _DecodePlan(ops, self.layers[0].input_layernorm, layers, self.layers[0].self_attn.head_dim)

    def _decode_fast(self, ids: torch.Tensor, meta: AttentionMetadata, plan: _DecodePlan) -> torch.Tensor | None:
        attention, add_rms_norm_, silu_mul = plan.ops
        h = self.embed(ids)  # a fresh tensor: the residual stream, updated in place below
        x = plan.first_norm.forward(h)
        window, n = meta.window or 0, h.shape[0]
        if plan.pool is not plan.layers[0].attn.cache.pool:  # first use, or a new cache
            plan.compiled = _compile_plan(plan, self.dist.world_size)
            plan.run = kernels.decode_layers_ops()[1] if plan.compiled is not None else None
            plan.pool = plan.layers[0].attn.cache.pool
        if plan.compiled is not None:  # (with the adapters of every slot: lora_changed rebuilds it)
            x = plan.run(plan.compiled, h, x, meta.cos, meta.sin, meta.slots, meta.decode_table, meta.decode_lens,
                         window, meta.lora.token_slots if meta.lora is not None else None)
            return stage_output(x, meta, self.lm_head)
        for f in plan.layers:
            qkv = f.qkv.matmul(x, f.qkv.bias)
            a = f.attn
            o = attention(qkv, meta.cos, meta.sin, a.cache.pool, meta.slots, meta.decode_table, meta.decode_lens,
                          f.q_index, a.num_heads, a.num_kv_heads, a.scale, window)
            if f.out_index is not None:  # uneven GQA groups: drop the padding positions
                o = o.view(n, -1, plan.head_dim).index_select(1, f.out_index).reshape(n, -1)
            x = add_rms_norm_(h, f.o_proj.forward(o), f.post_norm.weight, f.post_norm.eps)
            d = f.down.forward(silu_mul(f.gate_up.matmul(x, f.gate_up.bias)))
            x = add_rms_norm_(h, d, f.next_norm.weight, f.next_norm.eps)
        return stage_output(x, meta, self.lm_head)  # x: the final norm of every token's hidden state

    def lora_changed(self) -> None:
        """An adapter was loaded or unloaded (sharding/layers/lora.py): the compiled decode step, which holds the adapters'
        tensors, is rebuilt at its next use."""
        if self._plan:
            self._plan.pool = None

    def forward(self, ids: torch.Tensor, meta: AttentionMetadata, hidden: torch.Tensor | None = None):
        if self.lora is not None:
            self.lora.rows = meta.lora
        if meta.all_decode and not meta.seq_parallel and meta.cos is not None:
            if self._plan is False:
                self._plan = self._decode_plan()
            if self._plan is not None and meta.cos.shape[-1] == self._plan.head_dim:
                return self._decode_fast(ids, meta, self._plan)
        h = self.embed(ids, scatter=meta.seq_parallel) if self.first_stage else hidden
        for layer in self.layers:
            h = layer(h, meta)
        if not self.last_stage:
            return h
        if meta.seq_parallel:
            h = self.dist.all_gather_tokens(h, meta.positions.numel())
        return stage_output(h, meta, self.lm_head, self.norm)
