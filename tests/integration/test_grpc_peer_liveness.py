"""How a channel (shared/grpc_common.py) tells a live peer from a gone one.

A channel to a service that went away reaches it again within a second or so of its restart on the same
address (RECONNECT_OPTIONS), however long it was away. A call to a peer that stopped (SIGSTOP: no socket
closes) fails UNAVAILABLE once the channel's keepalive pings go unanswered, where without them it would wait
for its deadline, or forever.

With gRPC's default backoff (1 s growing 1.6x to 120 s) a channel whose peer was gone for 10 s next tries
to connect about 6 s later, and every call until then fails at once: a router would count a supervisor's
restarted decode as failed and send its requests elsewhere, or nowhere."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

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


# a server in its own process, whose one method takes a minute to answer (a long Prefill, say)
_SLOW_SERVER = """
import asyncio, sys
import grpc
from shared.grpc_common import make_server

async def wait(request, context):
    await asyncio.sleep(60)
    return b""

async def main():
    server = make_server("127.0.0.1:0")
    handler = grpc.unary_unary_rpc_method_handler(wait)
    server.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Slow", {"Wait": handler})])
    await server.start()
    print(server.port, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def _slow_server() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_SERVER], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout is not None
    return proc, f"127.0.0.1:{proc.stdout.readline().strip()}"


async def _wait_call(address: str, deadline_s: float, stop_pid: int | None = None) -> grpc.StatusCode:
    """The status of a call to the slow method on a channel pinging every second; with `stop_pid`, that
    process stopped (SIGSTOP) 0.5 s into the call."""
    async with channel(address, keepalive_s=1.0) as ch:
        call = ch.unary_unary("/test.Slow/Wait")(b"", timeout=deadline_s)
        if stop_pid is not None:
            await asyncio.sleep(0.5)
            os.kill(stop_pid, signal.SIGSTOP)
        try:
            await call
        except grpc.aio.AioRpcError as e:
            return e.code()
        return grpc.StatusCode.OK


def test_a_call_to_a_stopped_peer_fails_unavailable_and_one_to_a_busy_peer_waits() -> None:
    proc, address = _slow_server()
    try:
        # busy (its handler awaiting) but alive: it answers five seconds of pings, the call runs to its deadline
        assert asyncio.run(_wait_call(address, 5.0)) == grpc.StatusCode.DEADLINE_EXCEEDED
        # stopped: a ping unanswered for 1 s closes the transport, long before the call's 30 s deadline
        assert asyncio.run(_wait_call(address, 30.0, proc.pid)) == grpc.StatusCode.UNAVAILABLE
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
