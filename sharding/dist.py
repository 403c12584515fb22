"""Process groups and the few collectives tpserve uses, behind one small object.

The world is data x pipeline x tensor parallel ranks (`Layout`): global rank = (dp_rank * pp + pp_rank) * tp +
tp_rank, so the TP ranks of a stage are consecutive (one node under torchrun) and stages follow each other (PP
across nodes). A `Dist` is one rank's view: `rank` and `world_size` are its place in its TP group, which is what
every parallel layer needs; `layout`, `global_rank`, `pp_rank` and `dp_rank` place it in the world, and `send` /
`recv` move tensors between rank 0 and a replica's ranks or between a replica's stages (activations, steps,
logits).

There is no world-wide group. Each replica is a fault domain with groups of its own, made by name over the
rendezvous store (`make_replica_groups`): a link (rank 0 and the replica's ranks) and a TP group per stage. A dead
rank breaks only its replica's groups, and a respawned replica meets rank 0 in groups of a new generation
(server/engine/supervisor.py, docs/fault-tolerance.md).

The device and the backend are chosen here and nowhere else: CUDA + NCCL when a GPU is visible, else CPU + gloo.
The gloo groups carry the control traffic (the step description, start-up agreements, point-to-point messages)
so it never has to go through NCCL. With one rank nothing is initialised and every collective is a no-op.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from loaders import envs
from sharding import numa, shm_allreduce
from sharding import store as rank_store

logger = logging.getLogger(__name__)


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def threads_per_rank(local_world_size: int, placement: numa.Placement | None = None) -> int:
    """Cores of this host divided by the ranks on it (at least one): ranks x threads must not exceed the cores. A
    rank bound to a NUMA node (sharding/numa.py) has CPUs of its own: one thread on each."""
    if placement is not None:
        return len(placement.cpus)
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


class Group:
    """Some ranks' process group, made straight over the store under a name of its own rather than inside
    torch.distributed's default world: a replica's groups can then be made again, under a new generation's name,
    with processes started after the others (sharding/executor.py: rejoin, a respawned replica). `rank` is this process's
    place in `members` (global ranks, in order); the methods take and return that group's own ranks."""

    def __init__(self, store, name: str, members: list[int], global_rank: int, timeout: datetime.timedelta,
                 backend: str = "gloo", device=None):
        self.name, self.members = name, list(members)
        self.rank, self.size = self.members.index(global_rank), len(self.members)
        prefixed = dist.PrefixStore(name, store)
        if backend == "gloo":  # its sockets on `device`'s address (sharding/store.py: gloo_device), not the wildcard
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [device if device is not None else dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self.pg = dist.ProcessGroupGloo(prefixed, self.rank, self.size, opts)
        else:  # a CUDA build's NCCL group (not exercised on this project's CPU-only CI)
            self.pg = dist.ProcessGroupNCCL(prefixed, self.rank, self.size)

    def local(self, global_rank: int) -> int:
        return self.members.index(global_rank)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([t], opts).wait()
        return t

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.pg.allreduce([t], opts).wait()
        return t

    def gather(self, t: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        outs = [torch.empty_like(t) for _ in range(self.size)] if self.rank == dst else []
        opts = dist.GatherOptions()
        opts.rootRank = dst
        self.pg.gather([outs] if outs else [], [t], opts).wait()
        return outs or None

    def send(self, t: torch.Tensor, dst: int) -> None:
        self.pg.send([t], dst, 0).wait()

    def isend(self, t: torch.Tensor, dst: int):
        return self.pg.send([t], dst, 0)

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        self.pg.recv([t], src, 0).wait()
        return t


def link_members(layout: "Layout", replica: int) -> list[int]:
    """A replica's link group: global rank 0 (which drives every replica) and the replica's own ranks. It carries
    the steps and logits between rank 0 and the replica, the activations between its stages and its start-up
    agreements; nothing in it touches another replica, so a dead replica's links fail alone."""
    base = layout.rank_of(replica, 0, 0)
    return sorted({0, *range(base, base + layout.tp * layout.pp)})


def tp_members(layout: "Layout", replica: int, stage: int) -> list[int]:
    return [layout.rank_of(replica, stage, t) for t in range(layout.tp)]


@dataclass
class Dist:
    rank: int = 0  # in the TP group
    world_size: int = 1  # of the TP group
    local_world_size: int = 1  # ranks on this host
    device: torch.device = field(default_factory=default_device)
    cpu_group: Group | None = None  # the TP group (gloo)
    device_group: Group | None = None  # the TP group (the device's backend)
    fast_all_reduce: shm_allreduce.ShmAllReduce | None = None  # the TP group's same-host collectives, when set up
    layout: Layout = field(default_factory=Layout)
    global_rank: int = 0
    links: dict[int, Group] = field(default_factory=dict)  # replica -> its link group (rank 0 has one per replica)
    layer_partition: str | None = None  # TPSERVE_PP_LAYER_PARTITION
    expert_parallel: bool = False  # MoE layers: the TP group's ranks own whole experts (sharding/layers/moe.py)
    store: dist.Store | None = None  # the rendezvous store every group is made over (sharding/store.py)
    gloo_device: object = None  # where this rank's gloo sockets listen (sharding/store.py: gloo_device)
    timeout: datetime.timedelta = datetime.timedelta(seconds=600)
    generation: int = 0  # of this rank's replica: 0 at start, +1 each time the replica is respawned
    shm_ok: bool = False  # the shared-memory collectives may be used for this rank's TP group
    # where ranks run (placement_record): this rank's own; on rank 0, every rank's (global rank -> record)
    placements: dict[int, dict[str, str]] = field(default_factory=dict)

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

    def _link(self, peer: int) -> Group:
        """The link group that joins this rank and `peer`: the peer's replica's (rank 0's side) or this rank's."""
        return self.links[self.dp_rank if peer == 0 else self.layout.coords(peer)[0]]

    # ---- point to point (CPU tensors, over the link groups; ranks are global) ----------------------------------
    def send(self, t: torch.Tensor, dst: int) -> None:
        link = self._link(dst)
        link.send(t.contiguous(), link.local(dst))

    def isend(self, t: torch.Tensor, dst: int):
        """Start sending; the caller keeps `t` alive and waits on the returned work before reusing it."""
        link = self._link(dst)
        return link.isend(t, link.local(dst))

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        link = self._link(src)
        return link.recv(t, link.local(src))

    # ---- collectives -------------------------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over all ranks, in place; the one call site every row-parallel layer uses."""
        if self.world_size == 1:
            return t
        if self.fast_all_reduce is not None:
            return self.fast_all_reduce.all_reduce(t)
        return self.device_group.all_reduce(t)

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
            bufs = self.device_group.gather(t, dst=0)
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
                self.cpu_group.broadcast(t, src=0)
        return t

    # ---- start-up agreements over the link groups --------------------------------------------------------------
    def _agree_links(self) -> list[Group]:
        """The links an agreement runs over: every replica's on rank 0 (in replica order), this rank's own
        elsewhere. Every rank of a replica agrees with rank 0, which alone hears every replica."""
        return [self.links[r] for r in sorted(self.links)] if self.is_driver else [self.links[self.dp_rank]]

    def failed_ranks(self, ok: bool, links: list[Group] | None = None) -> list[int]:
        """Every rank says whether it succeeded; returns the global ranks that did not, of the links this rank is
        in (all of them on rank 0). No rank waits for one that failed: a failure is a vote like any other."""
        failed: set[int] = set()
        for link in links if links is not None else self._agree_links():
            status = torch.zeros(link.size, dtype=torch.int64)
            status[link.rank] = 1 if ok else 0
            link.all_reduce(status, dist.ReduceOp.SUM)
            failed.update(link.members[i] for i in range(link.size) if status[i] == 0)
        return sorted(failed)

    def agree_min(self, value: int, links: list[Group] | None = None) -> int:
        """The smallest `value` of every rank (rank 0: of every replica), known to every rank: a MIN over each
        link, then rank 0 tells each link the overall result."""
        links = links if links is not None else self._agree_links()
        if self.global_world_size == 1:
            return value
        out = value
        for link in links:
            t = torch.tensor([value], dtype=torch.int64)
            out = min(out, int(link.all_reduce(t, dist.ReduceOp.MIN)[0]))
        for link in links:
            t = torch.tensor([out], dtype=torch.int64)
            out = int(link.broadcast(t, src=0)[0])
        return out

    def shutdown(self) -> None:
        if self.fast_all_reduce is not None:
            self.fast_all_reduce.close()
            self.fast_all_reduce = None
        if self.is_driver and isinstance(self.store, rank_store.StoreClient):
            rank_store.close_store(self.store.port)  # rank 0's: no replica will be started again
        # the groups go with the process (a gloo group waits for nothing when it is dropped at exit)


def _group_name(kind: str, replica: int, generation: int) -> str:
    """A group's name in the store: a replica's groups get new names each time it is respawned (its generation),
    and each torchrun restart (which keeps its agent's store) starts a namespace of its own."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"tpserve/{restart}/r{replica}/g{generation}/{kind}"


def _placement_key(rank: int) -> str:
    return f"tpserve/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/placement/{rank}"


def _same_host(store, name: str, members: list[int], global_rank: int) -> bool:
    """Whether every member runs on this host (hostname + boot id, exchanged through the store)."""
    me = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            me += ":" + f.read().strip()
    except OSError:
        pass
    store.set(f"{name}/host/{global_rank}", me)
    return all(store.get(f"{name}/host/{r}").decode() == me for r in members)


@dataclass
class ReplicaGroups:
    """What one rank holds of one replica's groups (of one generation): the link, and the TP group (with its
    shared-memory collectives) when this rank is one of the replica's ranks."""

    replica: int
    generation: int
    link: Group
    cpu_group: Group | None = None
    device_group: Group | None = None
    fast_all_reduce: shm_allreduce.ShmAllReduce | None = None


def make_replica_groups(d: Dist, replica: int, generation: int) -> ReplicaGroups:
    """Make (with the other members, who call this too) this rank's groups of a replica: every member blocks here
    until all have arrived. Rank 0 calls it for each replica at start, and again for a respawned one."""
    layout, me = d.layout, d.global_rank
    backend = "nccl" if d.device.type == "cuda" else "gloo"
    link = Group(d.store, _group_name("link", replica, generation), link_members(layout, replica), me, d.timeout,
                 device=d.gloo_device)
    out = ReplicaGroups(replica, generation, link)
    dp_rank, pp_rank, tp_rank = layout.coords(me)
    if dp_rank != replica or layout.tp == 1:
        return out
    members = tp_members(layout, replica, pp_rank)
    name = _group_name(f"tp{pp_rank}", replica, generation)
    out.cpu_group = link if members == link.members else Group(d.store, name, members, me, d.timeout,
                                                               device=d.gloo_device)
    out.device_group = out.cpu_group if backend == "gloo" else Group(d.store, name + "/device", members, me,
                                                                     d.timeout, backend)
    if d.shm_ok and _same_host(d.store, name, members, me):
        try:
            out.fast_all_reduce = shm_allreduce.ShmAllReduce(tp_rank, layout.tp, out.cpu_group,
                                                             timeout_s=d.timeout.total_seconds())
        except RuntimeError as e:  # raised on every rank of the group alike, so they fall back together
            if envs.SHM_ALLREDUCE.get():
                raise
            logger.warning("rank %d: %s; all-reduce goes through gloo", me, e)
    return out


def install_groups(d: Dist, groups: ReplicaGroups) -> None:
    """Use these groups from now on (a respawned replica's, on rank 0: from the thread that steps)."""
    d.links[groups.replica] = groups.link
    if groups.cpu_group is not None:
        if d.fast_all_reduce is not None:
            d.fast_all_reduce.close()
        d.cpu_group, d.device_group, d.fast_all_reduce = groups.cpu_group, groups.device_group, groups.fast_all_reduce
    if d.global_rank != 0:
        d.generation = groups.generation


def placement_record(local_rank: int, placement: numa.Placement | None, note: str) -> dict[str, str]:
    """Where this rank runs, as rank 0 shows it (the start line, /metrics): host, NUMA nodes (empty when not
    bound), the CPUs it may run on, its torch threads, and its memory policy or why it is not bound (numa.place)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return {"host": socket.gethostname(), "local_rank": str(local_rank),
            "numa_nodes": numa.format_cpulist(placement.nodes) if placement else "",
            "cpus": numa.format_cpulist(cpus), "threads": str(torch.get_num_threads()),
            "numa": f"memory: {note}" if placement else f"not bound: {note}"}


def init_dist(layout: Layout | None = None, timeout_s: float | None = None) -> Dist:
    """Join the ranks described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; a respawned
    replica's ranks also TPSERVE_GENERATION).

    torchrun and tpserve's own launcher both set these. Without them this process is a single rank. Before anything
    is allocated, a CPU rank is placed on a NUMA node as TPSERVE_NUMA says (sharding/numa.py, with LOCAL_RANK and
    LOCAL_WORLD_SIZE), and `placements` records where it runs (on rank 0: every rank). `layout` splits
    the world (default: all of it tensor parallel). There is no world-wide group: rank 0 hosts the rendezvous store
    (sharding/store.py: the launcher starts it before spawning the ranks; under torchrun rank 0 does, here), and
    every group is made over it by name (make_replica_groups): each replica's link to rank 0 and each stage's TP
    group, so that one replica's failure leaves the others' groups intact.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank % max(1, local_world_size))))
    layout = layout or Layout(tp=world_size)
    if layout.world_size != world_size:
        raise ValueError(f"tensor x pipeline x data parallel sizes ({layout.tp} x {layout.pp} x {layout.dp} = "
                         f"{layout.world_size}) must equal the world size ({world_size})")
    device = default_device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    # the shared-memory collectives spin: only for gloo ranks no more than the cores of their host (a bad
    # TPSERVE_SHM_ALLREDUCE setting fails here, before joining; and before binding, so every rank counts the same
    # cores)
    shm_ok = world_size > 1 and shm_allreduce.wanted(backend, local_world_size, local_world_size)
    # NUMA placement (sharding/numa.py) before anything is allocated, so the weights and the cache land on the node
    mode = envs.NUMA.get() if device.type == "cpu" else "off"
    placement, note = numa.place(local_rank, local_world_size, mode)
    torch.set_num_threads(envs.THREADS.get() or threads_per_rank(local_world_size, placement))
    record = placement_record(local_rank, placement, note)
    partition = envs.PP_LAYER_PARTITION.get()
    if world_size == 1:
        return Dist(device=device, layer_partition=partition, placements={0: record})
    timeout = datetime.timedelta(seconds=timeout_s or envs.COLLECTIVE_TIMEOUT.get())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # the store (on rank 0, proving a secret) and gloo's sockets listen on loopback, or across hosts on the address
    # MASTER_ADDR names: never on the wildcard (sharding/store.py)
    store = rank_store.join_store(rank, timeout)
    gloo_device = rank_store.gloo_device(os.environ.get("MASTER_ADDR", "127.0.0.1"))
    store.set(_placement_key(rank), json.dumps(record))  # for rank 0 (a respawned rank writes its own again)
    generation = envs.GENERATION.get()
    dp_rank, pp_rank, tp_rank = layout.coords(rank)
    d = Dist(tp_rank, layout.tp, local_world_size, device, layout=layout, global_rank=rank,
             layer_partition=partition, store=store, gloo_device=gloo_device, timeout=timeout, generation=generation,
             shm_ok=shm_ok, placements={rank: record})
    for replica in range(layout.dp) if rank == 0 else [dp_rank]:
        install_groups(d, make_replica_groups(d, replica, generation if replica == dp_rank else 0))
    if rank == 0:  # every rank wrote its record before joining its groups, which rank 0 has now made with all
        d.placements = {r: json.loads(store.get(_placement_key(r))) for r in range(world_size)}
    logger.debug("rank %d/%d (dp %d, pp %d, tp %d) on %s (%s), %d threads on CPUs %s, all-reduce via %s", rank,
                 world_size, dp_rank, pp_rank, tp_rank, device, backend, torch.get_num_threads(), record["cpus"],
                 "shared memory" if d.fast_all_reduce is not None else backend)
    return d
