"""HostKVTier on its own: a spilled block comes back bit for bit into another block, for uniform and
per-layer (mixed head shapes, a one-tensor layer) layouts; the tier's LRU drops the oldest when full."""

from __future__ import annotations

import pytest
import torch

from shared.engine.kv_offload import HostKVTier
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
