"""The TCP transport's connection key: a peer that has the agent's metadata (from an authenticated GetAgent)
moves bytes; one that only reached the port, with no key or a wrong one, is cut off before it touches memory."""

from __future__ import annotations

import socket
import time

import torch

from shared.transport import Descriptor, TransferOp, TransferState, make_transport
from shared.transport.tcp_server import DESC, HELLO, HELLO_MAGIC, MAGIC, OP_CODES, REQUEST


def _stranger_write(address: tuple[str, int], hello: bytes, addr: int, payload: bytes) -> None:
    """A WRITE of `payload` to `addr` over a raw socket, after `hello` (empty: none)."""
    with socket.create_connection(address, timeout=5) as sock:
        try:
            sock.sendall(hello + REQUEST.pack(MAGIC, OP_CODES[TransferOp.WRITE], 1, 1)
                         + DESC.pack(addr, len(payload)) + payload)
            sock.recv(64)  # the server closes: EOF (or a reset)
        except OSError:
            pass


def test_only_a_peer_with_the_agents_key_moves_bytes() -> None:
    target = make_transport("tcp", "target", transfer_timeout_s=5.0)
    initiator = make_transport("tcp", "initiator", transfer_timeout_s=5.0)
    memory = torch.zeros(4096, dtype=torch.uint8)
    source = torch.full((4096,), 7, dtype=torch.uint8)
    try:
        region = target.register(memory)
        local = initiator.register(source)
        address = target.address  # type: ignore[attr-defined]
        for hello in (b"", HELLO.pack(HELLO_MAGIC, bytes(32)), HELLO.pack(b"BTX1", bytes(32))):
            _stranger_write(address, hello, region.addr, b"\x01" * (HELLO.size + 64))
        time.sleep(0.2)
        assert int(memory.sum()) == 0
        assert target.num_refused_connections == 3  # type: ignore[attr-defined]
        initiator.add_remote("target", target.metadata())
        handle = initiator.start(TransferOp.WRITE, [Descriptor(local.addr, 4096)], "target",
                                 [Descriptor(region.addr, 4096)])
        initiator.wait(handle, 10.0)
        assert handle.state is TransferState.DONE and torch.equal(memory, source)
    finally:
        initiator.close()
        target.close()
