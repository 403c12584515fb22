"""Rotary embeddings, the slot-based KV cache and attention over it for a mixed prefill/decode step.

The cache of one layer is [max_num_seqs, local_kv_heads, max_model_len, head_dim] for K and for V, allocated once.
A sequence owns one slot for its life; its token at position p lives at [slot, :, p]. Attention metadata (positions,
rotary cos/sin, masks) is built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sharding.step import Step


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


@dataclass(slots=True)
class Prefill:
    token_start: int
    n: int
    slot: int
    start_pos: int
    mask: torch.Tensor | None  # [n, start_pos + n] bool, None when plainly causal from position 0


@dataclass(slots=True)
class AttentionMetadata:
    positions: torch.Tensor  # [N]
    token_slots: torch.Tensor  # [N]
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    decode_tokens: torch.Tensor  # [B] indices into the flat tokens
    decode_slots: torch.Tensor  # [B]
    decode_slot_range: tuple[int, int] | None  # when the decode slots are exactly range(a, b), a view replaces a gather
    decode_len: int  # keys to look at: max context length over the decode batch
    decode_mask: torch.Tensor | None  # [B, 1, 1, decode_len] bool; None when every row sees all decode_len keys
    prefills: list[Prefill]
    logits_indices: torch.Tensor  # [R] tokens whose logits are computed: each sequence's last one (S), or all of them
    all_decode: bool = False  # every token is a decode token, in sequence order (decode_tokens == arange(N))
    write_rows: dict = field(default_factory=dict)  # per cache geometry: flat row of each (token, kv head)

    @staticmethod
    def build(step: Step, rotary: RotaryTable | None, sliding_window: int | None, device: torch.device
              ) -> "AttentionMetadata":
        """Vectorized over the step's sequences; only prefilling sequences (few per step) loop in Python."""
        table = step.seq_table
        slots, ns, starts = table[:, 0], table[:, 1], table[:, 2]
        n_seqs = table.shape[0]
        ends = ns.cumsum(0)
        is_decode = ns == 1
        all_decode = bool(is_decode.all())
        if all_decode:
            positions, token_slots = starts, slots
            decode_idx = torch.arange(n_seqs)
            decode_tokens = decode_idx
            prefills = []
        else:
            offsets = ends - ns
            token_slots = slots.repeat_interleave(ns)
            positions = (starts - offsets).repeat_interleave(ns) + torch.arange(int(ends[-1]))
            decode_idx = is_decode.nonzero().squeeze(1)  # sequence indices
            decode_tokens = offsets[decode_idx]  # their tokens' indices in the flat step
            prefills = []
            for i in (~is_decode).nonzero().squeeze(1).tolist():
                slot, n, start = table[i].tolist()
                mask = None
                if start > 0 or (sliding_window is not None and start + n > sliding_window):
                    q = torch.arange(start, start + n)[:, None]
                    k = torch.arange(start + n)[None, :]
                    mask = k <= q
                    if sliding_window is not None:
                        mask &= k > q - sliding_window
                    mask = mask.to(device)
                prefills.append(Prefill(int(offsets[i]), n, slot, start, mask))
        decode_len, decode_mask, slot_range = 0, None, None
        decode_slots = slots[decode_idx]
        if decode_idx.numel():
            lens = starts[decode_idx] + 1
            lo, hi = int(lens.min()), int(lens.max())
            decode_len = hi
            windowed = sliding_window is not None and hi > sliding_window
            if lo != hi or windowed:
                k = torch.arange(decode_len)[None, :]
                mask = k < lens[:, None]
                if sliding_window is not None:
                    mask &= k >= (lens[:, None] - sliding_window)
                decode_mask = mask[:, None, None, :].to(device)
            first = int(decode_slots[0])
            if bool((decode_slots == torch.arange(first, first + decode_slots.numel())).all()):
                slot_range = (first, first + decode_slots.numel())
        logits_indices = ends - 1
        if step.all_logits is not None and step.all_logits.numel():
            # whole sequences' logits for the listed ones, the last token's for the others, in sequence order
            want_all = torch.zeros(n_seqs, dtype=torch.bool)
            want_all[step.all_logits] = True
            rows_per_seq = torch.where(want_all, ns, torch.ones_like(ns))
            row_ends = rows_per_seq.cumsum(0)
            first_token = torch.where(want_all, ends - ns, ends - 1)
            logits_indices = (first_token - (row_ends - rows_per_seq)).repeat_interleave(rows_per_seq) \
                + torch.arange(int(row_ends[-1]))
        return AttentionMetadata(
            positions=positions.to(device),
            token_slots=token_slots.to(device),
            cos=rotary.cos[positions] if rotary is not None else None,
            sin=rotary.sin[positions] if rotary is not None else None,
            decode_tokens=decode_tokens.to(device),
            decode_slots=decode_slots.to(device),
            decode_slot_range=slot_range,
            decode_len=decode_len,
            decode_mask=decode_mask,
            prefills=prefills,
            logits_indices=logits_indices.to(device),
            all_decode=all_decode,
        )


class KVCache:
    """K and V of one layer for every slot: [max_num_seqs, kv_heads, max_model_len, head_dim] each."""

    def __init__(self, max_num_seqs: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.k = torch.zeros(max_num_seqs, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def write(self, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [N, kv_heads, head_dim] for the step's tokens, stored at (slot, position).

        One index_copy_ into the flattened cache per tensor; the flat rows are computed once per step and geometry."""
        _, heads, max_len, head_dim = self.k.shape
        rows = meta.write_rows.get((heads, max_len))
        if rows is None:
            base = meta.token_slots[:, None] * heads + torch.arange(heads, device=k.device)[None, :]
            rows = meta.write_rows[(heads, max_len)] = (base * max_len + meta.positions[:, None]).reshape(-1)
        self.k.view(-1, head_dim).index_copy_(0, rows, k.reshape(-1, head_dim))
        self.v.view(-1, head_dim).index_copy_(0, rows, v.reshape(-1, head_dim))


class GroupedHeads:
    """How local query heads share local KV heads (GQA), prepared once so attention needs no per-step KV copies.

    Query heads of one KV head are contiguous. With uniform groups of g heads, decode queries [B, heads, d] are viewed
    as [B, kv_heads, g, d]: a KV head's g queries become g "query positions" of one attention call over that head's
    keys, so the cache is read in place. With uneven groups (SmolLM2's 9 heads at TP=2: groups of 3 and 2), the groups
    are padded to the largest (padding repeats a head; its output is dropped).
    """

    def __init__(self, kv_for_q: torch.Tensor | None):
        self.kv_for_q = kv_for_q
        if kv_for_q is None:
            self.uniform, self.group = True, 1
            self.q_index = self.out_index = None
            return
        kv = kv_for_q.tolist()
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
            self.q_index = torch.tensor(q_index, device=kv_for_q.device)
            self.out_index = torch.tensor(out_index, device=kv_for_q.device)

    _memo: dict[int, "GroupedHeads"] = {}

    @classmethod
    def of(cls, kv_for_q: "torch.Tensor | GroupedHeads | None") -> "GroupedHeads":
        if isinstance(kv_for_q, GroupedHeads):
            return kv_for_q
        key = id(kv_for_q)
        g = cls._memo.get(key)
        if g is None or g.kv_for_q is not kv_for_q:
            g = cls._memo[key] = cls(kv_for_q)
        return g

    def expand(self, kv: torch.Tensor) -> torch.Tensor:
        """[..., kv_heads, T, d] -> [..., heads, T, d] (a copy; only prefill of uneven groups uses it)."""
        return kv if self.kv_for_q is None else kv.index_select(-3, self.kv_for_q)


def attend(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
           kv_for_q: "torch.Tensor | GroupedHeads | None", scale: float, softcap: float | None = None
           ) -> torch.Tensor:
    """Attention of the step's queries q [N, heads, head_dim] over the cache (already holding this step's K/V).

    kv_for_q maps each local query head to its local KV head (None when they are the same heads), as a tensor or
    as GroupedHeads prepared from one. Returns [N, heads * head_dim].
    """
    n_tokens, heads, head_dim = q.shape
    gh = GroupedHeads.of(kv_for_q)
    out = q.new_empty(n_tokens, heads, head_dim) if not meta.all_decode else None

    for p in meta.prefills:
        qs = q[p.token_start : p.token_start + p.n].transpose(0, 1)  # [heads, n, d]
        ks = cache.k[p.slot, :, : p.start_pos + p.n]
        vs = cache.v[p.slot, :, : p.start_pos + p.n]
        if gh.uniform:
            o = _sdpa(qs, ks, vs, p.mask, p.mask is None, scale, softcap, gqa=gh.group > 1)
        else:
            o = _sdpa(qs, gh.expand(ks), gh.expand(vs), p.mask, p.mask is None, scale, softcap)
        out[p.token_start : p.token_start + p.n] = o.transpose(0, 1)

    if meta.decode_tokens.numel():
        qd = q if meta.all_decode else q[meta.decode_tokens]  # [B, heads, d]
        b = qd.shape[0]
        if meta.decode_slot_range is not None:
            a, z = meta.decode_slot_range
            kd, vd = cache.k[a:z, :, : meta.decode_len], cache.v[a:z, :, : meta.decode_len]
        else:
            kd = cache.k[meta.decode_slots, :, : meta.decode_len]
            vd = cache.v[meta.decode_slots, :, : meta.decode_len]
        kv_heads = kd.shape[1]
        if gh.q_index is not None:
            qd = qd.index_select(1, gh.q_index)
        o = _decode_attention(qd.reshape(b, kv_heads, gh.group, head_dim), kd, vd, meta.decode_mask, scale, softcap)
        o = o.reshape(b, kv_heads * gh.group, head_dim)
        if gh.out_index is not None:
            o = o.index_select(1, gh.out_index)
        if meta.all_decode:
            return o.reshape(n_tokens, heads * head_dim)
        out[meta.decode_tokens] = o
    return out.reshape(n_tokens, heads * head_dim)


# Batched decode attention is two small matmuls per KV head. On CPU, SDPA's fused kernel loops over (batch, head)
# blocks and loses to plain batched matmuls from ~4 sequences on (SmolLM2 shapes, 2 threads: 62 vs 32 us at 8
# sequences x 40 keys, 342 vs 205 us at 32 x 150; at 1-2 sequences SDPA is ~15 % faster). float32 only: in bf16 the
# explicit scores would be rounded to bf16, where SDPA keeps them in float32.
EXPLICIT_DECODE_MIN_BATCH = 4


def _decode_attention(q, k, v, mask, scale, softcap):
    """q [B, kv_heads, group, d] against k/v [B, kv_heads, T, d] (views of the cache); mask [B, 1, 1, T] or None."""
    if softcap is None and (q.dtype != torch.float32 or q.shape[0] < EXPLICIT_DECODE_MIN_BATCH
                            or q.device.type != "cpu"):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return _explicit_attention(q, k, v, mask, scale, softcap)


def _explicit_attention(q, k, v, mask, scale, softcap):
    """softmax(q k^T * scale [soft-capped], masked) v as plain matmuls; mask: True = attend (broadcastable)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)


def _sdpa(q, k, v, mask, causal, scale, softcap, gqa=False):
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    # soft-capped scores (Gemma 2) are not expressible through SDPA: compute them explicitly
    if causal:
        n, t = q.shape[-2], k.shape[-2]
        mask = torch.ones(n, t, dtype=torch.bool, device=q.device).tril(t - n)
    return _explicit_attention(q, k, v, mask, scale, softcap)
