"""The slot pool: kv_transfer's host memory cut into fixed-size slots, some content-addressed.

One slot holds one KV block of every layer (`[num_layers, 2, block_size,
num_kv_heads, head_dim]`, see `shared.kv.remote`) or a piece of a request's
hidden states. A slot is in exactly one of three places::

    free ──acquire──► pinned (ref_count > 0) ──release──► free           (no key)
                        ▲    │                      └──► evictable        (keyed: a prefix-pool entry)
                        │    └ publish(key): the slot now names a prefix block
                        └──────── acquire hit (same key) ──── evictable ──evict──► free

Keyed slots are the prefix pool: a full KV block named by its chained prefix
hash (which covers every token before it) under a layout key (model, dtype,
block size, shapes). A later request, a later chat turn or another prefill
instance that asks for the same key reuses the slot instead of sending the
block again. Unpinned keyed slots are evicted by a pluggable policy when free
slots run out; pinned slots never are. Two policies (`BATON_KV_TRANSFER_EVICTION_POLICY`):

    lru   least recently released first
    lfu   least frequently hit first, with dynamic aging (LFU-DA): an entry's priority is its hit count plus
          the priority of the last victim when it was released, so a block many turns and requests shared
          (a system prompt, an early chat turn) outlives one-off tails, while counts from long ago stop
          protecting a block once newer entries climb past them (bench/kv_offload_policy.py compares the two)
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from shared.errors import CapacityError

PoolKey = tuple[str, bytes]  # (layout key, chained block hash)


class EvictionPolicy(Protocol):
    """Chooses which unpinned prefix-pool slot to drop when the pool needs room."""

    def add(self, slot: int) -> None:
        """`slot` became evictable (its last pin was released)."""
        ...

    def remove(self, slot: int) -> None:
        """`slot` is no longer evictable (pinned again by a hit)."""
        ...

    def pop(self) -> int | None:
        """The next victim, or None when nothing is evictable."""
        ...

    def hit(self, slot: int) -> None:
        """A request asked for `slot`'s key and got it (pinned or evictable)."""
        ...

    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently released first."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def add(self, slot: int) -> None:
        self._order[slot] = None
        self._order.move_to_end(slot)

    def remove(self, slot: int) -> None:
        self._order.pop(slot, None)

    def pop(self) -> int | None:
        if not self._order:
            return None
        slot, _ = self._order.popitem(last=False)
        return slot

    def hit(self, slot: int) -> None:
        """Recency is taken at release (`add`), not at the hit."""

    def __len__(self) -> int:
        return len(self._order)


class LFUPolicy:
    """Least frequently hit first, aged dynamically (LFU-DA; the module docstring); ties go to the least
    recently released. A heap with lazy deletion: `remove` only forgets the slot's live entry."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int]] = []  # (priority, release order, slot)
        self._live: dict[int, int] = {}  # evictable slot -> release order of its live heap entry
        self._hits: dict[int, int] = {}  # keyed slot -> requests that used it since it was published
        self._age = 0.0  # priority of the last victim
        self._order = itertools.count()

    def add(self, slot: int) -> None:
        order = next(self._order)
        self._live[slot] = order
        heapq.heappush(self._heap, (self._age + self._hits.setdefault(slot, 1), order, slot))
        if len(self._heap) > 2 * len(self._live) + 64:  # dead entries of slots hit again: drop them
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def remove(self, slot: int) -> None:
        self._live.pop(slot, None)

    def pop(self) -> int | None:
        while self._heap:
            priority, order, slot = heapq.heappop(self._heap)
            if self._live.get(slot) == order:
                del self._live[slot]
                self._hits.pop(slot, None)
                self._age = priority
                return slot
        return None

    def hit(self, slot: int) -> None:
        self._hits[slot] = self._hits.get(slot, 1) + 1

    def __len__(self) -> int:
        return len(self._live)


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by its settings name (`EVICTION_POLICIES`)."""
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}: one of {sorted(EVICTION_POLICIES)}") from None


@dataclass
class _Slot:
    ref_count: int = 0
    key: PoolKey | None = None


@dataclass(frozen=True)
class Acquired:
    slots: list[int]
    hits: list[bool]  # hits[i]: slots[i] already holds the data named by keys[i]

    @property
    def num_hits(self) -> int:
        return sum(self.hits)


class SlotPool:
    """Ref-counted slots with a content-addressed prefix pool; no memory of its own, only indices."""

    def __init__(self, num_slots: int, policy: EvictionPolicy | None = None) -> None:
        if num_slots < 0:
            raise ValueError("num_slots must be >= 0")
        self.num_slots = num_slots
        self._slots = [_Slot() for _ in range(num_slots)]
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out low ids first
        self._by_key: dict[PoolKey, int] = {}
        self._policy: EvictionPolicy = policy if policy is not None else LRUPolicy()  # an empty one is falsy

    # --- queries -------------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Slots with no content."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Prefix-pool slots no lease pins."""
        return len(self._policy)

    @property
    def num_cached(self) -> int:
        """Prefix-pool slots, pinned or not."""
        return len(self._by_key)

    @property
    def num_pinned(self) -> int:
        return self.num_slots - self.num_free - self.num_evictable

    def lookup(self, key: PoolKey) -> int | None:
        return self._by_key.get(key)

    def recent_hashes(self, max_keys: int) -> list[bytes]:
        """Block hashes of up to `max_keys` prefix-pool entries, the most recently published first."""
        return [block_hash for _, block_hash in itertools.islice(reversed(self._by_key), max_keys)]

    # --- acquire / publish / release -------------------------------------------------------------

    def acquire(self, keys: Sequence[PoolKey | None]) -> Acquired:
        """Pin one slot per key: the pool's slot on a hit, a fresh one otherwise (None = never a hit).

        All or nothing: raises CapacityError, changing nothing, when fresh slots run out.
        """
        hit_slots = [self._by_key.get(k) if k is not None else None for k in keys]
        num_fresh = sum(1 for s in hit_slots if s is None)
        # a hit on an evictable slot takes it out of the evictable set, so it cannot also be a victim
        evictable_hits = {s for s in hit_slots if s is not None and self._slots[s].ref_count == 0}
        available = len(self._free) + len(self._policy) - len(evictable_hits)
        if num_fresh > available:
            raise CapacityError(
                f"kv_transfer store full: {num_fresh} slots needed, {available} of {self.num_slots} available"
            )
        for s in hit_slots:
            if s is not None:
                self._policy.hit(s)
                self._pin(s)
        slots = [s if s is not None else self._take_fresh() for s in hit_slots]
        return Acquired(slots, [s is not None for s in hit_slots])

    def publish(self, slot: int, key: PoolKey) -> bool:
        """Name a pinned slot's content by `key` (first writer wins). True when the key was new."""
        entry = self._slots[slot]
        assert entry.ref_count > 0, f"publish of unpinned slot {slot}"
        if entry.key is not None or key in self._by_key:
            return False
        entry.key = key
        self._by_key[key] = slot
        return True

    def release(self, slots: Sequence[int]) -> None:
        """Drop one pin from each slot; keyed slots stay in the pool as evictable, others are freed."""
        for slot in slots:
            entry = self._slots[slot]
            assert entry.ref_count > 0, f"double release of slot {slot}"
            entry.ref_count -= 1
            if entry.ref_count == 0:
                if entry.key is not None:
                    self._policy.add(slot)
                else:
                    self._free.append(slot)

    def clear(self) -> int:
        """Drop every unpinned prefix-pool entry; returns how many."""
        dropped = 0
        while (slot := self._policy.pop()) is not None:
            self._forget(slot)
            self._free.append(slot)
            dropped += 1
        return dropped

    def check_no_pins(self) -> None:
        pinned = [i for i, s in enumerate(self._slots) if s.ref_count]
        assert not pinned, f"slots still pinned: {pinned[:16]}"

    # --- internals ---------------------------------------------------------------------------------

    def _pin(self, slot: int) -> None:
        entry = self._slots[slot]
        if entry.ref_count == 0:
            self._policy.remove(slot)
        entry.ref_count += 1

    def _take_fresh(self) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            victim = self._policy.pop()
            assert victim is not None, "acquire checked the capacity"
            self._forget(victim)
            slot = victim
        self._slots[slot].ref_count = 1
        return slot

    def _forget(self, slot: int) -> None:
        entry = self._slots[slot]
        if entry.key is not None:
            del self._by_key[entry.key]
            entry.key = None
