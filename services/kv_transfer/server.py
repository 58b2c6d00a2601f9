"""The kv_transfer gRPC servicer: protobuf in and out here, the HandoffStore inside.

    GetAgent ─► the slab's agent (name, metadata, slot geometry)
    Reserve  ─► store.reserve  (slots pinned; pool hits marked present)      ─┐ prefill WRITEs the
    Renew    ─► store.renew    (prefill still queued or computing)             │ slots in between
    Commit   ─► store.commit   (claimable; new full blocks join the pool)     ─┘
    Claim    ─► store.claim    (waits for the commit; decode READs the slots after)
    Release  ─► store.release  (pulled / aborted / failed; idempotent)
    Stats    ─► occupancy
    PutEncoderOutputs / GetEncoderOutputs ─► the encoder-output cache (encoder_cache.py)

No KV byte passes through here: the data moves between the peers' transport
agents and the slab this service registered (encoder outputs, a row of the
hidden size per soft token, are the one payload that does). Errors are raised as
`BatonError`s; the interceptor maps them to gRPC status (full store ->
RESOURCE_EXHAUSTED, unknown handoff -> NOT_FOUND, bad request -> INVALID_ARGUMENT).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import replace

import grpc.aio
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from proto.baton.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from services.kv_transfer.encoder_cache import EncoderOutputCache, EncoderOutputEntry
from services.kv_transfer.store import HandoffStore, LeaseState
from shared.errors import CapacityError, HandoffNotFoundError, InvalidRequestError
from shared.kv.remote import AgentAddress, HandoffSpec, SlotSpace, slot_nbytes_for, usable_pool_prefix
from shared.registry.kv_summary import MAX_SUMMARY_BLOCKS, KVSummary, summarize
from shared.telemetry import HANDOFF_ID, KV_NUM_BLOCKS, REQUEST_ID, server_span, tracer
from shared.wire import kv_summary_to_proto
from shared.wire_encoder import check_encoder_output
from shared.wire_kv import (
    agent_to_proto,
    claimed_to_proto,
    commit_from_proto,
    reserve_from_proto,
    slots_to_proto,
)

logger = logging.getLogger(__name__)

SERVICE_NAME = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransferService"].full_name
_tracer = tracer(__name__)


class KVTransferMetrics:
    """Prometheus metrics of one kv_transfer instance, in its own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.leases_active = Gauge("baton_handoff_leases_active", "Handoffs live (writing, leased or claimed)",
                                   registry=registry)
        self.slots_pinned = Gauge("baton_kv_transfer_slots_pinned", "Slots held by live handoffs",
                                  registry=registry)
        self.slots_cached = Gauge("baton_prefix_pool_blocks", "Blocks in the prefix pool", registry=registry)
        self.capacity_bytes = Gauge("baton_kv_transfer_capacity_bytes", "Slab size", registry=registry)
        self.failures = Counter("baton_kv_transfer_failures", "Handoffs that failed, by reason", ["reason"],
                                registry=registry)
        self.leases_ended = Counter("baton_handoff_leases_ended", "Leases ended, by final state", ["state"],
                                    registry=registry)
        self.hit_tokens = Counter("baton_prefix_pool_hit_tokens", "Prompt tokens found in the prefix pool",
                                  registry=registry)
        self.reserved_tokens = Counter("baton_prefix_pool_query_tokens", "Prompt tokens of reserved handoffs",
                                       registry=registry)
        self.encoder_lookups = Counter("baton_encoder_cache_lookups", "Encoder outputs asked for, by result "
                                       "(hit, miss)", ["result"], registry=registry)
        self.encoder_bytes = Gauge("baton_encoder_cache_bytes", "Bytes of encoder outputs held", registry=registry)

    def watch(self, store: HandoffStore) -> None:
        """Read the gauges from `store` at scrape time."""
        self.leases_active.set_function(lambda: store.active_leases)
        self.slots_pinned.set_function(lambda: store.pool.num_pinned)
        self.slots_cached.set_function(lambda: store.pool.num_cached)
        self.capacity_bytes.set(store.capacity_bytes)
        self.registry.register(_RefusalsCollector(store))

    def on_lease_end(self, spec: HandoffSpec, state: LeaseState, num_slots: int) -> None:
        """HandoffStore end listener."""
        self.leases_ended.labels(state=state.value).inc()
        if state in (LeaseState.EXPIRED, LeaseState.FAILED):
            self.failures.labels(reason=state.value).inc()


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServiceServicer):
    def __init__(
        self, store: HandoffStore, metrics: KVTransferMetrics, address: AgentAddress, capacity_bytes: int,
        max_claim_wait_s: float, encoder_cache: EncoderOutputCache | None = None,
        expect_traffic: Callable[[], None] = lambda: None, used_up_to: Callable[[int], None] = lambda _: None,
    ) -> None:
        """`address`: the slab's agent; its slot size is 0 until the first Reserve cuts the slab.
        `expect_traffic`: the agent's `Transport.expect_traffic`, called before a peer moves data through
        the slab (a reserved handoff is written, a claimed one read, an agent connects).
        `used_up_to`: told the slab offset past the furthest slot each Reserve handed out (the prefaulter's)."""
        self._store = store
        self._expect_traffic = expect_traffic
        self._used_up_to = used_up_to
        self.encoder_cache = encoder_cache if encoder_cache is not None else EncoderOutputCache(0)
        metrics.encoder_bytes.set_function(lambda: self.encoder_cache.nbytes)
        self._metrics = metrics
        self._address = address
        self._capacity_bytes = capacity_bytes
        self._max_claim_wait_s = max_claim_wait_s

    async def GetAgent(  # noqa: N802 (gRPC method name)
        self, request: kv_transfer_pb2.GetAgentRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.AgentInfo:
        if request.kind and request.kind != self._address.kind:
            raise InvalidRequestError(f"this kv_transfer speaks {self._address.kind}, not {request.kind}",
                                      param="kind")
        self._expect_traffic()  # the peer connects next
        return agent_to_proto(self._address)

    async def Reserve(  # noqa: N802
        self, request: kv_transfer_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.ReserveResponse:
        attributes: dict[str, AttributeValue] = {HANDOFF_ID: request.handoff_id, REQUEST_ID: request.request_id,
                                                 KV_NUM_BLOCKS: request.num_blocks}
        with server_span(_tracer, context, "kv_transfer.Reserve", attributes):
            spec = reserve_from_proto(request)
            self._cut_slab(spec)
            try:
                slots = self._store.reserve(spec)
            except CapacityError:
                self._metrics.failures.labels(reason="capacity").inc()
                raise
            self._expect_traffic()  # prefill writes the slots next
            self._used_up_to((max(slots.block_slots + slots.hidden_slots, default=-1) + 1) * slots.space.slot_nbytes)
            num_tokens, bs = len(spec.prompt_token_ids), spec.layout.block_size
            hit_tokens = usable_pool_prefix(spec.layout, slots.present, num_tokens, num_tokens // bs) * bs
            self._metrics.hit_tokens.inc(hit_tokens)
            self._metrics.reserved_tokens.inc(len(spec.prompt_token_ids))
            trace.get_current_span().set_attribute("baton.prefix_pool.hit_tokens", hit_tokens)
            return slots_to_proto(slots, self._address)

    def _cut_slab(self, spec: HandoffSpec) -> None:
        """The first Reserve sizes the slots for its block format (unless configured)."""
        if self._store.space is not None:
            return
        space = self._address.space
        slot_nbytes = slot_nbytes_for(spec.layout)
        num_slots = self._capacity_bytes // slot_nbytes
        space = replace(space, slot_nbytes=slot_nbytes, num_slots=num_slots)
        self._store.cut_slots(space)
        self._address = replace(self._address, space=space)
        logger.info("slab cut into %d slots of %d bytes for %s", num_slots, slot_nbytes, spec.key)

    async def Renew(  # noqa: N802
        self, request: kv_transfer_pb2.RenewRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.RenewResponse:
        self._expect_traffic()  # a lease still being written
        return kv_transfer_pb2.RenewResponse(found=self._store.renew(request.handoff_id, request.capability))

    async def Commit(  # noqa: N802
        self, request: kv_transfer_pb2.CommitRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.CommitResponse:
        with server_span(_tracer, context, "kv_transfer.Commit", {HANDOFF_ID: request.handoff_id}):
            handoff_id, result = commit_from_proto(request)
            return kv_transfer_pb2.CommitResponse(nbytes=self._store.commit(handoff_id, result, request.capability))

    async def Claim(  # noqa: N802
        self, request: kv_transfer_pb2.ClaimRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.ClaimResponse:
        with server_span(_tracer, context, "kv_transfer.Claim", {HANDOFF_ID: request.handoff_id}):
            if not request.handoff_id:
                raise InvalidRequestError("Claim needs a handoff_id", param="handoff_id")
            wait_s = min(request.wait_ms / 1000, self._max_claim_wait_s)
            try:
                claimed = await self._store.claim(request.handoff_id, wait_s, request.capability)
            except HandoffNotFoundError:
                self._metrics.failures.labels(reason="claim_not_found").inc()
                raise
            self._expect_traffic()  # decode reads the slots next
            trace.get_current_span().set_attributes({REQUEST_ID: claimed.spec.request_id,
                                                     KV_NUM_BLOCKS: claimed.spec.num_blocks})
            return claimed_to_proto(claimed, self._address)

    async def Release(  # noqa: N802
        self, request: kv_transfer_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.ReleaseResponse:
        if not request.handoff_id:
            raise InvalidRequestError("Release needs a handoff_id", param="handoff_id")
        with server_span(_tracer, context, "kv_transfer.Release", {HANDOFF_ID: request.handoff_id}):
            found = self._store.release(request.handoff_id, failed=request.failed, capability=request.capability,
                                        transfers_stopped=request.transfers_stopped)
            return kv_transfer_pb2.ReleaseResponse(found=found)

    async def Stats(  # noqa: N802
        self, request: kv_transfer_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.StatsResponse:
        s = self._store.stats()
        return kv_transfer_pb2.StatsResponse(
            active_leases=s.active_leases, num_slots=s.num_slots, slots_pinned=s.slots_pinned,
            slots_cached=s.slots_cached, slot_nbytes=s.slot_nbytes, capacity_bytes=s.capacity_bytes,
            kv=kv_summary_to_proto(pool_summary(self._store)),
        )


    async def PutEncoderOutputs(  # noqa: N802
        self, request: kv_transfer_pb2.PutEncoderOutputsRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.PutEncoderOutputsResponse:
        if not request.model:
            raise InvalidRequestError("PutEncoderOutputs needs the model", param="model")
        for msg in request.outputs:
            check_encoder_output(msg)
        entries = [EncoderOutputEntry(bytes(m.content_hash), m.dtype, tuple(m.shape), bytes(m.data))
                   for m in request.outputs]
        return kv_transfer_pb2.PutEncoderOutputsResponse(num_stored=self.encoder_cache.put(request.model, entries))

    async def GetEncoderOutputs(  # noqa: N802
        self, request: kv_transfer_pb2.GetEncoderOutputsRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.GetEncoderOutputsResponse:
        found = self.encoder_cache.get(request.model, [bytes(h) for h in request.content_hashes])
        self._metrics.encoder_lookups.labels(result="hit").inc(len(found))
        self._metrics.encoder_lookups.labels(result="miss").inc(len(request.content_hashes) - len(found))
        if request.digests_only:
            return kv_transfer_pb2.GetEncoderOutputsResponse(outputs=[
                kv_transfer_pb2.EncoderOutput(content_hash=e.content_hash) for e in found])
        return kv_transfer_pb2.GetEncoderOutputsResponse(outputs=[
            kv_transfer_pb2.EncoderOutput(content_hash=e.content_hash, dtype=e.dtype, shape=list(e.shape),
                                          data=e.data) for e in found])


class _RefusalsCollector(Collector):
    def __init__(self, store: HandoffStore) -> None:
        self._store = store

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("baton_handoff_capability_refused", "Calls that named a live handoff without "
                                  "its capability (refused with PERMISSION_DENIED).",
                                  value=self._store.num_capability_refusals)


def pool_summary(store: HandoffStore) -> KVSummary:
    """The prefix pool's block hashes, for the router's prefix-hit estimate (its engines' block size and
    salt name them; the pool does not know either, so the summary leaves them unset)."""
    return summarize(store.pool.recent_hashes(MAX_SUMMARY_BLOCKS))


def slab_space(agent_name: str, base_addr: int, slot_nbytes: int, capacity_bytes: int) -> SlotSpace | None:
    """The slot geometry when it is configured; None leaves it to the first Reserve."""
    if slot_nbytes <= 0:
        return None
    return SlotSpace(agent_name, base_addr, slot_nbytes, capacity_bytes // slot_nbytes)
