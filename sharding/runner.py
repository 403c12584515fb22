"""What every rank runs: build the model, load this rank's shard, allocate the KV cache, execute steps.

Rank 0 calls `run(step)`, which broadcasts the step's description over the CPU group and executes it; ranks > 0
sit in `worker_loop()`, receiving descriptions and executing the same forward until a shutdown message arrives.

The KV cache is a pool of blocks sized from a memory budget (`--kv-cache-memory`, or a share of the memory left after
the weights); every rank gets the same number of blocks (the smallest any rank can afford), because rank 0's block
manager hands out block ids that every rank uses.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import torch

from loaders.checkpoint import Checkpoint, CheckpointError
from loaders.config import load_config
from sharding.cpu import hugepages, kernels
from sharding.layers.attention import AttentionMetadata, PagedKVCache, RotaryTable
from sharding.dist import Dist, Layout, ReplicaGroups, make_replica_groups
from sharding.layers.interface import Loadable, Packable, ReadElsewhere
from sharding.layers.linear import ParallelLMHead
from sharding.models import model_class
from sharding.models.interface import CausalLM
from sharding.progress import LoadProgress, StartPhases
from sharding.wire import CMD_NOOP, CMD_SHUTDOWN, CMD_STEP, HEADER, Step

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# commands with a payload of their own between steps (header [cmd, payload size, 0, 0]): a LoRA adapter into a slot
# (the payload: sharding/layers/lora.py encode_load, a slot and a local path each rank reads its own byte ranges from) or out
CMD_LORA_LOAD = 4
CMD_LORA_UNLOAD = 5
PAYLOAD_COMMANDS = (CMD_LORA_LOAD, CMD_LORA_UNLOAD)

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
        raise CheckpointError(f"checkpoint {ckpt.folder} does not match its config.json ({ckpt.architecture}): "
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
    ckpt = ckpt or Checkpoint(cfg.model)
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
    def __init__(self, cfg: EngineConfig, dist: Dist):
        self.cfg = cfg
        self.dist = dist
        t0 = time.perf_counter()
        self.phases = phases = StartPhases()  # the time of each start phase, logged by rank 0 once it serves
        if dist.device.type == "cpu":
            with phases.phase("kernels"):
                kernels.build_kernels()  # the compiled CPU kernels: a prebuilt variant or a build for this CPU
        with Checkpoint(cfg.model) as ckpt:
            self.cfg = cfg = cpu_precision(cfg, ckpt, dist.device)
            quantize = self._quantizer()
            with phases.phase("building the model"):
                self.model, self.config, self.dtype = build_model(cfg, dist, ckpt)
            loaders = [m for m in self.model.modules() if isinstance(m, Loadable)]
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
            finally:
                progress.close()
            self.bytes_read = ckpt.bytes_read
        with phases.phase("quantizing"):
            for m in self.model.modules():
                quantize(m)  # what the loop could not do yet (an LM head tied to an embedding loaded after it)
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
        self._message = torch.zeros(Step.message_size(cfg.max_num_seqs), dtype=torch.int64)  # see sharding/wire.py
        self.load_seconds = time.perf_counter() - t0
        self.vocab_size = self.config.vocab_size
        self._sliding_window = self.model.sliding_window()
        self.thread_id = threading.get_ident()  # steps are fastest on this thread (server/engine/core.py: EngineThread)
        self.lora = None  # this rank's adapter slots (sharding/layers/lora.py), with --enable-lora
        if cfg.enable_lora:
            from sharding.layers.lora import LoraManager

            self.lora = LoraManager(self.model, cfg.max_cpu_loras, cfg.max_lora_rank)
        self.block_size = cfg.block_size
        self.num_blocks = 0
        self.block_table = torch.zeros(0, 0, dtype=torch.int64)
        self.seq_parallel_steps = 0
        self._order = 0  # launches and no-wait commands, numbered (Launched.order)
        self._unwaited: dict[int, list] = {}  # replica -> [(order, send work, tensor)] of commands not waited for yet

    def _quantizer(self):
        """A function quantizing one module's weight in place under --quantization, else doing nothing. The LM head gets
        int8 under both integer modes (llama.cpp's Q4_0 files keep theirs at 6 bits too: a 4-bit head took SmolLM2's
        int4 perplexity loss from +2.76 to +4.11; BENCHMARKS.md section 9) and bf16 under bf16; it stays unquantized
        with TPSERVE_QUANTIZE_LM_HEAD=0, or follows the mode with =same (for measurements). Embeddings stay."""
        mode, group = self.cfg.quantization, self.cfg.quantization_group_size
        default_head = "int8" if mode in ("int8", "int4") else mode
        head_mode = {"0": None, "same": mode}.get(os.environ.get("TPSERVE_QUANTIZE_LM_HEAD", "1"), default_head)

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
            seqs = self.cfg.max_num_seqs * self.cfg.pipeline_parallel_size  # every lane's batch (server/engine/core.py)
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
        # a row per sequence of every batch that may be in flight at once (server/engine/core.py: one per stage)
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

    # ---- rank 0 ------------------------------------------------------------------------------------------------
    # Rank 0 drives every replica: replica 0's first stage runs here (its TP peers get the step by broadcast),
    # another replica's first stage gets the step from here point to point. A step is launched, then collected:
    # with pipeline stages or other replicas, its logits come back from the last stage later, and rank 0 meanwhile
    # launches other steps (server/engine/core.py keeps up to pp steps per replica in flight).
    def launch(self, step: Step, replica: int = 0) -> "Launched":
        self._order += 1
        launched = self._launch(step, replica)
        launched.order = self._order
        return launched

    def _launch(self, step: Step, replica: int) -> "Launched":
        d = self.dist
        sends = []
        if replica == 0:
            if d.world_size > 1:
                rest = step.pack_into(self._message)
                d.broadcast_control(self._message)  # a decode step: this one message
                if rest is not None:
                    d.broadcast_control(rest)
            out = self.execute(step)
            if d.last_stage:
                if isinstance(out, tuple):  # embedding sequences' pooled rows beside the logits
                    return Launched(step, replica, out[0], sends, out[1])
                return Launched(step, replica, out, sends)
            sends = self._send_step(step, d.peer(pp_rank=1), out, isend=True)
        else:
            sends = self._send_step(step, d.layout.rank_of(replica, 0, 0), None, isend=True)
        return Launched(step, replica, None, sends)

    def collect(self, launched: "Launched") -> torch.Tensor:
        """The launched step's logits (float32 [rows, vocab]): at once, or received from its last stage; the pooled
        rows of its embedding sequences, if any, arrive in `launched.pooled` (float32 [rows, hidden])."""
        logits = launched.logits
        if logits is None:
            rows, pooled = launched.step.num_logits(), launched.step.num_hidden()
            logits = torch.empty(rows, self.vocab_size, dtype=torch.float32)
            src = self.dist.layout.rank_of(launched.replica, self.dist.pp_size - 1, 0)
            if rows:
                self.dist.recv(logits, src)
            if pooled:
                launched.pooled = torch.empty(pooled, self.config.hidden_size, dtype=torch.float32)
                self.dist.recv(launched.pooled, src)
        for work, _ in launched.sends:
            work.wait()
        # commands sent to this replica before the step was launched: its ranks took them before the step, so their
        # sends are done (waiting at once could deadlock, see _command)
        pending = self._unwaited.get(launched.replica, [])
        while pending and pending[0][0] < launched.order:
            pending.pop(0)[1].wait()
        return logits

    def run(self, step: Step) -> torch.Tensor:
        return self.collect(self.launch(step))

    def _send_step(self, step: Step, dst: int, hidden: torch.Tensor | None, isend: bool = False) -> list:
        """The step's message (and payload) to another rank, then the hidden states if any."""
        message = torch.empty_like(self._message)
        rest = step.pack_into(message)
        parts = [message] + ([rest] if rest is not None else []) + ([hidden.contiguous().cpu()] if hidden is not None
                                                                     else [])
        if isend:  # (work, tensor): the tensor stays referenced until the send is waited for
            return [(self.dist.isend(t, dst), t) for t in parts]
        for t in parts:
            self.dist.send(t, dst)
        return []

    def _pack_command(self, cmd: int, payload: torch.Tensor | None) -> list[torch.Tensor]:
        """A command's message, and its payload as a second one when it does not fit in the first."""
        message = torch.zeros_like(self._message)
        n = 0 if payload is None else payload.numel()
        message[:HEADER] = torch.tensor([cmd, n, 0, 0], dtype=torch.int64)
        if n and HEADER + n <= message.numel():
            message[HEADER : HEADER + n] = payload
            return [message]
        return [message] + ([payload.contiguous()] if n else [])

    def _command(self, cmd: int, replicas: list[int] | None = None, payload: torch.Tensor | None = None,
                 wait: bool = True) -> None:
        """A command to every rank of `replicas` (default: all): by broadcast to replica 0's first stage, point to
        point to the other replicas' first stages; every stage passes it on to the next.

        `wait=False` between steps in flight (the LoRA commands): a gloo send may wait for its receiver, and a
        replica's first stage can be blocked passing an earlier step on to a stage that is itself blocked sending
        logits to rank 0, which would be blocked here. The sends are waited for when a step launched after them
        completes (collect)."""
        parts = self._pack_command(cmd, payload)
        replicas = list(range(self.dist.layout.dp)) if replicas is None else replicas
        works = []
        for replica in replicas:
            if replica:
                works += [(self.dist.isend(t, self.dist.layout.rank_of(replica, 0, 0)), t) for t in parts]
        if 0 in replicas:
            if self.dist.world_size > 1:
                for t in parts:
                    self.dist.broadcast_control(t)
            if self.dist.pp_size > 1:
                works += [(self.dist.isend(t, self.dist.peer(pp_rank=1)), t) for t in parts]
        if not wait:
            assert len(replicas) == 1, "a command left unwaited goes to one replica at a time"
            self._order += 1
            self._unwaited.setdefault(replicas[0], []).extend((self._order, w, t) for w, t in works)
            return
        for w, _ in works:
            w.wait()

    # LoRA adapters (server/engine/lora_registry.py decides which adapter is in which slot; rank 0 validated the folder first)
    def lora_load(self, slot: int, path: str, replicas: list[int], local: bool = True) -> None:
        """Rank 0 reads its own blocks of the adapter into `slot` (`local`; raising, with nothing sent, if it
        cannot), then tells `replicas`' ranks to read theirs. A rank that then fails to read exits (its replica is
        restarted and given every loaded adapter again: server/engine/core.py)."""
        from sharding.layers.lora import encode_load

        if local:
            self.lora.load(slot, path)
        if self.dist.global_world_size > 1 and replicas:
            self._command(CMD_LORA_LOAD, replicas, encode_load(slot, path), wait=False)

    def lora_unload(self, slot: int, replicas: list[int]) -> None:
        if not replicas:
            self.lora.unload(slot)
        if self.dist.global_world_size > 1 and replicas:
            self._command(CMD_LORA_UNLOAD, replicas, torch.tensor([slot], dtype=torch.int64), wait=False)

    def forget_sends(self, replica: int) -> None:
        """A dead replica's unwaited command sends (sharding/runner.py _command): never waited for."""
        self._unwaited.pop(replica, None)

    def heartbeat(self, replicas: list[int] | None = None) -> None:
        self._command(CMD_NOOP, replicas)

    def stop_workers(self, replicas: list[int] | None = None) -> None:
        self._command(CMD_SHUTDOWN, replicas)

    def rejoin(self, replica: int, generation: int) -> tuple[ReplicaGroups, int]:
        """Rank 0's side of a respawned replica's start (called from a thread of its own while the engine serves the
        other replicas): make the replica's groups of this generation with its new processes, then agree with them
        as at start (they load their shards meanwhile; sharding/runner.py: start_rank). Returns the groups, which
        the stepping thread installs (dist.install_groups), and the replica's block count: no more than before."""
        groups = make_replica_groups(self.dist, replica, generation)
        links = [groups.link]
        for what in ("start", None, "allocate the KV cache"):
            if what is None:
                count = self.dist.agree_min(self.num_blocks, links)
                continue
            failed = self.dist.failed_ranks(True, links)
            if failed:
                raise RuntimeError(f"rank(s) {', '.join(map(str, failed))} of replica {replica} failed to {what}")
        return groups, count

    # ---- ranks > 0 ---------------------------------------------------------------------------------------------
    def _receive(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next message (header + payload) and, on a later stage, the hidden states that come with it: from
        the previous stage; on a first stage from rank 0 (a replica's TP rank 0) or by broadcast (other TP ranks)."""
        d, message = self.dist, self._message
        if not d.first_stage:
            src = d.peer(pp_rank=d.pp_rank - 1)
        elif d.is_first:
            src = 0  # the TP rank 0 of another replica's first stage: rank 0 sends it the step
        else:
            src = None  # a first stage's other TP ranks: their rank 0 broadcasts
        if src is None:
            d.broadcast_control(message)
        else:
            d.recv(message, src)
            if d.first_stage and d.world_size > 1:  # pass it on to this replica's TP group
                d.broadcast_control(message)
        header = message[:HEADER]
        cmd = int(header[0])
        if cmd not in (CMD_STEP, *PAYLOAD_COMMANDS):
            return message, None
        size = Step.payload_size(header) if cmd == CMD_STEP else int(header[1])
        if HEADER + size <= message.numel():
            payload = message[HEADER : HEADER + size]  # used before the next message overwrites it
        else:
            payload = torch.empty(size, dtype=torch.int64)
            if src is None:
                d.broadcast_control(payload)
            else:
                d.recv(payload, src)
                if d.first_stage and d.world_size > 1:
                    d.broadcast_control(payload)
        hidden = None
        if not d.first_stage and cmd == CMD_STEP:
            hidden = torch.empty(int(header[1]), self.config.hidden_size, dtype=self.dtype)
            d.recv(hidden, src)
        return torch.cat([header, payload]), hidden

    def worker_loop(self) -> None:
        d = self.dist
        while True:
            message, hidden = self._receive()
            header = message[:HEADER]
            cmd = int(header[0])
            if cmd in (CMD_SHUTDOWN, CMD_NOOP):
                if not d.last_stage:
                    d.send(message[: self._message.numel()], d.peer(pp_rank=d.pp_rank + 1))
                if cmd == CMD_SHUTDOWN:
                    return
                continue
            if cmd in PAYLOAD_COMMANDS:
                payload = message[HEADER:]
                if not d.last_stage:
                    for t in self._pack_command(cmd, payload):
                        d.send(t, d.peer(pp_rank=d.pp_rank + 1))
                self._apply_command(cmd, payload)
                continue
            assert cmd == CMD_STEP, f"unknown command {cmd}"
            step = Step.unpack(header, message[HEADER:])
            out = self.execute(step, hidden)
            if not d.last_stage:
                self._send_step(step, d.peer(pp_rank=d.pp_rank + 1), out)
            elif d.is_first and out is not None:
                logits, pooled = out if isinstance(out, tuple) else (out, None)
                if logits.shape[0]:
                    d.send(logits.cpu(), 0)  # the logits, to rank 0, which samples (gloo: from host memory)
                if pooled is not None:
                    d.send(pooled.cpu(), 0)  # embedding sequences' pooled rows


    def _apply_command(self, cmd: int, payload: torch.Tensor) -> None:
        """A LoRA load or unload on this rank. A rank that cannot read its part of an adapter rank 0 could read
        leaves: its replica is restarted (server/engine/supervisor.py) rather than serve without the adapter."""
        from sharding.layers.lora import decode_load

        try:
            if cmd == CMD_LORA_LOAD:
                slot, path = decode_load(payload)
                self.lora.load(slot, path)
            else:
                self.lora.unload(int(payload[0]))
        except Exception as e:  # noqa: BLE001 - fatal for this rank, see above
            logger.error("rank %d could not apply LoRA command %d: %s; leaving", self.dist.global_rank, cmd, e)
            os._exit(1)


@dataclass(slots=True)
class Launched:
    """A step on its way: its logits when they are already here, else where they will come from."""

    step: Step
    replica: int
    logits: torch.Tensor | None
    sends: list  # isend works to wait for before the buffers may go
    pooled: torch.Tensor | None = None  # embedding sequences' pooled rows (collect fills them in from a last stage)
    order: int = 0  # launches and commands are numbered (ModelRunner._order): commands sent before it are done by then


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


def leave_shutdown_to_rank0() -> None:
    """Ranks > 0 ignore SIGINT and SIGTERM. Ctrl-C in a terminal, `kill -- -PGID`, systemd's default
    KillMode=control-group and torchrun all signal every process of the group at once; rank 0 then drains (requests in
    flight finish) and tells the other ranks to stop, which they could not do if the signal had killed them first.
    They still die with rank 0 (PR_SET_PDEATHSIG when tpserve spawned them; a dead peer fails their next wait)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def worker_main(argv: list[str] | None = None, started: float | None = None) -> int:
    """Entry of ranks > 0 (`python -m sharding.worker`)."""
    import sys

    from sharding.dist import init_dist

    cfg = EngineConfig.from_argv(sys.argv[1:] if argv is None else argv)
    leave_shutdown_to_rank0()
    dist = init_dist(cfg.layout(int(os.environ.get("WORLD_SIZE", "1"))))
    logging.basicConfig(level=logging.WARNING, format=f"[rank {dist.global_rank}] %(levelname)s %(message)s")
    try:
        runner = start_rank(cfg, dist)
    except Exception:  # noqa: BLE001 - the message was logged; rank 0 reports the failure
        dist.shutdown()
        return 1
    if dist.generation and started is not None:  # a respawned replica's rank (server/engine/supervisor.py): where its start went
        logger.warning("rank %d started again (generation %d) in %.1f s since its process began: %s",
                       dist.global_rank, dist.generation, time.monotonic() - (started or 0.0), runner.phases.summary())
    try:
        runner.worker_loop()
    except Exception as e:  # noqa: BLE001 - rank 0 went away or a collective failed: leave, loudly
        logger.error("rank %d stopping: %s", dist.global_rank, e)
        os._exit(1)
    dist.shutdown()
    return 0
