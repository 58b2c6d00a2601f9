"""HostKVTier on its own: a spilled block comes back bit for bit into another block, for uniform and
per-layer (mixed head shapes, a one-tensor layer) layouts; the tier's LRU drops the oldest when full; a
hybrid layout gets a tier per layer group, each moving only its group's layers."""

from __future__ import annotations

import pytest
import torch

from shared.engine.kv_offload import HostKVTier, group_tiers
from shared.kv.layout import KVLayout, LayerKV

LAYOUTS = {
    "uniform": KVLayout(3, 8, 4, 2, 8, torch.float32),
    "per-layer": KVLayout.of((LayerKV(2, 8), LayerKV(1, 16, num_tensors=1), LayerKV(2, 8)), 8, 4, torch.bfloat16),
}


def _blocks(layout: KVLayout, kv: torch.Tensor, block_id: int) -> list[torch.Tensor]:
    return [layout.layer_blocks(kv, layer)[block_id].clone() for layer in layout.stored_layers]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_spilled_block_is_restored_bit_for_bit(name: str) -> None:
    layout = LAYOUTS[name]
    kv = layout.allocate()
    kv.copy_(torch.randn(kv.shape).to(kv.dtype))
    tier = HostKVTier(layout, kv, capacity_bytes=4 * 1024 * 1024)
    original = _blocks(layout, kv, 3)
    tier.spill(3, b"h3", (1, 2, 3, 4))
    kv.zero_()
    assert tier.holds(b"h3", [1, 2, 3, 4]) and not tier.holds(b"h3", [1, 2, 3, 5])
    tier.restore(b"h3", 6)
    for want, got in zip(original, _blocks(layout, kv, 6), strict=True):
        assert torch.equal(want, got)
    assert not tier.holds(b"h3", [1, 2, 3, 4]) and tier.stats.restored_blocks == 1


def test_a_full_tier_drops_its_oldest_block() -> None:
    layout = LAYOUTS["uniform"]
    kv = layout.allocate()
    tier = HostKVTier(layout, kv, capacity_bytes=2 * 3 * 2 * 4 * 2 * 8 * 4)  # room for two blocks
    assert tier.num_slots == 2
    for i in range(3):
        tier.spill(i, bytes([i]), (i,))
    assert not tier.holds(b"\x00", (0,)) and tier.holds(b"\x01", (1,)) and tier.holds(b"\x02", (2,))
    assert tier.stats.dropped_blocks == 1 and len(tier) == 2


def test_a_hybrid_layout_gets_one_tier_per_group_each_moving_its_own_layers() -> None:
    # full layers 0 and 2, a sliding layer 1 (window 8) with its own, smaller pool
    layout = KVLayout.of((LayerKV(2, 8), LayerKV(2, 8, sliding_window=8), LayerKV(1, 16, num_tensors=1)),
                         (12, 4), 4, torch.float32)
    kv = layout.allocate()
    kv.copy_(torch.randn(kv.shape))
    full, sliding = group_tiers(layout, kv, capacity_bytes=1 << 20)
    pool_bytes = [layout.group_num_blocks(g) * layout.unit_nbytes(g) for g in (0, 1)]
    assert full.block_nbytes == layout.unit_nbytes(0) and sliding.block_nbytes == layout.unit_nbytes(1)
    # the host memory splits as the pools do (to a slot's rounding)
    assert abs(full.num_slots * full.block_nbytes / (sliding.num_slots * sliding.block_nbytes)
               - pool_bytes[0] / pool_bytes[1]) < 0.01
    layer0, layer1, layer2 = (layout.layer_blocks(kv, i) for i in range(3))
    before = [layer0[5].clone(), layer2[5].clone(), layer1[2].clone()]
    full.spill(5, b"f", (1,))
    sliding.spill(2, b"s", (1,))
    kv.zero_()
    full.restore(b"f", 7)
    sliding.restore(b"s", 3)
    assert torch.equal(layer0[7], before[0]) and torch.equal(layer2[7], before[1])
    assert torch.equal(layer1[3], before[2])
    assert not layer0[3].any()  # the sliding tier wrote its own group's block 3 only
