"""Block tables per layer group: sliding-window layers keep only the blocks a query can still see.

A model whose layers keep different things (KVLayout.groups: Gemma 4's full and
sliding layers) gets one block pool per group. Group 0 (layers that keep every
block) is the plain `KVCacheManager` the scheduler talks to; each sliding group
adds a table per request whose entries before the window are NULL::

    logical block      0     1     2     3     4     5     6          (block_size 4, window 8)
    group 0 (full)     17    3     9     40    41    12    8          every block, prefix-cached
    group 1 (w=8)      NULL  NULL  NULL  NULL  22    5     30         the next query (position 27) sees 20..27

Before each step the blocks that fall out of the window of the step's first
query are freed (they stay prefix-cached in their pool until evicted: a later
request with the same prefix can still use them). A prefix hit must hold, in
every sliding group, the blocks inside the window before the hit's end; the hit
is shortened until it does. NULL is one extra block per sliding pool that no
request owns (reads of it are masked out: it lies outside every window).
With a host tier per group (kv_offload.py), a block missing from a pool is
looked up in its group's tier and copied back before the hit is shortened.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.engine.block_pool import BlockHash, BlockPool
from shared.engine.kv_manager import KVCacheManager, restore_block
from shared.engine.kv_offload import HostKVTier, SwapInTimer
from shared.engine.request import Request
from shared.kv.layout import KVGroup, cdiv
from shared.multimodal.items import MediaInput

# positions a step's start may move back after it was planned: its drafts, all rejected (at most 16, EngineConfig)
_ROLLBACK_TOKENS = 17


@dataclass
class _WindowGroup:
    group: KVGroup
    pool: BlockPool
    null: int  # the block id NULL entries name (one past the pool's blocks)
    tables: dict[str, list[int]] = field(default_factory=dict)
    num_registered: dict[str, int] = field(default_factory=dict)  # blocks registered in the prefix cache
    tier: HostKVTier | None = None  # the pool's evicted blocks in host memory (kv_offload.py), when configured


class HybridKVCacheManager(KVCacheManager):
    """`KVCacheManager` over group 0, plus a table per request in each sliding group."""

    def __init__(self, pools: list[BlockPool], groups: tuple[KVGroup, ...], block_size: int,
                 hash_salt: bytes = b"") -> None:
        super().__init__(pools[0], block_size, hash_salt)
        assert groups[0].sliding_window is None and all(g.sliding_window for g in groups[1:]), groups
        self.windows = [_WindowGroup(g, p, p.num_blocks) for g, p in zip(groups[1:], pools[1:], strict=True)]
        self._pending_hits: dict[str, list[list[int]]] = {}  # request id -> each group's hits (lookup_prefix)

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """Each sliding group's table of the request (NULL before the window)."""
        return [w.tables.get(request_id, []) for w in self.windows]

    # ---- host tiers (kv_offload.py) ----------------------------------------------------
    def attach_tiers(self, tiers: list[HostKVTier]) -> None:
        super().attach_tiers(tiers[:1])
        for w, tier in zip(self.windows, tiers[1:], strict=True):
            w.tier = tier
            w.pool.on_evict = tier.spill

    @property
    def tiers(self) -> list[HostKVTier]:
        return [*super().tiers, *(w.tier for w in self.windows if w.tier is not None)]

    # ---- prefix hits ------------------------------------------------------------------
    def _lookup(self, request: Request, timer: SwapInTimer | None) -> tuple[list[int], BlockHash | None]:
        hit, next_hash = super()._lookup(request, timer)
        self._pending_hits.pop(request.request_id, None)
        if not hit:
            return hit, next_hash
        tokens = request.all_token_ids
        hashes = self._chain(tokens, len(hit), request.media)
        for n in range(len(hit), -1, -1):  # the longest hit every sliding group can serve
            found = [self._window_hits(w, tokens, hashes, n, timer) for w in self.windows]
            if all(f is not None for f in found):
                break
        if n < len(hit):
            next_hash = hashes[n]
        self._pending_hits[request.request_id] = [f for f in found if f is not None]
        return hit[:n], next_hash

    def _chain(self, tokens: list[int], num_blocks: int, media: Sequence[MediaInput] = ()) -> list[BlockHash]:
        from shared.engine.block_pool import hash_block
        from shared.multimodal.items import block_media_key

        out: list[BlockHash] = []
        parent: BlockHash | None = None
        for i in range(num_blocks):
            parent = hash_block(parent, tokens[i * self.block_size:(i + 1) * self.block_size],
                                self.hash_salt, block_media_key(media, i, self.block_size))
            out.append(parent)
        return out

    def _window_hits(self, w: _WindowGroup, tokens: list[int], hashes: list[BlockHash], n: int,
                     timer: SwapInTimer | None) -> list[int] | None:
        """The group's table for a hit of `n` blocks (NULL before the window), or None if it lacks a block that
        neither its pool nor its host tier holds."""
        first = w.group.first_kept_block(n * self.block_size, self.block_size)
        table = [w.null] * first
        for i in range(first, n):
            block_tokens = tokens[i * self.block_size:(i + 1) * self.block_size]
            block_id = w.pool.lookup(hashes[i], block_tokens)
            if block_id is None and timer is not None:
                block_id = restore_block(w.pool, w.tier, hashes[i], block_tokens, table[first:])
                timer.num_blocks += block_id is not None
            if block_id is None:
                return None
            table.append(block_id)
        return table

    # ---- growth, release, rollback ------------------------------------------------------
    def allocate_slots(self, request: Request, num_tokens_after_step: int, cached_block_ids: list[int] | None = None,
                       host_writes: bool = False) -> bool:
        rid = request.request_id
        cached = cached_block_ids or []
        hits = self._pending_hits.pop(rid, None) if cached else None
        if cached and (hits is None or any(len(h) != len(cached) for h in hits)):
            hits = [[w.null] * len(cached) for w in self.windows]  # unreachable: lookup_prefix stashed them
        # host writes (a handoff) fill every position before the step; a step starts at the computed tokens,
        # which count its planned drafts: keep what a query sees after all of them are rejected
        computed = max(request.num_computed_tokens, len(cached) * self.block_size)
        next_pos = num_tokens_after_step if host_writes else max(0, computed - _ROLLBACK_TOKENS)
        last = cdiv(num_tokens_after_step, self.block_size)
        plans = []
        for gi, w in enumerate(self.windows):
            table = hits[gi] if hits is not None else w.tables.get(rid, [])
            first = w.group.first_kept_block(next_pos, self.block_size)
            new = [i for i in range(len(table), last) if i >= first]
            live_hits = [b for b in (hits[gi] if hits is not None else []) if b != w.null]
            free_hits = sum(1 for b in live_hits if w.pool.is_free_for(b, host_writes))
            if len(new) > w.pool.num_free_for(host_writes) - free_hits:
                return False
            plans.append((w, table, first, new, live_hits))
        if not super().allocate_slots(request, num_tokens_after_step, cached, host_writes):
            return False
        for w, table, first, new, live_hits in plans:
            w.pool.touch(live_hits)
            ids = iter(w.pool.allocate(len(new), host_writes))
            table = table + [next(ids) if i >= first else w.null for i in range(len(table), last)]
            self._release_before(w, table, first)
            w.tables[rid] = table
        return True

    def _release_before(self, w: _WindowGroup, table: list[int], first: int) -> None:
        """Free the table's blocks before `first` (out of every later query's window)."""
        gone = [b for b in table[:first] if b != w.null]
        if gone:
            w.pool.free(gone)
            table[:first] = [w.null] * first

    def truncate(self, request: Request, num_tokens: int) -> None:
        super().truncate(request, num_tokens)
        keep = cdiv(num_tokens, self.block_size)
        for w in self.windows:
            table = w.tables.get(request.request_id)
            if table is not None and len(table) > keep:
                extra = [b for b in table[keep:] if b != w.null]
                del table[keep:]
                w.pool.free(extra)

    def cache_full_blocks(self, request: Request) -> None:
        super().cache_full_blocks(request)
        rid = request.request_id
        hashes = self._block_hashes.get(rid, [])
        tokens = request.all_token_ids
        for w in self.windows:
            table = w.tables.get(rid, [])
            start = w.num_registered.get(rid, 0)
            for i in range(start, min(len(hashes), len(table))):
                if table[i] != w.null:
                    w.pool.cache_block(table[i], hashes[i], tokens[i * self.block_size:(i + 1) * self.block_size])
            w.num_registered[rid] = max(start, min(len(hashes), len(table)))

    def num_final_blocks(self, request_id: str) -> int:
        """Group 0's final blocks, if every sliding group holds those inside the window that the query after
        them sees (its NULL entries are a prefix of its table, before that window); else none."""
        n = min([super().num_final_blocks(request_id), *(w.num_registered.get(request_id, 0) for w in self.windows)])
        for w in self.windows:
            table = w.tables.get(request_id, [])
            if any(table[i] == w.null for i in range(w.group.first_kept_block(n * self.block_size, self.block_size), n)):
                return 0
        return n

    def free(self, request: Request) -> None:
        super().free(request)
        rid = request.request_id
        self._pending_hits.pop(rid, None)
        for w in self.windows:
            table = w.tables.pop(rid, None)
            w.num_registered.pop(rid, None)
            if table:
                w.pool.free([b for b in table if b != w.null])

    # ---- pools --------------------------------------------------------------------------
    def hold_frees(self) -> None:
        super().hold_frees()
        for w in self.windows:
            w.pool.hold_frees()

    def release_held_frees(self) -> None:
        super().release_held_frees()
        for w in self.windows:
            w.pool.release_held_frees()

    def check_no_leaks(self) -> None:
        super().check_no_leaks()
        for w in self.windows:
            assert not w.tables, f"requests still hold sliding blocks: {sorted(w.tables)}"
            w.pool.check_no_leaks()
