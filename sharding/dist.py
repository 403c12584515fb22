"""Process groups and the few collectives tpserve uses, behind one small object.

The device and the backend are chosen here and nowhere else: CUDA + NCCL when a GPU is visible, else CPU + gloo.
A second, CPU-side gloo group carries the control traffic (the step description, start-up status) so it never
has to go through NCCL. With one rank nothing is initialised and every collective is a no-op.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from sharding import shm_allreduce

logger = logging.getLogger(__name__)


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def threads_per_rank(local_world_size: int) -> int:
    """Cores of this host divided by the ranks on it (at least one): ranks x threads must not exceed the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = field(default_factory=default_device)
    cpu_group: object | None = None
    device_group: object | None = None
    fast_all_reduce: object | None = None  # a same-host shared-memory all-reduce, when one is set up

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    # ---- collectives -------------------------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over all ranks, in place; the one call site every row-parallel layer uses."""
        if self.world_size == 1:
            return t
        if self.fast_all_reduce is not None:
            return self.fast_all_reduce.all_reduce(t)
        dist.all_reduce(t, group=self.device_group)
        return t

    def gather_last_dim(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Concatenate every rank's `t` along the last dim on rank 0 (rank i contributes sizes[i] columns)."""
        if self.world_size == 1:
            return t
        width = max(sizes)
        if t.shape[-1] < width:
            t = torch.nn.functional.pad(t, (0, width - t.shape[-1]))
        t = t.contiguous()
        if self.fast_all_reduce is not None:  # ranks on one host: through the shared-memory segment
            bufs = self.fast_all_reduce.gather(t, dst=0)
        else:
            bufs = [torch.empty_like(t) for _ in range(self.world_size)] if self.is_first else None
            dist.gather(t, bufs, dst=0, group=self.device_group)
        if not self.is_first:
            return None
        return torch.cat([b[..., :n] for b, n in zip(bufs, sizes)], dim=-1)

    def broadcast_control(self, t: torch.Tensor) -> torch.Tensor:
        """Broadcast a contiguous CPU int64 tensor from rank 0, in place: through the shared-memory segment when the
        ranks share one (the step message, every step), else over the CPU gloo group."""
        if self.world_size > 1:
            if self.fast_all_reduce is not None:
                self.fast_all_reduce.broadcast(t, src=0)
            else:
                dist.broadcast(t, src=0, group=self.cpu_group)
        return t

    def all_reduce_control(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.MIN) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(t, op=op, group=self.cpu_group)
        return t

    def shutdown(self) -> None:
        if self.fast_all_reduce is not None:
            self.fast_all_reduce.close()
            self.fast_all_reduce = None
        if self.world_size > 1 and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass


def init_dist(timeout_s: float | None = None) -> Dist:
    """Join the process group described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    torchrun and tpserve's own launcher both set these. Without them this process is a single rank.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    device = default_device()
    torch.set_num_threads(int(os.environ.get("TPSERVE_THREADS", "0")) or threads_per_rank(local_world_size))
    if world_size == 1:
        return Dist(device=device)
    timeout = datetime.timedelta(seconds=timeout_s or float(os.environ.get("TPSERVE_COLLECTIVE_TIMEOUT", "600")))
    backend = "nccl" if device.type == "cuda" else "gloo"
    use_shm = shm_allreduce.wanted(backend, world_size, local_world_size)  # a bad setting fails before joining
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
    device_group = dist.group.WORLD
    cpu_group = device_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    d = Dist(rank, world_size, local_world_size, device, cpu_group, device_group)
    if use_shm:
        try:
            d.fast_all_reduce = shm_allreduce.ShmAllReduce(rank, world_size, cpu_group,
                                                           timeout_s=timeout.total_seconds())
        except RuntimeError as e:  # raised on every rank alike, so all ranks fall back together
            if os.environ.get("TPSERVE_SHM_ALLREDUCE") == "1":
                raise
            logger.warning("rank %d: %s; all-reduce goes through gloo", rank, e)
    logger.debug("rank %d/%d on %s (%s), %d threads, all-reduce via %s", rank, world_size, device, backend,
                 torch.get_num_threads(), "shared memory" if d.fast_all_reduce is not None else backend)
    return d
