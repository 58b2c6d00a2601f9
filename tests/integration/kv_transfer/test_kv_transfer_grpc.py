"""kv_transfer over real gRPC and a real transport: a grpc.aio server on 127.0.0.1 in this process.

The test plays both engines: it writes KV into the reserved slots with its own
transport agent (as prefill does), commits, claims and reads it back (as
decode does), for every transport that works here.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Awaitable, Callable
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
from shared.engine.block_pool import hash_prefix_blocks
from shared.engine.request import TokenLogprobs
from shared.errors import BatonError, CapacityError, HandoffNotFoundError, RequestAbortedError
from shared.grpc_common import channel, check_health
from shared.kv.layout import KVLayout, cdiv
from shared.kv.remote import HandoffResult, HandoffSpec, block_plan, slot_nbytes_for
from shared.service.kv_client import KVTransferClient
from shared.transport import TransferOp, available_transports, make_transport

pb = kv_transfer_pb2
Stub = kv_transfer_pb2_grpc.KVTransferServiceStub
CACHE = KVLayout(num_layers=4, num_blocks=8, block_size=8, num_kv_heads=2, head_dim=16, dtype=torch.float32)
PROMPT = list(range(100, 120))  # 2 full blocks and a partial one
SLOT_NBYTES = slot_nbytes_for(CACHE)


def make_spec(handoff_id: str, prompt: list[int] = PROMPT, lease_timeout_ms: int = 0,
              capability: str = "") -> HandoffSpec:
    layout = KVLayout(4, cdiv(len(prompt), 8), 8, 2, 16, torch.float32)
    return HandoffSpec(handoff_id, f"req-{handoff_id}", "tiny-llama", layout, prompt,
                       hash_prefix_blocks(prompt, 8), 0, lease_timeout_ms, capability=capability)


RESULT = HandoffResult(7, TokenLogprobs(7, -0.125, [(7, -0.125), (3, -3.5)]))


def run_with_server(scenario: Callable[[RunningKVTransfer, Stub], Awaitable[None]], **settings: Any) -> None:
    """Start a kv_transfer instance, run `scenario` against it, stop it; all in one event loop."""

    async def main() -> None:
        # metrics off unless a test asks: stopping the metrics server takes up to 0.5 s
        config = {"port": 0, "metrics_port": -1, "sweep_interval_s": 0.02, "shutdown_grace_s": 0.0,
                  "capacity_bytes": 64 * SLOT_NBYTES}
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


async def baton_error(awaitable: Awaitable[Any]) -> BatonError:
    try:
        await awaitable
    except BatonError as exc:
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
    return reply.active_leases == 0 and reply.slots_pinned == 0


@pytest.mark.parametrize("kind", available_transports())
def test_written_blocks_read_back_bit_identical(kind: str) -> None:
    async def scenario(running: RunningKVTransfer, stub: Stub) -> None:
        client = KVTransferClient(4 << 20)
        agent = make_transport(kind, "test-engine", transfer_timeout_s=5.0)
        try:
            src = torch.randn(CACHE.shape)  # [layers, blocks, 2, block, heads, dim]
            dst = torch.zeros(CACHE.shape)
            src_region, dst_region = agent.register(src), agent.register(dst)
            slots, address = await client.reserve(running.address, make_spec("h1"))
            assert address.kind == kind and address.space.slot_nbytes == SLOT_NBYTES
            agent.add_remote(address.space.agent_name, address.metadata)
            layers = range(CACHE.num_layers)
            write = block_plan(CACHE, src_region, [5, 2, 7], address.space, slots.block_slots, layers)
            agent.wait(agent.start(TransferOp.WRITE, write.local, address.space.agent_name, write.remote), 5.0)
            await client.commit(running.address, "h1", RESULT)
            claimed, address = await client.claim(running.address, "h1", wait_s=0, timeout_s=5)
            assert claimed.result == RESULT and claimed.spec.prompt_token_ids == PROMPT
            read = block_plan(CACHE, dst_region, [0, 1, 3], address.space, claimed.slots.block_slots, layers)
            agent.wait(agent.start(TransferOp.READ, read.local, address.space.agent_name, read.remote), 5.0)
            assert torch.equal(dst[:, [0, 1, 3]], src[:, [5, 2, 7]])
            assert await client.release(running.address, "h1", transfers_stopped=True)
            assert await store_empty(stub)
            # the two full blocks stay in the prefix pool: the next turn finds them
            slots2, _ = await client.reserve(running.address, make_spec("h2", PROMPT[:16] + [1, 2, 3]))
            assert slots2.present == [True, True, False] and slots2.block_slots[:2] == slots.block_slots[:2]
            assert await client.release(running.address, "h2", transfers_stopped=True)
        finally:
            agent.close()
            await client.close()

    run_with_server(scenario, transport=kind)


def test_release_is_idempotent_and_refuses_a_late_reserve() -> None:
    async def scenario(running: RunningKVTransfer, stub: Stub) -> None:
        client = KVTransferClient(4 << 20)
        await client.reserve(running.address, make_spec("h1"))
        assert await client.release(running.address, "h1") is True  # the router's: its prefill may still write
        assert (await stats(stub)).active_leases == 1
        assert await client.release(running.address, "h1", transfers_stopped=True) is True  # the prefill's own
        assert await client.release(running.address, "h1") is False
        assert await client.release(running.address, "early") is False
        err = await baton_error(client.reserve(running.address, make_spec("early")))
        assert isinstance(err, RequestAbortedError)  # the request was aborted before its prefill
        assert await store_empty(stub)
        await client.close()

    run_with_server(scenario, transport="tcp")


def test_leases_expire_in_every_state() -> None:
    async def scenario(running: RunningKVTransfer, stub: Stub) -> None:
        client = KVTransferClient(4 << 20)
        await client.reserve(running.address, make_spec("writing", lease_timeout_ms=100))  # prefill died
        await client.reserve(running.address, make_spec("leased", lease_timeout_ms=100))  # decode never came
        await client.commit(running.address, "leased", RESULT)
        await client.reserve(running.address, make_spec("claimed"))  # decode died mid-pull
        await client.commit(running.address, "claimed", RESULT)
        await client.claim(running.address, "claimed", wait_s=0, timeout_s=5)
        assert (await stats(stub)).active_leases == 3
        await wait_until(lambda: store_empty(stub))  # claim timeout 0.2 s
        for hid in ("writing", "leased", "claimed"):
            err = await baton_error(client.claim(running.address, hid, wait_s=0, timeout_s=5))
            assert isinstance(err, HandoffNotFoundError) and "expired" in err.message
        await client.close()

    run_with_server(scenario, transport="tcp", claim_timeout_s=0.2)


def test_capacity_overflow_is_resource_exhausted() -> None:
    async def scenario(running: RunningKVTransfer, stub: Stub) -> None:
        client = KVTransferClient(4 << 20)
        await client.reserve(running.address, make_spec("h1"))  # 3 of 4 slots
        err = await baton_error(client.reserve(running.address, make_spec("h2", list(range(500, 520)))))
        assert isinstance(err, CapacityError)
        reply = await stats(stub)
        assert (reply.active_leases, reply.slots_pinned, reply.num_slots) == (1, 3, 4)
        await client.release(running.address, "h1", transfers_stopped=True)
        await client.reserve(running.address, make_spec("h2", list(range(500, 520))))  # room again
        await client.release(running.address, "h2", transfers_stopped=True)
        await client.close()

    run_with_server(scenario, transport="tcp", capacity_bytes=4 * SLOT_NBYTES)


@pytest.mark.parametrize(("policy", "kept"), [("lru", "tail"), ("lfu", "shared")])
def test_the_eviction_policy_setting_decides_which_pool_block_goes(policy: str, kept: str) -> None:
    """Over gRPC, with BATON_KV_TRANSFER_EVICTION_POLICY: a block four requests shared against one used once
    after it; when a fresh slot is needed, LRU drops the shared one (released first), LFU the one-off."""
    shared, tail = list(range(100, 108)), list(range(300, 308))

    async def cycle(client: KVTransferClient, address: str, handoff_id: str, prompt: list[int]) -> list[bool]:
        slots, _ = await client.reserve(address, make_spec(handoff_id, prompt))
        await client.commit(address, handoff_id, RESULT)
        await client.release(address, handoff_id)  # released unclaimed: its full blocks stay in the pool
        return slots.present

    async def scenario(running: RunningKVTransfer, stub: Stub) -> None:
        client = KVTransferClient(4 << 20)
        for i in range(4):
            await cycle(client, running.address, f"s{i}", shared + [1])
        await cycle(client, running.address, "t", tail + [1])
        await cycle(client, running.address, "fresh", list(range(500, 508)) + [1])  # needs 2 slots: 1 is free
        other = "tail" if kept == "shared" else "shared"
        prompts = {"shared": shared + [1], "tail": tail + [1]}
        assert (await cycle(client, running.address, "k", prompts[kept]))[0]  # it is still in the pool
        assert not (await cycle(client, running.address, "o", prompts[other]))[0]  # it was evicted
        await client.close()

    # 3 slots: the shared and tail blocks, and one free for a request's partial block
    run_with_server(scenario, transport="tcp", capacity_bytes=3 * SLOT_NBYTES, eviction_policy=policy)


def test_claim_waits_for_a_commit_that_comes_later() -> None:
    async def scenario(running: RunningKVTransfer, stub: Stub) -> None:
        client = KVTransferClient(4 << 20)
        claim = asyncio.create_task(client.claim(running.address, "late", wait_s=5, timeout_s=10))
        await asyncio.sleep(0.2)
        await client.reserve(running.address, make_spec("late"))
        await asyncio.sleep(0.1)
        assert not claim.done()
        await client.commit(running.address, "late", RESULT)
        claimed, _ = await asyncio.wait_for(claim, 3.0)
        assert claimed.result.first_token_id == 7
        await client.release(running.address, "late", transfers_stopped=True)
        started = asyncio.get_running_loop().time()
        err = await baton_error(client.claim(running.address, "x", wait_s=0.1, timeout_s=5))
        assert isinstance(err, HandoffNotFoundError)
        assert asyncio.get_running_loop().time() - started >= 0.09
        await client.close()

    run_with_server(scenario, transport="tcp")


def test_a_layout_mismatch_with_the_transport_kind_is_refused() -> None:
    async def scenario(running: RunningKVTransfer, stub: Stub) -> None:
        exc = await rpc_error(stub.GetAgent(pb.GetAgentRequest(kind="nixl")))
        assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT
        info = await stub.GetAgent(pb.GetAgentRequest(kind="tcp"))
        assert info.kind == "tcp" and info.slot_nbytes == 0  # cut by the first Reserve

    run_with_server(scenario, transport="tcp")


def test_a_caller_without_the_handoffs_capability_is_refused_and_counted() -> None:
    async def scenario(running: RunningKVTransfer, stub: Stub) -> None:
        client = KVTransferClient(4 << 20)
        await client.reserve(running.address, make_spec("h1", capability="s3cret"))
        for call in (stub.Renew(pb.RenewRequest(handoff_id="h1", capability="guess")),
                     stub.Commit(pb.CommitRequest(handoff_id="h1", first_token_id=7)),
                     stub.Release(pb.ReleaseRequest(handoff_id="h1", capability="guess"))):
            assert (await rpc_error(call)).code() == grpc.StatusCode.PERMISSION_DENIED
        await client.commit(running.address, "h1", RESULT, "s3cret")
        err = await rpc_error(stub.Claim(pb.ClaimRequest(handoff_id="h1")))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        url = f"http://127.0.0.1:{running.metrics_port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        assert "baton_handoff_capability_refused_total 4.0" in body and "baton_handoff_leases_active 1.0" in body
        await client.claim(running.address, "h1", wait_s=0, timeout_s=5, capability="s3cret")
        assert await client.release(running.address, "h1", capability="s3cret", transfers_stopped=True)
        assert await store_empty(stub)
        await client.close()

    run_with_server(scenario, metrics_port=0, transport="tcp")


def test_health_and_metrics() -> None:
    async def scenario(running: RunningKVTransfer, stub: Stub) -> None:
        assert await check_health(running.address)
        assert await check_health(running.address, SERVICE_NAME)
        client = KVTransferClient(4 << 20)
        await client.reserve(running.address, make_spec("h1"))
        url = f"http://127.0.0.1:{running.metrics_port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        assert "baton_handoff_leases_active 1.0" in body and "baton_kv_transfer_slots_pinned 3.0" in body
        assert "# TYPE baton_kv_transfer_failures_total counter" in body
        await client.commit(running.address, "h1", RESULT)
        await client.claim(running.address, "h1", wait_s=0, timeout_s=5)
        await baton_error(client.claim(running.address, "h1", wait_s=0, timeout_s=5))
        await client.release(running.address, "h1", transfers_stopped=True)
        await client.reserve(running.address, make_spec("h2"))  # two full blocks from the pool
        await client.release(running.address, "h2", transfers_stopped=True)
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        assert "baton_handoff_leases_active 0.0" in body and "baton_prefix_pool_blocks 2.0" in body
        assert "baton_prefix_pool_hit_tokens_total 16.0" in body
        assert 'baton_kv_transfer_failures_total{reason="claim_not_found"} 1.0' in body
        await client.close()

    run_with_server(scenario, metrics_port=0, transport="tcp")


def test_encoder_outputs_are_kept_by_model_and_digest_and_bad_ones_refused() -> None:
    """What a prefill offers another gets back bit-identical, under its model only; outputs past the cache's
    bytes push the oldest out; a malformed output is INVALID_ARGUMENT; lookups are counted."""
    async def scenario(running: RunningKVTransfer, stub: Stub) -> None:
        client = KVTransferClient(4 << 20)
        image, clip = torch.randn(12, 32), torch.randn(5, 32).bfloat16()
        assert await client.put_encoder_outputs(running.address, "m", {b"i" * 32: image, b"a" * 32: clip}) == 2
        got = await client.get_encoder_outputs(running.address, "m", [b"a" * 32, b"x" * 32, b"i" * 32])
        assert list(got) == [b"a" * 32, b"i" * 32]
        assert torch.equal(got[b"i" * 32], image) and torch.equal(got[b"a" * 32], clip)
        assert await client.get_encoder_outputs(running.address, "another model", [b"i" * 32]) == {}
        assert await client.held_encoder_outputs(running.address, "m", [b"i" * 32, b"x" * 32]) == {b"i" * 32}
        await client.put_encoder_outputs(running.address, "m", {b"n" * 32: torch.zeros(8, 32)})  # 1 KiB: past it
        assert list(await client.get_encoder_outputs(running.address, "m", [b"i" * 32, b"n" * 32])) == [b"n" * 32]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.PutEncoderOutputs(pb.PutEncoderOutputsRequest(model="m", outputs=[pb.EncoderOutput(
                content_hash=b"z" * 32, dtype="float32", shape=[4, 4], data=b"short")]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        url = f"http://127.0.0.1:{running.metrics_port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        assert 'baton_encoder_cache_lookups_total{result="hit"} 4.0' in body
        assert 'baton_encoder_cache_lookups_total{result="miss"} 4.0' in body
        assert f"baton_encoder_cache_bytes {float(running.encoder_cache.nbytes)}" in body
        await client.close()

    run_with_server(scenario, metrics_port=0, transport="tcp", encoder_cache_bytes=2048)


def test_two_instances_in_one_process_have_separate_metrics() -> None:
    async def main() -> None:
        settings = KVTransferSettings(port=0, metrics_port=0, shutdown_grace_s=0.0, capacity_bytes=1 << 20)
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
        "BATON_KV_TRANSFER_CAPACITY_BYTES": str(1 << 20),
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
