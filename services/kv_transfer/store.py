"""HandoffStore: each request's KV held in slots under a lease until decode has pulled it. No gRPC here.

Lifecycle of one handoff (one lease, one owner: the store)::

    reserve ──► WRITING ──commit──► LEASED ──claim──► CLAIMED ──release(done)──► DONE
                  │                   │                  └──deadline──► EXPIRED     (decode died mid-pull)
                  │                   ├──release──► RELEASED                        (request aborted)
                  │                   └──deadline─► EXPIRED                         (decode never came)
                  ├──release(failed) / deadline ──► FAILED / EXPIRED               (prefill died mid-push)
    WRITING or CLAIMED ──release by another (the router)──► abandoned: slots kept until the writer or
                       reader stops (its own release, or a refused commit) or the deadline passes

While WRITING, prefill renews the lease (its prompt may wait behind others
before it computes); a prefill that dies stops renewing and the lease expires.
`reserve` pins one slot per KV block and enough slots for the hidden states,
all or nothing: a full store refuses with CapacityError (backpressure), never
runs out of memory halfway. Blocks whose prefix hash is already in the pool
are hits: their slots are shared, nobody writes them again. At `commit` the
handoff's new full blocks join the prefix pool under their hashes, so later
requests hit them while this one is still in flight. Every exit from a live
state goes through `_end`, which unpins the slots exactly once; keyed slots
stay in the pool (evictable), the rest are free again.

Slots being written or read are freed only when the peer moving their bytes has stopped: it says so (its
release after its transfers ended or were aborted, `transfers_stopped`; a commit comes after the writes),
or its deadline passes. A release from anyone else (the router dropping a request whose prefill or decode
went silent, or whose client left mid-prompt) abandons the lease instead: no commit, claim or renewal from
then on, but its slots stay pinned, since an instance the router gave up on may be alive (stopped, slow)
and its one-sided writes (or reads, into a prefix cache) still land.

The ids of recently ended handoffs are remembered, so a Reserve that arrives
after its request was released is refused at once instead of sitting out a
lease. The store is single-threaded: call it from one asyncio event loop.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.kv_transfer.slots import EvictionPolicy, PoolKey, SlotPool
from shared.errors import (
    HandoffNotFoundError,
    InvalidRequestError,
    PermissionDeniedError,
    RequestAbortedError,
)
from shared.kv.layout import cdiv
from shared.kv.remote import (
    ClaimedHandoff,
    HandoffResult,
    HandoffSlots,
    HandoffSpec,
    SlotSpace,
    slot_nbytes_for,
)

logger = logging.getLogger(__name__)


class LeaseState(enum.Enum):
    WRITING = "writing"  # reserved, prefill writing
    LEASED = "leased"  # committed, waiting for decode
    CLAIMED = "claimed"  # decode pulling
    DONE = "done"  # decode pulled it and released
    RELEASED = "released"  # dropped on request (abort)
    EXPIRED = "expired"  # a deadline passed
    FAILED = "failed"  # prefill reported that its push broke

    @property
    def is_live(self) -> bool:
        return self in (LeaseState.WRITING, LeaseState.LEASED, LeaseState.CLAIMED)


@dataclass
class _Lease:
    spec: HandoffSpec
    slots: HandoffSlots
    deadline_s: float
    timeout_s: float
    state: LeaseState = LeaseState.WRITING
    result: HandoffResult | None = None
    abandoned: bool = False  # released by someone other than the peer moving its bytes: ends when that stops

    @property
    def all_slots(self) -> list[int]:
        return self.slots.block_slots + self.slots.hidden_slots


@dataclass(frozen=True)
class StoreStats:
    active_leases: int
    num_slots: int
    slots_pinned: int  # held by live leases
    slots_cached: int  # prefix-pool entries (pinned or evictable)
    slot_nbytes: int
    capacity_bytes: int


# Called once per lease when it ends: (spec, final state, slots it pinned).
EndListener = Callable[[HandoffSpec, LeaseState, int], None]


class HandoffStore:
    """Leases over a SlotPool cut from `capacity_bytes` of registered memory."""

    def __init__(
        self, capacity_bytes: int, space: SlotSpace | None, *, lease_timeout_s: float, claim_timeout_s: float,
        max_lease_timeout_s: float | None = None, policy: EvictionPolicy | None = None,
        clock: Callable[[], float] = time.monotonic, on_end: EndListener | None = None,
        max_remembered_ids: int = 65536,
    ) -> None:
        """`space`: the slot geometry; None cuts slots at the first reserve, sized for its layout."""
        if lease_timeout_s <= 0 or claim_timeout_s <= 0:
            raise ValueError("lease_timeout_s and claim_timeout_s must be > 0")
        self.capacity_bytes = capacity_bytes
        self.lease_timeout_s = lease_timeout_s
        self.claim_timeout_s = claim_timeout_s
        self.max_lease_timeout_s = max_lease_timeout_s
        self.space = space
        self._policy = policy
        self.pool = SlotPool(space.num_slots if space else 0, policy)
        self._clock = clock
        self._on_end = on_end
        self._leases: dict[str, _Lease] = {}
        self._ended: OrderedDict[str, LeaseState] = OrderedDict()
        self._max_remembered_ids = max_remembered_ids
        self._changed = asyncio.Event()  # replaced after every set: waiters re-check the map
        self.hit_blocks_total = 0
        self.num_capability_refusals = 0  # calls that named a live handoff without its capability

    # --- queries ----------------------------------------------------------------------------

    @property
    def active_leases(self) -> int:
        return len(self._leases)

    def data_moving(self) -> bool:
        """A lease is being written (prefill) or read (decode): peers move bytes through the slab now.
        Safe from any thread: the leases are copied (one C call under the GIL) before they are read."""
        return any(lease.state in (LeaseState.WRITING, LeaseState.CLAIMED) for lease in list(self._leases.values()))

    def stats(self) -> StoreStats:
        space = self.space
        return StoreStats(len(self._leases), self.pool.num_slots, self.pool.num_pinned, self.pool.num_cached,
                          space.slot_nbytes if space else 0, self.capacity_bytes)

    def state(self, handoff_id: str) -> LeaseState | None:
        """Current state, the final state of a recently ended handoff, or None when unknown."""
        lease = self._leases.get(handoff_id)
        return lease.state if lease is not None else self._ended.get(handoff_id)

    # --- prefill side ---------------------------------------------------------------------------

    def reserve(self, spec: HandoffSpec) -> HandoffSlots:
        """Pin slots for a new handoff (WRITING); hits are blocks the pool already holds."""
        self.expire(self._clock())
        self._check_new(spec.handoff_id)
        space = self._space_for(spec)
        keys: list[PoolKey | None] = [(spec.key, h) for h in spec.block_hashes]
        keys += [None] * (spec.num_blocks - len(keys))
        num_hidden_slots = cdiv(spec.hidden_nbytes, space.slot_nbytes)
        timeout_s = spec.lease_timeout_ms / 1000 if spec.lease_timeout_ms else self.lease_timeout_s
        if self.max_lease_timeout_s is not None:
            timeout_s = min(timeout_s, self.max_lease_timeout_s)
        acquired = self.pool.acquire([*keys, *([None] * num_hidden_slots)])  # raises CapacityError
        slots = HandoffSlots(space, acquired.slots[: spec.num_blocks], acquired.hits[: spec.num_blocks],
                             acquired.slots[spec.num_blocks :], timeout_s)
        self._ended.pop(spec.handoff_id, None)
        self._leases[spec.handoff_id] = _Lease(spec, slots, self._clock() + timeout_s, timeout_s)
        self.hit_blocks_total += slots.num_leading_hits
        logger.debug("handoff %s (request %s): reserved %d block slots (%d hits) + %d hidden",
                     spec.handoff_id, spec.request_id, spec.num_blocks, acquired.num_hits, num_hidden_slots)
        self._notify()
        return slots

    def _check_new(self, handoff_id: str) -> None:
        if handoff_id in self._leases:
            raise InvalidRequestError(f"handoff {handoff_id} already exists", param="handoff_id")
        ended = self._ended.get(handoff_id)
        if ended is LeaseState.RELEASED:
            raise RequestAbortedError(f"handoff {handoff_id} was released before it was reserved")
        if ended is LeaseState.DONE:
            raise InvalidRequestError(f"handoff {handoff_id} was already claimed", param="handoff_id")

    def _space_for(self, spec: HandoffSpec) -> SlotSpace:
        need = slot_nbytes_for(spec.layout)
        if self.space is None:
            raise InvalidRequestError("kv_transfer has no slot space yet")  # the service cuts it first
        if need > self.space.slot_nbytes:
            raise InvalidRequestError(
                f"a block of {spec.key} needs {need} bytes; this store's slots hold {self.space.slot_nbytes} "
                "(raise BATON_KV_TRANSFER_SLOT_NBYTES)")
        return self.space

    def cut_slots(self, space: SlotSpace) -> None:
        """Set the slot geometry once (a store created without one); the service calls it."""
        assert self.space is None and not self._leases
        self.space = space
        self.pool = SlotPool(space.num_slots, self._policy)

    def renew(self, handoff_id: str, capability: str = "") -> bool:
        """Prefill is alive and still writing (queued behind other prompts, or computing): restart the deadline."""
        lease = self._leases.get(handoff_id)
        if lease is not None:
            self._check_capability(lease, capability)
        if lease is None or lease.state is not LeaseState.WRITING:
            return False
        if lease.abandoned:  # its writer renews, so it is alive: it learns here, aborts and releases
            return False
        lease.deadline_s = self._clock() + lease.timeout_s
        return True

    def commit(self, handoff_id: str, result: HandoffResult, capability: str = "") -> int:
        """Prefill wrote everything: the handoff becomes LEASED and its full blocks join the pool."""
        lease = self._live(handoff_id, LeaseState.WRITING)
        self._check_capability(lease, capability)
        if lease.abandoned:  # a commit comes after the writes: the slots are free to go
            self._end(handoff_id, LeaseState.RELEASED)
            raise RequestAbortedError(f"handoff {handoff_id} was released")
        hidden_nbytes = result.num_hidden_tokens * result.hidden_width * lease.spec.layout.hidden_dtype.itemsize
        if hidden_nbytes > len(lease.slots.hidden_slots) * lease.slots.space.slot_nbytes:
            self._end(handoff_id, LeaseState.FAILED)
            raise InvalidRequestError(f"handoff {handoff_id}: {hidden_nbytes} bytes of hidden states were "
                                      f"written to room reserved for {lease.spec.hidden_nbytes}")
        lease.result = result
        lease.state = LeaseState.LEASED
        lease.deadline_s = self._clock() + lease.timeout_s
        for block_hash, slot in zip(lease.spec.block_hashes, lease.slots.block_slots, strict=False):
            self.pool.publish(slot, (lease.spec.key, block_hash))
        logger.info("handoff %s (request %s): leased, %d blocks", handoff_id, lease.spec.request_id,
                    lease.spec.num_blocks)
        self._notify()
        return len(lease.all_slots) * lease.slots.space.slot_nbytes

    # --- decode side ------------------------------------------------------------------------------

    async def claim(self, handoff_id: str, wait_s: float = 0.0, capability: str = "") -> ClaimedHandoff:
        """Take a LEASED handoff (-> CLAIMED), waiting up to `wait_s` for its commit.

        The slots stay pinned until decode releases (pulled) or the claim deadline passes.
        Raises HandoffNotFoundError when it is not claimable within `wait_s`.
        """
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + max(wait_s, 0.0)
        while True:
            self.expire(self._clock())
            lease = self._leases.get(handoff_id)
            if lease is not None:
                self._check_capability(lease, capability)
            if lease is not None and lease.state is LeaseState.LEASED:
                assert lease.result is not None
                lease.state = LeaseState.CLAIMED
                lease.deadline_s = self._clock() + self.claim_timeout_s
                self._notify()
                return ClaimedHandoff(lease.spec, lease.result, lease.slots, int(self.claim_timeout_s * 1000))
            remaining_s = give_up_at - loop.time()
            ended = self._ended.get(handoff_id)
            if lease is not None and lease.state is LeaseState.CLAIMED:
                ended = LeaseState.CLAIMED
            if lease is not None and lease.abandoned:
                ended = LeaseState.RELEASED
            if ended is not None or remaining_s <= 0:
                why = f"it was {ended.value}" if ended is not None else "prefill did not commit it in time"
                raise HandoffNotFoundError(f"handoff {handoff_id} not found: {why}", param="handoff_id")
            try:
                # any change to the store (a reserve, a commit, a sweep) re-checks
                await asyncio.wait_for(self._changed.wait(), timeout=remaining_s)
            except TimeoutError:
                pass

    def release(self, handoff_id: str, failed: bool = False, capability: str = "",
                transfers_stopped: bool = False) -> bool:
        """End a handoff. Idempotent: True when this call ended it (or abandoned it).

        CLAIMED -> DONE (decode pulled it); WRITING -> FAILED when `failed` (prefill's push broke);
        otherwise -> RELEASED (aborted). WRITING or CLAIMED without `transfers_stopped` (the caller is not the
        peer moving its bytes, or that peer has not stopped) is abandoned instead: it ends when that peer
        stops (see the module docstring). Releasing an unknown id remembers it, so a later Reserve is refused.
        """
        lease = self._leases.get(handoff_id)
        if lease is not None:
            self._check_capability(lease, capability)
            if lease.state in (LeaseState.WRITING, LeaseState.CLAIMED) and not transfers_stopped:
                found = not lease.abandoned
                if found:
                    lease.abandoned = True
                    logger.info("handoff %s (request %s): released while %s; its slots wait for that to stop",
                                handoff_id, lease.spec.request_id,
                                "being written" if lease.state is LeaseState.WRITING else "being read")
                    self._notify()  # a claim waiting on it gives up
                return found
            if lease.state is LeaseState.CLAIMED:
                state = LeaseState.DONE
            elif failed and lease.state is LeaseState.WRITING:
                state = LeaseState.FAILED
            else:
                state = LeaseState.RELEASED
            self._end(handoff_id, state)
            return True
        if handoff_id not in self._ended:
            self._remember(handoff_id, LeaseState.RELEASED)
            self._notify()
        return False

    def expire(self, now_s: float) -> list[str]:
        """End every lease whose deadline is at or before `now_s`; returns their ids."""
        expired = [hid for hid, lease in self._leases.items() if lease.deadline_s <= now_s]
        for handoff_id in expired:
            self._end(handoff_id, LeaseState.EXPIRED)
        return expired

    def sweep(self) -> list[str]:
        """`expire` at the store's own clock (what the service's sweeper calls)."""
        return self.expire(self._clock())

    def release_all(self) -> int:
        """Drop every live handoff (shutdown). Returns how many."""
        live = list(self._leases)
        for handoff_id in live:
            self._end(handoff_id, LeaseState.RELEASED)
        return len(live)

    def check_no_leaks(self) -> None:
        assert not self._leases, f"leases still live: {sorted(self._leases)[:8]}"
        self.pool.check_no_pins()

    def _check_capability(self, lease: _Lease, capability: str) -> None:
        """Refuse a call naming the handoff without its secret (compared in constant time)."""
        if not hmac.compare_digest(lease.spec.capability.encode(), capability.encode()):
            self.num_capability_refusals += 1
            raise PermissionDeniedError(f"handoff {lease.spec.handoff_id}: wrong capability", param="capability")

    # --- the one exit -------------------------------------------------------------------------

    def _live(self, handoff_id: str, expected: LeaseState) -> _Lease:
        lease = self._leases.get(handoff_id)
        if lease is not None and lease.state is expected:
            return lease
        state = lease.state if lease is not None else self._ended.get(handoff_id)
        if state in (LeaseState.RELEASED, LeaseState.EXPIRED):
            raise RequestAbortedError(f"handoff {handoff_id} was {state.value}")
        raise InvalidRequestError(f"handoff {handoff_id} is {state.value if state else 'unknown'}, "
                                  f"not {expected.value}")

    def _end(self, handoff_id: str, state: LeaseState) -> None:
        lease = self._leases.pop(handoff_id)
        assert lease.state.is_live and not state.is_live, (lease.state, state)
        was = lease.state
        lease.state = state
        self.pool.release(lease.all_slots)
        self._remember(handoff_id, state)
        level = logging.INFO if state in (LeaseState.DONE, LeaseState.RELEASED) else logging.WARNING
        logger.log(level, "handoff %s (request %s): %s after %s, %d slots unpinned", handoff_id,
                   lease.spec.request_id, state.value, was.value, len(lease.all_slots))
        if self._on_end is not None:
            self._on_end(lease.spec, state, len(lease.all_slots))
        self._notify()

    def _remember(self, handoff_id: str, state: LeaseState) -> None:
        self._ended[handoff_id] = state
        self._ended.move_to_end(handoff_id)
        while len(self._ended) > self._max_remembered_ids:
            self._ended.popitem(last=False)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
