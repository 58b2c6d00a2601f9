"""shared.grpc_errors: the one BatonError <-> gRPC status mapping, and the server interceptor."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.baton.v1 import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc
from shared.errors import (
    AuthenticationError,
    BatonError,
    CapacityError,
    ConfigError,
    ContextLengthExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestAbortedError,
    UnavailableError,
)
from shared.grpc_common import GrpcServer, channel, check_health, make_server
from shared.grpc_errors import (
    REQUEST_ID_KEY,
    error_from_rpc,
    error_from_status,
    status_for_error,
    trailing_metadata_for_error,
)

S = grpc.StatusCode

MAPPING = [
    (InvalidRequestError("bad", param="top_p"), S.INVALID_ARGUMENT),
    (ContextLengthExceededError("too long", param="messages"), S.INVALID_ARGUMENT),
    (ModelNotFoundError("no such model", param="model"), S.NOT_FOUND),
    (CapacityError("full"), S.RESOURCE_EXHAUSTED),
    (UnavailableError("nobody home"), S.UNAVAILABLE),
    (RequestAbortedError("gone"), S.CANCELLED),
    (AuthenticationError("who are you"), S.UNAUTHENTICATED),
    (ConfigError("bad setting"), S.INTERNAL),
    (BatonError("generic"), S.INTERNAL),
]


class ServiceNotFoundError(BatonError):
    """A subclass a service defines itself: mapped by its HTTP status."""

    http_status = 404
    code = "thing_not_found"


@pytest.mark.parametrize(("error", "status"), MAPPING)
def test_status_for_error(error: BatonError, status: grpc.StatusCode) -> None:
    assert status_for_error(error) is status


def test_unexpected_exceptions_are_internal() -> None:
    assert status_for_error(RuntimeError("boom")) is S.INTERNAL
    assert status_for_error(KeyError("x")) is S.INTERNAL


def test_unlisted_subclasses_map_by_http_status() -> None:
    assert status_for_error(ServiceNotFoundError("x")) is S.NOT_FOUND


@pytest.mark.parametrize(("error", "status"), MAPPING)
def test_round_trip_keeps_class_message_and_param(error: BatonError, status: grpc.StatusCode) -> None:
    back = error_from_status(status, error.message, trailing_metadata_for_error(error))
    assert type(back) is type(error)
    assert (back.message, back.param) == (error.message, error.param)


def test_round_trip_of_a_service_defined_error() -> None:
    error = ServiceNotFoundError("handoff h1 not found", param="handoff_id")
    back = error_from_status(S.NOT_FOUND, error.message, trailing_metadata_for_error(error))
    assert type(back) is ServiceNotFoundError and back.param == "handoff_id"


@pytest.mark.parametrize(
    ("status", "error_type"),
    [
        (S.INVALID_ARGUMENT, InvalidRequestError),
        (S.NOT_FOUND, ModelNotFoundError),
        (S.RESOURCE_EXHAUSTED, CapacityError),
        (S.UNAVAILABLE, UnavailableError),
        (S.CANCELLED, RequestAbortedError),
        (S.DEADLINE_EXCEEDED, RequestAbortedError),
        (S.UNAUTHENTICATED, AuthenticationError),
        (S.INTERNAL, BatonError),
        (S.UNKNOWN, BatonError),
    ],
)
def test_status_without_trailers(status: grpc.StatusCode, error_type: type[BatonError]) -> None:
    back = error_from_status(status, "details here")
    assert type(back) is error_type and back.message == "details here"


def test_trailer_disagreeing_with_the_status_is_ignored() -> None:
    trailers = trailing_metadata_for_error(ContextLengthExceededError("x"))
    assert type(error_from_status(S.UNAVAILABLE, "down", trailers)) is UnavailableError
    assert type(error_from_status(S.INVALID_ARGUMENT, "x", (("baton-error-code", "nonsense"),))) is (
        InvalidRequestError
    )


# --- the interceptor, on a real grpc.aio server -------------------------------------------------


class FailingServicer(kv_transfer_pb2_grpc.KVTransferServiceServicer):
    """Raises what the handoff id names."""

    ERRORS: dict[str, Exception] = {
        "capacity": CapacityError("store full"),
        "context": ContextLengthExceededError("prompt too long", param="prompt"),
        "boom": RuntimeError("secret internals"),
    }

    async def Release(
        self, request: kv_transfer_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.ReleaseResponse:
        if request.handoff_id in self.ERRORS:
            raise self.ERRORS[request.handoff_id]
        return kv_transfer_pb2.ReleaseResponse(found=True)



class FailingDecode(decode_pb2_grpc.DecodeServiceServicer):
    """A server-streaming RPC that fails after its first message."""

    async def Generate(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        yield decode_pb2.DecodeResponse(token_ids=[1])
        raise FailingServicer.ERRORS[request.handoff_id]


class WritingFailingDecode(decode_pb2_grpc.DecodeServiceServicer):
    """The same, written as baton's decode service is: a coroutine that streams with `context.write`."""

    async def Generate(  # type: ignore[override]
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await context.write(decode_pb2.DecodeResponse(token_ids=[1]))
        raise FailingServicer.ERRORS[request.handoff_id]


async def _rpc_error(call: object) -> grpc.aio.AioRpcError:
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:  # type: ignore[attr-defined]
                pass
        else:
            await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the call did not fail")


@contextlib.asynccontextmanager
async def failing_server(decode: type[decode_pb2_grpc.DecodeServiceServicer] = FailingDecode
                         ) -> AsyncIterator[GrpcServer]:
    """A real grpc.aio server (make_server's interceptors) with the failing kv_transfer and decode servicers."""
    handle = make_server("127.0.0.1:0")
    kv_transfer_pb2_grpc.add_KVTransferServiceServicer_to_server(FailingServicer(), handle.server)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(decode(), handle.server)
    await handle.start("baton.v1.KVTransferService")
    try:
        yield handle
    finally:
        await handle.stop(0)


@pytest.mark.parametrize("servicer", [FailingDecode, WritingFailingDecode])
def test_interceptor_maps_errors_from_every_rpc_kind(caplog: pytest.LogCaptureFixture, servicer: type) -> None:
    async def scenario() -> None:
        async with failing_server(servicer) as handle:
            async with channel(handle.address) as ch:
                stub = kv_transfer_pb2_grpc.KVTransferServiceStub(ch)
                ok = await stub.Release(kv_transfer_pb2.ReleaseRequest(handoff_id="fine"))
                assert ok.found

                exc = await _rpc_error(stub.Release(kv_transfer_pb2.ReleaseRequest(handoff_id="capacity")))
                assert exc.code() is S.RESOURCE_EXHAUSTED and exc.details() == "store full"
                assert type(error_from_rpc(exc)) is CapacityError

                decode = decode_pb2_grpc.DecodeServiceStub(ch)
                exc = await _rpc_error(decode.Generate(decode_pb2.DecodeRequest(handoff_id="context")))
                assert exc.code() is S.INVALID_ARGUMENT
                error = error_from_rpc(exc)
                assert type(error) is ContextLengthExceededError and error.param == "prompt"

                call = stub.Release(
                    kv_transfer_pb2.ReleaseRequest(handoff_id="boom"), metadata=((REQUEST_ID_KEY, "req-77"),)
                )
                exc = await _rpc_error(call)
                assert exc.code() is S.INTERNAL
                assert "secret" not in (exc.details() or "")  # internals stay in the log
                assert type(error_from_rpc(exc)) is BatonError

                # the health service's Watch (a coroutine that writes) passes the interceptor intact
                health = health_pb2_grpc.HealthStub(ch)
                watch = health.Watch(health_pb2.HealthCheckRequest(service="baton.v1.KVTransferService"))
                first = await watch.read()
                assert first.status == health_pb2.HealthCheckResponse.SERVING
                watch.cancel()
            assert await check_health(handle.address, "baton.v1.KVTransferService")
            assert not await check_health(handle.address, "baton.v1.NoSuchService")

    with caplog.at_level(logging.INFO, logger="shared.grpc_errors"):
        asyncio.run(scenario())
    unexpected = [r for r in caplog.records if "unexpected" in r.getMessage()]
    assert len(unexpected) == 1 and "req-77" in unexpected[0].getMessage()
    assert unexpected[0].exc_info is not None and "secret internals" in str(unexpected[0].exc_info[1])
