"""Continuous batching over a paged KV cache: which sequences run in the next step, and how many tokens each.

A step has a token budget (`max_num_batched_tokens`). It serves every decoding sequence first (one token each),
then fills the rest with prefill chunks: sequences part-way through their prompt, then waiting ones in arrival order.
A prompt longer than what is left is prefilled over several steps while the other streams keep decoding. While any
sequence decodes, a step's prefill tokens are also capped: on a CPU a prefill token costs a sizeable part of a whole
decode step, so this cap is what bounds the gap a long prompt puts between two tokens of every running stream. By
default the cap comes from what this lane's steps are measured to cost (`StepCosts`): a decode step's time and a
prefill token's added time, so that a step with a chunk lasts about STALL_STEPS decode steps, on whatever CPU and
model; `max_prefill_tokens_while_decoding` set to a number fixes it instead. Deep into a long prompt, where each
token's attention reads thousands of keys, the chunk shrinks in proportion. With nothing decoding, prefill takes the
whole budget.

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
DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING = "auto"  # from the measured step costs (StepCosts)
# the cap before a lane has measured a step with prefill in it
FIRST_PREFILL_CAP = 64
# a step carrying a prefill chunk while others decode lasts about this many decode steps (the gap a long prompt puts
# in a stream, against its usual inter-token time); 2 leaves room for the ~1.8x spells of a host whose speed drifts
# under a 4x bound (BENCHMARKS.md section 26)
STALL_STEPS = 2.0


class StepCosts:
    """What one lane's steps cost, measured as they run: a step of decode tokens only (seconds, a moving average),
    and the seconds a prefill token adds to a step, scaled to depth 0 by the attention-depth rule (a token at depth
    d costs (A + d) / A of one at the start; A: attention_depth_tokens). The cap is the prefill tokens at depth 0 that
    add STALL_STEPS - 1 decode steps; `Scheduler._chunk` shortens it with depth as before."""

    SMOOTH = 0.25  # weight of the newest measurement in the moving averages

    def __init__(self, attention_depth: int | None, budget: int):
        self.attention_depth = attention_depth
        self.budget = budget
        self.decode: float | None = None  # seconds of a decode-only step
        self.per_token: float | None = None  # seconds a prefill token at depth 0 adds to a step

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.SMOOTH * (new - old)

    def weight(self, start: int, n: int) -> float:
        """A chunk of n prompt tokens from position `start`, in tokens at depth 0."""
        if not self.attention_depth:
            return float(n)
        return n * (self.attention_depth + start + n / 2) / self.attention_depth

    def observe(self, decode_rows: int, chunks: list[tuple[int, int]], seconds: float) -> None:
        """One finished step: its decode rows, its prefill chunks (start, n), its wall time."""
        if seconds <= 0:
            return
        weight = sum(self.weight(a, n) for a, n in chunks)
        if not weight:
            if decode_rows:
                self.decode = self._avg(self.decode, seconds)
            return
        if decode_rows and self.decode is not None:
            self.per_token = self._avg(self.per_token, max(seconds - self.decode, 0.0) / weight)
        elif self.per_token is None:  # prefill alone: an upper bound (its weights' streaming counted in)
            self.per_token = seconds / weight

    def cap(self) -> int:
        if self.decode is None or not self.per_token:
            return FIRST_PREFILL_CAP
        tokens = (STALL_STEPS - 1) * self.decode / self.per_token
        return int(max(1, min(self.budget, tokens)))


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
                 max_prefill_tokens_while_decoding: int | str | None = None, attention_depth: int | None = None,
                 first_row: int = 0, max_model_len: int = 1 << 62):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"--max-num-batched-tokens ({max_num_batched_tokens}) must be at least --max-num-seqs "
                             f"({max_num_seqs}): every running sequence decodes one token per step")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # a fixed cap (0 or None: none), or "auto": from this lane's measured step costs
        auto = max_prefill_tokens_while_decoding == "auto"
        self.costs = StepCosts(attention_depth, max_num_batched_tokens) if auto else None
        self.max_prefill_tokens_while_decoding = None if auto else max_prefill_tokens_while_decoding
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
        cap = self.prefill_cap() if decoding else None
        if cap:
            prefill_budget = min(prefill_budget, cap)
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

    def prefill_cap(self) -> int | None:
        """Prefill tokens per step while others decode (at depth 0): fixed, measured, or None (no cap)."""
        return self.costs.cap() if self.costs is not None else self.max_prefill_tokens_while_decoding

    def observe(self, batch: SchedulerOutput, seconds: float) -> None:
        """A finished step's wall time, for the measured cap: decode rows and prefill chunks told apart."""
        if self.costs is None:
            return
        decode_rows, chunks = 0, []
        for item in batch.items:
            if item.n == 1 and item.start >= len(item.seq.prompt_ids):  # (its token is an output token)
                decode_rows += 1 + len(item.drafts)
            else:
                chunks.append((item.start, item.n))
        self.costs.observe(decode_rows, chunks, seconds)

    def _chunk(self, budget: int, depth: int, decoding: int) -> int:
        """Prefill tokens for a sequence whose first `depth` tokens are cached: the budget, shortened while others
        decode by how much more a token costs at that depth (its attention reads `depth` keys)."""
        if budget > 0 and decoding and self.prefill_cap() and self.attention_depth and depth:
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
