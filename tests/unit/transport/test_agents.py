"""Agent bookkeeping on every available backend, two agents in this one process.

The two-process behaviour (byte-identical blocks, dead peers) lives in
tests/integration/transport; here: registration, remotes, errors raised by
`start`, lifecycle. Every test checks that no transfer is left in flight.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from shared.kv.layout import KVLayout
from shared.transport import (
    Descriptor,
    InvalidDescriptorError,
    MemoryRegion,
    TransferFailedError,
    TransferOp,
    TransferState,
    TransferTimeoutError,
    Transport,
    TransportError,
    UnknownRemoteError,
    available_transports,
    make_transport,
    unavailable_reason,
    wait_async,
)
from shared.transport.core import TransportCore
from shared.transport.metadata import AgentMetadata

LAYOUT = KVLayout(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float16)
OPTIONS = {"transfer_timeout_s": 5.0}


@pytest.fixture(params=available_transports())
def agents(request: pytest.FixtureRequest) -> Iterator[tuple[TransportCore, TransportCore]]:
    a = make_transport(request.param, "a", **OPTIONS)
    b = make_transport(request.param, "b", **OPTIONS)
    assert isinstance(a, TransportCore) and isinstance(b, TransportCore)
    yield a, b
    assert a.num_inflight == 0 and b.num_inflight == 0
    b.close()
    a.close()


def test_tcp_is_always_available_and_unknown_kinds_are_not() -> None:
    assert "tcp" in available_transports()
    assert unavailable_reason("tcp") is None
    assert unavailable_reason("carrier-pigeon") is not None
    with pytest.raises(TransportError, match="unknown transport"):
        make_transport("carrier-pigeon", "x")


def test_agents_satisfy_the_protocol(agents: tuple[TransportCore, TransportCore]) -> None:
    a, _ = agents
    assert isinstance(a, Transport)
    assert a.name == "a" and a.kind in ("nixl", "ucxx", "tcp")


def test_read_and_write_between_two_local_agents(agents: tuple[TransportCore, TransportCore]) -> None:
    a, b = agents
    kv_a, kv_b = torch.randn(LAYOUT.shape).to(LAYOUT.dtype), LAYOUT.allocate()
    region_a, region_b = a.register(kv_a), b.register(kv_b)
    b.add_remote("a", a.metadata())
    assert b.remotes == ["a"]
    handle = b.start(TransferOp.READ, region_b.descriptors(LAYOUT.block_ranges([0, 3])), "a",
                     region_a.descriptors(LAYOUT.block_ranges([5, 7])))
    assert b.wait(handle, 10.0) is handle and handle.state is TransferState.DONE
    assert torch.equal(kv_b[:, [0, 3]], kv_a[:, [5, 7]])
    kv_b.fill_(2.0)
    handle = b.start(TransferOp.WRITE, [region_b.descriptor(0, LAYOUT.layer_nbytes)], "a",
                     [region_a.descriptor(LAYOUT.layer_nbytes, LAYOUT.layer_nbytes)])
    b.wait(handle, 10.0)
    assert bool((kv_a[1] == 2.0).all())
    assert handle.duration_s is not None and handle.nbytes == LAYOUT.layer_nbytes and handle.num_descs == 1


def test_start_raises_for_caller_errors(agents: tuple[TransportCore, TransportCore]) -> None:
    a, b = agents
    region_a, region_b = a.register(bytearray(8192)), b.register(bytearray(8192))
    with pytest.raises(UnknownRemoteError):
        b.start(TransferOp.READ, [region_b.descriptor(0, 16)], "a", [region_a.descriptor(0, 16)])
    b.add_remote("a", a.metadata())
    with pytest.raises(InvalidDescriptorError, match="remote"):
        b.start(TransferOp.READ, [region_b.descriptor(0, 16)], "a", [Descriptor(region_a.end - 8, 16)])
    with pytest.raises(InvalidDescriptorError, match="local"):
        b.start(TransferOp.READ, [Descriptor(region_b.addr - 16, 16)], "a", [region_a.descriptor(0, 16)])
    b.remove_remote("a")
    with pytest.raises(UnknownRemoteError):
        b.start(TransferOp.READ, [region_b.descriptor(0, 16)], "a", [region_a.descriptor(0, 16)])
    with pytest.raises(UnknownRemoteError):
        b.remove_remote("a")


def test_add_remote_checks_the_metadata(agents: tuple[TransportCore, TransportCore]) -> None:
    a, b = agents
    with pytest.raises(TransportError, match="names agent 'a'"):
        b.add_remote("someone-else", a.metadata())
    with pytest.raises(TransportError, match="itself"):
        b.add_remote("b", b.metadata())
    other_kind = "tcp" if a.kind != "tcp" else "nixl"
    foreign = AgentMetadata(other_kind, "a", (), b"").encode()
    with pytest.raises(TransportError, match="given to a"):
        b.add_remote("a", foreign)
    with pytest.raises(TransportError):
        b.add_remote("a", b"not metadata")


def test_metadata_lists_regions_and_re_adding_refreshes(agents: tuple[TransportCore, TransportCore]) -> None:
    a, b = agents
    first = torch.zeros(1024, dtype=torch.uint8)
    r1 = a.register(first)
    b.add_remote("a", a.metadata())
    later = torch.arange(256, dtype=torch.uint8)
    r2 = a.register(later)
    assert AgentMetadata.decode(a.metadata()).regions == tuple(sorted((r1, r2), key=lambda r: r.addr))
    local = b.register(torch.zeros(256, dtype=torch.uint8))
    with pytest.raises(InvalidDescriptorError):  # b's copy of a's metadata predates `later`
        b.start(TransferOp.READ, [local.descriptor(0, 256)], "a", [r2.descriptor(0, 256)])
    b.add_remote("a", a.metadata())
    b.wait(b.start(TransferOp.READ, [local.descriptor(0, 256)], "a", [r2.descriptor(0, 256)]), 10.0)


def test_register_deregister_and_close(agents: tuple[TransportCore, TransportCore]) -> None:
    a, _ = agents
    tensor = torch.zeros(4096, dtype=torch.uint8)
    region = a.register(tensor)
    with pytest.raises(InvalidDescriptorError, match="overlaps"):
        a.register(tensor)
    a.deregister(region)
    assert a.regions == []
    with pytest.raises(InvalidDescriptorError):
        a.deregister(region)
    a.register(tensor)
    a.close()
    a.close()  # idempotent
    with pytest.raises(TransportError, match="closed"):
        a.metadata()
    with pytest.raises(TransportError, match="closed"):
        a.register(torch.zeros(16))


def test_wait_async(agents: tuple[TransportCore, TransportCore]) -> None:
    a, b = agents
    src, dst = torch.arange(4096, dtype=torch.int32), torch.zeros(4096, dtype=torch.int32)
    region_a, region_b = a.register(src), b.register(dst)
    b.add_remote("a", a.metadata())

    async def pull() -> None:
        handle = b.start(TransferOp.READ, [region_b.descriptor(0, 16384)], "a",
                         [region_a.descriptor(0, 16384)])
        await wait_async(b, handle, 10.0)

    asyncio.run(pull())
    assert torch.equal(src, dst)


# --- deadlines, on real sockets: a peer that accepts connections and never answers ---------------------


@pytest.fixture
def silent_peer() -> Iterator[bytes]:
    """Metadata of a 'tcp' agent whose server accepts and then stays silent."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    host, port = listener.getsockname()[:2]
    regions = (MemoryRegion(1 << 30, 1 << 20),)
    yield AgentMetadata("tcp", "silent", regions, f"{host}:{port}:{'00' * 32}".encode()).encode()
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    listener.close()


def test_transfer_deadline_fails_a_silent_peer(silent_peer: bytes) -> None:
    with make_transport("tcp", "impatient", transfer_timeout_s=0.3) as agent:
        region = agent.register(bytearray(4096))
        agent.add_remote("silent", silent_peer)
        handle = agent.start(TransferOp.READ, [region.descriptor(0, 64)], "silent", [Descriptor(1 << 30, 64)])
        t0 = time.monotonic()
        while agent.poll(handle) is TransferState.PENDING:
            time.sleep(0.01)
        assert time.monotonic() - t0 < 3.0
        assert handle.state is TransferState.FAILED and handle.error is not None
        with pytest.raises(TransferFailedError):
            agent.wait(handle, 1.0)
        assert agent.num_inflight == 0


def test_wait_timeout_aborts_the_transfer(silent_peer: bytes) -> None:
    with make_transport("tcp", "impatient", transfer_timeout_s=30.0) as agent:
        region = agent.register(bytearray(4096))
        agent.add_remote("silent", silent_peer)
        handle = agent.start(TransferOp.WRITE, [region.descriptor(0, 64)], "silent",
                             [Descriptor(1 << 30, 64)])
        with pytest.raises(TransferTimeoutError):
            agent.wait(handle, 0.2)
        assert handle.state is TransferState.FAILED and "timed out" in (handle.error or "")
        assert agent.num_inflight == 0
        again = agent.start(TransferOp.READ, [region.descriptor(0, 64)], "silent", [Descriptor(1 << 30, 64)])
        agent.remove_remote("silent")  # in-flight transfers to a removed remote end FAILED
        assert again.state is TransferState.FAILED
