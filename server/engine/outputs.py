"""The two contracts of a step, on rank 0: what the scheduler asks of it, and what it returns, keyed by sequence.

    Scheduler.schedule() -> SchedulerOutput -> .to_step() -> Step (sharding/wire.py) -> the ranks
    the ranks -> logits and pooled rows -> StepOutput.split() -> StepOutput -> Engine (server/engine/core.py)

The rows a step returns are laid out by one rule, `sharding.wire.output_rows`, which the last stage uses to pick
them and `StepOutput.split` uses, entry by entry (`entry_rows`, the same rule in Python ints), to hand them back to
their sequences; nothing else counts rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from server.engine.request import Sequence
from sharding.wire import (HIDDEN_FIRST, HIDDEN_LAST, HIDDEN_SUM, LOGITS_ALL, LOGITS_LAST, SEQ_FIELDS, Step,
                           entry_rows, with_lora)

# an embedding sequence's flags for one chunk of its prompt: the last token's hidden state with the prompt's last
# chunk, the first token's with the chunk from position 0, the sum over every chunk's tokens
POOL_FLAGS: dict[str, Callable[["Scheduled"], int]] = {
    "last": lambda item: HIDDEN_LAST if item.samples else 0,
    "cls": lambda item: HIDDEN_FIRST if item.start == 0 else 0,
    "mean": lambda item: HIDDEN_SUM,
}


@dataclass(slots=True)
class Scheduled:
    """One sequence's part of a step: tokens token_ids[start : start + n]; it samples when they reach its end. A
    decoding sequence may carry draft tokens to verify: they run after its token in the same step, one decode row
    each at the next positions (server/engine/spec_decode/), and are not in token_ids until verified."""

    seq: Sequence
    start: int
    n: int
    drafts: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        return self.start + self.n == len(self.seq.token_ids)

    def flags(self) -> int:
        """What it wants back (sharding/wire.py): a pooled row (an embedding), or logits: of its last token when it
        samples, of every token while its prompt logprobs are owed; and its adapter slot."""
        seq = self.seq
        if seq.pooling is not None:
            flags = POOL_FLAGS[seq.pooling](self)
        else:
            flags = LOGITS_LAST if self.samples else 0
            if seq.wants_prompt_logprobs and self.start <= len(seq.prompt_ids) - 2:
                flags |= LOGITS_ALL
        return with_lora(flags, self.slot)

    @property
    def slot(self) -> int:
        return self.seq.lora.slot if self.seq.lora is not None else 0


@dataclass(slots=True)
class SchedulerOutput:
    """What the scheduler asks of one step: each scheduled sequence's tokens, and the block-table entries that
    changed ((row, index, block): every rank mirrors the table)."""

    items: list[Scheduled]
    block_updates: list[tuple[int, int, int]]

    def to_step(self) -> Step:
        """The step message: per item one entry of the sequence table (row, n, start, flags), then one decode entry
        per draft at the next positions of the same cache row. `StepOutput.split` reads the entries back in the
        same order."""
        ids: list[int] = []
        table: list[tuple[int, int, int, int]] = []
        for item in self.items:
            seq = item.seq
            ids.extend(seq.token_ids[item.start : item.start + item.n])
            table.append((seq.row, item.n, item.start, item.flags()))
            if item.drafts:
                ids.extend(item.drafts)
                table.extend((seq.row, 1, item.start + 1 + j, with_lora(LOGITS_LAST, item.slot))
                             for j in range(len(item.drafts)))
        updates = torch.tensor(self.block_updates, dtype=torch.int64) if self.block_updates else None
        return Step(torch.tensor(ids, dtype=torch.int64),
                    torch.tensor(table, dtype=torch.int64).view(-1, SEQ_FIELDS), updates)


@dataclass(slots=True)
class SeqOutput:
    """One sequence's part of a step's result."""

    rows: range  # its rows of StepOutput.logits, in token order: its chunk's every token (prompt logprobs), or its
    #              last token then one per draft; empty for a prefill chunk that does not sample
    every_token: bool  # rows are every token of its chunk: row j predicts token start + j + 1
    pooled: torch.Tensor | None  # its pooled hidden state of this chunk (an embedding), float32 [hidden]


@dataclass(slots=True)
class StepOutput:
    """A step's result, keyed by sequence id: what each sequence gets back."""

    logits: torch.Tensor  # float32 [rows, vocab], every sequence's rows
    seqs: dict[int, SeqOutput]

    @staticmethod
    def split(batch: SchedulerOutput, step: Step, logits: torch.Tensor, pooled: torch.Tensor | None) -> "StepOutput":
        """Hand the rows back to their sequences, by `entry_rows` (`output_rows` entry by entry) over the step's table
        (built by `to_step`)."""
        table = step.seq_table.tolist()  # (a few entries: Python ints, `entry_rows`)
        seqs: dict[int, SeqOutput] = {}
        entry = row = pooled_at = 0
        for item in batch.items:
            entries = 1 + len(item.drafts)
            count = sum(entry_rows(n, f)[0] for _, n, _, f in table[entry : entry + entries])
            flags = table[entry][3]
            pooled_row = None
            if entry_rows(table[entry][1], flags)[1]:
                pooled_row = pooled[pooled_at]
                pooled_at += 1
            seqs[item.seq.seq_id] = SeqOutput(range(row, row + count), bool(flags & LOGITS_ALL), pooled_row)
            row += count
            entry += entries
        assert row == logits.shape[0] and entry == len(table), "step rows do not match its table"
        return StepOutput(logits, seqs)

    def __getitem__(self, seq: Sequence) -> SeqOutput:
        return self.seqs[seq.seq_id]

    def rows_of(self, seq: Sequence) -> torch.Tensor:
        """The sequence's logits rows (a view)."""
        r = self.seqs[seq.seq_id].rows
        return self.logits[r.start : r.stop]

    def last_rows(self, seqs: list[Sequence]) -> torch.Tensor:
        """[len(seqs), vocab]: each sequence's last row, the one it samples from (the step's logits themselves when
        they are exactly those rows in order: a plain decode step copies nothing)."""
        rows = [self.seqs[s.seq_id].rows[-1] for s in seqs]
        if rows == list(range(self.logits.shape[0])):
            return self.logits
        return self.logits[rows]
