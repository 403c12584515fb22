"""Continuous batching: which sequences run in the next step.

Every running sequence decodes one token per step; waiting sequences join as soon as a KV-cache slot is free and the
step's token budget allows their prompt (one is always admitted when a slot is free, so a long prompt cannot
starve). Finished or aborted sequences leave between steps and give their slot back at once.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from server.detokenize import IncrementalDetokenizer
from server.sampling import SamplingParams

_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    emit: Callable[["Sequence", str, bool], None]  # (sequence, new text, finished) called from the engine thread
    eos_ids: frozenset[int] = frozenset()
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None  # of prompt tokens 1.. (the first has none), when params ask
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    slot: int = -1
    num_cached: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    aborted: bool = False
    generator: torch.Generator | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def next_input(self) -> tuple[list[int], int]:
        """Token ids to feed this step and the position of the first one."""
        if self.num_cached == 0:
            return self.prompt_ids, 0
        return [self.output_ids[-1]], self.num_cached

    def banned_ids(self) -> list[int]:
        if self.params.ignore_eos or len(self.output_ids) >= self.params.min_tokens:
            return []
        return sorted(self.eos_ids | set(self.params.stop_token_ids))


class Scheduler:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int):
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_num_seqs))
        heapq.heapify(self.free_slots)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        """The sequences of the next step: all running ones, plus waiting ones admitted in arrival order."""
        self.running = [s for s in self.running if not s.finished]
        self.waiting = deque(s for s in self.waiting if not s.finished)
        budget = self.max_num_batched_tokens - len(self.running)
        admitted_any = False
        while self.waiting and self.free_slots:
            seq = self.waiting[0]
            if admitted_any and len(seq.prompt_ids) > budget:
                break
            self.waiting.popleft()
            seq.slot = heapq.heappop(self.free_slots)
            budget -= len(seq.prompt_ids)
            self.running.append(seq)
            admitted_any = True
        # keep the batch in slot order: consecutive slots let attention read the cache without a gather
        self.running.sort(key=lambda s: s.slot)
        return list(self.running)

    def free(self, seq: Sequence) -> None:
        """Give the sequence's slot back (it is finished or aborted)."""
        if seq.slot >= 0:
            heapq.heappush(self.free_slots, seq.slot)
            seq.slot = -1
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
