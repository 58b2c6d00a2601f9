"""HandoffStore alone: every lease path, prefix-pool hits, capacity backpressure, expiry, exactly-once ends."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from services.kv_transfer.store import HandoffStore, LeaseState
from shared.engine.block_pool import hash_prefix_blocks
from shared.errors import (
    CapacityError,
    HandoffNotFoundError,
    InvalidRequestError,
    PermissionDeniedError,
    RequestAbortedError,
)
from shared.kv.layout import KVLayout, cdiv
from shared.kv.remote import HandoffResult, HandoffSpec, SlotSpace, slot_nbytes_for

BLOCK = 4
LAYOUT = KVLayout(num_layers=3, num_blocks=1, block_size=BLOCK, num_kv_heads=2, head_dim=8, dtype=torch.float16)
SLOT_NBYTES = slot_nbytes_for(LAYOUT)
NUM_SLOTS = 16
HIDDEN_WIDTH = 16


def make_spec(handoff_id: str, prompt: list[int] | None = None, hidden_rows: int = 0,
              lease_timeout_ms: int = 0, capability: str = "") -> HandoffSpec:
    tokens = prompt if prompt is not None else [1, 2, 3, 4, 5]
    layout = KVLayout(3, cdiv(len(tokens), BLOCK), BLOCK, 2, 8, torch.float16)
    return HandoffSpec(handoff_id, f"req-{handoff_id}", "tiny", layout, tokens,
                       hash_prefix_blocks(tokens, BLOCK), hidden_rows * HIDDEN_WIDTH * 2, lease_timeout_ms,
                       capability=capability)


RESULT = HandoffResult(first_token_id=9, first_logprobs=None)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class Ends:
    """Records every end listener call, to prove each lease ends exactly once."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, LeaseState]] = []

    def __call__(self, spec: HandoffSpec, state: LeaseState, num_slots: int) -> None:
        self.calls.append((spec.handoff_id, state))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ends() -> Ends:
    return Ends()


@pytest.fixture
def store(clock: FakeClock, ends: Ends) -> Iterator[HandoffStore]:
    space = SlotSpace("kv", 1 << 20, SLOT_NBYTES, NUM_SLOTS)
    s = HandoffStore(SLOT_NBYTES * NUM_SLOTS, space, lease_timeout_s=5.0, claim_timeout_s=2.0, clock=clock,
                     on_end=ends)
    yield s
    s.check_no_leaks()  # every test leaves nothing pinned
    assert len(ends.calls) == len({h for h, _ in ends.calls}), f"a lease ended twice: {ends.calls}"


def claim(store: HandoffStore, handoff_id: str, wait_s: float = 0.0):  # type: ignore[no-untyped-def]
    return asyncio.run(store.claim(handoff_id, wait_s))


def test_reserve_commit_claim_release(store: HandoffStore, ends: Ends) -> None:
    slots = store.reserve(make_spec("h1", hidden_rows=5))
    assert len(slots.block_slots) == 2 and slots.present == [False, False]
    assert len(slots.hidden_slots) == cdiv(5 * HIDDEN_WIDTH * 2, SLOT_NBYTES)
    assert store.state("h1") is LeaseState.WRITING
    store.commit("h1", HandoffResult(9, None, HIDDEN_WIDTH, 5))
    claimed = claim(store, "h1")
    assert claimed.slots.block_slots == slots.block_slots and claimed.result.first_token_id == 9
    assert store.state("h1") is LeaseState.CLAIMED
    assert store.release("h1", transfers_stopped=True)
    assert store.state("h1") is LeaseState.DONE and ends.calls == [("h1", LeaseState.DONE)]
    assert not store.release("h1", transfers_stopped=True)  # idempotent


def test_committed_full_blocks_are_pool_hits_for_the_next_turn(store: HandoffStore) -> None:
    turn1 = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # two full blocks and a partial one
    first = store.reserve(make_spec("t1", turn1))
    store.commit("t1", RESULT)
    claim(store, "t1")
    store.release("t1", transfers_stopped=True)
    turn2 = turn1[:8] + [20, 21, 22, 23, 24]
    second = store.reserve(make_spec("t2", turn2))
    assert second.present == [True, True, False, False]
    assert second.block_slots[:2] == first.block_slots[:2]
    assert second.num_leading_hits == 2 and store.hit_blocks_total == 2
    store.release("t2", transfers_stopped=True)


def test_data_moves_while_a_lease_is_written_or_read_not_while_it_waits(store: HandoffStore) -> None:
    """What kv_transfer's agent watches to progress at full rate (shared/transport/nixl_backend.py)."""
    assert not store.data_moving()
    store.reserve(make_spec("m", [1, 2, 3, 4, 5]))
    assert store.data_moving()  # prefill writes
    store.commit("m", RESULT)
    assert not store.data_moving()  # leased: waiting for a decode
    claim(store, "m")
    assert store.data_moving()  # decode reads
    store.release("m", transfers_stopped=True)
    assert not store.data_moving()


def test_uncommitted_blocks_never_become_hits(store: HandoffStore) -> None:
    store.reserve(make_spec("a", [1, 2, 3, 4, 5]))
    store.release("a", failed=True, transfers_stopped=True)
    assert store.state("a") is LeaseState.FAILED
    slots = store.reserve(make_spec("b", [1, 2, 3, 4, 5]))
    assert slots.present == [False, False]
    store.release("b", transfers_stopped=True)


def test_full_store_is_backpressure_not_oom(store: HandoffStore, ends: Ends) -> None:
    store.reserve(make_spec("big", list(range(4 * 14))))  # 14 of 16 slots
    with pytest.raises(CapacityError, match="store full"):
        store.reserve(make_spec("next", list(range(100, 100 + 4 * 3))))
    assert store.state("next") is None  # nothing was reserved
    store.release("big", transfers_stopped=True)
    store.reserve(make_spec("next", list(range(100, 100 + 4 * 3))))
    store.release("next", transfers_stopped=True)


@pytest.mark.parametrize("writer", ["commits", "releases", "dies"])
def test_a_handoff_dropped_while_written_keeps_its_slots_until_its_writer_stops(
        store: HandoffStore, clock: FakeClock, ends: Ends, writer: str) -> None:
    """The router gives up on a prefill that went silent and releases its handoff; the prefill may be alive
    (stopped, slow) and write on: its slots go to no one else until it stops writing or its lease runs out."""
    store.reserve(make_spec("big", list(range(4 * 14))))  # 14 of 16 slots
    assert store.release("big")  # the router's release: the lease is abandoned, not ended
    assert not store.release("big")  # once
    assert ends.calls == [] and store.data_moving()
    with pytest.raises(CapacityError):
        store.reserve(make_spec("other", list(range(100, 100 + 4 * 3))))  # still the writer's
    with pytest.raises(HandoffNotFoundError, match="released"):
        claim(store, "big", wait_s=1.0)  # no decode waits for it
    assert not store.renew("big")  # a live writer learns it here
    if writer == "commits":  # its writes are over: the commit is refused and the slots go
        with pytest.raises(RequestAbortedError):
            store.commit("big", RESULT)
    elif writer == "releases":  # it aborted its writes and says so
        assert store.release("big", transfers_stopped=True)
    else:  # never heard from again: its lease runs out, as a dead prefill's does
        clock.now_s += 5.1
        assert store.sweep() == ["big"]
    assert ends.calls == [("big", LeaseState.EXPIRED if writer == "dies" else LeaseState.RELEASED)]
    store.reserve(make_spec("other", list(range(100, 100 + 4 * 3))))
    store.release("other", transfers_stopped=True)


@pytest.mark.parametrize("reader", ["releases", "dies"])
def test_a_handoff_dropped_while_read_keeps_its_slots_until_its_reader_stops(
        store: HandoffStore, clock: FakeClock, ends: Ends, reader: str) -> None:
    """The router leaves a decode gone silent mid-pull: its reads may go on into its prefix cache, so the
    slots wait for it (or its claim deadline) before anyone else may write them."""
    store.reserve(make_spec("big", list(range(4 * 14))))
    store.commit("big", RESULT)
    claim(store, "big")
    assert store.release("big") and ends.calls == [] and store.data_moving()
    with pytest.raises(CapacityError):
        store.reserve(make_spec("other", list(range(100, 100 + 4 * 3))))
    if reader == "releases":
        assert store.release("big", transfers_stopped=True)
    else:
        clock.now_s += 2.1  # the claim deadline
        assert store.sweep() == ["big"]
    assert ends.calls == [("big", LeaseState.DONE if reader == "releases" else LeaseState.EXPIRED)]
    store.reserve(make_spec("other", list(range(100, 100 + 4 * 3))))
    store.release("other", transfers_stopped=True)


@pytest.mark.parametrize("stage", ["writing", "leased", "claimed"])
def test_every_live_state_expires(store: HandoffStore, clock: FakeClock, ends: Ends, stage: str) -> None:
    store.reserve(make_spec("h"))
    if stage != "writing":
        store.commit("h", RESULT)
    if stage == "claimed":
        claim(store, "h")  # decode died mid-pull: the claim deadline frees the slots
    clock.now_s += 5.1
    assert store.sweep() == ["h"]
    assert ends.calls == [("h", LeaseState.EXPIRED)]
    with pytest.raises(HandoffNotFoundError, match="expired"):
        claim(store, "h")


def test_release_before_reserve_refuses_the_reserve(store: HandoffStore) -> None:
    assert not store.release("early")
    with pytest.raises(RequestAbortedError):
        store.reserve(make_spec("early"))


def test_commit_after_release_is_aborted(store: HandoffStore) -> None:
    store.reserve(make_spec("h"))
    store.release("h")
    with pytest.raises(RequestAbortedError):
        store.commit("h", RESULT)


def test_duplicate_and_claimed_ids_are_refused(store: HandoffStore) -> None:
    store.reserve(make_spec("h"))
    with pytest.raises(InvalidRequestError, match="already exists"):
        store.reserve(make_spec("h"))
    store.commit("h", RESULT)
    claim(store, "h")
    with pytest.raises(HandoffNotFoundError, match="claimed"):
        claim(store, "h")  # one owner
    store.release("h", transfers_stopped=True)
    with pytest.raises(InvalidRequestError, match="already claimed"):
        store.reserve(make_spec("h"))


def test_hidden_states_larger_than_reserved_fail_the_handoff(store: HandoffStore) -> None:
    store.reserve(make_spec("h", hidden_rows=1))
    with pytest.raises(InvalidRequestError, match="hidden states"):
        store.commit("h", HandoffResult(9, None, HIDDEN_WIDTH, 10_000))
    assert store.state("h") is LeaseState.FAILED


def test_claim_waits_for_the_commit(store: HandoffStore) -> None:
    async def scenario() -> int:
        store.reserve(make_spec("h"))
        waiter = asyncio.create_task(store.claim("h", wait_s=2.0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        store.commit("h", RESULT)
        claimed = await waiter
        store.release("h", transfers_stopped=True)
        return claimed.result.first_token_id

    assert asyncio.run(scenario()) == 9


def test_block_format_too_big_for_the_slots_is_refused(store: HandoffStore) -> None:
    spec = make_spec("h")
    wide = HandoffSpec("w", "r", "tiny", KVLayout(30, 2, BLOCK, 2, 8, torch.float16), spec.prompt_token_ids,
                       spec.block_hashes, 0)
    with pytest.raises(InvalidRequestError, match="SLOT_NBYTES"):
        store.reserve(wide)


def test_random_operations_never_leak(clock: FakeClock, ends: Ends) -> None:
    """A random walk over reserve/commit/claim/release/expiry ends with every slot unpinned."""
    space = SlotSpace("kv", 0, SLOT_NBYTES, 12)
    store = HandoffStore(SLOT_NBYTES * 12, space, lease_timeout_s=3.0, claim_timeout_s=1.0, clock=clock,
                         on_end=ends)
    rng = random.Random(0)
    ids = [f"h{i}" for i in range(40)]

    async def walk() -> None:
        for _ in range(600):
            hid = rng.choice(ids)
            op = rng.choice(["reserve", "commit", "claim", "release", "fail", "tick"])
            try:
                if op == "reserve":
                    prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 13))]
                    store.reserve(make_spec(hid, prompt, hidden_rows=rng.randrange(3)))
                elif op == "commit":
                    store.commit(hid, RESULT)
                elif op == "claim":
                    await store.claim(hid, 0.0)
                elif op in ("release", "fail"):
                    store.release(hid, failed=op == "fail", transfers_stopped=rng.random() < 0.5)
                else:
                    clock.now_s += rng.random()
                    store.sweep()
            except (CapacityError, InvalidRequestError, RequestAbortedError, HandoffNotFoundError):
                pass
        store.release_all()

    asyncio.run(walk())
    store.check_no_leaks()
    assert store.pool.num_free + store.pool.num_evictable == 12
    counts = Counter(h for h, _ in ends.calls)
    assert sum(counts.values()) == len(ends.calls)


def test_a_renewed_writing_lease_outlives_its_timeout(store: HandoffStore, clock: FakeClock, ends: Ends) -> None:
    slots = store.reserve(make_spec("slow"))  # a prompt queued behind others at its prefill
    assert slots.lease_timeout_s == 5.0
    for _ in range(4):
        clock.now_s += 4.0
        assert store.renew("slow")
        assert store.sweep() == []
    store.commit("slow", RESULT)
    assert not store.renew("slow")  # only a handoff being written is renewed
    clock.now_s += 5.1
    assert store.sweep() == ["slow"]  # nobody claimed it
    assert not store.renew("slow")


def test_lfu_store_with_layer_groups_keeps_the_shared_prefix_units() -> None:
    """A Gemma 4-like layout (a full group, a sliding group with a window, a KV-shared layer) through the store
    with the LFU policy: units are keyed as prefill names them (`unit_hashes`); a system prompt's units that
    every turn hits outlive one-off units when the pool runs short, and what prefill may reuse
    (`usable_pool_prefix`) is the system prompt's blocks."""
    from dataclasses import replace

    from services.kv_transfer.slots import LFUPolicy
    from shared.kv.layout import LayerKV
    from shared.kv.remote import unit_hashes, usable_pool_prefix

    layers = (LayerKV(2, 8, sliding_window=32), LayerKV(1, 16, 1), LayerKV(2, 8, reads_layer=0, sliding_window=32))
    base = KVLayout.of(layers, 64, BLOCK, torch.float16)
    space = SlotSpace("kv", 1 << 20, base.slot_nbytes, 12)
    store = HandoffStore(base.slot_nbytes * 12, space, lease_timeout_s=5.0, claim_timeout_s=2.0, policy=LFUPolicy())
    system = list(range(100, 108))  # two full blocks every conversation starts with

    def turn(handoff_id: str, prompt: list[int]) -> int:
        layout = replace(base, num_blocks=len(base.handoff_units(len(prompt))), group_blocks=())
        spec = HandoffSpec(handoff_id, f"req-{handoff_id}", "g4", layout, prompt,
                           unit_hashes(layout, hash_prefix_blocks(prompt, BLOCK), len(prompt)), 0)
        slots = store.reserve(spec)
        usable = usable_pool_prefix(layout, slots.present, len(prompt), len(prompt) // BLOCK)
        store.commit(handoff_id, RESULT)
        claim(store, handoff_id)
        store.release(handoff_id, transfers_stopped=True)
        return usable

    assert turn("a", system + [1, 2, 3, 4, 5]) == 0
    assert turn("b", system + [6, 7, 8, 9, 10]) == 2  # the system prompt's blocks, in both groups
    for i in range(3):  # one-off conversations fill the pool: their units are evicted, the system prompt's stay
        turn(f"x{i}", system + [20 + 10 * i + j for j in range(9)])
    assert turn("c", system + [90, 91, 92, 93, 94]) == 2
    store.check_no_leaks()


def test_every_call_on_a_handoff_needs_its_capability(store: HandoffStore, ends: Ends) -> None:
    """Knowing a handoff's id is not enough: renew, commit, claim and release without its secret are refused
    (and counted), leaving the lease as it was; with it, the handoff runs its course."""
    store.reserve(make_spec("h1", capability="s3cret"))
    for wrong in ("", "guess", "s3cret!"):
        with pytest.raises(PermissionDeniedError):
            store.renew("h1", wrong)
        with pytest.raises(PermissionDeniedError):
            store.commit("h1", RESULT, wrong)
        with pytest.raises(PermissionDeniedError):
            store.release("h1", capability=wrong)
    assert store.num_capability_refusals == 9
    assert store.renew("h1", "s3cret")
    store.commit("h1", RESULT, "s3cret")
    with pytest.raises(PermissionDeniedError):
        asyncio.run(store.claim("h1", capability="guess"))
    assert store.state("h1") is LeaseState.LEASED
    asyncio.run(store.claim("h1", capability="s3cret"))
    assert store.release("h1", capability="s3cret", transfers_stopped=True)
    assert ends.calls == [("h1", LeaseState.DONE)]
    store.check_no_leaks()
