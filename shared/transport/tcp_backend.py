"""Plain TCP: the fallback where neither NIXL nor ucxx can run.

Each agent serves its registered memory on a TCP port (127.0.0.1 unless told
otherwise); its metadata blob is "host:port:key" (the key: 32 random bytes, hex,
that every connection opens with; tcp_server.py). An initiator keeps one
connection per remote agent and runs that connection's transfers in order on
a small thread; the transfer's completion is the target's reply::

    initiator                                        target (server thread per connection)
    on connect: [hello magic key]                 ─►  the agent's key? else close
    READ:  [hdr op xfer_id n][n × (addr, nbytes)]  ─►  check ranges
                                                   ◄─  [reply status xfer_id err] [bytes of each desc]
    WRITE: [hdr][descs][bytes of each desc]         ─►  check, recv into its memory (or drain)
                                                   ◄─  [reply status xfer_id err]

Bytes go straight between the socket and registered memory (no staging copy).
A dead peer shows up as EOF or a reset on the socket; a silent one hits the
socket timeout (the transfer deadline).
"""

from __future__ import annotations

import logging
import queue
import secrets
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.transport.base import (
    Descriptor,
    InvalidDescriptorError,
    MemoryRegion,
    TransferHandle,
    TransferOp,
    TransferState,
    TransportError,
)
from shared.transport.core import TransportCore
from shared.transport.metadata import AgentMetadata
from shared.transport.regions import host_view
from shared.transport.tcp_server import (
    DESC,
    HELLO,
    HELLO_MAGIC,
    KEY_NBYTES,
    MAGIC,
    OP_CODES,
    REPLY,
    REQUEST,
    RegionGuard,
    TcpServer,
    recv_exact,
    recv_into,
)

logger = logging.getLogger(__name__)

SOCKET_BUFFER_NBYTES = 4 << 20


@dataclass(eq=False)
class _TcpXfer:
    """One transfer as the connection thread sees it: queued -> active -> finished."""

    op: TransferOp
    xfer_id: int
    local_descs: Sequence[Descriptor]
    remote_descs: Sequence[Descriptor]
    lock: threading.Lock = field(default_factory=threading.Lock)
    phase: str = "queued"
    error: str | None = None
    finished: threading.Event = field(default_factory=threading.Event)

    def claim(self) -> bool:
        with self.lock:
            if self.phase != "queued":
                return False
            self.phase = "active"
            return True

    def finish(self, error: str | None) -> None:
        with self.lock:
            if self.phase == "finished":
                return
            self.phase, self.error = "finished", error
        self.finished.set()


class _Connection:
    """One socket to one remote agent and the thread that runs its transfers in order."""

    def __init__(self, address: tuple[str, int], key: bytes, timeout_s: float, label: str) -> None:
        self._address = address
        self._key = key
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._queue: queue.SimpleQueue[_TcpXfer | None] = queue.SimpleQueue()
        # the transfer on the socket now, and whether an abort shut the socket down: an abort may only
        # interrupt its own transfer, never the next one (of another request) sharing the connection
        self._active_lock = threading.Lock()
        self._active: _TcpXfer | None = None
        self._interrupted = False
        self._thread = threading.Thread(target=self._run, name=f"tcp-xfer-{label}", daemon=True)
        self._thread.start()

    def submit(self, xfer: _TcpXfer) -> None:
        self._queue.put(xfer)

    def abort(self, xfer: _TcpXfer) -> None:
        """Stop `xfer`; once this returns the thread no longer touches its memory."""
        with xfer.lock:
            if xfer.phase == "queued":
                xfer.phase, xfer.error = "finished", "aborted"
                xfer.finished.set()
                return
        with self._active_lock:
            if self._active is xfer:
                self._interrupted = True
                self._interrupt()
        if not xfer.finished.wait(self._timeout_s):
            logger.error("tcp transfer %d did not stop after abort", xfer.xfer_id)

    def close(self) -> None:
        self._queue.put(None)
        self._interrupt()
        self._thread.join(self._timeout_s)

    def _interrupt(self) -> None:
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _run(self) -> None:
        while (xfer := self._queue.get()) is not None:
            with self._active_lock:
                if not xfer.claim():
                    continue
                self._active = xfer
            error: str | None
            try:
                error = self._transfer(xfer)
            except (OSError, TransportError) as e:
                self._drop()
                error = f"{type(e).__name__}: {e}"
            with self._active_lock:
                self._active = None
                if self._interrupted:  # shut down by an abort, maybe after the reply was in: start afresh
                    self._interrupted = False
                    self._drop()
            xfer.finish(error)
        self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _socket(self) -> socket.socket:
        if self._sock is None:
            sock = socket.create_connection(self._address, timeout=self._timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_NBYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_NBYTES)
            sock.sendall(HELLO.pack(HELLO_MAGIC, self._key))
            self._sock = sock
        return self._sock

    def _transfer(self, xfer: _TcpXfer) -> str | None:
        """Run one request/reply; returns the target's error (None: done). Raises on a broken socket."""
        sock = self._socket()
        header = REQUEST.pack(MAGIC, OP_CODES[xfer.op], xfer.xfer_id, len(xfer.remote_descs))
        sock.sendall(header + b"".join(DESC.pack(d.addr, d.nbytes) for d in xfer.remote_descs))
        if xfer.op is TransferOp.WRITE:
            for desc in xfer.local_descs:
                sock.sendall(host_view(desc))
        magic, status, xfer_id, error_nbytes = REPLY.unpack(recv_exact(sock, REPLY.size))
        if magic != MAGIC or xfer_id != xfer.xfer_id:
            raise TransportError(f"protocol error: reply for transfer {xfer_id}, expected {xfer.xfer_id}")
        if status != 0:
            return recv_exact(sock, error_nbytes).decode(errors="replace")
        if xfer.op is TransferOp.READ:
            for desc in xfer.local_descs:
                recv_into(sock, host_view(desc))
        return None


class TcpTransport(TransportCore):
    """Transfers over TCP sockets; each agent also serves its registered memory."""

    kind = "tcp"

    def __init__(self, name: str, *, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 transfer_timeout_s: float = 30.0) -> None:
        """Serve on (host, port) (port 0: any free one); peers connect to `advertise_host` (default: host)."""
        super().__init__(name, transfer_timeout_s)
        self._guard = RegionGuard()
        self._key = secrets.token_bytes(KEY_NBYTES)  # in the metadata only: who connects must have asked for it
        self._server = TcpServer(host, port, self._guard, transfer_timeout_s, label=name, key=self._key)
        self._advertise_host = advertise_host or self._server.address[0]
        self._connections: dict[str, _Connection] = {}

    @property
    def address(self) -> tuple[str, int]:
        return self._advertise_host, self._server.address[1]

    @property
    def num_refused_connections(self) -> int:
        return self._server.num_refused

    def _blob(self) -> bytes:
        host, port = self.address
        return f"{host}:{port}:{self._key.hex()}".encode()

    def _register_backend(self, region: MemoryRegion) -> None:
        self._guard.publish(self._local.regions)

    def _deregister_backend(self, region: MemoryRegion) -> None:
        # `_local` no longer holds it: publish, then wait out requests that may still touch it.
        self._guard.publish([r for r in self._local.regions if r != region])

    def _connect(self, remote: AgentMetadata) -> None:
        address, _, key_hex = remote.blob.decode(errors="replace").rpartition(":")
        host, _, port = address.rpartition(":")
        try:
            key = bytes.fromhex(key_hex)
        except ValueError:
            key = b""
        if not host or not port.isdigit() or len(key) != KEY_NBYTES:
            raise TransportError(f"bad tcp address or key in {remote.name!r}'s metadata")
        self._connections[remote.name] = _Connection((host, int(port)), key, self._transfer_timeout_s,
                                                     f"{self._name}->{remote.name}")

    def _disconnect(self, name: str) -> None:
        self._connections.pop(name).close()

    def _post(self, handle: TransferHandle, local_descs: Sequence[Descriptor],
              remote_descs: Sequence[Descriptor]) -> tuple[_Connection, _TcpXfer]:
        if any(d.device_id != 0 for d in remote_descs):
            raise InvalidDescriptorError("the tcp transport moves host memory only")
        conn = self._connections[handle.remote_name]
        xfer = _TcpXfer(handle.op, handle.xfer_id, list(local_descs), list(remote_descs))
        conn.submit(xfer)
        return conn, xfer

    def _progress(self, token: tuple[_Connection, _TcpXfer]) -> TransferState:
        xfer = token[1]
        if not xfer.finished.is_set():
            return TransferState.PENDING
        if xfer.error is not None:
            raise TransportError(xfer.error)
        return TransferState.DONE

    def _block(self, token: tuple[_Connection, _TcpXfer], timeout_s: float) -> None:
        token[1].finished.wait(timeout_s)

    def _release(self, token: tuple[_Connection, _TcpXfer], abort: bool) -> None:
        if abort:
            token[0].abort(token[1])

    def _shutdown(self) -> None:
        self._server.close()
