"""Rank 0's engine: the schedulers, the model runner and the sampler, stepping in a thread of their own.

Requests enter through `add()` from any thread; each step's new text reaches its sequence's `emit` callback from the
engine thread.

Lanes. Every replica (--data-parallel-size) has one block pool and one lane per pipeline stage
(--pipeline-parallel-size): a lane is a scheduler over its own sequences, with at most one step in flight. The
engine launches a step on every idle lane (another replica's first, then its own replica's, whose first stage runs
here), then completes the oldest step in flight: receives its logits, samples, and so on. With P stages, P steps of
disjoint sequences are in the pipeline at once, so no stage idles (vLLM's "virtual engines"); with D replicas, D
steps run at once. With neither, one lane: launch computes the logits and completion samples them at once. A new
request goes to the lane with the least work (running + waiting). When idle the engine sends a heartbeat to the other ranks every second, so they can tell a quiet
server from a dead one. If a step fails (a rank died, a collective timed out) the engine is dead: every sequence ends
with finish_reason "error" and `on_fatal` is called.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from server.engine.block_manager import BlockManager
from server.engine.structured.grammar import Grammars
from server.engine.sampler import SampleRow, sample
from server.engine.outputs import Scheduled, SchedulerOutput, StepOutput
from server.engine.request import WAITING, Sequence
from server.engine.scheduler import Scheduler
from server.engine.spec_decode.proposers import SpeculativeConfig, Speculator
from sharding.executor import Executor, Launched

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0

# Tokens per step (--max-num-batched-tokens): decoding sequences first, then prefill chunks; large enough that a
# prefill with nothing else running goes at full speed. While sequences decode, a step's prefill tokens are capped
# (--max-prefill-tokens-while-decoding) so a long prompt arriving keeps every stream's inter-token gap within a few
# decode steps (BENCHMARKS.md, "A long prompt arrives").
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING = 64


class EngineThread:
    """The one thread of rank 0's server process that runs torch work: loading the model, then the engine loop.

    Why one thread: torch's CPU kernels run on libgomp, which keeps a team of OpenMP worker threads per thread that
    has run a parallel region, and once it manages more threads than there are cores it stops spinning between
    regions (its throttled spin count) and parks workers in the kernel instead. A process that loaded the model on
    its main thread and stepped in another one ran SmolLM2's batch-1 step in 24 ms instead of 16-18 ms on 2 cores
    (and every served token paid it). Jobs run in order; a daemon, so Ctrl-C during a long load is not held up."""

    def __init__(self, name: str = "tpserve-engine"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if fn is None:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                    future.set_exception(e)

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((lambda: fn(*args), future))
        return future

    def call(self, fn: Callable, *args):
        """Run fn(*args) on this thread and return its result (or raise its exception) in the caller's."""
        return self.submit(fn, *args).result()

    def close(self) -> None:
        self._jobs.put((None, None))


def eos_token_ids(model_path: str, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json (an int or a list) and the tokenizer."""
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_path)
        eos = gen.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def attention_depth_tokens(config) -> int | None:
    """The context length at which one token's attention costs as many multiply-adds as its linears (a Llama-shaped
    layer: q/k/v/o and a gated MLP against 2 x heads x head_dim per cached key). SmolLM2-135M: ~3100 tokens."""
    try:
        h, inter = config.hidden_size, config.intermediate_size
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        d = getattr(config, "head_dim", None) or h // heads
    except AttributeError:
        return None
    linears = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * inter
    return max(1, linears // (2 * heads * d))


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


@dataclass(slots=True)
class InFlight:
    lane: Lane
    batch: SchedulerOutput
    launched: Launched
    started: float


class Engine:
    def __init__(self, runner: Executor, tokenizer, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, on_fatal: Callable[[str], None] | None = None,
                 max_prefill_tokens_while_decoding: int | None = DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING,
                 speculative: SpeculativeConfig | None = None):
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = runner.max_model_len
        layout = runner.dist.layout
        self.pools = [BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching)
                      for _ in range(layout.dp)]
        self.blocks = self.pools[0]
        step_tokens = max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, runner.cfg.max_num_seqs)
        seqs = runner.cfg.max_num_seqs

        def scheduler(replica: int, v: int) -> Scheduler:  # (again for a respawned replica: an empty one)
            return Scheduler(seqs, step_tokens, self.pools[replica], max_prefill_tokens_while_decoding,
                             attention_depth_tokens(runner.config), first_row=v * seqs)
        self._new_scheduler = scheduler
        self.lanes = [Lane(r * layout.pp + v, r, scheduler(r, v)) for r in range(layout.dp) for v in range(layout.pp)]
        # fault isolation (server/engine/supervisor.py): replicas out of rotation, and the sequences that wait for one
        self.down: dict[int, str] = {}  # replica -> why it is down
        self.replica_failures = 0
        self._parked: deque[Sequence] = deque()  # no replica serves: they wait for one to come back
        self.on_replica_failure: Callable[[int, str], None] | None = None  # the supervisor respawns it
        self._waiting_on: int | None = None  # the replica whose launch or result the engine waits for
        self._past = {"preemptions": 0, "prefix_queries": 0, "prefix_hits": 0}  # of replaced schedulers and pools
        self.loras = None  # server/engine/lora_registry.py LoraRegistry, with --enable-lora (enable_lora)
        self.scheduler = self.lanes[0].scheduler  # the step budget and caps every lane shares (for the start line)
        self.speculative = speculative
        draft = None
        if speculative is not None and speculative.method == "draft_model":
            from server.engine.spec_decode.draft_model import DraftModel

            draft = DraftModel(speculative.model, runner, tokenizer, runner.cfg.max_num_seqs * len(self.lanes))
        self.speculator = Speculator(speculative, draft) if speculative is not None else None
        if self.speculator is not None:
            for lane in self.lanes:
                lane.scheduler.propose = self._propose
        # what verification found (server/api/metrics.py exports these as vLLM's spec_decode counters)
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted_tokens = 0
        self.spec_accepted_per_position = [0] * (speculative.num_speculative_tokens if speculative else 0)
        # launch order: other replicas first (a message each), replica 0's lanes last (its first stage runs here)
        self._launch_order = sorted(self.lanes, key=lambda lane: (lane.replica == 0, lane.index))
        self._inflight: deque[InFlight] = deque()
        self.eos_ids = eos_token_ids(runner.cfg.model, tokenizer)
        self.grammars = Grammars(tokenizer, runner.config.vocab_size, self.eos_ids)
        self.on_fatal = on_fatal
        self.dead: str | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._loop_done: threading.Event | None = None
        self.loop_thread_id: int | None = None
        self.step_listeners: list[Callable[[float, int], None]] = []  # (seconds, tokens) after each step
        self._step_started: float | None = None
        self._die_lock = threading.Lock()

    # ---- requests (any thread) ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.eos_ids = self.eos_ids
        self._inbox.put(("add", seq))
        self._wake.set()

    def abort(self, seq: Sequence) -> None:
        self._inbox.put(("abort", seq))
        self._wake.set()

    @property
    def num_running(self) -> int:
        return sum(len(lane.scheduler.running) for lane in self.lanes)

    @property
    def num_waiting(self) -> int:
        return (sum(len(lane.scheduler.waiting) for lane in self.lanes) + self._inbox.qsize()
                + len(self._parked))

    @property
    def replicas_alive(self) -> int:
        return len(self.pools) - len(self.down)

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

    @property
    def pool_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    # ---- the loop ----------------------------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, seq = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                if self.dead:
                    self._finish(seq, "error")
                else:
                    self._place(seq)
            elif kind == "abort":
                if not seq.finished:
                    self._finish(seq, "abort")
            elif kind == "down":
                self._replica_down(*seq)
            elif kind == "up":
                self._replica_up(*seq)
            elif kind == "call":  # a function for this thread (the LoRA endpoints), and the future of its result
                fn, future = seq
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as e:  # noqa: BLE001 - handed to the caller
                        future.set_exception(e)

    def call_soon(self, fn: Callable[[], object]) -> Future:
        """Run fn() on the engine thread between steps (from any thread); its result arrives in the future."""
        future: Future = Future()
        self._inbox.put(("call", (fn, future)))
        self._wake.set()
        return future

    def _place(self, seq: Sequence) -> None:
        """Give a sequence to the least loaded lane of a live replica (the first of equals), or park it while no
        replica serves."""
        live = [lane for lane in self.lanes if lane.replica not in self.down]
        if not live:
            self._parked.append(seq)
            return
        lane = min(live, key=lambda x: x.load)
        seq.lane = lane.index
        lane.scheduler.add(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq in self._parked:
            self._parked.remove(seq)
        self.lanes[seq.lane].scheduler.free(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        try:
            seq.emit(seq, seq.detok.release(final=True) if reason not in ("abort", "error") else "", True)
        except Exception:  # noqa: BLE001 - a client's callback must not take the engine down
            logger.exception("emit failed")

    def step(self, launch: bool = True) -> bool:
        """Launch a step on every idle lane that has work (unless `launch` is False: stopping), then complete the
        oldest step in flight; False when nothing was in flight."""
        self._drain_inbox()
        self._step_started = time.monotonic()
        try:
            for lane in self._launch_order if launch else ():
                if not lane.busy and lane.replica not in self.down:
                    batch = lane.scheduler.schedule()
                    if batch.items:
                        self._launch(lane, batch)
            if not self._inflight:
                return False
            self._complete(self._inflight.popleft())
            return True
        finally:
            self._step_started = None
            self._waiting_on = None

    def _runner_call(self, replica: int, fn, *args) -> tuple[object, bool]:
        """(result, True) of a runner call that talks to one replica's ranks (a launch, a result, a heartbeat).
        When it fails and the supervisor finds that the replica's ranks died (or killed them for hanging), the
        replica leaves rotation and its sequences go to the others: (None, False). Without a supervisor (the
        offline LLM, torchrun), or when no rank of the replica died (rank 0's own failure), the error is raised and
        fails the engine, as before."""
        self._waiting_on = replica
        try:
            return fn(*args), True
        except Exception as e:  # noqa: BLE001 - judged below
            reason = f"replica {replica}: {type(e).__name__}: {e}"
            if self.on_replica_failure is None or self.dead or not self.on_replica_failure(replica, reason):
                raise
            self._replica_down(replica, reason)
            return None, False
        finally:
            self._waiting_on = None

    # ---- LoRA adapters (server/engine/lora_registry.py) -------------------------------------------------------------------------
    def enable_lora(self, registry) -> None:
        self.loras = registry
        for lane in self.lanes:
            lane.scheduler.admit = self._admit

    def _live(self) -> list[int]:
        return [r for r in range(len(self.pools)) if r not in self.down]

    def _admit(self, seq: Sequence, running: list[Sequence]) -> bool:
        """May this waiting sequence join its lane's batch now: no more than --max-loras adapters in the step, and
        its adapter in a slot (read into one now if needed)."""
        adapter = seq.lora
        active = {s.lora for s in running if s.lora is not None}
        if adapter not in active and len(active) >= self.loras.max_loras:
            return False
        try:
            return self.loras.slot_for(adapter, self._lora_in_use, self._lora_load) > 0
        except (OSError, ValueError) as e:  # rank 0 could not read it (its folder changed since the check)
            logger.error("LoRA adapter %s could not be read: %s", adapter.name, e)
            self._finish(seq, "error")
            return False

    def _lora_in_use(self, adapter) -> bool:
        return any(s.lora is adapter for lane in self.lanes for s in lane.scheduler.running)

    def _lora_load(self, slot: int, path: str) -> None:
        """Rank 0's part first (raises with nothing sent), then every live replica's ranks. This runs inside a
        lane's schedule(): a replica found dead here is taken down through the inbox, after this step's scheduling,
        not under the scheduler's feet."""
        self.runner.lora_load(slot, path, [], True)
        for replica in self._live():
            self._waiting_on = replica
            try:
                self.runner.lora_load(slot, path, [replica], False)
            except Exception as e:  # noqa: BLE001 - judged as in _runner_call
                reason = f"replica {replica}: {type(e).__name__}: {e}"
                if self.on_replica_failure is None or self.dead or not self.on_replica_failure(replica, reason):
                    raise
                self.replica_down(replica, reason)
            finally:
                self._waiting_on = None

    def lora_retire(self, adapter) -> None:
        """On the engine thread: an unloaded adapter's slot is freed now if no sequence runs with it, else when it is
        next needed (its sequences in flight finish with it)."""
        if adapter.slot and not self._lora_in_use(adapter) and not any(
                s.lora is adapter for lane in self.lanes for s in lane.scheduler.waiting):
            slot = adapter.slot
            self.runner.lora_unload(slot, [])
            for replica in self._live():
                self._runner_call(replica, self.runner.lora_unload, slot, [replica])
            self.loras.slots[slot], adapter.slot = None, 0

    # ---- fault isolation ---------------------------------------------------------------------------------------
    def replica_down(self, replica: int, reason: str) -> None:
        """From any thread (the supervisor saw a rank of it exit): take the replica out of rotation."""
        self._inbox.put(("down", (replica, reason)))
        self._wake.set()

    def replica_up(self, replica: int, groups, num_blocks: int) -> None:
        """From any thread (the supervisor, once a respawned replica has joined): back into rotation."""
        self._inbox.put(("up", (replica, groups, num_blocks)))
        self._wake.set()

    def _replica_down(self, replica: int, reason: str) -> None:
        """On the engine thread. Its steps in flight are dropped (their results will not come), its pool is
        forgotten (the blocks held its dead ranks' K/V), and every sequence it held goes back to a live replica as a
        recompute preemption: prompt plus the tokens already generated, so the stream continues where it stopped
        (server/engine/scheduler.py). A sequence whose client left is finished, not recomputed."""
        if replica in self.down:
            return
        logger.error("replica %d is out of rotation: %s", replica, reason)
        self.down[replica] = reason
        self.replica_failures += 1
        self._inflight = deque(f for f in self._inflight if f.lane.replica != replica)
        self.runner.forget_sends(replica)
        moved: list[Sequence] = []
        for lane in self.lanes:
            if lane.replica != replica:
                continue
            moved += [s for s in list(lane.scheduler.running) + list(lane.scheduler.waiting) if not s.finished]
            lane.busy = False
        self._reset_replica(replica, self.runner.num_blocks)
        for seq in sorted(moved, key=lambda s: s.arrival):
            seq.status, seq.row, seq.num_computed = WAITING, -1, 0
            seq.num_preemptions += 1
            self._past["preemptions"] += 1
            self._place(seq)
        if moved:
            logger.warning("%d sequence(s) of replica %d recompute elsewhere%s", len(moved), replica,
                           "" if self.replicas_alive else " once a replica serves again")

    def _reset_replica(self, replica: int, num_blocks: int) -> None:
        """A fresh pool (an empty prefix cache) and empty schedulers for a replica."""
        old = self.pools[replica]
        self._past["prefix_queries"] += old.prefix_query_tokens
        self._past["prefix_hits"] += old.prefix_hit_tokens
        self.pools[replica] = BlockManager(num_blocks, self.runner.block_size, old.enable_prefix_caching)
        if replica == 0:
            self.blocks = self.pools[0]
        for lane in self.lanes:
            if lane.replica == replica:
                propose, admit = lane.scheduler.propose, lane.scheduler.admit
                self._past["preemptions"] += lane.scheduler.num_preemptions
                lane.scheduler = self._new_scheduler(replica, lane.index % self.runner.dist.layout.pp)
                lane.scheduler.propose, lane.scheduler.admit = propose, admit
        if replica == 0:
            self.scheduler = self.lanes[0].scheduler

    def _replica_up(self, replica: int, groups, num_blocks: int) -> None:
        from sharding.dist import install_groups

        install_groups(self.runner.dist, groups)
        self._reset_replica(replica, num_blocks)
        self.down.pop(replica, None)
        if self.loras is not None:  # the new ranks read every adapter the others hold, before they serve
            for slot, adapter in enumerate(self.loras.slots):
                if adapter is not None and replica not in self.down:
                    self._runner_call(replica, self.runner.lora_load, slot, adapter.path, [replica], False)
            if replica in self.down:
                return
        logger.warning("replica %d serves again", replica)
        parked, self._parked = self._parked, deque()
        for seq in parked:
            if not seq.finished:
                self._place(seq)

    def _launch(self, lane: Lane, batch: SchedulerOutput) -> None:
        if lane.replica in self.down:  # (taken down while this batch was scheduled: its sequences moved already)
            return
        t0 = time.perf_counter()
        launched, ok = self._runner_call(lane.replica, self.runner.launch, batch.to_step(), lane.replica)
        if not ok:
            return
        lane.busy = True
        self._inflight.append(InFlight(lane, batch, launched, t0))

    def _complete(self, f: InFlight) -> None:
        logits, ok = self._runner_call(f.lane.replica, self.runner.collect, f.launched)
        if not ok:
            return
        f.lane.busy = False
        f.lane.scheduler.finished_step(f.batch)
        out = StepOutput.split(f.batch, f.launched.step, logits, f.launched.pooled)
        sampling: list[Scheduled] = []
        verifying: list[Scheduled] = []
        for item in f.batch.items:
            seq = item.seq
            if seq.finished:  # aborted while its step was in flight
                continue
            got = out[seq]
            if seq.pooling is not None:
                if got.pooled is not None:
                    self._pool(item, got.pooled)
                elif item.samples:  # "cls": the first token's row came with an earlier chunk
                    self._finish_embedding(seq)
            elif got.every_token:
                self._record_prompt_logprobs(seq, out.rows_of(seq), item.start)
                if item.samples:
                    sampling.append(item)
            elif item.drafts:
                verifying.append(item)
            elif item.samples:
                sampling.append(item)
        if sampling:
            self._sample(sampling, out.last_rows([item.seq for item in sampling]))
        for item in verifying:
            self._verify(item, out.rows_of(item.seq))
        dt = time.perf_counter() - f.started
        for listener in self.step_listeners:
            listener(dt, f.launched.step.num_tokens)

    def _sample(self, items: list[Scheduled], logits: torch.Tensor) -> None:
        seqs = [item.seq for item in items]
        rows = [SampleRow(s.params, s.generator, s.prompt_ids, s.output_ids, s.banned_ids()) for s in seqs]
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if constrained:  # only these rows pay (the logits are this step's own: masked in place)
            with torch.inference_mode():  # the runner made them under inference mode
                self.grammars.mask_logits(logits, constrained, [seqs[i].grammar for i in constrained])
        sampled = sample(logits, rows)
        now = time.monotonic()
        for i, seq in enumerate(seqs):
            self._append(seq, sampled.token_ids[i], now)
            if sampled.logprobs is not None and seq.params.logprobs is not None:
                seq.token_logprobs.append(sampled.logprobs[i])
                seq.top_logprobs.append(sampled.top_logprobs[i] if sampled.top_logprobs else [])
            if seq.finished:
                self._finished(seq)
            else:
                seq.emit(seq, seq.detok.release(), False)

    def _propose(self, seq: Sequence, running: int, budget: int) -> list[int]:
        """Draft tokens for a decoding sequence (the scheduler asks; server/engine/spec_decode/proposers.py proposes). Never more
        than max_tokens or the context leaves, and for a constrained sequence only the drafts its grammar allows."""
        if seq.pooling is not None or seq.finished:
            return []
        p = seq.params
        room = min(p.max_tokens - len(seq.output_ids), self.max_model_len - len(seq.token_ids), budget + 1) - 1
        drafts = self.speculator.propose(seq, running, room)
        if drafts and seq.grammar is not None:
            m = seq.grammar.matcher
            n = m.try_consume_tokens(drafts)
            m.rollback(n)
            drafts = drafts[:n]
        return drafts

    def _verify(self, item: Scheduled, logits: torch.Tensor) -> None:
        """A sequence's verification rows: row j has the logits after its token and drafts[:j]. Each row is sampled
        as decoding would sample it (its context has the drafts before it as output: penalties, min_tokens, the
        grammar), and the drafts are kept while the sampled token equals them; the first token that differs, or the
        one after the last draft, is the model's own. Greedy: the same tokens as without speculation. Sampling:
        drawing from the target and keeping a draft when the draw equals it is rejection sampling with the
        proposal's probability 1, so the output has exactly the target's distribution; a seeded sequence draws
        row by row and stops at the first difference, so its generator advances exactly as without speculation."""
        seq, drafts = item.seq, item.drafts
        k = len(drafts)
        penalties = seq.params.has_penalties  # only penalties read the output (a copy per row, so only then)
        rows = [SampleRow(seq.params, seq.generator, seq.prompt_ids,
                          seq.output_ids + drafts[:j] if penalties else seq.output_ids, seq.banned_ids(j))
                for j in range(k + 1)]
        grammar = seq.grammar
        with torch.inference_mode():
            if grammar is not None:  # each row masked by the grammar's state after the drafts before it
                consumed = 0
                for j in range(k + 1):
                    self.grammars.mask_logits(logits, [j], [grammar])
                    if j < k:
                        if not grammar.accept(drafts[j]):
                            break
                        consumed += 1
                grammar.matcher.rollback(consumed)
            if seq.generator is not None and not seq.params.greedy:
                tokens, lps, tops = [], [], []
                for j in range(k + 1):
                    one = sample(logits[j : j + 1], rows[j : j + 1])
                    tokens.append(one.token_ids[0])
                    lps.append(one.logprobs[0] if one.logprobs else None)
                    tops.append(one.top_logprobs[0] if one.top_logprobs else [])
                    if j == k or tokens[-1] != drafts[j]:
                        break
            else:
                got = sample(logits, rows)
                tokens, lps = got.token_ids, got.logprobs or [None] * (k + 1)
                tops = got.top_logprobs or [[] for _ in range(k + 1)]
        now = time.monotonic()
        accepted = 0
        for j, token in enumerate(tokens):
            self._append(seq, token, now)
            if seq.params.logprobs is not None:
                seq.token_logprobs.append(lps[j])
                seq.top_logprobs.append(tops[j])
            if seq.finished or j == k or token != drafts[j]:
                break
            accepted += 1
        seq.num_computed += accepted  # the accepted drafts' K/V were written by this step
        self.speculator.verified(seq, k, accepted)
        self.spec_drafts += 1
        self.spec_draft_tokens += k
        self.spec_accepted_tokens += accepted
        for j in range(accepted):
            self.spec_accepted_per_position[j] += 1
        if seq.finished:
            self._finished(seq)
        else:
            seq.emit(seq, seq.detok.release(), False)

    def _finished(self, seq: Sequence) -> None:
        """A sequence that ended by itself (EOS, a stop, a length): give back its blocks, tell its client."""
        self.lanes[seq.lane].scheduler.free(seq)
        if self.speculator is not None:
            self.speculator.finished(seq)
        seq.emit(seq, seq.detok.release(final=True), True)

    def _pool(self, item: Scheduled, row: torch.Tensor) -> None:
        """An embedding sequence's pooled row of this step: its last (or first) token's hidden state, or under
        "mean" the sum over the chunk's tokens, added up over chunks (a chunk from position 0 starts it anew: a
        sequence recomputed after a preemption counts every token once). Its last chunk finishes it."""
        seq = item.seq
        if seq.pooling == "mean" and item.start > 0 and seq.pooled is not None:
            seq.pooled += row
        else:
            seq.pooled = row.clone()
        if item.samples:
            self._finish_embedding(seq)

    def _finish_embedding(self, seq: Sequence) -> None:
        if seq.pooling == "mean":
            seq.pooled /= len(seq.prompt_ids)
        seq.finish_reason = "stop"
        seq.first_token_time = seq.last_token_time = time.monotonic()
        self.lanes[seq.lane].scheduler.free(seq)
        seq.emit(seq, "", True)

    @staticmethod
    def _record_prompt_logprobs(seq: Sequence, logits: torch.Tensor, start: int) -> None:
        """Logits came for every token of a chunk of the prompt: row j predicts the token at start + j + 1. Record
        each prompt token's logprob (and top alternatives) under the model's own distribution, once (a recomputed
        chunk after a preemption adds nothing)."""
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs, seq.prompt_top_logprobs = [], []
        first = len(seq.prompt_logprobs) + 1  # the next prompt position without a logprob
        last = min(start + logits.shape[0], len(seq.prompt_ids) - 1)
        if last < first:
            return
        lp = torch.log_softmax(logits[first - 1 - start : last - start].float(), dim=-1)
        target = torch.tensor(seq.prompt_ids[first : last + 1], dtype=torch.int64)
        seq.prompt_logprobs += lp.gather(1, target[:, None]).squeeze(1).tolist()
        k = seq.params.prompt_logprobs or 0
        if k:
            vals, idx = lp.topk(min(k, lp.shape[-1]), dim=-1)
            seq.prompt_top_logprobs += [list(zip(r_i, r_v)) for r_i, r_v in zip(idx.tolist(), vals.tolist())]
        else:
            seq.prompt_top_logprobs += [[] for _ in range(last - first + 1)]

    def _append(self, seq: Sequence, token: int, now: float) -> None:
        p = seq.params
        seq.output_ids.append(token)
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        if seq.grammar is not None and not seq.grammar.accept(token):
            # cannot happen for a token the mask allowed; if it does, end the answer rather than go on unconstrained
            logger.error("grammar rejected sampled token %d: %s", token, seq.grammar.error)
            seq.finish_reason = "stop"
            return
        if not p.ignore_eos and token in self.eos_ids:
            seq.finish_reason = "stop"
            return
        if token in p.stop_token_ids:
            seq.finish_reason = "stop"
            return
        seq.detok.add(token)
        if seq.detok.stopped_by is not None:
            seq.finish_reason = "stop"
        elif seq.grammar is not None and seq.grammar.done:  # the constrained answer is complete
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"

    def run_until_idle(self) -> None:
        """Step until every added sequence has finished (the offline path, in the caller's thread)."""
        while self.step():
            pass

    # ---- background thread (the server) -------------------------------------------------------------------------
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
        if self.loop_thread_id != getattr(self.runner, "thread_id", self.loop_thread_id):
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
                    self._step_started = time.monotonic()
                    for replica in range(len(self.pools)):
                        if replica not in self.down:
                            self._runner_call(replica, self.runner.heartbeat, [replica])
                    self._step_started = None
                    last = time.monotonic()
        except Exception as e:  # noqa: BLE001 - a dead rank or a failed collective: nothing can step any more
            self.fail(f"engine step failed: {e}")
        finally:
            if self._loop_done is not None:
                self._loop_done.set()

    def watchdog(self, step_timeout: float, on_hang: Callable[[int, str], bool] | None = None) -> None:
        """A thread that notices a step (or heartbeat) that has not returned in time: a hung rank leaves rank 0
        inside a collective, and nothing else would notice. `on_hang(replica, reason)` may deal with it (the
        supervisor kills the replica's ranks, which turns the hang into the failure of a dead replica) and returns
        True; else the engine is declared dead."""
        def loop() -> None:
            handled: float | None = None
            while self.dead is None and not self._stop.is_set():
                started, replica = self._step_started, self._waiting_on
                if started is not None and time.monotonic() - started > step_timeout and started != handled:
                    reason = f"no step result from the ranks within {step_timeout:.0f} s (a rank hangs)"
                    if replica is None or on_hang is None or not on_hang(replica, reason):
                        self.fail(reason)
                        return
                    handled = started
                time.sleep(0.2)

        threading.Thread(target=loop, name="tpserve-watchdog", daemon=True).start()

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
        for seq in list(self._parked):
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
