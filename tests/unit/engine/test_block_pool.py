"""Unit tests for shared.engine.block_pool: ref counts, LRU free list, prefix hashes."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from shared.engine.block_pool import BlockPool, hash_block, hash_prefix_blocks

PoolFactory = Callable[..., BlockPool]


def _ref_counts(pool: BlockPool, block_ids: list[int]) -> list[int]:
    return [pool.blocks[b].ref_count for b in block_ids]


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_allocate_and_free_ref_counts(pool_factory: PoolFactory) -> None:
    pool = pool_factory(num_blocks=4)
    ids = pool.allocate(3)
    assert ids == [0, 1, 2]  # a fresh pool hands out blocks in id order
    assert _ref_counts(pool, ids) == [1, 1, 1]
    assert pool.num_free_blocks == 1

    pool.touch([ids[0]])  # a second holder of a referenced block takes nothing from the free list
    assert pool.blocks[ids[0]].ref_count == 2
    assert pool.num_free_blocks == 1

    pool.free(ids)
    assert _ref_counts(pool, ids) == [1, 0, 0]
    assert pool.num_free_blocks == 3
    pool.free([ids[0]])
    assert pool.num_free_blocks == 4


def test_allocate_more_than_free_raises_and_changes_nothing(pool_factory: PoolFactory) -> None:
    pool = pool_factory(num_blocks=3)
    held = pool.allocate(2)
    with pytest.raises(RuntimeError, match="asked for 2 blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.free(held)


def test_free_order_freed_last_is_evicted_last(pool_factory: PoolFactory) -> None:
    pool = pool_factory(num_blocks=6)
    first = pool.allocate(3)  # [0, 1, 2]
    second = pool.allocate(3)  # [3, 4, 5]
    pool.free(second)
    pool.free(first)
    # LRU head is evicted first: `second` went back first, and each request gave its tail back first
    order = pool.allocate(6)
    assert order == [5, 4, 3, 2, 1, 0]
    pool.free(order)


def test_request_tail_blocks_are_evicted_before_its_head(pool_factory: PoolFactory) -> None:
    pool = pool_factory(num_blocks=3)
    ids = pool.allocate(3)
    hashes = hash_prefix_blocks(list(range(12)), 4)
    for i, (block_id, block_hash) in enumerate(zip(ids, hashes, strict=True)):
        pool.cache_block(block_id, block_hash, range(4 * i, 4 * i + 4))
    pool.free(ids)
    assert pool.num_cached_blocks == 3

    evicted = pool.allocate(1)
    assert evicted == [ids[2]]  # the tail of the prefix goes first
    assert pool.lookup(hashes[2], range(8, 12)) is None
    assert pool.lookup(hashes[0], range(0, 4)) == ids[0]
    assert pool.lookup(hashes[1], range(4, 8)) == ids[1]
    assert pool.num_cached_blocks == 2
    pool.free(evicted)


def test_cached_hit_and_touch_take_the_block_off_the_free_list(pool_factory: PoolFactory) -> None:
    pool = pool_factory(num_blocks=4)
    tokens = [7, 8, 9, 10]
    block_hash = hash_block(None, tokens)
    [block_id] = pool.allocate(1)
    pool.cache_block(block_id, block_hash, tokens)
    pool.free([block_id])
    assert pool.num_free_blocks == 4

    hit = pool.lookup(block_hash, tokens)
    assert hit == block_id
    pool.touch([block_id])
    assert pool.blocks[block_id].ref_count == 1
    assert pool.num_free_blocks == 3
    # the touched block can no longer be handed out or evicted
    others = pool.allocate(3)
    assert block_id not in others
    assert pool.lookup(block_hash, tokens) == block_id
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(others + [block_id])


def test_lookup_rejects_hash_hit_with_other_tokens(pool_factory: PoolFactory) -> None:
    pool = pool_factory(num_blocks=2)
    [block_id] = pool.allocate(1)
    colliding_hash = hash_block(None, [1, 2, 3, 4])
    # simulate a collision: the block sits under the hash of [1, 2, 3, 4] but holds other tokens
    pool.cache_block(block_id, colliding_hash, [5, 6, 7, 8])
    assert pool.lookup(colliding_hash, [1, 2, 3, 4]) is None
    assert pool.lookup(colliding_hash, [5, 6, 7, 8]) == block_id
    assert pool.lookup(hash_block(None, [9, 9, 9, 9]), [9, 9, 9, 9]) is None
    pool.free([block_id])


def test_double_free_asserts(pool_factory: PoolFactory) -> None:
    pool = pool_factory(num_blocks=2)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(AssertionError, match=f"double free of block {ids[0]}"):
        pool.free(ids)
    assert pool.num_free_blocks == 2
    assert pool.blocks[ids[0]].ref_count == 0


def test_hash_is_stable_and_chained() -> None:
    tokens = [1, 2, 3, 4]
    root = hash_block(None, tokens)
    assert root == hash_block(None, list(tokens)) == hash_block(None, tuple(tokens))
    # pinned: hashes cross processes (prefill -> decode), so they must not depend on PYTHONHASHSEED
    assert root.hex() == "f6e8cd0d07d91b7881401f32026a89ba"
    assert hash_block(root, [5, 6, 7, 8]).hex() == "91d21b48a55f60687e387dfbdf4d632e"

    other_parent = hash_block(None, [1, 2, 3, 5])
    assert hash_block(root, [5, 6, 7, 8]) != hash_block(other_parent, [5, 6, 7, 8])
    assert hash_block(root, tokens) != root  # same tokens, different parent
    assert hash_block(None, tokens, extra=b"model-a") != hash_block(None, tokens, extra=b"model-b")
    assert hash_block(None, tokens, extra=b"model-a") != root


def test_hash_prefix_blocks_hashes_full_blocks_only() -> None:
    tokens = list(range(100, 110))
    hashes = hash_prefix_blocks(tokens, 4)
    assert len(hashes) == 2  # the last 2 tokens do not fill a block
    assert hashes[0] == hash_block(None, tokens[0:4])
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])
    # a hash names the whole prefix: changing the first token changes every later hash
    changed = hash_prefix_blocks([0] + tokens[1:], 4)
    assert changed[0] != hashes[0] and changed[1] != hashes[1]
    assert hash_prefix_blocks(tokens[:8] + [1, 2, 3, 4], 4)[:2] == hashes
    assert hash_prefix_blocks(tokens[:3], 4) == []


def test_num_free_blocks_counts_cached_but_unreferenced(pool_factory: PoolFactory) -> None:
    pool = pool_factory(num_blocks=4)
    ids = pool.allocate(2)
    hashes = hash_prefix_blocks(list(range(8)), 4)
    pool.cache_block(ids[0], hashes[0], range(0, 4))
    pool.cache_block(ids[1], hashes[1], range(4, 8))
    assert pool.num_free_blocks == 2
    pool.free(ids)
    assert pool.num_free_blocks == 4
    assert pool.num_cached_blocks == 2

    # needing every block evicts the cached ones
    all_ids = pool.allocate(4)
    assert pool.num_cached_blocks == 0
    assert pool.lookup(hashes[0], range(0, 4)) is None
    assert all(pool.blocks[b].block_hash is None for b in all_ids)
    pool.free(all_ids)


def test_cache_block_first_writer_wins(pool_factory: PoolFactory) -> None:
    pool = pool_factory(num_blocks=3)
    a, b = pool.allocate(2)
    block_hash = hash_block(None, [1, 2, 3, 4])
    pool.cache_block(a, block_hash, [1, 2, 3, 4])
    pool.cache_block(b, block_hash, [1, 2, 3, 4])
    assert pool.lookup(block_hash, [1, 2, 3, 4]) == a
    assert pool.blocks[b].block_hash is None
    # re-registering a cached block under another hash is ignored too
    pool.cache_block(a, hash_block(None, [4, 3, 2, 1]), [4, 3, 2, 1])
    assert pool.lookup(block_hash, [1, 2, 3, 4]) == a
    assert pool.num_cached_blocks == 1
    pool.free([a, b])


def test_prefix_caching_off_registers_nothing(pool_factory: PoolFactory) -> None:
    pool = pool_factory(num_blocks=2, enable_prefix_caching=False)
    ids = pool.allocate(1)
    block_hash = hash_block(None, [1, 2, 3, 4])
    pool.cache_block(ids[0], block_hash, [1, 2, 3, 4])
    assert pool.num_cached_blocks == 0
    assert pool.lookup(block_hash, [1, 2, 3, 4]) is None
    pool.free(ids)


def test_reset_prefix_cache_drops_every_hash(pool_factory: PoolFactory) -> None:
    pool = pool_factory(num_blocks=2)
    ids = pool.allocate(2)
    hashes = hash_prefix_blocks(list(range(8)), 4)
    pool.cache_block(ids[0], hashes[0], range(0, 4))
    pool.cache_block(ids[1], hashes[1], range(4, 8))
    pool.free(ids[1:])
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert pool.lookup(hashes[0], range(0, 4)) is None
    assert pool.blocks[ids[0]].ref_count == 1  # holders keep their blocks
    pool.free(ids[:1])


def test_check_no_leaks_reports_held_blocks() -> None:
    pool = BlockPool(3)
    ids = pool.allocate(2)
    with pytest.raises(AssertionError, match=r"blocks still referenced: \[0, 1\]"):
        pool.check_no_leaks()
    pool.free(ids)
    pool.check_no_leaks()


def test_frees_held_while_a_step_runs_reach_steps_but_not_host_writers(pool_factory: PoolFactory) -> None:
    pool = pool_factory(num_blocks=4)
    ids = pool.allocate(3)
    pool.cache_block(ids[0], hash_block(None, [1, 2]), [1, 2])
    pool.hold_frees()  # a step was submitted
    pool.free(ids)
    assert pool.num_free_blocks == 4 and pool.num_free_for(host_writes=True) == 1
    with pytest.raises(AssertionError, match="held for a step in flight"):
        pool.check_no_leaks()
    with pytest.raises(RuntimeError):
        pool.allocate(2, host_writes=True)  # a KV handoff may not land where the step may still write
    assert pool.allocate(1, host_writes=True) == [3]
    step_ids = pool.allocate(2)  # a later step may: it runs after the one in flight
    assert set(step_ids) <= set(ids)
    hit = pool.lookup(hash_block(None, [1, 2]), [1, 2])
    assert hit is not None and pool.is_free_for(hit, host_writes=False) and not pool.is_free_for(hit, True)
    pool.touch([hit])  # a prefix hit only reads: sharing a held block is fine
    pool.release_held_frees()  # the step ended
    pool.free([hit, *step_ids, 3])
    assert pool.num_free_for(host_writes=True) == 4
