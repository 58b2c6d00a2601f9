"""The serving half of the TCP transport: a thread per connection, requests in order.

The server reads and writes registered memory in place. `RegionGuard` holds
the regions it may touch; deregistration publishes the smaller set and then
waits until no request still uses the old one, so freed memory is never
touched. A connection opens with the agent's key (a random secret in its
metadata, which peers get only through an authenticated GetAgent), as a UCX
peer needs the region's rkey: reaching the port is not enough to touch memory.
"""

from __future__ import annotations

import hmac
import logging
import socket
import struct
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from shared.transport.base import Descriptor, InvalidDescriptorError, MemoryRegion, TransferOp, TransportError
from shared.transport.regions import RegionTable, host_view

logger = logging.getLogger(__name__)

# The wire format (little-endian); the module doc of tcp_backend draws the exchange.
MAGIC = b"BTX1"
HELLO = struct.Struct("<4s32s")  # magic, the agent's key: the first bytes of every connection
HELLO_MAGIC = b"BTH1"
KEY_NBYTES = 32
REQUEST = struct.Struct("<4sBQI")  # magic, op, xfer_id, num_descs; then num_descs x DESC
DESC = struct.Struct("<QQ")  # addr, nbytes (target memory)
REPLY = struct.Struct("<4sBQI")  # magic, status (0 ok), xfer_id, error_nbytes; then the error text
OP_CODES = {TransferOp.READ: 1, TransferOp.WRITE: 2}
MAX_DESCS = 1 << 20
_DRAIN_NBYTES = 1 << 20


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    buf = bytearray(nbytes)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket; raises ConnectionError on EOF."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


class RegionGuard:
    """The regions the server may touch, swapped atomically; `publish` waits out readers."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._table = RegionTable()
        self._readers = 0

    def publish(self, regions: Sequence[MemoryRegion]) -> None:
        with self._cond:
            self._table = RegionTable(regions)
            self._cond.wait_for(lambda: self._readers == 0)

    @contextmanager
    def reading(self) -> Iterator[RegionTable]:
        with self._cond:
            self._readers += 1
            table = self._table
        try:
            yield table
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()


class TcpServer:
    """Accepts connections on (host, port) and serves READ/WRITE requests against `guard`'s regions."""

    def __init__(self, host: str, port: int, guard: RegionGuard, timeout_s: float, label: str, key: bytes) -> None:
        if len(key) != KEY_NBYTES:
            raise ValueError(f"the connection key has {KEY_NBYTES} bytes")
        self._key = key
        self.num_refused = 0  # connections that did not open with the key
        self._guard = guard
        self._timeout_s = timeout_s
        self._listener = socket.create_server((host, port))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"tcp-serve-{label}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(self._timeout_s)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="tcp-serve-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if not self._greeted(conn):
                return
            while self._serve_one(conn):
                pass
        except (OSError, TransportError) as e:
            logger.debug("tcp server: connection ended: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _greeted(self, conn: socket.socket) -> bool:
        """Whether the peer opened with this agent's key (compared in constant time); refusals are counted."""
        conn.settimeout(self._timeout_s)
        magic, key = HELLO.unpack(recv_exact(conn, HELLO.size))
        if magic == HELLO_MAGIC and hmac.compare_digest(key, self._key):
            return True
        with self._lock:
            self.num_refused += 1
        logger.warning("tcp server: refused a connection that did not open with the agent's key")
        return False

    def _serve_one(self, conn: socket.socket) -> bool:
        """Serve one request; False when the peer closed the connection between requests."""
        conn.settimeout(None)  # idle between requests is fine
        first = conn.recv(REQUEST.size, socket.MSG_PEEK)
        if not first:
            return False
        conn.settimeout(self._timeout_s)
        magic, op, xfer_id, num_descs = REQUEST.unpack(recv_exact(conn, REQUEST.size))
        if magic != MAGIC or op not in OP_CODES.values() or num_descs > MAX_DESCS:
            raise TransportError(f"protocol error: bad request header (op={op}, num_descs={num_descs})")
        raw = recv_exact(conn, num_descs * DESC.size)
        descs = [Descriptor(addr, nbytes) for addr, nbytes in DESC.iter_unpack(raw)]
        is_write = op == OP_CODES[TransferOp.WRITE]
        with self._guard.reading() as table:
            error = _check(table, descs)
            if is_write:
                if error is None:
                    for desc in descs:
                        recv_into(conn, host_view(desc))
                else:
                    _drain(conn, sum(d.nbytes for d in descs))
            message = (error or "").encode()
            conn.sendall(REPLY.pack(MAGIC, 0 if error is None else 1, xfer_id, len(message)) + message)
            if not is_write and error is None:
                for desc in descs:
                    conn.sendall(host_view(desc))
        return True


def _check(table: RegionTable, descs: Sequence[Descriptor]) -> str | None:
    try:
        for desc in descs:
            table.find(desc)
    except InvalidDescriptorError as e:
        return f"target rejected the request: {e.message}"
    return None


def _drain(conn: socket.socket, nbytes: int) -> None:
    scratch = memoryview(bytearray(min(nbytes, _DRAIN_NBYTES)))
    while nbytes > 0:
        n = conn.recv_into(scratch[:min(nbytes, len(scratch))])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        nbytes -= n
