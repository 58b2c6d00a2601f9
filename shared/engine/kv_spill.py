"""A preempted decode request's context parked in kv_transfer's pool, and read back when it resumes.

When a decode engine runs out of blocks, the scheduler preempts a request and frees its blocks; without a
second tier its whole context is computed again when it resumes. With kv_transfer's pool as that tier::

    spill(request), its blocks still held ─► its final blocks (full, prefix-cached, in every layer group):
        Reserve them at the kv_transfer its KV came through (the pool names those it already holds: the
        prompt prefill pushed) ─► WRITE the others ─► Commit (they join the pool under their prefix hashes)
        ─► Release                                                  ... then the scheduler frees its blocks
    swap_in(request), once per preemption, before its admission looks up the local prefix cache:
        Reserve its tokens ─► the pool's usable prefix past what the local cache holds ─► READ it into fresh
        blocks, cached locally ─► Release ─► the admission finds them as local prefix hits

Both run on the engine thread and block it until their transfers are over: a preemption is rare, and what
it saves (recomputing a context of thousands of tokens, bench/kv_spill.py) is far longer than the stall.
Any failure (kv_transfer gone or full, a transfer broken) leaves the request to be recomputed as without a
tier. Every lease is released on every path, so kv_transfer keeps only what was committed, and a block read
back is only cached once its read is over.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from shared.engine.handoff_spec import handoff_spec
from shared.engine.kv_pull import KVPuller, PullOutcome, PullSource
from shared.engine.kv_push import KVPusher, PushOutcome
from shared.engine.request import Request
from shared.errors import BatonError, KVTransferError
from shared.kv.remote import AgentAddress, HandoffResult, HandoffSlots, HandoffSpec, usable_pool_prefix

if TYPE_CHECKING:
    from shared.engine.kv_link import KVAgents
    from shared.engine.kv_stats import KVTransferStats
    from shared.engine.remote_kv import HandoffEngine

logger = logging.getLogger(__name__)

_MAX_WAITS = 4  # steps a resuming request waits for blocks held by the steps in flight to read its context into
_POLL_S = 0.0002  # between polls of a blocking transfer: short against a block's copy, long against a poll
_PARKED = HandoffResult(first_token_id=0, first_logprobs=None)  # what a parked context commits: nothing to decode

OutcomeT = TypeVar("OutcomeT", PushOutcome, PullOutcome)


class KVTransferCalls(Protocol):
    """kv_transfer's control calls for the engine thread: each blocks until the service has made it on its own
    event loop (shared/service/kv_calls.py), and raises BatonError when it fails."""

    def address_of(self, agent_name: str) -> str | None:
        """The gRPC address of the kv_transfer whose agent has this name (None: not one this service met)."""
        ...

    def reserve(self, address: str, spec: HandoffSpec) -> tuple[HandoffSlots, AgentAddress]: ...

    def commit(self, address: str, handoff_id: str, result: HandoffResult, capability: str) -> None: ...

    def release(self, address: str, handoff_id: str, failed: bool, capability: str) -> None: ...


@dataclass(frozen=True)
class _Lease:
    """A handoff this engine reserved at kv_transfer for itself (parking, or looking up, a context)."""

    handoff_id: str
    capability: str
    slots: HandoffSlots
    agent: AgentAddress


class KVSpill:
    """The decode engine's side of parking preempted contexts in kv_transfer (module docstring)."""

    def __init__(self, engine: HandoffEngine, agents: KVAgents, calls: KVTransferCalls, stats: KVTransferStats,
                 transfer_timeout_s: float) -> None:
        self._e = engine
        self._calls = calls
        self._pusher = KVPusher(agents, engine.layout, "after_prefill")  # everything at once: it is all computed
        self._puller = KVPuller(agents, engine.layout, engine.runner.kv_cache)
        self._stats = stats  # directions "spill" and "swap_in"
        self._timeout_s = transfer_timeout_s
        self.spilled_units = 0  # blocks (of every layer group) written to the pool
        self.swapped_in_blocks = 0  # blocks read back instead of recomputed
        self.recent_swap_in_s: deque[float] = deque(maxlen=4096)  # per resume that read blocks, for percentiles

    def spill(self, request: Request) -> None:
        """The scheduler preempts `request` and has not freed its blocks yet: park its final blocks."""
        e = self._e
        address = self._address(request)
        num_blocks = e.kv.num_final_blocks(request.request_id)
        if address is None or num_blocks == 0:
            return
        num_tokens = num_blocks * e.config.block_size
        started = time.perf_counter()
        lease = self._reserve(request, address, num_tokens, "spill")
        if lease is None:
            return
        committed, nbytes = False, 0
        try:
            self._pusher.attach(lease.handoff_id, lease.agent, lease.slots, num_tokens)
            self._pusher.finish(lease.handoff_id, e.kv.tables(request.request_id), _PARKED, None)
            outcome = self._wait(self._pusher.poll, self._pusher.abort, lease.handoff_id)
            if outcome.result is not None:
                self._calls.commit(address, lease.handoff_id, outcome.result, lease.capability)
                committed, nbytes = True, outcome.nbytes
        except BatonError as err:
            logger.warning("request %s: parking its KV in kv_transfer failed: %s", request.request_id, err)
        finally:
            self._pusher.abort(lease.handoff_id)  # nothing may read its blocks once they are freed
            self._release(address, lease, failed=not committed)
        seconds = time.perf_counter() - started
        self._stats.observe("spill", seconds, nbytes, failed=not committed)
        if committed:
            written = lease.slots.present.count(False)
            self.spilled_units += written
            logger.info("request %s preempted: %d tokens parked in kv_transfer (%d of %d units written, %d bytes) "
                        "in %.1f ms", request.request_id, num_tokens, written, len(lease.slots.present), nbytes,
                        seconds * 1e3)

    def swap_in(self, request: Request) -> bool:
        """`request` resumes after a preemption: what the pool holds of its context past the local prefix cache
        comes back as locally cached blocks, which its admission then finds. Returns True when the admission
        should wait a step: no blocks are free to read into yet (in the zero-bubble loop the blocks a finished
        request gave up stay closed to host writes until the step in flight ends); after _MAX_WAITS such steps
        it goes on without them. Otherwise done once per preemption."""
        if request.num_spill_lookups >= request.num_preemptions:
            return False
        e, bs = self._e, self._e.config.block_size
        address = self._address(request)
        tokens = request.all_token_ids
        limit = (len(tokens) - 1) // bs  # at least one token is computed: its step samples the next
        need = None
        if address is not None and limit > 0:
            # a stand-in with the request's tokens owns the blocks being read until they are cached
            holder = Request(f"swap-in:{request.request_id}", list(tokens), request.params,
                             eos_token_ids=request.eos_token_ids, media=request.media)
            try:
                need = self._swap_in(request, holder, address, limit)
            finally:
                e.kv.free(holder)  # what it holds, and what its lookup noted for its allocation
        if need is not None:
            # no room (in the full layers' pool, or in a sliding group's when the step in flight holds no frees)
            # even for its admission, which would wait anyway: not a wait of ours. Only blocks a step in flight
            # keeps from host writes make it one, and those open when the step ends
            if e.pool.num_free_blocks < need or not e.pool.holding_frees:
                return True
            if request.num_spill_waits < _MAX_WAITS:
                request.num_spill_waits += 1
                return True
        request.num_spill_lookups, request.num_spill_waits = request.num_preemptions, 0
        return False

    def _swap_in(self, request: Request, holder: Request, address: str, limit: int) -> int | None:
        """None when it is over either way; the blocks it needs when they were not free to read into."""
        e, bs = self._e, self._e.config.block_size
        local = e.kv.find_cached_prefix(holder)
        if len(local) >= limit or not e.pool.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return None  # (prompt logprobs: the admission computes every prompt position anyway)
        if e.pool.num_free_for(host_writes=True) < limit - len(local):
            return limit - len(local)  # no room to read it all into: before asking kv_transfer anything
        num_tokens = limit * bs
        started = time.perf_counter()
        lease = self._reserve(request, address, num_tokens, "swap_in")
        if lease is None:
            return None
        try:
            num_pool = usable_pool_prefix(e.layout, lease.slots.present, num_tokens, limit)
            if num_pool <= len(local):
                return None
            if not self._read_back(request, holder, local, num_pool, lease, num_tokens, started):
                return num_pool - len(local)
            return None
        finally:
            self._release(address, lease, failed=False)

    def _read_back(self, request: Request, holder: Request, local: list[int], num_pool: int, lease: _Lease,
                   num_tokens: int, started: float) -> bool:
        """False when the blocks to read into could not be had; True when the read is over, done or failed."""
        e, bs = self._e, self._e.config.block_size
        if not e.kv.allocate_slots(holder, num_pool * bs, local, host_writes=True):
            return False  # (a sliding group's pool, when there are several): try again
        error: str | None = None
        nbytes = 0
        try:
            source = PullSource(e.layout, lease.slots, num_pool * bs, handoff_tokens=num_tokens)
            self._puller.start(holder.request_id, lease.agent, source, e.kv.tables(holder.request_id), len(local) * bs)
            outcome = self._wait(self._puller.poll, self._puller.abort, holder.request_id)
            error, nbytes = outcome.error, outcome.nbytes
            if error is None:
                holder.num_computed_tokens = num_pool * bs
                e.kv.cache_full_blocks(holder)
        except BatonError as err:
            error = str(err)
        finally:
            self._puller.abort(holder.request_id)  # no read may land in a block once it is freed
        seconds = time.perf_counter() - started
        self._stats.observe("swap_in", seconds, nbytes, failed=error is not None)
        if error is not None:
            logger.warning("request %s: reading its parked KV back failed (recomputing it): %s", request.request_id,
                           error)
            return True
        self.swapped_in_blocks += num_pool - len(local)
        self.recent_swap_in_s.append(seconds)
        logger.info("request %s resumes: %d blocks read back from kv_transfer (%d bytes) in %.1f ms",
                    request.request_id, num_pool - len(local), nbytes, seconds * 1e3)
        return True

    def _address(self, request: Request) -> str | None:
        return self._calls.address_of(request.kv_home) if request.kv_home else None

    def _reserve(self, request: Request, address: str, num_tokens: int, direction: str) -> _Lease | None:
        """A lease at kv_transfer on the request's first `num_tokens` (the units its pool holds come back present);
        None when the Reserve failed (logged, and counted against `direction`)."""
        handoff_id = f"{direction.replace('_', '-')}-{request.request_id}-{uuid.uuid4().hex[:8]}"
        capability = secrets.token_urlsafe(16)
        spec = handoff_spec(self._e, handoff_id, request.request_id, request.all_token_ids[:num_tokens],
                            request.media, capability=capability)
        try:
            slots, agent = self._calls.reserve(address, spec)
        except BatonError as err:
            logger.warning("request %s: kv_transfer refused its %s lease: %s", request.request_id, direction, err)
            self._stats.observe(direction, 0.0, 0, failed=True)
            return None
        return _Lease(handoff_id, capability, slots, agent)

    def _release(self, address: str, lease: _Lease, failed: bool) -> None:
        try:
            self._calls.release(address, lease.handoff_id, failed, lease.capability)
        except BatonError as err:  # its lease runs out on its own
            logger.warning("releasing %s failed (its lease will expire): %s", lease.handoff_id, err)

    def _wait(self, poll: Callable[[], dict[str, OutcomeT]], abort: Callable[[str], None], job_id: str) -> OutcomeT:
        """Poll until `job_id`'s transfers are over; past the transfer timeout they are stopped and it fails."""
        deadline = time.perf_counter() + self._timeout_s
        while True:
            over = poll()
            if job_id in over:
                return over[job_id]
            if time.perf_counter() > deadline:
                abort(job_id)
                raise KVTransferError(f"{job_id}: transfers not over after {self._timeout_s:.0f} s")
            time.sleep(_POLL_S)
