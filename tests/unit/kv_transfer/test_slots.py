"""SlotPool: pins, the content-addressed prefix pool, eviction, all-or-nothing capacity."""

from __future__ import annotations

import pytest

from services.kv_transfer.slots import LFUPolicy, LRUPolicy, SlotPool, make_policy
from shared.errors import CapacityError


def key(i: int) -> tuple[str, bytes]:
    return ("m|float32|bs16", bytes([i]) * 16)


def test_fresh_slots_are_pinned_and_released_back() -> None:
    pool = SlotPool(4)
    got = pool.acquire([None, None])
    assert got.hits == [False, False] and len(set(got.slots)) == 2
    assert pool.num_pinned == 2 and pool.num_free == 2
    pool.release(got.slots)
    assert pool.num_free == 4
    pool.check_no_pins()


def test_published_blocks_are_hits_for_later_acquires() -> None:
    pool = SlotPool(4)
    first = pool.acquire([key(1), key(2), None])
    assert first.num_hits == 0
    assert pool.publish(first.slots[0], key(1)) and pool.publish(first.slots[1], key(2))
    second = pool.acquire([key(1), key(2), key(3)])  # while the first still pins them
    assert second.hits == [True, True, False]
    assert second.slots[:2] == first.slots[:2]
    pool.release(first.slots)
    pool.release(second.slots)
    assert pool.num_cached == 2 and pool.num_evictable == 2
    third = pool.acquire([key(1)])
    assert third.hits == [True] and pool.num_evictable == 1
    pool.release(third.slots)
    pool.check_no_pins()


def test_first_writer_wins() -> None:
    pool = SlotPool(4)
    a, b = pool.acquire([None]), pool.acquire([None])
    assert pool.publish(a.slots[0], key(1))
    assert not pool.publish(b.slots[0], key(1))  # the same block computed twice: one copy is kept
    pool.release(a.slots + b.slots)
    assert pool.num_cached == 1 and pool.num_free == 3


def test_lru_eviction_when_free_slots_run_out() -> None:
    pool = SlotPool(3, LRUPolicy())
    for i in (1, 2, 3):
        got = pool.acquire([None])
        pool.publish(got.slots[0], key(i))
        pool.release(got.slots)
    pool.release(pool.acquire([key(1)]).slots)  # key 1 used again: now the most recent
    got = pool.acquire([None, None])  # evicts keys 2 and 3
    assert pool.lookup(key(1)) is not None
    assert pool.lookup(key(2)) is None and pool.lookup(key(3)) is None
    pool.release(got.slots)


def test_capacity_error_changes_nothing() -> None:
    pool = SlotPool(3)
    held = pool.acquire([None])
    cached = pool.acquire([None])
    pool.publish(cached.slots[0], key(9))
    with pytest.raises(CapacityError, match="store full"):
        pool.acquire([key(9), None, None])  # the hit cannot also be evicted to make room
    assert pool.num_pinned == 2 and pool.num_free == 1
    pool.release(cached.slots)
    got = pool.acquire([None, None])  # now the cached slot may be evicted
    assert pool.lookup(key(9)) is None
    pool.release(got.slots + held.slots)
    pool.check_no_pins()


def test_pinned_slots_are_never_evicted() -> None:
    pool = SlotPool(2)
    got = pool.acquire([None, None])
    pool.publish(got.slots[0], key(1))
    with pytest.raises(CapacityError):
        pool.acquire([None])
    pool.release(got.slots)
    assert pool.clear() == 1 and pool.num_free == 2


def test_double_release_is_an_invariant_violation() -> None:
    pool = SlotPool(1)
    got = pool.acquire([None])
    pool.release(got.slots)
    with pytest.raises(AssertionError, match="double release"):
        pool.release(got.slots)


def _cache(pool: SlotPool, i: int, uses: int = 1) -> None:
    """Publish key i, then have `uses - 1` more requests hit it; every pin released."""
    got = pool.acquire([key(i)])
    if not got.hits[0]:
        pool.publish(got.slots[0], key(i))
    pool.release(got.slots)
    for _ in range(uses - 1):
        pool.release(pool.acquire([key(i)]).slots)


def test_lfu_keeps_the_often_hit_block_that_lru_drops() -> None:
    # key 1 (a shared system prompt) hit by 4 requests, then keys 2 and 3 used once each, later: one
    # fresh slot must go. LRU drops key 1 (released first); LFU drops key 2 (fewest hits, oldest).
    for policy, survivor, victim in ((LRUPolicy(), 3, 1), (LFUPolicy(), 1, 2)):
        pool = SlotPool(3, policy)
        _cache(pool, 1, uses=4)
        _cache(pool, 2)
        _cache(pool, 3)
        got = pool.acquire([None])
        assert pool.lookup(key(victim)) is None and pool.lookup(key(survivor)) is not None, type(policy).__name__
        pool.release(got.slots)
        pool.check_no_pins()


def test_lfu_ages_out_counts_from_long_ago() -> None:
    # key 1 hit 3 times, then a stream of one-off blocks: each victim raises the age, so once newer entries
    # reach key 1's priority it goes too (plain LFU would keep it forever)
    pool = SlotPool(2, LFUPolicy())
    _cache(pool, 1, uses=3)
    for i in range(2, 8):
        _cache(pool, i)
    assert pool.lookup(key(1)) is None
    pool.check_no_pins()


def test_lfu_never_evicts_a_pinned_slot_and_counts_hits_while_pinned() -> None:
    policy = LFUPolicy()
    pool = SlotPool(2, policy)
    first = pool.acquire([key(1)])
    pool.publish(first.slots[0], key(1))
    second = pool.acquire([key(1)])  # a hit while the first request still pins it
    assert second.hits == [True]
    _cache(pool, 2)
    with pytest.raises(CapacityError):
        pool.acquire([None, None])
    pool.release(first.slots + second.slots)
    got = pool.acquire([None])  # key 2 (one use) goes, key 1 (two) stays
    assert pool.lookup(key(1)) is not None and pool.lookup(key(2)) is None
    pool.release(got.slots)
    assert pool.clear() == 1 and len(policy) == 0
    pool.check_no_pins()


def test_lfu_heap_stays_bounded_under_hit_churn() -> None:
    policy = LFUPolicy()
    pool = SlotPool(4, policy)
    for i in range(4):
        _cache(pool, i)
    for _ in range(1000):
        _cache(pool, 0, uses=2)
    assert len(policy._heap) <= 2 * len(policy) + 65


def test_make_policy_names() -> None:
    assert isinstance(make_policy("lru"), LRUPolicy) and isinstance(make_policy("lfu"), LFUPolicy)
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        make_policy("fifo")
