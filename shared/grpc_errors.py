"""The one mapping between baton's error hierarchy and gRPC status codes.

Servers: `ErrorInterceptor` (installed by `shared.grpc_common.make_server`)
turns a `BatonError` raised by any servicer method into
`context.abort(code, message)` and an unexpected exception into INTERNAL,
after logging it with the request id. The error's stable `code` and `param`
travel in trailing metadata, so a client rebuilds the same subclass::

    servicer raises CapacityError("store full")
        └─► RESOURCE_EXHAUSTED "store full"  + trailers baton-error-code=rate_limit_exceeded
              └─► client: error_from_rpc(exc) -> CapacityError("store full")

Clients: `error_from_rpc(exc)` (or `error_from_status(code, details)` when
only those are known) turns a failed call back into a `BatonError`.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from shared.errors import (
    AuthenticationError,
    BatonError,
    CapacityError,
    ContextLengthExceededError,
    HandoffNotFoundError,
    InvalidRequestError,
    ModelNotFoundError,
    PermissionDeniedError,
    RequestAbortedError,
    UnavailableError,
)

logger = logging.getLogger(__name__)

ERROR_CODE_KEY = "baton-error-code"
ERROR_PARAM_KEY = "baton-error-param"
REQUEST_ID_KEY = "x-request-id"

# Most specific first; a subclass not listed takes its nearest listed ancestor.
_STATUS_BY_ERROR: tuple[tuple[type[BatonError], grpc.StatusCode], ...] = (
    (ContextLengthExceededError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (ModelNotFoundError, grpc.StatusCode.NOT_FOUND),
    (HandoffNotFoundError, grpc.StatusCode.NOT_FOUND),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (RequestAbortedError, grpc.StatusCode.CANCELLED),
    (AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
)

# For BatonError subclasses outside the table whose only listed ancestor is BatonError
# itself (e.g. one a service defines): their HTTP status says what kind of failure it is.
_STATUS_BY_HTTP: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
}

# Client side, when the trailers name no known error class.
_ERROR_BY_STATUS: dict[grpc.StatusCode, type[BatonError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: ModelNotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.CANCELLED: RequestAbortedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: RequestAbortedError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
}


def status_for_error(error: BaseException) -> grpc.StatusCode:
    """The gRPC status a raised exception maps to (INTERNAL for anything unplanned)."""
    if not isinstance(error, BatonError):
        return grpc.StatusCode.INTERNAL
    for error_type, status in _STATUS_BY_ERROR:
        if isinstance(error, error_type):
            return status
    return _STATUS_BY_HTTP.get(error.http_status, grpc.StatusCode.INTERNAL)


def trailing_metadata_for_error(error: BatonError) -> tuple[tuple[str, str], ...]:
    """Trailers that let `error_from_rpc` rebuild the exact error class and param."""
    pairs = [(ERROR_CODE_KEY, error.code)]
    if error.param is not None:
        pairs.append((ERROR_PARAM_KEY, error.param))
    return tuple(pairs)


def _error_classes_by_code() -> dict[str, type[BatonError]]:
    """Every BatonError subclass loaded in this process, by its `code` (base classes win ties)."""
    found: dict[str, type[BatonError]] = {}
    pending: list[type[BatonError]] = [BatonError]
    while pending:
        cls = pending.pop(0)
        found.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    return found


def error_from_status(
    status: grpc.StatusCode,
    details: str | None,
    trailing_metadata: Sequence[tuple[str, str | bytes]] | None = None,
) -> BatonError:
    """Rebuild the BatonError a server raised from its status, details and trailers."""
    meta = {key: value for key, value in (trailing_metadata or ())}
    code = meta.get(ERROR_CODE_KEY)
    param = meta.get(ERROR_PARAM_KEY)
    message = details or status.name.lower()
    error_type: type[BatonError] | None = None
    if isinstance(code, str):
        error_type = _error_classes_by_code().get(code)
        # Trust the trailer only when it agrees with the status (a proxy may rewrite one).
        if error_type is not None and status_for_error(error_type(message)) != status:
            error_type = None
    if error_type is None:
        error_type = _ERROR_BY_STATUS.get(status, BatonError)
    return error_type(message, param=param if isinstance(param, str) else None)


def error_from_rpc(exc: grpc.RpcError) -> BatonError:
    """The BatonError behind a failed gRPC call (sync or aio client)."""
    code_fn = getattr(exc, "code", None)
    status = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details_fn = getattr(exc, "details", None)
    details = details_fn() if callable(details_fn) else str(exc)
    trailers_fn = getattr(exc, "trailing_metadata", None)
    trailers = trailers_fn() if callable(trailers_fn) else None
    return error_from_status(status, details, list(trailers) if trailers else None)


def _request_id(request: object, context: grpc.aio.ServicerContext) -> str:
    """The request id of a call: from the message (or its nested request), else metadata."""
    for holder in (request, getattr(request, "request", None), getattr(request, "header", None)):
        value = getattr(holder, "request_id", None)
        if isinstance(value, str) and value:
            return value
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and isinstance(value, str):
            return value
    return "-"


async def _abort_for(
    error: Exception, method: str, request: object, context: grpc.aio.ServicerContext
) -> None:
    """Log `error` and abort the call with its mapped status. Always raises."""
    request_id = _request_id(request, context)
    if isinstance(error, BatonError):
        status = status_for_error(error)
        logger.info("rpc %s failed: request_id=%s status=%s: %s", method, request_id, status.name, error)
        await context.abort(status, error.message, trailing_metadata=trailing_metadata_for_error(error))
    logger.exception("rpc %s: unexpected error, request_id=%s", method, request_id)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}")


def _wrap_unary_response(behavior: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Any]:
    @functools.wraps(behavior)
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # noqa: BLE001 - every failure must become a status
            await _abort_for(error, method, request, context)

    return wrapper


def _wrap_stream_generator(behavior: Callable[..., AsyncIterator[Any]], method: str) -> Callable[..., Any]:
    @functools.wraps(behavior)
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for response in behavior(request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # noqa: BLE001
            await _abort_for(error, method, request, context)

    return wrapper


def _wrap(behavior: Callable[..., Any] | None, method: str) -> Callable[..., Any] | None:
    """Wrap an async servicer method; sync or missing behaviors pass through untouched."""
    if behavior is None:
        return None
    # grpc.aio picks how to drive a handler (await it or iterate it) from its function
    # type, so the wrapper must keep that type.
    if inspect.isasyncgenfunction(behavior):
        return _wrap_stream_generator(behavior, method)
    if inspect.iscoroutinefunction(behavior):
        return _wrap_unary_response(behavior, method)
    return behavior


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions out of every servicer method (unary and streaming) to gRPC status."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        fields = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_wrap(handler.unary_unary, method), **fields)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_wrap(handler.unary_stream, method), **fields)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(_wrap(handler.stream_unary, method), **fields)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(_wrap(handler.stream_stream, method), **fields)
        return handler
