"""Per-request block tables on top of the block pool.

The manager is the one owner of "which blocks does request R hold". The
scheduler asks it to find a cached prefix at admission, to grow a request's
table before a step, to register blocks that became full, and to free a
request's blocks exactly once when it finishes, is preempted or aborted.
"""

from __future__ import annotations

from shared.engine.block_pool import BlockHash, BlockPool, hash_block
from shared.engine.kv_offload import HostKVTier, SwapInTimer
from shared.engine.request import Request
from shared.kv.layout import cdiv
from shared.multimodal.items import block_media_key


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, hash_salt: bytes = b"") -> None:
        self.pool = pool
        self.block_size = block_size
        # salt (model identity) keeps hashes of different models apart
        self.hash_salt = hash_salt
        self.block_tables: dict[str, list[int]] = {}
        self._block_hashes: dict[str, list[BlockHash]] = {}
        self.tier: HostKVTier | None = None  # evicted blocks in host memory (kv_offload.py), when configured

    def attach_tiers(self, tiers: list[HostKVTier]) -> None:
        """Spill what each group's pool evicts into its tier (kv_offload.group_tiers); lookups restore from them
        (a second prefix-cache tier). One group here; hybrid_kv.py adds the sliding ones."""
        [self.tier] = tiers
        self.pool.on_evict = self.tier.spill

    @property
    def tiers(self) -> list[HostKVTier]:
        """Every group's host tier (none when offload is off)."""
        return [self.tier] if self.tier is not None else []

    def block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's tables in the other layer groups (none here; see hybrid_kv.py)."""
        return []

    def tables(self, request_id: str) -> list[list[int]]:
        """The request's table in every layer group (KVLayout.groups order)."""
        return [self.block_ids(request_id), *self.group_block_ids(request_id)]

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Longest run of cached full blocks matching the request's tokens (see `lookup_prefix`)."""
        return self.lookup_prefix(request)[0]

    def lookup_prefix(self, request: Request) -> tuple[list[int], BlockHash | None]:
        """(the longest run of cached full blocks matching the request's tokens, the hash of the full block
        after them: None when there is none, or prefix caching is off).

        At least one token is always left to compute: the step that computes it
        samples the next token.
        """
        if not self.pool.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return [], None  # prompt logprobs need every prompt position computed (vLLM skips the cache too)
        timer = SwapInTimer(self.tier) if self.tier is not None else None  # one admission's restores, every group
        try:
            return self._lookup(request, timer)
        finally:
            if timer is not None:
                timer.done()

    def _lookup(self, request: Request, timer: SwapInTimer | None) -> tuple[list[int], BlockHash | None]:
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hit: list[int] = []
        parent: BlockHash | None = None
        for i in range(max_blocks):
            block_tokens = tokens[i * self.block_size : (i + 1) * self.block_size]
            parent = hash_block(parent, block_tokens, self.hash_salt, block_media_key(request.media, i, self.block_size))
            block_id = self.pool.lookup(parent, block_tokens)
            if block_id is None and timer is not None:
                block_id = restore_block(self.pool, self.tier, parent, block_tokens, hit)
                timer.num_blocks += block_id is not None
            if block_id is None:
                return hit, parent
            hit.append(block_id)
        return hit, None

    def blocks_needed(self, request: Request, num_tokens_after_step: int) -> int:
        """New blocks `allocate_slots(request, num_tokens_after_step)` would take (no prefix hits)."""
        return max(cdiv(num_tokens_after_step, self.block_size) - len(self.block_tables.get(request.request_id, [])),
                   0)

    def allocate_slots(
        self, request: Request, num_tokens_after_step: int, cached_block_ids: list[int] | None = None,
        host_writes: bool = False,
    ) -> bool:
        """Grow the request's table to hold `num_tokens_after_step` tokens.

        `cached_block_ids` (admission only) are prefix-cache hits to adopt first. `host_writes`:
        the new blocks are filled from the host (a KV handoff), not by a step (see BlockPool.hold_frees).
        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        cached = cached_block_ids or []
        table = self.block_tables.get(request.request_id, [])
        num_new = cdiv(num_tokens_after_step, self.block_size) - len(table) - len(cached)
        # cached hits that no one references sit in the free list: adopting them uses it up too
        num_free_hits = sum(1 for b in cached if self.pool.is_free_for(b, host_writes))
        if max(num_new, 0) > self.pool.num_free_for(host_writes) - num_free_hits:
            return False
        self.pool.touch(cached)
        new_ids = self.pool.allocate(num_new, host_writes) if num_new > 0 else []
        self.block_tables[request.request_id] = table + cached + new_ids
        return True

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (slots only rejected drafts used).

        Those blocks were never registered in the prefix cache: a block is cached
        only once every slot in it holds a computed, accepted token.
        """
        table = self.block_tables.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if table is None or len(table) <= keep:
            return
        extra = table[keep:]
        del table[keep:]
        self.pool.free(extra)

    def cache_full_blocks(self, request: Request) -> None:
        """Register blocks that this request has filled with computed tokens of known ids.

        The newest known token is left out: its KV is written by the step that runs it, which may
        still be in flight (and planned positions past the known tokens hold guesses).
        """
        table = self.block_tables.get(request.request_id)
        if table is None or not self.pool.enable_prefix_caching:
            return
        hashes = self._block_hashes.setdefault(request.request_id, [])
        first = len(hashes)
        hashes += self._unregistered(request, hashes)
        tokens = request.all_token_ids
        for i in range(first, len(hashes)):
            self.pool.cache_block(table[i], hashes[i], tokens[i * self.block_size : (i + 1) * self.block_size])

    def num_final_blocks(self, request_id: str) -> int:
        """Leading full blocks of the request whose KV is final (registered in the prefix cache) in every layer
        group it keeps them in: what a preemption can park elsewhere (kv_spill.py)."""
        return len(self._block_hashes.get(request_id, []))

    def planned_block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the full blocks that the request's planned steps fill and that are not registered
        yet: once those steps are read (`cache_full_blocks`), they are prefix-cache hits."""
        if request.request_id not in self.block_tables or not self.pool.enable_prefix_caching:
            return []
        return self._unregistered(request, self._block_hashes.get(request.request_id, []))

    def _unregistered(self, request: Request, hashes: list[BlockHash]) -> list[BlockHash]:
        """The chained hashes after `hashes` of the request's full blocks of computed, known tokens."""
        num_full = min(request.num_computed_tokens, request.num_tokens - 1) // self.block_size
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else None
        out: list[BlockHash] = []
        for i in range(len(hashes), num_full):
            parent = hash_block(parent, tokens[i * self.block_size : (i + 1) * self.block_size],
                                self.hash_salt, block_media_key(request.media, i, self.block_size))
            out.append(parent)
        return out

    def free(self, request: Request) -> None:
        """Release every block the request holds. Safe to call once per hold."""
        table = self.block_tables.pop(request.request_id, None)
        self._block_hashes.pop(request.request_id, None)
        if table:
            self.pool.free(table)

    def hold_frees(self) -> None:
        """A step goes to the executor: see BlockPool.hold_frees."""
        self.pool.hold_frees()

    def release_held_frees(self) -> None:
        self.pool.release_held_frees()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def check_no_leaks(self) -> None:
        assert not self.block_tables, f"requests still hold blocks: {sorted(self.block_tables)}"
        self.pool.check_no_leaks()


def restore_block(pool: BlockPool, tier: HostKVTier | None, block_hash: BlockHash, block_tokens: list[int],
                  hit: list[int]) -> int | None:
    """A block `tier` holds, copied back into a fresh block of `pool` and cached there (unreferenced, like any
    cached block); None when there is no tier, it lacks the block, or no block is free for a host write.
    `hit`: the blocks of `pool` found so far, which this allocation must not evict."""
    if tier is None or not tier.holds(block_hash, block_tokens):
        return None
    pool.touch(hit)
    try:
        if not pool.num_free_for(host_writes=True):
            return None
        [block_id] = pool.allocate(1, host_writes=True)
    finally:
        pool.free(hit)
    tier.restore(block_hash, block_id)
    pool.cache_block(block_id, block_hash, block_tokens)
    pool.free([block_id])
    return block_id
