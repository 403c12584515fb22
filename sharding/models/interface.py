"""What a model provides to the runner (sharding/runner.py) and to the layers that act on a whole model (LoRA slots,
the launcher's checks), declared once: every class in sharding.models.MODELS derives from `CausalLM`, says what
differs from the defaults below as class attributes or overrides, and implements the abstract members
(tests/test_layout.py checks both).

A model is this rank's part: its TP shard of its pipeline stage's layers. `forward(ids, meta, hidden)` takes token ids
(first stage) or the previous stage's hidden states and returns hidden states for the next stage, or on the last
stage the float32 logits (full vocabulary, on the stage's TP rank 0; None on its other ranks), with the pooled rows of
embedding sequences beside them when a step asks for some (sharding/layers/attention.py stage_output).

What the CPU decode plan asks of a decoder layer is declared beside the plan (sharding/cpu/decode_plan.py:
`PlanLayer`); Llama's layers declare it (sharding/models/llama.py).
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from sharding.dist import Dist
    from sharding.layers.attention import AttentionMetadata, PagedKVCache
    from sharding.layers.lora_rows import LoraContext


class AttentionLayer(Protocol):
    """What the runner reads of each attention layer to size and place the KV cache (it sets `cache`)."""

    num_kv_heads: int  # this rank's
    head_dim: int
    cache: PagedKVCache | None


class CausalLM(nn.Module, metaclass=ABCMeta):
    config: PretrainedConfig
    dist: Dist
    first_stage: bool
    last_stage: bool

    has_experts: bool = False  # MoE layers whose experts --enable-expert-parallel can split over the TP group
    uses_rotary: bool = True  # the runner builds the rotary table (GPT-2 has learned positions instead)
    supports_sequence_parallel: bool = False  # --sequence-parallel: its layers split the token axis (Megatron SP)
    supports_lora: bool = False  # every linear of its layers is a column- or row-parallel one (sharding/layers/lora.py)
    lora: LoraContext | None = None  # set by sharding.layers.lora.LoraManager; each step's adapter rows go through it

    @property
    @abstractmethod
    def attention_layers(self) -> list[AttentionLayer]:
        """This rank's attention layers, in order: one KV cache each."""

    @abstractmethod
    def sliding_window(self) -> int | None:
        """The window every layer attends within (the runner's metadata), or None: causal for every layer (a model
        whose layers differ narrows the metadata itself)."""

    @abstractmethod
    def ignored_tensors(self) -> set[str]:
        """Checkpoint tensors that are fine to skip (a tied head stored anyway)."""

    @abstractmethod
    def forward(self, ids: torch.Tensor, meta: AttentionMetadata, hidden: torch.Tensor | None = None):
        """See the module's docstring."""

    def check_max_model_len(self, n: int) -> None:
        """Refuse, at start, a max_model_len this model cannot serve (beyond what max_position_embeddings says)."""

    def lora_changed(self) -> None:
        """An adapter was loaded or unloaded (sharding/layers/lora.py): drop whatever holds the adapters' tensors."""
