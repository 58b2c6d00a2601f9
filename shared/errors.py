"""The one error hierarchy of baton.

Every failure a caller can act on is a `BatonError` subclass with a stable
`code` (the OpenAI error `type`/`code` pair is derived from it) and an HTTP
status. The gRPC mapping and the OpenAI JSON mapping each live in one place at
the service edges; library code only raises these.
"""

from __future__ import annotations


class BatonError(Exception):
    """Base of every error baton raises on purpose."""

    http_status: int = 500
    code: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(BatonError):
    """The request itself is malformed or asks for something impossible."""

    http_status = 400
    code = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    """Prompt (plus requested tokens) does not fit the model's context."""

    code = "context_length_exceeded"


class AuthenticationError(BatonError):
    http_status = 401
    code = "invalid_api_key"


class PermissionDeniedError(BatonError):
    """The caller is known but may not touch this object (a handoff named without its capability)."""

    http_status = 403
    code = "permission_denied"


class ModelNotFoundError(BatonError):
    """Unknown model name or spec (alias, GGUF file or HF directory)."""

    http_status = 404
    code = "model_not_found"


class CapacityError(BatonError):
    """Over capacity right now (queue full, KV store full): retry later."""

    http_status = 429
    code = "rate_limit_exceeded"


class UnavailableError(BatonError):
    """No healthy backend can take the request."""

    http_status = 503
    code = "service_unavailable"


class KVTransferError(UnavailableError):
    """Moving a request's KV between services failed (a peer died, a transfer broke or timed out)."""

    code = "kv_transfer_failed"


class RequestAbortedError(BatonError):
    """The request was aborted (client gone, deadline, peer failure)."""

    http_status = 499
    code = "request_aborted"


class HandoffNotFoundError(BatonError):
    """A KV handoff is gone: never stored, already claimed, released or expired.

    NOT_FOUND between services; a client of the router sees 503 (the request's
    KV was lost inside baton, not a resource the client named).
    """

    http_status = 503
    code = "handoff_not_found"


class ConfigError(BatonError):
    """A setting or model file cannot be used as given."""

    http_status = 500
    code = "config_error"
