"""Fault a large buffer's pages in ahead of use, on a thread that runs only when a core is idle.

kv_transfer's slab is allocated unfaulted (`host_buffer(prefault=False)`: 2 GiB that may never fill). A
prefill's first write into a fresh slot then faults the slot's huge pages in, inside the writer's
process_vm_writev: the kernel zeroes each 2 MiB page there, in the prefill's transfer. Measured on the 2-core
host (perf, 8 handoffs of 256-token SmolLM2 prompts): 26.5 ms of each prefill in `clear_page_erms` under
process_vm_writev, while the slots handed out kept moving into fresh memory (the prefix pool keeps what was
written, so new prompts take new slots until the pool is full).

`Prefaulter` keeps the buffer populated up to `ahead_bytes` past the highest offset handed out so far,
with `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+): the pages are faulted in writable without their contents
being touched, so it races with nothing that writes them. Its thread runs under SCHED_IDLE: it takes no core
from an engine, and catches up in the gaps between requests. Where the kernel lacks the advice it does nothing
(and says so once).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h
_CHUNK_BYTES = 16 << 20  # one madvise call: small enough that stop() waits little
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def populate(addr: int, nbytes: int) -> bool:
    """Fault [addr, addr + nbytes) in writable without writing it (addr page-aligned); False if refused."""
    if _libc.madvise(addr, nbytes, MADV_POPULATE_WRITE) == 0:
        return True
    logger.warning("madvise(MADV_POPULATE_WRITE) at %#x (+%d): %s", addr, nbytes, os.strerror(ctypes.get_errno()))
    return False


class Prefaulter:
    """Populates [base, base + nbytes) from the start, up to `ahead_bytes` past the furthest `used_up_to`."""

    def __init__(self, base_addr: int, nbytes: int, ahead_bytes: int, name: str = "prefault") -> None:
        if base_addr % os.sysconf("SC_PAGE_SIZE"):
            raise ValueError(f"base address {base_addr:#x} is not page-aligned")
        self.base_addr, self.nbytes, self.ahead_bytes = base_addr, nbytes, ahead_bytes
        self.populated = 0  # bytes from the start faulted in so far
        self._on = ahead_bytes > 0 and nbytes > 0  # off: first touch stays with the writers
        self._target = min(nbytes, ahead_bytes) if self._on else 0
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        if self._on:
            self._thread.start()

    def used_up_to(self, offset: int) -> None:
        """Memory up to `offset` (bytes from the base) is in use: keep `ahead_bytes` past it populated."""
        if not self._on:
            return
        target = min(self.nbytes, offset + self.ahead_bytes)
        with self._cond:
            if target > self._target:
                self._target = target
                self._cond.notify()

    def wait(self, timeout_s: float) -> bool:
        """True once everything asked for so far is populated (tests, and a start that wants it done)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.populated >= self._target or self._stopped, timeout_s)

    def close(self) -> None:
        """Stop the thread (it finishes the madvise call in progress) before the buffer goes away."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        try:  # this thread only (a thread id of 0 is the caller): a core's idle time, never an engine's
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError) as e:
            logger.info("prefault thread stays at normal priority: %s", e)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self.populated < self._target)
                if self._stopped:
                    return
                start, end = self.populated, min(self._target, self.populated + _CHUNK_BYTES)
            if not populate(self.base_addr + start, end - start):
                with self._cond:  # not on this kernel: first touch stays where it was
                    self._stopped = True
                    self._cond.notify_all()
                return
            with self._cond:
                self.populated = end
                self._cond.notify_all()
