"""TransferGroup over real agents of every available backend: a transfer that fails, whenever it fails (as it
is posted, or later), fails the group; the group never reports DONE for bytes that did not move.

Found by the chaos soak: kv_transfer was SIGKILLed while a decode started its reads, NIXL refused them as they
were posted ("remote agent was disconnected"), the group skipped the already-ended handles as done, and the
decode served the request from blocks nothing had written (and cached them for the next request)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from shared.engine.kv_link import Link, TransferGroup
from shared.kv.layout import KVLayout
from shared.kv.remote import TransferPlan
from shared.transport import TransferOp, TransferState, available_transports, make_transport
from shared.transport.core import TransportCore

LAYOUT = KVLayout(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float16)


@pytest.fixture(params=available_transports())
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[TransportCore, TransportCore]]:
    a = make_transport(request.param, "a", transfer_timeout_s=5.0)
    b = make_transport(request.param, "b", transfer_timeout_s=5.0)
    assert isinstance(a, TransportCore) and isinstance(b, TransportCore)
    yield a, b
    b.close()
    a.close()


def _group(a: TransportCore, b: TransportCore) -> tuple[TransferGroup, TransferPlan, torch.Tensor, torch.Tensor]:
    kv_a, kv_b = torch.randn(LAYOUT.shape).to(LAYOUT.dtype), LAYOUT.allocate()
    region_a, region_b = a.register(kv_a), b.register(kv_b)
    b.add_remote("a", a.metadata())
    plan = TransferPlan(region_b.descriptors(LAYOUT.block_ranges([0, 3])), region_a.descriptors(LAYOUT.block_ranges([5, 7])))
    return TransferGroup(Link(b, region_b, "a")), plan, kv_a, kv_b


def _settle(group: TransferGroup) -> TransferState:
    deadline = time.monotonic() + 15.0
    while (state := group.poll()) is TransferState.PENDING and time.monotonic() < deadline:
        time.sleep(0.01)
    return state


def test_a_group_of_transfers_that_ran_is_done_and_moved_the_bytes(pair: tuple[TransportCore, TransportCore]) -> None:
    a, b = pair
    group, plan, kv_a, kv_b = _group(a, b)
    group.start(TransferOp.READ, plan)
    assert _settle(group) is TransferState.DONE and group.error is None
    assert torch.equal(kv_b[:, [0, 3]], kv_a[:, [5, 7]])
    group.close()


def test_reads_from_a_dead_peer_fail_the_group(pair: tuple[TransportCore, TransportCore]) -> None:
    a, b = pair
    group, plan, _, _ = _group(a, b)
    a.close()  # the peer dies after its metadata was added: every read of it must fail, not count as done
    group.start(TransferOp.READ, plan)
    group.start(TransferOp.READ, plan)
    assert _settle(group) is TransferState.FAILED and group.error
    assert group.poll() is TransferState.FAILED  # and stays failed
    group.close()


def test_a_handle_that_ended_failed_elsewhere_fails_the_group(pair: tuple[TransportCore, TransportCore]) -> None:
    """A handle polled to FAILED outside the group (the transport's own wait) is not skipped as done."""
    a, b = pair
    group, plan, _, _ = _group(a, b)
    a.close()
    group.start(TransferOp.READ, plan)
    for handle in group.handles:
        deadline = time.monotonic() + 15.0
        while b.poll(handle) is TransferState.PENDING and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handle.state is TransferState.FAILED
    group.error = None  # as if the group had not seen the failure when it started
    assert group.poll() is TransferState.FAILED and group.error
    group.close()
