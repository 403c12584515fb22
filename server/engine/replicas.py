"""Rank 0's view of the replicas: their block pools, their lanes, which are down, and a call to their ranks that
tells a dead replica from a failed server.

Lanes. Every replica (--data-parallel-size) has one block pool and one lane per pipeline stage
(--pipeline-parallel-size): a lane is a scheduler over its own sequences, with at most one step in flight. With P
stages, P steps of disjoint sequences are in the pipeline at once, so no stage idles (vLLM's "virtual engines");
with D replicas, D steps run at once. A new request goes to the lane with the least work (running + waiting).

Fault isolation (server/engine/supervisor.py respawns a dead replica). A replica whose ranks died leaves rotation:
its pool is forgotten (the blocks held its dead ranks' K/V) and every sequence it held goes to a live replica as a
recompute preemption (prompt plus the tokens already generated, so the stream continues where it stopped). While no
replica serves, sequences are parked until one is back.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from server.engine.block_manager import BlockManager
from server.engine.request import WAITING, Sequence
from server.engine.scheduler import Scheduler
from sharding.dist import install_groups

if TYPE_CHECKING:
    from sharding.executor import Executor

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Lane:
    """A scheduler of one replica with at most one step in flight."""

    index: int
    replica: int
    scheduler: Scheduler
    busy: bool = False

    @property
    def load(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)


class Replicas:
    def __init__(self, executor: Executor, new_scheduler: Callable[[BlockManager, int], Scheduler],
                 enable_prefix_caching: bool):
        """`new_scheduler(pool, stage)`: an empty scheduler over a replica's pool for one pipeline stage's lane."""
        self.executor = executor
        layout = executor.dist.layout
        self.stages = layout.pp
        self._new_scheduler = new_scheduler
        self.pools = [BlockManager(executor.num_blocks, executor.block_size, enable_prefix_caching)
                      for _ in range(layout.dp)]
        self.lanes = [Lane(r * layout.pp + v, r, new_scheduler(self.pools[r], v))
                      for r in range(layout.dp) for v in range(layout.pp)]
        # launch order: other replicas first (a message each), replica 0's lanes last (its first stage runs here)
        self.launch_order = sorted(self.lanes, key=lambda lane: (lane.replica == 0, lane.index))
        self.down: dict[int, str] = {}  # replica -> why it is down
        self.failures = 0
        self.parked: deque[Sequence] = deque()  # no replica serves: they wait for one to come back
        # set by the engine: (replica, reason) -> True when the replica's ranks died (the supervisor respawns them),
        # and what to do then (take it down now, or between steps)
        self.judge: Callable[[int, str], bool] = lambda replica, reason: False
        self.on_down: Callable[[int, str], None] = lambda replica, reason: None
        self.waiting_on: int | None = None  # the replica whose launch or result the engine waits for
        self._past = {"preemptions": 0, "prefix_queries": 0, "prefix_hits": 0}  # of replaced schedulers and pools

    # ---- counts (any thread) -----------------------------------------------------------------------------------
    def live(self) -> list[int]:
        return [r for r in range(len(self.pools)) if r not in self.down]

    @property
    def alive(self) -> int:
        return len(self.pools) - len(self.down)

    @property
    def pool_tokens(self) -> int:
        """Tokens one replica's KV cache holds."""
        return self.pools[0].num_blocks * self.pools[0].block_size

    @property
    def num_running(self) -> int:
        return sum(len(lane.scheduler.running) for lane in self.lanes)

    @property
    def num_waiting(self) -> int:
        return sum(len(lane.scheduler.waiting) for lane in self.lanes) + len(self.parked)

    @property
    def num_preemptions(self) -> int:
        return self._past["preemptions"] + sum(lane.scheduler.num_preemptions for lane in self.lanes)

    @property
    def prefix_query_tokens(self) -> int:
        return self._past["prefix_queries"] + sum(p.prefix_query_tokens for p in self.pools)

    @property
    def prefix_hit_tokens(self) -> int:
        return self._past["prefix_hits"] + sum(p.prefix_hit_tokens for p in self.pools)

    def kv_usage(self, replica: int | None = None) -> float:
        """Fraction of KV-cache blocks held by sequences (cached free blocks count as free): of one replica's
        pool, or the mean over the replicas."""
        if replica is not None:
            return self.pools[replica].usage()
        return sum(p.usage() for p in self.pools) / len(self.pools)

    def replica_load(self, replica: int) -> tuple[int, int]:
        """(running, waiting) of one replica."""
        lanes = [lane for lane in self.lanes if lane.replica == replica]
        return sum(len(x.scheduler.running) for x in lanes), sum(len(x.scheduler.waiting) for x in lanes)

    # ---- placement and calls (the engine thread) ---------------------------------------------------------------
    def place(self, seq: Sequence) -> None:
        """Give a sequence to the least loaded lane of a live replica (the first of equals), or park it while no
        replica serves."""
        live = [lane for lane in self.lanes if lane.replica not in self.down]
        if not live:
            self.parked.append(seq)
            return
        lane = min(live, key=lambda x: x.load)
        seq.lane = lane.index
        lane.scheduler.add(seq)

    def call(self, replica: int, fn: Callable, *args, down: Callable[[int, str], None] | None = None
             ) -> tuple[object, bool]:
        """(result, True) of a executor call that talks to one replica's ranks (a launch, a result, a heartbeat, an
        adapter). When it fails and the supervisor finds that the replica's ranks died (or killed them for
        hanging), the replica is taken down (`down`, else `on_down`): (None, False). Without a supervisor (the
        offline LLM, torchrun), or when no rank of the replica died (rank 0's own failure), the error is raised and
        fails the engine."""
        self.waiting_on = replica
        try:
            return fn(*args), True
        except Exception as e:  # noqa: BLE001 - judged below
            reason = f"replica {replica}: {type(e).__name__}: {e}"
            if not self.judge(replica, reason):
                raise
            (down or self.on_down)(replica, reason)
            return None, False
        finally:
            self.waiting_on = None

    def take_down(self, replica: int, reason: str) -> None:
        """Out of rotation: a fresh pool and empty schedulers; the sequences it held (their clients still waiting)
        go to the live replicas as recompute preemptions, or are parked while none serves."""
        logger.error("replica %d is out of rotation: %s", replica, reason)
        self.down[replica] = reason
        self.failures += 1
        self.executor.forget_sends(replica)
        moved: list[Sequence] = []
        for lane in self.lanes:
            if lane.replica == replica:
                moved += [s for s in list(lane.scheduler.running) + list(lane.scheduler.waiting) if not s.finished]
                lane.busy = False
        self.reset(replica, self.executor.num_blocks)
        for seq in sorted(moved, key=lambda s: s.arrival):
            seq.status, seq.row, seq.num_computed = WAITING, -1, 0
            seq.num_preemptions += 1
            self._past["preemptions"] += 1
            self.place(seq)
        if moved:
            logger.warning("%d sequence(s) of replica %d recompute elsewhere%s", len(moved), replica,
                           "" if self.live() else " once a replica serves again")

    def bring_up(self, replica: int, groups, num_blocks: int, prepare: Callable[[int], None] | None = None) -> None:
        """A respawned replica: its new groups installed, an empty pool, `prepare(replica)` (its ranks read every
        LoRA adapter the others hold; a failure there takes it down again), then back into rotation with whatever
        was parked."""
        install_groups(self.executor.dist, groups)
        self.reset(replica, num_blocks)
        self.down.pop(replica, None)
        if prepare is not None:
            prepare(replica)
            if replica in self.down:
                return
        logger.warning("replica %d serves again", replica)
        parked, self.parked = self.parked, deque()
        for seq in parked:
            if not seq.finished:
                self.place(seq)

    def reset(self, replica: int, num_blocks: int) -> None:
        """A fresh pool (an empty prefix cache) and empty schedulers for a replica."""
        old = self.pools[replica]
        self._past["prefix_queries"] += old.prefix_query_tokens
        self._past["prefix_hits"] += old.prefix_hit_tokens
        self.pools[replica] = BlockManager(num_blocks, self.executor.block_size, old.enable_prefix_caching)
        for lane in self.lanes:
            if lane.replica == replica:
                propose, admit = lane.scheduler.propose, lane.scheduler.admit
                self._past["preemptions"] += lane.scheduler.num_preemptions
                lane.scheduler = self._new_scheduler(self.pools[replica], lane.index % self.stages)
                lane.scheduler.propose, lane.scheduler.admit = propose, admit
