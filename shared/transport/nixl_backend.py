"""NIXL with its UCX backend: one-sided READ/WRITE of registered memory.

    initiator                                   target
    register ─► agent.register_memory           register ─► agent.register_memory
    add_remote ─► agent.add_remote_agent(md) ◄── metadata (NIXL agent metadata inside)
    start ─► initialize_xfer + transfer         (passive: UCX RMA, nothing to serve)
    poll  ─► check_xfer_state (drives UCX progress) ─► DONE | ERR (NIXL_ERR_REMOTE_DISCONNECT …)

Between two processes on one host UCX picks `cma` (process_vm_readv/writev:
one copy, no target CPU) for host memory; over `tcp` the target's worker has
to be progressed, which a small thread here does every
`passive_progress_interval_s` (the agent is created with
`enable_prog_thread=False`: NIXL's own progress thread busy-polls a core).
It does so only while traffic is expected: for `ACTIVE_WINDOW_S` after the
agent's own last call, a notification, or `expect_traffic()` (kv_transfer
calls it when a handoff is reserved or claimed, before the peer moves the
data), and while `watch_traffic`'s probe says data moves (kv_transfer's: a
handoff is being written or read); otherwise every `passive_idle_interval_s`.
At 2 ms always, an idle kv_transfer woke ~500 times a second and took ~3% of
a core (28 ms a second, measured on 2 cores), and every agent of a stack did
so once it had moved data: each wake-up preempts a thread of an engine's step
on the same host.
Every agent call takes one lock, so the owner thread and that thread never
race inside NIXL (whose agents are created with thread sync NONE).

Configuration. NIXL's UCX plugin takes no transport option, and UCX reads
`UCX_*` from the process environment when the agent's context is created. The
agent's UCX settings (`ucx_tls`, `ucx_env`) are therefore put into
`os.environ` for the duration of the agent's creation only, under a lock, and
the previous values are restored right after.

VRAM: a CUDA tensor registers as VRAM with its device index, the same call;
UCX then moves it with its CUDA transports (`cuda_copy`, `cuda_ipc`) when
`ucx_tls` allows them (e.g. "cma,tcp,self,cuda_copy,cuda_ipc").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.transport.base import (
    Descriptor,
    InvalidDescriptorError,
    MemoryRegion,
    MemType,
    TransferHandle,
    TransferState,
    TransportError,
    TransportUnavailableError,
)
from shared.transport.core import TransportCore
from shared.transport.metadata import AgentMetadata
from shared.transport.regions import RegionTable

logger = logging.getLogger(__name__)

DEFAULT_UCX_TLS = "cma,tcp,self"
ACTIVE_WINDOW_S = 0.25  # progress at full rate this long after the last sign of traffic (module docstring)
_ENV_LOCK = threading.Lock()


def nixl_api() -> Any:
    """NIXL's Python API module (`nixl._api`); raises TransportUnavailableError if it cannot load."""
    try:
        import nixl  # noqa: F401  (picks nixl_cu12 / nixl_cu13 and aliases nixl._api)
        from nixl import _api
    except Exception as e:  # ImportError, or OSError from a wheel whose libraries do not load
        raise TransportUnavailableError(f"NIXL is not usable here: {type(e).__name__}: {e}") from e
    # NIXL logs every agent creation at INFO on stdout; keep stdout for the caller.
    logging.getLogger("nixl").setLevel(logging.WARNING)
    return _api


def _nixl_errors(api: Any) -> tuple[type[Exception], ...]:
    bindings = api.nixlBind
    return tuple(getattr(bindings, n) for n in dir(bindings) if n.startswith("nixl") and n.endswith("Error"))


@contextmanager
def _process_env(values: Mapping[str, str]) -> Iterator[None]:
    """Set `values` in the process environment for the block, then restore (see module doc)."""
    with _ENV_LOCK:
        saved = {key: os.environ.get(key) for key in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for key, old in saved.items():
                if old is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = old


@dataclass
class _NixlXfer:
    xfer: Any  # nixl_xfer_handle
    done: bool


class NixlTransport(TransportCore):
    """A NIXL agent with the UCX backend, progressed from the caller's thread."""

    kind = "nixl"
    mem_types = frozenset({MemType.DRAM, MemType.VRAM})

    def __init__(
        self, name: str, *, ucx_tls: str = DEFAULT_UCX_TLS, ucx_env: Mapping[str, str] | None = None,
        passive_progress_interval_s: float | None = 0.002, transfer_timeout_s: float = 30.0,
        passive_idle_interval_s: float = 0.02,
    ) -> None:
        """`ucx_env`: more UCX settings, e.g. {"UCX_LOG_LEVEL": "error"}.

        `passive_progress_interval_s`: how often the agent progresses UCX on its own (None: never),
        which peers need for connection setup and for transfers over transports other than cma, while
        traffic is expected; `passive_idle_interval_s` otherwise (see the module docstring).
        """
        super().__init__(name, transfer_timeout_s)
        api = nixl_api()
        self._errors = _nixl_errors(api)
        env = {"UCX_TLS": ucx_tls, "UCX_WARN_UNUSED_ENV_VARS": "n", **(ucx_env or {})}
        config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
        creation_errors: tuple[type[Exception], ...] = (RuntimeError, *self._errors)
        try:
            with _process_env(env):
                self._agent = api.nixl_agent(name, config)
        except creation_errors as e:
            raise TransportUnavailableError(f"NIXL agent {name!r}: {type(e).__name__}: {e}") from e
        if "UCX" not in self._agent.backends:
            raise TransportUnavailableError("NIXL's UCX plugin did not load")
        self._lock = threading.Lock()
        self._reg_descs: dict[MemoryRegion, Any] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()  # expect_traffic(): leave the idle interval now
        self._active_until = 0.0  # time.monotonic() until which the progress thread polls at full rate
        self._mark_active()  # connection setup follows creation
        self.num_progress_calls = 0  # the progress thread's polls (tests read it)
        self._moving: Callable[[], bool] = lambda: False  # watch_traffic()
        self._progress_thread: threading.Thread | None = None
        if passive_progress_interval_s is not None:
            self._progress_thread = threading.Thread(
                target=self._progress_loop, args=(passive_progress_interval_s, passive_idle_interval_s),
                name=f"nixl-progress-{name}", daemon=True,
            )
            self._progress_thread.start()

    def _mark_active(self) -> None:
        self._active_until = time.monotonic() + ACTIVE_WINDOW_S

    def expect_traffic(self) -> None:
        self._mark_active()
        self._wake.set()

    def watch_traffic(self, moving: Callable[[], bool]) -> None:
        self._moving = moving

    def _progress_loop(self, interval_s: float, idle_interval_s: float) -> None:
        """Progress the UCX worker so that peers' transfers over non-one-sided transports complete."""
        while not self._stop.is_set():
            active = time.monotonic() < self._active_until or self._moving()
            self._wake.wait(interval_s if active else max(interval_s, idle_interval_s))
            self._wake.clear()
            if self._stop.is_set():
                return
            self.num_progress_calls += 1
            with self._lock:
                try:
                    notifications = self._agent.get_new_notifs()
                except self._errors:
                    logger.exception("agent %s: NIXL progress failed", self._name)
                    continue
            if notifications:  # a peer is at work here
                self._mark_active()

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        self._mark_active()  # the owner is at work: so may its peers be
        with self._lock:
            try:
                return fn(*args)
            except self._errors as e:
                raise TransportError(f"NIXL {what}: {type(e).__name__}: {e}") from e

    def _blob(self) -> bytes:
        return bytes(self._call("get_agent_metadata", self._agent.get_agent_metadata))

    def _register_backend(self, region: MemoryRegion) -> None:
        rows = [(region.addr, region.nbytes, region.device_id, "")]
        self._reg_descs[region] = self._call("register_memory", self._agent.register_memory, rows,
                                             region.mem_type.value)

    def _deregister_backend(self, region: MemoryRegion) -> None:
        self._call("deregister_memory", self._agent.deregister_memory, self._reg_descs.pop(region))

    def _connect(self, remote: AgentMetadata) -> None:
        added = self._call("add_remote_agent", self._agent.add_remote_agent, remote.blob)
        added_name = added.decode() if isinstance(added, bytes) else str(added)  # bytes, despite its hint
        if added_name != remote.name:
            self._call("remove_remote_agent", self._agent.remove_remote_agent, added_name)
            raise TransportError(f"NIXL metadata is for agent {added_name!r}, not {remote.name!r}")

    def _disconnect(self, name: str) -> None:
        self._call("remove_remote_agent", self._agent.remove_remote_agent, name)

    def _post(self, handle: TransferHandle, local_descs: Sequence[Descriptor],
              remote_descs: Sequence[Descriptor]) -> _NixlXfer:
        local_type = _mem_type(self._local, local_descs)
        remote_type = _mem_type(self._remotes[handle.remote_name], remote_descs)
        agent = self._agent
        local = self._call("get_xfer_descs", agent.get_xfer_descs, _rows(local_descs), local_type)
        remote = self._call("get_xfer_descs", agent.get_xfer_descs, _rows(remote_descs), remote_type)
        xfer = self._call("initialize_xfer", agent.initialize_xfer, handle.op.value, local, remote,
                          handle.remote_name)
        try:
            status = self._call("transfer", agent.transfer, xfer)
            if status == "ERR":
                raise TransportError("NIXL transfer: posting failed")
        except TransportError:
            self._release(_NixlXfer(xfer, False), abort=True)
            raise
        return _NixlXfer(xfer, status == "DONE")

    def _progress(self, token: _NixlXfer) -> TransferState:
        if not token.done:
            status = self._call("check_xfer_state", self._agent.check_xfer_state, token.xfer)
            if status == "ERR":
                raise TransportError("NIXL transfer failed")
            token.done = status == "DONE"
        return TransferState.DONE if token.done else TransferState.PENDING

    def _release(self, token: _NixlXfer, abort: bool) -> None:
        # Releasing a transfer that is still active asks NIXL to cancel it first.
        self._call("release_xfer_handle", self._agent.release_xfer_handle, token.xfer)

    def _shutdown(self) -> None:
        self._stop.set()
        self._wake.set()  # out of an idle wait at once
        if self._progress_thread is not None:
            self._progress_thread.join()
        with self._lock:
            self._agent = None  # the agent is destroyed with its last reference


def _rows(descs: Sequence[Descriptor]) -> np.ndarray:
    return np.array([(d.addr, d.nbytes, d.device_id) for d in descs], dtype=np.uint64).reshape(-1, 3)


def _mem_type(table: RegionTable, descs: Sequence[Descriptor]) -> str:
    """The one memory type of a descriptor list (a NIXL descriptor list has exactly one)."""
    types = {table.find(d).mem_type for d in descs}
    if len(types) != 1:
        raise InvalidDescriptorError("one transfer cannot mix DRAM and VRAM descriptors on one side")
    return types.pop().value
