"""Serving a prepared request over HTTP: a JSON body, or an SSE stream, with disconnects and spans.

    read_body ─► (endpoint prepares) ─► Responder.respond ─► GenerationRunner.run ─► deltas
        not streamed: collect all deltas (a disconnect cancels and aborts) ─► fmt.response ─► JSON
        streamed: wait for the first delta (so a refusal gets its real status) ─► SSE events
                  ─► [usage] ─► [DONE]; a later failure is an SSE error event, then [DONE]

A client that goes away aborts its request on the backend: while waiting (non-streamed,
or before the first delta) a watcher on the ASGI receive channel notices the disconnect;
while streaming, the server cancels the stream. Each generation request is one SERVER
span, current while the backend starts its calls so that every service's spans join its
trace; it ends with the response (for a stream, when the stream ends).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, StatusCode
from opentelemetry.util.types import AttributeValue
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from services.router.errors import (
    error_payload,
    from_validation_errors,
    parse_json,
    public_error,
    request_id_of,
)
from services.router.generation import Delta, GenerationRunner, PreparedRequest
from services.router.metrics import RequestTimer, RouterMetrics
from services.router.openai_format import Collected, ResponseFormat, usage
from shared.errors import BatonError, InvalidRequestError, RequestAbortedError
from shared.telemetry import (
    CACHED_TOKENS,
    INPUT_TOKENS,
    OUTPUT_TOKENS,
    REQUEST_ID,
    STREAM,
    extract_http,
    tracer,
)

logger = logging.getLogger(__name__)
_tracer = tracer(__name__)

T = TypeVar("T")
ModelT = TypeVar("ModelT", bound=BaseModel)
DONE_EVENT = "data: [DONE]\n\n"


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it and raising RequestAbortedError if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if not task.cancelled():
        return task.result()
    raise RequestAbortedError("the client disconnected")


async def _wait_for_disconnect(request: Request) -> None:
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # a broken receive channel: the client is as good as gone
        logger.debug("request %s: receive failed while waiting", request_id_of(request), exc_info=True)


async def _next(deltas: AsyncIterator[Delta]) -> Delta:
    return await deltas.__anext__()


async def _collect(deltas: AsyncIterator[Delta]) -> Collected:
    result = Collected()
    async for delta in deltas:
        result.add(delta)
    return result



async def read_body(request: Request, model: type[ModelT], limit_bytes: int) -> ModelT:
    """The request body as `model`; 400 when it is too large, not JSON, or not valid."""
    too_large = InvalidRequestError(f"the request body exceeds {limit_bytes} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit_bytes:
        raise too_large
    parts: list[bytes] = []
    size = 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > limit_bytes:
                raise too_large
            parts.append(part)
    except ClientDisconnect:
        raise RequestAbortedError("the client disconnected while sending the request") from None
    try:
        return model.model_validate(parse_json(b"".join(parts)))
    except ValidationError as e:
        raise from_validation_errors(e.errors()) from None


class Responder:
    """Runs prepared requests and answers them as JSON or SSE, recording status metrics."""

    def __init__(self, runner: GenerationRunner, metrics: RouterMetrics, hide_internal: bool = False) -> None:
        self.runner = runner
        self.metrics = metrics
        self.hide_internal = hide_internal  # 5xx detail stays in the log (errors.public_error)

    async def respond(
        self, request: Request, prepared: PreparedRequest, fmt: ResponseFormat, timer: RequestTimer
    ) -> Response:
        """The response to `prepared`, formatted by `fmt`; `timer` started when the request arrived."""
        params = prepared.params
        logger.info("request %s: %d prompt tokens, %d choices, max_tokens=%d, temperature=%s, stream=%s",
                    prepared.request_id, prepared.num_prompt_tokens, prepared.num_choices, params.max_tokens,
                    params.temperature, prepared.stream)
        span = _request_span(request, prepared)
        try:
            # current while the backend starts its calls: they take their trace context from it
            with trace.use_span(span, set_status_on_exception=False):
                deltas = self.runner.run(prepared, timer)
                if not prepared.stream:
                    result = await until_disconnected(request, _collect(deltas))
                    _end_span(span, 200, result.num_tokens, result.num_cached_tokens)
                    self.metrics.record_status(200)
                    return json_response(fmt.response(result))
                first = await until_disconnected(request, _next(deltas))
        except BaseException as e:
            _end_span(span, _http_status(e))
            raise
        return _ClosingStreamingResponse(self._events(prepared, fmt, first, deltas, span),
                                         media_type="text/event-stream", headers={"cache-control": "no-cache"})

    async def _events(
        self, prepared: PreparedRequest, fmt: ResponseFormat, first: Delta,
        deltas: AsyncGenerator[Delta, None], span: Span,
    ) -> AsyncIterator[str]:
        """The SSE body of a streamed request whose first delta is in hand; ends its span."""
        status = RequestAbortedError.http_status  # unless it ends below: the client went away
        exclude = None if prepared.include_usage else {"usage"}
        num_tokens, num_cached = 0, 0
        try:
            for chunk in fmt.start_chunks():
                yield _event(chunk, exclude)
            delta: Delta | None = first
            while delta is not None:  # the runner stops once every choice has finished
                num_tokens += len(delta.token_ids)
                num_cached = max(num_cached, delta.num_cached_tokens)
                for chunk in fmt.chunks(delta):
                    yield _event(chunk, exclude)
                delta = await anext(deltas, None)
            if prepared.include_usage:
                yield _event(fmt.usage_chunk(usage(prepared, num_tokens, num_cached)), None)
            yield DONE_EVENT
            status = 200
        except BatonError as e:
            status = e.http_status
            span.record_exception(e)
            logger.warning("request %s: stream failed: %s (%s)", prepared.request_id, e.message, e.code)
            yield f"data: {_dumps(error_payload(public_error(e, self.hide_internal)))}\n\n{DONE_EVENT}"
        except Exception as e:
            status = 500
            span.record_exception(e)
            logger.exception("request %s: stream failed unexpectedly", prepared.request_id)
            error = BatonError("internal server error; see the server log for this request id")
            yield f"data: {_dumps(error_payload(error))}\n\n{DONE_EVENT}"
        finally:
            await deltas.aclose()  # a no-op once finished; otherwise aborts on the backend
            self.metrics.record_status(status)
            _end_span(span, status, num_tokens, num_cached)


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its body iterator however the response ends.

    When the client disconnects, Starlette cancels the sending task, which may leave the
    iterator suspended at a `yield` until garbage collection; closing it here runs its
    `finally` (the backend abort) at once.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def request_id(request: Request) -> str:
    value = request_id_of(request)
    assert value is not None, "ErrorBoundary assigns every request an id"
    return value


def _request_span(request: Request, prepared: PreparedRequest) -> Span:
    """The request's SERVER span, continuing the client's trace when it sent a traceparent header."""
    route = request.url.path
    attributes: dict[str, AttributeValue] = {
        REQUEST_ID: prepared.request_id, INPUT_TOKENS: prepared.num_prompt_tokens,
        STREAM: prepared.stream, "http.request.method": request.method, "http.route": route,
    }
    return _tracer.start_span(f"{request.method} {route}", context=extract_http(request.headers),
                              kind=SpanKind.SERVER, attributes=attributes)


def _http_status(error: BaseException) -> int:
    if isinstance(error, BatonError):
        return error.http_status
    return RequestAbortedError.http_status if isinstance(error, asyncio.CancelledError) else 500


def _end_span(span: Span, status: int, num_tokens: int | None = None, num_cached_tokens: int = 0) -> None:
    """End the request span with its HTTP status and token counts (no-op when off or already ended)."""
    if not span.is_recording():
        return
    span.set_attribute("http.response.status_code", status)
    if num_tokens is not None:
        span.set_attributes({OUTPUT_TOKENS: num_tokens, CACHED_TOKENS: num_cached_tokens})
    if status >= 500:
        span.set_status(StatusCode.ERROR)
    span.end()


def json_response(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _event(model: BaseModel, exclude: set[str] | None) -> str:
    return f"data: {model.model_dump_json(exclude=exclude)}\n\n"


def _dumps(payload: dict[str, Any]) -> str:
    return json.dumps(payload, separators=(",", ":"))
