"""Tensor-parallel layers. Each one owns a block of a Hugging Face weight and knows how to read exactly that block.

Megatron's recipe: a column-parallel linear (q/k/v, gate/up) keeps a block of output rows and needs no collective;
the row-parallel linear that follows (o_proj, down_proj) keeps the matching block of input columns, so its partial
outputs sum to the full result with one all-reduce. Embedding and LM head keep a block of vocabulary rows.

Every layer lists the HF tensors it reads (`expected()`: name -> full shape) and loads its block with `load()`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from loaders.checkpoint import Checkpoint
from loaders.partition import split_evenly
from sharding.cpu import kernels
from sharding.layers import quant, stored
from sharding.layers.interface import Loadable, Packable
from sharding.dist import Dist
from sharding.cpu.kernels import can_pack, pack, packed_linear

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Piece:
    """Rows [start, stop) along the split dimension of HF tensor `name` (without `.weight`), whose full weight
    shape is `full` ([out, in], or [in, out] when `transposed`, as GPT-2's Conv1D stores it)."""

    name: str
    start: int
    stop: int
    full: tuple[int, ...]
    transposed: bool = False


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class _Linear(Packable):
    """What every linear shares: `weight` [out, in] as loaded, and after `prepack()` (the runner calls it once all
    weights are loaded) a copy laid out for the CPU kernels that replaces it: float32 in blocks of 32 output columns
    for the compiled f32_linear, else (bfloat16, or without the compiled kernels) oneDNN's packed layout
    (sharding/cpu/kernels.py)."""

    packed: torch.Tensor | None = None
    blocked: torch.Tensor | None = None  # float32, kernels.block_f32
    qweight: quant.QuantizedWeight | None = None  # --quantization: replaces the weight (sharding/layers/quant.py)

    def quantize(self, mode: str, group: int) -> None:
        if self.qweight is None and self.weight is not None and quant.supported(mode, self.weight.shape[1], group):
            self.qweight = quant.quantize(self.weight, mode, group)
            self.weight = None  # a tied embedding keeps its own reference

    def prepack(self) -> None:
        w = self.weight
        if (self.blocked is None and w is not None and w.dim() == 2 and w.dtype == torch.float32
                and w.device.type == "cpu" and kernels.f32_linear_op() is not None):
            self.blocked = kernels.block_f32(w)
            self._f32 = (kernels.f32_linear_op(), w.shape[0])
            self.weight = None  # (a tied embedding keeps its own reference)
            return
        if self.packed is None and self.weight is not None and can_pack(self.weight):
            try:
                self.packed = pack(self.weight)
            except RuntimeError:  # a oneDNN build without this path: stay on F.linear
                return
            self.weight = None  # the packed copy is the weight now (a tied embedding keeps its own reference)

    lora = None  # sharding/layers/lora.py LoraLinear: this linear's LoRA adapters (column/row-parallel, when enabled)

    @property
    def float32_base(self) -> bool:
        """Whether this linear's weights are float32 (not quantized, not bfloat16): its LoRA adapters are then held in
        float32 too, else in bfloat16 (sharding/layers/lora.py)."""
        if self.qweight is not None:
            return False
        if self.blocked is not None:
            return True
        w = self.packed if self.packed is not None else self.weight
        return w is not None and w.dtype == torch.float32

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ bias), plus the LoRA deltas of the step's adapter rows when it has any (sharding/layers/lora.py). Every
        path through a linear (module forward, the decode fast path) goes through here, so none skips an adapter."""
        lora = self.lora
        if lora is None or lora.ctx.rows is None:
            return self._base_matmul(x, bias)
        return lora.apply(x, self._base_matmul(x, bias))

    pad: tuple[int, int] | None = None  # RowParallelLinear: zeros around the inputs (a split that cuts a block)

    def _base_matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.pad is not None:
            x = F.pad(x, self.pad)
        if self.qweight is not None:
            return quant.linear(x, self.qweight, bias)
        if self.blocked is not None:
            op, n = self._f32
            if x.dim() == 2:
                return op(x, self.blocked, bias, n)
            return op(x.reshape(-1, x.shape[-1]), self.blocked, bias, n).reshape(*x.shape[:-1], n)
        if self.packed is not None:
            m = x.shape[0]
            rows = bucket_rows(m)
            if rows != m:  # see bucket_rows: a bounded set of shapes, so oneDNN's memory stays bounded
                return packed_linear(torch.cat([x, x.new_zeros(rows - m, x.shape[1])]), self.packed, bias)[:m]
            return packed_linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)


def bucket_rows(m: int) -> int:
    """The row count a packed linear runs at for m rows. oneDNN keeps a compiled primitive per distinct shape (~1 MB
    each, up to its cache's 1024 entries): four linears called at every row count from 1 to 512 grew a process by
    2.4 GB, and a server's steps (decode batches, prefill chunks, their mixes) take all of those counts. Rounding up
    keeps the count of shapes small: exact up to 32 rows (decode batches), then multiples of 16 up to 128 (decode
    batches with a small prefill chunk), of 32 up to 512, of 128 up to 2048 and of 512 beyond (~5 % padded rows on
    average; measured in BENCHMARKS.md, "Flat memory")."""
    if m <= 32:
        return m
    step = 16 if m <= 128 else 32 if m <= 512 else 128 if m <= 2048 else 512
    return -(-m // step) * step


class ColumnParallelLinear(_Linear):
    """y_local = x @ W[rows]^T (+ b[rows]): the output is split over ranks by rows of W; no collective.

    Several pieces are fused into one matmul (q/k/v, gate/up): each piece is a block of rows of its own HF tensor, or
    of one fused HF tensor (Phi-3's qkv_proj), concatenated in order.
    """

    def __init__(self, in_features: int, pieces: list[Piece], bias: bool, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.pieces = pieces
        self.out_sizes = [p.stop - p.start for p in pieces]
        self.weight = _empty(sum(self.out_sizes), in_features, dtype=dtype, device=device)
        self.bias = _empty(sum(self.out_sizes), dtype=dtype, device=device) if bias else None

    def expected(self) -> dict[str, tuple[int, ...]]:
        out = {}
        for p in self.pieces:
            out[p.name + ".weight"] = p.full
            if self.bias is not None:
                out[p.name + ".bias"] = (p.full[1] if p.transposed else p.full[0],)
        return out

    def load(self, ckpt: Checkpoint) -> None:
        ws, bs = [], []
        self.qweight = stored.read_weight(ckpt, [(p.name + ".weight", 0, [(p.start, p.stop)]) for p in self.pieces])
        if self.qweight is not None:  # stored quantized (GGUF, a quantized HF folder): never a float copy
            self.weight = None
        for p in self.pieces:
            ranges = [(p.start, p.stop)]
            if self.qweight is not None:
                pass
            elif p.transposed:
                ws.append(ckpt.read(p.name + ".weight", 1, ranges).t())
            else:
                ws.append(ckpt.read(p.name + ".weight", 0, ranges))
            if self.bias is not None:
                bs.append(ckpt.read(p.name + ".bias", 0, ranges))
        # Group contiguous blocks of one fused tensor are still separate reads; cat copies once into the parameter.
        if ws:
            self.weight.data.copy_(torch.cat(ws, 0) if len(ws) > 1 else ws[0])
        if self.bias is not None:
            self.bias.data.copy_(torch.cat(bs, 0) if len(bs) > 1 else bs[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class RowParallelLinear(_Linear):
    """y = all_reduce(x_local @ W[:, cols]^T) + b: the input is split over ranks by columns of W; one all-reduce,
    then the (replicated) bias is added once."""

    def __init__(self, piece: Piece, bias: bool, dist: Dist, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.piece = piece
        self.dist = dist
        out_features = piece.full[1] if piece.transposed else piece.full[0]
        self.weight = _empty(out_features, piece.stop - piece.start, dtype=dtype, device=device)
        self.bias = _empty(out_features, dtype=dtype, device=device) if bias else None

    def expected(self) -> dict[str, tuple[int, ...]]:
        out = {self.piece.name + ".weight": self.piece.full}
        if self.bias is not None:
            out[self.piece.name + ".bias"] = (self.weight.shape[0],)
        return out

    def load(self, ckpt: Checkpoint) -> None:
        p = self.piece
        start, stop, self.pad = quant.whole_blocks(ckpt, p.name + ".weight", p.start, p.stop)
        if self.pad is not None:
            logger.info("%s: the tensor-parallel split cuts its blocks; this rank reads inputs [%d, %d) for its [%d, %d) "
                        "and zero-pads the rest", p.name, start, stop, p.start, p.stop)
        self.qweight = stored.read_weight(ckpt, [(p.name + ".weight", 1, [(start, stop)])])
        if self.qweight is not None:  # stored quantized: this rank's blocks or groups of every row
            self.weight = None
        elif p.transposed:
            self.weight.data.copy_(ckpt.read(p.name + ".weight", 0, [(p.start, p.stop)]).t())
        else:
            self.weight.data.copy_(ckpt.read(p.name + ".weight", 1, [(p.start, p.stop)]))
        if self.bias is not None:
            self.bias.data.copy_(ckpt.read(p.name + ".bias"))

    def forward(self, x: torch.Tensor, scatter: bool = False) -> torch.Tensor:
        """scatter: sequence parallelism; the sum is reduce-scattered over the tokens (this rank's rows only). A LoRA
        delta (x_local @ A[:, cols]^T @ B^T) joins the partial product before the reduce (sharding/layers/lora.py)."""
        partial = self.matmul(x)
        y = self.dist.reduce_scatter_tokens(partial) if scatter else self.dist.all_reduce(partial)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(Loadable):
    """Rows [start, stop) of the embedding table; ids outside the block give zeros; one all-reduce sums the blocks."""

    def __init__(self, name: str, vocab_size: int, hidden: int, dist: Dist, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.name = name
        self.dist = dist
        self.vocab_size = vocab_size
        self.start, self.stop = split_evenly(vocab_size, dist.world_size, dist.rank)
        self.dtype = dtype  # what the looked-up rows are (the table may stay in its stored 16-bit dtype: load)
        self.weight = _empty(self.stop - self.start, hidden, dtype=dtype, device=device)

    def expected(self) -> dict[str, tuple[int, ...]]:
        return {self.name: (self.vocab_size, self.weight.shape[1])}

    blocks: torch.Tensor | None = None  # a GGUF table kept in its blocks: uint8 [rows, blocks, bytes per block]
    block_type: str | None = None
    shared = False  # an LM head multiplies by this table (tied): it stays in the model's dtype

    def load(self, ckpt: Checkpoint) -> None:
        self.block_type = ckpt.quant_type(self.name)
        if self.block_type is not None:  # stored in blocks (GGUF): kept so; the looked-up rows are dequantized
            self.blocks = ckpt.read_blocks(self.name, 0, [(self.start, self.stop)])
            self.weight = None
            return
        stored = ckpt.info(self.name).dtype
        if (not self.shared and self.weight.dtype == torch.float32 and stored in (torch.bfloat16, torch.float16)
                and self.weight.device.type == "cpu"):
            # a 16-bit table served in float32 stays 16-bit: only its looked-up rows become float32 (exactly), not
            # the whole table (Llama-3-8B's: 2.1 GB in float32, 1.05 as stored)
            self.weight = nn.Parameter(ckpt.read(self.name, 0, [(self.start, self.stop)]), requires_grad=False)
            return
        self.weight.data.copy_(ckpt.read(self.name, 0, [(self.start, self.stop)]))

    def _lookup(self, local: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            rows = F.embedding(local, self.weight)
            return rows if rows.dtype == self.dtype else rows.to(self.dtype)
        rows = self.blocks.index_select(0, local.reshape(-1))
        return quant.dequantize_blocks(self.block_type, rows).reshape(*local.shape, -1)

    def forward(self, ids: torch.Tensor, scatter: bool = False) -> torch.Tensor:
        if self.dist.world_size == 1:
            return self._lookup(ids)
        inside = (ids >= self.start) & (ids < self.stop)
        local = torch.where(inside, ids - self.start, torch.zeros_like(ids))
        out = self._lookup(local)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.dist.reduce_scatter_tokens(out) if scatter else self.dist.all_reduce(out)


class ParallelLMHead(_Linear):
    """logits[:, start:stop] = h @ W[start:stop]^T on each rank; the blocks are gathered to rank 0, which samples.

    With tied embeddings it shares the embedding's block (same rows), so nothing more is read."""

    def __init__(self, name: str, vocab_size: int, hidden: int, dist: Dist, dtype: torch.dtype,
                 device: torch.device, tied_to: VocabParallelEmbedding | None = None, bias: bool = False):
        super().__init__()
        self.name = name
        self.dist = dist
        self.vocab_size = vocab_size
        self.sizes = [b - a for a, b in (split_evenly(vocab_size, dist.world_size, r) for r in range(dist.world_size))]
        self.start, self.stop = split_evenly(vocab_size, dist.world_size, dist.rank)
        self.tied = tied_to is not None
        self.tied_name = tied_to.name if tied_to is not None else None
        if tied_to is not None:
            tied_to.shared = True
        self.weight = tied_to.weight if tied_to is not None else _empty(self.stop - self.start, hidden, dtype=dtype,
                                                                         device=device)
        self.bias = _empty(self.stop - self.start, dtype=dtype, device=device) if bias else None

    def expected(self) -> dict[str, tuple[int, ...]]:
        out = {} if self.tied else {self.name + ".weight": (self.vocab_size, self.weight.shape[1])}
        if self.bias is not None:
            out[self.name + ".bias"] = (self.vocab_size,)
        return out

    read_as_stored = False  # set by the runner when the head is quantized right after its read (a 16-bit head then
    # stays 16-bit until quant.quantize converts it chunk by chunk: Llama-3-8B's is never 2.1 GB of float32)

    def load(self, ckpt: Checkpoint) -> None:
        if self.tied and ckpt.quant_type(self.tied_name) is not None:  # the embedding's blocks, for the matmul
            self.qweight = stored.read_weight(ckpt, [(self.tied_name, 0, [(self.start, self.stop)])])
            self.weight = None
        if not self.tied:
            self.qweight = stored.read_weight(ckpt, [(self.name + ".weight", 0, [(self.start, self.stop)])])
            if self.qweight is not None:  # stored quantized: served in its own layout
                self.weight = None
            elif (self.read_as_stored and self.weight.dtype == torch.float32
                  and ckpt.info(self.name + ".weight").dtype in (torch.bfloat16, torch.float16)):
                self.weight = nn.Parameter(ckpt.read(self.name + ".weight", 0, [(self.start, self.stop)]),
                                           requires_grad=False)
            else:
                self.weight.data.copy_(ckpt.read(self.name + ".weight", 0, [(self.start, self.stop)]))
        if self.bias is not None:
            self.bias.data.copy_(ckpt.read(self.name + ".bias", 0, [(self.start, self.stop)]))

    def forward(self, h: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary float32 logits on rank 0, None elsewhere."""
        local = self.matmul(h, self.bias).float()
        return self.dist.gather_last_dim(local, self.sizes)


class Replicated(Loadable):
    """A parameter every rank holds whole (norm weights, GPT-2's position table)."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.name = name
        self.weight = _empty(*shape, dtype=dtype, device=device)

    def expected(self) -> dict[str, tuple[int, ...]]:
        return {self.name: tuple(self.weight.shape)}

    def load(self, ckpt: Checkpoint) -> None:
        self.weight.data.copy_(ckpt.read(self.name))


class RMSNorm(Replicated):
    """Llama's RMSNorm, computed in float32 exactly as transformers does; `offset` is 1.0 for Gemma's (1 + w)."""

    def __init__(self, name: str, dim: int, eps: float, dtype: torch.dtype, device: torch.device, offset: float = 0.0):
        super().__init__(name, (dim,), dtype, device)
        self.eps = eps
        self.offset = offset
        # the compiled one-pass kernel, looked up at the first call (built at start); None: none
        self._op: kernels.Op | Literal[False] | None = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and not self.offset:
            if self._op is False:
                self._op = kernels.rms_norm_op() if x.device.type == "cpu" else None
            if self._op is not None:  # one dispatch instead of ~6 (sharding/cpu/csrc/rms_norm.cpp)
                if x.dim() == 2:
                    return self._op(x, self.weight, self.eps)
                return self._op(x.reshape(-1, x.shape[-1]), self.weight, self.eps).reshape(x.shape)
            # bit-identical to the float32 formula below (checked in tests/sharding/test_perf_paths)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)
