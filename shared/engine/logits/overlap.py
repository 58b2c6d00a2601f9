"""Building a step's logits constraints beside its forward pass.

The grammar bitmasks and penalty inputs of a step depend only on each request's output
before the step (for a step that continues the previous one, on what that step emitted),
not on this step's logits. So the executor hands their building to one worker thread
right before the forward and collects them after it:

    executor thread   finish inputs ─┬─ forward ──────────────── wait ─ apply masks ─ sample
    mask worker                      └─ read prev tokens ─ sync states ─ fill bitmasks ┘

The forward spends its time in torch ops that release the GIL (and, on a GPU, in queued
kernels), so the worker's Python and xgrammar calls run meanwhile; on a GPU the read of
the previous step's tokens also waits there, not on the executor thread. `wait_s` is the
part that was not hidden: the executor's time blocked on a mask the forward finished
before. The states a worker touches belong to the step's requests, which the executor does
not touch until it has the result.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

__all__ = ["MaskOverlap", "PendingMasks"]

T = TypeVar("T")


class PendingMasks(Generic[T]):
    """One step's constraints under construction; `result` blocks until built (re-raising its error)."""

    def __init__(self, future: Future[T], owner: MaskOverlap) -> None:
        self._future = future
        self._owner = owner

    def result(self) -> T:
        t0 = time.perf_counter()
        try:
            return self._future.result()
        finally:
            self._owner.wait_s += time.perf_counter() - t0


class MaskOverlap:
    """A one-thread worker for constraint building, with the time it took and the time waited for it."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.build_s = 0.0  # worker time building constraints
        self.wait_s = 0.0  # executor time blocked on them after the forward
        self.num_builds = 0

    def submit(self, build: Callable[[], T]) -> PendingMasks[T]:
        with self._lock:
            if self._pool is None:  # most engines never constrain a token: no thread for them
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-masks")
        return PendingMasks(self._pool.submit(self._timed, build), self)

    def _timed(self, build: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        try:
            return build()
        finally:
            self.build_s += time.perf_counter() - t0
            self.num_builds += 1

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
