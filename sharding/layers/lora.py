"""LoRA adapters on a tensor-parallel model: slots of float32 A/B per linear, and the grouped delta of a mixed step.

A model with adapters enabled (`LoraManager(model, num_slots)`) has `num_slots` adapter slots, numbered 1..num_slots
(0 is the base model). Loading an adapter into a slot reads, on each rank, only the blocks its linears need, by byte
ranges (loaders/adapters.py AdapterFiles):
- column-parallel linears (q/k/v, gate/up, fused or not) keep A [r, in] whole and the rows of B [out, r] that follow
  the base layer's split (its Pieces: uneven head splits, replicated KV heads, sections of Phi-3's fused tensors);
- row-parallel linears (o_proj, down_proj) keep the columns of A that match their input block and B whole; their
  delta is added to the partial product before the all-reduce the layer already does (sum over ranks of
  x_r A_r^T = x A^T), so adapters add no collective.
Each linear stores, per slot, A^T [in, R] and B^T * scale [R, out_local] in float32. Over a float32 base they are the
adapter's values; over a quantized or bfloat16 base they are rounded to bfloat16 (`LoraLinear.half`), and the compiled
step holds them as bfloat16: at batch 1 an adapter's bytes are read once a token like the base's, and float32 rank-16
adapters on every linear add ~14 % to an int8 base's bytes, bfloat16 ones ~7 %. The rounding (a relative 2^-9) is
far below the base's own (int8: 2^-8 of a block's largest weight, int4 2^-4), and every path (the modules, the
per-layer loop, the compiled step) computes with the same rounded values. A fused column linear whose pieces come
from several adapted modules (q, k, v) concatenates their A's (R = the sum of their ranks) and places each B
block-diagonally, so a delta is two matmuls.

A step says each sequence's slot in its flags (sharding/wire.py: with_lora); AttentionMetadata.build turns them into
`LoraRows` (for each slot present, the step's tokens of that slot), which the model's forward hands to its
`LoraContext`. Every adapted linear's `matmul` then adds, per slot present, (x[rows] @ A^T) @ (B^T * scale) to its
output rows (a grouped shrink and expand over that adapter's rows only; S-LoRA / Punica's idea). A step without
adapter rows has no LoraRows: its linears check one attribute and do nothing else. The decode fast paths see the
adapters too: the per-layer loop through the linears' `matmul`, the compiled one-call step of TP=1
(sharding/cpu/csrc/decode_glue.cpp: decode_layers) through each linear's adapters registered with it (`set_lora`) and the
rows' slots passed per step; loading or unloading rebuilds that step at its next use (LlamaForCausalLM.lora_changed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from loaders.adapters import AdapterFiles, AdapterInfo, LoraError, ModuleAdapter, read_adapter
from sharding.layers.linear import ColumnParallelLinear, Piece, RowParallelLinear
from sharding.layers.lora_rows import LoraContext

if TYPE_CHECKING:
    from sharding.models.interface import CausalLM


# ---- one linear ----------------------------------------------------------------------------------------------------


# A fused linear's expand runs block by block (its B^T's zero blocks skipped) from this many rows on; below it, one
# matmul over the whole B^T costs less than a dispatch per block.
BLOCK_ROWS = 32

Block = tuple[int, int, int, int]  # rows r0:r1 of B^T nonzero only in its columns c0:c1


class LoraLinear:
    """The adapters of one column- or row-parallel linear, slot by slot: (A^T [in_local, R], B^T * scale
    [R, out_local]) float32, or None where that slot's adapter does not adapt this linear; and per slot the nonzero
    blocks of a fused linear's block-diagonal B^T (None: B^T is one block)."""

    __slots__ = ("ctx", "slots", "blocks", "half")

    def __init__(self, ctx: LoraContext, num_slots: int, half: bool = False) -> None:
        self.ctx = ctx
        self.half = half  # adapters rounded to bfloat16 (a quantized or bfloat16 base; see the module's docstring)
        self.slots: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * (num_slots + 1)
        self.blocks: list[list[Block] | None] = [None] * (num_slots + 1)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y += the delta of every slot present in the step, over that slot's rows of x; returns y."""
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        y2 = y if y.dim() == 2 else y.view(-1, y.shape[-1])
        for slot, idx in self.ctx.rows.groups:
            w = self.slots[slot]
            if w is None:
                continue
            at, bt = w
            xs = x2 if idx is None else x2.index_select(0, idx)
            if xs.dtype != at.dtype:
                xs = xs.to(at.dtype)
            shrunk = torch.mm(xs, at)  # [rows, R]
            blocks = self.blocks[slot]
            if blocks is None or shrunk.shape[0] < BLOCK_ROWS:
                if idx is None and y2.dtype == bt.dtype:
                    y2.addmm_(shrunk, bt)
                    continue
                delta = torch.mm(shrunk, bt)
            elif idx is None and y2.dtype == bt.dtype:  # B^T's nonzero blocks only, into y's columns
                for r0, r1, c0, c1 in blocks:
                    y2[:, c0:c1].addmm_(shrunk[:, r0:r1], bt[r0:r1, c0:c1])
                continue
            else:
                delta = shrunk.new_zeros(shrunk.shape[0], bt.shape[1])
                for r0, r1, c0, c1 in blocks:
                    delta[:, c0:c1].addmm_(shrunk[:, r0:r1], bt[r0:r1, c0:c1])
            if idx is None:
                y2.add_(delta.to(y2.dtype))
            else:
                y2.index_add_(0, idx, delta.to(y2.dtype))
        return y


def _check_shapes(info: AdapterInfo, m: ModuleAdapter, p: Piece) -> None:
    """Module `m`'s tensors must be lora_A [rank, in] and lora_B [out, rank] of the base weight the slot's linear
    holds a piece of (p.full). Rank 0 checked the folder against the base checkpoint once, when it was registered
    (check_against_base), but every load reads the files again: one rewritten since must fail its load here, not the
    first step that uses it (on every rank)."""
    out, inp = (p.full[1], p.full[0]) if p.transposed else (p.full[0], p.full[1])
    a, b = info.tensors[m.a].shape, info.tensors[m.b].shape
    if tuple(a) != (m.rank, inp) or tuple(b) != (out, m.rank):
        raise LoraError(f"{info.path!r}: module {m.name!r} has lora_A {list(a)} and lora_B {list(b)}, where this "
                        f"model needs [{m.rank}, {inp}] and [{out}, {m.rank}] (the adapter changed since it was "
                        "checked?)")


def _load_column(lin: ColumnParallelLinear, info: AdapterInfo, files: AdapterFiles, device: torch.device):
    """(A^T, B^T * scale, blocks) of a column-parallel linear: A whole per adapted module, B's rows of each piece;
    blocks: B^T's nonzero blocks when it has several (a fused linear), else None."""
    names = [n for n in dict.fromkeys(p.name for p in lin.pieces) if n in info.modules]
    if not names:
        return None
    for p in lin.pieces:  # (before any read)
        if p.name in info.modules:
            _check_shapes(info, info.modules[p.name], p)
    cols, a_parts = {}, []
    r0 = 0
    for n in names:
        m = info.modules[n]
        a_parts.append(files.read(m.a).float())
        cols[n] = (r0, r0 + m.rank)
        r0 += m.rank
    b = torch.zeros(sum(lin.out_sizes), r0, dtype=torch.float32)
    off = 0
    blocks: list[list[int]] = []
    for p, size in zip(lin.pieces, lin.out_sizes):
        if p.name in cols:
            m = info.modules[p.name]
            c0, c1 = cols[p.name]
            b[off:off + size, c0:c1] = files.read(m.b, 0, [(p.start, p.stop)]).float() * m.scale
            if blocks and blocks[-1][:2] == [c0, c1] and blocks[-1][3] == off:
                blocks[-1][3] = off + size  # the next rows of the same module
            else:
                blocks.append([c0, c1, off, off + size])
        off += size
    whole = len(blocks) == 1 and blocks[0] == [0, r0, 0, off]
    return (torch.cat(a_parts).t().contiguous().to(device), b.t().contiguous().to(device),
            None if whole else [tuple(x) for x in blocks])


def _load_row(lin: RowParallelLinear, info: AdapterInfo, files: AdapterFiles, device: torch.device):
    """(A^T, B^T * scale) of a row-parallel linear: A's columns of this rank's input block, B whole."""
    m = info.modules.get(lin.piece.name)
    if m is None:
        return None
    p = lin.piece
    _check_shapes(info, m, p)
    a = files.read(m.a, 1, [(p.start, p.stop)]).float()  # [r, in_local]
    b = files.read(m.b).float() * m.scale  # [out, r]
    return a.t().contiguous().to(device), b.t().contiguous().to(device), None


def _as_bf16(t: torch.Tensor) -> torch.Tensor:
    """t's values rounded to bfloat16 (to nearest even), kept in float32."""
    return t.to(torch.bfloat16).float()


# ---- the model -----------------------------------------------------------------------------------------------------


def supports_lora(model_cls: type[CausalLM]) -> bool:
    return model_cls.supports_lora


class LoraManager:
    """A model's adapter slots on this rank. Construct it once per rank after the weights are loaded (any format:
    float32, bfloat16, int8/int4/bf16 quantized); then `load(slot, path)` / `unload(slot)` on every rank, with the same
    slot and path on each, between steps. Slots are 1..num_slots; loading into an occupied slot replaces its adapter.

    The rank reads only its byte ranges of the adapter's tensors. `load` checks the folder itself (read_adapter) and
    each tensor's shape against the linear it adapts (the files may have changed since rank 0's `validate_adapter`
    checked them against the base checkpoint, before asking the ranks to load).
    """

    def __init__(self, model: CausalLM, num_slots: int, max_rank: int = 64) -> None:
        if not supports_lora(type(model)):
            raise LoraError(f"LoRA adapters are not supported for {type(model).__name__} yet")
        if num_slots < 1:
            raise ValueError(f"the number of LoRA slots must be at least 1, not {num_slots}")
        self.num_slots, self.max_rank = num_slots, max_rank
        self.ctx = LoraContext()
        model.lora = self.ctx
        self.model = model
        self.columns: list[tuple[ColumnParallelLinear, LoraLinear]] = []
        self.rows: list[tuple[RowParallelLinear, LoraLinear]] = []
        for module in model.modules():
            if isinstance(module, ColumnParallelLinear):
                module.lora = LoraLinear(self.ctx, num_slots, half=not module.float32_base)
                self.columns.append((module, module.lora))
            elif isinstance(module, RowParallelLinear):
                module.lora = LoraLinear(self.ctx, num_slots, half=not module.float32_base)
                self.rows.append((module, module.lora))
        self.device = next(model.parameters()).device
        self.adapters: dict[int, AdapterInfo] = {}  # slot -> what it holds
        self.bytes_read = 0  # by the last load

    def _check_slot(self, slot: int) -> None:
        if not 1 <= slot <= self.num_slots:
            raise ValueError(f"LoRA slot {slot} does not exist (slots are 1 to {self.num_slots}; 0 is the base model)")

    def load(self, slot: int, adapter: str | AdapterInfo) -> AdapterInfo:
        """Read this rank's blocks of the adapter at `adapter` (a local folder, or its read_adapter result) into
        `slot`. Every module the adapter adapts in this rank's layers is placed; modules of other pipeline stages
        are skipped."""
        self._check_slot(slot)
        info = read_adapter(adapter) if isinstance(adapter, str) else adapter
        if info.max_rank > self.max_rank:
            raise LoraError(f"{info.path!r}: rank {info.max_rank} is above the maximum LoRA rank {self.max_rank}")
        loaded: dict[LoraLinear, tuple] = {}
        with AdapterFiles(info) as files:
            for lin, lora in self.columns + self.rows:
                w = (_load_column if isinstance(lin, ColumnParallelLinear) else _load_row)(lin, info, files,
                                                                                          self.device)
                if w is not None:
                    loaded[lora] = (*(_as_bf16(t) for t in w[:2]), w[2]) if lora.half else w
            self.bytes_read = files.bytes_read
        if not loaded and getattr(self.model, "first_stage", True) and getattr(self.model, "last_stage", True):
            # (a pipeline stage may hold none of an adapter's modules: rank 0 checked them against the whole model)
            raise LoraError(f"{info.path!r} adapts none of this model's linears")
        # every read succeeded: swap the slot in at once
        for _, lora in self.columns + self.rows:
            w = loaded.get(lora)
            lora.slots[slot], lora.blocks[slot] = (None, None) if w is None else (w[:2], w[2])
        self.adapters[slot] = info
        self._changed()
        return info

    def _changed(self) -> None:
        self.model.lora_changed()  # e.g. the compiled decode step holds the adapters: rebuilt at its next use

    def unload(self, slot: int) -> None:
        """Free `slot` (its tensors are dropped; steps must no longer name it)."""
        self._check_slot(slot)
        for _, lora in self.columns + self.rows:
            lora.slots[slot] = lora.blocks[slot] = None
        self.adapters.pop(slot, None)
        self._changed()

    def nbytes(self, slot: int | None = None) -> int:
        """Bytes of adapter tensors held on this rank (in `slot`, or in every slot)."""
        total = 0
        for _, lora in self.columns + self.rows:
            for s, w in enumerate(lora.slots):
                if w is not None and (slot is None or s == slot):
                    total += sum(t.numel() * t.element_size() for t in w)
        return total


# ---- the runtime-load command's payload (for the step protocol) --------------------------------------------------


def encode_load(slot: int, path: str, ticket: int = 0) -> torch.Tensor:
    """int64 [3 + ceil(len / 8)]: slot, ticket, byte length, then the path's UTF-8 bytes (a load command's payload:
    each rank decodes it with decode_load, reads its own byte ranges from that local path, and reports how it went
    under the ticket, report_load; ticket 0: no report wanted)."""
    raw = path.encode()
    buf = np.zeros(-(-len(raw) // 8) * 8, dtype=np.uint8)
    buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    head = torch.tensor([slot, ticket, len(raw)], dtype=torch.int64)
    return torch.cat([head, torch.from_numpy(buf.view(np.int64).copy())])


def decode_load(payload: torch.Tensor) -> tuple[int, str, int]:
    """(slot, path, ticket) of encode_load's payload."""
    slot, ticket, n = int(payload[0]), int(payload[1]), int(payload[2])
    raw = payload[3:].numpy().view(np.uint8)[:n].tobytes()
    return slot, raw.decode(), ticket


# ---- a rank's report of a load, through the ranks' store (sharding/store.py), to rank 0 -----------------------------
# A load command travels one way (rank 0 -> the ranks, between steps, its sends not waited for). How each rank fared
# comes back beside the wire, as a key of the store every rank already holds a connection to: rank 0 reads them
# (sharding/executor.py: lora_reports) without blocking while steps of that replica are in flight.

LOAD_OK = "ok"


def load_report_key(ticket: int, rank: int) -> str:
    return f"tpserve/lora-load/{ticket}/{rank}"


def report_load(store, ticket: int, rank: int, error: str | None) -> None:
    """This rank's outcome of load `ticket`: LOAD_OK, or why it could not read its part."""
    if ticket:
        store.set(load_report_key(ticket, rank), LOAD_OK if error is None else (error or "failed")[:2000])
