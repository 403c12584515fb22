"""Continuous batching over a paged KV cache: which sequences run in the next step, and how many tokens each.

A step has a token budget (`max_num_batched_tokens`). It serves every decoding sequence first (one token each),
then fills the rest with prefill chunks: sequences part-way through their prompt, then waiting ones in arrival order.
A prompt longer than what is left is prefilled over several steps while the other streams keep decoding. While any
sequence decodes, a step's prefill tokens are also capped at `max_prefill_tokens_while_decoding`: on a CPU a prefill
token costs about as much as a whole decode step's weight streaming, so this cap is what bounds the gap a long prompt
puts between two tokens of every running stream; deep into a long prompt, where each token's attention reads
thousands of keys, the cap shrinks in proportion. With nothing decoding, prefill takes the whole budget.

Blocks come from the block manager (server/engine/block_manager.py). A waiting sequence starts with the longest run of
cached full blocks that matches its tokens (automatic prefix caching) and computes the rest. When a running sequence
needs a block and none is free, the most recently admitted sequences are preempted: their blocks are freed (kept in
the prefix cache until evicted), they go back to the front of the queue, and they are recomputed later with their
generated tokens as part of the prompt, so their output does not change.

Each running sequence also holds a row of the block table that every rank mirrors (sharding/wire.py); the step
message carries the (row, index, block) entries that changed.

After the step, `update_from_output` advances its sequences: the computed tokens' full blocks join the prefix cache,
the new tokens are appended (server/engine/step_sampler.py chose them) and their stops applied, embeddings take their
pooled rows, and a finished sequence gives back its blocks and row.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from typing import Callable

from server.engine.block_manager import BlockManager
from server.engine.outputs import Scheduled, SchedulerOutput, StepOutput
from server.engine.request import FINISHED, RUNNING, WAITING, Sequence
from server.engine.step_sampler import NewTokens


# Tokens per step (--max-num-batched-tokens): decoding sequences first, then prefill chunks; large enough that a
# prefill with nothing else running goes at full speed. While sequences decode, a step's prefill tokens are capped
# (--max-prefill-tokens-while-decoding) so a long prompt arriving keeps every stream's inter-token gap within a few
# decode steps (BENCHMARKS.md, "A long prompt arrives").
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING = 64


def attention_depth_tokens(config) -> int | None:
    """The context length at which one token's attention costs as many multiply-adds as its linears (a Llama-shaped
    layer: q/k/v/o and a gated MLP against 2 x heads x head_dim per cached key). SmolLM2-135M: ~3100 tokens."""
    try:
        h, inter = config.hidden_size, config.intermediate_size
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        d = getattr(config, "head_dim", None) or h // heads
    except AttributeError:
        return None
    linears = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * inter
    return max(1, linears // (2 * heads * d))


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, blocks: BlockManager,
                 max_prefill_tokens_while_decoding: int | None = None, attention_depth: int | None = None,
                 first_row: int = 0, max_model_len: int = 1 << 62):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"--max-num-batched-tokens ({max_num_batched_tokens}) must be at least --max-num-seqs "
                             f"({max_num_seqs}): every running sequence decodes one token per step")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens_while_decoding = max_prefill_tokens_while_decoding
        # the context length at which a token's attention costs as much as its linears (attention_depth_tokens):
        # a chunk deep into a long prompt is shortened so that its step stays about as long as one near the start
        self.attention_depth = attention_depth
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: preemption takes from the end
        self.free_rows = list(range(first_row, first_row + max_num_seqs))  # its rows of the block table
        self.num_preemptions = 0
        # speculative decoding: (sequence, running sequences, token budget left) -> draft tokens (Speculator.drafts_for)
        self.propose: Callable[[Sequence, int, int], list[int]] | None = None
        # LoRA: (waiting sequence, running sequences) -> whether it may join the batch now: its adapter in a slot and
        # no more than --max-loras adapters in one step (LoraSlots.admit); one that may not keeps its place
        self.admit: Callable[[Sequence, list[Sequence]], bool] | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        """The next step: every decoding sequence, then prefill chunks within the token budget."""
        self.running = [s for s in self.running if not s.finished]
        self.waiting = deque(s for s in self.waiting if not s.finished)
        updates: list[tuple[int, int, int]] = []
        items: list[Scheduled] = []
        decoding = sum(1 for s in self.running if s.num_remaining == 1)
        prefill_budget = self.max_num_batched_tokens - decoding  # decoders' tokens are set aside first
        if decoding and self.max_prefill_tokens_while_decoding:
            prefill_budget = min(prefill_budget, self.max_prefill_tokens_while_decoding)
        preempted = False
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            is_decode = seq.num_remaining == 1
            n = 1 if is_decode else min(seq.num_remaining, self._chunk(prefill_budget, seq.num_computed, decoding))
            if n <= 0:
                i += 1
                continue
            while not self._grow(seq, seq.num_computed + n, updates):
                victim = self.running[-1]  # the most recently admitted
                preempted = True
                if victim.num_remaining == 1 and victim is not seq:
                    prefill_budget += 1  # its reserved decode token is free again
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status != RUNNING:  # it preempted itself: nothing later in `running` is left either
                break
            if not is_decode:
                prefill_budget -= n
            drafts: list[int] = []
            if is_decode and self.propose is not None and prefill_budget > 0:  # drafts spend the prefill budget
                drafts = self.propose(seq, len(self.running), prefill_budget)
                if drafts and self._grow(seq, seq.num_computed + 1 + len(drafts), updates):
                    prefill_budget -= len(drafts)
                else:
                    drafts = []  # no block for them: no preemption for the sake of a guess
            items.append(Scheduled(seq, seq.num_computed, n, drafts))
            i += 1
        # admit waiting sequences while rows, budget and blocks allow (none after a preemption: blocks are short)
        held: list[Sequence] = []  # waiting ones `admit` turned down this step: they keep their places
        while self.waiting and not preempted and self.free_rows and prefill_budget > 0:
            seq = self.waiting.popleft()
            if seq.lora is not None and self.admit is not None and not self.admit(seq, self.running):
                if not seq.finished:
                    held.append(seq)
                continue
            computed: list[int] = []
            root = seq.lora.cache_root if seq.lora is not None else None
            if self.blocks.enable_prefix_caching and not seq.computes_every_token:
                computed = self.blocks.lookup(seq.token_ids, root)
            num_cached = len(computed) * self.blocks.block_size
            n = min(len(seq.token_ids) - num_cached, self._chunk(prefill_budget, num_cached, decoding))
            new = self.blocks.allocate(seq, num_cached + n, computed)
            if new is None:
                self.waiting.appendleft(seq)
                break  # wait for blocks; running sequences are never preempted for a waiting one
            self.blocks.record_prefix_query(len(seq.token_ids), num_cached)
            seq.status, seq.row, seq.num_computed = RUNNING, heapq.heappop(self.free_rows), num_cached
            if not seq.num_preemptions:
                seq.num_cached_prompt = num_cached
            self.running.append(seq)
            self._record(seq, new, updates)
            prefill_budget -= n
            items.append(Scheduled(seq, num_cached, n))
        self.waiting.extendleft(reversed(held))
        return SchedulerOutput(items, updates)

    def _chunk(self, budget: int, depth: int, decoding: int) -> int:
        """Prefill tokens for a sequence whose first `depth` tokens are cached: the budget, shortened while others
        decode by how much more a token costs at that depth (its attention reads `depth` keys)."""
        if budget > 0 and decoding and self.max_prefill_tokens_while_decoding and self.attention_depth and depth:
            return max(1, budget * self.attention_depth // (self.attention_depth + depth))
        return budget

    def _grow(self, seq: Sequence, num_tokens: int, updates: list) -> bool:
        new = self.blocks.allocate(seq, num_tokens)
        if new is None:
            return False
        self._record(seq, new, updates)
        return True

    def _record(self, seq: Sequence, new: list[int], updates: list) -> None:
        if new:
            first = len(self.blocks.block_table(seq)) - len(new)
            updates.extend((seq.row, first + j, b) for j, b in enumerate(new))

    def _preempt(self, seq: Sequence) -> None:
        """Free its blocks and row; it is recomputed from the front of the queue later (same output)."""
        self.running.remove(seq)
        self._release(seq)
        seq.status, seq.num_computed = WAITING, 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        if seq.row >= 0:
            heapq.heappush(self.free_rows, seq.row)
            seq.row = -1

    def update_from_output(self, batch: SchedulerOutput, out: StepOutput,
                           new: dict[int, NewTokens]) -> list[Sequence]:
        """After the step: the scheduled tokens are in the cache, and their full blocks join the prefix cache (not
        for a sequence aborted while its step was in flight: its blocks are gone). Each sequence's new tokens are
        appended until one ends it; drafts the model agreed with are kept, and their K/V (written by this step)
        count as computed. An embedding adds this chunk's pooled row; its last chunk finishes it. Finished
        sequences give back their blocks and row. Returns the sequences that advanced, for the engine to stream."""
        for item in batch.items:
            seq = item.seq
            if seq.status == RUNNING:
                seq.num_computed = item.start + item.n
                self.blocks.cache_blocks(seq, seq.token_ids, seq.num_computed,
                                         seq.lora.cache_root if seq.lora is not None else None)
        now = time.monotonic()
        advanced: list[Sequence] = []
        for item in batch.items:
            seq = item.seq
            if seq.finished:
                continue
            if seq.pooling is not None:
                self._pool(item, out[seq].pooled, now)
            elif (got := new.get(seq.seq_id)) is not None:
                for j, token in enumerate(got.tokens):
                    seq.append_token(token, now, self.max_model_len)
                    if seq.params.logprobs is not None:
                        seq.token_logprobs.append(got.logprobs[j])
                        seq.top_logprobs.append(got.top_logprobs[j])
                    if seq.finished or j == len(item.drafts) or token != item.drafts[j]:
                        break
                    got.accepted += 1
                seq.num_computed += got.accepted
            else:
                continue
            if seq.finished:
                self.free(seq)
                advanced.append(seq)
            elif seq.pooling is None:
                advanced.append(seq)
        return advanced

    @staticmethod
    def _pool(item: Scheduled, row, now: float) -> None:
        """An embedding sequence's pooled row of this step: its last (or first) token's hidden state, or under
        "mean" the sum over the chunk's tokens, added up over chunks (a chunk from position 0 starts it anew: a
        sequence recomputed after a preemption counts every token once). Its last chunk finishes it ("cls": the
        first token's row came with an earlier chunk)."""
        seq = item.seq
        if row is not None:
            if seq.pooling == "mean" and item.start > 0 and seq.pooled is not None:
                seq.pooled += row
            else:
                seq.pooled = row.clone()
        if item.samples:
            if seq.pooling == "mean":
                seq.pooled /= len(seq.prompt_ids)
            seq.finish_reason = "stop"
            seq.first_token_time = seq.last_token_time = now

    def free(self, seq: Sequence) -> None:
        """The sequence is finished or aborted: give its blocks and row back."""
        if seq.status == RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status == WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = FINISHED
