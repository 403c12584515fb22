"""Progress of a rank's start, readable where there is no terminal.

A big checkpoint takes minutes to load (a 14.8 GB bf16 one quantized to int4: ~130 s). On a terminal the weights get
a tqdm bar; `docker logs`, systemd and Kubernetes are never terminals, and tqdm draws nothing there, so the same
progress goes out as plain log lines: every ~10 % of the tensors or every TPSERVE_PROGRESS_INTERVAL seconds (default
10), with tensors, bytes, bytes/s and what is being done. At the end, the time of each start phase.
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager

from loaders import envs

logger = logging.getLogger("tpserve")


class StartPhases:
    """Seconds spent per named phase of a start, in the order first seen ("reading", "quantizing", ...)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def summary(self) -> str:
        return ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items())


class LoadProgress:
    """The weights' load on rank 0: `advance` after each tensor's module; the work on it is timed in `phases`."""

    def __init__(self, total: int, total_bytes: int, bytes_read, enabled: bool, phases: StartPhases,
                 interval: float | None = None) -> None:
        self.total, self.total_bytes, self.bytes_read = total, total_bytes, bytes_read  # bytes_read: () -> int
        self.phases = phases
        self.enabled = enabled
        self.done = 0
        self.t0 = self.last_time = time.perf_counter()
        self.last_tenth = 0
        self.interval = envs.PROGRESS_INTERVAL.get() if interval is None else interval
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="loading weights", unit="tensor", leave=False)
        elif enabled:
            logger.info("loading weights: %d tensors, %s to read", total, _size(total_bytes))

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            return
        if not self.enabled:
            return
        now = time.perf_counter()
        tenth = self.done * 10 // max(self.total, 1)
        if tenth > self.last_tenth or now - self.last_time >= self.interval:
            self.last_tenth, self.last_time = tenth, now
            logger.info("loading weights: %s", self.line(now))

    def line(self, now: float) -> str:
        read = self.bytes_read()
        rate = read / max(now - self.t0, 1e-9)
        doing = ", ".join(f"{name} {self.phases.seconds[name]:.1f} s" for name in ("reading", "quantizing")
                          if name in self.phases.seconds)
        return (f"{self.done}/{self.total} tensors ({100 * self.done // max(self.total, 1)} %), {_size(read)} of "
                f"{_size(self.total_bytes)} read, {_size(rate)}/s ({doing} so far)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
