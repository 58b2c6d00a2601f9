"""migration.py on its own: the stall rule of read_stream, and what a resumed message carries."""

from __future__ import annotations

import asyncio

import grpc.aio
import pytest

from proto.baton.v1 import common_pb2, decode_pb2
from services.router.migration import DecodeStalledError, keepalive_s, read_stream, resumed_message


class _Call:
    """A stream call whose messages arrive after the given delays (a test double of grpc.aio's call); the
    messages at the indices in `keepalives` are keepalives."""

    def __init__(self, delays_s: list[float], keepalives: frozenset[int] = frozenset()) -> None:
        self.delays_s = list(delays_s)
        self.keepalives = keepalives
        self.num_read = 0
        self.cancelled = False

    async def read(self) -> object:
        if not self.delays_s:
            return grpc.aio.EOF
        await asyncio.sleep(self.delays_s.pop(0))
        self.num_read += 1
        if self.num_read - 1 in self.keepalives:
            return decode_pb2.DecodeResponse(keepalive=True)
        return decode_pb2.DecodeResponse(token_ids=[1])

    def cancel(self) -> bool:
        self.cancelled = True
        return True


async def _drain(call: _Call, stall_timeout_s: float, keepalive: bool = False) -> int:
    return len([m async for m in read_stream(call, stall_timeout_s, keepalive)])  # type: ignore[arg-type]


def test_a_slow_first_message_is_not_a_stall_but_a_silence_after_one_is() -> None:
    assert asyncio.run(_drain(_Call([0.3, 0.01, 0.01]), stall_timeout_s=0.1)) == 3
    call = _Call([0.0, 0.3])
    with pytest.raises(DecodeStalledError, match="silent"):
        asyncio.run(_drain(call, stall_timeout_s=0.1))
    assert call.cancelled
    assert asyncio.run(_drain(_Call([0.0, 0.3]), stall_timeout_s=0)) == 2  # 0: no stall rule


def test_with_keepalives_a_silent_first_message_is_a_stall_and_keepalives_are_not_passed_on() -> None:
    call = _Call([0.3, 0.01])
    with pytest.raises(DecodeStalledError, match="silent"):
        asyncio.run(_drain(call, stall_timeout_s=0.1, keepalive=True))
    assert call.cancelled and call.num_read == 0
    # keepalives every 0.06 s hold off the stall before the first token and between tokens, and only
    # the three token messages come out
    call = _Call([0.06] * 8, keepalives=frozenset({0, 1, 2, 4, 5, 6}))
    assert asyncio.run(_drain(call, stall_timeout_s=0.1, keepalive=True)) == 2
    call = _Call([0.06, 0.06, 0.0, 0.06], keepalives=frozenset({0, 1}))
    assert asyncio.run(_drain(call, stall_timeout_s=0.1, keepalive=True)) == 2


def test_a_router_call_asks_for_keepalives_within_its_stall_timeout_and_a_migration_keeps_asking() -> None:
    assert 0 < keepalive_s(3.0) < 3.0 and keepalive_s(0) == 0
    message = decode_pb2.DecodeRequest(request=common_pb2.GenerateRequest(request_id="r"), keepalive_s=1.0)
    assert resumed_message(message, [7], keep_prompt_logprobs=False).keepalive_s == 1.0


def test_only_the_wait_for_a_message_counts_as_silence() -> None:
    # messages that keep coming for longer than the timeout in all: no stall
    assert asyncio.run(_drain(_Call([0.0] + [0.03] * 10), stall_timeout_s=0.1)) == 11

    async def slow_consumer() -> int:  # the router busy between messages (a slow client) is not the stream
        n = 0
        async for _ in read_stream(_Call([0.0, 0.02, 0.02]), 0.1):  # type: ignore[arg-type]
            n += 1
            await asyncio.sleep(0.25)
        return n
    assert asyncio.run(slow_consumer()) == 3

    async def stalled_then_caller_goes_on() -> tuple[str, bool]:
        with pytest.raises(DecodeStalledError):
            await _drain(_Call([0.0, 0.02, 0.5]), stall_timeout_s=0.1)
        await asyncio.sleep(0.01)  # the stall's cancellation was taken back: the caller's task runs on
        task = asyncio.current_task()
        assert task is not None
        return "went on", task.cancelling() == 0
    assert asyncio.run(stalled_then_caller_goes_on()) == ("went on", True)


def test_a_cancelled_reader_stays_cancelled() -> None:
    async def main() -> None:
        reader = asyncio.ensure_future(_drain(_Call([0.0, 5.0]), stall_timeout_s=0.1))
        await asyncio.sleep(0.05)
        reader.cancel()  # the client went away before the stall: a cancellation, not a stall
        with pytest.raises(asyncio.CancelledError):
            await reader
    asyncio.run(main())


def test_a_resumed_message_drops_the_handoff_and_carries_the_streamed_tokens() -> None:
    message = decode_pb2.DecodeRequest(
        request=common_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                           params=common_pb2.SamplingParams(max_tokens=9, prompt_logprobs=2)),
        handoff_id="h", kv_transfer_address="kv:1", first_token_id=7)
    resumed = resumed_message(message, [7, 8], keep_prompt_logprobs=False)
    assert not resumed.handoff_id and not resumed.kv_transfer_address and not resumed.first_token_id
    assert list(resumed.request.output_token_ids) == [7, 8]
    assert list(resumed.request.prompt_token_ids) == [1, 2, 3] and resumed.request.params.max_tokens == 9
    assert not resumed.request.params.HasField("prompt_logprobs")
    assert resumed_message(message, [], keep_prompt_logprobs=True).request.params.prompt_logprobs == 2
    assert message.handoff_id == "h"  # the original is left as it was
