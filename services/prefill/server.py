"""The prefill servicer: protobuf at the edge, the engine (prefill role) inside.

Prefill(request, handoff_id)
  engine: prompt computed (batched with other prefills), first token sampled
  ├ first token ends the request (max_tokens=1, eos): reply with finish_reason, no handoff
  └ else: KV + hidden states Put to kv_transfer under handoff_id, then reply
A cancelled call (router gone) aborts the request in the engine.
"""

from __future__ import annotations

import logging

import grpc
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from proto.baton.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from shared.engine.async_engine import AsyncEngine
from shared.engine.request import RequestOutput
from shared.errors import InvalidRequestError
from shared.service.kv_client import KVTransferClient
from shared.telemetry import (
    CACHED_TOKENS,
    HANDOFF_ID,
    INPUT_TOKENS,
    KV_NBYTES,
    KV_NUM_BLOCKS,
    OUTPUT_TOKENS,
    REQUEST_ID,
    server_span,
    tracer,
)
from shared.wire import load_report_to_proto, sampling_params_from_proto, token_logprobs_to_proto

logger = logging.getLogger(__name__)

SERVICE_NAME = "baton.v1.PrefillService"
_tracer = tracer(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, aengine: AsyncEngine, kv: KVTransferClient, model: str, push_timeout_s: float) -> None:
        self.aengine = aengine
        self.kv = kv
        self.model = model
        self.push_timeout_s = push_timeout_s

    async def Prefill(  # noqa: N802 (gRPC method name)
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        attributes: dict[str, AttributeValue] = {
            REQUEST_ID: request.request.request_id, HANDOFF_ID: request.handoff_id,
            INPUT_TOKENS: len(request.request.prompt_token_ids),
        }
        with server_span(_tracer, context, "prefill.Prefill", attributes):
            return await self._prefill(request)

    async def _prefill(self, request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
        req = request.request
        params = sampling_params_from_proto(req.params)
        if not request.handoff_id or not request.kv_transfer_address:
            raise InvalidRequestError("Prefill needs a handoff_id and a kv_transfer_address")
        final: RequestOutput | None = None
        async for out in await self.aengine.generate(req.request_id, list(req.prompt_token_ids), params):
            final = out
        assert final is not None and final.finished
        reply = prefill_pb2.PrefillResponse(
            handoff_id=request.handoff_id, first_token_id=final.new_token_ids[0],
            num_prompt_tokens=final.num_prompt_tokens, num_cached_tokens=final.num_cached_tokens,
        )
        if final.new_logprobs:
            reply.first_logprobs.CopyFrom(token_logprobs_to_proto(final.new_logprobs[0]))
        span = trace.get_current_span()
        span.set_attributes({CACHED_TOKENS: final.num_cached_tokens, OUTPUT_TOKENS: 1})
        if final.finish_reason != "handoff":
            reply.finish_reason = final.finish_reason or "stop"
            return reply
        nbytes = await self.kv.put(
            request.kv_transfer_address, final.handoff, handoff_id=request.handoff_id,  # type: ignore[arg-type]
            request_id=req.request_id, model=self.model, timeout_s=self.push_timeout_s,
        )
        num_blocks = final.handoff.num_blocks  # type: ignore[attr-defined]
        span.set_attributes({KV_NBYTES: nbytes, KV_NUM_BLOCKS: num_blocks})
        logger.info("request %s: prefilled %d tokens (%d cached), handoff %s (%d bytes)", req.request_id,
                    final.num_prompt_tokens, final.num_cached_tokens, request.handoff_id, nbytes)
        return reply

    async def Abort(  # noqa: N802
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        with server_span(_tracer, context, "prefill.Abort", {REQUEST_ID: request.request_id}):
            return common_pb2.AbortResponse(found=await self.aengine.abort(request.request_id))

    async def GetLoad(  # noqa: N802
        self, request: prefill_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.LoadReport:
        return load_report_to_proto(self.aengine.load)
