"""The decode servicer: protobuf at the edge, the engine (decode role) inside.

Generate(request, handoff_id, kv_transfer_address) — server streaming
  ├ handoff_id set: Claim it from kv_transfer (waits for prefill's Commit) and learn where its
  │   blocks are; the engine checks model and layout, reserves blocks (its own prefix-cache hits
  │   kept), READs only the missing ones (+ hidden states), then runs it; Release once pulled
  └ handoff_id empty (colocated role, or a request the router judged cheaper to prefill here than to
      hand off: short, or mostly in this instance's prefix cache): compute the prompt here
  then stream DecodeResponse batches until one has finished = true (and, with keepalive_s, a keepalive
  message whenever that long passes without one: keepalive.py).
The client cancelling the stream aborts the request (its reads stopped before the lease is
released); its blocks are freed once.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing

import grpc
from opentelemetry import trace

from proto.baton.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.decode.keepalive import stream_writer
from shared.engine.async_engine import AsyncEngine
from shared.engine.request import RequestOutput
from shared.errors import InvalidRequestError
from shared.kv.remote import AgentAddress, ClaimedHandoff
from shared.service.engine_host import engine_kv_summary
from shared.service.kv_calls import EngineKVCalls
from shared.service.kv_client import KVTransferClient
from shared.telemetry import (
    HANDOFF_ID,
    KV_NUM_BLOCKS,
    OUTPUT_TOKENS,
    REQUEST_ID,
    server_span,
    tracer,
)
from shared.wire import (
    first_token_from_proto,
    load_report_to_proto,
    media_from_proto,
    sampling_params_from_proto,
    token_logprobs_to_proto,
)

logger = logging.getLogger(__name__)

SERVICE_NAME = "baton.v1.DecodeService"
_CLAIM_RPC_SLACK_S = 5.0  # a Claim's deadline: its wait plus this
_tracer = tracer(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, aengine: AsyncEngine, kv: KVTransferClient, claim_wait_s: float,
                 spill_calls: EngineKVCalls | None = None) -> None:
        self.aengine = aengine
        self.kv = kv
        self.claim_wait_s = claim_wait_s
        self.spill_calls = spill_calls  # preempted contexts parked in kv_transfer: it learns where each agent is

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Streams with `context.write` from a coroutine, not as an async generator: a generator that a
        cancelled call leaves suspended (the router closes the call once the last token is in) is closed
        later by the event loop's finalizer in another context, where the span's context cannot be
        detached (an ERROR traceback from opentelemetry for a request that went well)."""
        attributes = {REQUEST_ID: request.request.request_id, HANDOFF_ID: request.handoff_id}
        with server_span(_tracer, context, "decode.Generate", attributes) as span:
            num_tokens = 0
            try:
                async with aclosing(self._generate(request)) as responses, \
                        stream_writer(context, request.keepalive_s) as write:
                    async for response in responses:
                        num_tokens += len(response.token_ids)
                        await write(response)
            finally:  # a cancelled stream reports what it sent too
                span.set_attribute(OUTPUT_TOKENS, num_tokens)

    async def _generate(
        self, request: decode_pb2.DecodeRequest
    ) -> AsyncGenerator[decode_pb2.DecodeResponse, None]:
        req = request.request
        params = sampling_params_from_proto(req.params)
        if not request.handoff_id:  # colocated role, the router chose to prefill here (no handoff pays), or
            # a request migrated from a decode that died (its streamed tokens come as output_token_ids)
            async for out in await self.aengine.generate(req.request_id, list(req.prompt_token_ids), params,
                                                         list(req.output_token_ids), media_from_proto(req.media)):
                yield _response(out)
            return
        if req.output_token_ids:
            raise InvalidRequestError("output_token_ids (a resumed request) come without a handoff: the "
                                      "instance computes them with the prompt", param="output_token_ids")
        address = request.kv_transfer_address
        claimed, agent = await self._claim(request)
        released = False
        try:
            more = [first_token_from_proto(m) for m in request.more_choices]
            stream = await self.aengine.generate_pulled(req.request_id, params, claimed, agent, more,
                                                        media_from_proto(req.media))
            async for out in stream:
                # the first tokens come after the pull is over: the slots can go (an output without tokens
                # may come before it: a choice of n > 1 that its first token from prefill ended)
                if not released and out.new_token_ids:
                    released = True
                    await self.kv.release(address, request.handoff_id, capability=request.handoff_capability,
                                          transfers_stopped=True)
                yield _response(out)
        finally:
            if not released:
                # stop our reads before the slots can go to anyone else, even if this task is cancelled
                await self.kv.release_after_abort(lambda: self.aengine.abort(req.request_id), address,
                                                  request.handoff_id, capability=request.handoff_capability)

    async def _claim(self, request: decode_pb2.DecodeRequest) -> tuple[ClaimedHandoff, AgentAddress]:
        claimed, agent = await self.kv.claim(
            request.kv_transfer_address, request.handoff_id, wait_s=self.claim_wait_s,
            timeout_s=self.claim_wait_s + _CLAIM_RPC_SLACK_S, capability=request.handoff_capability,
        )
        if self.spill_calls is not None:
            self.spill_calls.learn(agent, request.kv_transfer_address)
        spec = claimed.spec
        trace.get_current_span().set_attributes({KV_NUM_BLOCKS: spec.num_blocks})
        logger.info("request %s: claimed handoff %s (%d blocks of %d tokens, %d prompt tokens)",
                    request.request.request_id, request.handoff_id, spec.num_blocks, spec.layout.block_size,
                    len(spec.prompt_token_ids))
        return claimed, agent

    async def Abort(  # noqa: N802
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        with server_span(_tracer, context, "decode.Abort", {REQUEST_ID: request.request_id}):
            return common_pb2.AbortResponse(found=await self.aengine.abort(request.request_id))

    async def GetLoad(  # noqa: N802
        self, request: decode_pb2.DecodeLoadRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.LoadReport:
        return load_report_to_proto(self.aengine.load, engine_kv_summary(self.aengine))


def _response(out: RequestOutput) -> decode_pb2.DecodeResponse:
    return decode_pb2.DecodeResponse(
        token_ids=out.new_token_ids, logprobs=[token_logprobs_to_proto(lp) for lp in out.new_logprobs],
        finished=out.finished, finish_reason=out.finish_reason or "", num_cached_tokens=out.num_cached_tokens,
        index=out.index,
        prompt_logprobs=[token_logprobs_to_proto(lp) for lp in out.prompt_logprobs or ()],
    )


__all__ = ["SERVICE_NAME", "DecodeServicer"]
