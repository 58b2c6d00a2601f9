"""The bookkeeping every backend shares; a backend only moves bytes.

`TransportCore` owns the local regions, the remote agents' advertised
regions, the in-flight table and each transfer's deadline, and turns the
protocol's calls into a handful of hooks::

    start ─► validate ─► _post(handle, local, remote) ─► token
    poll  ─► _progress(token) ─► PENDING | DONE         (raises TransportError: FAILED)
             deadline passed  ─► _release(token, abort=True) ─► FAILED
    wait  ─► poll, _block(token, s), poll, ...

A transfer leaves the in-flight table exactly once (DONE or FAILED), and
`_release` runs exactly once for it.
"""

from __future__ import annotations

import abc
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from shared.transport.base import (
    Descriptor,
    InvalidDescriptorError,
    MemoryRegion,
    MemType,
    TransferFailedError,
    TransferHandle,
    TransferOp,
    TransferState,
    TransferTimeoutError,
    TransportError,
    UnknownRemoteError,
)
from shared.transport.metadata import AgentMetadata
from shared.transport.regions import RegionTable, describe_memory, validate_transfer

logger = logging.getLogger(__name__)


@dataclass
class Inflight:
    handle: TransferHandle
    deadline_s: float
    local_regions: frozenset[MemoryRegion]
    token: Any = None  # the backend's own state for this transfer


class TransportCore(abc.ABC):
    """Shared implementation of `Transport`; subclasses implement the `_hooks`."""

    kind: ClassVar[str]
    mem_types: ClassVar[frozenset[MemType]] = frozenset({MemType.DRAM})

    def __init__(self, name: str, transfer_timeout_s: float) -> None:
        if not name:
            raise TransportError("an agent needs a non-empty name")
        if transfer_timeout_s <= 0:
            raise TransportError("transfer_timeout_s must be positive")
        self._name = name
        self._transfer_timeout_s = transfer_timeout_s
        self._local = RegionTable()
        self._remotes: dict[str, RegionTable] = {}
        self._inflight: dict[int, Inflight] = {}
        self._xfer_ids = itertools.count(1)
        self._closed = False

    # --- the protocol -------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def regions(self) -> list[MemoryRegion]:
        return self._local.regions

    @property
    def remotes(self) -> list[str]:
        return list(self._remotes)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def metadata(self) -> bytes:
        self._check_open()
        return AgentMetadata(self.kind, self._name, tuple(self._local.regions), self._blob()).encode()

    def register(self, memory: Any) -> MemoryRegion:
        self._check_open()
        region = describe_memory(memory)
        if region.mem_type not in self.mem_types:
            raise TransportError(f"the {self.kind} transport cannot register {region.mem_type.value} memory")
        self._local.add(region, memory)
        try:
            self._register_backend(region)
        except BaseException:
            self._local.remove(region)
            raise
        return region

    def deregister(self, region: MemoryRegion) -> None:
        if any(region in x.local_regions for x in self._inflight.values()):
            raise TransportError(f"{region} has transfers in flight")
        self._local.remove(region)
        self._deregister_backend(region)

    def add_remote(self, name: str, metadata: bytes) -> None:
        self._check_open()
        md = AgentMetadata.decode(metadata)
        if md.kind != self.kind:
            raise TransportError(f"metadata of a {md.kind!r} agent given to a {self.kind!r} transport")
        if md.name != name:
            raise TransportError(f"metadata names agent {md.name!r}, not {name!r}")
        if name == self._name:
            raise TransportError(f"agent {name!r} cannot add itself as a remote")
        if name in self._remotes:
            self.remove_remote(name)
        self._connect(md)
        self._remotes[name] = RegionTable(md.regions)
        logger.debug("agent %s: added remote %s (%d regions)", self._name, name, len(md.regions))

    def remove_remote(self, name: str) -> None:
        if name not in self._remotes:
            raise UnknownRemoteError(f"agent {self._name!r} has no remote {name!r}")
        for x in [x for x in self._inflight.values() if x.handle.remote_name == name]:
            self._finish(x, f"remote {name!r} removed")
        del self._remotes[name]
        self._disconnect(name)

    def start(
        self, op: TransferOp, local_descs: Sequence[Descriptor], remote_name: str,
        remote_descs: Sequence[Descriptor],
    ) -> TransferHandle:
        self._check_open()
        remote = self._remotes.get(remote_name)
        if remote is None:
            raise UnknownRemoteError(f"agent {self._name!r} has no remote {remote_name!r}")
        local_regions, _ = validate_transfer(self._local, local_descs, remote, remote_descs)
        nbytes = sum(d.nbytes for d in local_descs)
        handle = TransferHandle(next(self._xfer_ids), TransferOp(op), remote_name, nbytes, len(local_descs))
        x = Inflight(handle, handle.started_s + self._transfer_timeout_s, frozenset(local_regions))
        self._inflight[handle.xfer_id] = x
        try:
            x.token = self._post(handle, local_descs, remote_descs)
        except InvalidDescriptorError:
            del self._inflight[handle.xfer_id]
            raise
        except TransportError as e:
            self._finish(x, e.message)
        except BaseException:
            del self._inflight[handle.xfer_id]
            raise
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        x = self._inflight.get(handle.xfer_id)
        if x is None or x.handle is not handle:
            return handle.state
        try:
            if self._progress(x.token) is TransferState.DONE:
                self._finish(x, None)
            elif time.monotonic() > x.deadline_s:
                self._finish(x, f"no completion within {self._transfer_timeout_s:g} s")
        except TransportError as e:
            self._finish(x, e.message)
        return handle.state

    def wait(self, handle: TransferHandle, timeout_s: float) -> TransferHandle:
        deadline_s = time.monotonic() + timeout_s
        while self.poll(handle) is TransferState.PENDING:
            x = self._inflight[handle.xfer_id]
            now = time.monotonic()
            if now >= deadline_s:
                self._finish(x, f"wait timed out after {timeout_s:g} s")
                raise TransferTimeoutError(
                    f"transfer {handle.xfer_id} to {handle.remote_name!r}: {handle.error}")
            self._block(x.token, min(deadline_s, x.deadline_s) - now)
        if handle.state is TransferState.FAILED:
            raise TransferFailedError(
                f"transfer {handle.xfer_id} to {handle.remote_name!r} failed: {handle.error}")
        return handle

    def expect_traffic(self) -> None:  # noqa: B027 (a hook: most backends need nothing)
        """Backends whose peers need this side progressed (NIXL over tcp) speed up; the others need nothing."""

    def watch_traffic(self, moving: Callable[[], bool]) -> None:  # noqa: B027 (as expect_traffic)
        """As `expect_traffic`, for as long as `moving()` is true."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for x in list(self._inflight.values()):
            self._finish(x, "transport closed")
        for name in list(self._remotes):
            self._best_effort(self._disconnect, name)
        self._remotes.clear()
        for region in self._local.regions:
            self._best_effort(self._deregister_backend, region)
            self._local.remove(region)
        self._shutdown()

    def __enter__(self) -> TransportCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- shared helpers -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"{self.kind} agent {self._name!r} is closed")

    def _finish(self, x: Inflight, error: str | None) -> None:
        """End a transfer exactly once: DONE when `error` is None, else FAILED (aborting it)."""
        del self._inflight[x.handle.xfer_id]
        if x.token is not None:
            self._best_effort(self._release, x.token, error is not None)
        handle = x.handle
        handle.state = TransferState.DONE if error is None else TransferState.FAILED
        handle.error = error
        handle.finished_s = time.monotonic()
        if error is not None:
            logger.warning("agent %s: transfer %d (%s %d bytes) to %s failed: %s", self._name,
                           handle.xfer_id, handle.op.value, handle.nbytes, handle.remote_name, error)

    def _best_effort(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            logger.exception("agent %s: %s failed during cleanup", self._name, getattr(fn, "__name__", fn))

    # --- backend hooks ------------------------------------------------------------------------------

    @abc.abstractmethod
    def _blob(self) -> bytes:
        """What a peer needs to connect (goes inside the metadata envelope)."""

    @abc.abstractmethod
    def _register_backend(self, region: MemoryRegion) -> None: ...

    @abc.abstractmethod
    def _deregister_backend(self, region: MemoryRegion) -> None: ...

    @abc.abstractmethod
    def _connect(self, remote: AgentMetadata) -> None: ...

    @abc.abstractmethod
    def _disconnect(self, name: str) -> None: ...

    @abc.abstractmethod
    def _post(self, handle: TransferHandle, local_descs: Sequence[Descriptor],
              remote_descs: Sequence[Descriptor]) -> Any:
        """Start moving bytes; returns the token later hooks get. Raises TransportError to fail it."""

    @abc.abstractmethod
    def _progress(self, token: Any) -> TransferState:
        """PENDING or DONE without blocking; raises TransportError when the transfer failed."""

    @abc.abstractmethod
    def _release(self, token: Any, abort: bool) -> None:
        """Free the transfer's resources once it ended; `abort`: cancel it first if still running."""

    def _block(self, token: Any, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for the transfer to make progress; default: yield the CPU."""
        time.sleep(0)

    @abc.abstractmethod
    def _shutdown(self) -> None:
        """Stop the backend's threads and release its agent (after everything else was freed)."""
