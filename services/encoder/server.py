"""The encoder servicer: a request's media to encoder outputs in kv_transfer's cache.

Encode(items, kv_transfer_address)
  kv_transfer holds an item's output (GetEncoderOutputs, digests only) ─► found, nothing to do
  this process's cache holds it                            ─► found, stored in kv_transfer again
  else: decoded and cut (a thread; bad media: INVALID_ARGUMENT), then encoded in the batcher's next pass
  outputs not held there ──PutEncoderOutputs──► kv_transfer; reply with the counts
The same item in two calls at once may be encoded twice (each call checks the caches before it queues):
wasted work, never a wrong output.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proto.baton.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc
from services.encoder.batcher import EncodeBatcher
from shared.errors import InvalidRequestError
from shared.multimodal.encoder import MediaEncoder
from shared.multimodal.items import MediaItem
from shared.service.kv_client import KVTransferClient
from shared.telemetry import REQUEST_ID, server_span, tracer
from shared.wire import media_from_proto

logger = logging.getLogger(__name__)

SERVICE_NAME = encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name
_tracer = tracer(__name__)


class EncoderMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.items = Counter("baton_encoder_items", "Media items asked for, by how they were served "
                             "(encoded, found)", ["result"], registry=registry)
        self.batch_items = Histogram("baton_encoder_batch_items", "Items per tower pass",
                                     buckets=(1, 2, 4, 8, 16, 32, 64), registry=registry)
        self.batch_seconds = Histogram("baton_encoder_batch_seconds", "Time of one tower pass",
                                       buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
                                       registry=registry)

    def watch(self, batcher: EncodeBatcher) -> None:
        """The queue gauge (the encoder HPA's signal), read at scrape time."""
        Gauge("baton_encoder_items_queued", "Media items waiting for a tower pass or in one",
              registry=self.registry).set_function(lambda: batcher.num_queued)

    def on_batch(self, num_items: int, seconds: float) -> None:
        self.batch_items.observe(num_items)
        self.batch_seconds.observe(seconds)


class EncoderServicer(encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self, encoder: MediaEncoder, batcher: EncodeBatcher, kv: KVTransferClient, model_key: str,
                 metrics: EncoderMetrics) -> None:
        """`model_key`: whose outputs these are in kv_transfer's cache (what the model's prefills ask for)."""
        self.encoder = encoder
        self.batcher = batcher
        self.kv = kv
        self.model_key = model_key
        self.metrics = metrics

    async def Encode(  # noqa: N802 (gRPC method name)
        self, request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EncodeResponse:
        with server_span(_tracer, context, "encoder.Encode", {REQUEST_ID: request.request_id}):
            if not request.kv_transfer_address:
                raise InvalidRequestError("Encode needs a kv_transfer_address", param="kv_transfer_address")
            items = list({m.content_hash: m for m in media_from_proto(request.media)}.values())
            held = await self.kv.held_encoder_outputs(request.kv_transfer_address, self.model_key,
                                                      [m.content_hash for m in items])
            todo = [m for m in items if m.content_hash not in held]
            outputs, num_encoded = await self._outputs(todo)
            stored = await self.kv.put_encoder_outputs(request.kv_transfer_address, self.model_key, outputs) \
                if outputs else 0
            self.metrics.items.labels(result="encoded").inc(num_encoded)
            self.metrics.items.labels(result="found").inc(len(items) - num_encoded)
            logger.info("request %s: %d media items, %d encoded, %d stored in kv_transfer", request.request_id,
                        len(items), num_encoded, stored)
            return encoder_pb2.EncodeResponse(num_encoded=num_encoded, num_found=len(items) - num_encoded,
                                              num_stored=stored)

    async def GetLoad(  # noqa: N802
        self, request: encoder_pb2.EncoderLoadRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.LoadReport:
        return common_pb2.LoadReport(num_running=self.batcher.num_queued)

    async def _outputs(self, items: list[MediaItem]) -> tuple[dict[bytes, torch.Tensor], int]:
        """(each item's output, how many of them were encoded now): this process's cache, else the towers."""
        ready = await asyncio.to_thread(lambda: [self.encoder.prepare(m) for m in items])
        outputs = {m.content_hash: r for m, r in zip(items, ready, strict=True) if isinstance(r, torch.Tensor)}
        prepared = [r for r in ready if not isinstance(r, torch.Tensor)]
        if prepared:
            encoded = await self.batcher.encode(prepared)
            outputs.update((p.item.content_hash, e) for p, e in zip(prepared, encoded, strict=True))
        return outputs, len(prepared)
