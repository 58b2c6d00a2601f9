"""The kv_transfer gRPC servicer: protobuf in and out here, the HandoffStore inside.

    Put    (stream HandoffChunk) ─► begin_put / add_part ... / commit   (abort_put if the stream breaks)
    Claim  (handoff_id, wait_ms) ─► claim ─► stream HandoffChunk back
    Release(handoff_id)          ─► release (idempotent)
    Stats                        ─► store occupancy

Errors are raised as `BatonError`s; the interceptor from `shared.grpc_common`
maps them to gRPC status (full store -> RESOURCE_EXHAUSTED, unknown handoff ->
NOT_FOUND, bad stream -> INVALID_ARGUMENT).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

import grpc.aio
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge

from proto.baton.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from services.kv_transfer.store import HandoffStore, LeaseState
from shared.errors import CapacityError, HandoffNotFoundError, InvalidRequestError
from shared.handoff_stream import HandoffInfo
from shared.telemetry import HANDOFF_ID, KV_NBYTES, KV_NUM_BLOCKS, REQUEST_ID, server_span, tracer
from shared.wire import part_from_chunk, payload_chunks

logger = logging.getLogger(__name__)

SERVICE_NAME = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransferService"].full_name
_tracer = tracer(__name__)


class KVTransferMetrics:
    """Prometheus metrics of one kv_transfer instance, in its own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.leases_active = Gauge(
            "baton_handoff_leases_active",
            "Handoffs held (receiving or leased), not yet released",
            registry=registry,
        )
        self.bytes_held = Gauge(
            "baton_kv_transfer_bytes_held", "Bytes reserved by live handoffs", registry=registry
        )
        self.capacity_bytes = Gauge("baton_kv_transfer_capacity_bytes", "Store capacity", registry=registry)
        self.transfer_bytes = Counter(
            "baton_kv_transfer_bytes", "KV and hidden-state bytes moved", ["direction"], registry=registry
        )
        self.failures = Counter(
            "baton_kv_transfer_failures", "Handoffs that failed, by reason", ["reason"], registry=registry
        )
        self.leases_ended = Counter(
            "baton_handoff_leases_ended", "Leases ended, by final state", ["state"], registry=registry
        )

    def watch(self, store: HandoffStore) -> None:
        """Read the gauges from `store` at scrape time."""
        self.leases_active.set_function(lambda: store.active_leases)
        self.bytes_held.set_function(lambda: store.bytes_held)
        self.capacity_bytes.set(store.capacity_bytes)

    def on_lease_end(self, info: HandoffInfo, state: LeaseState, nbytes: int) -> None:
        """HandoffStore end listener."""
        self.leases_ended.labels(state=state.value).inc()
        if state is LeaseState.EXPIRED:
            self.failures.labels(reason="expired").inc()
        elif state is LeaseState.FAILED:
            self.failures.labels(reason="put_failed").inc()


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServiceServicer):
    def __init__(self, store: HandoffStore, metrics: KVTransferMetrics, max_claim_wait_s: float) -> None:
        self._store = store
        self._metrics = metrics
        self._max_claim_wait_s = max_claim_wait_s

    async def Put(
        self,
        request_iterator: AsyncIterator[kv_transfer_pb2.HandoffChunk],
        context: grpc.aio.ServicerContext,
    ) -> kv_transfer_pb2.PutResponse:
        with server_span(_tracer, context, "kv_transfer.Put"):
            return await self._put(request_iterator)

    async def _put(
        self, request_iterator: AsyncIterator[kv_transfer_pb2.HandoffChunk]
    ) -> kv_transfer_pb2.PutResponse:
        handoff_id: str | None = None
        committed = False
        received = self._metrics.transfer_bytes.labels(direction="received")
        try:
            async for chunk in request_iterator:
                part = part_from_chunk(chunk)
                if isinstance(part, HandoffInfo):
                    if handoff_id is not None:
                        raise InvalidRequestError(f"handoff {handoff_id}: a second header in one Put")
                    try:
                        self._begin_put(part)
                    except CapacityError:
                        # read the rest before refusing: a client still writing when the call ends
                        # sees gRPC core's opaque INTERNAL instead of RESOURCE_EXHAUSTED
                        async for _ in request_iterator:
                            pass
                        raise
                    handoff_id = part.handoff_id
                    trace.get_current_span().set_attributes(_span_attributes(part))
                elif handoff_id is None:
                    raise InvalidRequestError("a Put stream must start with its header")
                else:
                    self._store.add_part(handoff_id, part)
                    received.inc(len(part.data))
            if handoff_id is None:
                raise InvalidRequestError("empty Put stream")
            nbytes = self._store.commit(handoff_id)
            committed = True
            trace.get_current_span().set_attribute(KV_NBYTES, nbytes)
        finally:
            # a broken stream (client cancelled, bad data, deadline) frees what it reserved
            if handoff_id is not None and not committed and self._store.abort_put(handoff_id):
                logger.warning("handoff %s: Put did not complete, freed", handoff_id)
        return kv_transfer_pb2.PutResponse(handoff_id=handoff_id, nbytes=nbytes)

    def _begin_put(self, info: HandoffInfo) -> None:
        try:
            self._store.begin_put(info)
        except CapacityError:
            self._metrics.failures.labels(reason="capacity").inc()
            raise

    async def Claim(
        self, request: kv_transfer_pb2.ClaimRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kv_transfer_pb2.HandoffChunk]:
        with server_span(_tracer, context, "kv_transfer.Claim", {HANDOFF_ID: request.handoff_id}):
            async with aclosing(self._claim(request)) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def _claim(
        self, request: kv_transfer_pb2.ClaimRequest
    ) -> AsyncGenerator[kv_transfer_pb2.HandoffChunk, None]:
        if not request.handoff_id:
            raise InvalidRequestError("Claim needs a handoff_id", param="handoff_id")
        wait_s = min(request.wait_ms / 1000, self._max_claim_wait_s)
        try:
            payload = await self._store.claim(request.handoff_id, wait_s)
        except HandoffNotFoundError:
            self._metrics.failures.labels(reason="claim_not_found").inc()
            raise
        trace.get_current_span().set_attributes({**_span_attributes(payload.info),
                                                 KV_NBYTES: payload.info.total_nbytes})
        # The lease ended at claim (bytes freed in the store); the payload lives until streamed.
        sent = self._metrics.transfer_bytes.labels(direction="sent")
        for chunk in payload_chunks(payload):
            yield chunk
            kind = chunk.WhichOneof("kind")
            if kind == "kv":
                sent.inc(len(chunk.kv.data))
            elif kind == "hidden":
                sent.inc(len(chunk.hidden.data))

    async def Release(
        self, request: kv_transfer_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.ReleaseResponse:
        if not request.handoff_id:
            raise InvalidRequestError("Release needs a handoff_id", param="handoff_id")
        with server_span(_tracer, context, "kv_transfer.Release", {HANDOFF_ID: request.handoff_id}):
            return kv_transfer_pb2.ReleaseResponse(found=self._store.release(request.handoff_id))

    async def Stats(
        self, request: kv_transfer_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.StatsResponse:
        stats = self._store.stats()
        return kv_transfer_pb2.StatsResponse(
            active_leases=stats.active_leases,
            bytes_held=stats.bytes_held,
            capacity_bytes=stats.capacity_bytes,
        )


def _span_attributes(info: HandoffInfo) -> dict[str, str | int]:
    return {HANDOFF_ID: info.handoff_id, REQUEST_ID: info.request_id, KV_NUM_BLOCKS: info.layout.num_blocks}
