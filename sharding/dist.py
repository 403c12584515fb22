"""Process groups and the few collectives tpserve uses, behind one small object.

The world is data x pipeline x tensor parallel ranks (`Layout`): global rank = (dp_rank * pp + pp_rank) * tp +
tp_rank, so the TP ranks of a stage are consecutive (one node under torchrun) and stages follow each other (PP
across nodes). A `Dist` is one rank's view: `rank` and `world_size` are its place in its TP group, which is what
every parallel layer needs; `layout`, `global_rank`, `pp_rank` and `dp_rank` place it in the world, and `send` /
`recv` move tensors between any two ranks (activations between stages, steps and logits between rank 0 and the
other replicas).

The device and the backend are chosen here and nowhere else: CUDA + NCCL when a GPU is visible, else CPU + gloo.
A CPU-side gloo group carries the control traffic (the step description, start-up status, point-to-point messages)
so it never has to go through NCCL. With one rank nothing is initialised and every collective is a no-op.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
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


@dataclass(frozen=True, slots=True)
class Layout:
    """How the world splits: tp ranks per stage, pp stages per replica, dp replicas."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return (dp_rank * self.pp + pp_rank) * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of a global rank."""
        return rank // (self.tp * self.pp), rank // self.tp % self.pp, rank % self.tp


@dataclass
class Dist:
    rank: int = 0  # in the TP group
    world_size: int = 1  # of the TP group
    local_world_size: int = 1  # ranks on this host
    device: torch.device = field(default_factory=default_device)
    cpu_group: object | None = None  # the TP group (gloo)
    device_group: object | None = None  # the TP group (the device's backend)
    fast_all_reduce: object | None = None  # the TP group's same-host shared-memory collectives, when set up
    layout: Layout = field(default_factory=Layout)
    global_rank: int = 0
    world_group: object | None = None  # every rank (gloo): status exchanges and point-to-point messages
    layer_partition: str | None = None  # TPSERVE_PP_LAYER_PARTITION
    expert_parallel: bool = False  # MoE layers: the TP group's ranks own whole experts (sharding/moe.py)

    @property
    def is_first(self) -> bool:
        """This rank leads its TP group: it receives the gathered logits and sends its stage's messages first."""
        return self.rank == 0

    @property
    def is_driver(self) -> bool:
        """Global rank 0: the HTTP server, the schedulers and the sampler."""
        return self.global_rank == 0

    @property
    def global_world_size(self) -> int:
        return self.layout.world_size

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.global_rank)[0]

    @property
    def pp_rank(self) -> int:
        return self.layout.coords(self.global_rank)[1]

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    def stage_layers(self, num_layers: int) -> tuple[int, int]:
        """[start, stop) of the decoder layers this rank's stage holds."""
        from loaders.partition import stage_layers

        return stage_layers(num_layers, self.layout.pp, self.pp_rank, self.layer_partition)

    def peer(self, pp_rank: int | None = None, dp_rank: int | None = None, tp_rank: int | None = None) -> int:
        """The global rank at these coordinates; unspecified ones are this rank's."""
        d, p, t = self.layout.coords(self.global_rank)
        return self.layout.rank_of(d if dp_rank is None else dp_rank, p if pp_rank is None else pp_rank,
                                   t if tp_rank is None else tp_rank)

    # ---- point to point (CPU tensors, over the world's gloo group) ---------------------------------------------
    def send(self, t: torch.Tensor, dst: int) -> None:
        dist.send(t.contiguous(), dst, group=self.world_group)

    def isend(self, t: torch.Tensor, dst: int):
        """Start sending; the caller keeps `t` alive and waits on the returned work before reusing it."""
        return dist.isend(t, dst, group=self.world_group)

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        dist.recv(t, src, group=self.world_group)
        return t

    # ---- collectives -------------------------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over all ranks, in place; the one call site every row-parallel layer uses."""
        if self.world_size == 1:
            return t
        if self.fast_all_reduce is not None:
            return self.fast_all_reduce.all_reduce(t)
        dist.all_reduce(t, group=self.device_group)
        return t

    # ---- sequence parallelism: the token axis split over the TP group ------------------------------------------
    def token_split(self, n: int) -> tuple[int, int]:
        """[start, stop) of the n tokens of a step this TP rank holds between layers (uneven splits allowed)."""
        from loaders.partition import split_evenly

        return split_evenly(n, self.world_size, self.rank)

    def reduce_scatter_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` [n, ...] over the TP group and keep this rank's rows. Done as the all-reduce followed by a
        copy of the rank's rows, so the values are bitwise those of the all-reduce without sequence parallelism
        (the same sums in the same order); the full sum lives only until the copy."""
        a, b = self.token_split(t.shape[0])
        return self.all_reduce(t)[a:b].clone()

    def all_gather_tokens(self, t: torch.Tensor, n: int) -> torch.Tensor:
        """Every rank's rows of an [n, ...] tensor, in rank order, on every rank: each rank contributes its rows and
        zeros elsewhere, and the all-reduce adds exact zeros."""
        a, b = self.token_split(n)
        out = t.new_zeros((n, *t.shape[1:]))
        out[a:b] = t
        return self.all_reduce(out)

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
            dist.gather(t, bufs, group=self.device_group, group_dst=0)
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
                dist.broadcast(t, group=self.cpu_group, group_src=0)
        return t

    def all_reduce_control(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.MIN) -> torch.Tensor:
        """Over every rank of the world (start-up agreements)."""
        if self.global_world_size > 1:
            dist.all_reduce(t, op=op, group=self.world_group)
        return t

    def shutdown(self) -> None:
        if self.fast_all_reduce is not None:
            self.fast_all_reduce.close()
            self.fast_all_reduce = None
        if dist.is_initialized():  # (world_size is the TP size: a -pp or -dp group at TP 1 has one too)
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass


def _same_host_groups(groups: list[list[int]], world_group) -> set[int]:
    """Indices of the groups whose ranks all run on this rank's host (hostname + boot id, exchanged once)."""
    me = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            me += ":" + f.read().strip()
    except OSError:
        pass
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, me, group=world_group)
    return {i for i, g in enumerate(groups) if len({hosts[r] for r in g}) == 1}


def init_dist(layout: Layout | None = None, timeout_s: float | None = None) -> Dist:
    """Join the process group described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    torchrun and tpserve's own launcher both set these. Without them this process is a single rank. `layout` splits
    the world (default: all of it tensor parallel); every rank creates every TP group, in the same order.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    layout = layout or Layout(tp=world_size)
    if layout.world_size != world_size:
        raise ValueError(f"tensor x pipeline x data parallel sizes ({layout.tp} x {layout.pp} x {layout.dp} = "
                         f"{layout.world_size}) must equal the world size ({world_size})")
    device = default_device()
    torch.set_num_threads(int(os.environ.get("TPSERVE_THREADS") or 0) or threads_per_rank(local_world_size))
    partition = os.environ.get("TPSERVE_PP_LAYER_PARTITION") or None
    if world_size == 1:
        return Dist(device=device, layer_partition=partition)
    timeout = datetime.timedelta(seconds=timeout_s or float(os.environ.get("TPSERVE_COLLECTIVE_TIMEOUT", "600")))
    backend = "nccl" if device.type == "cuda" else "gloo"
    # the shared-memory collectives spin: only for gloo ranks no more than the cores of their host (a bad
    # TPSERVE_SHM_ALLREDUCE setting fails here, before joining)
    shm_ok = shm_allreduce.wanted(backend, local_world_size, local_world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
    world_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    dp_rank, pp_rank, tp_rank = layout.coords(rank)
    if layout.tp == world_size:
        cpu_group, device_group, mine, groups = world_group, dist.group.WORLD, 0, [list(range(world_size))]
    else:
        groups = [[layout.rank_of(d, p, t) for t in range(layout.tp)] for d in range(layout.dp)
                  for p in range(layout.pp)]
        mine = dp_rank * layout.pp + pp_rank
        cpu_group = device_group = None
        for i, g in enumerate(groups):  # every rank creates every group, in the same order
            c = dist.new_group(g, backend="gloo", timeout=timeout)
            dv = c if backend == "gloo" else dist.new_group(g, backend=backend, timeout=timeout)
            if i == mine:
                cpu_group, device_group = c, dv
    d = Dist(tp_rank, layout.tp, local_world_size, device, cpu_group, device_group, layout=layout, global_rank=rank,
             world_group=world_group, layer_partition=partition)
    on_host = _same_host_groups(groups, world_group) if layout.tp > 1 else set()
    use_shm = layout.tp > 1 and mine in on_host and shm_ok
    if use_shm:
        try:
            d.fast_all_reduce = shm_allreduce.ShmAllReduce(tp_rank, layout.tp, cpu_group,
                                                           timeout_s=timeout.total_seconds())
        except RuntimeError as e:  # raised on every rank of the group alike, so they fall back together
            if os.environ.get("TPSERVE_SHM_ALLREDUCE") == "1":
                raise
            logger.warning("rank %d: %s; all-reduce goes through gloo", rank, e)
    logger.debug("rank %d/%d (dp %d, pp %d, tp %d) on %s (%s), %d threads, all-reduce via %s", rank, world_size,
                 dp_rank, pp_rank, tp_rank, device, backend, torch.get_num_threads(),
                 "shared memory" if d.fast_all_reduce is not None else backend)
    return d
