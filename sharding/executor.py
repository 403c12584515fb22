"""Rank 0's side of the wire: the `Executor` the engine (server/engine/core.py) drives.

Rank 0 drives every replica: replica 0's first stage runs here, on rank 0's own `ModelRunner` (sharding/runner.py;
its TP peers get the step by broadcast), another replica's first stage gets the step from here point to point. A step
is launched, then collected: with pipeline stages or other replicas, its logits come back from the last stage later,
and rank 0 meanwhile launches other steps (server/engine/core.py keeps up to pp steps per replica in flight).
Between steps it sends commands (a heartbeat, LoRA adapters in and out of slots, shutdown) and meets a respawned
replica's new processes (`rejoin`). The other ranks' side is sharding/worker.py.
"""

from __future__ import annotations

import datetime
import itertools
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from sharding.dist import Dist, ReplicaGroups, make_replica_groups
from sharding.runner import EngineConfig, ModelRunner, start_rank
from sharding.wire import (CMD_LORA_LOAD, CMD_LORA_UNLOAD, CMD_NOOP, CMD_SHUTDOWN, Step, pack_command,
                           send_step)

REPORT_POLL_S = 0.5  # a wait for the ranks' LoRA load reports looks this often whether their replica is going down

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from sharding.layers.lora import LoraManager
    from sharding.models.interface import CausalLM
    from sharding.progress import StartPhases


def _of_runner(name: str) -> property:
    """A read-only attribute of rank 0's own ModelRunner, read through the executor."""
    return property(lambda self: getattr(self.runner, name))


class Executor:
    """Every rank's steps and commands, driven from rank 0: its own ModelRunner (`runner`) executes replica 0's first
    stage, the wire carries the rest. What the server reads of the model and its cache (num_blocks, block_size,
    max_model_len, cfg, config, ...) reads through to `runner`."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.dist: Dist = runner.dist
        self._message = torch.zeros(Step.message_size(runner.cfg.max_num_seqs), dtype=torch.int64)  # sharding/wire.py
        self._order = 0  # launches and no-wait commands, numbered (Launched.order)
        self._unwaited: dict[int, list] = {}  # replica -> [(order, send work, tensor)] of commands not waited for yet
        # LoRA load tickets: from a random start, so that no report left in a store that outlives this process (a
        # torchrun agent's) answers for a load of this one
        self._tickets = itertools.count(secrets.randbits(40) << 16 | 1)

    # ---- what the server reads of rank 0's model and cache: rank 0's own ModelRunner's ---------------------------
    cfg: EngineConfig = _of_runner("cfg")
    config: PretrainedConfig = _of_runner("config")
    model: CausalLM = _of_runner("model")
    dtype: torch.dtype = _of_runner("dtype")
    vocab_size: int = _of_runner("vocab_size")
    max_model_len: int = _of_runner("max_model_len")
    num_blocks: int = _of_runner("num_blocks")
    block_size: int = _of_runner("block_size")
    block_table: torch.Tensor = _of_runner("block_table")
    lora: LoraManager | None = _of_runner("lora")
    thread_id: int = _of_runner("thread_id")  # steps are fastest on it (server/engine/thread.py: EngineThread)
    phases: StartPhases = _of_runner("phases")
    load_seconds: float = _of_runner("load_seconds")
    bytes_read: int = _of_runner("bytes_read")
    seq_parallel_steps: int = _of_runner("seq_parallel_steps")

    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes()

    # ---- steps ---------------------------------------------------------------------------------------------------
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
            out = self.runner.execute(step)
            if d.last_stage:
                if isinstance(out, tuple):  # embedding sequences' pooled rows beside the logits
                    return Launched(step, replica, out[0], sends, out[1])
                return Launched(step, replica, out, sends)
            sends = send_step(d, step, self._message.numel(), d.peer(pp_rank=1), out, isend=True)
        else:
            sends = send_step(d, step, self._message.numel(), d.layout.rank_of(replica, 0, 0), None, isend=True)
        return Launched(step, replica, None, sends)

    def collect(self, launched: "Launched") -> torch.Tensor:
        """The launched step's logits (float32 [rows, vocab]): at once, or received from its last stage; the pooled
        rows of its embedding sequences, if any, arrive in `launched.pooled` (float32 [rows, hidden])."""
        logits = launched.logits
        if logits is None:
            rows, pooled = launched.step.num_logits(), launched.step.num_hidden()
            logits = torch.empty(rows, self.runner.vocab_size, dtype=torch.float32)
            src = self.dist.layout.rank_of(launched.replica, self.dist.pp_size - 1, 0)
            if rows:
                self.dist.recv(logits, src)
            if pooled:
                launched.pooled = torch.empty(pooled, self.runner.config.hidden_size, dtype=torch.float32)
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

    def _command(self, cmd: int, replicas: list[int] | None = None, payload: torch.Tensor | None = None,
                 wait: bool = True) -> None:
        """A command to every rank of `replicas` (default: all): by broadcast to replica 0's first stage, point to
        point to the other replicas' first stages; every stage passes it on to the next.

        `wait=False` between steps in flight (the LoRA commands): a gloo send may wait for its receiver, and a
        replica's first stage can be blocked passing an earlier step on to a stage that is itself blocked sending
        logits to rank 0, which would be blocked here. The sends are waited for when a step launched after them
        completes (collect)."""
        parts = pack_command(cmd, payload, self._message.numel())
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
    def lora_load(self, slot: int, path: str, replicas: list[int], local: bool = True) -> LoadTicket | None:
        """Rank 0 reads its own blocks of the adapter into `slot` (`local`; raising, with nothing sent, if it
        cannot), then tells `replicas`' ranks to read theirs. Each of them reports how it fared under the ticket
        returned (None: no other rank was asked), which `lora_reports` reads: a rank that cannot read its part
        fails that load, not its replica."""
        from sharding.layers.lora import encode_load

        if local:
            self.runner.lora.load(slot, path)
        if self.dist.global_world_size > 1 and replicas:
            layout = self.dist.layout
            ranks = [r for replica in replicas for p in range(layout.pp) for t in range(layout.tp)
                     if (r := layout.rank_of(replica, p, t)) != 0]
            ticket = LoadTicket(next(self._tickets), ranks) if ranks else None
            self._command(CMD_LORA_LOAD, replicas, encode_load(slot, path, ticket.id if ticket else 0), wait=False)
            return ticket
        return None

    def lora_reports(self, ticket: LoadTicket, wait: bool, gone: Callable[[], bool] = lambda: False
                     ) -> dict[int, str] | None:
        """The ranks' reports of a load (sharding/layers/lora.py: report_load): None while some rank has not
        reported, else {rank: why} of the ranks that could not read their part (empty: every rank did). `wait`:
        wait for them (only while none of those replicas' steps is in flight: a rank blocked handing rank 0 an
        earlier step's logits would never report), until `gone()` says the replica is being taken down, or the
        collective timeout (RuntimeError either way)."""
        from sharding.layers.lora import LOAD_OK, load_report_key

        store = self.dist.store
        keys = [load_report_key(ticket.id, r) for r in ticket.ranks]
        if wait:
            deadline = time.monotonic() + self.dist.timeout.total_seconds()
            while not store.check(keys):
                if gone() or time.monotonic() > deadline:
                    raise RuntimeError(f"rank(s) {', '.join(map(str, ticket.ranks))} did not report reading a LoRA "
                                       "adapter")
                try:
                    store.wait(keys, datetime.timedelta(seconds=REPORT_POLL_S))
                except RuntimeError:  # DistStoreError: not yet (a store gone fails the next check)
                    pass
        elif not store.check(keys):
            return None
        failed = {}
        for rank, key in zip(ticket.ranks, keys):
            value = store.get(key).decode(errors="replace")
            store.delete_key(key)
            if value != LOAD_OK:
                failed[rank] = value
        return failed

    def lora_unload(self, slot: int, replicas: list[int]) -> None:
        if not replicas:
            self.runner.lora.unload(slot)
        if self.dist.global_world_size > 1 and replicas:
            self._command(CMD_LORA_UNLOAD, replicas, torch.tensor([slot], dtype=torch.int64), wait=False)

    def forget_sends(self, replica: int) -> None:
        """A dead replica's unwaited command sends (_command): never waited for."""
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


@dataclass(slots=True)
class LoadTicket:
    """A LoRA load sent to other ranks: its id (in the command and the keys the ranks report under) and the ranks
    that report."""

    id: int
    ranks: list[int]


@dataclass(slots=True)
class Launched:
    """A step on its way: its logits when they are already here, else where they will come from."""

    step: Step
    replica: int
    logits: torch.Tensor | None
    sends: list  # isend works to wait for before the buffers may go
    pooled: torch.Tensor | None = None  # embedding sequences' pooled rows (collect fills them in from a last stage)
    order: int = 0  # launches and commands are numbered (Executor._order): commands sent before it are done by then


def start_executor(cfg: EngineConfig, dist: Dist) -> Executor:
    """Rank 0's start: its own rank's model and cache, as every rank's (sharding/runner.py start_rank), then the
    executor that drives them all."""
    return Executor(start_rank(cfg, dist))
