"""`baton up` counts its router ready only once the router answers as itself and sees every instance the
stack started (a real HTTP server stands in for the router's /health)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from shared.cli.up_cmd import Child, healthy

# what a gRPC server sends first: an HTTP/2 SETTINGS frame, which no HTTP/1 status line parses
HTTP2_SETTINGS = b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x64"


@pytest.fixture
def router_health() -> Iterator[tuple[Child, dict[str, object]]]:
    body: dict[str, object] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    child = Child("router", "router", f"127.0.0.1:{server.server_address[1]}", "", {}, instance_id="r-1")
    try:
        yield child, body
    finally:
        server.shutdown()


def test_ready_only_when_the_router_sees_every_instance(router_health: tuple[Child, dict[str, object]]) -> None:
    child, body = router_health
    expected = {"prefill": 1, "decode": 2, "kv_transfer": 1}
    body.update(status="ok", instance_id="r-1", instances={"prefill": 1, "decode": 1, "kv_transfer": 1})
    assert not healthy(child, expected)  # one decode not yet polled: a burst now would all go to the other
    body["instances"] = {"prefill": 1, "decode": 2, "kv_transfer": 1, "colocated": 0}
    assert healthy(child, expected)


def test_another_stacks_router_is_not_ours(router_health: tuple[Child, dict[str, object]]) -> None:
    child, body = router_health
    body.update(status="ok", instance_id="someone-else", instances={"colocated": 1})
    assert not healthy(child, {"colocated": 1})


def test_a_grpc_server_on_the_routers_port_is_not_our_router() -> None:
    """A port answered by something else is not ready, never a crash."""
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
