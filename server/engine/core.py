"""Rank 0's engine: the loop that schedules, executes and updates, one lane at a time, in a thread of its own.

    schedule: Scheduler.schedule() -> SchedulerOutput         (server/engine/scheduler.py)
    execute:  executor.launch(SchedulerOutput.to_step()) ... executor.collect() -> StepOutput.split()
    update:   sample_step() -> Scheduler.update_from_output() -> each sequence's `emit`

Requests enter through `add()` from any thread; each step's new text reaches its sequence's `emit` callback from the
engine thread. Each step launches on every idle lane (server/engine/replicas.py: one per replica and pipeline stage;
other replicas' first, then replica 0's, whose first stage runs here), then completes the oldest step in flight. With
one lane, launch computes the logits and completion samples them at once. When idle the engine sends a heartbeat to
the other ranks every second, so they can tell a quiet server from a dead one. If a step fails and no replica's
ranks died (rank 0's own failure) the engine is dead: every sequence ends with finish_reason "error" and `on_fatal`
is called.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Callable

from server.engine.lora_registry import LoraRegistry, LoraSlots
from server.engine.outputs import SchedulerOutput, StepOutput
from server.engine.replicas import Lane, Replicas
from server.engine.request import Sequence
from server.engine.scheduler import (DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING,
                                     Scheduler, attention_depth_tokens)
from server.engine.spec_decode.proposers import SpeculativeConfig, Speculator
from server.engine.step_sampler import sample_step
from server.engine.structured.grammar import Grammars
from server.engine.thread import EngineThread
from server.engine.tokenizer import eos_token_ids
from sharding.executor import Executor, Launched

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0


@dataclass(slots=True)
class InFlight:
    lane: Lane
    batch: SchedulerOutput
    launched: Launched
    started: float


class Engine:
    def __init__(self, executor: Executor, tokenizer, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, on_fatal: Callable[[str], None] | None = None,
                 max_prefill_tokens_while_decoding: int | str | None = DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING,
                 speculative: SpeculativeConfig | None = None):
        self.executor, self.tokenizer, self.max_model_len = executor, tokenizer, executor.max_model_len
        seqs = executor.cfg.max_num_seqs
        step_tokens = max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, seqs)
        depth = attention_depth_tokens(executor.config)
        self.replicas = Replicas(executor, lambda pool, stage: Scheduler(
            seqs, step_tokens, pool, max_prefill_tokens_while_decoding, depth, stage * seqs, self.max_model_len),
            enable_prefix_caching)
        self.replicas.judge = lambda replica, reason: (self.dead is None and self.on_replica_failure is not None
                                                       and self.on_replica_failure(replica, reason))
        self.replicas.on_down = self._replica_down
        self.lanes = self.replicas.lanes
        self.on_replica_failure: Callable[[int, str], bool] | None = None  # the supervisor (engine/supervisor.py)
        self.loras: LoraSlots | None = None  # with --enable-lora (enable_lora)
        self.speculator: Speculator | None = None
        if speculative is not None:
            draft = None
            if speculative.method == "draft_model":
                from server.engine.spec_decode.draft_model import DraftModel

                draft = DraftModel(speculative.model, executor, tokenizer, seqs * len(self.lanes))
            self.speculator = Speculator(speculative, draft)
            for lane in self.lanes:  # the scheduler asks for drafts with the step's token budget left
                lane.scheduler.propose = partial(self.speculator.drafts_for, max_model_len=self.max_model_len)
        self._inflight: deque[InFlight] = deque()
        self.eos_ids = eos_token_ids(executor.cfg.model, tokenizer)
        self.grammars = Grammars(tokenizer, executor.config.vocab_size, self.eos_ids)
        self.on_fatal = on_fatal
        self.dead: str | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake, self._stop, self._die_lock = threading.Event(), threading.Event(), threading.Lock()
        self._loop_done: threading.Event | None = None
        self.loop_thread_id: int | None = None
        self.step_listeners: list[Callable[[float, int], None]] = []  # (seconds, tokens) after each step
        self.step_started: float | None = None  # while a step or heartbeat waits on the ranks (the watchdog reads it)

    # ---- requests and counts (any thread) ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.eos_ids = self.eos_ids
        self._post("add", seq)

    def abort(self, seq: Sequence) -> None:
        self._post("abort", seq)

    def replica_down(self, replica: int, reason: str) -> None:
        """The supervisor saw a rank of it exit: out of rotation, between steps."""
        self._post("down", (replica, reason))

    def replica_up(self, replica: int, groups, num_blocks: int) -> None:
        """The supervisor's respawned replica has joined: back into rotation, between steps."""
        self._post("up", (replica, groups, num_blocks))

    def call_soon(self, fn: Callable[[], object]) -> Future:
        """Run fn() on the engine thread between steps; its result arrives in the future."""
        future: Future = Future()
        self._post("call", (fn, future))
        return future

    def _post(self, kind: str, what) -> None:
        self._inbox.put((kind, what))
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def num_waiting(self) -> int:
        return self.replicas.num_waiting + self._inbox.qsize()

    # ---- the loop (the engine thread) --------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, what = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add" and self.dead:
                self._finish(what, "error")
            elif kind == "add":
                self.replicas.place(what)
            elif kind == "abort":
                if not what.finished:
                    self._finish(what, "abort")
            elif kind == "down":
                self._replica_down(*what)
            elif kind == "up":
                self._replica_up(*what)
            elif kind == "call":  # a function for this thread (the LoRA endpoints), and the future of its result
                fn, future = what
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as e:  # noqa: BLE001 - handed to the caller
                        future.set_exception(e)

    def step(self, launch: bool = True) -> bool:
        """Launch a step on every idle lane that has work (unless `launch` is False: stopping), then complete the
        oldest step in flight; False when nothing was in flight."""
        self._drain_inbox()
        self.step_started = time.monotonic()
        try:
            for lane in self.replicas.launch_order if launch else ():
                if not lane.busy and lane.replica not in self.replicas.down:
                    batch = lane.scheduler.schedule()
                    if batch.items and lane.replica not in self.replicas.down:  # (not taken down while scheduled)
                        t0 = time.perf_counter()
                        launched, ok = self.replicas.call(lane.replica, self.executor.launch, batch.to_step(),
                                                          lane.replica)
                        if ok:
                            lane.busy = True
                            self._inflight.append(InFlight(lane, batch, launched, t0))
            if not self._inflight:
                return False
            self._complete(self._inflight.popleft())
            return True
        finally:
            self.step_started = None

    def _complete(self, f: InFlight) -> None:
        """Execute's end and update: the step's rows back to their sequences, new tokens chosen and appended."""
        logits, ok = self.replicas.call(f.lane.replica, self.executor.collect, f.launched)
        if not ok:
            return
        f.lane.busy = False
        out = StepOutput.split(f.batch, f.launched.step, logits, f.launched.pooled)
        new = sample_step(f.batch, out, self.grammars)
        advanced = f.lane.scheduler.update_from_output(f.batch, out, new)
        if self.speculator is not None:
            for item in f.batch.items:
                if item.drafts and item.seq.seq_id in new:
                    self.speculator.verified(item.seq, len(item.drafts), new[item.seq.seq_id].accepted)
        for seq in advanced:
            if not seq.finished:
                self._emit(seq, seq.detok.release(), False)
                continue
            if self.speculator is not None and seq.pooling is None:
                self.speculator.finished(seq)
            self._emit(seq, "" if seq.pooling is not None else seq.detok.release(final=True), True)
        dt = time.perf_counter() - f.started
        f.lane.scheduler.observe(f.batch, dt)  # the measured prefill cap (scheduler.StepCosts)
        for listener in self.step_listeners:
            listener(dt, f.launched.step.num_tokens)

    @staticmethod
    def _emit(seq: Sequence, text: str, finished: bool) -> None:
        try:
            seq.emit(seq, text, finished)
        except Exception:  # noqa: BLE001 - a client's callback must not take the engine down
            logger.exception("emit failed")

    def _finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence from outside its steps (an abort, an error): blocks back, the client told."""
        seq.finish_reason = reason
        if seq in self.replicas.parked:
            self.replicas.parked.remove(seq)
        self.lanes[seq.lane].scheduler.free(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        self._emit(seq, seq.detok.release(final=True) if reason not in ("abort", "error") else "", True)

    def run_until_idle(self) -> None:
        """Step until every added sequence has finished (the offline path, in the caller's thread)."""
        while self.step():
            pass

    # ---- LoRA adapters and replicas ----------------------------------------------------------------------------
    def enable_lora(self, registry: LoraRegistry) -> None:
        self.loras = LoraSlots(registry, self.replicas, self._finish, self.replica_down)
        for lane in self.lanes:
            lane.scheduler.admit = self.loras.admit

    def _replica_down(self, replica: int, reason: str) -> None:
        """Its steps in flight are dropped (their results will not come) and its sequences recompute elsewhere."""
        if replica not in self.replicas.down:
            self._inflight = deque(f for f in self._inflight if f.lane.replica != replica)
            self.replicas.take_down(replica, reason)

    def _replica_up(self, replica: int, groups, num_blocks: int) -> None:
        self.replicas.bring_up(replica, groups, num_blocks, self.loras.reload if self.loras is not None else None)

    # ---- background thread (the server) ------------------------------------------------------------------------
    def start(self, thread: EngineThread | None = None) -> None:
        """Step in the background: on `thread` (the one that loaded the model, see EngineThread) or a new one."""
        self._loop_done = threading.Event()
        if thread is None:
            thread = EngineThread()
            thread.submit(self._loop)
            thread.close()
        else:
            thread.submit(self._loop)

    def _loop(self) -> None:
        self.loop_thread_id = threading.get_ident()
        if self.loop_thread_id != self.executor.thread_id:
            logger.warning("the engine steps on another thread than the one that loaded the model: CPU steps run "
                           "slower (see EngineThread)")
        last = time.monotonic()
        try:
            while not self._stop.is_set() or self._inflight:  # steps in flight are completed before leaving
                if self.step(launch=not self._stop.is_set()):
                    last = time.monotonic()
                    continue
                if self._stop.is_set():
                    break
                self._wake.wait(timeout=HEARTBEAT_S)
                self._wake.clear()
                if not self._inbox.empty() or self._stop.is_set():
                    continue
                if time.monotonic() - last >= HEARTBEAT_S:
                    self.step_started = time.monotonic()
                    for replica in self.replicas.live():
                        self.replicas.call(replica, self.executor.heartbeat, [replica])
                    self.step_started = None
                    last = time.monotonic()
        except Exception as e:  # noqa: BLE001 - a dead rank or a failed collective: nothing can step any more
            self.fail(f"engine step failed: {e}")
        finally:
            if self._loop_done is not None:
                self._loop_done.set()

    def fail(self, reason: str) -> None:
        """Fail everything in flight and report once; safe to call from any thread, any number of times."""
        with self._die_lock:
            if self.dead is not None:
                return
            self.dead = reason
        logger.error("%s", reason)
        for lane in self.lanes:
            for seq in list(lane.scheduler.running) + list(lane.scheduler.waiting):
                self._finish(seq, "error")
        for seq in list(self.replicas.parked):
            self._finish(seq, "error")
        self._drain_inbox()
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop thread (requests in flight are not waited for: drain first)."""
        self._stop.set()
        self._wake.set()
        if self._loop_done is not None:
            self._loop_done.wait(timeout)
