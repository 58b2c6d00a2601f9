"""A host-memory second tier for the prefix cache: evicted blocks are kept, and restored instead of recomputed.

```
 pool needs a block ─► evicts a cached one (LRU) ─► spill: its KV, every stored layer, copied into a tier
                                                    slot under its prefix hash (the tier's own LRU drops
                                                    the oldest when full)
 admission looks up a prefix (a new request, or a preempted one resuming)
     local hits ... first miss ─► the tier holds that hash? ─► restore: a fresh block, the KV copied back,
                                  registered as a cached block ─► a local hit like any other (next hash ...)
```

This is what keeps a preempted request from recomputing its context when the pool runs dry: its full
blocks stay cached when it is preempted, are spilled when others need the room, and come back when it
resumes (only the partial last block and what no block holds are computed again). Restore time per
admission is the swap-in latency (`swap_in_seconds`, recorded in group 0's tier).

A model whose layers form several groups (hybrid_kv.py: Gemma 4's full and sliding layers) has one pool per
group and so one tier per group (`group_tiers`), each holding its group's layers of a block; the host memory
is split between them as the pools split the cache. A sliding group's tier only ever sees the blocks inside
some request's window (the others were freed, cached and evicted like any block), which is what a resume
needs back.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shared.engine.kv_stats import DirectionStats
from shared.kv.layout import KVLayout

logger = logging.getLogger(__name__)

BlockHash = bytes


@dataclass
class OffloadStats:
    spilled_blocks: int = 0
    restored_blocks: int = 0
    dropped_blocks: int = 0  # spilled, then pushed out of the tier before anyone wanted them back
    swap_in: DirectionStats = field(default_factory=DirectionStats)  # per admission that restored blocks
    recent_swap_in_s: deque[float] = field(default_factory=lambda: deque(maxlen=4096))  # for percentiles

    def observe_swap_in(self, seconds: float, nbytes: int) -> None:
        self.swap_in.observe(seconds, nbytes)
        self.recent_swap_in_s.append(seconds)


class HostKVTier:
    """Up to `capacity_bytes` of evicted blocks in host memory, one slot per block, LRU."""

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, capacity_bytes: int,
                 layers: Sequence[int] | None = None) -> None:
        """`layers`: the stored layers one block id names (a group's; every stored layer by default)."""
        layers = layout.stored_layers if layers is None else list(layers)
        self._views = [layout.layer_blocks(kv_cache, layer) for layer in layers]
        self._sizes = [v[0].numel() for v in self._views]  # elements of one block in each stored layer
        block_elems = sum(self._sizes)
        self.block_nbytes = block_elems * layout.itemsize
        self.num_slots = capacity_bytes // self.block_nbytes
        self._buffer = torch.empty((self.num_slots, block_elems), dtype=layout.dtype)  # pageable host memory
        self._free_slots = list(range(self.num_slots))
        self._entries: OrderedDict[BlockHash, tuple[tuple[int, ...], int]] = OrderedDict()  # hash -> (tokens, slot)
        self.stats = OffloadStats()
        logger.info("KV offload tier: %d blocks of %d bytes in host memory (%d layers)", self.num_slots,
                    self.block_nbytes, len(layers))

    def __len__(self) -> int:
        return len(self._entries)

    def spill(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Keep a block the pool is evicting (its content is final: cached blocks are full and computed)."""
        if self.num_slots == 0 or block_hash in self._entries:
            return
        if not self._free_slots:
            _, (_, slot) = self._entries.popitem(last=False)
            self._free_slots.append(slot)
            self.stats.dropped_blocks += 1
        slot = self._free_slots.pop()
        row = self._buffer[slot]
        offset = 0
        for view, size in zip(self._views, self._sizes, strict=True):
            row[offset:offset + size].copy_(view[block_id].reshape(-1))
            offset += size
        self._entries[block_hash] = (tuple(token_ids), slot)
        self.stats.spilled_blocks += 1

    def holds(self, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        entry = self._entries.get(block_hash)
        return entry is not None and entry[0] == tuple(token_ids)

    def restore(self, block_hash: BlockHash, block_id: int) -> None:
        """Copy a held block into `block_id` of the cache; the tier lets it go (the cache has it again)."""
        _, slot = self._entries.pop(block_hash)
        row = self._buffer[slot]
        offset = 0
        for view, size in zip(self._views, self._sizes, strict=True):
            view[block_id].copy_(row[offset:offset + size].view(view[block_id].shape))
            offset += size
        self._free_slots.append(slot)
        self.stats.restored_blocks += 1


def group_tiers(layout: KVLayout, kv_cache: torch.Tensor, capacity_bytes: int) -> list[HostKVTier]:
    """One tier per layer group (KVLayout.groups order), `capacity_bytes` split in proportion to the bytes of
    each group's pool."""
    pool_bytes = [layout.group_num_blocks(g) * layout.unit_nbytes(g) for g in range(len(layout.groups))]
    total = sum(pool_bytes)
    return [HostKVTier(layout, kv_cache, capacity_bytes * nbytes // total, group.layers)
            for group, nbytes in zip(layout.groups, pool_bytes, strict=True)]


class SwapInTimer:
    """Times the restores of one admission; records the total if any block came back."""

    def __init__(self, tier: HostKVTier) -> None:
        self._tier = tier
        self._start = time.perf_counter()
        self.num_blocks = 0

    def done(self) -> None:
        if self.num_blocks:
            self._tier.stats.observe_swap_in(time.perf_counter() - self._start, self.num_blocks * self._tier.block_nbytes)
