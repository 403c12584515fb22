"""GPT-2: Conv1D weights stored transposed ([in, out]), q/k/v fused in `c_attn`, learned absolute positions,
LayerNorm with bias, GELU MLP, LM head tied to `wte`. Tensor names have no `model.` prefix: `transformer.h.0...` as
GPT2LMHeadModel saves them, or `h.0...` in the original GPT-2 checkpoints (saved from GPT2Model); both are read.

Per layer: ln_1 -> c_attn (column-parallel: each rank reads its heads' columns of the q, k and v sections of the
[hidden, 3*hidden] tensor) -> attention over the KV cache -> c_proj (row-parallel: rows of the [hidden, hidden]
tensor, all-reduce, bias) -> residual -> ln_2 -> c_fc (column-parallel) -> GELU -> c_proj (row-parallel) -> residual.
No rotary: the position table `wpe` is added to the token embeddings at the step's positions.
"""

from __future__ import annotations

import torch
from torch import nn

from loaders.checkpoint import Checkpoint, CheckpointError
from loaders.partition import shard_heads, split_evenly
from sharding.layers.activations import activation
from sharding.layers.attention import AttentionMetadata, PagedKVCache, attend, stage_output
from sharding.dist import Dist
from sharding.layers.linear import ColumnParallelLinear, ParallelLMHead, Piece, RowParallelLinear, VocabParallelEmbedding
from sharding.layers.norms import LayerNorm, PositionEmbedding
from sharding.models.interface import CausalLM


def check_config(config) -> None:
    """Reject GPT-2 variants this file does not implement, naming the setting."""
    if getattr(config, "add_cross_attention", False):
        raise ValueError("GPT-2 checkpoints with cross-attention (add_cross_attention=true) are not supported")
    if getattr(config, "reorder_and_upcast_attn", False):
        raise ValueError("GPT-2 with reorder_and_upcast_attn=true is not supported; set it to false in config.json "
                         "(it only changes the precision of the attention scores) or serve with --dtype float32")


def tensor_prefix(config) -> str:
    """`transformer.` unless the checkpoint names its tensors as GPT2Model does (`wte.weight`, `h.0...`)."""
    try:
        names = Checkpoint(config.name_or_path).tensors
    except (CheckpointError, OSError, TypeError):
        return "transformer."
    return "" if "wte.weight" in names and "transformer.wte.weight" not in names else "transformer."


class GPT2Attention(nn.Module):
    def __init__(self, config, prefix: str, layer_idx: int, dist: Dist, dtype: torch.dtype, device: torch.device):
        super().__init__()
        hidden = config.hidden_size
        self.total_num_heads = config.num_attention_heads
        self.head_dim = hd = hidden // self.total_num_heads
        heads = shard_heads(self.total_num_heads, self.total_num_heads, dist.world_size, dist.rank)
        self.num_heads = self.num_kv_heads = heads.num_heads
        a, b = heads.q_start * hd, heads.q_stop * hd
        full = (hidden, 3 * hidden)  # Conv1D: [in, out], out = q | k | v
        self.c_attn = ColumnParallelLinear(
            hidden, [Piece(f"{prefix}.c_attn", off + a, off + b, full, transposed=True) for off in (0, hidden, 2 * hidden)],
            bias=True, dtype=dtype, device=device)
        self.c_proj = RowParallelLinear(Piece(f"{prefix}.c_proj", a, b, (hidden, hidden), transposed=True), bias=True,
                                        dist=dist, dtype=dtype, device=device)
        self.scale = hd ** -0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            self.scale /= float(layer_idx + 1)
        self.cache: PagedKVCache | None = None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        return self.c_proj(attend(q, k, v, self.cache, meta, None, self.scale))


class GPT2MLP(nn.Module):
    def __init__(self, config, prefix: str, dist: Dist, dtype: torch.dtype, device: torch.device):
        super().__init__()
        hidden = config.hidden_size
        inter = getattr(config, "n_inner", None) or 4 * hidden
        a, b = split_evenly(inter, dist.world_size, dist.rank)
        self.c_fc = ColumnParallelLinear(hidden, [Piece(f"{prefix}.c_fc", a, b, (hidden, inter), transposed=True)],
                                         bias=True, dtype=dtype, device=device)
        self.c_proj = RowParallelLinear(Piece(f"{prefix}.c_proj", a, b, (inter, hidden), transposed=True), bias=True,
                                        dist=dist, dtype=dtype, device=device)
        self.act = activation(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config, prefix: str, layer_idx: int, dist: Dist, dtype: torch.dtype, device: torch.device):
        super().__init__()
        eps, hidden = config.layer_norm_epsilon, config.hidden_size
        self.ln_1 = LayerNorm(f"{prefix}.ln_1", hidden, eps, dtype, device)
        self.attn = GPT2Attention(config, f"{prefix}.attn", layer_idx, dist, dtype, device)
        self.ln_2 = LayerNorm(f"{prefix}.ln_2", hidden, eps, dtype, device)
        self.mlp = GPT2MLP(config, f"{prefix}.mlp", dist, dtype, device)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.attn(self.ln_1(h), meta)
        return h + self.mlp(self.ln_2(h))


class GPT2LMHeadModel(CausalLM):
    uses_rotary = False  # learned absolute positions (wpe)
    supports_sequence_parallel = False
    supports_lora = False

    def __init__(self, config, dist: Dist, dtype: torch.dtype, device: torch.device):
        super().__init__()
        check_config(config)
        self.config = config
        self.dist = dist
        hidden = config.hidden_size
        self.prefix = pre = tensor_prefix(config)
        self.first_stage, self.last_stage = dist.first_stage, dist.last_stage
        self.tied = getattr(config, "tie_word_embeddings", True)
        start, stop = dist.stage_layers(config.num_hidden_layers)
        self.wte = self.wpe = self.ln_f = self.lm_head = None
        if self.first_stage or (self.tied and self.last_stage):  # a tied head on a later stage needs wte's rows
            self.wte = VocabParallelEmbedding(f"{pre}wte.weight", config.vocab_size, hidden, dist, dtype, device)
        if self.first_stage:
            self.wpe = PositionEmbedding(f"{pre}wpe.weight", (config.max_position_embeddings, hidden), dtype, device)
        self.h = nn.ModuleList(GPT2Block(config, f"{pre}h.{i}", i, dist, dtype, device) for i in range(start, stop))
        if self.last_stage:
            self.ln_f = LayerNorm(f"{pre}ln_f", hidden, config.layer_norm_epsilon, dtype, device)
            self.lm_head = ParallelLMHead("lm_head", config.vocab_size, hidden, dist, dtype, device,
                                          self.wte if self.tied else None)

    @property
    def attention_layers(self) -> list[nn.Module]:
        return [block.attn for block in self.h]

    def sliding_window(self) -> int | None:
        return None

    def ignored_tensors(self) -> set[str]:
        """A tied head stored anyway, and the causal-mask buffers old GPT-2 checkpoints carry."""
        ignored = {"lm_head.weight"} if self.tied else set()
        for i in range(self.config.num_hidden_layers):
            ignored |= {f"{self.prefix}h.{i}.attn.bias", f"{self.prefix}h.{i}.attn.masked_bias"}
        return ignored

    def embed(self, ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.wte(ids) + self.wpe(meta.positions)

    def forward(self, ids: torch.Tensor, meta: AttentionMetadata, hidden: torch.Tensor | None = None):
        h = self.embed(ids, meta) if self.first_stage else hidden
        for block in self.h:
            h = block(h, meta)
        if not self.last_stage:
            return h
        return stage_output(h, meta, self.lm_head, self.ln_f)
