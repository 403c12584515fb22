"""Phi-3: the Llama layout with q/k/v fused into one `qkv_proj` tensor and gate/up fused into one `gate_up_proj`.

Each rank reads its heads' rows of every section of the fused tensor (q at row 0, k after all q rows, v after all
k rows; gate at row 0, up after all gate rows): several pieces of one tensor at different row offsets.
Partial rotary (`partial_rotary_factor`) comes from the shared rotary table.

LongRoPE (Phi-3-*-128k): transformers rotates a whole sequence with the short factors while it fits in
original_max_position_embeddings and re-rotates it with the long factors once it grows past. tpserve's rotary
table is static (short factors), so such a checkpoint is served only with max_model_len <= the original length.
"""

from __future__ import annotations

from sharding.layers.linear import Piece
from sharding.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


def longrope_limit(config) -> int | None:
    """original_max_position_embeddings of a LongRoPE config, past which its frequencies change; None otherwise."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params.get("rope_type", params.get("type")) != "longrope":
        return None
    return params.get("original_max_position_embeddings") or config.original_max_position_embeddings


class Phi3Attention(LlamaAttention):
    def qkv_bias(self, config) -> bool:
        return False

    def qkv_pieces(self, config, prefix: str, heads) -> list[Piece]:
        hd = self.head_dim
        q_rows, kv_rows = self.total_num_heads * hd, self.total_num_kv_heads * hd
        full = (q_rows + 2 * kv_rows, config.hidden_size)
        name = f"{prefix}.qkv_proj"
        return [
            Piece(name, heads.q_start * hd, heads.q_stop * hd, full),
            Piece(name, q_rows + heads.kv_start * hd, q_rows + heads.kv_stop * hd, full),
            Piece(name, q_rows + kv_rows + heads.kv_start * hd, q_rows + kv_rows + heads.kv_stop * hd, full),
        ]


class Phi3MLP(LlamaMLP):
    def gate_up_pieces(self, prefix: str, a: int, b: int, inter: int, hidden: int) -> list[Piece]:
        full = (2 * inter, hidden)
        return [Piece(f"{prefix}.gate_up_proj", a, b, full), Piece(f"{prefix}.gate_up_proj", inter + a, inter + b, full)]


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Phi3Attention
    mlp_cls = Phi3MLP


class Phi3ForCausalLM(LlamaForCausalLM):
    layer_cls = Phi3DecoderLayer

    def __init__(self, config, dist, dtype, device):
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"Phi-3 with hidden_act={config.hidden_act!r} is not supported (only silu)")
        super().__init__(config, dist, dtype, device)

    def check_max_model_len(self, n: int) -> None:
        """A context that LongRoPE would re-rotate with its long factors is refused at start."""
        limit = longrope_limit(self.config)
        if limit is not None and n > limit:
            raise ValueError(
                f"this Phi-3 checkpoint uses LongRoPE, whose long factors apply past original_max_position_embeddings "
                f"({limit}); tpserve applies the short factors only, so max_model_len ({n}) must not exceed {limit}: "
                f"pass --max-model-len {limit} or less")
