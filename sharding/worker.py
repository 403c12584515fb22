"""`python -m sharding.worker --model ...`: one rank > 0, launched by tpserve's launcher (or torchrun), and the loop
every rank > 0 runs: receive each message rank 0 (sharding/executor.py) or the previous stage sends, execute steps on
this rank's model (sharding/runner.py), pass steps and commands on to the next stage, send the last stage's logits
to rank 0.
"""

import time

STARTED = time.monotonic()  # before the imports: a respawned rank logs its whole start

import logging
import os
import signal
import sys

import torch

from sharding.runner import EngineConfig, ModelRunner, start_rank
from sharding.wire import (CMD_LORA_LOAD, CMD_NOOP, CMD_SHUTDOWN, CMD_STEP, HEADER, PAYLOAD_COMMANDS, Step,
                           pack_command, send_step)

logger = logging.getLogger(__name__)


class Worker:
    """A rank > 0's side of the wire, around its ModelRunner."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.dist = runner.dist
        self._message = torch.zeros(Step.message_size(runner.cfg.max_num_seqs), dtype=torch.int64)  # sharding/wire.py

    def _receive(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next message (header + payload) and, on a later stage, the hidden states that come with it: from
        the previous stage; on a first stage from rank 0 (a replica's TP rank 0) or by broadcast (other TP ranks)."""
        d, message = self.dist, self._message
        if not d.first_stage:
            src = d.peer(pp_rank=d.pp_rank - 1)
        elif d.is_first:
            src = 0  # the TP rank 0 of another replica's first stage: rank 0 sends it the step
        else:
            src = None  # a first stage's other TP ranks: their rank 0 broadcasts
        if src is None:
            d.broadcast_control(message)
        else:
            d.recv(message, src)
            if d.first_stage and d.world_size > 1:  # pass it on to this replica's TP group
                d.broadcast_control(message)
        header = message[:HEADER]
        cmd = int(header[0])
        if cmd not in (CMD_STEP, *PAYLOAD_COMMANDS):
            return message, None
        size = Step.payload_size(header) if cmd == CMD_STEP else int(header[1])
        if HEADER + size <= message.numel():
            payload = message[HEADER : HEADER + size]  # used before the next message overwrites it
        else:
            payload = torch.empty(size, dtype=torch.int64)
            if src is None:
                d.broadcast_control(payload)
            else:
                d.recv(payload, src)
                if d.first_stage and d.world_size > 1:
                    d.broadcast_control(payload)
        hidden = None
        if not d.first_stage and cmd == CMD_STEP:
            hidden = torch.empty(int(header[1]), self.runner.config.hidden_size, dtype=self.runner.dtype)
            d.recv(hidden, src)
        return torch.cat([header, payload]), hidden

    def loop(self) -> None:
        """Receive and apply messages until a shutdown arrives: steps (executed, passed on or answered with the
        logits), commands (passed on to the next stage, then applied)."""
        d = self.dist
        while True:
            message, hidden = self._receive()
            header = message[:HEADER]
            cmd = int(header[0])
            if cmd in (CMD_SHUTDOWN, CMD_NOOP):
                if not d.last_stage:
                    d.send(message[: self._message.numel()], d.peer(pp_rank=d.pp_rank + 1))
                if cmd == CMD_SHUTDOWN:
                    return
                continue
            if cmd in PAYLOAD_COMMANDS:
                payload = message[HEADER:]
                if not d.last_stage:
                    for t in pack_command(cmd, payload, self._message.numel()):
                        d.send(t, d.peer(pp_rank=d.pp_rank + 1))
                self._apply_command(cmd, payload)
                continue
            assert cmd == CMD_STEP, f"unknown command {cmd}"
            step = Step.unpack(header, message[HEADER:])
            out = self.runner.execute(step, hidden)
            if not d.last_stage:
                send_step(d, step, self._message.numel(), d.peer(pp_rank=d.pp_rank + 1), out)
            elif d.is_first and out is not None:
                logits, pooled = out if isinstance(out, tuple) else (out, None)
                if logits.shape[0]:
                    d.send(logits.cpu(), 0)  # the logits, to rank 0, which samples (gloo: from host memory)
                if pooled is not None:
                    d.send(pooled.cpu(), 0)  # embedding sequences' pooled rows

    def _apply_command(self, cmd: int, payload: torch.Tensor) -> None:
        """A LoRA load or unload on this rank. A load this rank cannot read (its files changed since rank 0 checked
        them, or are missing on this host) leaves the slot empty here and is reported to rank 0 like a success
        (report_load): rank 0 fails that load and unloads the slot on this replica. The rank keeps serving."""
        from sharding.layers.lora import decode_load, report_load

        if cmd != CMD_LORA_LOAD:
            self.runner.lora.unload(int(payload[0]))
            return
        slot, path, ticket = decode_load(payload)
        error = None
        try:
            self.runner.lora.load(slot, path)
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which fails the load
            error = str(e) if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {e}"
            logger.error("rank %d could not read LoRA adapter %s into slot %d: %s", self.dist.global_rank, path, slot,
                         error)
            self.runner.lora.unload(slot)  # not the slot's previous adapter either
        report_load(self.dist.store, ticket, self.dist.global_rank, error)


def worker_loop(runner: ModelRunner) -> None:
    """Serve rank 0's steps and commands on this rank until it says shut down."""
    Worker(runner).loop()


def leave_shutdown_to_rank0() -> None:
    """Ranks > 0 ignore SIGINT and SIGTERM. Ctrl-C in a terminal, `kill -- -PGID`, systemd's default
    KillMode=control-group and torchrun all signal every process of the group at once; rank 0 then drains (requests in
    flight finish) and tells the other ranks to stop, which they could not do if the signal had killed them first.
    They still die with rank 0 (PR_SET_PDEATHSIG when tpserve spawned them; a dead peer fails their next wait)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def worker_main(argv: list[str] | None = None, started: float | None = None) -> int:
    """Entry of ranks > 0 (`python -m sharding.worker`)."""
    from sharding.dist import init_dist

    cfg = EngineConfig.from_argv(sys.argv[1:] if argv is None else argv)
    leave_shutdown_to_rank0()
    dist = init_dist(cfg.layout(int(os.environ.get("WORLD_SIZE", "1"))))
    logging.basicConfig(level=logging.WARNING, format=f"[rank {dist.global_rank}] %(levelname)s %(message)s")
    try:
        runner = start_rank(cfg, dist)
    except Exception:  # noqa: BLE001 - the message was logged; rank 0 reports the failure
        dist.shutdown()
        return 1
    if dist.generation and started is not None:  # a respawned replica's rank (server/engine/supervisor.py): where its start went
        logger.warning("rank %d started again (generation %d) in %.1f s since its process began: %s",
                       dist.global_rank, dist.generation, time.monotonic() - (started or 0.0), runner.phases.summary())
    try:
        worker_loop(runner)
    except Exception as e:  # noqa: BLE001 - rank 0 went away or a collective failed: leave, loudly
        logger.error("rank %d stopping: %s", dist.global_rank, e)
        os._exit(1)
    dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(started=STARTED))
