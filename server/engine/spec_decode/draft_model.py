"""The draft model of speculative decoding (`"method": "draft_model"`): a smaller checkpoint with the target's
tokenizer, run on rank 0 alone (`draft_tensor_parallel_size` 1) with a paged KV pool of its own.

Each decoding sequence that proposes feeds the draft the tokens it has not seen yet (its prompt the first time, then
what the last verification kept) and lets it decode k tokens greedily; its guesses are the proposal. The draft's cache
keeps its own K/V of every verified token, so it never reads a prompt twice: after a verification that kept `a`
drafts, the draft's tokens up to the first rejected one stay valid, the rest are overwritten next time. The draft's
pool holds as many tokens as the target's (its blocks are smaller: a smaller model), and the proposal is the draft's
argmax, which is a proposal with probability 1: the target's rejection rule (server/engine/step_sampler.py, `_verify`) is exact
for it as for n-gram proposals.
"""

from __future__ import annotations

import heapq
import logging

import torch

from server.engine.block_manager import BlockManager
from sharding.dist import Dist
from sharding.executor import start_executor
from sharding.runner import EngineConfig
from sharding.wire import LOGITS_LAST, Step

logger = logging.getLogger(__name__)


def check_draft(path: str, target_config, target_tokenizer) -> None:
    """The draft must read and write the target's tokens: the same vocabulary, token for token."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"--speculative-config: cannot load the draft model {path!r}: {e}") from None
    if config.vocab_size != target_config.vocab_size or tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"--speculative-config: the draft model {path!r} has another vocabulary than the served "
                         f"model ({config.vocab_size} vs {target_config.vocab_size} ids, or other tokens): its "
                         "proposals would be other tokens")


class DraftModel:
    def __init__(self, path: str, target, tokenizer, rows: int):
        check_draft(path, target.config, tokenizer)
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(path)
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        block_bytes = 2 * c.num_hidden_layers * kv_heads * head_dim * target.block_size * 4
        cfg = EngineConfig(path, max_num_seqs=rows, max_model_len=target.max_model_len, block_size=target.block_size,
                           kv_cache_memory=target.num_blocks * block_bytes)
        self.executor = start_executor(cfg, Dist())  # one rank: every collective is a no-op
        self.blocks = BlockManager(self.executor.num_blocks, self.executor.block_size, enable_prefix_caching=False)
        self.free_rows = list(range(rows))
        self.sent: dict[int, int] = {}  # seq_id -> blocks of its table the executor has been told about

    def _step(self, seq, row: int, ids: list[int], start: int) -> int:
        table = self.blocks.block_table(seq)
        done = self.sent.get(seq.seq_id, 0)
        updates = torch.tensor([(row, i, b) for i, b in enumerate(table[done:], done)], dtype=torch.int64) \
            if len(table) > done else None
        self.sent[seq.seq_id] = len(table)
        step = Step(torch.tensor(ids, dtype=torch.int64), torch.tensor([[row, len(ids), start, LOGITS_LAST]]),
                    updates)
        return int(self.executor.run(step)[0].argmax())

    def propose(self, seq, st, k: int) -> list[int]:
        if st.draft_row < 0:
            if not self.free_rows:
                return []
            st.draft_row = heapq.heappop(self.free_rows)
        tokens = seq.token_ids
        n = len(tokens)
        if self.blocks.allocate(seq, n + k - 1) is None:
            return []  # the draft's pool is full: no proposal this time
        start = min(st.draft_computed, n - 1)
        drafts = [self._step(seq, st.draft_row, tokens[start:], start)]
        for j in range(1, k):
            drafts.append(self._step(seq, st.draft_row, [drafts[-1]], n + j - 1))
        st.draft_computed, st.draft_base = n + k - 1, n
        return drafts

    def verified(self, st, proposed: int, accepted: int) -> None:
        """The kept drafts' K/V stay valid (the same tokens at the same positions), up to the last one fed."""
        st.draft_computed = min(st.draft_computed, st.draft_base + min(accepted, proposed - 1))

    def release(self, seq, st) -> None:
        self.blocks.free(seq)
        self.sent.pop(seq.seq_id, None)
        if st.draft_row >= 0:
            heapq.heappush(self.free_rows, st.draft_row)
            st.draft_row = -1
