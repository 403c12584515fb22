"""A step's tokens by LoRA adapter slot, read from the slots in its flags (sharding/wire.py: with_lora).

AttentionMetadata.build makes a step's `LoraRows`; the model's forward puts them in its `LoraContext`, which every
adapted linear (sharding/layers/lora.py) reads. Kept apart from the adapters themselves so that the step's metadata
does not depend on the adapter slots, the checkpoint readers or the models.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sharding.wire import LORA_SHIFT


@dataclass(slots=True)
class LoraRows:
    """A step's tokens by adapter slot: `groups` [(slot, token indices, or None when the slot has every token)],
    slots > 0 only; `token_slots` [N] int64, every token's slot (0: base)."""

    groups: list[tuple[int, torch.Tensor | None]]
    token_slots: torch.Tensor


def lora_rows(flags: torch.Tensor | np.ndarray, ns: torch.Tensor | np.ndarray | None) -> LoraRows | None:
    """The LoraRows of a step whose sequences have these flags and token counts (ns None: one token each), or None
    when no sequence uses an adapter (the common case: one vectorized test)."""
    if isinstance(flags, np.ndarray):
        slots_np = flags >> LORA_SHIFT
        if not slots_np.any():
            return None
        seq_slots = torch.from_numpy(slots_np.copy())
    else:
        seq_slots = flags >> LORA_SHIFT
        if not bool(seq_slots.any()):
            return None
    token_slots = seq_slots if ns is None else seq_slots.repeat_interleave(torch.as_tensor(ns))
    groups = []
    for slot in sorted(set(token_slots.tolist()) - {0}):
        idx = (token_slots == slot).nonzero().squeeze(1)
        groups.append((slot, None if idx.numel() == token_slots.numel() else idx))
    return LoraRows(groups, token_slots)


class LoraContext:
    """The current step's LoraRows, shared by a model's adapted linears (set by the model's forward)."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: LoraRows | None = None


