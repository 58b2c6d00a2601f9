"""One suite, every available backend: two processes moving KV blocks with READ and WRITE.

This process is the initiator; `peer.py` runs the target agents ("target" and
"victim", the one that gets killed) in spawned processes. Block byte ranges
come from `KVLayout.block_ranges`, so the descriptors are the non-contiguous
spans a real handoff moves.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from shared.transport import (
    Descriptor,
    InvalidDescriptorError,
    MemoryRegion,
    MemType,
    TransferFailedError,
    TransferOp,
    TransferState,
    Transport,
    UnknownRemoteError,
    available_transports,
    make_transport,
    unavailable_reason,
)
from shared.transport.metadata import AgentMetadata
from tests.integration.transport.peer import BIG_NBYTES, LAYOUT, Peer, seeded_kv, start_peers

KINDS = available_transports()
TRANSFER_TIMEOUT_S = 5.0
DEATH_BOUND_S = 15.0
UCXX_FAST = "ucxx-eh-off"  # ucxx with endpoint error handling off: the cma fast path
BACKENDS = [*KINDS, *([UCXX_FAST] if "ucxx" in KINDS else [])]


def backend_kind(backend: str) -> str:
    return "ucxx" if backend == UCXX_FAST else backend


def transport_options(backend: str) -> dict[str, Any]:
    options: dict[str, Any] = {"transfer_timeout_s": TRANSFER_TIMEOUT_S}
    if backend == "nixl":  # UCX logs a flush error when a peer has gone: some tests do that on purpose
        options["ucx_env"] = {"UCX_LOG_LEVEL": "fatal"}
    if backend == UCXX_FAST:
        options["endpoint_error_handling"] = False
    return options


@dataclass
class Pair:
    backend: str
    transport: Transport
    kv: torch.Tensor  # [layers, blocks, 2, block, heads, dim], registered
    kv_region: MemoryRegion
    big: torch.Tensor  # [BIG_NBYTES] uint8, registered
    big_region: MemoryRegion
    target: Peer
    victim: Peer

    def remote_kv(self, peer: Peer) -> MemoryRegion:
        return MemoryRegion(peer.info["kv_addr"], LAYOUT.total_nbytes)

    def remote_big(self, peer: Peer) -> MemoryRegion:
        return MemoryRegion(peer.info["big_addr"], BIG_NBYTES)


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    backend, kind = request.param, backend_kind(request.param)
    options = transport_options(backend)
    target, victim = start_peers(kind, options, [("target", True), ("victim", True)])
    transport = make_transport(kind, "initiator", **options)
    kv = torch.zeros(LAYOUT.shape, dtype=LAYOUT.dtype)
    big = torch.zeros(BIG_NBYTES, dtype=torch.uint8)
    try:
        p = Pair(backend, transport, kv, transport.register(kv), big, transport.register(big), target, victim)
        transport.add_remote("target", target.metadata)
        transport.add_remote("victim", victim.metadata)
        yield p
    finally:
        transport.close()
        target.stop()
        victim.stop()


@pytest.fixture(autouse=True)
def no_transfer_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "pair" in request.fixturenames:
        pair: Pair = request.getfixturevalue("pair")
        assert pair.transport.num_inflight == 0


def local_bytes(descs: list[Descriptor]) -> bytes:
    return b"".join(ctypes.string_at(d.addr, d.nbytes) for d in descs)


def spans(descs: list[Descriptor]) -> list[tuple[int, int]]:
    return [(d.addr, d.nbytes) for d in descs]


def run(pair: Pair, op: TransferOp, local: list[Descriptor], remote: str,
        remote_descs: list[Descriptor]) -> None:
    handle = pair.transport.start(op, local, remote, remote_descs)
    pair.transport.wait(handle, 30.0)
    assert handle.state is TransferState.DONE and handle.nbytes == sum(d.nbytes for d in local)


def test_read_blocks_match_the_peers_cache(pair: Pair) -> None:
    blocks, layers = [2, 12, 13], [1]
    remote = pair.remote_kv(pair.target).descriptors(LAYOUT.block_ranges(blocks, layers))
    local = pair.kv_region.descriptors(LAYOUT.block_ranges([0, 5, 9], layers))
    run(pair, TransferOp.READ, local, "target", remote)
    expected = seeded_kv(seed=1)[1, blocks]
    assert torch.equal(pair.kv[1, [0, 5, 9]], expected)


def test_write_then_read_non_contiguous_blocks_are_byte_identical(pair: Pair) -> None:
    layers = [0, 2, 3]
    pair.kv.copy_(seeded_kv(seed=2))
    source = pair.kv_region.descriptors(LAYOUT.block_ranges([1, 5, 6, 11], layers))
    remote = pair.remote_kv(pair.target).descriptors(LAYOUT.block_ranges([3, 4, 9, 15], layers))
    run(pair, TransferOp.WRITE, source, "target", remote)
    assert pair.target.read_bytes(spans(remote)) == local_bytes(source)

    back = pair.kv_region.descriptors(LAYOUT.block_ranges([0, 2, 7, 8], layers))
    run(pair, TransferOp.READ, back, "target", remote)
    assert local_bytes(back) == local_bytes(source)
    untouched = pair.remote_kv(pair.target).descriptors(LAYOUT.block_ranges([0], [1]))
    assert pair.target.read_bytes(spans(untouched)) == seeded_kv(seed=1)[1, 0].numpy().tobytes()


def test_large_transfers_round_trip(pair: Pair) -> None:
    nbytes = 16 << 20
    pair.big[:nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    remote = pair.remote_big(pair.target)
    run(pair, TransferOp.WRITE, [pair.big_region.descriptor(0, nbytes)], "target",
        [remote.descriptor(0, nbytes)])
    run(pair, TransferOp.READ, [pair.big_region.descriptor(nbytes, nbytes)], "target",
        [remote.descriptor(0, nbytes)])
    assert torch.equal(pair.big[:nbytes], pair.big[nbytes:2 * nbytes])


def test_many_transfers_in_flight_complete(pair: Pair) -> None:
    remote_kv = pair.remote_kv(pair.target)
    handles = []
    for block in range(16):
        local = pair.kv_region.descriptors(LAYOUT.block_ranges([block], [1]))
        remote = remote_kv.descriptors(LAYOUT.block_ranges([15 - block], [1]))
        handles.append(pair.transport.start(TransferOp.READ, local, "target", remote))
    deadline_s = time.monotonic() + 30.0
    while any(pair.transport.poll(h) is TransferState.PENDING for h in handles):
        assert time.monotonic() < deadline_s, "transfers did not complete"
    assert all(h.state is TransferState.DONE for h in handles)
    remote_layer = pair.target.read_bytes(spans(remote_kv.descriptors(LAYOUT.block_ranges(range(16), [1]))))
    per_block = [remote_layer[i * LAYOUT.block_nbytes:(i + 1) * LAYOUT.block_nbytes] for i in range(16)]
    assert local_bytes(pair.kv_region.descriptors(LAYOUT.block_ranges(range(16), [1]))) == b"".join(
        reversed(per_block))


def test_bad_descriptors_and_unknown_remotes_raise_at_start(pair: Pair) -> None:
    remote_kv, t = pair.remote_kv(pair.target), pair.transport
    inside = pair.kv_region.descriptor(0, 4096)
    with pytest.raises(InvalidDescriptorError, match="remote"):
        t.start(TransferOp.READ, [inside], "target", [Descriptor(remote_kv.end - 2048, 4096)])
    with pytest.raises(InvalidDescriptorError, match="local"):
        t.start(TransferOp.WRITE, [Descriptor(pair.kv_region.end - 8, 4096)], "target",
                [remote_kv.descriptor(0, 4096)])
    with pytest.raises(InvalidDescriptorError):
        t.start(TransferOp.WRITE, [inside], "target", [remote_kv.descriptor(0, 2048)])
    with pytest.raises(UnknownRemoteError):
        t.start(TransferOp.READ, [inside], "nobody", [remote_kv.descriptor(0, 4096)])


def test_transfer_into_unregistered_target_memory_fails_cleanly(pair: Pair) -> None:
    """Metadata claiming a region the target never registered: the target (or NIXL) refuses, no hang."""
    real = AgentMetadata.decode(pair.target.metadata)
    hidden_addr, hidden_nbytes = pair.target.info["hidden"]
    hidden = MemoryRegion(hidden_addr, hidden_nbytes)
    forged = AgentMetadata(real.kind, real.name, (*real.regions, hidden), real.blob).encode()
    pair.transport.add_remote("target", forged)
    try:
        local = [pair.kv_region.descriptor(0, 8192)]
        for op in (TransferOp.WRITE, TransferOp.READ):
            handle = pair.transport.start(op, local, "target", [hidden.descriptor(4096, 8192)])
            with pytest.raises(TransferFailedError):
                pair.transport.wait(handle, 30.0)
            assert handle.state is TransferState.FAILED and handle.duration_s is not None
            assert handle.duration_s < TRANSFER_TIMEOUT_S + 1
        assert pair.target.read_bytes([(hidden_addr, hidden_nbytes)]) == bytes([3]) * hidden_nbytes
    finally:
        pair.transport.add_remote("target", pair.target.metadata)
    run(pair, TransferOp.READ, local, "target", [pair.remote_kv(pair.target).descriptor(0, 8192)])


def test_peer_killed_mid_transfer_fails_within_a_bound(pair: Pair) -> None:
    if pair.backend == UCXX_FAST:
        pytest.skip("without endpoint error handling UCX aborts the process when a peer dies inside a cma "
                    "copy (cma_ep.c: process_vm_readv ... No such process); see ucxx_backend's docstring")
    remote = pair.remote_big(pair.victim)
    chunk = 1 << 20
    local = [pair.big_region.descriptor(i * chunk, chunk) for i in range(BIG_NBYTES // chunk)]
    remote_descs = [remote.descriptor(i * chunk, chunk) for i in range(BIG_NBYTES // chunk)]
    run(pair, TransferOp.READ, local[:4], "victim", remote_descs[:4])  # connected and working
    t0 = time.monotonic()
    in_flight = pair.transport.start(TransferOp.READ, local, "victim", remote_descs)
    pair.victim.proc.kill()
    try:
        pair.transport.wait(in_flight, 30.0)  # it may have finished before the kill landed
    except TransferFailedError:
        pass
    pair.victim.proc.join(10)
    after = pair.transport.start(TransferOp.WRITE, local[:8], "victim", remote_descs[:8])
    with pytest.raises(TransferFailedError):
        pair.transport.wait(after, 30.0)
    assert after.state is TransferState.FAILED
    assert time.monotonic() - t0 < DEATH_BOUND_S
    pair.transport.remove_remote("victim")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif("nixl" not in KINDS, reason=f"NIXL unavailable: {unavailable_reason('nixl')}")
def test_nixl_moves_blocks_out_of_vram() -> None:
    options = {"ucx_tls": "cma,tcp,self,cuda_copy,cuda_ipc", "transfer_timeout_s": TRANSFER_TIMEOUT_S}
    with make_transport("nixl", "gpu-owner", **options) as owner, \
            make_transport("nixl", "host-reader", **options) as reader:
        kv_gpu = seeded_kv(seed=1).cuda()
        gpu_region = owner.register(kv_gpu)
        assert gpu_region.mem_type is MemType.VRAM and gpu_region.device_id == kv_gpu.get_device()
        host = torch.zeros(LAYOUT.shape, dtype=LAYOUT.dtype)
        host_region = reader.register(host)
        reader.add_remote("gpu-owner", owner.metadata())
        blocks, layers = [1, 7], [0, 3]
        handle = reader.start(TransferOp.READ, host_region.descriptors(LAYOUT.block_ranges(blocks, layers)),
                              "gpu-owner", gpu_region.descriptors(LAYOUT.block_ranges(blocks, layers)))
        reader.wait(handle, 30.0)
        assert torch.equal(host[layers][:, blocks], kv_gpu[layers][:, blocks].cpu())
