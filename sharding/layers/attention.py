"""Rotary embeddings, the paged KV cache and attention over it for a mixed prefill/decode step.

The cache of one layer is a pool of fixed-size blocks, allocated once: [2 (K, V), kv_heads, num_blocks, block_size,
head_dim]. A sequence owns a list of blocks (its row of the block table, mirrored on every rank from the step
messages); its token at position p lives in block table[p // block_size] at offset p % block_size ("slot"
block * block_size + offset). Attention metadata (positions, slots, rotary cos/sin, the blocks to read, masks) is
built once per step and shared by every layer.

Decode attention reads the blocks in place through a compiled kernel (sharding/cpu/csrc/paged_attention.cpp) when it
is built; otherwise, and for a prefill chunk after cached tokens, a sequence's blocks are gathered into one
contiguous run (one index_select per layer, K and V together), or viewed when they already are one run in the pool.
scripts/bench_paged_attention.py measures both against the contiguous slot cache this replaced.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sharding.cpu import kernels
from sharding.layers.lora_rows import LoraRows, lora_rows
from sharding.wire import FLAG_BITS, HIDDEN, HIDDEN_FIRST, HIDDEN_SUM, LOGITS_LAST, LORA_SHIFT, Step, output_rows


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, as transformers computes them for this config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type == "dynamic" or rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: default, "
                         f"{', '.join(sorted(k for k in ROPE_INIT_FUNCTIONS if k != 'dynamic'))})")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryTable:
    """cos/sin for every position up to max_len, computed once (float32 products as transformers does)."""

    def __init__(self, config, max_len: int, dtype: torch.dtype, device: torch.device):
        inv_freq, scaling = rope_inv_freq(config)
        pos = torch.arange(max_len, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * scaling).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * scaling).to(dtype=dtype, device=device)
        self.rotary_dim = emb.shape[-1]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim]; cos/sin: [N, rotary_dim]. A partial rotary dim rotates only the leading part."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


_EMPTY = torch.empty(0)  # (no rotary tables)
LEAN_DECODE_MAX = 64  # decode steps of up to this many sequences take AttentionMetadata._build_decode (kernels built)
ROWS_VIEW_MAX = 2048  # steps with prompt chunks: the tokens up to which AttentionMetadata has a view of them as rows


@dataclass(slots=True)
class Prefill:
    token_start: int
    n: int
    start_pos: int
    blocks: torch.Tensor | None  # the sequence's blocks up to start_pos + n; None when it starts at 0 (the step's
    #                              own K/V are all it reads)
    mask: torch.Tensor | None  # [n, start_pos + n] bool, None when plainly causal from position 0
    key_start: int = 0  # first key any query of the chunk sees (> 0 under a sliding window)


@dataclass(slots=True)
class Pool:
    """The step's pooled hidden-state rows (embedding sequences, sharding/wire.py HIDDEN_*): output row rows[t] adds
    the final-normed hidden state of flat token index[t]."""

    index: torch.Tensor  # [T] flat token indices
    rows: torch.Tensor  # [T] their output rows
    num: int  # output rows: one per embedding sequence of the step


def _pool(ends: torch.Tensor, ns: torch.Tensor, flags: torch.Tensor) -> Pool | None:
    """The step's pooled rows: one per entry that `output_rows` gives one, in table order."""
    want = output_rows(ns, flags)[1].nonzero().squeeze(1).tolist()
    if not want:
        return None
    index, rows = [], []
    for r, i in enumerate(want):
        end, n, f = int(ends[i]), int(ns[i]), int(flags[i])
        toks = range(end - n, end) if f & HIDDEN_SUM else [end - n] if f & HIDDEN_FIRST else [end - 1]
        index.extend(toks)
        rows.extend([r] * len(toks))
    return Pool(torch.tensor(index, dtype=torch.int64), torch.tensor(rows, dtype=torch.int64), len(want))


def pooled_rows(x: torch.Tensor, pool: Pool, norm=None) -> torch.Tensor:
    """float32 [pool.num, hidden]: the pooled rows of x (hidden states of every token of the step; `norm` applied
    to the rows taken, when x is not normed yet)."""
    rows = x[pool.index.to(x.device)]
    if norm is not None:
        rows = norm(rows)
    out = torch.zeros(pool.num, rows.shape[-1], dtype=torch.float32, device=rows.device)
    return out.index_add_(0, pool.rows.to(rows.device), rows.float())


def stage_output(x: torch.Tensor, meta: "AttentionMetadata", head, norm=None):
    """The last stage's result from the hidden states x of every token of the step: head(norm(x[rows])) for the
    logits rows, and, when the step has embedding sequences, the pair (logits, pooled rows). `norm` None: x is
    already normed (the decode fast path)."""
    # (a decode step whose every row returns logits: the indices are 0..n-1, and x itself is the rows)
    rows = x if meta.all_decode and meta.logits_indices.numel() == x.shape[0] else x[meta.logits_indices]
    logits = head(rows if norm is None else norm(rows))
    if meta.pool is None:
        return logits
    return logits, pooled_rows(x, meta.pool, norm)


@dataclass(slots=True)
class AttentionMetadata:
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N] where each token's K/V go: block * block_size + offset
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    decode_tokens: torch.Tensor  # [B] indices into the flat tokens
    decode_lens: torch.Tensor  # [B] keys each decoding sequence sees (its position + 1)
    decode_table: torch.Tensor | None  # [B, nblk] the decode batch's blocks (the paged kernel reads through it)
    decode_blocks: torch.Tensor | None  # [B * nblk] the same, flat, for a gather; None with decode_range
    decode_range: tuple[int, int] | None  # when those blocks are exactly range(a, b): a view replaces the gather
    decode_len: int  # keys to look at: max context length over the decode batch
    decode_mask: torch.Tensor | None  # [B, decode_len] bool; None when every row sees all decode_len keys
    prefills: list[Prefill]
    logits_indices: torch.Tensor  # [R] tokens whose logits are computed (see sharding/wire.py: flags)
    all_decode: bool = False  # every token is a decode token, in sequence order (decode_tokens == arange(N))
    window: int | None = None  # the sliding window the masks apply
    seq_parallel: bool = False  # this step runs sequence parallel: between layers a rank holds its tokens only
    write_rows: dict = field(default_factory=dict)  # per cache geometry: flat row of each (token, K/V head)
    pool: Pool | None = None  # embedding sequences' pooled rows, returned beside the logits
    lora: "LoraRows | None" = None  # the tokens of each LoRA adapter slot (sharding/layers/lora.py); None: base rows only
    # a step with prompt chunks seen as decode rows, one per token (on CPU, up to ROWS_VIEW_MAX tokens): each token's
    # sequence's blocks [N, nblk] and the keys it sees [N] (its position + 1). The CPU decode plan runs such a step as
    # it runs a speculative step's verification rows (sharding/cpu/decode_plan.py); None otherwise
    token_table: torch.Tensor | None = None
    token_lens: torch.Tensor | None = None

    @staticmethod
    def build(step: Step, block_table: torch.Tensor, block_size: int, rotary: "RotaryTable | None",
              sliding_window: int | None, device: torch.device) -> "AttentionMetadata":
        """Vectorized over the step's sequences; only prefilling sequences (few per step) loop in Python.
        `block_table` [rows, blocks per sequence] already holds this step's updates."""
        table = step.seq_table
        if (table.shape[0] == step.input_ids.numel() and table.shape[0] <= LEAN_DECODE_MAX and device.type == "cpu"
                and (op := kernels.decode_metadata_op()) is not None):
            return AttentionMetadata._build_decode(op, table, block_table, block_size, rotary, sliding_window)
        rows, ns, starts, flags = table[:, 0], table[:, 1], table[:, 2], table[:, 3]
        n_seqs = table.shape[0]
        ends = ns.cumsum(0)
        is_decode = ns == 1
        all_decode = bool(is_decode.all())
        if all_decode:
            positions, token_rows = starts, rows
            decode_idx = torch.arange(n_seqs)
            decode_tokens = decode_idx
        else:
            offsets = ends - ns
            token_rows = rows.repeat_interleave(ns)
            positions = (starts - offsets).repeat_interleave(ns) + torch.arange(int(ends[-1]))
            decode_idx = is_decode.nonzero().squeeze(1)  # sequence indices
            decode_tokens = offsets[decode_idx]  # their tokens' indices in the flat step
        slots = block_table[token_rows, positions // block_size] * block_size + positions % block_size
        prefills = []
        if not all_decode:
            for i in (~is_decode).nonzero().squeeze(1).tolist():
                row, n, start, _ = table[i].tolist()
                blocks = None
                if start > 0:
                    blocks = block_table[row, : (start + n + block_size - 1) // block_size].to(device)
                prefills.append(Prefill(int(offsets[i]), n, start, blocks, None))
        decode_lens = starts[decode_idx] + 1
        decode_table, decode_blocks, decode_range, decode_len = None, None, None, 0
        if decode_idx.numel():
            decode_len = int(decode_lens.max())
            nblk = (decode_len + block_size - 1) // block_size
            decode_table = block_table[rows[decode_idx], :nblk]
            blocks = decode_table.reshape(-1)
            first = int(blocks[0])
            if bool((blocks == torch.arange(first, first + blocks.numel())).all()):
                decode_range = (first, first + blocks.numel())
            else:
                decode_blocks = blocks.to(device)
            decode_table = decode_table.to(device)
        logits_indices = _logits_indices(ends, ns, flags)
        token_table = token_lens = None
        if not all_decode and device.type == "cpu" and positions.numel() <= ROWS_VIEW_MAX:
            token_lens = positions + 1
            token_table = block_table[token_rows, : (int(token_lens.max()) + block_size - 1) // block_size]
        meta = AttentionMetadata(
            positions=positions.to(device),
            slots=slots.to(device),
            cos=rotary.cos[positions] if rotary is not None else None,
            sin=rotary.sin[positions] if rotary is not None else None,
            decode_tokens=decode_tokens.to(device),
            decode_lens=decode_lens.to(device),
            decode_table=decode_table,
            decode_blocks=decode_blocks,
            decode_range=decode_range,
            decode_len=decode_len,
            decode_mask=None,
            prefills=prefills,
            logits_indices=logits_indices.to(device),
            all_decode=all_decode,
            pool=_pool(ends, ns, flags),
            lora=lora_rows(flags, ns),
            token_table=token_table,
            token_lens=token_lens,
        )
        return meta.windowed(sliding_window)

    @staticmethod
    def _build_decode(op, table: torch.Tensor, block_table: torch.Tensor, block_size: int,
                      rotary: "RotaryTable | None", sliding_window: int | None) -> "AttentionMetadata":
        """`build` for a step of decode tokens only (one per sequence), on CPU: the same fields, the numbers from one
        compiled call (`op`: sharding/cpu/csrc/step_meta.cpp), the flags tested as Python ints, and the window's mask
        made here rather than by `windowed`'s second pass. Each torch or numpy op costs 1-3 us when the host's caches
        are warm, but the step before has just streamed the weights through them: then it is 13-30 us, and the ~30
        ops of this builder in numpy were ~80-160 us of a decode step (BENCHMARKS.md sections 34, 35)."""
        flags = table[:, 3].tolist()
        n_seqs = len(flags)
        positions, slots, lens, decode_table, cos, sin, idx, decode_len, first = op(
            table, block_table, block_size, rotary.cos if rotary is not None else _EMPTY,
            rotary.sin if rotary is not None else _EMPTY)
        if all((f & FLAG_BITS) == LOGITS_LAST for f in flags):
            logits_indices = idx
        else:
            logits_indices = _logits_indices(idx + 1, torch.ones(n_seqs, dtype=torch.int64), table[:, 3])
        return AttentionMetadata(
            positions=positions,
            slots=slots,
            cos=cos if rotary is not None else None,
            sin=sin if rotary is not None else None,
            decode_tokens=idx,
            decode_lens=lens,
            decode_table=decode_table,
            decode_blocks=None if first >= 0 else decode_table.view(-1),
            decode_range=(first, first + decode_table.numel()) if first >= 0 else None,
            decode_len=decode_len,
            decode_mask=_decode_mask(lens, decode_len, sliding_window),
            prefills=[],
            logits_indices=logits_indices,
            all_decode=True,
            window=sliding_window,
            pool=_pool(idx + 1, torch.ones(n_seqs, dtype=torch.int64), table[:, 3])
            if any(f & HIDDEN for f in flags) else None,
            lora=lora_rows(table[:, 3], None) if any(f >> LORA_SHIFT for f in flags) else None,
        )

    def windowed(self, window: int | None) -> "AttentionMetadata":
        """This step's masks with each query limited to the `window` latest keys (itself included), as transformers'
        sliding-window mask: key k is seen from query q when q - window < k <= q. window None: plainly causal.
        Keys sit in position order in the gathered blocks, so a mask over positions is a mask over blocks too."""
        device = self.positions.device
        prefills = []
        for p in self.prefills:
            mask = None
            if p.start_pos > 0 or (window is not None and p.start_pos + p.n > window):
                q = torch.arange(p.start_pos, p.start_pos + p.n, device=device)[:, None]
                k = torch.arange(p.start_pos + p.n, device=device)[None, :]
                mask = k <= q
                if window is not None:
                    mask &= k > q - window
            key_start = max(0, p.start_pos - window + 1) if window is not None else 0
            prefills.append(dataclasses.replace(p, mask=mask, key_start=key_start))
        decode_mask = _decode_mask(self.decode_lens, self.decode_len, window) if self.decode_len else None
        return dataclasses.replace(self, prefills=prefills, decode_mask=decode_mask, window=window)


def _decode_mask(lens: torch.Tensor, decode_len: int, window: int | None) -> torch.Tensor | None:
    """[B, decode_len] bool: the keys each decode row sees (its first lens[b]; with a window, only the `window`
    latest of them), or None when every row sees all decode_len keys (always so for one row: its lens is decode_len)."""
    windowed = window is not None and decode_len > window
    if not windowed and (lens.numel() == 1 or not bool((lens != decode_len).any())):
        return None
    k = torch.arange(decode_len, device=lens.device)[None, :]
    mask = k < lens[:, None]
    if windowed:
        mask &= k >= lens[:, None] - window
    return mask


def _logits_indices(ends: torch.Tensor, ns: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """Flat token indices whose logits the step returns, in the order `output_rows` defines: each entry's rows are
    its last rows_e tokens (all n under LOGITS_ALL, the last one under LOGITS_LAST, none otherwise)."""
    rows_per_seq = output_rows(ns, flags)[0]
    if bool((rows_per_seq == 1).all()):
        return ends - 1
    row_ends = rows_per_seq.cumsum(0)
    return (ends - rows_per_seq - (row_ends - rows_per_seq)).repeat_interleave(rows_per_seq) + torch.arange(
        int(row_ends[-1]) if row_ends.numel() else 0)


class PagedKVCache:
    """K and V of one layer for every block: [2, kv_heads, num_blocks, block_size, head_dim], allocated once."""

    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, pool: torch.Tensor | None = None):
        """`pool`: zeroed memory of `shape(...)` to use (the runner gives every layer a part of one huge-page
        mapping, sharding/cpu/hugepages.py), else a new torch.zeros."""
        self.num_blocks, self.block_size, self.kv_heads, self.head_dim = num_blocks, block_size, kv_heads, head_dim
        shape = self.shape(num_blocks, block_size, kv_heads, head_dim)
        if pool is None:
            pool = torch.zeros(shape, dtype=dtype, device=device)
        assert pool.shape == shape and pool.dtype == dtype
        self.pool = pool

    @staticmethod
    def shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, kv_heads, num_blocks, block_size, head_dim)

    @staticmethod
    def bytes_per_block(block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * kv_heads * block_size * head_dim * dtype.itemsize

    def write(self, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [N, kv_heads, head_dim] for the step's tokens, stored at their slots: one index_copy_ for both, with
        the flat rows computed once per step and geometry."""
        heads, d = self.kv_heads, self.head_dim
        per_head = self.num_blocks * self.block_size
        rows = meta.write_rows.get((heads, per_head))
        if rows is None:
            base = torch.arange(2 * heads, device=k.device)[None, :] * per_head
            rows = meta.write_rows[(heads, per_head)] = (base + meta.slots[:, None]).reshape(-1)
        self.pool.view(-1, d).index_copy_(0, rows, torch.cat([k, v], dim=1).reshape(-1, d))

    def gather(self, blocks: torch.Tensor | None, block_range: tuple[int, int] | None, n_seqs: int, length: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [kv_heads, n_seqs, length, head_dim] of n_seqs sequences whose blocks are `blocks` (row-major,
        the same count for each) or the range `block_range`: a view for a range, else one copy."""
        heads, d = self.kv_heads, self.head_dim
        kv = self.pool.view(2 * heads, self.num_blocks, self.block_size, d)
        if block_range is not None:
            kv = kv[:, block_range[0] : block_range[1]]
        else:
            kv = kv.index_select(1, blocks)
        kv = kv.view(2 * heads, n_seqs, -1, d)[:, :, :length]
        return kv[:heads], kv[heads:]


class GroupedHeads:
    """How local query heads share local KV heads (GQA), prepared once so attention needs no per-step KV copies.

    Query heads of one KV head are contiguous. With uniform groups of g heads, decode queries [B, heads, d] are viewed
    as [B, kv_heads, g, d]: a KV head's g queries become g "query positions" of one attention call over that head's
    keys, so the cache is read in place. With uneven groups (SmolLM2's 9 heads at TP=2: groups of 3 and 2), the groups
    are padded to the largest (padding repeats a head; its output is dropped).
    """

    def __init__(self, kv_for_q: "list[int] | torch.Tensor | None", device: torch.device | None = None):
        if kv_for_q is None:
            self.kv_for_q = None
            self.uniform, self.group = True, 1
            self.q_index = self.out_index = None
            return
        if isinstance(kv_for_q, torch.Tensor):
            kv, device = kv_for_q.tolist(), kv_for_q.device
        else:
            kv = list(kv_for_q)
        self.kv_for_q = torch.tensor(kv, device=device)
        assert kv == sorted(kv), "query heads of one KV head must be contiguous"
        counts = [kv.count(j) for j in range(max(kv) + 1)]
        self.group = max(counts)
        self.uniform = min(counts) == self.group
        self.q_index = self.out_index = None
        if not self.uniform:
            q_index, out_index, first = [], [], 0
            for j, c in enumerate(counts):
                q_index += list(range(first, first + c)) + [first + c - 1] * (self.group - c)
                out_index += [j * self.group + i for i in range(c)]
                first += c
            self.q_index = torch.tensor(q_index, device=device)
            self.out_index = torch.tensor(out_index, device=device)

    @classmethod
    def of(cls, kv_for_q: "torch.Tensor | GroupedHeads | None") -> "GroupedHeads":
        return kv_for_q if isinstance(kv_for_q, GroupedHeads) else cls(kv_for_q)

    def expand(self, kv: torch.Tensor) -> torch.Tensor:
        """[..., kv_heads, T, d] -> [..., heads, T, d] (a copy; prefill uses it)."""
        return kv if self.kv_for_q is None else kv.index_select(-3, self.kv_for_q)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata,
           groups: "GroupedHeads | torch.Tensor | None", scale: float, softcap: float | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Store the step's k, v [N, kv_heads, head_dim] in the cache, then attend with its queries q [N, heads, head_dim].

    groups maps each local query head to its local KV head (GroupedHeads, or the kv_for_q tensor it is made from; None
    when they are the same heads). `sinks` (gpt-oss): float32 [heads], one learned logit per local query head that
    joins every softmax's denominator and attends to nothing (transformers appends it as a last score column and drops
    that column after the softmax). Returns [N, heads * head_dim].
    """
    cache.write(meta, k, v)
    n_tokens, heads, head_dim = q.shape
    gh = GroupedHeads.of(groups)
    out = q.new_empty(n_tokens, heads, head_dim) if not meta.all_decode else None

    for p in meta.prefills:
        a, z = p.token_start, p.token_start + p.n
        if p.blocks is None:  # from position 0: its own keys are all it sees
            ks, vs = k[a:z].transpose(0, 1), v[a:z].transpose(0, 1)
        else:
            ks, vs = cache.gather(p.blocks, None, 1, p.start_pos + p.n)
            ks, vs = ks[:, 0], vs[:, 0]
        mask = p.mask
        if p.key_start:  # a sliding window: keys before the first query's window are never seen
            ks, vs, mask = ks[:, p.key_start :], vs[:, p.key_start :], mask[:, p.key_start :]
        out[a:z] = _prefill_attention(q[a:z].transpose(0, 1), ks, vs, gh, mask, scale, softcap, sinks).transpose(0, 1)

    if meta.decode_len:
        qd = q if meta.all_decode else q[meta.decode_tokens]  # [B, heads, d]
        b, kv_heads = qd.shape[0], cache.kv_heads
        if gh.q_index is not None:
            qd = qd.index_select(1, gh.q_index)
        qd = qd.reshape(b, kv_heads, gh.group, head_dim)
        sd = None
        if sinks is not None:  # laid out as the grouped queries: [kv_heads, group] (padding repeats a head's)
            sd = (sinks if gh.q_index is None else sinks.index_select(0, gh.q_index)).view(kv_heads, gh.group)
        # the compiled kernel (soft-capping and sinks too): float32 queries
        kernel = kernels.paged_decode_attention() if qd.dtype == torch.float32 else None
        if kernel is not None and qd.device.type == "cpu":  # reads the blocks in place
            o = kernel(qd, cache.pool, meta.decode_table, meta.decode_lens, scale, meta.window or 0,
                       None if sd is None else sd.float().contiguous(), softcap or 0.0)
        else:
            kd, vd = cache.gather(meta.decode_blocks, meta.decode_range, b, meta.decode_len)  # [kv, B, T, d]
            o = _decode_attention(qd, kd, vd, meta.decode_mask, scale, softcap, sd)
        o = o.reshape(b, kv_heads * gh.group, head_dim)
        if gh.out_index is not None:
            o = o.index_select(1, gh.out_index)
        if meta.all_decode:
            return o.reshape(n_tokens, heads * head_dim)
        out[meta.decode_tokens] = o
    return out.reshape(n_tokens, heads * head_dim)


# Batched decode attention is two small matmuls per KV head. On CPU, SDPA's fused kernel loops over (batch, head)
# blocks and loses to plain batched matmuls from ~4 sequences on (scripts/bench_paged_attention.py); at 1-3 sequences
# SDPA is faster. float32 only: in bf16 the explicit scores would be rounded to bf16, where SDPA keeps them in float32.
EXPLICIT_DECODE_MIN_BATCH = 4


def _decode_attention(q, k, v, mask, scale, softcap, sinks=None):
    """q [B, kv_heads, group, d] (a KV head's query heads as its "query positions") against k/v [kv_heads, B, T, d];
    mask [B, T] (True = attend) or None; sinks [kv_heads, group] or None. Returns [B, kv_heads, group, d]."""
    b = q.shape[0]
    if softcap is None and sinks is None and (q.dtype != torch.float32 or b < EXPLICIT_DECODE_MIN_BATCH
                                              or q.device.type != "cpu"):
        m = None if mask is None else mask[:, None, None, :]
        return F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=m, scale=scale)
    m = None if mask is None else mask[None, :, None, :]
    s = None if sinks is None else sinks[:, None, :, None]
    return _explicit_attention(q.transpose(0, 1), k, v, m, scale, softcap, s).transpose(0, 1)


def _explicit_attention(q, k, v, mask, scale, softcap, sinks=None):
    """softmax(q k^T * scale [soft-capped], masked) v as plain matmuls; mask: True = attend (broadcastable). sinks:
    one more logit per row of scores (shaped to broadcast against scores[..., :1]), in the softmax only."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)
    scores = scores.float()
    scores = torch.cat([scores, sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)  # as transformers does
    return torch.matmul(torch.softmax(scores, dim=-1)[..., :-1].to(q.dtype), v)


def _flash_with_lse():
    """SDPA's fused CPU kernel (flash attention) as the op that also returns each query's log-sum-exp, or None."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _sink_flash_attention(q, k, v, mask, scale, sinks):
    """Attention with sinks on SDPA's fused CPU kernel: a sink s adds e^s to the softmax's denominator Z and
    nothing to the numerator, so the output without it is scaled by Z / (Z + e^s) = sigmoid(lse - s), lse = log Z
    (which the kernel returns). q [heads, n, d], k/v [heads or uniform KV heads, L, d], mask [n, L] or None."""
    m = None
    if mask is not None:  # the kernel takes an additive mask of the query's dtype
        m = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    out, lse = _flash_with_lse()(q[None], k[None], v[None], 0.0, mask is None, attn_mask=m, scale=scale)
    return out[0].mul_(torch.sigmoid(lse[0] - sinks.float()[:, None]).unsqueeze(-1).to(out.dtype))


def _prefill_attention(q, k, v, gh: GroupedHeads, mask, scale, softcap, sinks=None):
    """q [heads, n, d] over k/v [kv_heads, L, d] (the sequence's keys up to its last query), causal or masked
    (mask [n, L], True = attend). Kept on SDPA's fused CPU kernel (flash attention), which takes only 4-D inputs: 3-D
    ones fall back to the path that materializes the scores (3-8x slower from 600 tokens on). Uniform GQA groups go
    through enable_gqa (no copy); uneven ones (TP not dividing the heads) expand K/V to the query heads. Sinks [heads]
    stay on the fused kernel too (_sink_flash_attention), on CPU; elsewhere they take the explicit path."""
    explicit = softcap is not None or (sinks is not None and (q.device.type != "cpu" or _flash_with_lse() is None))
    gqa = gh.kv_for_q is not None and gh.uniform
    if gh.kv_for_q is not None and (not gh.uniform or explicit):
        k, v = gh.expand(k), gh.expand(v)
        gqa = False
    if explicit:  # soft-capped scores (Gemma 2), or sinks without the CPU kernel's lse: explicit, in blocks
        n, t = q.shape[-2], k.shape[-2]
        if mask is None:
            mask = torch.ones(n, t, dtype=torch.bool, device=q.device).tril(t - n)
        s = None if sinks is None else sinks.view(-1, 1, 1)
        out = q.new_empty(q.shape)
        for a in range(0, n, PREFILL_QUERY_BLOCK):  # bounded memory: a block of queries' scores at a time
            z = min(n, a + PREFILL_QUERY_BLOCK)
            out[:, a:z] = _explicit_attention(q[:, a:z], k, v, mask[a:z], scale, softcap, s)
        return out
    if sinks is not None:  # the kernel maps uniform GQA groups as enable_gqa does
        return _sink_flash_attention(q, k, v, mask, scale, sinks)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
                                          scale=scale, enable_gqa=gqa)[0]


PREFILL_QUERY_BLOCK = 512
