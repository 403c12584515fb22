"""Phi-3: the Llama layout with q/k/v fused into one `qkv_proj` tensor and gate/up fused into one `gate_up_proj`.

Each rank reads its heads' rows of every section of the fused tensor (q at row 0, k after all q rows, v after all
k rows; gate at row 0, up after all gate rows): several pieces of one tensor at different row offsets.
Partial rotary (`partial_rotary_factor`) comes from the shared rotary table.
"""

from __future__ import annotations

from sharding.layers import Piece
from sharding.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


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
