"""Engines on one host lend each other their cores.

`baton up` starts a disaggregated stack's engines side by side on one machine and gives each a fixed share
of the cores (cores / engines torch threads). Under load that is right: prefill and decode both compute and
each keeps its own cores. Under light load it leaves half the machine idle: one stream's decode steps run on
one thread while prefill waits for its next prompt, and that prompt is prefilled on one thread while decode
has nothing to do. Giving every engine every core instead oversubscribes them under load (2 cores, SmolLM2
fp32, 32 streams: decode TPOT p50 123 ms against 64 on fixed shares, measured by hand on 2026-11-26).

So each engine marks, in a small file shared by the stack's engines, whether it has work, and before each
step takes every core when no other engine has work and its share otherwise. Each slot of the file holds the
pid of a busy engine or 0; a slot whose pid is no longer alive counts as idle, so a killed engine does not
hold its share forever. A long step (a prefill chunk) looks again between its layers: one started on every
core just before another engine became busy runs at most one layer oversubscribed, then shrinks. Before,
it ran the whole step so: a 2-thread OpenMP team beside another engine's thread runs at ~0.28 of its speed
alone (bench/omp_contention.py), and in a 1P1D run at 1 request/s on 2 cores, prompts of 131-256 tokens
that started just before their decode took 0.84-1.1 s to prefill against 0.3-0.4 s alone (2026-11-27).

Measured (SmolLM2 fp32, 256 in / 128 out, 2 cores): one stream served disaggregated went from 0.82 to 0.95
of the in-process engine's tok/s (`bench/results/serve_overhead-20261126-163949.json`), and in one run the
stack gave 44.7 / 146.9 / 153.1 tok/s at 1 / 8 / 32 streams against 30.1 / 95.4 / 126.9 on fixed shares
(1.49x / 1.54x / 1.21x, p99 TPOT 21.5 / 31.6 / 53.0 ms against 30.7 / 45.2 / 82.5; `serve-20261126-165143.json`).

The thread count is set on the thread that runs the steps: torch's OpenMP build keeps the count per thread
(omp_set_num_threads sets the calling thread's value), and every kernel of ours asks `at::get_num_threads()`
when called.
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SLOTS = 64  # engines one file serves (`baton up` numbers them; a larger stack shares no cores beyond them)
_SLOT_BYTES = 8


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


class CoreShare:
    """This engine's slot in the stack's share file; `set_busy` is called by the engine thread each loop."""

    def __init__(self, path: Path, slot: int, share_threads: int, max_threads: int | None = None) -> None:
        if not 0 <= slot < SLOTS:
            raise ValueError(f"core share slot {slot} is outside 0..{SLOTS - 1}")
        if share_threads < 1:
            raise ValueError(f"share_threads must be >= 1, got {share_threads}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:  # every engine may be first: growing to the same size twice is harmless, and never shrinks
            if os.fstat(fd).st_size < SLOTS * _SLOT_BYTES:
                os.ftruncate(fd, SLOTS * _SLOT_BYTES)
            self._map = mmap.mmap(fd, SLOTS * _SLOT_BYTES)
        finally:
            os.close(fd)
        self._slots = memoryview(self._map).cast("q")  # aligned 8-byte stores: whole to every reader
        self.path, self.slot, self.pid = path, slot, os.getpid()
        self.share_threads = share_threads
        self.max_threads = max(share_threads, max_threads or len(os.sched_getaffinity(0)))
        self.threads = share_threads  # what the engine thread runs with now
        self.num_changes = 0
        self._busy = False
        self._slots[slot] = 0  # a restarted engine's old pid reads as busy again once the system reuses it

    def others_busy(self) -> int:
        return sum(1 for i, pid in enumerate(self._slots) if i != self.slot and pid and _alive(pid))

    def set_busy(self, busy: bool) -> None:
        """On the engine thread: before a step (busy) or before waiting for work (idle)."""
        if not busy:
            if self._busy:
                self._slots[self.slot] = 0
                self._busy = False
            return
        if not self._busy:
            self._slots[self.slot] = self.pid  # first, then read the others: two engines starting together
            self._busy = True  # each see the other (at worst one layer each runs oversubscribed)
        self.fit_threads()

    def fit_threads(self) -> None:
        """On the engine thread, while busy: take what the share allows now. Called before each step, and
        between the layers of a long step (engine.py), so that an engine that borrowed every core gives them
        back within a layer of another engine getting work, not at the end of a whole prefill."""
        want = max(self.share_threads, self.max_threads // (1 + self.others_busy()))
        if want != self.threads:
            torch.set_num_threads(want)
            logger.debug("core share: %d -> %d torch threads", self.threads, want)
            self.threads = want
            self.num_changes += 1

    def close(self) -> None:
        self.set_busy(False)
        self._slots.release()
        self._map.close()
