"""attend() over mixed prefill/decode steps against a naive per-sequence reference (no processes)."""

import math

import pytest
import torch

from sharding.attention import AttentionMetadata, KVCache, attend
from sharding.step import Step


def naive(q, k_all, v_all, scale, window=None, softcap=None):
    """q [n, H, d] at the last n positions of k_all/v_all [T, H, d], causal."""
    n, t = q.shape[0], k_all.shape[0]
    s = torch.einsum("nhd,thd->hnt", q, k_all) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    qpos = torch.arange(t - n, t)[:, None]
    kpos = torch.arange(t)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hnt,thd->nhd", s.softmax(-1), v_all)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (3, 1)])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 2.0)])
def test_mixed_steps_equal_per_sequence_attention(heads, kv_heads, window, softcap):
    torch.manual_seed(0)
    d, max_len, n_slots = 8, 32, 6
    scale = 1 / math.sqrt(d)
    kv_for_q = None if heads == kv_heads else torch.arange(heads) // (heads // kv_heads)
    cache = KVCache(n_slots, kv_heads, max_len, d, torch.float32, torch.device("cpu"))
    history: dict[int, tuple[list, list]] = {}  # slot -> per-position k, v
    # steps of (slot, n new tokens): prefills join while others decode, in non-consecutive slots
    steps = [[(0, 5)], [(0, 1), (3, 7)], [(0, 1), (3, 1), (1, 2)], [(1, 1), (3, 1)],
             [(0, 1), (1, 1), (2, 9), (3, 1), (5, 1)], [(0, 1), (2, 1), (5, 1)], [(4, 3), (2, 1)],
             # all-decode steps of >= EXPLICIT_DECODE_MIN_BATCH sequences of different lengths (matmul path)
             [(0, 1), (1, 1), (2, 1), (3, 1), (5, 1)], [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1)],
             [(1, 1), (2, 1), (3, 1), (4, 1)]]
    for entries in steps:
        table, n_total = [], 0
        for slot, n in entries:
            start = len(history.get(slot, ([], []))[0])
            table.append((slot, n, start))
            n_total += n
        step = Step(torch.zeros(n_total, dtype=torch.int64), torch.tensor(table, dtype=torch.int64))
        meta = AttentionMetadata.build(step, None, window, torch.device("cpu"))
        q = torch.randn(n_total, heads, d)
        k = torch.randn(n_total, kv_heads, d)
        v = torch.randn(n_total, kv_heads, d)
        cache.write(meta, k, v)
        out = attend(q, cache, meta, kv_for_q, scale, softcap=softcap).view(n_total, heads, d)
        at = 0
        for slot, n, start in table:
            hk, hv = history.setdefault(slot, ([], []))
            hk.extend(k[at:at + n]); hv.extend(v[at:at + n])
            ks, vs = torch.stack(hk), torch.stack(hv)
            if kv_for_q is not None:
                ks, vs = ks[:, kv_for_q], vs[:, kv_for_q]
            ref = naive(q[at:at + n], ks, vs, scale, window, softcap)
            torch.testing.assert_close(out[at:at + n], ref, msg=f"slot {slot} in step {table}")
            at += n


def test_step_message_round_trip():
    """A decode step of up to max_num_seqs sequences fits the one fixed-size message; a longer step's payload
    follows separately; both unpack to the same step."""
    from sharding.step import HEADER

    max_seqs = 4
    decode = Step(torch.tensor([5, 6, 7, 8]), torch.tensor([[0, 1, 9], [1, 1, 3], [2, 1, 4], [3, 1, 7]]),
                  torch.tensor([0, 1, 2, 3]))
    prefill = Step(torch.arange(30), torch.tensor([[0, 1, 9], [2, 29, 0]]), torch.tensor([1]))
    for step, inline in ((decode, True), (prefill, False)):
        message = torch.zeros(Step.message_size(max_seqs), dtype=torch.int64)
        rest = step.pack_into(message)
        assert (rest is None) == inline
        header = message[:HEADER]
        payload = message[HEADER : HEADER + Step.payload_size(header)] if inline else rest
        got = Step.unpack(header, payload)
        assert torch.equal(got.input_ids, step.input_ids) and torch.equal(got.seq_table, step.seq_table)
        assert torch.equal(got.all_logits, step.all_logits)
