"""`baton up`'s readiness probe of its router: a port answered by something else is not ready, never a crash."""

from __future__ import annotations

import socket
import threading

from shared.cli.up_cmd import Child, healthy

# what a gRPC server sends first: an HTTP/2 SETTINGS frame, which no HTTP/1 status line parses
HTTP2_SETTINGS = b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x64"


def test_a_grpc_server_on_the_routers_port_is_not_our_router() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(HTTP2_SETTINGS)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        child = Child("router", "router", f"127.0.0.1:{server.getsockname()[1]}", "", {}, instance_id="r-1")
        assert not healthy(child, {})
    finally:
        thread.join(5)
        server.close()
