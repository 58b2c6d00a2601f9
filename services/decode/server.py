"""The decode servicer: protobuf at the edge, the engine (decode role) inside.

Generate(request, handoff_id, first_token) — server streaming
  ├ handoff_id set: Claim the KV from kv_transfer (lease ends with the claim),
  │   check it was made by the same model with the same layout, admit it
  └ handoff_id empty (colocated role): compute the prompt here
  then stream DecodeResponse batches until one has finished = true.
The client cancelling the stream aborts the request; its blocks are freed once.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

import grpc
from opentelemetry import trace

from proto.baton.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from shared.engine.async_engine import AsyncEngine
from shared.engine.handoff import KVHandoff
from shared.engine.request import RequestOutput
from shared.errors import InvalidRequestError
from shared.handoff_stream import HandoffInfo
from shared.service.kv_client import KVTransferClient
from shared.telemetry import (
    HANDOFF_ID,
    KV_NBYTES,
    KV_NUM_BLOCKS,
    OUTPUT_TOKENS,
    REQUEST_ID,
    server_span,
    tracer,
)
from shared.wire import load_report_to_proto, sampling_params_from_proto, token_logprobs_to_proto

logger = logging.getLogger(__name__)

SERVICE_NAME = "baton.v1.DecodeService"
_tracer = tracer(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(
        self, aengine: AsyncEngine, kv: KVTransferClient, model: str, claim_wait_s: float, claim_timeout_s: float
    ) -> None:
        self.aengine = aengine
        self.kv = kv
        self.model = model
        self.claim_wait_s = claim_wait_s
        self.claim_timeout_s = claim_timeout_s

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        attributes = {REQUEST_ID: request.request.request_id, HANDOFF_ID: request.handoff_id}
        with server_span(_tracer, context, "decode.Generate", attributes) as span:
            num_tokens = 0
            try:
                async with aclosing(self._generate(request)) as responses:
                    async for response in responses:
                        num_tokens += len(response.token_ids)
                        yield response
            finally:  # a cancelled stream reports what it sent too
                span.set_attribute(OUTPUT_TOKENS, num_tokens)

    async def _generate(
        self, request: decode_pb2.DecodeRequest
    ) -> AsyncGenerator[decode_pb2.DecodeResponse, None]:
        req = request.request
        params = sampling_params_from_proto(req.params)
        if request.handoff_id:
            handoff = await self._claim(request)
            stream = await self.aengine.generate_from_handoff(req.request_id, params, handoff)
        else:
            if self.aengine.engine.config.role != "colocated":
                raise InvalidRequestError("this decode instance needs a handoff_id (it does not prefill)")
            stream = await self.aengine.generate(req.request_id, list(req.prompt_token_ids), params)
        async for out in stream:
            yield _response(out)

    async def _claim(self, request: decode_pb2.DecodeRequest) -> KVHandoff:
        info, handoff = await self.kv.claim(
            request.kv_transfer_address, request.handoff_id, wait_s=self.claim_wait_s,
            timeout_s=self.claim_timeout_s,
        )
        self._check_compatible(info, request.request)
        trace.get_current_span().set_attributes({KV_NBYTES: handoff.nbytes,
                                                 KV_NUM_BLOCKS: handoff.num_blocks})
        logger.info("request %s: claimed handoff %s (%d blocks, %d prompt tokens)", request.request.request_id,
                    request.handoff_id, handoff.num_blocks, len(handoff.prompt_token_ids))
        return handoff

    def _check_compatible(self, info: HandoffInfo, req: object) -> None:
        engine = self.aengine.engine
        mine, theirs = engine.layout, info.layout
        problems = []
        if info.model != self.model:
            problems.append(f"model {info.model} != {self.model}")
        for field in ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size"):
            if getattr(mine, field) != getattr(theirs, field):
                problems.append(f"{field} {getattr(theirs, field)} != {getattr(mine, field)}")
        if problems:
            raise InvalidRequestError(f"handoff {info.handoff_id} does not fit this decode engine: "
                                      + "; ".join(problems))

    async def Abort(  # noqa: N802
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        with server_span(_tracer, context, "decode.Abort", {REQUEST_ID: request.request_id}):
            return common_pb2.AbortResponse(found=await self.aengine.abort(request.request_id))

    async def GetLoad(  # noqa: N802
        self, request: decode_pb2.DecodeLoadRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.LoadReport:
        return load_report_to_proto(self.aengine.load)


def _response(out: RequestOutput) -> decode_pb2.DecodeResponse:
    return decode_pb2.DecodeResponse(
        token_ids=out.new_token_ids, logprobs=[token_logprobs_to_proto(lp) for lp in out.new_logprobs],
        finished=out.finished, finish_reason=out.finish_reason or "", num_cached_tokens=out.num_cached_tokens,
    )


__all__ = ["SERVICE_NAME", "DecodeServicer"]
