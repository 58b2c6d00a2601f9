"""KVLayout with layer groups: per-layer geometry, group pools, handoff units, the pool prefix a prefill may use."""

from __future__ import annotations

import torch

from shared.kv.layout import KVLayout, LayerKV, kv_groups
from shared.kv.remote import unit_hashes, usable_pool_prefix

# sliding (2 heads x 16, window 8), full K=V (1 x 32, one tensor), and a KV-shared layer reading each
LAYERS = (LayerKV(2, 16, sliding_window=8), LayerKV(1, 32, 1), LayerKV(2, 16, sliding_window=8),
          LayerKV(2, 16, reads_layer=2, sliding_window=8), LayerKV(1, 32, 1, reads_layer=1))


def layout(blocks: tuple[int, int] = (10, 5)) -> KVLayout:
    return KVLayout.of(LAYERS, list(blocks), 4, torch.float32)


def test_groups_and_region() -> None:
    kv = layout()
    assert [g.layers for g in kv_groups(LAYERS)] == [(1,), (0, 2)]
    assert [kv.group_of(i) for i in range(5)] == [1, 0, 1, 1, 0]
    assert not kv.is_uniform and kv.stored_layers == [0, 1, 2]
    # layer 0: 5 blocks x (2 x 2 x 16) x 4 tokens; layer 1: 10 x 32 x 4; layer 2 like layer 0
    assert [kv.layer_offset(i) // 4 for i in range(3)] == [0, 5 * 64 * 4, 5 * 64 * 4 + 10 * 32 * 4]
    assert kv.total_nbytes == 4 * (2 * 5 * 64 * 4 + 10 * 32 * 4)
    assert kv.unit_nbytes(0) == 32 * 4 * 4 and kv.unit_nbytes(1) == 2 * 64 * 4 * 4
    assert kv.slot_nbytes == kv.unit_nbytes(1) and kv.slot_offset(2) == 64 * 4 * 4


def test_views_cut_the_flat_region() -> None:
    kv = layout()
    cache = kv.allocate()
    k, v = kv.layer_cache(cache, 4)  # the shared full layer reads layer 1's one tensor
    assert k.shape == (10, 4, 1, 32) and k.data_ptr() == v.data_ptr() == kv.layer_cache(cache, 1)[0].data_ptr()
    k2, v2 = kv.layer_cache(cache, 2)
    assert k2.shape == (5, 4, 2, 16) and v2.data_ptr() - k2.data_ptr() == 4 * 2 * 16 * 4
    k2[3, 1, 0, 5] = 7.0  # the byte range of (layer 2, block 3) holds it
    r = kv.block_range(2, 3)
    assert cache.view(torch.uint8)[r.offset:r.offset + r.nbytes].view(torch.float32).eq(7.0).sum() == 1


def test_handoff_units_keep_only_the_window_and_hash_full_blocks_first() -> None:
    kv = layout()
    # 22 tokens, blocks of 4: full blocks 0..4, partial 5; the next query (22) sees 15..22: blocks 3..5
    assert kv.handoff_units(22) == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 3), (1, 4), (0, 5), (1, 5)]
    assert kv.num_hashed_units(22) == 7
    hashes = unit_hashes(kv, [bytes([i]) * 16 for i in range(5)], 22)
    assert hashes[:5] == [bytes([i]) * 16 for i in range(5)] and len(set(hashes)) == 7


def test_usable_pool_prefix_needs_the_window_before_it() -> None:
    kv = layout()
    units = kv.handoff_units(22)
    present = [g == 0 and i < 4 for g, i in units]  # group 0's first four blocks only
    assert usable_pool_prefix(kv, present, 22, 5) == 0  # a prefix of n blocks needs sliding blocks before n
    # 20 tokens: the next query (20) sees 13..20, so sliding blocks 3 and 4 (the handoff has 3..5)
    present = [(g == 0 and i < 5) or (g == 1 and i in (3, 4)) for g, i in units]
    assert usable_pool_prefix(kv, present, 22, 5) == 5
    # 16 tokens would need sliding block 2, which a handoff of 22 tokens does not carry
    assert usable_pool_prefix(kv, present, 22, 4) == 0
    one_group = KVLayout.of((LayerKV(2, 16),) * 2, 8, 4, torch.float32)
    assert usable_pool_prefix(one_group, [True, True, False], 10, 2) == 2
