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
when called. The zero-bubble loop (decode and colocated roles) runs its steps on an executor thread, so the
engine calls `fit_threads` there before each step (`LLMEngine.before_step`).

An engine that gets work does not start its first step beside a neighbour still running more threads than its
new share: each engine publishes the count its step in progress runs on, and a newcomer waits (sleeping, at most
ROOM_WAIT_S) until every busy neighbour has shrunk to its share, which it does at its next step or layer.
Without the wait, the neighbour's step in flight ran oversubscribed to its end, and an OpenMP team with a
descheduled thread waits at every barrier: in a 1P1D stack (2 cores, fp32), a decode step of ~15 ms that
was in flight when a 256-token prompt reached prefill took 300-400 ms, the prompt's whole prefill, in four of
five tries (`/proc` per-thread CPU time: decode's two threads busy throughout; a trace of the share file: no
decode step began until prefill was done). With it (2026-11-29) the stream's longest gap beside such a prompt
is a few of its own steps.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SLOTS = 64  # engines one file serves (`baton up` numbers them; a larger stack shares no cores beyond them)
_SLOT_BYTES = 8
# The file: three arrays of SLOTS 8-byte values, the slot's busy pid (0: idle), the thread count its steps run
# on now, and its share
_FIELDS = 3
FILE_BYTES = SLOTS * _SLOT_BYTES * _FIELDS
# The longest a newcomer waits for its neighbours to shrink: longer than a decode step or a prefill layer at
# batch 32 on two cores, far shorter than a prompt's prefill (then it starts anyway, oversubscribed as before)
ROOM_WAIT_S = 0.25
_ROOM_POLL_S = 0.0005


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
            if os.fstat(fd).st_size < FILE_BYTES:
                os.ftruncate(fd, FILE_BYTES)
            self._map = mmap.mmap(fd, FILE_BYTES)
        finally:
            os.close(fd)
        self._values = memoryview(self._map).cast("q")  # aligned 8-byte stores: whole to every reader
        self._slots, self._counts, self._shares = (self._values[i * SLOTS:(i + 1) * SLOTS] for i in range(_FIELDS))
        self.path, self.slot, self.pid = path, slot, os.getpid()
        self.share_threads = share_threads
        self.max_threads = max(share_threads, max_threads or len(os.sched_getaffinity(0)))
        self.threads = share_threads  # what this engine's steps run on now
        self.num_changes = 0
        self.num_waits = 0  # steps that waited for a neighbour to shrink
        self._busy = False
        self._slots[slot] = 0  # a restarted engine's old pid reads as busy again once the system reuses it
        self._counts[slot] = 0
        self._shares[slot] = share_threads

    def _busy_others(self) -> list[int]:
        return [i for i, pid in enumerate(self._slots) if i != self.slot and pid and _alive(pid)]

    def others_busy(self) -> int:
        return len(self._busy_others())

    def set_busy(self, busy: bool) -> None:
        """On the engine thread: it has work (before its steps) or has none (before waiting for work)."""
        if not busy:
            if self._busy:
                self._slots[self.slot] = 0
                self._counts[self.slot] = 0
                self._busy = False
            return
        if not self._busy:
            self._slots[self.slot] = self.pid  # first, then read the others (fit_threads): two engines
            self._busy = True  # starting together each see the other

    def fit_threads(self) -> None:
        """While busy, on the thread that runs the step's kernels: take what the share allows now, publish it
        until `step_over`, and wait until the neighbours have room for it (module docstring). Called before
        each step, and between the layers of a long step (engine.py), so that an engine that borrowed every
        core gives them back within a layer of another engine getting work, not at the end of a whole
        prefill."""
        others = self._busy_others()
        want = max(self.share_threads, self.max_threads // (1 + len(others)))
        have = torch.get_num_threads()
        if have != want:
            torch.set_num_threads(want)
            logger.debug("core share: %d -> %d torch threads", have, want)
            self.num_changes += 1
        self.threads = want
        self._counts[self.slot] = want
        if others and self._crowded(others):
            self._wait_for_room()

    def step_over(self) -> None:
        """After each step: between steps an engine computes nothing a newcomer should wait for (a prefill
        waiting on its pushes, a loop between its steps)."""
        self._counts[self.slot] = 0

    def _crowded(self, others: list[int]) -> bool:
        """A busy neighbour runs more threads than its share of the busy engines allows."""
        fair = self.max_threads // (1 + len(others))
        return any(self._counts[i] > max(self._shares[i], fair) for i in others)

    def _wait_for_room(self) -> None:
        self.num_waits += 1
        deadline = time.monotonic() + ROOM_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(_ROOM_POLL_S)
            others = self._busy_others()
            if not others or not self._crowded(others):
                return
        logger.debug("core share: a neighbour kept its cores for %.0f ms; stepping beside it", ROOM_WAIT_S * 1e3)

    def close(self) -> None:
        self.set_busy(False)
        for view in (self._slots, self._counts, self._shares, self._values):
            view.release()
        self._map.close()
