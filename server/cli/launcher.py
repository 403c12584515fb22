"""Start the ranks: check the checkpoint on rank 0, spawn ranks 1..N-1 on this host, join the group as rank 0.

Under torchrun every process is already one rank (RANK/WORLD_SIZE set by torchrun): nothing is spawned, ranks > 0
enter the worker loop and only rank 0 returns an engine. A watcher thread notices a spawned rank that exits
unexpectedly and reports it within a fraction of a second.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from loaders import envs
from loaders.default_model import ensure_default_model
from loaders.gguf_file import open_checkpoint
from sharding import store
from sharding.dist import Dist, init_dist
from sharding.executor import start_executor
from sharding.numa import MODES
from sharding.runner import EngineConfig, build_model, resolve_max_model_len, start_rank
from sharding.worker import leave_shutdown_to_rank0, worker_loop

logger = logging.getLogger(__name__)


def under_torchrun() -> bool:
    """torchrun (or a hand-made equivalent) set this process's rank; tpserve's own launcher never leaves these set."""
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """Set environment variables for the duration of the block (rank 0's rendezvous), then restore them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


DEFAULT_GGUF = "default.gguf"  # the model name that serves the embedded default model's GGUF file (Q4_1) directly


def resolve_model(model: str | None) -> str:
    """The model to serve: the default one, else `model`; a folder holding a GGUF model (or any part of a split
    set) resolves to its (first) .gguf file, so every later step sees the file."""
    if not model:
        return str(ensure_default_model())
    if model == DEFAULT_GGUF and not os.path.exists(model):  # the default model's own file, served as it ships
        from loaders.default_model import find_gguf as embedded_gguf

        return str(embedded_gguf())
    from loaders.gguf_file import find_gguf

    gguf = find_gguf(model)
    return str(gguf) if gguf is not None else model


def validate(cfg: EngineConfig, tp: int) -> None:
    """Everything that can be checked before any other rank exists: folder, files, architecture, names, shapes,
    the TP degree, the pipeline split. Raises ValueError with a message for the user."""
    if tp < 1:
        raise ValueError("--tensor-parallel-size must be at least 1")
    if cfg.pipeline_parallel_size < 1 or cfg.data_parallel_size < 1:
        raise ValueError("--pipeline-parallel-size and --data-parallel-size must be at least 1")
    import torch

    from loaders.partition import stage_layers
    from sharding.layers import quant

    quant.check(cfg.quantization, cfg.quantization_group_size)

    partition = envs.PP_LAYER_PARTITION.get()
    with open_checkpoint(cfg.model) as ckpt:
        ckpt.resolve_dtype(cfg.dtype)
        model, config, _ = build_model(cfg, Dist(rank=0, world_size=tp, device=torch.device("meta")), ckpt)
        resolve_max_model_len(model, config, cfg.max_model_len)
        for stage in range(cfg.pipeline_parallel_size):
            stage_layers(config.num_hidden_layers, cfg.pipeline_parallel_size, stage, partition)
        if cfg.sequence_parallel:
            if not model.supports_sequence_parallel:
                raise ValueError(f"--sequence-parallel is not supported for {ckpt.architecture} yet")
            if cfg.pipeline_parallel_size > 1:
                raise ValueError("--sequence-parallel with --pipeline-parallel-size above 1 is not supported yet")


@dataclass
class Workers:
    """The ranks > 0 this process spawned (global rank -> process), how to spawn one again, and a watcher that
    reports each one that exits on its own, once."""

    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    on_death: Callable[[int, str], None] | None = None  # (global rank, message), from the watcher thread
    argv: list[str] = field(default_factory=list)  # the worker command line's EngineConfig part
    env: dict[str, str] = field(default_factory=dict)  # the rendezvous environment (without RANK)
    _closing: bool = False
    _watching: bool = False
    _expected: set = field(default_factory=set)  # processes killed on purpose: not reported

    def spawn(self, rank: int, generation: int = 0, argv: list[str] | None = None) -> subprocess.Popen:
        """Start global rank `rank` (again, for a respawned replica: a later generation of its groups). Call from a
        thread that lives as long as the process: PR_SET_PDEATHSIG fires when the creating thread exits."""
        env = dict(os.environ, **self.env, RANK=str(rank), LOCAL_RANK=str(rank))
        if generation:
            env[envs.GENERATION.name] = str(generation)
        self.procs[rank] = p = subprocess.Popen([sys.executable, "-m", "sharding.worker", *(argv or self.argv)],
                                                env=env, preexec_fn=_die_with_parent)
        return p

    def kill(self, ranks: list[int], wait: float = 5.0) -> None:
        """SIGKILL these ranks' processes (a SIGSTOPped one too) and reap them; the watcher stays quiet about them."""
        procs = [self.procs[r] for r in ranks if r in self.procs]
        for p in procs:
            self._expected.add(p)
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(wait)

    def watch(self) -> None:
        """Start the watcher once (later calls only keep it; it reads `on_death` when a rank dies); none without
        spawned ranks."""
        if self._watching or not self.procs:
            return
        self._watching = True

        def loop() -> None:
            reported: set = set()
            while not self._closing:
                for rank, p in list(self.procs.items()):
                    code = p.poll()
                    if code is None or p in reported or p in self._expected or self._closing:
                        continue
                    reported.add(p)
                    msg = f"rank {rank} (pid {p.pid}) exited with code {code}"
                    logger.error("%s", msg)
                    if self.on_death is not None:
                        self.on_death(rank, msg)
                time.sleep(0.1)

        threading.Thread(target=loop, name="tpserve-rank-watch", daemon=True).start()

    def close(self, timeout: float = 10.0) -> None:
        """Wait for the ranks to leave (after a shutdown message), then terminate and kill what is left."""
        self._closing = True
        procs = list(self.procs.values())
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in procs:
            try:
                p.wait(2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _die_with_parent() -> None:
    """In the child before exec: on Linux, get SIGKILL when rank 0 dies, so no rank is ever orphaned."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def world_size(cfg: EngineConfig, tp: int) -> int:
    return tp * cfg.pipeline_parallel_size * cfg.data_parallel_size


def spawn_workers(cfg: EngineConfig, tp: int, settings: dict[str, str] | None = None) \
        -> tuple[Workers, dict[str, str]]:
    """Ranks 1..world-1 as `python -m sharding.worker`; returns them and rank 0's rendezvous environment.
    `settings`: more environment variables for every rank (and for ranks spawned again later)."""
    world = world_size(cfg, tp)
    # the ranks' store, on loopback with a secret of this server's own (sharding/store.py), before any rank starts
    secret = store.new_secret()
    port = store.serve_store("127.0.0.1", 0, secret.encode()).port
    rdzv = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                **{envs.STORE_PORT.name: str(port), envs.STORE_SECRET.name: secret}, **(settings or {}))
    workers = Workers(argv=cfg.to_argv(), env=rdzv)
    for rank in range(1, world):
        workers.spawn(rank)
    return workers, dict(rdzv, RANK="0", LOCAL_RANK="0")


def _fail_fast(rank: int, msg: str) -> None:
    """Before the engine exists a dead rank leaves rank 0 waiting in the rendezvous: stop the process."""
    print(f"tpserve: {msg} while starting; stopping", file=sys.stderr, flush=True)
    os._exit(1)


def torchrun_worker_signals() -> None:
    """Under torchrun, ranks > 0 leave shutdown to rank 0 (sharding/worker.py: leave_shutdown_to_rank0); call from
    the main thread, before launch (signal handlers can be set there only)."""
    if under_torchrun() and os.environ.get("RANK", "0") != "0":
        leave_shutdown_to_rank0()


def rank_settings(numa: str | None) -> dict[str, str]:
    """The environment the command line's settings give every rank: TPSERVE_NUMA for --numa (checked here, before
    any rank starts; None: the variable as set, or its default)."""
    if numa is None:
        envs.NUMA.get()  # a bad TPSERVE_NUMA is refused before any rank starts
        return {}
    if numa not in MODES:
        raise ValueError(f"--numa must be one of {', '.join(MODES)}, not {numa!r}")
    return {envs.NUMA.name: numa}


def launch(cfg: EngineConfig, tp: int, numa: str | None = None):
    """Start every rank. Returns (executor, dist, workers) on rank 0; on ranks > 0 under torchrun, runs the worker
    loop and exits the process when it ends. `numa`: where each host's CPU ranks run (sharding/numa.py; None:
    TPSERVE_NUMA)."""
    settings = rank_settings(numa)
    if under_torchrun():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != world_size(cfg, tp):
            raise ValueError(f"--tensor-parallel-size {tp} x --pipeline-parallel-size {cfg.pipeline_parallel_size} "
                             f"x --data-parallel-size {cfg.data_parallel_size} does not match torchrun's world size "
                             f"{world}")
        with environment(settings):
            dist = init_dist(cfg.layout(world))
        if not dist.is_driver:
            worker_loop(start_rank(cfg, dist))
            dist.shutdown()
            sys.exit(0)
        return start_executor(cfg, dist), dist, Workers()
    validate(cfg, tp)
    world = world_size(cfg, tp)
    workers, rdzv = spawn_workers(cfg, tp, settings) if world > 1 else (Workers(), settings)
    workers.on_death = _fail_fast
    workers.watch()
    with environment(rdzv):
        dist = init_dist(cfg.layout(world))
    try:
        executor = start_executor(cfg, dist)
    except BaseException:
        workers.close(timeout=5)
        raise
    return executor, dist, workers


def kill_workers(workers: Workers) -> None:
    for p in workers.procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
