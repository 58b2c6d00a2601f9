"""The prefill servicer: protobuf at the edge, the engine (prefill role) inside.

Prefill(request, handoff_id, kv_transfer_address)
  media the engine has not encoded: their encoder outputs from kv_transfer's shared cache, if it holds them
  Reserve slots in kv_transfer (full prompt blocks named by prefix hash: pool hits come back present)
  engine: the pool's prefix imported, the rest computed (batched with other prefills); each layer's
          finished blocks written into the slots as the layer completes; first token sampled; hidden
          states written
  outputs the engine encoded that kv_transfer lacked: offered to its cache (in the background)
  ├ first token ends the request (max_tokens=1, eos): release the slots, reply with finish_reason
  └ else: Commit (the handoff becomes claimable), then reply
With n > 1 choices the prompt is computed and shipped once, every choice samples its first token
here (`more_choices` carries choices 1..n-1), and the handoff is always committed: decode tells
how each choice ends.
A cancelled call (router gone) or a failed push aborts the request in the engine first, then
releases the slots, so no write of ours can land in a slot given to someone else.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from proto.baton.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from services.prefill.shared_encoder_outputs import SharedEncoderOutputs
from shared.engine.async_engine import AsyncEngine
from shared.engine.handoff_spec import handoff_spec
from shared.engine.kv_push import PushOutcome
from shared.engine.request import RequestOutput
from shared.errors import InvalidRequestError, KVTransferError
from shared.kv.remote import HandoffSpec
from shared.service.engine_host import engine_kv_summary
from shared.service.kv_client import KVTransferClient
from shared.telemetry import (
    CACHED_TOKENS,
    HANDOFF_ID,
    INPUT_TOKENS,
    KV_GBPS,
    KV_NBYTES,
    KV_NUM_BLOCKS,
    KV_SECONDS,
    OUTPUT_TOKENS,
    REQUEST_ID,
    server_span,
    tracer,
)
from shared.wire import (
    first_token_to_proto,
    load_report_to_proto,
    media_from_proto,
    sampling_params_from_proto,
    token_logprobs_to_proto,
)

logger = logging.getLogger(__name__)

SERVICE_NAME = "baton.v1.PrefillService"
_tracer = tracer(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, aengine: AsyncEngine, kv: KVTransferClient, send_hidden_states: bool = True,
                 share_encoder_outputs: bool = True) -> None:
        self.aengine = aengine
        self.kv = kv
        self.send_hidden_states = send_hidden_states
        self.encoder_outputs = SharedEncoderOutputs(aengine, kv) if share_encoder_outputs else None

    async def Prefill(  # noqa: N802 (gRPC method name)
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        attributes: dict[str, AttributeValue] = {
            REQUEST_ID: request.request.request_id, HANDOFF_ID: request.handoff_id,
            INPUT_TOKENS: len(request.request.prompt_token_ids),
        }
        with server_span(_tracer, context, "prefill.Prefill", attributes):
            return await self._prefill(request)

    def _spec(self, request: prefill_pb2.PrefillRequest) -> HandoffSpec:
        """What to reserve: a slot per prompt unit (full ones named by their prefix hash), room for hidden states."""
        engine = self.aengine.engine
        prompt = request.request.prompt_token_ids
        hidden_nbytes = (len(prompt) * engine.hidden_width * engine.layout.hidden_dtype.itemsize
                         if self.send_hidden_states else 0)
        # the media's digests join the blocks' prefix hashes
        return handoff_spec(engine, request.handoff_id, request.request.request_id, prompt,
                            media_from_proto(request.request.media), hidden_nbytes, request.handoff_capability)

    async def _prefill(self, request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
        req = request.request
        params = sampling_params_from_proto(req.params)
        if not request.handoff_id or not request.kv_transfer_address or not request.handoff_capability:
            raise InvalidRequestError("Prefill needs a handoff_id, its handoff_capability and a kv_transfer_address")
        if not req.prompt_token_ids:
            raise InvalidRequestError("empty prompt", param="prompt")
        if req.output_token_ids:  # a migrated request resumes on a decode instance, which computes its output
            raise InvalidRequestError("prefill takes no output_token_ids", param="output_token_ids")
        address = request.kv_transfer_address
        media = media_from_proto(req.media)
        to_offer = await self.encoder_outputs.fetch(address, media, req.request_id) \
            if self.encoder_outputs is not None and media else []
        slots, agent = await self.kv.reserve(address, self._spec(request))
        capability = request.handoff_capability
        renewer = asyncio.create_task(self._renew(address, request.handoff_id, capability, slots.lease_timeout_s))
        committed = False
        failed = True  # the slots' content is not to be trusted unless the first token ended the request
        try:
            finals: dict[int, RequestOutput] = {}  # by choice
            stream = await self.aengine.generate_pushed(req.request_id, list(req.prompt_token_ids), params, agent,
                                                        slots, media)
            async for out in stream:
                if out.finished:
                    finals[out.index] = out
            if to_offer and self.encoder_outputs is not None:
                self.encoder_outputs.offer(address, to_offer)
            assert len(finals) == params.n, (req.request_id, sorted(finals))
            final = finals[0]
            reply = prefill_pb2.PrefillResponse(
                handoff_id=request.handoff_id, first_token_id=final.new_token_ids[0],
                num_prompt_tokens=final.num_prompt_tokens, num_cached_tokens=final.num_cached_tokens,
                more_choices=[first_token_to_proto(finals[i].new_token_ids[0],
                                                   finals[i].new_logprobs[0] if finals[i].new_logprobs else None)
                              for i in range(1, params.n)],
            )
            if final.new_logprobs:
                reply.first_logprobs.CopyFrom(token_logprobs_to_proto(final.new_logprobs[0]))
            if final.prompt_logprobs:
                reply.prompt_logprobs.extend(token_logprobs_to_proto(lp) for lp in final.prompt_logprobs)
            span = trace.get_current_span()
            span.set_attributes({CACHED_TOKENS: final.num_cached_tokens, OUTPUT_TOKENS: 1})
            if final.finish_reason != "handoff":  # the first token ended it: nothing to hand over
                reply.finish_reason = final.finish_reason or "stop"
                failed = False
                return reply
            push = final.handoff
            assert isinstance(push, PushOutcome)
            if push.result is None:
                raise KVTransferError(f"request {req.request_id}: pushing its KV failed: {push.error}")
            await self.kv.commit(address, request.handoff_id, push.result, capability)
            committed = True
            span.set_attributes({KV_NBYTES: push.nbytes, KV_NUM_BLOCKS: len(slots.block_slots),
                                 KV_SECONDS: push.seconds, KV_GBPS: push.nbytes / max(push.seconds, 1e-9) / 1e9})
            # the pool's leading hits are blocks the push skipped; what was imported from it is in the KV stats
            logger.info("request %s: prefilled %d tokens (%d cached, %d already in the pool), handoff %s: %d bytes in "
                        "%.1f ms", req.request_id, final.num_prompt_tokens, final.num_cached_tokens,
                        slots.num_leading_hits * self.aengine.engine.config.block_size, request.handoff_id,
                        push.nbytes, push.seconds * 1000)
            return reply
        finally:
            renewer.cancel()
            if not committed:
                # stop the engine's writes before the slots can go to anyone else, even if this task is cancelled
                await self.kv.release_after_abort(lambda: self.aengine.abort(req.request_id), address,
                                                  request.handoff_id, failed, capability)

    async def _renew(self, address: str, handoff_id: str, capability: str, lease_timeout_s: float) -> None:
        """While the prompt waits and computes, keep its lease: a prefill that dies stops renewing."""
        if lease_timeout_s <= 0:
            return
        while True:
            await asyncio.sleep(max(lease_timeout_s / 3, 0.05))
            if not await self.kv.renew(address, handoff_id, capability):
                return

    async def Abort(  # noqa: N802
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        with server_span(_tracer, context, "prefill.Abort", {REQUEST_ID: request.request_id}):
            return common_pb2.AbortResponse(found=await self.aengine.abort(request.request_id))

    async def GetLoad(  # noqa: N802
        self, request: prefill_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.LoadReport:
        return load_report_to_proto(self.aengine.load, engine_kv_summary(self.aengine))
