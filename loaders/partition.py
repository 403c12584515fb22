"""Who owns what: the pure arithmetic of splitting heads, MLP columns and vocabulary rows over TP ranks.

Query heads are split contiguously and as evenly as possible (the first `n % tp` ranks get one more). A rank holds
every KV head that one of its query heads attends to, so a KV head is replicated on the ranks that share it. This
rule accepts every TP degree from 1 to the number of query heads: divisible or not, above the KV head count or not.
"""

from __future__ import annotations

from dataclasses import dataclass


def split_evenly(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of block `index` when `n` items are split into `parts` contiguous blocks, sizes differing by <= 1."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"block {index} of {parts} does not exist")
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(slots=True, frozen=True)
class HeadShard:
    """The attention heads one rank owns.

    q_start/q_stop: global query heads; kv_start/kv_stop: global KV heads held (possibly shared with neighbours);
    kv_for_q[i]: the local KV head that local query head i attends to.
    """

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    kv_for_q: tuple[int, ...]

    @property
    def num_heads(self) -> int:
        return self.q_stop - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_stop - self.kv_start

    @property
    def uniform_groups(self) -> bool:
        """True when every local KV head serves the same number of consecutive local query heads."""
        group, rem = divmod(self.num_heads, self.num_kv_heads)
        return rem == 0 and all(kv == i // group for i, kv in enumerate(self.kv_for_q))


def shard_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})")
    if not 1 <= tp_size <= num_heads:
        raise ValueError(
            f"tensor parallel size {tp_size} must be between 1 and the number of attention heads ({num_heads})"
        )
    group = num_heads // num_kv_heads
    q_start, q_stop = split_evenly(num_heads, tp_size, tp_rank)
    kv_start = q_start // group
    kv_stop = (q_stop - 1) // group + 1
    kv_for_q = tuple(h // group - kv_start for h in range(q_start, q_stop))
    return HeadShard(q_start, q_stop, kv_start, kv_stop, kv_for_q)


def stage_layers(num_layers: int, pp_size: int, pp_rank: int, partition: str | None = None) -> tuple[int, int]:
    """[start, stop) of the decoder layers pipeline stage `pp_rank` holds: contiguous, as even as possible (the first
    `num_layers % pp` stages get one more), or as `partition` says ("3,2": 3 layers on stage 0, 2 on stage 1; what
    TPSERVE_PP_LAYER_PARTITION holds, like vLLM's VLLM_PP_LAYER_PARTITION)."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"pipeline parallel size {pp_size} must be between 1 and the number of layers ({num_layers})")
    if not partition:
        return split_evenly(num_layers, pp_size, pp_rank)
    try:
        sizes = [int(x) for x in partition.split(",")]
    except ValueError:
        raise ValueError(f"layer partition {partition!r} must be comma-separated layer counts, e.g. 3,2") from None
    if len(sizes) != pp_size or any(n < 1 for n in sizes) or sum(sizes) != num_layers:
        raise ValueError(f"layer partition {partition!r} must give {pp_size} stage(s) at least one layer each, "
                         f"{num_layers} layers in all")
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]
