"""Block pool: ref-counted KV blocks with content-addressed prefix caching.

A block is *free* when no request holds it (ref_count == 0). A free block may
still carry a cached prefix (its hash is registered): it is reused by a later
request with the same prefix, or evicted (hash dropped) when the pool needs a
fresh block. Free blocks sit in an LRU queue: blocks freed last are evicted
last, and a request frees its blocks tail-first so that prefix heads outlive
their tails.

Block hashes are chained: hash(block i) = H(hash(block i-1), token ids of i),
so a hash names the whole prefix up to and including that block. The token ids
are kept next to the hash and re-checked on a hit.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from shared.multimodal.items import MediaInput, MediaItem, block_media_key

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"",
               media_key: bytes = b"") -> BlockHash:
    """Stable (cross-process) chained hash of one full block. `extra` (the model's salt) names the chain's root;
    `media_key` the images and audio whose soft tokens the block holds (shared/multimodal/items.py)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root:" + extra)
    h.update(array("q", token_ids).tobytes())
    if media_key:
        h.update(b"media:" + media_key)
    return h.digest()


def hash_prefix_blocks(token_ids: Sequence[int], block_size: int, extra: bytes = b"",
                       media: Sequence[MediaInput] | Sequence[MediaItem] = ()) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids` (with `media`: the prompt's images and audio)."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for i, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        parent = hash_block(parent, token_ids[start : start + block_size], extra, block_media_key(media, i, block_size))
        hashes.append(parent)
    return hashes


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = field(default=())


class BlockPool:
    """Hands out KV block ids; owns ref counts and the prefix-hash index."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # LRU of free blocks: the first key is evicted first
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        # zero-bubble loop: blocks freed while a step runs on the device, which may still write them.
        # Steps planned meanwhile may take them (they run after it); host writers may not yet.
        self._held: OrderedDict[int, None] | None = None
        # a second tier (kv_offload.py): told of each cached block evicted for reuse, before it is overwritten
        self.on_evict: Callable[[int, BlockHash, tuple[int, ...]], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks held by no request (cached-but-unreferenced blocks count as free)."""
        return len(self._free) + (len(self._held) if self._held is not None else 0)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def recent_cached_hashes(self, max_blocks: int) -> list[BlockHash]:
        """Hashes of up to `max_blocks` cached blocks, the most recently cached first (what an instance
        publishes so that a router can estimate its prefix hits; see shared/registry/kv_summary.py)."""
        return list(itertools.islice(reversed(self._cached), max_blocks))

    def allocate(self, n: int, host_writes: bool = False) -> list[int]:
        """Take `n` blocks for exclusive use (ref_count 1), evicting cached ones as needed.

        `host_writes`: the caller fills them from the host (a KV handoff), so held blocks are out.
        """
        if n > self.num_free_for(host_writes):
            raise RuntimeError(f"asked for {n} blocks, {self.num_free_for(host_writes)} free")  # caller checks
        ids = []
        for _ in range(n):
            source = self._free if self._free or self._held is None else self._held
            block_id, _ = source.popitem(last=False)
            block = self.blocks[block_id]
            if self.on_evict is not None and block.block_hash is not None:
                self.on_evict(block_id, block.block_hash, block.token_ids)
            self._evict(block)
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """Id of a cached block holding exactly this prefix block, if any."""
        block_id = self._cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids):
            return None
        return block_id

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to cached blocks found by `lookup`."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                if block_id in self._free:
                    del self._free[block_id]
                else:  # freed while a step runs: readers may share it (a prefix hit only reads)
                    assert self._held is not None and block_id in self._held, block_id
                    del self._held[block_id]
            block.ref_count += 1

    def hold_frees(self) -> None:
        """From now on, blocks that become free are kept from host writers until `release_held_frees`.

        The zero-bubble loop calls this when it submits a step: that step may still write the blocks
        of a request that finishes or is preempted meanwhile. A later step may reuse them (it runs
        after this one); a KV handoff copied in from the host may not until the step ends.
        """
        if self._held is None:
            self._held = OrderedDict()

    @property
    def holding_frees(self) -> bool:
        """A step is in flight: blocks freed since it was submitted are closed to host writers."""
        return self._held is not None

    def release_held_frees(self) -> None:
        """The step has ended: held blocks join the free list's tail, open to everyone."""
        held, self._held = self._held, None
        for block_id in held or ():
            self._free[block_id] = None

    def num_free_for(self, host_writes: bool) -> int:
        """Free blocks a writer may take: host writers (KV handoffs) only those no step may still write."""
        return len(self._free) if host_writes else self.num_free_blocks

    def is_free_for(self, block_id: int, host_writes: bool) -> bool:
        return block_id in self._free or (not host_writes and self._held is not None and block_id in self._held)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; unreferenced blocks join the LRU tail (or the held ones).

        Freed in reverse so a request's tail blocks are evicted before its head.
        """
        tail = self._held if self._held is not None else self._free
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                tail[block_id] = None

    def cache_block(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Register a full, computed block under its prefix hash (first writer wins)."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block_id

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block.block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()

    def check_no_leaks(self) -> None:
        """Assert every block is back in the pool (tests call this after each engine test)."""
        assert not self._held, f"blocks still held for a step in flight: {list(self._held or ())}"
        held = [b.block_id for b in self.blocks if b.ref_count != 0]
        assert not held, f"blocks still referenced: {held}"
        assert len(self._free) == self.num_blocks, f"free list has {len(self._free)}/{self.num_blocks}"
