"""kv_transfer over real gRPC: a grpc.aio server on 127.0.0.1 (ephemeral ports) in this process."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
import torch

from proto.baton.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from services.kv_transfer.main import RunningKVTransfer, start
from services.kv_transfer.server import SERVICE_NAME
from services.kv_transfer.settings import KVTransferSettings
from shared import wire
from shared.engine.handoff import KVHandoff
from shared.engine.request import TokenLogprobs
from shared.errors import CapacityError, InvalidRequestError
from shared.grpc_common import channel, check_health
from shared.grpc_errors import error_from_rpc

pb = kv_transfer_pb2
Stub = kv_transfer_pb2_grpc.KVTransferServiceStub


def make_handoff(seed: int = 0, dtype: torch.dtype = torch.float32) -> KVHandoff:
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn((4, 3, 2, 8, 2, 16), generator=gen).to(dtype)  # [layers, blocks, 2, block, heads, dim]
    return KVHandoff(
        prompt_token_ids=list(range(100, 120)),
        first_token_id=7,
        first_logprobs=TokenLogprobs(7, -0.125, [(7, -0.125), (3, -3.5)]),
        block_size=8,
        kv=kv,
        hidden_states=torch.randn((20, 32), generator=gen).to(dtype),  # [num_prompt_tokens, hidden]
    )


NBYTES = make_handoff().nbytes


def chunks(handoff: KVHandoff, handoff_id: str, lease_timeout_ms: int = 0) -> list[pb.HandoffChunk]:
    return list(
        wire.encode_handoff(
            handoff,
            handoff_id=handoff_id,
            request_id=f"req-{handoff_id}",
            model="tiny-llama",
            lease_timeout_ms=lease_timeout_ms,
        )
    )


def run_with_server(scenario: Callable[[RunningKVTransfer, Stub], Awaitable[None]], **settings: Any) -> None:
    """Start a kv_transfer instance, run `scenario` against it, stop it; all in one event loop."""

    async def main() -> None:
        # metrics off unless a test asks: stopping the metrics server takes up to 0.5 s
        config = {"port": 0, "metrics_port": -1, "sweep_interval_s": 0.02, "shutdown_grace_s": 0.0}
        running = await start(KVTransferSettings(**{**config, **settings}))
        try:
            async with channel(running.address) as ch:
                await asyncio.wait_for(scenario(running, Stub(ch)), timeout=15)
        finally:
            await running.stop()

    asyncio.run(main())


async def rpc_error(awaitable: Awaitable[Any]) -> grpc.aio.AioRpcError:
    try:
        await awaitable
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the call did not fail")


async def stats(stub: Stub) -> pb.StatsResponse:
    return await stub.Stats(pb.StatsRequest())


async def wait_until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def store_empty(stub: Stub) -> bool:
    reply = await stats(stub)
    return reply.active_leases == 0 and reply.bytes_held == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_put_then_claim_is_bit_identical(dtype: torch.dtype) -> None:
    handoff = make_handoff(dtype=dtype)

    async def scenario(running: RunningKVTransfer, stub: Stub) -> None:
        reply = await stub.Put(iter(chunks(handoff, "h1")))
        assert (reply.handoff_id, reply.nbytes) == ("h1", handoff.nbytes)
        held = await stats(stub)
        assert (held.active_leases, held.bytes_held) == (1, handoff.nbytes)

        info, back = await wire.decode_handoff_stream(stub.Claim(pb.ClaimRequest(handoff_id="h1")))
        assert (info.handoff_id, info.request_id, info.model) == ("h1", "req-h1", "tiny-llama")
        assert torch.equal(back.kv.view(torch.uint8), handoff.kv.view(torch.uint8))
        assert torch.equal(back.hidden_states.view(torch.uint8), handoff.hidden_states.view(torch.uint8))
        assert back.prompt_token_ids == handoff.prompt_token_ids
        assert (back.first_token_id, back.block_size) == (7, 8)
        assert back.first_logprobs == handoff.first_logprobs
        assert await store_empty(stub)

        exc = await rpc_error(wire.decode_handoff_stream(stub.Claim(pb.ClaimRequest(handoff_id="h1"))))
        assert exc.code() is grpc.StatusCode.NOT_FOUND
        assert error_from_rpc(exc).code == "handoff_not_found"
        # exactly once: the claim was the release
        assert (await stub.Release(pb.ReleaseRequest(handoff_id="h1"))).found is False

    run_with_server(scenario)


def test_release_is_idempotent() -> None:
    async def scenario(running: RunningKVTransfer, stub: Stub) -> None:
        await stub.Put(iter(chunks(make_handoff(), "h1")))
        assert (await stub.Release(pb.ReleaseRequest(handoff_id="h1"))).found is True
        assert (await stub.Release(pb.ReleaseRequest(handoff_id="h1"))).found is False
        assert (await stub.Release(pb.ReleaseRequest(handoff_id="unknown"))).found is False
        assert await store_empty(stub)
        exc = await rpc_error(wire.decode_handoff_stream(stub.Claim(pb.ClaimRequest(handoff_id="h1"))))
        assert exc.code() is grpc.StatusCode.NOT_FOUND

    run_with_server(scenario)


def test_lease_expiry_frees_the_bytes() -> None:
    async def scenario(running: RunningKVTransfer, stub: Stub) -> None:
        await stub.Put(iter(chunks(make_handoff(), "short", lease_timeout_ms=100)))
        await stub.Put(iter(chunks(make_handoff(), "default")))
        assert (await stats(stub)).active_leases == 2
        await wait_until(lambda: _held_equals(stub, NBYTES))  # "short" expired, "default" (10 s) kept
        exc = await rpc_error(wire.decode_handoff_stream(stub.Claim(pb.ClaimRequest(handoff_id="short"))))
        assert exc.code() is grpc.StatusCode.NOT_FOUND and "expired" in (exc.details() or "")
        await wire.decode_handoff_stream(stub.Claim(pb.ClaimRequest(handoff_id="default")))
        assert await store_empty(stub)

    run_with_server(scenario, lease_timeout_s=10.0)


async def _held_equals(stub: Stub, nbytes: int) -> bool:
    reply = await stats(stub)
    return reply.bytes_held == nbytes and reply.active_leases == 1


def test_capacity_overflow_is_resource_exhausted() -> None:
    async def scenario(running: RunningKVTransfer, stub: Stub) -> None:
        await stub.Put(iter(chunks(make_handoff(), "h1")))
        exc = await rpc_error(stub.Put(iter(chunks(make_handoff(), "h2"))))
        assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert isinstance(error_from_rpc(exc), CapacityError)
        reply = await stats(stub)
        assert (reply.active_leases, reply.bytes_held, reply.capacity_bytes) == (1, NBYTES, NBYTES + 100)
        await wire.decode_handoff_stream(stub.Claim(pb.ClaimRequest(handoff_id="h1")))
        await stub.Put(iter(chunks(make_handoff(), "h2")))  # room again

    run_with_server(scenario, capacity_bytes=NBYTES + 100)


def test_put_cancelled_midway_frees_everything() -> None:
    async def scenario(running: RunningKVTransfer, stub: Stub) -> None:
        header, kv0, *_ = chunks(make_handoff(), "h1")
        never = asyncio.Event()

        async def stalled_stream() -> AsyncIterator[pb.HandoffChunk]:
            yield header
            yield kv0
            await never.wait()

        call = stub.Put(stalled_stream())
        await wait_until(lambda: _held_equals(stub, NBYTES))  # reserved, receiving
        call.cancel()
        await wait_until(lambda: store_empty(stub))
        exc = await rpc_error(wire.decode_handoff_stream(stub.Claim(pb.ClaimRequest(handoff_id="h1"))))
        assert exc.code() is grpc.StatusCode.NOT_FOUND
        # the prefill may retry the same handoff id after a broken Put
        await stub.Put(iter(chunks(make_handoff(), "h1")))

    run_with_server(scenario)


def test_malformed_put_is_invalid_argument_and_frees_everything() -> None:
    async def scenario(running: RunningKVTransfer, stub: Stub) -> None:
        header, kv0, kv1, *_ = chunks(make_handoff(), "h1")
        short = pb.HandoffChunk(kv=pb.KVData(layer=1, data=kv1.kv.data[:100]))
        for stream in ([kv0, kv1], [header, kv0, short], [header, kv0], [header, header]):
            exc = await rpc_error(stub.Put(iter(stream)))
            assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert isinstance(error_from_rpc(exc), InvalidRequestError)
            assert await store_empty(stub)

    run_with_server(scenario)


def test_claim_waits_for_a_put_that_arrives_later() -> None:
    handoff = make_handoff(seed=3)

    async def scenario(running: RunningKVTransfer, stub: Stub) -> None:
        claim = asyncio.create_task(
            wire.decode_handoff_stream(stub.Claim(pb.ClaimRequest(handoff_id="late", wait_ms=5000)))
        )
        await asyncio.sleep(0.2)
        assert not claim.done()
        await stub.Put(iter(chunks(handoff, "late")))
        _, back = await asyncio.wait_for(claim, 3.0)
        assert torch.equal(back.kv, handoff.kv)
        assert await store_empty(stub)

        started = asyncio.get_running_loop().time()
        exc = await rpc_error(
            wire.decode_handoff_stream(stub.Claim(pb.ClaimRequest(handoff_id="x", wait_ms=100)))
        )
        assert exc.code() is grpc.StatusCode.NOT_FOUND
        assert asyncio.get_running_loop().time() - started >= 0.09

    run_with_server(scenario)


def test_health_and_metrics() -> None:
    async def scenario(running: RunningKVTransfer, stub: Stub) -> None:
        assert await check_health(running.address)
        assert await check_health(running.address, SERVICE_NAME)
        await stub.Put(iter(chunks(make_handoff(), "h1")))
        url = f"http://127.0.0.1:{running.metrics_port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        assert "baton_handoff_leases_active 1.0" in body
        assert f'baton_kv_transfer_bytes_total{{direction="received"}} {float(NBYTES)}' in body
        assert "# TYPE baton_kv_transfer_failures_total counter" in body
        await wire.decode_handoff_stream(stub.Claim(pb.ClaimRequest(handoff_id="h1")))
        await rpc_error(wire.decode_handoff_stream(stub.Claim(pb.ClaimRequest(handoff_id="h1"))))
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        assert "baton_handoff_leases_active 0.0" in body
        assert f'baton_kv_transfer_bytes_total{{direction="sent"}} {float(NBYTES)}' in body
        assert 'baton_kv_transfer_failures_total{reason="claim_not_found"} 1.0' in body

    run_with_server(scenario, metrics_port=0)


def test_two_instances_in_one_process_have_separate_metrics() -> None:
    async def main() -> None:
        settings = KVTransferSettings(port=0, metrics_port=0, shutdown_grace_s=0.0)
        first, second = await start(settings), await start(settings)
        try:
            assert first.address != second.address and first.metrics_port != second.metrics_port
            assert first.metrics.registry is not second.metrics.registry
        finally:
            await first.stop()
            await second.stop()
        assert not await check_health(first.address, timeout_s=0.5)

    asyncio.run(main())


def test_main_serves_until_sigterm() -> None:
    env = {
        **os.environ,
        "BATON_KV_TRANSFER_PORT": "0",
        "BATON_KV_TRANSFER_METRICS_PORT": "-1",
        "BATON_KV_TRANSFER_SHUTDOWN_GRACE_S": "0",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.kv_transfer.main"],
        cwd=Path(__file__).resolve().parents[3],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = ""
        while "listening on" not in line:
            line = proc.stderr.readline()
            assert line, "kv_transfer exited before listening"
        address = re.search(r"listening on (\S+)", line).group(1)  # type: ignore[union-attr]
        assert address.startswith("127.0.0.1:")
        assert asyncio.run(check_health(address, SERVICE_NAME))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
