"""Choosing a backend by name, and finding out which ones work on this host."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from shared.transport.base import Transport, TransportError, TransportUnavailableError

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
