"""HandoffStore: holds each handoff under a lease until decode claims it. No gRPC here.

Lifecycle of one handoff (one lease, one owner: the store)::

    begin_put ──► RECEIVING ──commit──► LEASED ──claim────► CLAIMED   (deadline restarts at commit)
                     │                    ├──release──► RELEASED
                     │                    └──deadline─► EXPIRED
                     ├──abort_put (stream broke, bad data) ──► FAILED
                     ├──release (request aborted mid-Put) ───► RELEASED
                     └──deadline (Put stalled) ──────────────► EXPIRED

The bytes a handoff announces are reserved when its Put begins, so a store
that is full refuses new Puts (CapacityError: backpressure) instead of
running out of memory halfway. Every exit from RECEIVING or LEASED goes
through `_end`, which frees the reservation exactly once and forgets the
entry; `bytes_held` is the sum of live reservations. The ids of recently
ended handoffs are remembered, so a Put that arrives after its request was
released is refused at once instead of sitting out a lease.

The store is single-threaded: call it from one asyncio event loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from shared.errors import CapacityError, HandoffNotFoundError, InvalidRequestError, RequestAbortedError
from shared.handoff_stream import HandoffAssembly, HandoffInfo, HandoffPayload, HiddenStateData, KVLayerData

logger = logging.getLogger(__name__)


class LeaseState(enum.Enum):
    RECEIVING = "receiving"  # Put in flight: bytes reserved, data arriving
    LEASED = "leased"  # complete, waiting for decode
    CLAIMED = "claimed"  # handed to decode
    RELEASED = "released"  # dropped on request (abort)
    EXPIRED = "expired"  # deadline passed unclaimed
    FAILED = "failed"  # the Put broke or sent bad data

    @property
    def is_live(self) -> bool:
        return self in (LeaseState.RECEIVING, LeaseState.LEASED)


@dataclass
class _Lease:
    assembly: HandoffAssembly
    nbytes: int  # reserved at begin_put
    timeout_s: float  # lease length: from begin_put while receiving, from commit once leased
    deadline_s: float  # on the store's clock
    state: LeaseState = LeaseState.RECEIVING

    @property
    def info(self) -> HandoffInfo:
        return self.assembly.info


@dataclass(frozen=True)
class StoreStats:
    active_leases: int  # RECEIVING + LEASED
    bytes_held: int
    capacity_bytes: int


# Called once per lease when it ends: (info, final state, bytes freed).
EndListener = Callable[[HandoffInfo, LeaseState, int], None]


class HandoffStore:
    """Handoffs by id, each under a lease with a deadline; bounded by `capacity_bytes`."""

    def __init__(
        self,
        capacity_bytes: int,
        default_lease_timeout_s: float,
        *,
        max_lease_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_end: EndListener | None = None,
        max_remembered_ids: int = 65536,
    ) -> None:
        if capacity_bytes < 0 or default_lease_timeout_s <= 0:
            raise ValueError("capacity_bytes must be >= 0 and default_lease_timeout_s > 0")
        self.capacity_bytes = capacity_bytes
        self.default_lease_timeout_s = default_lease_timeout_s
        self.max_lease_timeout_s = max_lease_timeout_s
        self._clock = clock
        self._on_end = on_end
        self._leases: dict[str, _Lease] = {}
        self._ended: OrderedDict[str, LeaseState] = OrderedDict()
        self._max_remembered_ids = max_remembered_ids
        self._bytes_held = 0
        self._changed = asyncio.Event()  # replaced after every set: waiters re-check the map

    # --- queries ----------------------------------------------------------------------------

    @property
    def bytes_held(self) -> int:
        return self._bytes_held

    @property
    def active_leases(self) -> int:
        return len(self._leases)

    def stats(self) -> StoreStats:
        return StoreStats(len(self._leases), self._bytes_held, self.capacity_bytes)

    def state(self, handoff_id: str) -> LeaseState | None:
        """Current state, the final state of a recently ended handoff, or None when unknown."""
        lease = self._leases.get(handoff_id)
        return lease.state if lease is not None else self._ended.get(handoff_id)

    # --- Put ----------------------------------------------------------------------------------

    def begin_put(self, info: HandoffInfo) -> None:
        """Reserve `info.total_nbytes` for a new handoff and open its lease (RECEIVING)."""
        handoff_id = info.handoff_id
        self.expire(self._clock())
        if handoff_id in self._leases:
            raise InvalidRequestError(f"handoff {handoff_id} already exists", param="handoff_id")
        # A failed or expired Put may be retried under the same id; a claimed one may not, and
        # a released one belongs to an aborted request.
        ended = self._ended.get(handoff_id)
        if ended is LeaseState.RELEASED:
            raise RequestAbortedError(f"handoff {handoff_id} was released before its Put")
        if ended is LeaseState.CLAIMED:
            raise InvalidRequestError(f"handoff {handoff_id} was already claimed", param="handoff_id")
        nbytes = info.total_nbytes
        if nbytes > self.capacity_bytes - self._bytes_held:
            raise CapacityError(
                f"kv_transfer store full: handoff {handoff_id} needs {nbytes} bytes, "
                f"{self.capacity_bytes - self._bytes_held} of {self.capacity_bytes} free"
            )
        timeout_s = info.lease_timeout_ms / 1000 if info.lease_timeout_ms else self.default_lease_timeout_s
        if self.max_lease_timeout_s is not None:
            timeout_s = min(timeout_s, self.max_lease_timeout_s)
        self._ended.pop(handoff_id, None)
        self._leases[handoff_id] = _Lease(HandoffAssembly(info), nbytes, timeout_s, self._clock() + timeout_s)
        self._bytes_held += nbytes
        logger.debug("handoff %s (request %s): receiving %d bytes", handoff_id, info.request_id, nbytes)
        self._notify()

    def add_part(self, handoff_id: str, part: KVLayerData | HiddenStateData) -> None:
        """Add one data part to a RECEIVING handoff; bad data fails (and frees) the handoff."""
        lease = self._receiving(handoff_id)
        try:
            lease.assembly.add(part)
        except InvalidRequestError:
            self._end(handoff_id, LeaseState.FAILED)
            raise

    def commit(self, handoff_id: str) -> int:
        """Close the Put: the handoff becomes LEASED (claimable). Returns its bytes."""
        lease = self._receiving(handoff_id)
        if not lease.assembly.complete:
            try:
                lease.assembly.finish()  # raises, naming what is missing
            finally:
                self._end(handoff_id, LeaseState.FAILED)
        lease.state = LeaseState.LEASED
        lease.deadline_s = self._clock() + lease.timeout_s
        info = lease.info
        logger.info("handoff %s (request %s): leased, %d bytes", handoff_id, info.request_id, lease.nbytes)
        self._notify()
        return lease.nbytes

    def abort_put(self, handoff_id: str) -> bool:
        """Drop a handoff whose Put did not complete. Idempotent; True when it freed something."""
        lease = self._leases.get(handoff_id)
        if lease is None or lease.state is not LeaseState.RECEIVING:
            return False
        self._end(handoff_id, LeaseState.FAILED)
        return True

    def _receiving(self, handoff_id: str) -> _Lease:
        lease = self._leases.get(handoff_id)
        if lease is not None and lease.state is LeaseState.RECEIVING:
            return lease
        state = lease.state if lease is not None else self._ended.get(handoff_id)
        if state in (LeaseState.RELEASED, LeaseState.EXPIRED):
            raise RequestAbortedError(f"handoff {handoff_id} was {state.value} during its Put")
        raise InvalidRequestError(
            f"handoff {handoff_id} is not receiving (state: {state.value if state else 'unknown'})"
        )

    # --- Claim / Release / expiry -------------------------------------------------------------

    async def claim(self, handoff_id: str, wait_s: float = 0.0) -> HandoffPayload:
        """Take a LEASED handoff (-> CLAIMED, bytes freed), waiting up to `wait_s` for a Put in flight.

        Raises HandoffNotFoundError when it is not claimable within `wait_s`.
        """
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + max(wait_s, 0.0)
        while True:
            self.expire(self._clock())
            lease = self._leases.get(handoff_id)
            if lease is not None and lease.state is LeaseState.LEASED:
                payload = lease.assembly.finish()
                self._end(handoff_id, LeaseState.CLAIMED)
                return payload
            remaining_s = give_up_at - loop.time()
            ended = self._ended.get(handoff_id)
            if ended is not None or remaining_s <= 0:
                why = f"it was {ended.value}" if ended is not None else "no complete Put arrived in time"
                raise HandoffNotFoundError(f"handoff {handoff_id} not found: {why}", param="handoff_id")
            try:
                # any change to the store (a Put beginning or committing, a sweep) re-checks
                await asyncio.wait_for(self._changed.wait(), timeout=remaining_s)
            except TimeoutError:
                pass

    def release(self, handoff_id: str) -> bool:
        """Drop a handoff (request aborted). Idempotent: True when this call freed it.

        Releasing an id not seen yet remembers it, so its Put is refused when it arrives.
        """
        if handoff_id in self._leases:
            self._end(handoff_id, LeaseState.RELEASED)
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

    # --- the one exit -------------------------------------------------------------------------

    def _end(self, handoff_id: str, state: LeaseState) -> None:
        lease = self._leases.pop(handoff_id)
        assert lease.state.is_live and not state.is_live, (lease.state, state)
        lease.state = state
        self._bytes_held -= lease.nbytes
        assert self._bytes_held >= 0, self._bytes_held
        self._remember(handoff_id, state)
        info = lease.info
        level = logging.INFO if state in (LeaseState.CLAIMED, LeaseState.RELEASED) else logging.WARNING
        logger.log(
            level,
            "handoff %s (request %s): %s, %d bytes freed",
            handoff_id,
            info.request_id,
            state.value,
            lease.nbytes,
        )
        if self._on_end is not None:
            self._on_end(info, state, lease.nbytes)
        self._notify()

    def _remember(self, handoff_id: str, state: LeaseState) -> None:
        self._ended[handoff_id] = state
        self._ended.move_to_end(handoff_id)
        while len(self._ended) > self._max_remembered_ids:
            self._ended.popitem(last=False)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
