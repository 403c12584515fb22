"""The paged KV cache bookkeeping (server.engine.block_manager): allocation, prefix-cache hits, refcounts, eviction order."""

import random

import pytest

import server.engine.block_manager as bm_module
from server.engine.block_manager import BlockManager

BS = 4


def run(bm: BlockManager, key: object, tokens: list[int]) -> list[int]:
    """A request's prefill in one step: look up the prefix, allocate, compute everything, register the full blocks."""
    hit = bm.lookup(tokens)
    assert bm.allocate(key, len(tokens), hit) is not None
    bm.cache_blocks(key, tokens, len(tokens))
    return bm.block_table(key)


def test_fresh_manager_and_growing_tables():
    bm = BlockManager(8, BS)
    assert (bm.num_blocks, bm.block_size, bm.enable_prefix_caching) == (8, BS, True)
    assert bm.num_free_blocks == 8 and bm.usage() == 0.0
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]

    assert bm.allocate("a", 5) == [0, 1]
    assert bm.allocate("a", 8) == []  # already covered
    assert bm.allocate("a", 3) == []
    assert bm.allocate("a", 9) == [2]
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.num_free_blocks == 5 and bm.usage() == pytest.approx(3 / 8)

    # too few blocks: None and nothing changed
    assert bm.allocate("b", 6 * BS) is None
    assert bm.allocate("a", 9 * BS) is None
    assert bm.num_free_blocks == 5
    assert bm.block_table("a") == [0, 1, 2] and bm.block_table("b") == []

    assert bm.allocate("b", 5 * BS) == [3, 4, 5, 6, 7]
    assert bm.num_free_blocks == 0 and bm.usage() == 1.0
    assert bm.allocate("c", 1) is None

    bm.free("a")
    assert bm.num_free_blocks == 3 and bm.block_table("a") == []
    bm.free("a")  # unknown key now: no-op
    bm.free("never-seen")
    assert bm.num_free_blocks == 3


def test_lookup_hits_only_full_cached_blocks_of_a_matching_chain():
    bm = BlockManager(8, BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert run(bm, "a", prompt) == [0, 1, 2]
    bm.free("a")
    free_before = bm.num_free_blocks

    assert bm.lookup(prompt) == [0, 1]
    assert bm.lookup(list(range(8)) + [99]) == [0, 1]
    assert bm.lookup(list(range(6)) + [50, 51, 52]) == [0]  # block 1 only partly shared: no hit for it
    assert bm.lookup(list(range(9))) == [0, 1]
    assert bm.lookup(list(range(8))) == [0]  # fully cached, but the last token must be computed
    assert bm.lookup(list(range(4))) == []
    assert bm.lookup([]) == []
    assert bm.lookup([100] + list(range(1, 10))) == []  # block 0 differs: block 1 (same tokens) can't hit either
    # lookup changes nothing
    assert bm.num_free_blocks == free_before
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (0, 0)


def test_shared_prefix_refcounts():
    bm = BlockManager(6, BS)
    a = list(range(10))
    b = list(range(8)) + [20, 21, 22]
    assert run(bm, "a", a) == [0, 1, 2]
    hit = bm.lookup(b)
    assert hit == [0, 1]
    assert bm.allocate("b", len(b), hit) == [0, 1, 3]
    assert bm.num_free_blocks == 2 and bm.usage() == pytest.approx(4 / 6)

    bm.free("a")  # blocks 0, 1 still used by b; only block 2 comes back
    assert bm.num_free_blocks == 3
    assert bm.lookup(a) == [0, 1]
    new = bm.allocate("c", 3 * BS)
    assert new is not None and not {0, 1} & set(new)
    bm.free("c")

    bm.free("b")
    assert bm.num_free_blocks == 6 and bm.usage() == 0.0
    assert bm.lookup(a) == [0, 1]  # freed, but still cached


def test_eviction_order_unhashed_first_then_lru_tail_first():
    bm = BlockManager(8, BS)
    a, b = list(range(8)), list(range(100, 108))
    assert run(bm, "a", a) == [0, 1]
    assert run(bm, "b", b) == [2, 3]
    assert bm.allocate("c", 3) == [4]  # never registered (partial block)
    bm.free("a")
    bm.free("b")
    bm.free("c")
    assert bm.num_free_blocks == 8

    # unhashed blocks first: never-used ones, then the freed unhashed block 4
    assert bm.allocate("d", 4 * BS) == [5, 6, 7, 4]
    assert bm.lookup(a + [0]) == [0, 1] and bm.lookup(b + [0]) == [2, 3]
    # then a's blocks (freed first), tail first
    assert bm.allocate("d", 5 * BS) == [1]
    assert bm.lookup(a + [0]) == [0]  # the evicted block no longer hits
    assert bm.allocate("d", 6 * BS) == [0]
    assert bm.lookup(a + [0]) == []
    assert bm.lookup(b + [0]) == [2, 3]
    # then b's
    assert bm.allocate("d", 7 * BS) == [3]
    assert bm.lookup(b + [0]) == [2]
    assert bm.allocate("d", 8 * BS) == [2]
    assert bm.lookup(b + [0]) == []
    assert bm.allocate("e", 1) is None


def test_reuse_refreshes_lru_position():
    bm = BlockManager(6, BS)
    a, b = list(range(8)), list(range(100, 108))
    run(bm, "a", a)
    run(bm, "b", b)
    assert bm.allocate("x", 2 * BS) == [4, 5]  # use up the never-used blocks
    bm.free("a")
    bm.free("b")  # LRU: 1, 0 (a, tail first), 3, 2 (b)
    assert run(bm, "a2", a + [1]) == [0, 1, 3]  # hits a's blocks; the last token evicts b's tail
    assert bm.lookup(b + [0]) == [2]
    bm.free("a2")  # a's blocks are now more recent than b's head
    assert bm.allocate("y", BS) == [3]  # unhashed (its hash went when a2 took it)
    assert bm.allocate("y", 2 * BS) == [2]  # b's head: b was freed before a2
    assert bm.lookup(a + [1]) == [0, 1]
    assert bm.allocate("y", 3 * BS) == [1]


def test_computed_blocks_at_refcount_zero_count_against_free_blocks():
    bm = BlockManager(4, BS)
    run(bm, "a", list(range(12)))
    bm.free("a")
    prompt = list(range(12)) + [7]
    hit = bm.lookup(prompt)
    assert hit == [0, 1, 2]
    # 2 fresh blocks would fit in 4 free ones, but the 3 cached blocks leave the free queue too: 5 > 4
    assert bm.allocate("b", 5 * BS, hit) is None
    assert bm.num_free_blocks == 4 and bm.block_table("b") == [] and bm.lookup(prompt) == hit
    assert bm.allocate("b", len(prompt), hit) == [0, 1, 2, 3]
    assert bm.num_free_blocks == 0 and bm.usage() == 1.0
    assert bm.lookup(prompt) == [0, 1, 2]  # in use, still registered
    bm.free("b")
    assert bm.num_free_blocks == 4


def test_computed_blocks_in_use_need_no_free_blocks():
    bm = BlockManager(4, BS)
    run(bm, "a", list(range(12)))
    prompt = list(range(12)) + [7]
    hit = bm.lookup(prompt)
    assert hit == [0, 1, 2] and bm.num_free_blocks == 1
    assert bm.allocate("b", len(prompt), hit) == [0, 1, 2, 3]
    assert bm.num_free_blocks == 0
    bm.free("a")
    assert bm.num_free_blocks == 0  # b holds all four
    bm.free("b")
    assert bm.num_free_blocks == 4


def test_cache_blocks_is_incremental_and_skips_partial_blocks(monkeypatch):
    hashed = []
    real = bm_module._chain_hash
    monkeypatch.setattr(bm_module, "_chain_hash", lambda parent, toks: hashed.append(list(toks)) or real(parent, toks))

    bm = BlockManager(8, BS)
    tokens = list(range(13))
    assert bm.allocate("a", 6) == [0, 1]
    bm.cache_blocks("a", tokens[:6], 3)  # no full block computed yet
    assert hashed == []
    bm.cache_blocks("a", tokens[:6], 6)
    assert hashed == [[0, 1, 2, 3]]
    bm.cache_blocks("a", tokens[:6], 6)  # again: nothing new to hash
    assert hashed == [[0, 1, 2, 3]]
    hashed.clear()
    assert bm.lookup(tokens) == [0]  # block 1 is partial: not registered

    assert bm.allocate("a", 9) == [2]
    hashed.clear()
    bm.cache_blocks("a", tokens[:9], 9)
    assert hashed == [[4, 5, 6, 7]]  # only the new full block; block 2 (token 8 only) stays unregistered
    hashed.clear()
    assert bm.lookup(tokens) == [0, 1]
    bm.cache_blocks("unknown", tokens, 8)  # no-op
    assert bm.lookup(tokens) == [0, 1]


def test_duplicate_block_stays_unregistered():
    bm = BlockManager(8, BS)
    tokens = list(range(8))
    assert bm.allocate("a", 8) == [0, 1]
    assert bm.allocate("b", 8) == [2, 3]  # computed independently (no lookup): same content, same keys
    bm.cache_blocks("a", tokens, 8)
    bm.cache_blocks("b", tokens, 8)
    assert bm.lookup(tokens + [9]) == [0, 1]  # the first registration wins
    bm.free("a")
    bm.free("b")
    # b's blocks hold no hash, so they are reused right after the never-used ones, before a's cached blocks
    assert bm.allocate("c", 6 * BS) == [4, 5, 6, 7, 3, 2]
    assert bm.lookup(tokens + [9]) == [0, 1]


def test_prefix_caching_disabled():
    bm = BlockManager(3, BS, enable_prefix_caching=False)
    tokens = list(range(9))
    assert bm.allocate("a", 8) == [0, 1]
    bm.cache_blocks("a", tokens, 8)
    assert bm.lookup(tokens) == []
    bm.free("a")
    assert bm.num_free_blocks == 3
    assert bm.lookup(tokens) == []
    assert bm.allocate("b", 3 * BS) == [2, 1, 0]
    assert bm.num_free_blocks == 0


def test_record_prefix_query_accumulates():
    bm = BlockManager(2, BS)
    bm.record_prefix_query(10, 8)
    bm.record_prefix_query(5, 0)
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (15, 8)


def test_reset_prefix_cache_forgets_only_free_blocks():
    bm = BlockManager(6, BS)
    a, b = list(range(8)), list(range(100, 108))
    run(bm, "a", a)
    run(bm, "b", b)
    bm.free("a")
    bm.reset_prefix_cache()
    assert bm.lookup(a + [0]) == []
    assert bm.lookup(b + [0]) == [2, 3]  # in use: kept
    assert bm.num_free_blocks == 4
    assert bm.allocate("c", 4 * BS) == [4, 5, 1, 0]  # a's blocks are plain free blocks now


def check_invariants(bm: BlockManager, tables: dict[object, list[int]]) -> None:
    for key, table in tables.items():
        assert bm.block_table(key) == table
    counts = [0] * bm.num_blocks
    for table in tables.values():
        for b in table:
            counts[b] += 1
    blocks = bm._blocks
    assert [blk.ref_count for blk in blocks] == counts
    assert sum(blk.ref_count for blk in blocks) == sum(len(t) for t in tables.values())
    used = sum(c > 0 for c in counts)
    assert bm.num_free_blocks + used == bm.num_blocks
    assert bm.usage() == pytest.approx(used / bm.num_blocks)
    unhashed, hashed = list(bm._free_unhashed), list(bm._free_hashed)
    queued = unhashed + hashed
    assert len(set(queued)) == len(queued) == bm.num_free_blocks
    assert set(queued) == {b for b, c in enumerate(counts) if c == 0}
    assert all(blocks[b].block_hash is None for b in unhashed)
    assert all(blocks[b].block_hash is not None for b in hashed)
    assert bm._cached == {blk.block_hash: blk.block_id for blk in blocks if blk.block_hash is not None}


def test_randomized_invariants_and_cache_contents():
    rng = random.Random(1234)
    bm = BlockManager(16, BS)
    bases = [[rng.randrange(3) for _ in range(14)] for _ in range(3)]
    contents: dict[int, list[int | None]] = {b: [None] * BS for b in range(bm.num_blocks)}  # the "KV" of each block
    seqs: dict[int, tuple[list[int], int]] = {}  # key -> (token ids, number computed)
    tables: dict[object, list[int]] = {}
    next_key = hits = preempted = 0

    for _ in range(400):
        op = rng.random()
        if op < 0.3 or not seqs:  # a new request
            prompt = rng.choice(bases)[:rng.randrange(1, 15)] + [rng.randrange(3) for _ in range(rng.randrange(4))]
            hit = bm.lookup(prompt)
            assert len(hit) <= (len(prompt) - 1) // BS
            for i, b in enumerate(hit):
                assert contents[b] == prompt[i * BS:(i + 1) * BS]
            bm.record_prefix_query(len(prompt), len(hit) * BS)
            hits += bool(hit)
            first = min(len(prompt), len(hit) * BS + rng.randrange(1, 9))  # the first prefill chunk
            new = bm.allocate(next_key, first, hit)
            if new is None:
                assert bm.block_table(next_key) == []
            else:
                assert new[:len(hit)] == hit
                tables[next_key] = list(new)
                seqs[next_key] = (prompt, len(hit) * BS)
            next_key += 1
        elif op < 0.85:  # a step of a running sequence: a prefill chunk or one decode token
            key = rng.choice(list(seqs))
            tokens, done = seqs[key]
            if done == len(tokens):
                tokens.append(rng.randrange(3))
            target = min(len(tokens), done + rng.randrange(1, 9))
            before = list(tables[key])
            new = bm.allocate(key, target)
            if new is None:  # out of blocks: preempt it
                assert bm.block_table(key) == before
                bm.free(key)
                del seqs[key], tables[key]
                preempted += 1
            else:
                tables[key] += new
                for p in range(done, target):  # write K/V: never into a block someone else holds
                    b = tables[key][p // BS]
                    assert sum(t.count(b) for t in tables.values()) == 1
                    contents[b][p % BS] = tokens[p]
                bm.cache_blocks(key, tokens, target)
                seqs[key] = (tokens, target)
                if len(tokens) > 30:
                    bm.free(key)
                    del seqs[key], tables[key]
        elif op < 0.99:  # finished or aborted
            key = rng.choice(list(seqs))
            bm.free(key)
            del seqs[key], tables[key]
        else:
            bm.reset_prefix_cache()
        check_invariants(bm, tables)

    assert hits > 20 and preempted > 0  # the run exercised cache hits and a full cache
    assert bm.prefix_hit_tokens > 0
