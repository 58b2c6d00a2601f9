"""keepalive.py on its own: when a stream writes keepalives, and that they never interleave a write."""

from __future__ import annotations

import asyncio

from proto.baton.v1 import decode_pb2
from services.decode.keepalive import StreamKeepalive, stream_writer


class _Context:
    """The write half of a servicer context (a test double): records what went out, and fails if a
    write starts while another is in flight, as grpc.aio would."""

    def __init__(self, write_s: float = 0.0) -> None:
        self.write_s = write_s
        self.sent: list[decode_pb2.DecodeResponse] = []
        self.in_flight = False

    async def write(self, message: decode_pb2.DecodeResponse) -> None:
        assert not self.in_flight, "two writes in flight on one call"
        self.in_flight = True
        try:
            await asyncio.sleep(self.write_s)
        finally:
            self.in_flight = False
        self.sent.append(message)


def _token(t: int) -> decode_pb2.DecodeResponse:
    return decode_pb2.DecodeResponse(token_ids=[t])


def test_keepalives_go_out_only_while_the_stream_is_silent() -> None:
    async def main() -> list[str]:
        context = _Context()
        async with StreamKeepalive(context, 0.05) as stream:  # type: ignore[arg-type]
            await asyncio.sleep(0.18)  # silent: about three keepalives
            for t in range(6):  # a token every 0.02 s: none
                await stream.write(_token(t))
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # the block is over: no more keepalives
        return ["k" if m.keepalive else "t" for m in context.sent]

    kinds = asyncio.run(main())
    assert kinds[-6:] == ["t"] * 6
    assert 2 <= len(kinds) - 6 <= 4 and set(kinds[:-6]) == {"k"}


def test_a_keepalive_waits_for_a_write_in_flight() -> None:
    async def main() -> list[decode_pb2.DecodeResponse]:
        context = _Context(write_s=0.03)  # slow writes (a slow client): the keepalive's lands between
        async with StreamKeepalive(context, 0.01) as stream:  # type: ignore[arg-type]
            for t in range(5):
                await stream.write(_token(t))
                await asyncio.sleep(0.02)
        return context.sent

    sent = asyncio.run(main())
    assert [m.token_ids[0] for m in sent if not m.keepalive] == [0, 1, 2, 3, 4]
    assert any(m.keepalive for m in sent)


def test_no_keepalive_asked_for_writes_straight_to_the_call() -> None:
    async def main() -> list[decode_pb2.DecodeResponse]:
        context = _Context()
        async with stream_writer(context, 0) as write:  # type: ignore[arg-type]
            assert write == context.write
            await write(_token(1))
            await asyncio.sleep(0.05)
        return context.sent

    assert [m.keepalive for m in asyncio.run(main())] == [False]
