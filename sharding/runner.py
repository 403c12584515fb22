"""What every rank runs: build the model, load this rank's shard, allocate the KV cache, execute steps.

`start_rank` gives each rank its `ModelRunner`. Rank 0 drives it through the Executor (sharding/executor.py), which
sends every step's description to the other ranks before executing it; ranks > 0 execute the same steps as they
arrive (sharding/worker.py).

The KV cache is a pool of blocks sized from a memory budget (`--kv-cache-memory`, or a share of the memory left after
the weights); every rank gets the same number of blocks (the smallest any rank can afford), because rank 0's block
manager hands out block ids that every rank uses.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import torch

from loaders.checkpoint import Checkpoint, CheckpointError
from loaders.config import load_config
from loaders.gguf_file import open_checkpoint
from sharding.cpu import hugepages, kernels
from sharding.layers.attention import AttentionMetadata, PagedKVCache, RotaryTable
from sharding.dist import Dist, Layout
from sharding.layers import quant
from sharding.layers.interface import Loadable, Packable, ReadElsewhere
from sharding.layers.linear import ParallelLMHead
from sharding.models import model_class
from sharding.models.interface import CausalLM
from sharding.progress import LoadProgress, StartPhases
from sharding.quant_cache import QuantCache
from sharding.wire import Step

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from sharding.layers.lora import LoraManager

logger = logging.getLogger(__name__)

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(slots=True)
class EngineConfig:
    """What every rank must agree on to build the same model and cache. Declared once: the worker's command line is
    generated from these fields (`to_argv`) and parsed back (`from_argv`)."""

    model: str
    dtype: str = "auto"
    max_num_seqs: int = 32  # caps the running batch; reserves nothing
    max_model_len: int | None = None  # None: min(max_position_embeddings, 2048)
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_memory: int | None = None  # bytes of KV cache per rank; None: see default_kv_budget
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the device's memory this process may use in all
    pipeline_parallel_size: int = 1  # stages per replica
    data_parallel_size: int = 1  # replicas (the TP degree is what is left of the world)
    sequence_parallel: bool = False  # prefill steps split the token axis between layers (Megatron SP)
    quantization: str | None = None  # weight-only int8 / int4 linears (sharding/layers/quant.py)
    quantization_group_size: int = 32  # int4: inputs per scale
    quantized_cache: bool = True  # --quantization: keep each rank's quantized linears on disk (sharding/quant_cache.py)
    enable_expert_parallel: bool = False  # MoE: each TP rank owns whole experts instead of a slice of each
    enable_lora: bool = False  # LoRA adapter slots on every linear (sharding/layers/lora.py)
    max_cpu_loras: int = 1  # adapters kept loaded at once: the slots
    max_lora_rank: int = 16

    def layout(self, world_size: int) -> Layout:
        pp, dp = self.pipeline_parallel_size, self.data_parallel_size
        if world_size % (pp * dp):
            raise ValueError(f"world size {world_size} is not a multiple of pipeline x data parallel size ({pp} x {dp})")
        return Layout(world_size // (pp * dp), pp, dp)

    def to_argv(self) -> list[str]:
        argv = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                argv += ["--" + f.name.replace("_", "-"), str(value)]
        return argv

    @classmethod
    def from_argv(cls, argv: list[str]) -> "EngineConfig":
        import argparse

        ap = argparse.ArgumentParser(prog="tpserve-worker")
        for f in fields(cls):
            kind = {"int": int, "float": float, "bool": lambda v: v == "True"}.get(str(f.type).split(" ")[0], str)
            ap.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, required=f.name == "model")
        return cls(**{k: v for k, v in vars(ap.parse_args(argv)).items() if v is not None})


# CPU: the share of the memory available after every rank has loaded its weights that the KV cache may take (split
# among the ranks of the host). The rest is for activations, the tokenizer, the HTTP server and the OS.
KV_CPU_MEMORY_SHARE = 0.5


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the physical memory reported by os.sysconf."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_kv_budget(cfg: EngineConfig, dist: Dist) -> int:
    """Bytes of KV cache for this rank when --kv-cache-memory is not given."""
    if dist.device.type == "cuda":  # vLLM's rule: this process may use gpu_memory_utilization of the device in all
        free, total = torch.cuda.mem_get_info(dist.device)
        return max(0, int(total * cfg.gpu_memory_utilization) - (total - free))
    return int(available_memory_bytes() * KV_CPU_MEMORY_SHARE / max(1, dist.local_world_size))


def check_plan(model: CausalLM, ckpt: Checkpoint, whole: bool = True) -> None:
    """Every tensor the model needs is in the checkpoint with the right shape, and (for a whole model: rank 0
    checks the whole checkpoint before any stage loads its part) nothing is left over."""
    expected: dict[str, tuple[int, ...]] = {}
    for module in model.modules():
        if isinstance(module, Loadable):
            expected.update(module.expected())
    have = set(ckpt.tensors)
    missing = sorted(set(expected) - have)
    # tensors only other ranks of the group read (other experts, under expert parallelism)
    elsewhere = set().union(*(m.elsewhere for m in model.modules() if isinstance(m, ReadElsewhere)))
    unexpected = [] if not whole else sorted(
        n for n in have - set(expected) - elsewhere - model.ignored_tensors() if not n.endswith(IGNORED_SUFFIXES))
    wrong = sorted(f"{n}: checkpoint {list(ckpt.tensors[n].shape)}, config implies {list(s)}"
                   for n, s in expected.items() if n in have and tuple(ckpt.tensors[n].shape) != tuple(s))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else ""))
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {', '.join(unexpected[:10])}"
                        + (" ..." if len(unexpected) > 10 else ""))
    if wrong:
        problems.append(f"{len(wrong)} shape mismatch(es): {'; '.join(wrong[:10])}")
    if problems:
        raise CheckpointError(f"checkpoint {ckpt.folder} does not match {ckpt.config_source} ({ckpt.architecture}): "
                              + " | ".join(problems))


def cpu_precision(cfg: EngineConfig, ckpt: Checkpoint, device: torch.device) -> EngineConfig:
    """What `--dtype auto` means on a CPU for a 16-bit checkpoint: float32 activations, the dtype of the CPU kernels
    and of the compiled decode step (torch's bfloat16 linears, through oneDNN, ran SmolLM2 at a third of llama.cpp's
    F16 speed per token; BENCHMARKS.md section 12). A bfloat16 checkpoint keeps its linears' weights in bfloat16 as
    stored (`bf16` weight-only, unless --quantization asks for another): the same numbers, at 16-bit size and speed.
    A float16 checkpoint's become float32 (exact; bfloat16 would round them). An explicit --dtype is kept."""
    if device.type != "cpu" or cfg.dtype != "auto":
        return cfg
    stored = ckpt.checkpoint_dtype()
    if stored == torch.bfloat16:
        return replace(cfg, dtype="float32", quantization=cfg.quantization or "bf16")
    if stored == torch.float16:
        return replace(cfg, dtype="float32")
    return cfg


def build_model(cfg: EngineConfig, dist: Dist, ckpt: Checkpoint | None = None
                ) -> tuple[CausalLM, PretrainedConfig, torch.dtype]:
    """Construct this rank's model (parameters allocated, not yet loaded) and check it against the checkpoint."""
    ckpt = ckpt or open_checkpoint(cfg.model)
    config = load_config(ckpt)
    cls = model_class(ckpt.architecture)
    dtype = ckpt.resolve_dtype(cfg.dtype)
    dist.expert_parallel = cfg.enable_expert_parallel
    # MoE checkpoints store experts one tensor each or fused into 3-D tensors; the model reads either (sharding/layers/moe.py)
    config.tpserve_fused_experts = any(n.endswith(".experts.gate_up_proj") for n in ckpt.tensors)
    model = cls(config, dist, dtype, dist.device)
    if cfg.enable_expert_parallel and not model.has_experts:
        raise ValueError(f"--enable-expert-parallel: {ckpt.architecture} is a dense model, it has no experts to split")
    check_plan(model, ckpt, whole=dist.pp_size == 1)
    return model, config, dtype


def lm_head_mode(mode: str | None) -> str | None:
    """The LM head's quantization under --quantization `mode` (see ModelRunner._quantizer)."""
    from loaders import envs

    return {"0": None, "same": mode}.get(envs.QUANTIZE_LM_HEAD.get(), "int8" if mode in ("int8", "int4") else mode)


def resolve_max_model_len(model: CausalLM, config: PretrainedConfig, requested: int | None) -> int:
    """--max-model-len, or its default min(max_position_embeddings, 2048); checked against the model's own limits
    (`check_max_model_len`). Runs on rank 0 before any other rank is spawned."""
    max_pos = getattr(config, "max_position_embeddings", None) or 2048
    n = requested or min(max_pos, 2048)
    if n > max_pos:
        raise ValueError(f"--max-model-len {n} exceeds the model's max_position_embeddings ({max_pos})")
    model.check_max_model_len(n)
    return n


class ModelRunner:
    """This rank's model, built and loaded in the constructor, its KV cache (`allocate_cache`, once every rank has
    loaded) and the mirror of rank 0's block table; `execute(step)` runs this rank's part of a step."""

    def __init__(self, cfg: EngineConfig, dist: Dist):
        self.cfg = cfg
        self.dist = dist
        t0 = time.perf_counter()
        self.phases = phases = StartPhases()  # the time of each start phase, logged by rank 0 once it serves
        if dist.device.type == "cpu":
            with phases.phase("kernels"):
                kernels.build_kernels()  # the compiled CPU kernels: a prebuilt variant or a build for this CPU
        trim = hugepages.LoadTrim()  # the heap's freed pages back to the OS as the load goes (see there)
        with open_checkpoint(cfg.model) as ckpt:
            asked = cfg.quantization is not None  # (the bf16 of cpu_precision keeps weights as stored: no cache)
            self.cfg = cfg = cpu_precision(cfg, ckpt, dist.device)
            quantize = self._quantizer()
            with phases.phase("building the model"):
                self.model, self.config, self.dtype = build_model(cfg, dist, ckpt)
            cache = (QuantCache.for_rank(ckpt, dist, cfg.quantization, cfg.quantization_group_size,
                                         lm_head_mode(cfg.quantization), self.dtype)
                     if asked and cfg.quantized_cache else None)
            cached = None
            if cache is not None:
                with phases.phase("reading the quantized cache"):
                    cached = cache.read(self.model)  # the linears it restored, nothing of theirs to read (None: a miss)
            loaders = [m for m in self.model.modules() if isinstance(m, Loadable) and m not in (cached or ())]
            head_mode = lm_head_mode(cfg.quantization)
            for m in loaders:  # a head quantized right after its read is read as stored (ParallelLMHead.read_as_stored)
                if (isinstance(m, ParallelLMHead) and head_mode and not m.tied and m.weight is not None
                        and quant.supported(head_mode, m.weight.shape[1], cfg.quantization_group_size)):
                    m.read_as_stored = True
            itemsize = ckpt.checkpoint_dtype().itemsize
            to_read = itemsize * sum(p.numel() for m in loaders if not m.tied  # (read once)
                                     for p in m.parameters(recurse=False))
            progress = LoadProgress(len(loaders), to_read, lambda: ckpt.bytes_read, dist.is_driver, phases)
            try:
                for m in loaders:
                    with phases.phase("reading"):
                        m.load(ckpt)
                    with phases.phase("quantizing"):
                        quantize(m, loaded=False)  # right after its read: one layer at a time in the checkpoint's dtype
                    progress.advance()
                    trim(ckpt.bytes_read)
            finally:
                progress.close()
            self.bytes_read = ckpt.bytes_read
        with phases.phase("quantizing"):
            for m in self.model.modules():
                quantize(m)  # what the loop could not do yet (an LM head tied to an embedding loaded after it)
        if cache is not None and cached is None:
            with phases.phase("writing the quantized cache"):
                cache.write(self.model)
        with phases.phase("packing"):
            for m in self.model.modules():
                if isinstance(m, Packable):
                    m.prepack()  # CPU: weights laid out for the kernels (sharding/cpu/kernels.py)
        if dist.device.type == "cpu":
            with phases.phase("huge pages"):
                hugepages.move_weights(self.model)  # the streamed weights in 2 MiB pages (sharding/cpu/hugepages.py)
        self.model.eval()
        self.max_model_len = resolve_max_model_len(self.model, self.config, cfg.max_model_len)
        self.rotary = (RotaryTable(self.config, self.max_model_len, self.dtype, dist.device) if self.model.uses_rotary
                       else None)
        self.load_seconds = time.perf_counter() - t0
        self.vocab_size = self.config.vocab_size
        self._sliding_window = self.model.sliding_window()
        self.thread_id = threading.get_ident()  # steps are fastest on this thread (server/engine/thread.py: EngineThread)
        self.lora: LoraManager | None = None  # this rank's adapter slots (sharding/layers/lora.py), with --enable-lora
        if cfg.enable_lora:
            from sharding.layers.lora import LoraManager

            self.lora = LoraManager(self.model, cfg.max_cpu_loras, cfg.max_lora_rank)
        self.block_size = cfg.block_size
        self.num_blocks = 0
        self.block_table = torch.zeros(0, 0, dtype=torch.int64)
        self.seq_parallel_steps = 0

    def _quantizer(self):
        """A function quantizing one module's weight in place under --quantization, else doing nothing. The LM head gets
        int8 under both integer modes (llama.cpp's Q4_0 files keep theirs at 6 bits too: a 4-bit head took SmolLM2's
        int4 perplexity loss from +2.76 to +4.11; BENCHMARKS.md section 9) and bf16 under bf16; it stays unquantized
        with TPSERVE_QUANTIZE_LM_HEAD=0, or follows the mode with =same (for measurements). Embeddings stay."""
        mode, group = self.cfg.quantization, self.cfg.quantization_group_size
        head_mode = lm_head_mode(mode)

        def apply(m: torch.nn.Module, loaded: bool = True) -> None:
            """loaded=False while the loop still reads: a tied LM head waits, its embedding may come later."""
            if not mode or not isinstance(m, Packable):
                return
            if isinstance(m, ParallelLMHead):
                if head_mode and (loaded or not m.tied):
                    m.quantize(head_mode, group)
            else:
                m.quantize(mode, group)
        return apply

    def bytes_per_block(self) -> int:
        """KV-cache bytes of one block on this rank, over every layer."""
        return sum(PagedKVCache.bytes_per_block(self.block_size, a.num_kv_heads, a.head_dim, self.dtype)
                   for a in self.model.attention_layers)

    def allocate_cache(self) -> None:
        """Size the block pool from the budget, agree on the block count with every rank, allocate it (zeroed, so
        the memory is resident from the start) and the block-table mirror. Every rank reaches the same verdict."""
        per_block = self.bytes_per_block()
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        budget = self.cfg.kv_cache_memory
        if budget is None:  # a share of the machine, but no more than a full batch of full-length sequences can use
            seqs = self.cfg.max_num_seqs * self.cfg.pipeline_parallel_size  # every lane's batch (server/engine/replicas.py)
            budget = min(default_kv_budget(self.cfg, self.dist), seqs * blocks_per_seq * per_block)
        num_blocks = self.dist.agree_min(budget // per_block)
        if num_blocks < blocks_per_seq and self.cfg.max_model_len is None and num_blocks > 0:
            # the default length does not fit the budget: serve what the pool holds (an explicit length is refused)
            logger.warning("the KV cache holds %d tokens: --max-model-len lowered from its default %d to %d",
                           num_blocks * self.block_size, self.max_model_len, num_blocks * self.block_size)
            self.max_model_len = num_blocks * self.block_size
            blocks_per_seq = num_blocks
        if num_blocks < blocks_per_seq or num_blocks == 0:
            raise ValueError(
                f"the KV cache budget ({budget / 2**20:.1f} MiB per rank) holds {num_blocks} blocks of "
                f"{self.block_size} tokens ({per_block / 2**20:.3f} MiB each), fewer than the {blocks_per_seq} one "
                f"sequence of --max-model-len {self.max_model_len} needs: raise --kv-cache-memory to at least "
                f"{blocks_per_seq * per_block / 2**20:.1f} MiB or lower --max-model-len")
        layers = self.model.attention_layers
        shapes = [PagedKVCache.shape(num_blocks, self.block_size, a.num_kv_heads, a.head_dim) for a in layers]
        with self.phases.phase("KV cache"):
            pools = hugepages.zeros(shapes, self.dtype, self.dist.device)  # one mapping in huge pages on CPU
        for attn, pool in zip(layers, pools):
            attn.cache = PagedKVCache(num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim, self.dtype,
                                      self.dist.device, pool)
        self.num_blocks = num_blocks
        # a row per sequence of every batch that may be in flight at once (server/engine/replicas.py: one lane per stage)
        rows = self.cfg.max_num_seqs * self.cfg.pipeline_parallel_size
        self.block_table = torch.zeros(rows, blocks_per_seq, dtype=torch.int64)

    def kv_cache_bytes(self) -> int:
        return sum(a.cache.pool.nbytes for a in self.model.attention_layers)

    @torch.inference_mode()
    def execute(self, step: Step, hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run this rank's part of one step: its stage's layers, from the step's token ids (first stage) or the
        previous stage's hidden states. Returns the hidden states for the next stage, or on the last stage's TP
        rank 0 the float32 logits [rows, vocab] (None on its other ranks)."""
        u = step.block_updates
        if u is not None:
            self.block_table[u[:, 0], u[:, 1]] = u[:, 2]
        meta = AttentionMetadata.build(step, self.block_table, self.block_size, self.rotary, self._sliding_window,
                                       self.dist.device)
        # sequence parallelism pays off where activations are large: prefill steps (decode steps stay plain TP)
        meta.seq_parallel = self.cfg.sequence_parallel and self.dist.world_size > 1 and not meta.all_decode
        self.seq_parallel_steps += meta.seq_parallel
        return self.model(step.input_ids.to(self.dist.device), meta,
                          None if hidden is None else hidden.to(self.dist.device))


def _agree(dist: Dist, what: str, fn):
    """Run fn() on every rank, then agree that all of them succeeded. A rank that fails still joins the status
    exchange (with its failure), so no rank waits forever for it; every rank then raises, and rank 0's message names
    the ranks that failed."""
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - reported below, after the others have heard of it
        error = e
        logger.error("rank %d failed to %s: %s", dist.global_rank, what, e)
    failed = dist.failed_ranks(error is None)
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"rank(s) {', '.join(map(str, failed))} failed to {what}; see their messages above")
    return result


def start_rank(cfg: EngineConfig, dist: Dist) -> ModelRunner:
    """Build this rank's runner and load its shard, then (once every rank has its weights in memory, so the memory
    left is known) allocate the KV cache; every rank agrees after each phase."""
    runner = _agree(dist, "start", lambda: ModelRunner(cfg, dist))
    _agree(dist, "allocate the KV cache", runner.allocate_cache)
    return runner
