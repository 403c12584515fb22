"""One step's description, as rank 0 decides it and every rank receives it.

A step is a flat run of N tokens from S sequences: sequence i owns tokens [offset_i, offset_i + n_i), sits in KV-cache
slot slot_i and starts at position start_i (its cached prefix). Decoding sequences contribute one token, prefilling
ones their whole (remaining) prompt. Logits are computed for each sequence's last token, and for every token of the
sequences listed in `all_logits` (prompt logprobs, for echo).

On the wire: one int64 message of a fixed size known to every rank (`message_size`): a header [cmd, N, S, F], then
the payload ids[N], (slot, n, start)[S], all_logits[F] (sequence indices); positions are derived. Every decode step
fits, so a decode step costs one broadcast; a step whose payload does not fit (a long prefill) sends the payload in a
second broadcast, sized from the header.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CMD_STEP = 1
CMD_SHUTDOWN = 2
CMD_NOOP = 3  # a heartbeat while idle, so waiting ranks can tell a quiet server from a dead one
HEADER = 4


@dataclass(slots=True)
class Step:
    input_ids: torch.Tensor  # [N] int64
    seq_table: torch.Tensor  # [S, 3] int64: slot, n_tokens, start_pos
    all_logits: torch.Tensor | None = None  # [F] int64: sequences that want logits for every token, ascending

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [self.input_ids, self.seq_table.reshape(-1)]
        f = 0 if self.all_logits is None else self.all_logits.numel()
        if f:
            parts.append(self.all_logits)
        header = torch.tensor([CMD_STEP, self.num_tokens, self.seq_table.shape[0], f], dtype=torch.int64)
        return header, torch.cat(parts)

    @staticmethod
    def message_size(max_num_seqs: int) -> int:
        """Header plus the largest decode step's payload: N = S <= max_num_seqs tokens, 3 S, F <= S."""
        return HEADER + 5 * max_num_seqs

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
        return int(header[1]) + 3 * int(header[2]) + int(header[3])

    @staticmethod
    def unpack(header: torch.Tensor, payload: torch.Tensor) -> "Step":
        n, s, f = int(header[1]), int(header[2]), int(header[3])
        return Step(payload[:n], payload[n : n + 3 * s].view(s, 3),
                    payload[n + 3 * s : n + 3 * s + f] if f else None)
