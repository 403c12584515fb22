"""Keep the replicas serving when a rank dies or hangs (rank 0 only, for ranks tpserve spawned itself).

Fault domains are replicas (--data-parallel-size): each has groups of its own (sharding/dist.py: a link to rank 0
and its TP groups), so a dead rank breaks only its replica's groups. When one of a replica's ranks exits (the
launcher's watcher sees it), a step of the replica fails (a collective or a message raised), or a step does not
return within --step-timeout (a hung rank: its replica's processes are killed, which turns the hang into a death):

1. the engine takes the replica out of rotation and hands its sequences to the live replicas as recompute
   preemptions (server/engine/replicas.py: take_down): streams continue where they stopped;
2. what is left of the replica's processes is killed (SIGKILL: a rank blocked in a collective with the dead one would
   never return);
3. with --restart-failed-ranks (the default), the replica's ranks are started again: they load their shards and
   meet rank 0 in groups of a new generation (sharding/executor.py: Executor.rejoin), and the replica returns to
   rotation with an empty KV cache. While no replica serves, requests wait (bounded by --max-queued-requests).

A replica that fails more than --max-rank-restarts times within --rank-restart-window seconds is not started again:
the server fails (non-zero exit, the reason in its log), so a supervisor above it (systemd, Kubernetes) takes over.
Without restarts, the server keeps serving on the live replicas and fails when none is left.

Everything that spawns runs on one long-lived thread: a child's PR_SET_PDEATHSIG fires when the thread that
created it exits, so a respawned rank made by a short-lived thread would be killed with that thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Callable

logger = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, engine, executor, workers, cfg, restart: bool = True, max_restarts: int = 3,
                 window_s: float = 600.0):
        self.engine, self.executor, self.workers = engine, executor, workers
        self.layout = executor.dist.layout
        # a respawned rank is told the context length rank 0 serves (it may have been lowered to fit the cache)
        self.argv = replace(cfg, max_model_len=executor.max_model_len).to_argv()
        self.restart, self.max_restarts, self.window_s = restart, max_restarts, window_s
        self.generation = [0] * self.layout.dp
        self.handling: set[int] = set()  # replicas down and not yet back
        self.restarting: set[int] = set()  # of those, the ones being started again
        self.failures: dict[int, deque[float]] = {r: deque() for r in range(self.layout.dp)}
        self.restarts = 0
        self.recovery_seconds: list[float] = []  # death to serving again, per respawn (logged, for BENCHMARKS.md)
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closing = False
        engine.on_replica_failure = self.on_replica_failure
        workers.on_death = self.rank_died
        threading.Thread(target=self._run, name="tpserve-supervisor", daemon=True).start()

    def ranks(self, replica: int) -> list[int]:
        """The replica's global ranks that are processes of their own (not rank 0)."""
        base = self.layout.rank_of(replica, 0, 0)
        return [r for r in range(base, base + self.layout.tp * self.layout.pp) if r != 0]

    # ---- reports (any thread) ----------------------------------------------------------------------------------
    def rank_died(self, rank: int, message: str) -> None:
        """The watcher saw a rank exit that nobody killed."""
        self._failed(self.layout.coords(rank)[0], message)

    def on_replica_failure(self, replica: int, reason: str) -> bool:
        """The engine's call to a replica's ranks raised. True when the replica is dealt with here (it dies, is
        killed, then started again); False when none of its ranks died, i.e. rank 0 itself failed (its own part of
        replica 0's step): that stays fatal."""
        if replica == 0 and 0 not in self.handling:
            deadline = time.monotonic() + 1.0  # rank 0 noticed first (its collective saw the peer exit): confirm
            while time.monotonic() < deadline and all(self.workers.procs[r].poll() is None for r in self.ranks(0)):
                time.sleep(0.05)
            if all(self.workers.procs[r].poll() is None for r in self.ranks(0)):
                return False
        self._failed(replica, reason)
        return True

    def on_hang(self, replica: int, reason: str) -> bool:
        """The watchdog: a step of this replica did not return in time. Kill the replica's ranks; the engine's
        wait then fails and the replica is handled as a dead one."""
        if self._closing:
            return False
        logger.error("replica %d: %s; killing its ranks", replica, reason)
        self._failed(replica, reason)
        return True

    def _failed(self, replica: int, reason: str) -> None:
        with self._lock:
            if replica in self.handling or self._closing:
                return
            self.handling.add(replica)
        self.engine.replica_down(replica, reason)
        self.workers.kill(self.ranks(replica))  # a rank waiting on the dead one would wait forever
        self._jobs.put(replica)

    # ---- the supervisor thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            replica = self._jobs.get()
            if replica is None:
                return
            self._recover(replica)

    def _give_up(self, reason: str) -> None:
        logger.error("%s", reason)
        self.engine.fail(reason)

    def _recover(self, replica: int) -> None:
        died = time.monotonic()
        while not self._closing:
            times = self.failures[replica]
            times.append(time.monotonic())
            while times and times[0] < time.monotonic() - self.window_s:
                times.popleft()
            if not self.restart:
                if len(self.handling) == self.layout.dp:
                    self._give_up("every replica has failed and --no-restart-failed-ranks is set")
                else:
                    logger.error("replica %d stays out of rotation (--no-restart-failed-ranks); %d of %d serve",
                                 replica, self.layout.dp - len(self.handling), self.layout.dp)
                return
            if len(times) > self.max_restarts:
                self._give_up(f"replica {replica} failed {len(times)} times within {self.window_s:.0f} s (more than "
                              f"--max-rank-restarts {self.max_restarts}): not restarting it")
                return
            self.generation[replica] += 1
            gen = self.generation[replica]
            self.restarting.add(replica)
            logger.warning("restarting replica %d (generation %d): ranks %s", replica, gen, self.ranks(replica))
            procs = [self.workers.spawn(rank, gen, self.argv) for rank in self.ranks(replica)]
            try:
                groups, num_blocks = self._rejoin(replica, gen, procs)
            except Exception as e:  # noqa: BLE001 - a new rank died while starting: another failure
                logger.error("replica %d failed to restart: %s", replica, e)
                self.workers.kill(self.ranks(replica))
                continue
            finally:
                self.restarting.discard(replica)
            self.restarts += 1
            self.recovery_seconds.append(time.monotonic() - died)
            logger.warning("replica %d restarted in %.1f s", replica, self.recovery_seconds[-1])
            with self._lock:
                self.handling.discard(replica)
            self.engine.replica_up(replica, groups, num_blocks)
            return

    def _rejoin(self, replica: int, gen: int, procs) -> tuple:
        """executor.rejoin on a thread of its own, given up on as soon as one of the new processes exits (before it
        reaches the rendezvous, rank 0 would wait for it until the collective timeout)."""
        result: dict = {}

        def run() -> None:
            try:
                result["value"] = self.executor.rejoin(replica, gen)
            except Exception as e:  # noqa: BLE001 - handed over below
                result["error"] = e

        t = threading.Thread(target=run, name=f"tpserve-rejoin-{replica}", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.1)
            dead = [p for p in procs if p.poll() is not None]
            if t.is_alive() and (dead or self._closing):
                raise RuntimeError("stopping" if self._closing else
                                   f"pid {dead[0].pid} exited with code {dead[0].returncode} while starting")
        if "error" in result:
            raise result["error"]
        return result["value"]

    def close(self) -> None:
        """At shutdown: no more restarts; a replica that is starting again is killed (it would never be told to
        stop: it has not joined)."""
        self._closing = True
        self._jobs.put(None)
        for replica in list(self.restarting):
            self.workers.kill(self.ranks(replica))

    def describe(self) -> dict:
        return {"replicas": self.layout.dp, "replicas_alive": self.engine.replicas.alive,
                "restarting": sorted(self.restarting), "replica_failures": self.engine.replicas.failures}


def watch_steps(engine, step_timeout: float, on_hang: Callable[[int, str], bool] | None = None) -> None:
    """A thread that notices a step (or heartbeat) that has not returned in time: a hung rank leaves rank 0 inside a
    collective, and nothing else would notice. `on_hang(replica, reason)` may deal with it (Supervisor.on_hang kills
    the replica's ranks, which turns the hang into the failure of a dead replica) and returns True; else the engine
    is declared dead."""
    def loop() -> None:
        handled: float | None = None
        while engine.dead is None and not engine.stopping:
            started, replica = engine.step_started, engine.replicas.waiting_on
            if started is not None and time.monotonic() - started > step_timeout and started != handled:
                reason = f"no step result from the ranks within {step_timeout:.0f} s (a rank hangs)"
                if replica is None or on_hang is None or not on_hang(replica, reason):
                    engine.fail(reason)
                    return
                handled = started
            time.sleep(0.2)

    threading.Thread(target=loop, name="tpserve-watchdog", daemon=True).start()
