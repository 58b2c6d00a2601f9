"""Keepalives on a real decode's Generate stream (the packaged SmolLM2 over gRPC): they come while the
stream has nothing to send, never change its tokens, and a stream that asked for none gets none."""

from __future__ import annotations

import grpc
import pytest

from proto.baton.v1 import common_pb2, decode_pb2
from shared.engine.request import SamplingParams
from shared.tokenizer import encode_prompt
from shared.wire import sampling_params_to_proto
from tests.helpers.models import packaged
from tests.integration.services.test_disagg_grpc import CAPABILITY, MODEL, Stack, run

pytestmark = pytest.mark.slow


def test_a_stream_waiting_for_its_handoff_sends_keepalives_until_its_error() -> None:
    async def body(stack: Stack) -> list[decode_pb2.DecodeResponse]:
        req = common_pb2.GenerateRequest(request_id="waits", prompt_token_ids=[1, 2],
                                         params=sampling_params_to_proto(SamplingParams(max_tokens=4)))
        got: list[decode_pb2.DecodeResponse] = []
        with pytest.raises(grpc.aio.AioRpcError) as e:  # the claim waits kv_claim_wait_s (0.5 s) in vain
            async for msg in stack.decode_stub.Generate(decode_pb2.DecodeRequest(
                    request=req, handoff_id="never-stored", kv_transfer_address=stack.kv.address,
                    handoff_capability=CAPABILITY, first_token_id=5, keepalive_s=0.1)):
                got.append(msg)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert stack.engines_idle()
        return got

    got = run(body)
    assert len(got) >= 2 and all(m.keepalive and not m.token_ids and not m.finished for m in got)


def test_keepalives_leave_a_streams_tokens_as_they_were() -> None:
    prompt = encode_prompt(packaged(MODEL).tokenizer, "Name three colors.", chat=True)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def body(stack: Stack) -> tuple[list[int], list[int]]:
        req, handoff_id, first = await stack.prefill_only(prompt, params)
        plain = [m async for m in stack.decode_stream(req, handoff_id, first.first_token_id)]
        req2, handoff_id, first = await stack.prefill_only(prompt, params)
        kept = [m async for m in stack.decode_stub.Generate(decode_pb2.DecodeRequest(
            request=req2, handoff_id=handoff_id, kv_transfer_address=stack.kv.address,
            handoff_capability=CAPABILITY, first_token_id=first.first_token_id, keepalive_s=0.001))]
        assert not any(m.keepalive for m in plain)
        assert all(not m.token_ids and not m.finished for m in kept if m.keepalive)
        return [t for m in plain for t in m.token_ids], [t for m in kept for t in m.token_ids]

    plain, kept = run(body)
    assert kept == plain and len(plain) == 23
