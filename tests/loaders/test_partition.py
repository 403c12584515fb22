import pytest

from loaders.partition import shard_heads, split_evenly


@pytest.mark.parametrize("n,parts", [(10, 3), (9, 2), (49152, 5), (7, 7), (3, 1)])
def test_split_evenly_covers_once_with_sizes_within_one(n, parts):
    blocks = [split_evenly(n, parts, i) for i in range(parts)]
    assert blocks[0][0] == 0 and blocks[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    sizes = [b - a for a, b in blocks]
    assert max(sizes) - min(sizes) <= 1


def test_every_head_layout_up_to_16_heads():
    for heads in range(1, 17):
        for kv in (k for k in range(1, heads + 1) if heads % k == 0):
            group = heads // kv
            for tp in range(1, heads + 1):
                owners = [0] * heads
                for rank in range(tp):
                    s = shard_heads(heads, kv, tp, rank)
                    assert s.num_heads >= 1
                    for i, h in enumerate(range(s.q_start, s.q_stop)):
                        owners[h] += 1
                        # the KV head this query head attends to is held locally, at the index kv_for_q says
                        assert s.kv_start <= h // group < s.kv_stop
                        assert s.kv_for_q[i] == h // group - s.kv_start
                    # no KV head is held that no local query head needs
                    assert {h // group for h in range(s.q_start, s.q_stop)} == set(range(s.kv_start, s.kv_stop))
                assert owners == [1] * heads, (heads, kv, tp)


def test_smollm2_at_tp2_is_uneven_and_shares_a_kv_head():
    a, b = shard_heads(9, 3, 2, 0), shard_heads(9, 3, 2, 1)
    assert (a.q_start, a.q_stop, a.kv_start, a.kv_stop) == (0, 5, 0, 2)
    assert (b.q_start, b.q_stop, b.kv_start, b.kv_stop) == (5, 9, 1, 3)
    assert a.kv_for_q == (0, 0, 0, 1, 1) and b.kv_for_q == (0, 1, 1, 1)
    assert not a.uniform_groups


@pytest.mark.parametrize("heads,kv,tp", [(8, 4, 0), (8, 4, 9), (8, 3, 2)])
def test_impossible_layouts_say_why(heads, kv, tp):
    with pytest.raises(ValueError, match="tensor parallel size|multiple of"):
        shard_heads(heads, kv, tp, 0)
