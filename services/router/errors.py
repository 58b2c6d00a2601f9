"""The one mapping from errors to OpenAI's error JSON, and the router's error boundary.

    BatonError (shared/errors.py) ─┐
    RequestValidationError ────────┼─► {"error": {"message", "type", "param", "code"}}, status
    HTTPException (404 route, 405) ┘        status = BatonError.http_status (or the HTTP exception's)
    anything else ─► logged with the request id, 500 server_error (last resort)

`ErrorBoundary` is the outermost ASGI middleware: it gives every request an id
(`cmpl-…`, `chatcmpl-…`, `req-…`) in `request.state.request_id` and the
`x-request-id` response header, and turns an exception that escaped everything
else into a 500 in the same JSON shape. Streams that fail after their first
byte report the error as an SSE event (`error_payload`) instead.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.errors import BatonError, InvalidRequestError

logger = logging.getLogger(__name__)

REQUEST_ID_PREFIXES = {"/v1/completions": "cmpl", "/v1/chat/completions": "chatcmpl",
                       "/v1/chat/completions/batch": "chatcmpl", "/v1/responses": "resp"}

StatusRecorder = Callable[[Request, int], None]


def error_type(status: int) -> str:
    """OpenAI's `type` for a status: what its own API returns for the same failures."""
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_payload(error: BatonError) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": error_type(error.http_status),
            "param": error.param,
            "code": error.code,
        }
    }


INTERNAL_DETAIL_HIDDEN = "the server had an error processing this request; its log has the details for the request id"


def public_error(error: BatonError, hide_internal: bool) -> BatonError:
    """What a client is told: with `hide_internal`, a 5xx says only that it happened (the log keeps the
    detail, under the request id); 4xx messages are about the request and stay."""
    if not hide_internal or error.http_status < 500:
        return error
    hidden = BatonError(INTERNAL_DETAIL_HIDDEN)
    hidden.http_status, hidden.code = error.http_status, error.code  # instance attributes: the class keeps its own
    return hidden


def error_response(error: BatonError, request_id: str | None = None) -> JSONResponse:
    headers = {"x-request-id": request_id} if request_id else {}
    retry_after_s = getattr(error, "retry_after_s", None)  # a rate limit says when to come back
    if retry_after_s is not None:
        headers["retry-after"] = str(max(1, math.ceil(retry_after_s)))
    return JSONResponse(error_payload(error), status_code=error.http_status, headers=headers or None)


def request_id_of(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> InvalidRequestError:
    """A pydantic/FastAPI error list as one 400 with the first offending field as `param`."""
    if not errors:
        return InvalidRequestError("invalid request body")
    parts = []
    for err in errors[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return malformed_json(str(err.get("ctx", {}).get("error", err.get("msg", ""))))
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
    first_loc = [str(p) for p in errors[0].get("loc", ()) if p != "body" and not isinstance(p, int)]
    return InvalidRequestError("invalid request: " + "; ".join(parts), param=first_loc[0] if first_loc else None)


def malformed_json(detail: str) -> InvalidRequestError:
    return InvalidRequestError(f"the request body is not valid JSON: {detail}")


def parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise malformed_json(str(e)) from None


def install_error_handlers(app: FastAPI, record_status: StatusRecorder | None = None,
                           hide_internal: bool = False) -> None:
    """Register the three handlers; `record_status(request, status)` sees every error response; with
    `hide_internal`, 5xx bodies keep their detail to the log (public_error)."""

    def respond(request: Request, error: BatonError) -> JSONResponse:
        request_id = request_id_of(request)
        if error.http_status >= 500:
            logger.error("request %s: %s (%s)", request_id, error.message, error.code)
        else:
            logger.info("request %s: %d %s", request_id, error.http_status, error.message)
        if record_status is not None:
            record_status(request, error.http_status)
        return error_response(public_error(error, hide_internal), request_id)

    async def on_baton_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, BatonError)
        return respond(request, exc)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return respond(request, from_validation_errors(exc.errors()))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        error = BatonError(str(exc.detail))
        error.http_status = exc.status_code  # an instance attribute: the class keeps its default
        error.code = "not_found" if exc.status_code == 404 else error_type(exc.status_code)
        return respond(request, error)

    app.add_exception_handler(BatonError, on_baton_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)


class ErrorBoundary:
    """Outermost middleware: request ids, and a 500 JSON for exceptions nothing else handled."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        prefix = REQUEST_ID_PREFIXES.get(scope.get("path", ""), "req")
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("request %s: unhandled error on %s %s", request_id, scope.get("method"),
                             scope.get("path"))
            if started:
                return  # the response is under way; the connection just ends
            error = BatonError("internal server error; see the server log for this request id")
            await error_response(error, request_id)(scope, receive, send)
