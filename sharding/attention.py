"""Rotary embeddings, the slot-based KV cache and attention over it for a mixed prefill/decode step.

The cache of one layer is [max_num_seqs, local_kv_heads, max_model_len, head_dim] for K and for V, allocated once.
A sequence owns one slot for its life; its token at position p lives at [slot, :, p]. Attention metadata (positions,
rotary cos/sin, masks) is built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    decode_mask: torch.Tensor | None  # [B, 1, 1, decode_len] bool
    prefills: list[Prefill]
    logits_indices: torch.Tensor  # [S] the last token of each sequence

    @staticmethod
    def build(step: Step, rotary: RotaryTable | None, sliding_window: int | None, device: torch.device
              ) -> "AttentionMetadata":
        table = step.seq_table.tolist()
        positions, slots, decode_tokens, decode_slots, decode_lens, prefills, last = [], [], [], [], [], [], []
        offset = 0
        for slot, n, start in table:
            positions.extend(range(start, start + n))
            slots.extend([slot] * n)
            if n == 1:
                decode_tokens.append(offset)
                decode_slots.append(slot)
                decode_lens.append(start + 1)
            else:
                mask = None
                if start > 0 or (sliding_window is not None and start + n > sliding_window):
                    q = torch.arange(start, start + n)[:, None]
                    k = torch.arange(start + n)[None, :]
                    mask = k <= q
                    if sliding_window is not None:
                        mask &= k > q - sliding_window
                    mask = mask.to(device)
                prefills.append(Prefill(offset, n, slot, start, mask))
            offset += n
            last.append(offset - 1)
        pos_t = torch.tensor(positions, dtype=torch.int64)
        decode_len = max(decode_lens, default=0)
        decode_mask = None
        slot_range = None
        if decode_tokens:
            lens = torch.tensor(decode_lens)
            k = torch.arange(decode_len)[None, :]
            mask = k < lens[:, None]
            if sliding_window is not None:
                mask &= k >= (lens[:, None] - sliding_window)
            decode_mask = mask[:, None, None, :].to(device)
            if decode_slots == list(range(decode_slots[0], decode_slots[0] + len(decode_slots))):
                slot_range = (decode_slots[0], decode_slots[0] + len(decode_slots))
        return AttentionMetadata(
            positions=pos_t.to(device),
            token_slots=torch.tensor(slots, dtype=torch.int64, device=device),
            cos=rotary.cos[pos_t] if rotary is not None else None,
            sin=rotary.sin[pos_t] if rotary is not None else None,
            decode_tokens=torch.tensor(decode_tokens, dtype=torch.int64, device=device),
            decode_slots=torch.tensor(decode_slots, dtype=torch.int64, device=device),
            decode_slot_range=slot_range,
            decode_len=decode_len,
            decode_mask=decode_mask,
            prefills=prefills,
            logits_indices=torch.tensor(last, dtype=torch.int64, device=device),
        )


class KVCache:
    """K and V of one layer for every slot: [max_num_seqs, kv_heads, max_model_len, head_dim] each."""

    def __init__(self, max_num_seqs: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.k = torch.zeros(max_num_seqs, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def write(self, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [N, kv_heads, head_dim] for the step's tokens, stored at (slot, position)."""
        self.k[meta.token_slots, :, meta.positions] = k
        self.v[meta.token_slots, :, meta.positions] = v


def attend(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, kv_for_q: torch.Tensor | None,
           scale: float, softcap: float | None = None) -> torch.Tensor:
    """Attention of the step's queries q [N, heads, head_dim] over the cache (already holding this step's K/V).

    kv_for_q maps each local query head to its local KV head (None when they are the same heads).
    Returns [N, heads * head_dim].
    """
    n_tokens, heads, head_dim = q.shape
    out = torch.empty_like(q)

    def expand(kv: torch.Tensor) -> torch.Tensor:  # [..., kv_heads, T, d] -> [..., heads, T, d]
        return kv if kv_for_q is None else kv.index_select(-3, kv_for_q)

    for p in meta.prefills:
        qs = q[p.token_start : p.token_start + p.n].transpose(0, 1)  # [heads, n, d]
        ks = expand(cache.k[p.slot, :, : p.start_pos + p.n])
        vs = expand(cache.v[p.slot, :, : p.start_pos + p.n])
        o = _sdpa(qs, ks, vs, p.mask, p.mask is None, scale, softcap)
        out[p.token_start : p.token_start + p.n] = o.transpose(0, 1)

    if meta.decode_tokens.numel():
        qd = q[meta.decode_tokens].unsqueeze(2)  # [B, heads, 1, d]
        if meta.decode_slot_range is not None:
            a, b = meta.decode_slot_range
            kd, vd = cache.k[a:b, :, : meta.decode_len], cache.v[a:b, :, : meta.decode_len]
        else:
            kd = cache.k[meta.decode_slots, :, : meta.decode_len]
            vd = cache.v[meta.decode_slots, :, : meta.decode_len]
        o = _sdpa(qd, expand(kd), expand(vd), meta.decode_mask, False, scale, softcap)
        out[meta.decode_tokens] = o.squeeze(2)
    return out.reshape(n_tokens, heads * head_dim)


def _sdpa(q, k, v, mask, causal, scale, softcap):
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    # soft-capped scores (Gemma 2) are not expressible through SDPA: compute them explicitly
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        n, t = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(n, t, dtype=torch.bool, device=q.device).tril(t - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)
