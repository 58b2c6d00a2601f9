"""HandoffStore alone: every lease path, capacity backpressure, expiry, exactly-once release."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from services.kv_transfer.store import HandoffStore, LeaseState
from shared.errors import CapacityError, HandoffNotFoundError, InvalidRequestError, RequestAbortedError
from shared.handoff_stream import HandoffInfo, HiddenStateData, KVLayerData
from shared.kv.layout import KVLayout

NUM_LAYERS = 3
LAYOUT = KVLayout(
    num_layers=NUM_LAYERS, num_blocks=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16
)
HIDDEN_SIZE = 16
NUM_HIDDEN_TOKENS = 5


def make_info(handoff_id: str, lease_timeout_ms: int = 0, hidden: bool = True) -> HandoffInfo:
    return HandoffInfo(
        handoff_id=handoff_id,
        request_id=f"req-{handoff_id}",
        model="tiny",
        layout=LAYOUT,
        prompt_token_ids=[1, 2, 3, 4, 5],
        first_token_id=9,
        first_logprobs=None,
        hidden_size=HIDDEN_SIZE,
        num_hidden_tokens=NUM_HIDDEN_TOKENS if hidden else 0,
        lease_timeout_ms=lease_timeout_ms,
    )


HANDOFF_NBYTES = make_info("x").total_nbytes


def data_parts(info: HandoffInfo) -> Iterator[KVLayerData | HiddenStateData]:
    for layer in range(info.layout.num_layers):
        yield KVLayerData(layer, bytes([layer + 1]) * info.layer_nbytes)
    if info.num_hidden_tokens:
        yield HiddenStateData(b"\x07" * info.hidden_nbytes)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class Ends:
    """Records every end listener call, to prove each lease ends exactly once."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, LeaseState, int]] = []

    def __call__(self, info: HandoffInfo, state: LeaseState, nbytes: int) -> None:
        self.calls.append((info.handoff_id, state, nbytes))

    def states(self, handoff_id: str) -> list[LeaseState]:
        return [state for hid, state, _ in self.calls if hid == handoff_id]


def make_store(
    capacity_bytes: int = 10 * HANDOFF_NBYTES, **kwargs: object
) -> tuple[HandoffStore, FakeClock, Ends]:
    clock, ends = FakeClock(), Ends()
    store = HandoffStore(capacity_bytes, 30.0, clock=clock, on_end=ends, **kwargs)  # type: ignore[arg-type]
    return store, clock, ends


def put(store: HandoffStore, info: HandoffInfo) -> int:
    store.begin_put(info)
    for part in data_parts(info):
        store.add_part(info.handoff_id, part)
    return store.commit(info.handoff_id)


def assert_empty(store: HandoffStore) -> None:
    assert store.bytes_held == 0
    assert store.active_leases == 0


def test_put_then_claim_returns_the_data_and_frees_it() -> None:
    store, _, ends = make_store()
    info = make_info("a")
    store.begin_put(info)
    assert store.state("a") is LeaseState.RECEIVING
    assert store.bytes_held == HANDOFF_NBYTES  # reserved up front
    for part in data_parts(info):
        store.add_part("a", part)
    assert store.commit("a") == HANDOFF_NBYTES
    assert store.state("a") is LeaseState.LEASED

    payload = asyncio.run(store.claim("a"))
    assert payload.info is info
    assert payload.kv_layers == [bytes([i + 1]) * info.layer_nbytes for i in range(NUM_LAYERS)]
    assert payload.hidden == b"\x07" * info.hidden_nbytes
    assert store.state("a") is LeaseState.CLAIMED
    assert_empty(store)
    assert ends.calls == [("a", LeaseState.CLAIMED, HANDOFF_NBYTES)]

    with pytest.raises(HandoffNotFoundError, match="claimed"):
        asyncio.run(store.claim("a"))
    assert store.release("a") is False
    assert ends.states("a") == [LeaseState.CLAIMED]


def test_handoff_without_hidden_states() -> None:
    store, _, _ = make_store()
    info = make_info("a", hidden=False)
    assert put(store, info) == info.layout.total_nbytes
    payload = asyncio.run(store.claim("a"))
    assert payload.hidden == b""
    assert_empty(store)


def test_release_is_idempotent() -> None:
    store, _, ends = make_store()
    put(store, make_info("a"))
    assert store.release("a") is True
    assert store.release("a") is False
    assert_empty(store)
    assert ends.states("a") == [LeaseState.RELEASED]
    with pytest.raises(HandoffNotFoundError):
        asyncio.run(store.claim("a", wait_s=1.0))  # ended: no waiting


def test_release_during_put_frees_and_stops_the_put() -> None:
    store, _, ends = make_store()
    info = make_info("a")
    store.begin_put(info)
    store.add_part("a", KVLayerData(0, b"\x01" * info.layer_nbytes))
    assert store.release("a") is True
    assert_empty(store)
    with pytest.raises(RequestAbortedError):
        store.add_part("a", KVLayerData(1, b"\x01" * info.layer_nbytes))
    with pytest.raises(RequestAbortedError):
        store.commit("a")
    assert store.abort_put("a") is False
    assert ends.states("a") == [LeaseState.RELEASED]


def test_release_before_put_refuses_the_put() -> None:
    store, _, _ = make_store()
    assert store.release("a") is False
    with pytest.raises(RequestAbortedError, match="released before"):
        store.begin_put(make_info("a"))
    assert_empty(store)


def test_broken_put_frees_what_it_reserved() -> None:
    store, _, ends = make_store()
    info = make_info("a")
    store.begin_put(info)
    store.add_part("a", KVLayerData(0, b"\x01" * info.layer_nbytes))
    assert store.abort_put("a") is True
    assert store.abort_put("a") is False
    assert_empty(store)
    assert ends.states("a") == [LeaseState.FAILED]
    # a failed Put may be retried under the same id
    put(store, info)
    assert store.state("a") is LeaseState.LEASED


@pytest.mark.parametrize(
    ("part", "match"),
    [
        (KVLayerData(0, b"\x00" * 3), "header implies"),
        (KVLayerData(NUM_LAYERS, b""), "outside"),
        (HiddenStateData(b"\x00" * 4), "header implies"),
    ],
)
def test_bad_data_fails_the_handoff(part: KVLayerData | HiddenStateData, match: str) -> None:
    store, _, ends = make_store()
    store.begin_put(make_info("a"))
    with pytest.raises(InvalidRequestError, match=match):
        store.add_part("a", part)
    assert_empty(store)
    assert ends.states("a") == [LeaseState.FAILED]


def test_duplicate_layer_and_data_after_hidden_are_refused() -> None:
    store, _, _ = make_store()
    info = make_info("a")
    store.begin_put(info)
    store.add_part("a", KVLayerData(0, b"\x00" * info.layer_nbytes))
    with pytest.raises(InvalidRequestError, match="twice"):
        store.add_part("a", KVLayerData(0, b"\x00" * info.layer_nbytes))
    store.begin_put(make_info("b"))
    store.add_part("b", HiddenStateData(b"\x00" * info.hidden_nbytes))
    with pytest.raises(InvalidRequestError, match="after the hidden"):
        store.add_part("b", KVLayerData(0, b"\x00" * info.layer_nbytes))
    assert_empty(store)


def test_commit_of_an_incomplete_put_fails_it() -> None:
    store, _, ends = make_store()
    info = make_info("a")
    store.begin_put(info)
    store.add_part("a", KVLayerData(0, b"\x00" * info.layer_nbytes))
    with pytest.raises(InvalidRequestError, match=r"missing layers \[1, 2\]"):
        store.commit("a")
    assert_empty(store)
    assert ends.states("a") == [LeaseState.FAILED]


def test_duplicate_ids_are_refused() -> None:
    store, _, _ = make_store()
    put(store, make_info("a"))
    with pytest.raises(InvalidRequestError, match="already exists"):
        store.begin_put(make_info("a"))
    assert store.bytes_held == HANDOFF_NBYTES
    asyncio.run(store.claim("a"))
    with pytest.raises(InvalidRequestError, match="already claimed"):
        store.begin_put(make_info("a"))
    assert_empty(store)


def test_capacity_backpressure() -> None:
    store, _, ends = make_store(capacity_bytes=2 * HANDOFF_NBYTES + 10)
    put(store, make_info("a"))
    store.begin_put(make_info("b"))  # receiving: its bytes count already
    with pytest.raises(CapacityError, match="store full"):
        store.begin_put(make_info("c"))
    assert store.bytes_held == 2 * HANDOFF_NBYTES
    assert store.active_leases == 2
    assert store.state("c") is None
    asyncio.run(store.claim("a"))
    put(store, make_info("c"))  # fits again
    store.release_all()
    assert_empty(store)
    assert sorted(hid for hid, _, _ in ends.calls) == ["a", "b", "c"]


def test_handoff_larger_than_the_store_is_refused() -> None:
    store, _, _ = make_store(capacity_bytes=HANDOFF_NBYTES - 1)
    with pytest.raises(CapacityError):
        store.begin_put(make_info("a"))
    assert_empty(store)


def test_expiry_frees_leased_and_stalled_handoffs() -> None:
    store, clock, ends = make_store()
    put(store, make_info("leased"))
    store.begin_put(make_info("stalled"))
    clock.now_s += 29.0
    assert store.sweep() == []
    clock.now_s += 1.0
    assert sorted(store.sweep()) == ["leased", "stalled"]
    assert_empty(store)
    assert ends.states("leased") == [LeaseState.EXPIRED]
    assert ends.states("stalled") == [LeaseState.EXPIRED]
    with pytest.raises(HandoffNotFoundError, match="expired"):
        asyncio.run(store.claim("leased"))
    with pytest.raises(RequestAbortedError, match="expired"):
        store.add_part("stalled", KVLayerData(0, b""))
    assert store.release("leased") is False
    assert store.sweep() == []
    assert len(ends.calls) == 2


def test_lease_deadline_restarts_at_commit() -> None:
    store, clock, _ = make_store()
    info = make_info("slow")
    store.begin_put(info)
    for part in data_parts(info):
        clock.now_s += 7.0  # a slow Put: 28 s of the 30 s timeout
        store.add_part("slow", part)
    store.commit("slow")
    clock.now_s += 29.0
    assert store.sweep() == []
    clock.now_s += 1.0
    assert store.sweep() == ["slow"]
    assert_empty(store)


def test_claim_after_the_deadline_expires_first() -> None:
    store, clock, ends = make_store()
    put(store, make_info("a"))
    clock.now_s += 31.0
    with pytest.raises(HandoffNotFoundError):
        asyncio.run(store.claim("a"))
    assert ends.states("a") == [LeaseState.EXPIRED]
    assert_empty(store)


def test_lease_timeout_from_header_is_bounded() -> None:
    store, clock, _ = make_store(max_lease_timeout_s=60.0)
    put(store, make_info("short", lease_timeout_ms=500))
    put(store, make_info("long", lease_timeout_ms=3_600_000))
    clock.now_s += 0.5
    assert store.sweep() == ["short"]
    clock.now_s += 59.0
    assert store.sweep() == []
    clock.now_s += 0.5
    assert store.sweep() == ["long"]
    assert_empty(store)


def test_claim_waits_for_a_put_in_flight() -> None:
    async def scenario() -> None:
        store, _, _ = make_store()
        info = make_info("a")
        claim = asyncio.create_task(store.claim("a", wait_s=5.0))
        await asyncio.sleep(0.01)
        assert not claim.done()
        store.begin_put(info)
        parts = list(data_parts(info))
        for part in parts:
            await asyncio.sleep(0.001)
            store.add_part("a", part)
        assert not claim.done()
        store.commit("a")
        payload = await asyncio.wait_for(claim, 1.0)
        assert payload.info is info
        assert_empty(store)

    asyncio.run(scenario())


def test_claim_gives_up_after_wait_and_when_the_put_fails() -> None:
    async def scenario() -> None:
        store, _, _ = make_store()
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(HandoffNotFoundError, match="in time"):
            await store.claim("never", wait_s=0.05)
        assert 0.04 <= loop.time() - started < 1.0

        store.begin_put(make_info("a"))
        claim = asyncio.create_task(store.claim("a", wait_s=5.0))
        await asyncio.sleep(0.01)
        store.abort_put("a")
        with pytest.raises(HandoffNotFoundError, match="failed"):
            await asyncio.wait_for(claim, 1.0)
        assert_empty(store)

    asyncio.run(scenario())


def test_release_wakes_a_waiting_claim() -> None:
    async def scenario() -> None:
        store, _, _ = make_store()
        claim = asyncio.create_task(store.claim("a", wait_s=5.0))
        await asyncio.sleep(0.01)
        store.release("a")
        with pytest.raises(HandoffNotFoundError, match="released"):
            await asyncio.wait_for(claim, 1.0)

    asyncio.run(scenario())


def test_random_operations_release_every_byte_exactly_once() -> None:
    """Any interleaving of puts, claims, releases, aborts and sweeps: accounting stays exact."""
    rng = random.Random(0)
    store, clock, ends = make_store(capacity_bytes=4 * HANDOFF_NBYTES)
    ids = [f"h{i}" for i in range(8)]
    begun: Counter[str] = Counter()  # successful begin_put calls per id
    sent: dict[str, int] = {}  # parts already sent by the latest Put of each id
    ops = ["begin", "part", "part", "part", "part", "commit", "claim", "release", "abort", "tick"]

    async def step() -> None:
        hid = rng.choice(ids)
        op = rng.choice(ops)
        info = make_info(hid, lease_timeout_ms=rng.choice([0, 2000]))
        try:
            if op == "begin":
                store.begin_put(info)
                begun[hid] += 1
                sent[hid] = 0
            elif op == "part" and sent.get(hid, 99) < NUM_LAYERS + 1:
                store.add_part(hid, list(data_parts(info))[sent[hid]])
                sent[hid] += 1
            elif op == "commit":
                store.commit(hid)
            elif op == "claim":
                await store.claim(hid)
            elif op == "release":
                store.release(hid)
            elif op == "abort":
                store.abort_put(hid)
            elif op == "tick":
                clock.now_s += rng.choice([0.1, 1.0, 5.0])
                store.sweep()
        except (CapacityError, InvalidRequestError, RequestAbortedError, HandoffNotFoundError):
            pass
        live = [h for h in ids if store.state(h) in (LeaseState.RECEIVING, LeaseState.LEASED)]
        assert store.bytes_held == len(live) * HANDOFF_NBYTES
        assert store.active_leases == len(live)
        assert store.bytes_held <= store.capacity_bytes

    async def run() -> None:
        for _ in range(4000):
            await step()

    asyncio.run(run())
    store.release_all()
    assert_empty(store)
    # every reservation ended exactly once, through one of the exits
    assert Counter(hid for hid, _, _ in ends.calls) == begun
    assert all(nbytes == HANDOFF_NBYTES for _, _, nbytes in ends.calls)
    final_states = Counter(state for _, state, _ in ends.calls)
    assert all(final_states[state] > 0 for state in LeaseState if not state.is_live), final_states
