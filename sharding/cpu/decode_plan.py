"""The CPU decode plan: a step of decode tokens (and prompt tokens, each a row attending as a decode row at its position
would: AttentionMetadata.token_table, DecodePlan.takes) through the layers of every family that declares it, run as each
layer's linears with a few compiled ops between them (sharding/cpu/csrc/decode_glue.cpp) instead of ~40 torch ops and
the module calls around them: the same arithmetic, without the per-op dispatch that dominated everything but the linears
at batch 1. At TP=1 the layers run as one compiled call instead (decode_layers: one OpenMP team through every phase of
every layer; see `compile_layers`), bitwise the same (LoRA adapter rows: within float32 rounding, their deltas summed in
another order). Where the model declares its embedding and LM head plain (`add_ends`), that call runs the whole step,
from token ids (or the rows the model looked up in a GGUF table's blocks) to logits (`DecodePlan.step`).

Which layers qualify, and what each adds to Llama's layer, is declared by the model's classes (sharding/models/),
never detected from its forward: `PlanLayer.on_decode_plan`; per-head q/k RMSNorms (Qwen 3,
`PlanAttention.plan_qk_norms`) or RMSNorms over the whole q and k projections with clip_qkv (OLMoE at TP 1,
`plan_whole_qk_norms`); attention sinks and a window per layer (gpt-oss, Gemma 2); soft-capped scores (Gemma 2,
`softcap`); the MLP's activation (`PlanMLP.plan_activation`: SiLU or Gemma's GELU-tanh); norms of the attention's
and the feed-forward's outputs (Gemma 2, `PlanLayer.plan_norms`). The plan checks the rest, which only the loaded
values tell (CPU, float32 RMSNorms, Gemma's (1 + w) folded into the weight, one head size). A feed-forward that is
not the plan's dense MLP (an MoE layer) runs as its own module (`forward(x)`, its all-reduce inside) in the Python
loop; the one compiled call takes it where it offers itself whole (`SparseMoe.plan_moe`: router, routing, grouped
experts and a shared expert in C++, decode_glue.cpp's MoeExperts).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from sharding.cpu import hugepages, kernels
from sharding.layers.attention import AttentionMetadata, GroupedHeads, PagedKVCache
from sharding.layers.linear import ColumnParallelLinear, ParallelLMHead, RMSNorm, RowParallelLinear
from sharding.layers.moe import SparseMoe

logger = logging.getLogger(__name__)


class PlanAttention(Protocol):
    """What the plan reads of a layer's attention."""

    qkv_proj: ColumnParallelLinear
    o_proj: RowParallelLinear
    groups: GroupedHeads
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    softcap: float | None
    cache: PagedKVCache | None

    window: int | None  # the layer's own sliding window, None: the model's (the step metadata's)

    def plan_qk_norms(self) -> tuple[RMSNorm, RMSNorm] | None:
        """The RMSNorms over each query and key head before rotary (Qwen 3's q_norm, k_norm), or None."""

    def attention_sinks(self) -> torch.Tensor | None:
        """One logit per local query head in every softmax's denominator (gpt-oss), float32 [heads], or None."""

    def plan_whole_qk_norms(self) -> tuple[torch.Tensor, torch.Tensor, float, float] | None | Literal[False]:
        """RMSNorms over the whole query and key projections before rotary, then q, k, v clamped (OLMoE): (query
        weight [heads * head_dim], key weight [kv_heads * head_dim], eps, clip or 0.0); None where it has none; False
        where the plan cannot take them (split over ranks: the mean of squares needs a reduction)."""


class PlanMLP(Protocol):
    """What the plan reads of a layer's feed-forward."""

    gate_up_proj: ColumnParallelLinear
    down_proj: RowParallelLinear

    def plan_activation(self) -> int | None:
        """Its act(gate) * up as the compiled ops compute it (decode_glue.cpp act_mul_row): 0 SiLU, 1 GELU with the
        tanh approximation (Gemma); None: another (the plan then calls the module)."""


class PlanLayer(Protocol):
    """A decoder layer the plan may run in place of its forward."""

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    self_attn: PlanAttention
    mlp: PlanMLP | SparseMoe | torch.nn.Module

    def on_decode_plan(self) -> bool:
        """Whether this layer computes what the plan computes around its feed-forward: input norm, fused q/k/v,
        (per-head q/k norms,) rotary, paged attention, o_proj, residual, post-attention norm, the feed-forward,
        residual. A declaration of its classes (sharding/models/llama.py); the values are the plan's to check."""

    def dense_mlp(self) -> bool:
        """Whether its feed-forward is the plan's own: fused gate/up, act(gate) * up, down (a PlanMLP). Otherwise
        the plan calls `mlp(x)`, which returns the layer's reduced output."""

    def plan_norms(self) -> tuple[RMSNorm, RMSNorm | None, RMSNorm | None]:
        """Its norms around the feed-forward: (the norm of the residual stream into it, the norm of the attention's
        output before its residual add or None, the norm of the feed-forward's output before its residual add or
        None). Llama: (post_attention_layernorm, None, None); Gemma 2's four-norm layer: (pre_feedforward_layernorm,
        post_attention_layernorm, post_feedforward_layernorm)."""


@dataclass(slots=True)
class FastLayer:
    """What the decode plan needs of one layer, looked up once."""

    attn: PlanAttention
    qkv: ColumnParallelLinear
    o_proj: RowParallelLinear
    gate_up: ColumnParallelLinear | None  # None: the feed-forward is `ffn`
    down: RowParallelLinear | None
    ffn: torch.nn.Module | None  # a feed-forward that is not the plan's own (an MoE layer), run as its module
    q_index: torch.Tensor | None
    out_index: torch.Tensor | None
    post_norm: Norm  # the norm of the residual stream into the feed-forward
    next_norm: Norm  # the next layer's input norm, or the final norm after the last layer
    qk_norms: tuple[RMSNorm, RMSNorm] | None
    sinks: torch.Tensor | None
    window: int | None  # the layer's own window (else the step's)
    softcap: float  # of the attention scores, 0: none
    act: int  # the dense MLP's (PlanMLP.plan_activation)
    attn_out: Norm | None  # the norms of the attention's and the feed-forward's outputs (PlanLayer.plan_norms)
    ffn_out: Norm | None
    whole_qk: tuple[torch.Tensor, torch.Tensor, float, float] | None  # PlanAttention.plan_whole_qk_norms


@dataclass(slots=True)
class Norm:
    """An RMSNorm as the compiled ops take it: float32 weight with Gemma's offset folded in (the module computes
    x * (offset + w)), and eps."""

    weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, norm: RMSNorm | None) -> Norm | None:
        """None where it is not a float32 RMSNorm (the plan does not take the layer)."""
        if type(norm) is not RMSNorm or norm.weight is None or norm.weight.dtype != torch.float32:
            return None
        return cls(norm.weight + norm.offset if norm.offset else norm.weight, norm.eps)


# The attention partials of a step's rows: per row, query head and chunk of ATTENTION_CHUNK keys (at fixed positions,
# sharding/cpu/csrc/core/kernels.h), head_dim + 2 floats (decode_glue.cpp decode_layers, paged_attention_rows)
ATTENTION_CHUNK = 256
ROWS_PARTIALS_MAX = 64 << 20  # bytes: the most a step with prompt chunks may take for them on the plan


@dataclass(slots=True)
class DecodePlan:
    ops: tuple[kernels.Op, ...]  # decode_attention, add_rms_norm_, silu_mul, whole_qk_norm_ (kernels.decode_glue_ops)
    first_norm: RMSNorm
    layers: list[FastLayer]
    head_dim: int
    world_size: int  # of the TP group: the one compiled call only at 1
    # the model's embedding table (None: a table the call does not read, e.g. in GGUF blocks) and LM head, where it
    # declares them plain (sharding/models/llama.py LlamaForCausalLM.plan_ends): the compiled call then runs the whole
    # step, from token ids (or the model's looked-up rows) to logits (`step`)
    ends: tuple[torch.Tensor | None, ParallelLMHead] | None = None
    compiled: torch.ScriptObject | None = None  # a torch.classes.tpserve.DecodeLayers: every layer in one call
    run: kernels.Op | None = None  # torch.ops.tpserve.decode_layers
    run_step: kernels.Op | None = None  # torch.ops.tpserve.decode_step, where `compiled` holds the ends
    pool: torch.Tensor | None = None  # the first layer's cache pool when `compiled` was made

    def takes(self, meta: AttentionMetadata) -> bool:
        """Whether this step runs on the plan: decode rows only, or a step with prompt chunks whose tokens, each a
        row of the decode attention (AttentionMetadata.token_table), keep the attention's partials under
        ROWS_PARTIALS_MAX (a long context's chunk of a prompt runs on the modules, through SDPA)."""
        if meta.all_decode:
            return True
        if meta.token_table is None:
            return False
        chunks = (int(meta.token_lens.max()) + ATTENTION_CHUNK - 1) // ATTENTION_CHUNK
        heads = self.layers[0].attn.num_heads
        return meta.token_lens.numel() * heads * chunks * (self.head_dim + 2) * 4 <= ROWS_PARTIALS_MAX

    def invalidate(self) -> None:
        """The compiled step holds what changed (the adapters' tensors): rebuilt at its next use."""
        self.pool = None

    def _compile(self) -> None:
        """The compiled call, made at first use and again for a new cache or changed adapters (`invalidate`)."""
        if self.pool is not self.layers[0].attn.cache.pool:
            self.compiled = compile_layers(self)
            ops = kernels.decode_layers_ops() if self.compiled is not None else None
            self.run = ops[1] if ops is not None else None
            self.run_step = ops[2] if ops is not None and self.compiled.has_ends() else None
            self.pool = self.layers[0].attn.cache.pool

    def step(self, ids: torch.Tensor, meta: AttentionMetadata,
             embed: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
        """The whole step in one compiled call, where the plan holds the model's ends: the token ids looked up (by
        `embed`, the model's lookup, where the plan holds no table), every layer, the final norm and the LM head over
        the rows that return logits. Returns those logits (float32 [rows, vocab]: what `forward` between the
        embedding module and the head returns, bit for bit), or None where this step is not one it takes (no
        compiled ends, or a step returning pooled rows): the caller then embeds, calls `forward` and applies the
        head."""
        self._compile()
        if self.run_step is None or self.compiled is None or meta.pool is not None:
            return None
        table, lens = (meta.decode_table, meta.decode_lens) if meta.all_decode else (meta.token_table, meta.token_lens)
        every = meta.all_decode and meta.logits_indices.numel() == ids.shape[0]  # (then the rows are 0..n-1)
        return self.run_step(self.compiled, ids, meta.cos, meta.sin, meta.slots, table, lens, meta.window or 0,
                             meta.lora.token_slots if meta.lora is not None else None,
                             None if every else meta.logits_indices,
                             embed(ids).contiguous() if self.ends[0] is None else None)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Every layer over the embedded decode tokens `h` (a fresh tensor: the residual stream, updated in place);
        returns the final norm of every token's hidden state."""
        x = self.first_norm.forward(h)
        n = h.shape[0]
        table, lens = (meta.decode_table, meta.decode_lens) if meta.all_decode else (meta.token_table, meta.token_lens)
        self._compile()
        if self.compiled is not None:  # (with the adapters of every slot: invalidate rebuilds it)
            return self.run(self.compiled, h, x, meta.cos, meta.sin, meta.slots, table, lens,
                            meta.window or 0, meta.lora.token_slots if meta.lora is not None else None)
        attention, add_rms_norm_, silu_mul, whole_qk_norm_ = self.ops
        norm = kernels.rms_norm_op()
        for f in self.layers:
            qkv = f.qkv.matmul(x, f.qkv.bias)
            a = f.attn
            if f.whole_qk is not None:
                whole_qk_norm_(qkv, f.whole_qk[0], f.whole_qk[1], a.num_heads, a.num_kv_heads, *f.whole_qk[2:])
            qn, kn = f.qk_norms or (None, None)
            o = attention(qkv, meta.cos, meta.sin, a.cache.pool, meta.slots, table, lens,
                          f.q_index, a.num_heads, a.num_kv_heads, a.scale, f.window or meta.window or 0,
                          qn.weight if qn is not None else None, kn.weight if kn is not None else None,
                          qn.eps if qn is not None else 0.0, f.sinks, f.softcap)
            if f.out_index is not None:  # uneven GQA groups: drop the padding positions
                o = o.view(n, -1, self.head_dim).index_select(1, f.out_index).reshape(n, -1)
            o = f.o_proj.forward(o)
            if f.attn_out is not None:  # (Gemma 2) the same rows the compiled step norms in place
                o = norm(o, f.attn_out.weight, f.attn_out.eps)
            x = add_rms_norm_(h, o, f.post_norm.weight, f.post_norm.eps)
            if f.ffn is not None:
                d = f.ffn(x)
            else:
                d = f.down.forward(silu_mul(f.gate_up.matmul(x, f.gate_up.bias), f.act))
            if f.ffn_out is not None:
                d = norm(d, f.ffn_out.weight, f.ffn_out.eps)
            x = add_rms_norm_(h, d, f.next_norm.weight, f.next_norm.eps)
        return x


def plain_rms_norm(norm: RMSNorm | None) -> bool:
    return type(norm) is RMSNorm and not norm.offset and norm.weight.dtype == torch.float32


def qk_norms(attn: PlanAttention) -> tuple[RMSNorm, RMSNorm] | None | Literal[False]:
    """The attention's per-head q/k norms as the plan takes them, None where it has none, False where they are not
    plain float32 RMSNorms of one eps over the head."""
    norms = attn.plan_qk_norms()
    if norms is None:
        return None
    q, k = norms
    ok = (plain_rms_norm(q) and plain_rms_norm(k) and q.eps == k.eps
          and q.weight.shape == k.weight.shape == (attn.head_dim,))
    return norms if ok else False


def build(layers: Sequence[PlanLayer], final_norm: RMSNorm | None, whole: bool, world_size: int,
          ends: tuple[torch.Tensor | None, ParallelLMHead] | None = None) -> DecodePlan | None:
    """The plan of a whole model (`whole`: one pipeline stage holding every layer) on CPU in float32 whose layers all
    declare the plan's shape, with float32 RMSNorms and one head size; None where it does not apply. `ends`: the
    model's embedding table and LM head, which the compiled call may run too
    (LlamaForCausalLM.plan_ends)."""
    ops = kernels.decode_glue_ops()
    if (ops is None or kernels.rms_norm_op() is None or not whole or not layers
            or final_norm.weight.device.type != "cpu" or Norm.of(final_norm) is None):
        return None
    fast = []
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        norms = qk_norms(attn) if layer.on_decode_plan() else False
        if norms is False:
            return None
        sinks = attn.attention_sinks()
        whole_qk = attn.plan_whole_qk_norms()
        if whole_qk is False or (whole_qk is not None and (norms is not None or any(
                w.dtype != torch.float32 for w in whole_qk[:2]))):
            return None
        ffn_in, attn_out, ffn_out = layer.plan_norms()
        around = [Norm.of(n) for n in (layer.input_layernorm, ffn_in, attn_out, ffn_out)]
        if (any(p is None for p, n in zip(around, (True, True, attn_out, ffn_out)) if n is not None)
                or (sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (attn.num_heads,)))
                or attn.head_dim != layers[0].self_attn.head_dim):
            return None
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else final_norm
        dense = layer.dense_mlp()
        fast.append(FastLayer(attn, attn.qkv_proj, attn.o_proj, mlp.gate_up_proj if dense else None,
                              mlp.down_proj if dense else None, None if dense else mlp, attn.groups.q_index,
                              attn.groups.out_index, around[1], Norm.of(nxt), norms, sinks, attn.window,
                              attn.softcap or 0.0, mlp.plan_activation() if dense else 0, around[2], around[3],
                              whole_qk))
    return DecodePlan(ops, layers[0].input_layernorm, fast, layers[0].self_attn.head_dim, world_size, ends)


def plan_moe(ffn: torch.nn.Module) -> tuple[torch.ScriptObject, torch.Tensor | None] | None:
    """An MoE feed-forward as the compiled step runs it (SparseMoe.plan_moe), or None (any other module)."""
    return ffn.plan_moe() if isinstance(ffn, SparseMoe) else None


def compile_layers(plan: DecodePlan) -> torch.ScriptObject | None:
    """The layers as one compiled DecodeLayers (sharding/cpu/csrc/decode_glue.cpp), where every linear has a compiled
    kernel and there is no all-reduce between them (TP=1); else None (the Python loop of DecodePlan.forward)."""
    ops = kernels.decode_layers_ops()
    if ops is None or plan.world_size != 1 or any(f.q_index is not None for f in plan.layers):
        return None  # (the one call: even groups)
    moes = [plan_moe(f.ffn) if f.ffn is not None else None for f in plan.layers]
    if any(f.ffn is not None and m is None for f, m in zip(plan.layers, moes)):
        return None  # (a feed-forward the step cannot run whole: the Python loop calls its module)
    linears = [[kernels.plan_linear(lin) for lin in (f.qkv, f.o_proj, f.gate_up, f.down) if lin is not None]
               for f in plan.layers]
    if any(spec is None for layer in linears for spec in layer):
        return None
    compiled = ops[0]()
    compiled.set_huge_pages(hugepages.enabled())  # (the LoRA adapters' copies: in huge pages where the weights are)
    try:
        for f, specs, moe in zip(plan.layers, linears, moes):
            for spec in specs:
                if spec[0] == 5:  # parts of several types (kernels.plan_linear)
                    compiled.add_mixed_linear(*spec[1:])
                else:
                    compiled.add_linear(*spec)
            a = f.attn
            shape = (a.cache.pool, a.num_heads, a.num_kv_heads, a.scale, f.post_norm.weight, f.post_norm.eps,
                     f.next_norm.weight, f.next_norm.eps)
            if moe is not None:
                compiled.add_moe_layer(*moe, *shape)
            else:
                compiled.add_layer(*shape)
            if f.qk_norms is not None:
                compiled.set_qk_norm(f.qk_norms[0].weight, f.qk_norms[1].weight, f.qk_norms[0].eps)
            if f.whole_qk is not None:
                compiled.set_whole_qk_norm(*f.whole_qk)
            if f.window is not None or f.sinks is not None or f.softcap:
                compiled.set_attention(f.window or 0, f.sinks, f.softcap)
            if f.act or f.attn_out is not None or f.ffn_out is not None:
                compiled.set_ffn(f.act, *(x for n in (f.attn_out, f.ffn_out)
                                          for x in ((n.weight, n.eps) if n is not None else (None, 0.0))))
            for which, lin in enumerate((f.qkv, f.o_proj, f.gate_up, f.down)):  # LoRA adapters (sharding/layers/lora.py)
                for slot, w in enumerate(lin.lora.slots if lin is not None and lin.lora is not None else ()):
                    if w is not None:  # (bfloat16 values over a quantized base: held as such, half the bytes)
                        compiled.set_lora(compiled.size() - 1, which, slot,
                                          *((t.to(torch.bfloat16) for t in w) if lin.lora.half else w))
    except RuntimeError as e:  # a layout the compiled step does not take: the Python loop serves it
        logger.warning("decode layers not compiled (%s); the per-op decode path runs", str(e).splitlines()[0][:200])
        return None
    add_ends(compiled, plan)
    return compiled


def add_ends(compiled: torch.ScriptObject, plan: DecodePlan) -> None:
    """The model's embedding and LM head into the compiled call, where the model declares them (plan.ends), the head
    has a compiled kernel and the first norm is a plain one; else the call runs the layers only (the model embeds
    and applies its head around it). A table the call does not read (None) leaves the lookup to the model."""
    first = Norm.of(plan.first_norm)
    if plan.ends is None or first is None:
        return
    table, head = plan.ends
    spec = kernels.plan_linear(head)
    if spec is None or head.lora is not None:
        return
    try:
        if spec[0] == 5:
            compiled.add_mixed_linear(*spec[1:])
        else:
            compiled.add_linear(*spec)
        compiled.set_ends(table, first.weight, first.eps)
    except RuntimeError as e:  # (a table of another dtype; the layers stay compiled, the model's ends run around them)
        logger.warning("the LM head is not in the compiled decode step (%s)", str(e).splitlines()[0][:200])
