"""One step's description, as rank 0 decides it and every rank receives it.

A step is a flat run of N tokens from S sequences: sequence i owns tokens [offset_i, offset_i + n_i), starts at
position start_i (the tokens before it are in the KV cache) and reads and writes the cache through row_i of the block
table. The block table ([max_num_seqs, blocks per sequence], int64) lives on every rank as a mirror of rank 0's block
manager: a step carries only the entries that changed since the last step, as (row, index, block) triples, and every
rank applies them before the forward. A decoding sequence adds at most one block per step, so a decode step's updates
are at most S.

Per sequence, `flags` say which logits the step returns: LOGITS_LAST for its last token (it samples after this step),
LOGITS_ALL for every one of its tokens (prompt logprobs), neither for a prefill chunk that is not the prompt's last.
An embedding sequence (prefill only) asks for one row of final-normed hidden states instead, pooled over its tokens
of this step: HIDDEN_LAST its last token, HIDDEN_FIRST its first (CLS), HIDDEN_SUM the sum of all of them (mean
pooling over chunks: rank 0 adds the chunks' sums and divides). The last stage returns those rows beside the logits.
The bits of `flags` from LORA_SHIFT up hold the sequence's LoRA adapter slot (0: the base model; sharding/layers/lora.py):
`with_lora(flags, slot)` sets them, `lora_slot(flags)` reads them, `flags & FLAG_BITS` is the rest. A step without
adapter rows is byte-identical to one from before adapters existed.

On the wire: one int64 message of a fixed size known to every rank (`message_size`): a header [cmd, N, S, U], then
the payload ids[N], (row, n, start, flags)[S], (row, index, block)[U]; positions are derived. Every decode step fits,
so a decode step costs one broadcast; a step whose payload does not fit (a prefill, a prefix-cache hit) sends the
payload in a second broadcast, sized from the header. Between steps, commands with a payload of their own (a LoRA
adapter in or out of a slot) travel in the same message (`pack_command`). Rank 0 sends (sharding/executor.py), the
other ranks receive and pass on to their next stage (sharding/worker.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sharding.dist import Dist

CMD_STEP = 1
CMD_SHUTDOWN = 2
CMD_NOOP = 3  # a heartbeat while idle, so waiting ranks can tell a quiet server from a dead one
# commands with a payload of their own between steps (header [cmd, payload size, 0, 0]): a LoRA adapter into a slot
# (the payload: sharding/layers/lora.py encode_load, a slot, a ticket the ranks report under, and a local path each rank
# reads its own byte ranges from) or out
CMD_LORA_LOAD = 4
CMD_LORA_UNLOAD = 5
PAYLOAD_COMMANDS = (CMD_LORA_LOAD, CMD_LORA_UNLOAD)
HEADER = 4

LOGITS_LAST = 1
LOGITS_ALL = 2
HIDDEN_LAST = 4
HIDDEN_SUM = 8
HIDDEN_FIRST = 16
HIDDEN = HIDDEN_LAST | HIDDEN_SUM | HIDDEN_FIRST
LORA_SHIFT = 16  # flags >> LORA_SHIFT: the sequence's LoRA adapter slot, 0 for the base model
FLAG_BITS = (1 << LORA_SHIFT) - 1  # the logits / hidden bits above


def with_lora(flags: int, slot: int) -> int:
    """`flags` with the sequence's adapter slot set (0: the base model)."""
    if slot < 0:
        raise ValueError(f"adapter slot {slot} must be >= 0")
    return (flags & FLAG_BITS) | (slot << LORA_SHIFT)


def lora_slot(flags: int) -> int:
    """The adapter slot a sequence's flags carry (0: the base model)."""
    return flags >> LORA_SHIFT



def output_rows(ns: torch.Tensor, flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The one definition of what a step returns, per entry of its sequence table (n tokens, flags): how many rows
    of logits (n under LOGITS_ALL, its tokens in order; 1 under LOGITS_LAST, its last token; else 0) and of pooled
    hidden states (1 under a HIDDEN_* flag, else 0). Both come back entry after entry in table order. The last stage
    picks its rows by it (sharding/layers/attention.py), rank 0 sizes what it receives by it (sharding/executor.py)
    and splits the rows by sequence by it (server/engine/outputs.py)."""
    logits = torch.where((flags & LOGITS_ALL) != 0, ns, ((flags & LOGITS_LAST) != 0).long())
    return logits, ((flags & HIDDEN) != 0).long()


def entry_rows(n: int, flags: int) -> tuple[int, int]:
    """`output_rows` for one entry, in Python ints: rank 0 splits a step's few entries by it (server/engine/outputs.py),
    where each torch op on a tiny table costs more than the arithmetic (13-30 us right after a step has streamed the
    weights through the caches; BENCHMARKS.md section 34). tests/sharding/test_attention_steps.py holds
    the two to one answer."""
    return (n if flags & LOGITS_ALL else 1 if flags & LOGITS_LAST else 0), (1 if flags & HIDDEN else 0)


SEQ_FIELDS = 4  # row, n_tokens, start_pos, flags
UPDATE_FIELDS = 3  # row, index in the row, block id


@dataclass(slots=True)
class Step:
    input_ids: torch.Tensor  # [N] int64
    seq_table: torch.Tensor  # [S, 4] int64: row, n_tokens, start_pos, flags
    block_updates: torch.Tensor | None = None  # [U, 3] int64: row, index, block id

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def num_logits(self) -> int:
        """Rows of logits the step returns (`output_rows`)."""
        return int(output_rows(self.seq_table[:, 1], self.seq_table[:, 3])[0].sum())

    def num_hidden(self) -> int:
        """Rows of pooled hidden states the step returns (`output_rows`)."""
        return int(output_rows(self.seq_table[:, 1], self.seq_table[:, 3])[1].sum())

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [self.input_ids, self.seq_table.reshape(-1)]
        u = 0 if self.block_updates is None else self.block_updates.shape[0]
        if u:
            parts.append(self.block_updates.reshape(-1))
        header = torch.tensor([CMD_STEP, self.num_tokens, self.seq_table.shape[0], u], dtype=torch.int64)
        return header, torch.cat(parts)

    @staticmethod
    def message_size(max_num_seqs: int) -> int:
        """Header plus the largest decode step's payload: N = S <= max_num_seqs tokens, 4 S, 3 U with U <= S."""
        return HEADER + (1 + SEQ_FIELDS + UPDATE_FIELDS) * max_num_seqs

    def pack_into(self, message: torch.Tensor) -> torch.Tensor | None:
        """Write the step into `message`; returns the payload when it must follow in a second broadcast."""
        header, payload = self.pack()
        message[:HEADER] = header
        if HEADER + payload.numel() <= message.numel():
            message[HEADER : HEADER + payload.numel()] = payload
            return None
        return payload

    @staticmethod
    def payload_size(header: torch.Tensor) -> int:
        return int(header[1]) + SEQ_FIELDS * int(header[2]) + UPDATE_FIELDS * int(header[3])

    @staticmethod
    def unpack(header: torch.Tensor, payload: torch.Tensor) -> "Step":
        n, s, u = int(header[1]), int(header[2]), int(header[3])
        e = n + SEQ_FIELDS * s
        return Step(payload[:n], payload[n:e].view(s, SEQ_FIELDS),
                    payload[e : e + UPDATE_FIELDS * u].view(u, UPDATE_FIELDS) if u else None)


def pack_command(cmd: int, payload: torch.Tensor | None, message_size: int) -> list[torch.Tensor]:
    """A command's message, and its payload as a second one when it does not fit in the first."""
    message = torch.zeros(message_size, dtype=torch.int64)
    n = 0 if payload is None else payload.numel()
    message[:HEADER] = torch.tensor([cmd, n, 0, 0], dtype=torch.int64)
    if n and HEADER + n <= message.numel():
        message[HEADER : HEADER + n] = payload
        return [message]
    return [message] + ([payload.contiguous()] if n else [])


def send_step(dist: Dist, step: Step, message_size: int, dst: int, hidden: torch.Tensor | None,
              isend: bool = False) -> list:
    """The step's message (and payload) to another rank, then the hidden states if any. With `isend`, the
    (work, tensor) pairs to wait for: the tensor stays referenced until its send is waited for."""
    message = torch.empty(message_size, dtype=torch.int64)
    rest = step.pack_into(message)
    parts = [message] + ([rest] if rest is not None else []) + ([hidden.contiguous().cpu()] if hidden is not None
                                                                 else [])
    if isend:
        return [(dist.isend(t, dst), t) for t in parts]
    for t in parts:
        dist.send(t, dst)
    return []
