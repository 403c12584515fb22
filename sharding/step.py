"""One step's description, as rank 0 decides it and every rank receives it.

A step is a flat run of N tokens from S sequences: sequence i owns tokens [offset_i, offset_i + n_i), sits in KV-cache
slot slot_i and starts at position start_i (its cached prefix). Decoding sequences contribute one token, prefilling
ones their whole (remaining) prompt. Logits are computed only for each sequence's last token.

On the wire it is one int64 tensor: [cmd, N, S, 0] then ids[N], then (slot, n, start)[S]; positions are derived.
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

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        header = torch.tensor([CMD_STEP, self.num_tokens, self.seq_table.shape[0], 0], dtype=torch.int64)
        return header, torch.cat([self.input_ids, self.seq_table.reshape(-1)])

    @staticmethod
    def unpack(header: torch.Tensor, payload: torch.Tensor) -> "Step":
        n, s = int(header[1]), int(header[2])
        return Step(payload[:n], payload[n : n + 3 * s].view(s, 3))
