"""The internal token on a real grpc.aio server: refused without it (unary and streaming calls alike),
served with it, health checks always open, refusals counted."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import grpc.aio
import pytest
from prometheus_client import CollectorRegistry

from proto.baton.v1 import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc
from shared.grpc_auth import AuthCollector, set_internal_token, token_metadata, unauthenticated_calls
from shared.grpc_common import channel, check_health
from tests.unit.test_grpc_errors import _rpc_error, failing_server


@pytest.fixture
def token() -> Iterator[str]:
    set_internal_token("stack-secret")
    yield "stack-secret"
    set_internal_token("")


def test_calls_without_the_token_are_unauthenticated_and_counted(token: str) -> None:
    async def scenario() -> None:
        async with failing_server() as handle:
            before = unauthenticated_calls()
            # a stranger's channel: no token, then a wrong one
            for metadata in ((), (("authorization", "Bearer guess"),)):
                async with grpc.aio.insecure_channel(handle.address) as ch:
                    stub = kv_transfer_pb2_grpc.KVTransferServiceStub(ch)
                    exc = await _rpc_error(stub.Release(kv_transfer_pb2.ReleaseRequest(handoff_id="x"),
                                                        metadata=metadata))
                    assert exc.code() is grpc.StatusCode.UNAUTHENTICATED and "internal token" in exc.details()
                    stream = decode_pb2_grpc.DecodeServiceStub(ch).Generate(
                        decode_pb2.DecodeRequest(handoff_id="context"), metadata=metadata)
                    assert (await _rpc_error(stream)).code() is grpc.StatusCode.UNAUTHENTICATED
            assert unauthenticated_calls() - before == 4
            registry = CollectorRegistry()
            registry.register(AuthCollector())
            assert registry.get_sample_value("baton_grpc_unauthenticated_total") == unauthenticated_calls()
            assert await check_health(handle.address, "baton.v1.KVTransferService")  # probes carry no token
            # our own channels send it (with the caller's metadata beside it)
            async with channel(handle.address) as ch:
                stub = kv_transfer_pb2_grpc.KVTransferServiceStub(ch)
                ok = await stub.Release(kv_transfer_pb2.ReleaseRequest(handoff_id="fine"),
                                        metadata=(("x-request-id", "req-1"),))
                assert ok.found
                stream = decode_pb2_grpc.DecodeServiceStub(ch).Generate(  # a stream carries it too
                    decode_pb2.DecodeRequest(handoff_id="context"), metadata=(("x-request-id", "req-2"),))
                assert (await _rpc_error(stream)).code() is grpc.StatusCode.INVALID_ARGUMENT  # served, then failed
            assert unauthenticated_calls() - before == 4
            # the router's channels: no interceptor, the token in each call's own metadata
            async with channel(handle.address, token_interceptor=False) as ch:
                stub = kv_transfer_pb2_grpc.KVTransferServiceStub(ch)
                exc = await _rpc_error(stub.Release(kv_transfer_pb2.ReleaseRequest(handoff_id="x")))
                assert exc.code() is grpc.StatusCode.UNAUTHENTICATED  # it adds nothing by itself
                ok = await stub.Release(kv_transfer_pb2.ReleaseRequest(handoff_id="fine"),
                                        metadata=[("x-request-id", "req-3"), *token_metadata()])
                assert ok.found
                stream = decode_pb2_grpc.DecodeServiceStub(ch).Generate(
                    decode_pb2.DecodeRequest(handoff_id="context"), metadata=token_metadata())
                assert (await _rpc_error(stream)).code() is grpc.StatusCode.INVALID_ARGUMENT
            assert unauthenticated_calls() - before == 5

    asyncio.run(scenario())


def test_without_a_token_servers_are_open() -> None:
    async def scenario() -> None:
        async with failing_server() as handle, grpc.aio.insecure_channel(handle.address) as ch:
            ok = await kv_transfer_pb2_grpc.KVTransferServiceStub(ch).Release(
                kv_transfer_pb2.ReleaseRequest(handoff_id="fine"))
            assert ok.found
            assert token_metadata() == []  # no token: nothing to send

    asyncio.run(scenario())
