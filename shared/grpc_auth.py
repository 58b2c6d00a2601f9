"""A shared token on every internal gRPC call: who may run the model, claim a handoff or free slots.

    service start ─► set_internal_token(settings.internal_token)      ("" = open, as before)
    channel()     ─► every call carries `authorization: Bearer <token>` (a client interceptor)
    make_server() ─► TokenAuthInterceptor: no token or a wrong one ─► UNAUTHENTICATED, counted
                     (the health service stays open: probes and `baton up` carry no token)

One token per stack: `baton up` makes a random one for its children; compose and Kubernetes
read it from a secret. Compared in constant time. Mutual TLS (grpc_tls.py) is the stronger mode;
the two can run together.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

__all__ = ["AuthCollector", "TokenAuthInterceptor", "client_interceptors", "count_refusal", "internal_token",
           "refusing_handler", "set_internal_token", "token_metadata", "unauthenticated_calls"]

logger = logging.getLogger(__name__)

_HEALTH_PREFIX = "/grpc.health.v1.Health/"
_state = {"token": ""}
_refused = {"count": 0}
_lock = threading.Lock()


def set_internal_token(token: str) -> None:
    """The token this process's gRPC servers require and its channels send ("" = none)."""
    _state["token"] = token


def internal_token() -> str:
    return _state["token"]


def unauthenticated_calls() -> int:
    """Calls this process's servers refused for a missing or wrong token (baton_grpc_unauthenticated)."""
    return _refused["count"]


class AuthCollector(Collector):
    """baton_grpc_unauthenticated_total: for a service's own metrics registry."""

    def collect(self) -> Any:
        family = CounterMetricFamily("baton_grpc_unauthenticated", "Internal gRPC calls refused for a missing or "
                                     "wrong token")
        family.add_metric([], unauthenticated_calls())
        yield family


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks unless it carries the process's internal token."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        token = internal_token()
        method = handler_call_details.method or ""
        if not token or method.startswith(_HEALTH_PREFIX):
            return await continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if isinstance(given, bytes):
            given = given.decode(errors="replace")
        if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return await continuation(handler_call_details)
        count_refusal(f"{method}: {'wrong' if given else 'no'} internal token")
        handler = await continuation(handler_call_details)
        return refusing_handler(handler, "missing or wrong internal token (BATON_*_INTERNAL_TOKEN)")


def count_refusal(why: str) -> None:
    """One call refused as unauthenticated (by the token or the TLS peer check), counted and logged."""
    with _lock:
        _refused["count"] += 1
    logger.warning("refused an unauthenticated call: %s", why)


def refusing_handler(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED and `message`."""

    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def abort_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort(request, context)
        yield  # pragma: no cover (an async generator: the abort raised before it)

    if handler is not None and handler.request_streaming:
        raise_ = abort_stream if handler.response_streaming else abort
        return (grpc.stream_stream_rpc_method_handler if handler.response_streaming
                else grpc.stream_unary_rpc_method_handler)(raise_)
    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_stream)
    return grpc.unary_unary_rpc_method_handler(abort)


class _BearerToken:
    """Adds the internal token to a call's metadata (beside the trace context callers send)."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    async def _forward(self, continuation: Any, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        """Every call kind's hook: the same details plus the token (`request` is an iterator for streams)."""
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._header)
        return await continuation(grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                                             details.credentials, details.wait_for_ready), request)


# one class per call kind: a channel files each interceptor under the first kind it is an instance of
class _UnaryUnaryToken(_BearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _BearerToken._forward


class _UnaryStreamToken(_BearerToken, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _BearerToken._forward


class _StreamUnaryToken(_BearerToken, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _BearerToken._forward


class _StreamStreamToken(_BearerToken, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _BearerToken._forward


def token_metadata() -> list[tuple[str, str]]:
    """The internal token as call metadata, for callers that send it on every call themselves (a channel
    made with `token_interceptor=False`: an intercepted stream costs an extra await for each message)."""
    token = internal_token()
    return [("authorization", f"Bearer {token}")] if token else []


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    token = internal_token()
    kinds = (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken, _StreamStreamToken)
    return [kind(token) for kind in kinds] if token else []
