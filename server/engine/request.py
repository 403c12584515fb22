"""A request as the engine tracks it: its tokens, its sampling state, its output so far, its place in the cache.

Built by the API's preprocessing (server/api/preprocess.py) or the offline LLM; scheduled by server/engine/scheduler.py,
advanced from each step's output by Scheduler.update_from_output. It lives on rank 0 only: the ranks see rows and
tokens.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.sampler import SamplingParams
from server.engine.structured.grammar import GrammarState

logger = logging.getLogger(__name__)

_ids = itertools.count()

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    emit: Callable[["Sequence", str, bool], None]  # (sequence, new text, finished) called from the engine thread
    eos_ids: frozenset[int] = frozenset()
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + output: every token whose K/V it will need
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None  # of prompt tokens 1.. (the first has none), when params ask
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    status: str = WAITING
    row: int = -1  # its row of the block table while running
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_preemptions: int = 0
    num_cached_prompt: int = 0  # prompt tokens its first admission found in the prefix cache (usage's cached_tokens)
    finish_reason: str | None = None
    error: str | None = None  # why it finished with "error", when that is its own (the client is told)
    generator: torch.Generator | None = None
    grammar: "GrammarState | None" = None  # the output constraint's matcher (server/engine/structured/grammar.py), if any
    lane: int = 0  # the engine lane (replica and in-flight slot) whose scheduler runs it
    pooling: str | None = None  # an embedding sequence (prefill only): "last", "mean" or "cls" (server/api/embeddings.py)
    pooled: torch.Tensor | None = None  # its pooled hidden state: the sum so far under "mean", then the result
    spec: object = None  # its speculation state (server/engine/spec_decode/proposers.py SpecState), when the server speculates
    lora: object = None  # its LoRA adapter (server/engine/lora_registry.py Adapter), None for the base model
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_remaining(self) -> int:
        """Known tokens not yet in the cache: 1 while decoding, more during a prefill (or a recompute)."""
        return len(self.token_ids) - self.num_computed

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It needs the logits of every prompt token (echo + logprobs), so cached blocks cannot stand in for them."""
        return self.params.prompt_logprobs is not None and (
            self.prompt_logprobs is None or len(self.prompt_logprobs) < len(self.prompt_ids) - 1)

    @property
    def computes_every_token(self) -> bool:
        """Cached blocks cannot stand in for its prompt: it needs every prompt token's logits or hidden state."""
        return self.wants_prompt_logprobs or self.pooling in ("mean", "cls")

    def banned_ids(self, ahead: int = 0) -> list[int]:
        """Ids masked out of its next token (`ahead` tokens further on, for a verification row): EOS and the stop
        token ids before min_tokens."""
        if self.params.ignore_eos or len(self.output_ids) + ahead >= self.params.min_tokens:
            return []
        return sorted(self.eos_ids | set(self.params.stop_token_ids))

    def append_token(self, token: int, now: float, max_model_len: int) -> None:
        """A new output token, and whether it ends the sequence: its grammar rejecting it (cannot happen for a token
        the mask allowed; if it does, the answer ends rather than go on unconstrained), EOS, a stop token, a stop
        string, a complete constrained answer, max_tokens or the context length."""
        p = self.params
        self.output_ids.append(token)
        self.token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        if self.grammar is not None and not self.grammar.accept(token):
            logger.error("grammar rejected sampled token %d: %s", token, self.grammar.error)
            self.finish_reason = "stop"
        elif (not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids:
            self.finish_reason = "stop"
        else:
            self.detok.add(token)
            if self.detok.stopped_by is not None or (self.grammar is not None and self.grammar.done):
                self.finish_reason = "stop"
            elif len(self.output_ids) >= p.max_tokens or len(self.token_ids) >= max_model_len:
                self.finish_reason = "length"
