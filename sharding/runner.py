"""What every rank runs: build the model, load this rank's shard, allocate the KV cache, execute steps.

Rank 0 calls `run(step)`, which broadcasts the step's description over the CPU group and executes it; ranks > 0
sit in `worker_loop()`, receiving descriptions and executing the same forward until a shutdown message arrives.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from loaders.checkpoint import Checkpoint, CheckpointError
from loaders.config import load_config
from sharding.attention import AttentionMetadata, KVCache, RotaryTable
from sharding.dist import Dist
from sharding.models import model_class
from sharding.step import CMD_NOOP, CMD_SHUTDOWN, CMD_STEP, HEADER, Step

logger = logging.getLogger(__name__)

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(slots=True)
class EngineConfig:
    """What every rank must agree on to build the same model and cache."""

    model: str
    dtype: str = "auto"
    max_num_seqs: int = 32
    max_model_len: int | None = None  # None: min(max_position_embeddings, 2048)

    def to_argv(self) -> list[str]:
        argv = ["--model", self.model, "--dtype", self.dtype, "--max-num-seqs", str(self.max_num_seqs)]
        if self.max_model_len is not None:
            argv += ["--max-model-len", str(self.max_model_len)]
        return argv


def check_plan(model: torch.nn.Module, ckpt: Checkpoint) -> None:
    """Every tensor the model needs is in the checkpoint with the right shape, and nothing is left over."""
    expected: dict[str, tuple[int, ...]] = {}
    for module in model.modules():
        if hasattr(module, "expected"):
            expected.update(module.expected())
    have = set(ckpt.tensors)
    missing = sorted(set(expected) - have)
    unexpected = sorted(n for n in have - set(expected) - model.ignored_tensors() if not n.endswith(IGNORED_SUFFIXES))
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


def build_model(cfg: EngineConfig, dist: Dist, ckpt: Checkpoint | None = None):
    """Construct this rank's model (parameters allocated, not yet loaded) and check it against the checkpoint."""
    ckpt = ckpt or Checkpoint(cfg.model)
    config = load_config(ckpt)
    cls = model_class(ckpt.architecture)
    dtype = ckpt.resolve_dtype(cfg.dtype)
    model = cls(config, dist, dtype, dist.device)
    check_plan(model, ckpt)
    return model, config, dtype


def resolve_max_model_len(model, config, requested: int | None) -> int:
    """--max-model-len, or its default min(max_position_embeddings, 2048); checked against the model's own limits
    (a model may add its own through `check_max_model_len`). Runs on rank 0 before any other rank is spawned."""
    max_pos = getattr(config, "max_position_embeddings", None) or 2048
    n = requested or min(max_pos, 2048)
    if n > max_pos:
        raise ValueError(f"--max-model-len {n} exceeds the model's max_position_embeddings ({max_pos})")
    check = getattr(model, "check_max_model_len", None)
    if check is not None:
        check(n)
    return n


class ModelRunner:
    def __init__(self, cfg: EngineConfig, dist: Dist):
        self.cfg = cfg
        self.dist = dist
        t0 = time.perf_counter()
        with Checkpoint(cfg.model) as ckpt:
            self.model, self.config, self.dtype = build_model(cfg, dist, ckpt)
            loaders = [m for m in self.model.modules() if hasattr(m, "expected")]
            for m in tqdm(loaders, desc="loading weights", unit="tensor", disable=not dist.is_first or None,
                          leave=False):
                m.load(ckpt)
            self.bytes_read = ckpt.bytes_read
        for m in self.model.modules():
            if hasattr(m, "prepack"):
                m.prepack()  # CPU: linears through oneDNN with packed weights (sharding/kernels.py)
        self.model.eval()
        self.max_model_len = resolve_max_model_len(self.model, self.config, cfg.max_model_len)
        uses_rope = getattr(self.model, "uses_rotary", True)
        self.rotary = RotaryTable(self.config, self.max_model_len, self.dtype, dist.device) if uses_rope else None
        for attn in self.model.attention_layers:
            attn.cache = KVCache(cfg.max_num_seqs, attn.num_kv_heads, self.max_model_len, attn.head_dim, self.dtype,
                                 dist.device)
        self._message = torch.zeros(Step.message_size(cfg.max_num_seqs), dtype=torch.int64)  # see sharding/step.py
        self.load_seconds = time.perf_counter() - t0
        self.vocab_size = self.config.vocab_size
        self._sliding_window = self.model.sliding_window()
        self.thread_id = threading.get_ident()  # steps are fastest on this thread (server/engine.py: EngineThread)

    def kv_cache_bytes(self) -> int:
        return sum(a.cache.k.nbytes + a.cache.v.nbytes for a in self.model.attention_layers)

    @torch.inference_mode()
    def execute(self, step: Step) -> torch.Tensor | None:
        """Run the forward of one step; rank 0 gets float32 logits [num_seqs, vocab], the others None."""
        meta = AttentionMetadata.build(step, self.rotary, self._sliding_window, self.dist.device)
        return self.model(step.input_ids.to(self.dist.device), meta)

    # ---- rank 0 ------------------------------------------------------------------------------------------------
    def run(self, step: Step) -> torch.Tensor:
        if self.dist.world_size > 1:
            rest = step.pack_into(self._message)
            self.dist.broadcast_control(self._message)  # a decode step: this one message
            if rest is not None:
                self.dist.broadcast_control(rest)
        return self.execute(step)

    def _command(self, cmd: int) -> None:
        self._message[:HEADER] = torch.tensor([cmd, 0, 0, 0], dtype=torch.int64)
        self.dist.broadcast_control(self._message)

    def heartbeat(self) -> None:
        self._command(CMD_NOOP)

    def stop_workers(self) -> None:
        self._command(CMD_SHUTDOWN)

    # ---- ranks > 0 ---------------------------------------------------------------------------------------------
    def worker_loop(self) -> None:
        message = self._message
        while True:
            self.dist.broadcast_control(message)
            header = message[:HEADER]
            cmd = int(header[0])
            if cmd == CMD_SHUTDOWN:
                return
            if cmd == CMD_NOOP:
                continue
            assert cmd == CMD_STEP, f"unknown command {cmd}"
            size = Step.payload_size(header)
            if HEADER + size <= message.numel():
                payload = message[HEADER : HEADER + size]  # used before the next message overwrites it
            else:
                payload = torch.empty(size, dtype=torch.int64)
                self.dist.broadcast_control(payload)
            self.execute(Step.unpack(header, payload))


def start_rank(cfg: EngineConfig, dist: Dist) -> ModelRunner:
    """Build this rank's runner, then agree with every rank that all of them are ready.

    A rank that fails still joins the status exchange (with its failure), so no rank waits forever for it; every
    rank then raises, and rank 0's message names the ranks that failed.
    """
    runner, error = None, None
    try:
        runner = ModelRunner(cfg, dist)
    except Exception as e:  # noqa: BLE001 - reported below, after the others have heard of it
        error = e
        logger.error("rank %d failed to start: %s", dist.rank, e)
    status = torch.zeros(dist.world_size, dtype=torch.int64)
    status[dist.rank] = 1 if error is None else 0
    dist.all_reduce_control(status, op=torch.distributed.ReduceOp.SUM)
    failed = [r for r in range(dist.world_size) if status[r] == 0]
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"rank(s) {', '.join(map(str, failed))} failed to start; see their messages above")
    return runner


def worker_main(argv: list[str] | None = None) -> int:
    """Entry of ranks > 0 (`python -m sharding.worker`)."""
    import argparse

    from sharding.dist import init_dist

    ap = argparse.ArgumentParser(prog="tpserve-worker")
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=None)
    args = ap.parse_args(argv)
    # Ctrl-C in a terminal reaches every process of the group: rank 0 alone decides when the ranks stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    dist = init_dist()
    logging.basicConfig(level=logging.WARNING, format=f"[rank {dist.rank}] %(levelname)s %(message)s")
    cfg = EngineConfig(args.model, args.dtype, args.max_num_seqs, args.max_model_len)
    try:
        runner = start_rank(cfg, dist)
    except Exception:  # noqa: BLE001 - the message was logged; rank 0 reports the failure
        dist.shutdown()
        return 1
    try:
        runner.worker_loop()
    except Exception as e:  # noqa: BLE001 - rank 0 went away or a collective failed: leave, loudly
        logger.error("rank %d stopping: %s", dist.rank, e)
        os._exit(1)
    dist.shutdown()
    return 0
