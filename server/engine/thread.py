"""The one thread of rank 0's server process that runs torch work."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable


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
