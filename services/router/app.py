"""The router's HTTP app: OpenAI-compatible endpoints over a `GenerationBackend`.

    POST /v1/completions, /v1/chat/completions ─► auth ─► parse + validate ─► prepare (tokenize)
        ─► GenerationRunner.run ─► JSON body, or SSE: data: {chunk}\\n\\n ... data: [DONE]\\n\\n
    GET /v1/models, /health (200 | 503), /metrics (Prometheus text; no auth, like /health)

A streamed request waits for its first delta before answering, so a request refused
up front (429, 503, 400) gets its real status; later failures become an SSE error
event followed by [DONE]. A client that goes away aborts its request on the backend:
while waiting (non-streamed, or before the first delta) a watcher on the ASGI receive
channel notices the disconnect; while streaming, the server cancels the stream.
Each generation request is one SERVER span (`POST /v1/chat/completions`), current while
the backend starts its calls so that every service's spans join its trace; it ends
with the response (for a stream, when the stream ends).
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, StatusCode
from opentelemetry.util.types import AttributeValue
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from services.router.backend import GenerationBackend
from services.router.errors import (
    REQUEST_ID_PREFIXES,
    ErrorBoundary,
    error_payload,
    error_response,
    from_validation_errors,
    install_error_handlers,
    parse_json,
    request_id_of,
)
from services.router.generation import (
    Delta,
    GenerationRunner,
    PreparedRequest,
    prepare_chat,
    prepare_completion,
)
from services.router.metrics import RequestTimer, RouterMetrics
from services.router.openai_format import (
    ChatFormat,
    Collected,
    CompletionFormat,
    ResponseFormat,
    TokenStrings,
    usage,
)
from services.router.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from services.router.settings import RouterSettings
from shared.errors import (
    AuthenticationError,
    BatonError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestAbortedError,
    UnavailableError,
)
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
# FastAPI >= 0.165 traces every request itself once a tracer provider is set; the router's own span
# (one per generation request, carrying baton's attributes) takes its place, and probes stay untraced.
_FASTAPI_OPTIONS: dict[str, Any] = (
    {"telemetry": {"tracing": False}} if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {}
)


def create_app(settings: RouterSettings, backend: GenerationBackend, tokenizer: Any, model_name: str) -> FastAPI:
    """The router app. The caller owns the backend's lifecycle (start before serving, close after)."""
    service = RouterService(settings, backend, tokenizer, model_name)
    app = FastAPI(title="baton router", version="0.1.0", **_FASTAPI_OPTIONS)
    app.state.router = service
    install_error_handlers(app, service.record_error_status)
    app.add_middleware(ErrorBoundary)
    auth = [Depends(api_key_checker(settings.api_keys))]
    app.add_api_route("/health", service.health, methods=["GET"])
    app.add_api_route("/metrics", service.metrics_text, methods=["GET"])
    app.add_api_route("/v1/models", service.list_models, methods=["GET"], dependencies=auth)
    app.add_api_route("/v1/models/{model}", service.get_model, methods=["GET"], dependencies=auth)
    app.add_api_route("/v1/completions", service.completions, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/chat/completions", service.chat_completions, methods=["POST"], dependencies=auth)
    return app


def api_key_checker(api_keys: Sequence[str]) -> Callable[[Request], Awaitable[None]]:
    """A dependency accepting `Authorization: Bearer <key>` for any configured key (none: open)."""
    keys = [k.encode() for k in api_keys]

    async def check(request: Request) -> None:
        if not keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        # compare against every key so the time taken does not tell which one nearly matched
        matches = [hmac.compare_digest(given, key) for key in keys]
        if scheme.lower() != "bearer" or not any(matches):
            raise AuthenticationError("invalid or missing API key: send 'Authorization: Bearer <key>'")

    return check


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


class RouterService:
    """The endpoints' state: settings, backend, tokenizer, metrics."""

    def __init__(self, settings: RouterSettings, backend: GenerationBackend, tokenizer: Any, model_name: str) -> None:
        self.settings = settings
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = RouterMetrics()
        self.runner = GenerationRunner(backend, tokenizer, settings.abort_timeout_s)
        self.token_strings = TokenStrings(tokenizer)
        self.created = int(time.time())

    # ---- plain endpoints ----------------------------------------------------------------
    async def health(self) -> Response:
        if self.backend.healthy():
            return Response('{"status":"ok"}', media_type="application/json")
        return error_response(UnavailableError("no healthy backend"))

    async def metrics_text(self) -> Response:
        content, content_type = self.metrics.render()
        return Response(content, media_type=content_type)

    def _model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, max_model_len=self.settings.max_model_len)

    async def list_models(self) -> Response:
        return _json(ModelList(data=[self._model_card()]))

    async def get_model(self, model: str) -> Response:
        self._check_model(model)
        return _json(self._model_card())

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ModelNotFoundError(f"The model `{name}` does not exist.", param="model")

    def record_error_status(self, request: Request, status: int) -> None:
        if request.url.path in REQUEST_ID_PREFIXES:
            self.metrics.record_status(status)

    # ---- generation endpoints -------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        timer = self.metrics.timer()
        body = await self._parse(request, CompletionRequest)
        self._check_model(body.model)
        prepared = prepare_completion(body, _request_id(request), self.tokenizer, self.settings)
        return await self._respond(request, prepared, CompletionFormat(prepared, self.model_name, self.token_strings),
                                   timer)

    async def chat_completions(self, request: Request) -> Response:
        timer = self.metrics.timer()
        body = await self._parse(request, ChatCompletionRequest)
        self._check_model(body.model)
        prepared = prepare_chat(body, _request_id(request), self.tokenizer, self.settings)
        return await self._respond(request, prepared, ChatFormat(prepared, self.model_name, self.token_strings),
                                   timer)

    async def _parse(self, request: Request, model: type[ModelT]) -> ModelT:
        limit = self.settings.max_request_body_bytes
        too_large = InvalidRequestError(f"the request body exceeds {limit} bytes")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        parts: list[bytes] = []
        size = 0
        try:
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise too_large
                parts.append(part)
        except ClientDisconnect:
            raise RequestAbortedError("the client disconnected while sending the request") from None
        try:
            return model.model_validate(parse_json(b"".join(parts)))
        except ValidationError as e:
            raise from_validation_errors(e.errors()) from None

    async def _respond(
        self, request: Request, prepared: PreparedRequest, fmt: ResponseFormat, timer: RequestTimer
    ) -> Response:
        params = prepared.params
        logger.info("request %s: %d prompt tokens, max_tokens=%d, temperature=%s, stream=%s", prepared.request_id,
                    len(prepared.prompt_token_ids), params.max_tokens, params.temperature, prepared.stream)
        span = _request_span(request, prepared)
        try:
            # current while the backend starts its calls: they take their trace context from it
            with trace.use_span(span, set_status_on_exception=False):
                deltas = self.runner.run(prepared, timer)
                if not prepared.stream:
                    result = await until_disconnected(request, _collect(deltas))
                    _end_span(span, 200, result.num_tokens, result.num_cached_tokens)
                    self.metrics.record_status(200)
                    return _json(fmt.response(result))
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
            delta = first
            while True:
                num_tokens += len(delta.token_ids)
                num_cached = max(num_cached, delta.num_cached_tokens)
                for chunk in fmt.chunks(delta):
                    yield _event(chunk, exclude)
                if delta.finish_reason is not None:
                    break
                delta = await _next(deltas)
            if prepared.include_usage:
                yield _event(fmt.usage_chunk(usage(prepared, num_tokens, num_cached)), None)
            yield DONE_EVENT
            status = 200
        except BatonError as e:
            status = e.http_status
            span.record_exception(e)
            logger.warning("request %s: stream failed: %s (%s)", prepared.request_id, e.message, e.code)
            yield f"data: {_dumps(error_payload(e))}\n\n{DONE_EVENT}"
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


def _request_id(request: Request) -> str:
    request_id = request_id_of(request)
    assert request_id is not None, "ErrorBoundary assigns every request an id"
    return request_id


def _request_span(request: Request, prepared: PreparedRequest) -> Span:
    """The request's SERVER span, continuing the client's trace when it sent a traceparent header."""
    route = request.url.path
    attributes: dict[str, AttributeValue] = {
        REQUEST_ID: prepared.request_id, INPUT_TOKENS: len(prepared.prompt_token_ids),
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


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _event(model: BaseModel, exclude: set[str] | None) -> str:
    return f"data: {model.model_dump_json(exclude=exclude)}\n\n"


def _dumps(payload: dict[str, Any]) -> str:
    return json.dumps(payload, separators=(",", ":"))
