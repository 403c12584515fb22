"""Rank-0 bookkeeping of the paged KV cache, with automatic prefix caching.

The cache is `num_blocks` fixed-size blocks of `block_size` tokens. Each sequence owns a block table (its block ids in
order); a block may be shared by several sequences, so it carries a refcount. A FULL block whose K/V is written is
registered under a hash-chain key: sha256(key of the previous block + the block's token ids), so a key names the whole
prefix up to the end of that block and a later request with the same prefix can reuse the block instead of recomputing.

A block at refcount 0 sits in the free queue but keeps its contents and hash until it is handed out again (only then
is it evicted from the prefix cache). Blocks without a hash are handed out first, then hashed ones least recently
freed first; a sequence's blocks are queued tail-first, so a shared prefix survives longest.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

_ROOT_HASH = bytes(32)  # the "previous block" key of block 0


def _chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())  # fixed width per token: no two token lists give the same bytes
    return h.digest()


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set while registered in the prefix cache


@dataclass(slots=True)
class _Seq:
    blocks: list[int] = field(default_factory=list)  # the block table
    hashes: list[bytes] = field(default_factory=list)  # chain keys of its first len(hashes) full blocks


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # the free queue, split in two; both are FIFO (first key = next handed out)
        self._free_unhashed: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_hashed: OrderedDict[int, None] = OrderedDict()  # LRU: least recently freed first
        self._cached: dict[bytes, int] = {}  # chain key -> block id
        self._seqs: dict[object, _Seq] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_unhashed) + len(self._free_hashed)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup(self, token_ids: list[int], root: bytes | None = None) -> list[int]:
        """Block ids of the longest cached run of full blocks matching a prefix of token_ids (never the last token).
        `root` starts the chain: a LoRA adapter's own (server/engine/lora_registry.py), so no two adapters share K/V."""
        if not self.enable_prefix_caching:
            return []
        hit: list[int] = []
        parent = root or _ROOT_HASH
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            parent = _chain_hash(parent, token_ids[i * bs:(i + 1) * bs])
            block_id = self._cached.get(parent)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_query_tokens += num_tokens
        self.prefix_hit_tokens += num_hit_tokens

    def allocate(self, key: object, num_tokens: int, computed: list[int] | None = None) -> list[int] | None:
        """Grow `key`'s table to cover num_tokens, taking `computed` cached blocks first; None (no change) if full."""
        computed = computed or []
        seq = self._seqs.get(key)
        table = seq.blocks if seq is not None else []
        if computed and table:
            raise ValueError("computed blocks can only be given on a sequence's first allocation")
        need = self.blocks_needed(num_tokens) - len(table)
        if need <= 0:
            return []
        assert len(computed) <= need and len(set(computed)) == len(computed)
        num_fresh = need - len(computed)
        num_revived = sum(1 for b in computed if self._blocks[b].ref_count == 0)
        if num_fresh + num_revived > self.num_free_blocks:
            return None

        new: list[int] = []
        hashes: list[bytes] = []
        for block_id in computed:
            block = self._blocks[block_id]
            assert block.block_hash is not None, "computed blocks come from lookup"
            if block.ref_count == 0:
                del self._free_hashed[block_id]
            block.ref_count += 1
            new.append(block_id)
            hashes.append(block.block_hash)
        for _ in range(num_fresh):
            new.append(self._pop_free())
        if seq is None:
            seq = self._seqs[key] = _Seq(hashes=hashes)  # the chain keys of the reused blocks are known already
        seq.blocks.extend(new)
        return new

    def _pop_free(self) -> int:
        queue = self._free_unhashed or self._free_hashed
        block_id, _ = queue.popitem(last=False)
        block = self._blocks[block_id]
        assert block.ref_count == 0
        if block.block_hash is not None:  # evicted from the prefix cache now
            assert self._cached[block.block_hash] == block_id
            del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def block_table(self, key: object) -> list[int]:
        seq = self._seqs.get(key)
        return list(seq.blocks) if seq is not None else []

    def cache_blocks(self, key: object, token_ids: list[int], num_computed: int, root: bytes | None = None) -> None:
        """Register the full blocks among the first num_computed tokens that are not registered yet (their chain
        started at `root`, as in lookup)."""
        seq = self._seqs.get(key)
        if not self.enable_prefix_caching or seq is None:
            return
        assert num_computed <= len(token_ids)
        num_full = num_computed // self.block_size
        assert num_full <= len(seq.blocks), "computed tokens beyond the block table"
        bs = self.block_size
        for i in range(len(seq.hashes), num_full):
            parent = seq.hashes[-1] if seq.hashes else (root or _ROOT_HASH)
            block_hash = _chain_hash(parent, token_ids[i * bs:(i + 1) * bs])
            seq.hashes.append(block_hash)
            block = self._blocks[seq.blocks[i]]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block.block_id
            else:  # already registered (a reused block), or a twin block holds this key: leave it be
                assert block.block_hash in (None, block_hash)

    def free(self, key: object) -> None:
        """Drop the sequence's hold on its blocks; those reaching refcount 0 are queued tail-first."""
        seq = self._seqs.pop(key, None)
        if seq is None:
            return
        for block_id in reversed(seq.blocks):
            block = self._blocks[block_id]
            assert block.ref_count > 0
            block.ref_count -= 1
            if block.ref_count == 0:
                queue = self._free_unhashed if block.block_hash is None else self._free_hashed
                queue[block_id] = None

    def reset_prefix_cache(self) -> None:
        """Forget the hashes of all free blocks (blocks in use keep theirs)."""
        while self._free_hashed:
            block_id, _ = self._free_hashed.popitem(last=False)
            block = self._blocks[block_id]
            assert block.block_hash is not None
            del self._cached[block.block_hash]
            block.block_hash = None
            self._free_unhashed[block_id] = None
