"""Where a host's CPU ranks run: one NUMA node (or sub-NUMA cluster) each, their threads and memory bound there.

A tensor-parallel rank whose threads run on one socket while its weights sit in the other socket's memory reads
every weight across the socket link, every step. `numactl --cpunodebind=N --preferred=N` before the rank starts
avoids that; this module does the same from inside the rank, before it allocates its weights and KV cache, so the
first touch of every page lands on the rank's node:

- `read_topology` reads the nodes from sysfs (`/sys/devices/system/node/node*/cpulist`, and which nodes have
  memory); sub-NUMA clusters (SNC, NPS) are just more nodes there. A node without CPUs (CXL or HBM memory) gets no
  rank; a node with CPUs but no memory gets ranks but no memory policy (the kernel then allocates from the nearest
  node with memory).
- `plan` is a pure function of the topology, the ranks on this host (LOCAL_WORLD_SIZE), the mode and the CPUs this
  process may use: every local rank's nodes and CPUs. Rank 0 and every other rank compute the same plan.
- `bind` sets the calling thread's CPU affinity (threads it starts later, e.g. torch's OpenMP workers, inherit it)
  and its memory policy through the `set_mempolicy` system call (MPOL_PREFERRED: pages go to the rank's node while
  it has free memory and spill over instead of failing when it is full; no libnuma needed). A refused memory policy
  (a seccomp filter, e.g. Docker's default profile without CAP_SYS_NICE) is a warning, never an error.

Modes (`tpserve serve --numa`, TPSERVE_NUMA): `auto` binds when the host has more than one node with usable CPUs
and the local ranks are a multiple of that count (1 rank per node, or 2, ...: every node gets as many ranks); `off`
never binds; `distribute` always spreads the ranks over the nodes: contiguous blocks of ranks per node when there are
at least as many ranks as nodes (consecutive ranks, i.e. one TP group, stay together), contiguous groups of nodes
per rank when there are fewer. Ranks that share a node split its CPUs between them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import re
import sys
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SYSFS = "/sys/devices/system/node"
MODES = ("auto", "off", "distribute")

MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND, MPOL_PREFERRED_MANY = 0, 1, 2, 5
# set_mempolicy's number per architecture (asm/unistd*.h; the generic table for the newer ports)
_SET_MEMPOLICY = {"x86_64": 238, "amd64": 238, "aarch64": 237, "arm64": 237, "riscv64": 237, "loongarch64": 237,
                  "ppc64le": 261, "ppc64": 261, "s390x": 270, "i386": 276, "i686": 276}


@dataclass(frozen=True)
class Node:
    id: int
    cpus: tuple[int, ...]
    memory: bool = True  # the node has memory of its own
    cores: tuple[tuple[int, ...], ...] = ()  # its CPUs by physical core (SMT siblings together); (): one per CPU

    def units(self, allowed: set[int] | None) -> list[tuple[int, ...]]:
        """The node's cores (their CPUs the process may use), in order of their first CPU: what ranks sharing the
        node split between them, so that no two ranks share a core's hyperthreads."""
        cores = self.cores or tuple((c,) for c in self.cpus)
        units = [tuple(c for c in core if allowed is None or c in allowed) for core in cores]
        return sorted((u for u in units if u), key=lambda u: u[0])


@dataclass(frozen=True)
class Placement:
    """Where one local rank runs: its nodes (one, unless ranks are fewer than nodes), its CPUs, and the nodes its
    memory policy prefers (those of its nodes that have memory; none: no policy)."""

    local_rank: int
    nodes: tuple[int, ...]
    cpus: tuple[int, ...]
    memory_nodes: tuple[int, ...]

    def describe(self) -> str:
        which = "node" if len(self.nodes) == 1 else "nodes"
        return f"NUMA {which} {format_cpulist(self.nodes)}, CPUs {format_cpulist(self.cpus)}"


@dataclass(frozen=True)
class Plan:
    ranks: tuple[Placement, ...]  # one per local rank; empty: no rank is bound
    reason: str  # why the ranks are (not) bound, for the logs


def parse_cpulist(text: str) -> list[int]:
    """The kernel's list format ("0-3,8-11", "5", "" for none) -> the sorted numbers."""
    out: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"not a CPU list: {text!r}")
        lo = int(m.group(1))
        out.update(range(lo, int(m.group(2) or lo) + 1))
    return sorted(out)


def format_cpulist(cpus) -> str:
    """The inverse of parse_cpulist: sorted numbers -> "0-3,8-11"."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def read_topology(root: str | os.PathLike = SYSFS, cpu_root: str | os.PathLike | None = None) -> list[Node]:
    """The NUMA nodes under `root` (sysfs, or a copy of its layout in a test), by id, with their cores when
    `cpu_root` (default: root's sibling `cpu`) has cpuN/topology/thread_siblings_list. No such folder: []."""
    root = Path(root)
    cpu_root = root.parent / "cpu" if cpu_root is None else Path(cpu_root)
    if not root.is_dir():
        return []
    with_memory = None
    if (root / "has_memory").is_file():
        with_memory = set(parse_cpulist((root / "has_memory").read_text()))
    nodes = []
    for d in root.iterdir():
        m = re.fullmatch(r"node(\d+)", d.name)
        if not m or not d.is_dir():
            continue
        node_id = int(m.group(1))
        cpulist = d / "cpulist"
        cpus = tuple(parse_cpulist(cpulist.read_text())) if cpulist.is_file() else ()
        nodes.append(Node(node_id, cpus, True if with_memory is None else node_id in with_memory,
                          _cores(cpus, cpu_root)))
    return sorted(nodes, key=lambda n: n.id)


def _cores(cpus: tuple[int, ...], cpu_root: Path) -> tuple[tuple[int, ...], ...]:
    """The node's CPUs grouped by core (thread_siblings_list); a CPU without that file is a core of its own."""
    seen: dict[int, tuple[int, ...]] = {}
    for c in cpus:
        if c in seen:
            continue
        siblings = cpu_root / f"cpu{c}" / "topology" / "thread_siblings_list"
        core = tuple(x for x in parse_cpulist(siblings.read_text()) if x in cpus) if siblings.is_file() else ()
        core = core if c in core else (c,)
        for x in core:
            seen[x] = core
    return tuple(sorted(set(seen.values()), key=lambda core: core[0]))


def _share(items: list, n: int, j: int) -> list:
    """The j-th of n contiguous parts of `items`, as even as possible (the first ones one larger)."""
    size, extra = divmod(len(items), n)
    start = j * size + min(j, extra)
    return items[start:start + size + (1 if j < extra else 0)]


def plan(topology: list[Node], local_world_size: int, mode: str, allowed_cpus=None) -> Plan:
    """Every local rank's placement (module docstring), from the nodes, this host's ranks, the mode and the CPUs
    the process may use (None: all); pure."""
    if mode not in MODES:
        raise ValueError(f"NUMA mode must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "off":
        return Plan((), "NUMA binding is off")
    if local_world_size < 1:
        raise ValueError(f"local world size must be at least 1, not {local_world_size}")
    allowed = None if allowed_cpus is None else set(allowed_cpus)
    usable = [(n, tuple(c for c in n.cpus if allowed is None or c in allowed)) for n in topology]
    usable = [(n, cpus) for n, cpus in usable if cpus]  # CPU-less nodes and nodes outside the mask get no rank
    if not usable:
        return Plan((), "no NUMA node with CPUs this process may use (no sysfs node information?)")
    count = len(usable)
    if mode == "auto":
        if count == 1:
            return Plan((), "one NUMA node" + (f" of {len(topology)} has CPUs this process may use"
                                               if len(topology) > 1 else " on this host"))
        if local_world_size % count:
            return Plan((), f"{local_world_size} local rank(s) do not divide evenly over {count} NUMA nodes "
                            "(--numa distribute spreads them anyway)")
    ranks = []
    if local_world_size >= count:  # contiguous blocks of ranks per node; ranks sharing a node split its cores
        node_of = [r * count // local_world_size for r in range(local_world_size)]
        for r, k in enumerate(node_of):
            node, cpus = usable[k]
            sharing = [q for q, kk in enumerate(node_of) if kk == k]
            j, n = sharing.index(r), len(sharing)
            units = node.units(allowed)
            if len(units) >= n:  # whole cores each
                mine = tuple(sorted(c for unit in _share(units, n, j) for c in unit))
            elif len(cpus) >= n:  # fewer cores than ranks: hyperthreads each
                mine = tuple(_share(list(cpus), n, j))
            else:  # more ranks than CPUs on the node: they take turns on single CPUs
                mine = (cpus[j % len(cpus)],)
            ranks.append(Placement(r, (node.id,), mine, (node.id,) if node.memory else ()))
    else:  # fewer ranks than nodes: contiguous groups of nodes per rank
        for r in range(local_world_size):
            group = usable[r * count // local_world_size:(r + 1) * count // local_world_size]
            ranks.append(Placement(r, tuple(n.id for n, _ in group), tuple(c for _, cs in group for c in cs),
                                   tuple(n.id for n, _ in group if n.memory)))
    return Plan(tuple(ranks), f"{local_world_size} local rank(s) over {count} NUMA node{'s' if count > 1 else ''} "
                              f"({mode})")


def _nodemask(nodes) -> ctypes.Array:
    words = (ctypes.c_ulong * (max(nodes) // 64 + 1))()
    for n in nodes:
        words[n // 64] |= 1 << (n % 64)
    return words


def set_memory_policy(nodes: tuple[int, ...]) -> str:
    """The calling thread's memory policy: prefer these nodes (set_mempolicy). Returns what was set, or why not
    (a warning is logged when the kernel refuses it: the rank runs on, with the default local allocation)."""
    if not nodes:
        return "local allocation (its nodes have no memory of their own)"
    number = _SET_MEMPOLICY.get(platform.machine().lower())
    if not sys.platform.startswith("linux") or number is None:
        return f"local allocation (no set_mempolicy for {sys.platform}/{platform.machine()})"
    mode = MPOL_PREFERRED if len(nodes) == 1 else MPOL_PREFERRED_MANY  # (several nodes: Linux 5.15+)
    mask = _nodemask(nodes)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(number), ctypes.c_long(mode), mask, ctypes.c_ulong(len(mask) * 64 + 1)) != 0:
        err = ctypes.get_errno()
        logger.warning("set_mempolicy(preferred %s) failed: %s; memory stays on the kernel's default (local) "
                       "policy", format_cpulist(nodes), os.strerror(err))
        return f"local allocation (set_mempolicy: {os.strerror(err)})"
    return f"preferred node{'s' if len(nodes) > 1 else ''} {format_cpulist(nodes)}"


def bind(p: Placement) -> str:
    """Bind the calling thread (and the threads it starts from now on) to the placement's CPUs, and prefer its
    nodes' memory. Returns the memory policy set (set_memory_policy). Raises OSError when the affinity is refused."""
    os.sched_setaffinity(0, p.cpus)
    return set_memory_policy(p.memory_nodes)


def place(local_rank: int, local_world_size: int, mode: str, root: str | os.PathLike = SYSFS) \
        -> tuple[Placement | None, str]:
    """Plan this host's ranks and bind this one (call before any weight or cache is allocated). Returns its
    placement and memory policy, or (None, why it is not bound)."""
    if mode == "off":
        return None, "NUMA binding is off"
    if not hasattr(os, "sched_setaffinity"):
        return None, "no CPU affinity on this platform"
    allowed = os.sched_getaffinity(0)
    try:
        topology = read_topology(root)
    except (OSError, ValueError) as e:  # an unreadable or unexpected sysfs: run unbound rather than not at all
        logger.warning("local rank %d: cannot read the NUMA topology (%s); it runs unbound", local_rank, e)
        return None, f"cannot read the NUMA topology: {e}"
    p = plan(topology, local_world_size, mode, allowed)
    if not p.ranks:
        logger.debug("local rank %d not bound to a NUMA node: %s", local_rank, p.reason)
        return None, p.reason
    if not 0 <= local_rank < len(p.ranks):
        logger.warning("local rank %d is outside the %d local ranks (LOCAL_RANK / LOCAL_WORLD_SIZE); it runs "
                       "unbound", local_rank, local_world_size)
        return None, f"local rank {local_rank} outside the {local_world_size} local ranks"
    mine = p.ranks[local_rank]
    try:
        memory = bind(mine)
    except OSError as e:
        logger.warning("local rank %d: binding to %s failed (%s); it runs unbound", local_rank, mine.describe(), e)
        return None, f"binding failed: {e}"
    logger.info("local rank %d bound to %s, memory %s (%s)", local_rank, mine.describe(), memory, p.reason)
    return mine, memory
