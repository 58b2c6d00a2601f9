"""The transport seam: NIXL-shaped descriptors, one protocol, three backends.

An agent has a name and a metadata blob (what a peer needs to reach it and the
memory it registered). A transfer moves bytes between a list of local
descriptors and a same-length list of descriptors on a named remote agent::

    initiator (e.g. decode)                       target (e.g. kv_transfer)
    ───────────────────────                       ─────────────────────────
    register(kv) ─► MemoryRegion                  register(store) ─► MemoryRegion
    add_remote("store", md) ◄──── metadata() ──── (out of band: gRPC, redis)
    start(READ, [(addr, n, dev)…], "store", [(raddr, n, dev)…]) ─► TransferHandle
    poll(handle) / wait(handle, timeout_s) ─► DONE | FAILED

A transfer is a small state machine that callers poll without blocking::

    PENDING ──► DONE
       └──────► FAILED   (peer gone, remote rejected the range, deadline, abort)

Completion is known from the transfer itself (the one-sided operation
completing, or the target's reply carrying the transfer's id), never from a
separate notification round trip. Rules every backend keeps:

- `start` raises for caller errors (closed transport, unknown remote,
  descriptors outside registered memory, mismatched lengths); whatever the
  network or the peer does afterwards is reported through the handle's state.
- Every transfer ends within its deadline (`transfer_timeout_s`): a dead or
  silent peer turns it FAILED, never a hang.
- A transport object is driven by one thread (its owner); backends may run
  internal threads of their own.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from shared.errors import UnavailableError


class TransportError(UnavailableError):
    """A KV transport cannot do what was asked (the base of every transport error)."""

    code = "kv_transport_error"


class TransportUnavailableError(TransportError):
    """The backend's package is not installed or does not work on this host."""


class InvalidDescriptorError(TransportError):
    """A descriptor is empty, mismatched, or outside memory the agent registered."""


class UnknownRemoteError(TransportError):
    """No remote agent of that name was added (or it was removed)."""


class TransferFailedError(TransportError):
    """A transfer ended FAILED (`wait` raises it with the handle's error)."""


class TransferTimeoutError(TransferFailedError):
    """A transfer did not finish in time; it was aborted and is FAILED."""


class TransferOp(enum.Enum):
    READ = "READ"  # remote -> local
    WRITE = "WRITE"  # local -> remote


class TransferState(enum.Enum):
    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


class MemType(enum.Enum):
    DRAM = "DRAM"  # host memory
    VRAM = "VRAM"  # accelerator memory (device_id = the CUDA device index)


@dataclass(frozen=True, slots=True)
class Descriptor:
    """One contiguous span of memory taking part in a transfer: NIXL's (addr, len, devID)."""

    addr: int
    nbytes: int
    device_id: int = 0

    @property
    def end(self) -> int:
        return self.addr + self.nbytes


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    """Memory an agent registered: descriptors must lie inside one region."""

    addr: int
    nbytes: int
    mem_type: MemType = MemType.DRAM
    device_id: int = 0

    @property
    def end(self) -> int:
        return self.addr + self.nbytes

    def contains(self, desc: Descriptor) -> bool:
        return desc.device_id == self.device_id and self.addr <= desc.addr and desc.end <= self.end

    def descriptor(self, offset: int, nbytes: int) -> Descriptor:
        """The descriptor of `nbytes` at `offset` from the region's base (bounds-checked)."""
        if offset < 0 or nbytes <= 0 or offset + nbytes > self.nbytes:
            raise InvalidDescriptorError(
                f"[{offset}, {offset + nbytes}) outside a region of {self.nbytes} bytes")
        return Descriptor(self.addr + offset, nbytes, self.device_id)

    def descriptors(self, byte_ranges: Iterable[Any]) -> list[Descriptor]:
        """Descriptors of byte ranges (anything with `.offset`, `.nbytes`: `KVLayout.block_ranges`)."""
        return [self.descriptor(r.offset, r.nbytes) for r in byte_ranges]


@dataclass(eq=False)
class TransferHandle:
    """One transfer's identity and state; the transport updates it on `poll`/`wait`."""

    xfer_id: int
    op: TransferOp
    remote_name: str
    nbytes: int  # total over all descriptors
    num_descs: int
    state: TransferState = TransferState.PENDING
    error: str | None = None
    started_s: float = field(default_factory=time.monotonic)
    finished_s: float | None = None

    @property
    def done(self) -> bool:
        return self.state is not TransferState.PENDING

    @property
    def duration_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.started_s


@runtime_checkable
class Transport(Protocol):
    """One agent of a KV transport backend (NIXL, ucxx or TCP)."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def num_inflight(self) -> int:
        """Transfers started and not yet DONE or FAILED (what leak checks look at)."""
        ...

    def metadata(self) -> bytes:
        """What a peer passes to `add_remote`: how to reach this agent and what it registered.

        Like NIXL's agent metadata, it lists the regions registered so far: a
        peer that should reach memory registered later needs fresh metadata.
        """
        ...

    def register(self, memory: Any) -> MemoryRegion:
        """Register a contiguous torch tensor (CPU or CUDA) or a writable buffer.

        The transport keeps a reference to `memory` until `deregister`.
        """
        ...

    def deregister(self, region: MemoryRegion) -> None: ...

    def add_remote(self, name: str, metadata: bytes) -> None:
        """Make `name` reachable (re-adding replaces its metadata)."""
        ...

    def remove_remote(self, name: str) -> None:
        """Forget `name`; its in-flight transfers end FAILED."""
        ...

    def start(
        self, op: TransferOp, local_descs: Sequence[Descriptor], remote_name: str,
        remote_descs: Sequence[Descriptor],
    ) -> TransferHandle:
        """Post a transfer; `local_descs[i]` pairs with `remote_descs[i]` (same nbytes)."""
        ...

    def poll(self, handle: TransferHandle) -> TransferState:
        """Advance the transfer without blocking and return its state."""
        ...

    def wait(self, handle: TransferHandle, timeout_s: float) -> TransferHandle:
        """Block until DONE; raises `TransferFailedError` (FAILED) or `TransferTimeoutError`.

        On timeout the transfer is aborted first, so its memory is free to reuse.
        """
        ...

    def expect_traffic(self) -> None:
        """A peer is about to move data through this agent's registered memory (a passive target, such as
        kv_transfer's slab, hears of it on the control path first): progress at full rate for a while."""
        ...

    def watch_traffic(self, moving: Callable[[], bool]) -> None:
        """`moving()` says whether peers move data through this agent now (any thread may call it): the
        agent progresses at full rate while it is true."""
        ...

    def close(self) -> None:
        """Abort in-flight transfers, deregister everything, stop internal threads (idempotent)."""
        ...

    def __enter__(self) -> Transport: ...

    def __exit__(self, *exc: object) -> None: ...


async def wait_async(
    transport: Transport, handle: TransferHandle, timeout_s: float, poll_interval_s: float = 0.0005
) -> TransferHandle:
    """`wait` for asyncio callers: polls between yields to the event loop."""
    deadline_s = time.monotonic() + timeout_s
    while transport.poll(handle) is TransferState.PENDING:
        if time.monotonic() > deadline_s:
            return transport.wait(handle, 0.0)  # aborts and raises TransferTimeoutError
        await asyncio.sleep(poll_interval_s)
    if handle.state is TransferState.FAILED:
        raise TransferFailedError(
            f"transfer {handle.xfer_id} to {handle.remote_name!r} failed: {handle.error}")
    return handle
