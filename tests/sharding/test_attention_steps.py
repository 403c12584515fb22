"""attend() over mixed prefill/decode steps on the paged cache against a naive per-sequence reference (no processes)."""

import math
import random

import pytest
import torch

from sharding.layers.attention import AttentionMetadata, PagedKVCache, attend
from sharding.wire import (HIDDEN, HIDDEN_FIRST, HIDDEN_LAST, HIDDEN_SUM, LOGITS_ALL, LOGITS_LAST, Step, entry_rows,
                           output_rows, with_lora)


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


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request, monkeypatch):
    """Decode attention through the compiled paged kernel (built as `make install` does), or the torch gather."""
    from sharding.cpu import kernels

    if request.param == "kernel":
        assert kernels.build_kernels() and kernels.paged_decode_attention() is not None, "no paged kernel"
    else:
        monkeypatch.setitem(kernels._OPS, "paged", None)
    return request.param


def run_mixed_steps(steps, heads: int, kv_heads: int, d: int, block_size: int, window, attend_step, check,
                    n_rows: int = 6, max_len: int = 32) -> None:
    """Run `steps` (lists of (row, new tokens)) through a paged cache whose blocks are scattered over the pool, as a
    running server's are: attend_step(q, k, v, cache, meta, kv_for_q) -> [tokens, heads, d] for each step, then
    check(out_rows, q_rows, keys, values, msg) per row of the step, with the row's keys/values so far (expanded to
    the query heads)."""
    kv_for_q = None if heads == kv_heads else torch.tensor([h * kv_heads // heads for h in range(heads)])
    num_blocks = n_rows * max_len // block_size
    cache = PagedKVCache(num_blocks, block_size, kv_heads, d, torch.float32, torch.device("cpu"))
    table = torch.zeros(n_rows, max_len // block_size, dtype=torch.int64)
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    history: dict[int, tuple[list, list]] = {}  # row -> per-position k, v
    for entries in steps:
        seq_table, updates, n_total = [], [], 0
        for row, n in entries:
            start = len(history.get(row, ([], []))[0])
            for index in range(-(-start // block_size), -(-(start + n) // block_size)):
                updates.append((row, index, free.pop()))
            seq_table.append((row, n, start, LOGITS_LAST))
            n_total += n
        step = Step(torch.zeros(n_total, dtype=torch.int64), torch.tensor(seq_table, dtype=torch.int64),
                    torch.tensor(updates, dtype=torch.int64) if updates else None)
        if updates:
            u = step.block_updates
            table[u[:, 0], u[:, 1]] = u[:, 2]
        meta = AttentionMetadata.build(step, table, block_size, None, window, torch.device("cpu"))
        q = torch.randn(n_total, heads, d)
        k = torch.randn(n_total, kv_heads, d)
        v = torch.randn(n_total, kv_heads, d)
        out = attend_step(q, k, v, cache, meta, kv_for_q)
        at = 0
        for row, n, start, _ in seq_table:
            hk, hv = history.setdefault(row, ([], []))
            hk.extend(k[at:at + n]); hv.extend(v[at:at + n])
            ks, vs = torch.stack(hk), torch.stack(hv)
            if kv_for_q is not None:
                ks, vs = ks[:, kv_for_q], vs[:, kv_for_q]
            check(out[at:at + n], q[at:at + n], ks, vs, f"row {row} in step {seq_table}")
            at += n


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (3, 1), (5, 2)])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 2.0)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_steps_equal_per_sequence_attention(heads, kv_heads, window, softcap, block_size, decode_path):
    torch.manual_seed(0)
    d = 8
    scale = 1 / math.sqrt(d)
    # steps of (row, n new tokens): prefills join while others decode; row 4 prefills in two chunks (the second one
    # after a cached prefix); the all-decode steps of >= 4 sequences take the batched-matmul path
    steps = [[(0, 5)], [(0, 1), (3, 7)], [(0, 1), (3, 1), (1, 2)], [(1, 1), (3, 1)],
             [(0, 1), (1, 1), (2, 9), (3, 1), (5, 1)], [(0, 1), (2, 1), (5, 1)], [(4, 3), (2, 1)], [(4, 6), (2, 1)],
             [(0, 1), (1, 1), (2, 1), (3, 1), (5, 1)], [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1)],
             [(1, 1), (2, 1), (3, 1), (4, 1)], [(2, 1)]]

    def attend_step(q, k, v, cache, meta, kv_for_q):
        return attend(q, k, v, cache, meta, kv_for_q, scale, softcap=softcap).view(q.shape)

    def check(out, q, ks, vs, msg):
        torch.testing.assert_close(out, naive(q, ks, vs, scale, window, softcap), msg=msg)

    run_mixed_steps(steps, heads, kv_heads, d, block_size, window, attend_step, check)


@pytest.mark.parametrize("window", [None, 6])
def test_decode_steps_build_the_same_metadata_on_the_lean_path(window, monkeypatch):
    """AttentionMetadata for a decode-only step: the lean path (_build_decode, its numbers from the compiled
    decode_metadata op) gives every field the general path gives. Steps of 1-5 sequences at scattered and consecutive
    blocks, equal and unequal lengths, each flag (an embedding's pooled row and an adapter's slot among them)."""
    import dataclasses

    from sharding.cpu import kernels
    from sharding.layers import attention

    op = kernels.decode_metadata_op()
    assert op is not None, "the CPU kernels are built here (make install)"
    calls, lean_max = [], attention.LEAN_DECODE_MAX
    monkeypatch.setattr(kernels, "decode_metadata_op", lambda: lambda *a: calls.append(1) or op(*a))

    class Rotary:
        cos, sin = torch.randn(64, 8), torch.randn(64, 8)

    rng = random.Random(3)
    bs, cpu = 4, torch.device("cpu")
    for trial in range(40):
        n = 1 + trial % 5
        table = torch.tensor([rng.sample(range(100), 8) for _ in range(6)])
        if trial % 4 == 0:  # one sequence over consecutive blocks: the view instead of the gather
            table[2] = torch.arange(20, 28)
        rows = rng.sample(range(6), n) if trial % 4 else [2] * n
        starts = [rng.randrange(0, 30) for _ in rows] if trial % 3 else [17] * n
        flags = [rng.choice([LOGITS_LAST, LOGITS_LAST, 0, LOGITS_ALL | LOGITS_LAST, HIDDEN_LAST | LOGITS_LAST,
                             with_lora(LOGITS_LAST, 2)]) for _ in rows]
        step = Step(torch.zeros(n, dtype=torch.int64),
                    torch.tensor([[r, 1, s, f] for r, s, f in zip(rows, starts, flags)]))
        lean = AttentionMetadata.build(step, table, bs, Rotary, window, cpu)
        assert len(calls) == trial + 1  # (the lean path ran)
        monkeypatch.setattr(attention, "LEAN_DECODE_MAX", 0)
        general = AttentionMetadata.build(step, table, bs, Rotary, window, cpu)
        monkeypatch.setattr(attention, "LEAN_DECODE_MAX", lean_max)
        def same(a, b) -> bool:  # tensors by dtype and value, dataclasses (Pool, LoraRows) field by field
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                return a is not None and b is not None and a.dtype == b.dtype and torch.equal(a, b)
            if dataclasses.is_dataclass(a) and type(a) is type(b):
                return all(same(getattr(a, g.name), getattr(b, g.name)) for g in dataclasses.fields(a))
            if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
                return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
            return a == b

        for f in dataclasses.fields(AttentionMetadata):
            assert same(getattr(lean, f.name), getattr(general, f.name)), f.name
        assert lean.decode_table.is_contiguous() and lean.cos.is_contiguous()


def test_decode_metadata_refuses_a_row_outside_the_block_table():
    """The compiled decode_metadata checks every row against the block table instead of reading past it."""
    from sharding.cpu import kernels

    op = kernels.decode_metadata_op()
    table = torch.zeros(2, 4, dtype=torch.int64)
    for row, start in ((2, 0), (0, 16), (-1, 0)):
        with pytest.raises(RuntimeError, match="outside the block table"):
            op(torch.tensor([[row, 1, start, LOGITS_LAST]]), table, 4, torch.empty(0), torch.empty(0))


def test_decode_over_consecutive_blocks_reads_a_view():
    """One sequence whose blocks are consecutive in the pool is read through a view (no gather), with the same
    result as the gather."""
    torch.manual_seed(1)
    bs, d = 4, 8
    cache = PagedKVCache(16, bs, 2, d, torch.float32, torch.device("cpu"))
    cache.pool.normal_()
    table = torch.tensor([[3, 4, 5, 0]])
    step = Step(torch.zeros(1, dtype=torch.int64), torch.tensor([[0, 1, 10, LOGITS_LAST]]))
    meta = AttentionMetadata.build(step, table, bs, None, None, torch.device("cpu"))
    assert meta.decode_range == (3, 6) and meta.decode_blocks is None
    k_view, v_view = cache.gather(None, meta.decode_range, 1, meta.decode_len)
    k_copy, v_copy = cache.gather(torch.tensor([3, 4, 5]), None, 1, meta.decode_len)
    assert k_view.shape == (2, 1, 11, d) and torch.equal(k_view, k_copy) and torch.equal(v_view, v_copy)
    assert k_view.data_ptr() == cache.pool[0, 0, 3].data_ptr()


def test_logits_rows_follow_the_flags():
    """LOGITS_LAST: the last token's row; LOGITS_ALL: every token's; neither (a mid-prompt chunk): none."""
    table = torch.zeros(4, 8, dtype=torch.int64)
    step = Step(torch.zeros(12, dtype=torch.int64),
                torch.tensor([[0, 1, 5, LOGITS_LAST], [1, 4, 0, 0], [2, 3, 0, LOGITS_ALL | LOGITS_LAST],
                              [3, 4, 8, LOGITS_ALL]]))
    meta = AttentionMetadata.build(step, table, 4, None, None, torch.device("cpu"))
    assert meta.logits_indices.tolist() == [0, 5, 6, 7, 8, 9, 10, 11]


def test_entry_rows_is_output_rows_entry_by_entry():
    """Rank 0 splits a step's rows by `entry_rows` (Python ints), the last stage picks them by `output_rows`
    (tensors): one answer for every flag combination and token count."""
    flags = [a | b for a in (0, LOGITS_LAST, LOGITS_ALL, LOGITS_ALL | LOGITS_LAST)
             for b in (0, HIDDEN_LAST, HIDDEN_FIRST, HIDDEN_SUM, HIDDEN)]
    flags += [with_lora(f, 3) for f in flags]
    for n in (1, 2, 7):
        logits, pooled = output_rows(torch.full((len(flags),), n), torch.tensor(flags))
        assert [entry_rows(n, f) for f in flags] == list(zip(logits.tolist(), pooled.tolist()))


def test_step_message_round_trip():
    """A decode step of up to max_num_seqs sequences, each adding a block, fits the one fixed-size message; a longer
    step's payload follows separately; both unpack to the same step."""
    from sharding.wire import HEADER

    max_seqs = 4
    decode = Step(torch.tensor([5, 6, 7, 8]),
                  torch.tensor([[0, 1, 9, 1], [1, 1, 3, 1], [2, 1, 4, 1], [3, 1, 7, 1]]),
                  torch.tensor([[0, 2, 17], [1, 0, 3], [2, 1, 9], [3, 1, 11]]))
    prefill = Step(torch.arange(30), torch.tensor([[0, 1, 9, 1], [2, 29, 0, 3]]),
                   torch.tensor([[2, i, 40 + i] for i in range(8)]))
    for step, inline in ((decode, True), (prefill, False)):
        message = torch.zeros(Step.message_size(max_seqs), dtype=torch.int64)
        rest = step.pack_into(message)
        assert (rest is None) == inline
        header = message[:HEADER]
        payload = message[HEADER : HEADER + Step.payload_size(header)] if inline else rest
        got = Step.unpack(header, payload)
        assert torch.equal(got.input_ids, step.input_ids) and torch.equal(got.seq_table, step.seq_table)
        assert torch.equal(got.block_updates, step.block_updates)
