"""Mixture-of-experts blocks: a replicated float32 router, the experts this rank computes, one all-reduce.

Every rank of a TP group holds every token after the attention's all-reduce, so an MoE layer needs no all-to-all
inside the group: each rank computes its share of the routed experts for the tokens routed to them, and the
layer's one all-reduce (the one a dense MLP's down projection would do) sums the shares. Two ways to split:

- Tensor parallel (default): every expert's intermediate dimension is split over the ranks, as a dense MLP's is:
  gate/up are column-parallel, down row-parallel, and each rank computes every routed expert on its slice.
- Expert parallel (`--enable-expert-parallel`): the ranks own whole experts, split as evenly as possible
  (`split_evenly` over the expert count, so any count works with any degree); a rank computes only its own
  experts, for the tokens routed to them, and reads only their bytes. A shared expert stays tensor-parallel.

The router runs on every rank alike (its weight replicated, in float32), so every rank agrees on the routing
without a message. The experts of a step run grouped, as llama.cpp's `mul_mat_id` does: the step's (token, expert)
pairs are sorted by expert, and each active expert's gate/up -> activation -> down runs once over its rows through
the ordinary linear kernels (float32, bf16, int8, int4), so a step reads each active expert's weights once, whatever
its row count, and a batch-1 step reads only the k active experts. The weighted rows are scatter-added into the
output in expert order (transformers' order, so TP 1 sums exactly as it does).

Expert weights are read from either layout checkpoints use, by byte ranges: one tensor per expert (what
`save_pretrained` writes: `experts.{e}.gate_proj.weight`, ...) or fused 3-D tensors (`experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I]; gpt-oss stores them transposed with gate/up interleaved). A GGUF
file's stacked experts are served as the first layout (loaders/gguf_file.py registers one 2-D tensor per expert over
its bytes), and an expert stored in blocks is read as its blocks (quant.read_blocks), as a dense linear is, a
tensor-parallel split that cuts a block of its down projection zero-padded as RowParallelLinear pads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from loaders.checkpoint import Checkpoint
from loaders.partition import split_evenly
from sharding.cpu import kernels
from sharding.dist import Dist
from sharding.layers import quant, stored
from sharding.layers.linear import _empty, _Linear


@dataclass(frozen=True, slots=True)
class Block:
    """A block of a weight: [start, stop) along `dim` of checkpoint tensor `tensor` (full shape `full`), or of its
    `index`-th slice along dimension 0 when `index` is set (one expert of a fused tensor). The blocks of one weight
    are stacked as rows. `transposed`: stored [in, out], so the weight is the block's transpose. `interleaved`: the
    rows alternate gate, up (gpt-oss); they are reordered to all gate rows, then all up rows."""

    tensor: str
    full: tuple[int, ...]
    start: int
    stop: int
    dim: int = 0
    index: int | None = None
    transposed: bool = False
    interleaved: bool = False

    def read(self, ckpt: Checkpoint) -> torch.Tensor:
        t = ckpt.read(self.tensor, self.dim, [(self.start, self.stop)], index=self.index)
        if self.transposed:
            t = t.t()
        if self.interleaved:  # rows g0 u0 g1 u1 ... -> g0 g1 ... u0 u1 ...
            t = t.reshape(t.shape[0] // 2, 2, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        return t


class ExpertLinear(_Linear):
    """One expert's share of one projection: weight [out, in] assembled from `blocks` (rows, in order), and a bias
    from `bias_blocks`. No collective: the MoE block weights, sums and all-reduces the experts' outputs."""

    def __init__(self, out: int, in_features: int, blocks: list[Block], bias_blocks: list[Block] | None,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.blocks = blocks
        self.bias_blocks = bias_blocks or []
        self.weight = _empty(out, in_features, dtype=dtype, device=device)
        self.bias = _empty(out, dtype=dtype, device=device) if bias_blocks else None

    def expected(self) -> dict[str, tuple[int, ...]]:
        return {b.tensor: b.full for b in self.blocks + self.bias_blocks}

    def load(self, ckpt: Checkpoint) -> None:
        plain = all(b.index is None and not b.transposed and not b.interleaved for b in self.blocks)
        if plain:  # one 2-D tensor per expert stored quantized (a GGUF file's, a Hugging Face one's): never a float copy
            self.qweight = stored.read_weight(ckpt, [(b.tensor, b.dim, self._block_range(ckpt, b)) for b in self.blocks])
        else:  # an expert of fused tensors stored quantized (gpt-oss's MXFP4)
            self.qweight, self.pad = stored.read_rows(ckpt, self.blocks)
        if self.qweight is not None:
            self.weight = None
        else:
            ws = [b.read(ckpt) for b in self.blocks]
            self.weight.data.copy_(torch.cat(ws) if len(ws) > 1 else ws[0])
        if self.bias is not None:
            bs = [b.read(ckpt) for b in self.bias_blocks]
            self.bias.data.copy_(torch.cat(bs) if len(bs) > 1 else bs[0])

    def _block_range(self, ckpt: Checkpoint, b: Block) -> list[tuple[int, int]]:
        """The inputs to read of a block split by inputs (the down projection under tensor parallelism): the whole
        GGUF blocks where the split cuts one, with zeros around this rank's inputs (quant.whole_blocks, `pad`)."""
        if b.dim != 1:
            return [(b.start, b.stop)]
        a, z, self.pad = quant.whole_blocks(ckpt, b.tensor, b.start, b.stop)
        return [(a, z)]


class Expert(nn.Module):
    """Expert `index`: its gate/up (gate rows then up rows of this rank's slice of the intermediate dimension) and
    its down projection (the matching input columns). `down_bias`: a bias added once over the group (on the rank
    that owns the expert under expert parallelism, on TP rank 0 otherwise)."""

    def __init__(self, index: int, gate_up: ExpertLinear, down: ExpertLinear, add_down_bias: bool):
        super().__init__()
        self.index = index
        self.gate_up = gate_up
        self.down = down
        self.inter = gate_up.weight.shape[0] // 2
        self.add_down_bias = add_down_bias


class ReplicatedLinear(_Linear):
    """A small linear every rank holds whole, in float32 whatever the checkpoint's dtype (a router: every rank must
    route alike, and the top-k of 16-bit logits would tie). Not quantized; on CPU it runs on the float32 kernel
    (prepacked like every float32 linear), which streams the weight at twice the speed of torch's matmul."""

    def quantize(self, mode: str, group: int) -> None:
        pass  # stays float32

    def __init__(self, name: str, out_features: int, in_features: int, bias: bool, device: torch.device):
        super().__init__()
        self.name = name
        self.weight = _empty(out_features, in_features, dtype=torch.float32, device=device)
        self.bias = _empty(out_features, dtype=torch.float32, device=device) if bias else None

    def expected(self) -> dict[str, tuple[int, ...]]:
        out = {self.name + ".weight": tuple(self.weight.shape)}
        if self.bias is not None:
            out[self.name + ".bias"] = tuple(self.bias.shape)
        return out

    def load(self, ckpt: Checkpoint) -> None:
        self.weight.data.copy_(ckpt.read(self.name + ".weight"))
        if self.bias is not None:
            self.bias.data.copy_(ckpt.read(self.name + ".bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x.float(), self.bias)


@dataclass(frozen=True, slots=True)
class Routing:
    """How a router's logits pick and weight the experts: `softmax_topk` (Mixtral, Qwen-MoE, OLMoE): softmax over
    all experts, top-k, then renormalised to sum 1 when `renormalize`; `topk_softmax` (gpt-oss): top-k of the
    logits, then a softmax over those k."""

    top_k: int
    renormalize: bool = False
    topk_softmax: bool = False

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [n, k] float32, expert ids [n, k])."""
        if self.topk_softmax:
            values, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(values, dim=-1), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, ids


def local_experts(num_experts: int, dist: Dist) -> tuple[int, int]:
    """[first, stop) of the experts this rank computes: all of them under tensor parallelism."""
    return split_evenly(num_experts, dist.world_size, dist.rank) if dist.expert_parallel else (0, num_experts)


def local_inter(inter: int, dist: Dist) -> tuple[int, int]:
    """[a, b) of an expert's intermediate dimension this rank computes: all of it under expert parallelism."""
    return (0, inter) if dist.expert_parallel else split_evenly(inter, dist.world_size, dist.rank)


def separate_experts(prefix: str, num_experts: int, inter: int, hidden: int, dist: Dist, dtype: torch.dtype,
                     device: torch.device, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                     ) -> list[Expert]:
    """This rank's experts from one tensor per expert and projection: `{prefix}.{e}.{gate}.weight` [I, H], up
    likewise, down [H, I] (Mixtral names them w1, w3, w2)."""
    gate, up, down = names
    a, b = local_inter(inter, dist)
    experts = []
    for e in range(*local_experts(num_experts, dist)):
        p = f"{prefix}.{e}"
        gate_up = ExpertLinear(2 * (b - a), hidden, [Block(f"{p}.{gate}.weight", (inter, hidden), a, b),
                                        Block(f"{p}.{up}.weight", (inter, hidden), a, b)], None, dtype, device)
        down_lin = ExpertLinear(hidden, b - a, [Block(f"{p}.{down}.weight", (hidden, inter), a, b, dim=1)], None, dtype,
                                device)  # every output row, input columns [a, b)
        experts.append(Expert(e, gate_up, down_lin, False))
    return experts


def fused_experts(prefix: str, num_experts: int, inter: int, hidden: int, dist: Dist, dtype: torch.dtype,
                  device: torch.device) -> list[Expert]:
    """This rank's experts from fused 3-D tensors (transformers' in-memory layout, which some checkpoints store):
    `{prefix}.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `{prefix}.down_proj` [E, H, I]."""
    a, b = local_inter(inter, dist)
    gu_full, down_full = (num_experts, 2 * inter, hidden), (num_experts, hidden, inter)
    experts = []
    for e in range(*local_experts(num_experts, dist)):
        gate_up = ExpertLinear(2 * (b - a), hidden, [Block(f"{prefix}.gate_up_proj", gu_full, a, b, index=e),
                                        Block(f"{prefix}.gate_up_proj", gu_full, inter + a, inter + b, index=e)],
                               None, dtype, device)
        down = ExpertLinear(hidden, b - a, [Block(f"{prefix}.down_proj", down_full, a, b, dim=1, index=e)], None, dtype,
                            device)
        experts.append(Expert(e, gate_up, down, False))
    return experts


class SparseMoe(nn.Module):
    """One MoE layer's feed-forward: y = all_reduce(sum over this rank's experts e of w_e(x) * expert_e(x)
    [+ this rank's share of the shared expert, times sigmoid(shared_gate(x))]).

    `act`: the activation of [n, 2I] gate|up rows into [n, I] (SiLU(gate) * up unless a model says otherwise)."""

    def __init__(self, router: ReplicatedLinear, routing: Routing, experts: tuple[list[Expert], set[str]],
                 num_experts: int, dist: Dist, hidden: int, shared: nn.Module | None = None,
                 shared_gate: ReplicatedLinear | None = None, act=None):
        super().__init__()
        self.router = router
        self.routing = routing
        # (this rank's, the tensors other ranks read: see routed_experts; sharding/layers/interface.py ReadElsewhere)
        experts, self.elsewhere = experts
        self.elsewhere: set[str]
        self.experts = nn.ModuleList(experts)
        self.num_experts = num_experts
        self.dist = dist
        self.hidden = hidden
        self.shared = shared
        self.shared_gate = shared_gate
        self._act = act
        self.first = experts[0].index if experts else 0
        # tokens routed to each expert since start (counted on rank 0, which exports them as metrics)
        self.tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64)

    def act(self, h: torch.Tensor) -> torch.Tensor:
        if self._act is not None:
            return self._act(h)
        glue = kernels.decode_glue_ops() if h.device.type == "cpu" and h.dtype == torch.float32 else None
        if glue is not None:
            return glue[2](h)  # silu(gate) * up in one pass (decode_glue.cpp)
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    # the compiled grouped experts (a torch.classes.tpserve.MoeExperts), None: the loop; False: not looked up yet
    _compiled: torch.ScriptObject | Literal[False] | None = False

    def _compile(self) -> torch.ScriptObject | None:
        """This rank's experts as one compiled MoeExperts (decode_glue.cpp's moe_experts: every phase of every active
        expert in one call), where each expert's linears have a compiled kernel and the activation is SiLU(gate) * up
        or one the kernel has (the act module's `plan_activation()`: (kind, alpha, limit)); else None (the loop of
        `routed`). Built at the first step, after the weights are packed and moved."""
        ops = kernels.moe_experts_ops()
        act = (0, 1.0, 0.0) if self._act is None else getattr(self._act, "plan_activation", lambda: None)()
        if ops is None or act is None or not len(self.experts):
            return None
        specs = [(e.index, kernels.plan_linear(e.gate_up), kernels.plan_linear(e.down)) for e in self.experts]
        if any(g is None or d is None or g[0] == 5 or d[0] == 5 for _, g, d in specs):  # (5: parts of several types)
            return None
        if any(e.down.pad is not None for e in self.experts):  # zero-padded inputs (_block_range): the loop pads
            return None
        compiled = ops[0]()
        compiled.set_activation(*act)
        for (index, gate_up, down), expert in zip(specs, self.experts):
            if not expert.add_down_bias:
                down = down[:3] + (None,) + down[4:]
            compiled.add_expert(index, *gate_up, *down)
        router = kernels.plan_linear(self.router)
        if router is not None and router[0] == 0:  # the float32 kernel's router: routed in C++ too (moe_forward)
            r = self.routing
            compiled.set_router(*router, r.top_k, r.renormalize, r.topk_softmax)
            self._routes = True
            shared = self._plan_shared()
            if shared is not None:
                compiled.set_shared(*shared)
                self._shared_planned = True
        return compiled

    _routes = False  # whether the compiled plan has the router and routing (moe_forward), else moe_experts
    _shared_planned = False  # whether it has the shared expert too

    def _plan_shared(self) -> tuple | None:
        """The shared expert as MoeExperts.set_shared takes it (a SiLU MLP whose linears have compiled kernels, and a
        float32 gate or none), or None (it then runs as its module)."""
        mlp = self.shared
        if mlp is None or getattr(mlp, "plan_activation", lambda: None)() != 0 or mlp.down_proj.bias is not None:
            return None  # (a row-parallel bias is added once after the all-reduce: the module's to do)
        gate_up, down = kernels.plan_linear(mlp.gate_up_proj), kernels.plan_linear(mlp.down_proj)
        gate = kernels.plan_linear(self.shared_gate) if self.shared_gate is not None else None
        if (gate_up is None or down is None or gate_up[0] == 5 or down[0] == 5
                or (self.shared_gate is not None and (gate is None or gate[0] != 0))):
            return None
        return (*gate_up, *down, gate[1] if gate else None, gate[3] if gate else None)

    def _plan(self) -> torch.ScriptObject | None:
        """The compiled experts (for float32 inputs on CPU), built at first use."""
        if self._compiled is False:
            self._compiled = self._compile()
        return self._compiled

    def _counts(self) -> torch.Tensor | None:
        """The expert-token counts a compiled call adds to: rank 0's only (it exports them as metrics)."""
        return self.tokens_per_expert if self.dist.is_driver else None

    def plan_moe(self) -> tuple[torch.ScriptObject, torch.Tensor | None] | None:
        """This feed-forward as the one-call decode step runs it (sharding/cpu/decode_plan.py): the compiled experts
        with their router and routing (and its shared expert), and the counts to add to; None where the step cannot
        run it whole (no compiled experts or router, a shared expert without compiled linears)."""
        plan = self._plan()
        if plan is None or not self._routes or (self.shared is not None and not self._shared_planned):
            return None
        return plan, self._counts()

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the routed experts' weighted sum, [n, hidden] in x's dtype."""
        compiled = self._plan() if x.dtype == torch.float32 and x.device.type == "cpu" else None
        if compiled is not None and self._routes:  # router, routing, the metric and the experts in one call
            return kernels.moe_experts_ops()[2](compiled, x.contiguous(), self._counts(), False)
        weights, ids = self.routing(self.router(x))
        if self.dist.is_driver:  # the metric is exported by rank 0 only (server/api/metrics.py ExpertTokens)
            self.tokens_per_expert += torch.bincount(ids.reshape(-1), minlength=self.num_experts).cpu()
        if compiled is not None:
            return kernels.moe_experts_ops()[1](compiled, x.contiguous(), ids, weights.contiguous())
        k = ids.shape[1]
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        order = torch.argsort(flat, stable=True)  # the (token, expert) pairs grouped by expert, tokens ascending
        tokens = order // k
        pair_weights = weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
        out = torch.zeros_like(x)
        counts_list = counts.tolist()
        start = sum(counts_list[:self.first])
        for expert in self.experts:
            c = counts_list[expert.index]
            if not c:
                continue
            rows = tokens[start:start + c]
            xe = x if c == x.shape[0] == 1 else x.index_select(0, rows)
            h = self.act(expert.gate_up.matmul(xe, expert.gate_up.bias))
            y = expert.down.matmul(h, expert.down.bias if expert.add_down_bias else None)
            out.index_add_(0, rows, y.mul_(pair_weights[start:start + c]))
            start += c
        return out

    def forward(self, x: torch.Tensor, scatter: bool = False) -> torch.Tensor:
        compiled = self._plan() if x.dtype == torch.float32 and x.device.type == "cpu" else None
        whole = compiled is not None and self._routes and self._shared_planned
        if whole:  # the routed experts and the shared expert in one call (moe_forward)
            out = kernels.moe_experts_ops()[2](compiled, x.contiguous(), self._counts(), True)
        else:
            out = self.routed(x)
        if self.shared is not None and not whole:
            s = self.shared.partial(x)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(x)).to(s.dtype) * s
            out = out + s
        return self.dist.reduce_scatter_tokens(out) if scatter else self.dist.all_reduce(out)


UNSUPPORTED_FIELDS = {
    # config field: (the value that means "not used", what it would need)
    "n_group": ((None, 1), "grouped top-k routing"),
    "topk_group": ((None, 1), "grouped top-k routing"),
    "topk_method": ((None, "greedy"), "a top-k method other than greedy (e.g. noaux_tc)"),
    "scoring_func": ((None, "softmax"), "a scoring function other than softmax (e.g. sigmoid)"),
    "routed_scaling_factor": ((None, 1, 1.0), "a routed scaling factor"),
    "e_score_correction_bias": ((None,), "an expert score correction bias"),
    "n_shared_experts": ((None, 0), "DeepSeek-style shared experts"),
    "moe_layer_freq": ((None, 1), "moe_layer_freq"),
    "first_k_dense_replace": ((None, 0), "first_k_dense_replace"),
}


def check_moe_config(config, architecture: str) -> None:
    """Refuse, at start and with the field's name, a routing feature this implementation does not compute."""
    for name, (unused, what) in UNSUPPORTED_FIELDS.items():
        value = getattr(config, name, None)
        if value not in unused:
            raise ValueError(f"{architecture}: config field {name}={value!r} ({what}) is not supported")
    k, e = config.num_experts_per_tok, getattr(config, "num_experts", None) or getattr(config, "num_local_experts")
    if not 1 <= k <= e:
        raise ValueError(f"{architecture}: num_experts_per_tok ({k}) must be between 1 and the expert count ({e})")


def routed_experts(config, prefix: str, num_experts: int, inter: int, dist: Dist, dtype: torch.dtype,
                   device: torch.device, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                   ) -> tuple[list[Expert], set[str]]:
    """This rank's experts under `{prefix}` (e.g. `model.layers.3.mlp.experts`), from whichever layout the
    checkpoint has (build_model sets `config.tpserve_fused_experts`), and the checkpoint tensors that only other
    ranks read (other experts' tensors, under expert parallelism)."""
    if getattr(config, "tpserve_fused_experts", False):  # every rank reads its experts' part of the same tensors
        return fused_experts(prefix, num_experts, inter, config.hidden_size, dist, dtype, device), set()
    first, stop = local_experts(num_experts, dist)
    elsewhere = {f"{prefix}.{e}.{n}.weight" for e in range(num_experts) if not first <= e < stop for n in names}
    return separate_experts(prefix, num_experts, inter, config.hidden_size, dist, dtype, device, names), elsewhere


def sparse_moe(config, prefix: str, num_experts: int, inter: int, routing: Routing, dist: Dist, dtype: torch.dtype,
               device: torch.device, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
               shared: nn.Module | None = None, shared_gate: ReplicatedLinear | None = None) -> SparseMoe:
    """The usual MoE block under `{prefix}`: router `{prefix}.gate` (no bias), experts `{prefix}.experts`."""
    router = ReplicatedLinear(f"{prefix}.gate", num_experts, config.hidden_size, False, device)
    experts = routed_experts(config, f"{prefix}.experts", num_experts, inter, dist, dtype, device, names)
    return SparseMoe(router, routing, experts, num_experts, dist, config.hidden_size, shared, shared_gate)
