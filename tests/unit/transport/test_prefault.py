"""The slab prefaulter (shared/transport/prefault.py): pages come in ahead of use, and nothing written changes."""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from shared.transport.memory import host_buffer
from shared.transport.prefault import Prefaulter

MIB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def resident(addr: int, nbytes: int) -> int:
    """Bytes of [addr, addr + nbytes) in memory now (mincore)."""
    page = os.sysconf("SC_PAGE_SIZE")
    pages = -(-nbytes // page)
    vec = (ctypes.c_ubyte * pages)()
    assert _libc.mincore(addr, nbytes, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec) * page


def test_populates_ahead_of_what_is_used_and_keeps_contents() -> None:
    slab = host_buffer(64 * MIB, prefault=False)
    base = slab.data_ptr()
    slab[5 * MIB + 7] = 42  # a peer's write before the prefaulter reaches it
    assert resident(base + 40 * MIB, 24 * MIB) == 0
    prefaulter = Prefaulter(base, slab.numel(), ahead_bytes=8 * MIB)
    try:
        assert prefaulter.wait(30.0) and prefaulter.populated == 8 * MIB
        assert resident(base, 8 * MIB) == 8 * MIB
        assert resident(base + 40 * MIB, 24 * MIB) == 0  # nothing past the target
        prefaulter.used_up_to(20 * MIB)  # a Reserve handed out slots up to 20 MiB
        assert prefaulter.wait(30.0) and prefaulter.populated == 28 * MIB
        assert resident(base, 28 * MIB) == 28 * MIB
        prefaulter.used_up_to(10 * MIB)  # behind the frontier: nothing more
        prefaulter.used_up_to(1 << 40)  # past the end: up to the end
        assert prefaulter.wait(30.0) and prefaulter.populated == slab.numel()
        assert int(slab[5 * MIB + 7]) == 42 and int(slab.sum()) == 42  # populated, not written
    finally:
        prefaulter.close()


def test_its_thread_runs_at_idle_priority_and_stops() -> None:
    slab = host_buffer(8 * MIB, prefault=False)
    prefaulter = Prefaulter(slab.data_ptr(), slab.numel(), ahead_bytes=4 * MIB, name="prefault-test")
    assert prefaulter.wait(30.0)
    thread = next(t for t in threading.enumerate() if t.name == "prefault-test")
    policy = os.sched_getscheduler(thread.native_id)  # type: ignore[arg-type]
    assert policy == os.SCHED_IDLE
    prefaulter.close()
    assert not thread.is_alive()
    prefaulter.used_up_to(8 * MIB)  # after close: ignored, no thread started again
    assert not thread.is_alive()


def test_off_when_ahead_is_zero() -> None:
    slab = host_buffer(4 * MIB, prefault=False)
    prefaulter = Prefaulter(slab.data_ptr(), slab.numel(), ahead_bytes=0)
    prefaulter.used_up_to(2 * MIB)
    assert prefaulter.populated == 0 and resident(slab.data_ptr(), 4 * MIB) == 0
    prefaulter.close()
    assert torch.count_nonzero(slab) == 0
