"""Choosing a backend by name, and finding out which ones work on this host."""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any

from shared.transport.base import Transport, TransportError, TransportUnavailableError

logger = logging.getLogger(__name__)

TRANSPORT_KINDS = ("nixl", "ucxx", "tcp")  # preference order
_BACKENDS = {
    "nixl": ("shared.transport.nixl_backend", "NixlTransport", "nixl_api"),
    "ucxx": ("shared.transport.ucxx_backend", "UcxxTransport", "ucxx_api"),
    "tcp": ("shared.transport.tcp_backend", "TcpTransport", None),
}


def make_transport(kind: str, name: str, **options: Any) -> Transport:
    """An agent called `name` of backend `kind` ("nixl", "ucxx" or "tcp"); options go to its constructor."""
    if kind not in _BACKENDS:
        raise TransportError(f"unknown transport {kind!r}; choose one of {', '.join(TRANSPORT_KINDS)}")
    module_name, class_name, _ = _BACKENDS[kind]
    cls = getattr(importlib.import_module(module_name), class_name)
    transport: Transport = cls(name, **options)
    return transport


@functools.cache
def unavailable_reason(kind: str) -> str | None:
    """Why `kind` cannot run here (its package is missing or does not load), or None if it can."""
    if kind not in _BACKENDS:
        return f"unknown transport {kind!r}"
    module_name, _, probe = _BACKENDS[kind]
    if probe is None:
        return None
    try:
        getattr(importlib.import_module(module_name), probe)()
    except TransportUnavailableError as e:
        return e.message
    return None


def available_transports() -> list[str]:
    """The backends whose packages load on this host, in preference order (tcp always)."""
    return [kind for kind in TRANSPORT_KINDS if unavailable_reason(kind) is None]


def resolve_kind(kind: str) -> str:
    """`auto` -> the first backend that works here; anything else is checked and returned."""
    if kind == "auto":
        chosen = available_transports()[0]
        skipped = {k: unavailable_reason(k) for k in TRANSPORT_KINDS[: TRANSPORT_KINDS.index(chosen)]}
        logger.info("transport auto: %s (preference %s%s)", chosen, " > ".join(TRANSPORT_KINDS),
                    "".join(f"; {k} unavailable: {why}" for k, why in skipped.items()))
        return chosen
    reason = unavailable_reason(kind)
    if reason is not None:
        raise TransportUnavailableError(f"transport {kind} cannot run here: {reason}")
    return kind


def service_transport(kind: str, name: str, *, host: str = "127.0.0.1", advertise_host: str = "",
                      transfer_timeout_s: float = 30.0) -> Transport:
    """The agent a service runs: `host` is where a TCP agent listens (the others find their own way)."""
    options: dict[str, Any] = {"transfer_timeout_s": transfer_timeout_s}
    if kind == "tcp":
        options.update(host=host, advertise_host=advertise_host or None)
    return make_transport(resolve_kind(kind), name, **options)
