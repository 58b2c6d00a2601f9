"""ucxx (the maintained successor of ucx-py): UCX tagged messages between worker addresses.

ucxx's Python API has no RMA (no memory handles or remote keys), so a
transfer is tagged messages that the target's server loop answers; UCX still
moves large messages with its rendezvous protocol, which over `cma` is one
zero-copy process_vm_readv straight between the two registered buffers::

    initiator                                          target (server loop)
    READ:  post recv DATA(k,i) into each local desc
           send CTRL READ(k, remote descs)       ──►  check ranges
                                                 ◄──  send DATA(k,i) from its memory, REPLY(k) ok
    WRITE: send CTRL WRITE(k, remote descs),
           send DATA(k,i) from each local desc   ──►  check, recv DATA(k,i) into its memory
                                                 ◄──  REPLY(k) ok once every recv completed

"Completion from the transfer itself": a transfer is DONE when all of its own
requests completed and the target's REPLY for this transfer key said ok; for
a READ the reply travels with the data, for a WRITE it is the target's
acknowledgement that the bytes landed (a send completing only says the
local buffer is free). No separate notification exists. A rejected range is
answered with an error REPLY (plus empty DATA messages that complete a READ's
posted receives, or truncating receives that drain a WRITE's data).

Endpoints are created from worker addresses. Error handling is ON by
default, and that is a real trade-off measured here (libucx 1.21):

- on (`endpoint_error_handling=True`, default): UCX detects a dead peer and
  the transfer fails at once, but UCX then excludes `cma` (it cannot report a
  peer's failure), so everything runs over tcp/lo: ~1 GB/s. In this mode the
  agent also keeps UCX to its copy protocols (RNDV_THRESH=ZCOPY_THRESH=inf):
  UCX 1.21 segfaults while purging a failed endpoint's zero-copy requests
  (`ucp_ep_reqs_purge` -> `ucp_request_memh_invalidate` ->
  `ucs_rcache_region_invalidate` on a NULL cache). Seen here with
  UCX_RCACHE_ENABLE=n, and in processes where NIXL's own UCX copy was active.
- off: `cma` is used, shared-memory speed (4-8 GB/s at 64 MiB here), but a peer
  that dies while UCX is inside process_vm_readv/writev of its memory makes
  UCX abort this whole process ("cma_ep.c: process_vm_readv ... No such
  process", then SIGABRT). Use it only where both peers live and die together.

With it off, a silent peer is caught by the transfer deadline: the endpoint is
closed, which cancels its outstanding requests, so none touches the memory
afterwards.

Threads: a server thread per agent sleeps on the worker's epoll fd and
progresses the worker when UCX has events (serving peers' requests needs no
help from the owner); the owner thread posts requests and, while it polls or
waits, progresses the worker itself, so a completion needs no thread handoff.
Every UCX call holds one lock.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.transport.base import (
    Descriptor,
    InvalidDescriptorError,
    MemoryRegion,
    TransferHandle,
    TransferOp,
    TransferState,
    TransportError,
    TransportUnavailableError,
)
from shared.transport.core import TransportCore
from shared.transport.metadata import AgentMetadata
from shared.transport.regions import RegionTable
from shared.transport.ucxx_server import Ucx, UcxServer, ucxx_api
from shared.transport.ucxx_wire import (
    CTRL_TAG,
    MAX_DESCS,
    REPLY_NBYTES,
    Ctrl,
    CtrlOp,
    data_tag,
    decode_reply,
    encode_ctrl,
    new_key,
    reply_tag,
)

__all__ = ["UcxxTransport", "ucxx_api"]

logger = logging.getLogger(__name__)

DEFAULT_UCX_TLS = "cma,tcp,self"
SAFE_PROTOCOLS = {"RNDV_THRESH": "inf", "ZCOPY_THRESH": "inf"}  # with error handling on: see the module doc
OWNER_GRACE_S = 0.002  # the server thread stays idle this long after the owner last progressed


@dataclass(eq=False)
class _ClientXfer:
    """The initiator's side of one transfer; whoever progresses the worker completes it."""

    key: int
    peer: str
    reply: bytearray = field(default_factory=lambda: bytearray(REPLY_NBYTES))
    requests: list[Any] = field(default_factory=list)
    keepalive: list[Any] = field(default_factory=list)
    checked: int = 0  # requests[:checked] completed without error
    error: str | None = None
    finished: threading.Event = field(default_factory=threading.Event)


class UcxxTransport(TransportCore):
    """A ucxx worker serving its registered memory and running transfers to its remotes."""

    kind = "ucxx"

    def __init__(
        self, name: str, *, ucx_tls: str = DEFAULT_UCX_TLS, ucx_options: Mapping[str, str] | None = None,
        endpoint_error_handling: bool = True, idle_wait_s: float = 0.005, transfer_timeout_s: float = 30.0,
    ) -> None:
        """`ucx_options`: more UCX settings without the UCX_ prefix (e.g. {"LOG_LEVEL": "error"})."""
        super().__init__(name, transfer_timeout_s)
        self._ucx = Ucx.load()
        lib = self._ucx.lib
        safe = SAFE_PROTOCOLS if endpoint_error_handling else {}
        config = {"TLS": ucx_tls, **safe, **(ucx_options or {})}
        try:
            self._context = lib.UCXContext(config, feature_flags=(lib.Feature.TAG, lib.Feature.WAKEUP))
            self._worker = lib.UCXWorker(self._context)
            self._worker.init_blocking_progress_mode()
        except lib.UCXError as e:
            raise TransportUnavailableError(f"ucxx worker {name!r}: {type(e).__name__}: {e}") from e
        self._error_handling = endpoint_error_handling
        self._idle_wait_s = idle_wait_s
        self._lock = threading.Lock()
        self._ops_done = threading.Condition(self._lock)
        self._server = UcxServer(self._ucx, self._worker, name, transfer_timeout_s, endpoint_error_handling,
                                 self._close)
        self._remote_addresses: dict[str, bytes] = {}
        self._eps: dict[str, Any] = {}  # remote name -> endpoint
        self._clients: dict[int, _ClientXfer] = {}
        self._graveyard: list[Any] = []  # closed endpoints and abandoned requests (see `_close`)
        self._stop = False
        self._owner_busy_until_s = 0.0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._serve_loop, name=f"ucxx-{name}", daemon=True)
        self._thread.start()

    # --- TransportCore hooks (owner thread) ----------------------------------------------------------

    def _blob(self) -> bytes:
        with self._lock:
            return bytes(self._worker.address.tobytes())

    def _register_backend(self, region: MemoryRegion) -> None:
        with self._lock:
            self._server.served = RegionTable(self._local.regions)

    def _deregister_backend(self, region: MemoryRegion) -> None:
        with self._ops_done:
            self._server.served = RegionTable([r for r in self._local.regions if r != region])
            if not self._ops_done.wait_for(lambda: not self._server.uses(region), self._transfer_timeout_s):
                logger.error("agent %s: requests on %s did not end before deregistration", self._name, region)

    def _connect(self, remote: AgentMetadata) -> None:
        self._remote_addresses[remote.name] = remote.blob
        with self._lock:
            self._endpoint(remote.name)
        self._wake()

    def _disconnect(self, name: str) -> None:
        self._remote_addresses.pop(name, None)
        with self._lock:
            self._close(self._eps.pop(name, None))

    def _post(self, handle: TransferHandle, local_descs: Sequence[Descriptor],
              remote_descs: Sequence[Descriptor]) -> _ClientXfer:
        if len(local_descs) > MAX_DESCS:
            raise InvalidDescriptorError(f"at most {MAX_DESCS} descriptors per ucxx transfer")
        with self._lock:
            key = new_key()
            while key in self._clients:
                key = new_key()
            x = _ClientXfer(key, handle.remote_name)
            ctrl_op = CtrlOp.READ if handle.op is TransferOp.READ else CtrlOp.WRITE
            frame = encode_ctrl(Ctrl(ctrl_op, key, self._name, descs=tuple(remote_descs)))
            try:
                self._post_requests(x, handle.op, local_descs, frame)
            except self._ucx.lib.UCXError as e:
                self._close(self._eps.pop(x.peer, None))  # cancels whatever was already posted
                raise TransportError(f"ucxx post: {type(e).__name__}: {e}") from e
            self._clients[key] = x
        return x

    def _post_requests(self, x: _ClientXfer, op: TransferOp, local_descs: Sequence[Descriptor],
                       frame: bytes) -> None:
        ep, ucx = self._endpoint(x.peer), self._ucx
        data = [(ucx.host_array(desc, x.keepalive), ucx.tag(data_tag(x.key, i)))
                for i, desc in enumerate(local_descs)]
        reply = (ucx.array(x.reply), ucx.tag(reply_tag(x.key)))
        ctrl = (ucx.array(frame), ucx.tag(CTRL_TAG))
        x.keepalive.append(frame)
        if op is TransferOp.READ:  # receives first, so the data never waits as unexpected
            x.requests.extend(ep.tag_recv(*d) for d in data)
            x.requests.append(ep.tag_recv(*reply))
            x.requests.append(ep.tag_send(*ctrl))
        else:
            x.requests.append(ep.tag_send(*ctrl))
            x.requests.extend(ep.tag_send(*d) for d in data)
            x.requests.append(ep.tag_recv(*reply))

    def _progress(self, token: _ClientXfer) -> TransferState:
        if not token.finished.is_set():
            self._owner_busy_until_s = time.monotonic() + OWNER_GRACE_S
            with self._lock:
                self._step()  # progress from the caller's own loop: no thread handoff on completion
        if not token.finished.is_set():
            return TransferState.PENDING
        if token.error is not None:
            raise TransportError(token.error)
        return TransferState.DONE

    def _block(self, token: _ClientXfer, timeout_s: float) -> None:
        """Nothing: `_progress` already drove the worker; yielding the CPU here costs a time slice."""

    def _release(self, token: _ClientXfer, abort: bool) -> None:
        with self._lock:
            if self._clients.pop(token.key, None) is not None:  # still running: abort it
                self._cancel(token)

    def _shutdown(self) -> None:
        with self._lock:
            self._stop = True
        self._wake()
        self._thread.join()
        with self._lock:
            for name in list(self._eps):
                self._close(self._eps.pop(name))
            self._server.close()
            for _ in range(100):
                self._worker.progress()
            self._graveyard.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # --- helpers (lock held, except _wake) -----------------------------------------------------------

    def _wake(self) -> None:
        """Get the server thread out of its epoll wait (new requests need progress)."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: it will wake anyway

    def _endpoint(self, name: str) -> Any:
        """The endpoint to remote `name`, (re)created with a HELLO so the remote can answer."""
        ep = self._eps.get(name)
        if ep is None:
            lib = self._ucx.lib
            address = lib.UCXAddress.create_from_buffer(self._remote_addresses[name])
            ep = lib.UCXEndpoint.create_from_worker_address(self._worker, address, self._error_handling)
            self._eps[name] = ep
            own_address = bytes(self._worker.address.tobytes())
            hello = encode_ctrl(Ctrl(CtrlOp.HELLO, 0, self._name, address=own_address))
            self._server.send_and_forget(ep, hello, CTRL_TAG)
        return ep

    def _close(self, ep: Any) -> None:
        """Close an endpoint, unless UCX already failed it, and keep its object until shutdown.

        ucxx crashes when an endpoint object dies while UCX may still call back into it (a close
        or an error in flight), or when a failed endpoint is closed again: closed endpoints are
        therefore kept in `_graveyard` and released only after the worker stopped.
        """
        if ep is None:
            return
        if ep.alive:
            ep.close()
        self._graveyard.append(ep)

    def _step(self) -> None:
        """One round of progress: UCX, both halves' requests."""
        self._worker.progress()
        self._advance_clients()
        if self._server.step():
            self._ops_done.notify_all()

    def _advance_clients(self) -> None:
        for key, x in list(self._clients.items()):
            while x.checked < len(x.requests) and x.requests[x.checked].completed:
                error = self._ucx.first_error(x.requests[x.checked:x.checked + 1])
                if error is not None:  # fail fast: the rest would wait for a peer that is gone
                    del self._clients[key]
                    self._cancel(x)
                    x.error = error
                    x.finished.set()
                    break
                x.checked += 1
            else:
                if x.checked == len(x.requests):
                    del self._clients[key]
                    x.error = decode_reply(x.reply)
                    x.finished.set()

    def _cancel(self, x: _ClientXfer) -> None:
        """Close the endpoint under `x` (cancelling every request on it) and wait until they ended."""
        # Other transfers to this peer fail too: the only way to take back memory a silent peer may
        # still be asked to fill. The next transfer re-creates the endpoint.
        self._close(self._eps.pop(x.peer, None))
        deadline_s = time.monotonic() + 1.0
        while not all(r.completed for r in x.requests) and time.monotonic() < deadline_s:
            self._worker.progress()
        if not all(r.completed for r in x.requests):
            logger.error("agent %s: requests to %s still pending after cancel", self._name, x.peer)
            self._graveyard.append((x.requests, x.keepalive))

    # --- server thread -------------------------------------------------------------------------------

    def _serve_loop(self) -> None:
        poller = select.epoll()
        poller.register(self._worker.epoll_file_descriptor, select.EPOLLIN)
        poller.register(self._wake_r, select.EPOLLIN)
        try:
            while True:
                if time.monotonic() < self._owner_busy_until_s:
                    time.sleep(OWNER_GRACE_S)  # the owner is progressing the worker: keep off the GIL
                    continue
                with self._lock:
                    if self._stop:
                        return
                    self._step()
                    armed = self._worker.arm()
                if armed:
                    poller.poll(self._idle_wait_s)
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
        except Exception:
            logger.exception("agent %s: ucxx server loop died", self._name)
            raise
        finally:
            poller.close()
