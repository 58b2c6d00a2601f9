"""A channel to a service that went away reaches it again within a second or so of its restart on the same
address (RECONNECT_OPTIONS in shared/grpc_common.py), however long it was away.

With gRPC's default backoff (1 s growing 1.6x to 120 s) a channel whose peer was gone for 10 s next tries
to connect about 6 s later, and every call until then fails at once: a router would count a supervisor's
restarted decode as failed and send its requests elsewhere, or nowhere."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.grpc_common import channel, make_server

DOWN_S = 10.0  # long enough for the default backoff to reach about 6 s
REACHED_WITHIN_S = 3.0  # ours: at most 1 s (+20% jitter) between tries


async def _check(stub: health_pb2_grpc.HealthStub) -> bool:
    try:
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        return True
    except grpc.aio.AioRpcError as e:
        assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), e
        return False


def test_a_restarted_peer_is_reached_again_within_a_second_of_backoff() -> None:
    async def main() -> None:
        server = make_server("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{server.port}"
        async with channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            assert await _check(stub)
            await server.stop(0)
            loop = asyncio.get_running_loop()
            down_until = loop.time() + DOWN_S
            while loop.time() < down_until:  # callers keep trying while it is gone: the backoff grows
                assert not await _check(stub)
                await asyncio.sleep(0.2)
            server = make_server(address)
            await server.start()
            try:
                restarted = loop.time()
                while not await _check(stub):
                    assert loop.time() - restarted < REACHED_WITHIN_S, "the channel did not reconnect"
                    await asyncio.sleep(0.05)
            finally:
                await server.stop(0)

    asyncio.run(main())
