"""Unit tests for shared.engine.kv_manager: prefix lookup, slot allocation, freeing."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from shared.engine.kv_manager import KVCacheManager
from shared.engine.request import Request
from tests.unit.engine.factories import make_kv_manager, make_request

KVFactory = Callable[..., KVCacheManager]
PROMPT = list(range(1000, 1012))  # 3 full blocks of 4


def _compute(kv: KVCacheManager, request: Request, num_tokens: int, cached: list[int] | None = None) -> None:
    """Allocate, 'compute' and register `num_tokens` tokens, as a step would.

    A step that reaches the last known token samples the next one; a block is registered once
    every slot holds KV of a known token that is not the newest.
    """
    assert kv.allocate_slots(request, num_tokens, cached)
    request.num_computed_tokens = num_tokens
    if num_tokens == request.num_tokens:
        request.append_output(1, None)
    kv.cache_full_blocks(request)


def _cache_prompt(kv: KVCacheManager, prompt: list[int], request_id: str = "writer") -> list[int]:
    """Compute a prompt, free it, and return the blocks it left in the prefix cache."""
    writer = make_request(request_id, prompt)
    _compute(kv, writer, len(prompt))
    block_ids = kv.block_ids(request_id)
    kv.free(writer)
    return block_ids


def test_find_cached_prefix_leaves_at_least_one_token(kv_factory: KVFactory) -> None:
    kv = kv_factory(num_blocks=8)
    block_ids = _cache_prompt(kv, PROMPT)
    assert kv.pool.num_cached_blocks == 3

    # the whole prompt is cached: one block fewer, so the last block's tokens run and sample
    assert kv.find_cached_prefix(make_request("same", PROMPT)) == block_ids[:2]
    # one token past the cached blocks: every full block is a hit
    assert kv.find_cached_prefix(make_request("longer", PROMPT + [5])) == block_ids
    assert kv.find_cached_prefix(make_request("short", PROMPT[:4])) == []
    assert kv.find_cached_prefix(make_request("partial", PROMPT[:6])) == block_ids[:1]


def test_find_cached_prefix_stops_at_first_miss(kv_factory: KVFactory) -> None:
    kv = kv_factory(num_blocks=8)
    block_ids = _cache_prompt(kv, PROMPT)
    diverges_in_block_1 = PROMPT[:5] + [0] + PROMPT[6:] + [1]
    assert kv.find_cached_prefix(make_request("b", diverges_in_block_1)) == block_ids[:1]
    diverges_in_block_0 = [0] + PROMPT[1:] + [1]  # later blocks equal, but the chain is broken
    assert kv.find_cached_prefix(make_request("c", diverges_in_block_0)) == []


def test_find_cached_prefix_is_salted_by_model(kv_factory: KVFactory) -> None:
    kv = kv_factory(num_blocks=8, hash_salt=b"model-a")
    _cache_prompt(kv, PROMPT)
    other_model = KVCacheManager(kv.pool, kv.block_size, hash_salt=b"model-b")
    assert other_model.find_cached_prefix(make_request("b", PROMPT + [1])) == []
    assert len(kv.find_cached_prefix(make_request("a", PROMPT + [1]))) == 3


def test_find_cached_prefix_with_caching_off(kv_factory: KVFactory) -> None:
    kv = kv_factory(num_blocks=8, enable_prefix_caching=False)
    _cache_prompt(kv, PROMPT)
    assert kv.pool.num_cached_blocks == 0
    assert kv.find_cached_prefix(make_request("b", PROMPT + [1])) == []


def test_allocate_slots_grows_the_table_by_whole_blocks(kv_factory: KVFactory) -> None:
    kv = kv_factory(num_blocks=8)
    request = make_request("a", 5)
    assert kv.allocate_slots(request, 5)
    assert len(kv.block_ids("a")) == 2
    first = kv.block_ids("a")
    assert kv.allocate_slots(request, 8)
    assert kv.block_ids("a") == first  # still fits
    assert kv.allocate_slots(request, 9)
    assert kv.block_ids("a")[:2] == first and len(kv.block_ids("a")) == 3
    assert kv.num_free_blocks == 5
    kv.free(request)


def test_allocate_slots_short_pool_returns_false_and_changes_nothing(kv_factory: KVFactory) -> None:
    kv = kv_factory(num_blocks=4)
    holder = make_request("holder", 12)
    assert kv.allocate_slots(holder, 12)
    held = list(kv.block_ids("holder"))
    grower = make_request("grower", 8)

    assert not kv.allocate_slots(grower, 8)  # needs 2, 1 free
    assert "grower" not in kv.block_tables
    assert kv.num_free_blocks == 1
    assert not kv.allocate_slots(holder, 20)  # growing by 2 fails the same way
    assert kv.block_ids("holder") == held
    assert kv.num_free_blocks == 1
    assert kv.allocate_slots(holder, 16)  # by 1 fits
    kv.free(holder)


def test_allocate_slots_counts_unreferenced_cached_hits_against_the_pool(kv_factory: KVFactory) -> None:
    kv = kv_factory(num_blocks=4)
    cached = _cache_prompt(kv, PROMPT)  # 3 cached blocks, all in the free list
    other = make_request("other", 4)
    assert kv.allocate_slots(other, 4)  # takes the never-used block: free = the 3 cached blocks
    assert cached[0] not in kv.block_ids("other") and kv.num_free_blocks == 3

    # 2 hits (both in the free list) + 2 new blocks = 4 > 3: the naive "2 new <= 3 free" would pass
    long = make_request("long", PROMPT[:8] + [1, 2, 3, 4, 5])
    hits = kv.find_cached_prefix(long)
    assert hits == cached[:2]
    assert not kv.allocate_slots(long, long.num_tokens, hits)
    assert "long" not in kv.block_tables
    assert kv.num_free_blocks == 3
    assert [kv.pool.blocks[b].ref_count for b in cached] == [0, 0, 0]
    assert kv.pool.num_cached_blocks == 3

    # 2 hits + 1 new = 3 fits exactly
    fits = make_request("fits", PROMPT[:8] + [1])
    hits = kv.find_cached_prefix(fits)
    assert kv.allocate_slots(fits, fits.num_tokens, hits)
    assert kv.block_ids("fits")[:2] == cached[:2]
    assert kv.num_free_blocks == 0
    kv.free(fits)
    kv.free(other)


def test_cached_hits_held_by_another_request_are_shared(kv_factory: KVFactory) -> None:
    kv = kv_factory(num_blocks=5)
    first = make_request("first", PROMPT)
    _compute(kv, first, 12)
    second = make_request("second", PROMPT[:8] + [1, 2])
    hits = kv.find_cached_prefix(second)
    assert hits == kv.block_ids("first")[:2]
    # the hits are referenced already, so only the 1 new block comes out of the 2 free ones
    assert kv.allocate_slots(second, second.num_tokens, hits)
    assert [kv.pool.blocks[b].ref_count for b in hits] == [2, 2]
    assert kv.num_free_blocks == 1

    kv.free(first)
    assert [kv.pool.blocks[b].ref_count for b in hits] == [1, 1]
    assert kv.num_free_blocks == 2  # first's third block only
    kv.free(second)
    assert kv.num_free_blocks == 5


def test_cache_full_blocks_registers_computed_full_blocks_only(kv_factory: KVFactory) -> None:
    kv = kv_factory(num_blocks=4)
    request = make_request("a", PROMPT)
    assert kv.allocate_slots(request, 12)
    request.num_computed_tokens = 7
    kv.cache_full_blocks(request)
    assert kv.pool.num_cached_blocks == 1
    request.num_computed_tokens = 12  # the prompt's last chunk ran and sampled 77
    kv.cache_full_blocks(request)
    assert kv.pool.num_cached_blocks == 2, "block 3 ends with the newest known token: not registered yet"
    request.append_output(77, None)
    kv.cache_full_blocks(request)
    assert kv.pool.num_cached_blocks == 3
    # generated tokens fill blocks too
    assert kv.allocate_slots(request, 16)
    request.append_output(78, None)
    request.append_output(79, None)
    request.append_output(80, None)
    request.num_computed_tokens = 16
    kv.cache_full_blocks(request)
    assert kv.pool.num_cached_blocks == 3, "position 15 holds the newest token (80), whose KV may be in flight"
    request.append_output(81, None)
    kv.cache_full_blocks(request)
    assert kv.pool.num_cached_blocks == 4
    follower = make_request("b", PROMPT + [77, 78, 79, 80, 1])
    assert kv.find_cached_prefix(follower) == kv.block_ids("a")
    kv.free(request)


def test_free_releases_once(kv_factory: KVFactory) -> None:
    kv = kv_factory(num_blocks=4)
    request = make_request("a", 10)
    assert kv.allocate_slots(request, 10)
    kv.free(request)
    assert kv.num_free_blocks == 4
    assert kv.block_ids("a") == []
    kv.free(request)  # a second free finds no table: nothing to give back twice
    assert kv.num_free_blocks == 4
    assert all(b.ref_count == 0 for b in kv.pool.blocks)
    kv.free(make_request("never-allocated", 3))
    kv.check_no_leaks()


def test_check_no_leaks_reports_requests_holding_blocks() -> None:
    kv = make_kv_manager(num_blocks=4)
    request = make_request("holder", 3)
    assert kv.allocate_slots(request, 3)
    with pytest.raises(AssertionError, match="requests still hold blocks: \\['holder'\\]"):
        kv.check_no_leaks()
    kv.free(request)
    kv.check_no_leaks()
