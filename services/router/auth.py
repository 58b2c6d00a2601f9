"""API keys at the router: who may call, and how much each key may take at once.

    request ─► KeyGate.check (a route dependency)
                 key from `Authorization: Bearer <key>`, compared in constant time against every key
                 (settings' keys plus --api-keys-file, re-read when the file changes: rotation
                 without a restart) ─ no match: 401
                 per key: requests in flight < max_concurrent, and a token bucket of
                 requests_per_minute ─ over: 429 with Retry-After
               ─► the endpoint (a stream holds its slot until its last byte)
               ─► ReleaseKeySlots (outermost ASGI middleware) gives the slot back, however it ended

Keys are known to metrics and logs only by a short hash (`key_id`), never in full.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from shared.errors import AuthenticationError, CapacityError, ConfigError

__all__ = ["KeyGate", "KeyRing", "KeyLimits", "ReleaseKeySlots", "key_id"]

logger = logging.getLogger(__name__)

RELOAD_CHECK_S = 1.0  # how often the keys file's mtime is looked at (a stat per request would be waste)


def key_id(key: bytes) -> str:
    """A key's name in logs and metrics: enough to tell keys apart, useless to an attacker."""
    return "key-" + hashlib.sha256(key).hexdigest()[:8]


def parse_keys(text: str) -> list[bytes]:
    """One key per line; blank lines and `#` comments skipped."""
    return [line.strip().encode() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


class KeyRing:
    """The accepted keys: fixed ones plus a file's, the file re-read when its mtime changes."""

    def __init__(self, keys: Sequence[str], path: Path | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fixed = [k.encode() for k in keys]
        self._path = path
        self._clock = clock
        self._file_keys: list[bytes] = []
        self._mtime_ns: int | None = None
        self._checked_at = -math.inf
        self._lock = threading.Lock()
        if path is not None:
            self._reload()

    @property
    def enabled(self) -> bool:
        return bool(self._fixed) or self._path is not None

    def _reload(self) -> None:
        assert self._path is not None
        first = self._mtime_ns is None
        try:
            mtime_ns = os.stat(self._path).st_mtime_ns
            if mtime_ns == self._mtime_ns:
                return
            keys = parse_keys(self._path.read_text())
        except OSError as exc:
            if first:  # at start: a missing or unreadable file is a configuration error
                raise ConfigError(f"cannot read the API keys file {self._path}: {exc.strerror}") from None
            logger.warning("API keys file %s unreadable (%s): keeping the last keys", self._path, exc.strerror)
            return
        self._file_keys, self._mtime_ns = keys, mtime_ns
        logger.info("API keys file %s %s: %d keys", self._path, "read" if first else "changed, re-read", len(keys))

    def keys(self) -> list[bytes]:
        if self._path is not None:
            now = self._clock()
            with self._lock:
                if now - self._checked_at >= RELOAD_CHECK_S:
                    self._checked_at = now
                    self._reload()
        return self._fixed + self._file_keys

    def match(self, token: bytes) -> bytes | None:
        """The key `token` is, or None. Every key is compared (in constant time each), so the time taken
        does not tell which one nearly matched."""
        found = None
        for key in self.keys():
            if hmac.compare_digest(token, key):
                found = key
        return found


@dataclass
class _Bucket:
    tokens: float
    updated_s: float
    in_flight: int = 0


class KeyLimits:
    """Per key: at most `max_concurrent` requests in flight and `requests_per_minute` (a token bucket that
    holds a minute's worth, so a burst up to the rate is fine). 0 turns a limit off."""

    def __init__(self, max_concurrent: int = 0, requests_per_minute: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_concurrent = max_concurrent
        self.per_minute = requests_per_minute
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_concurrent > 0 or self.per_minute > 0

    def acquire(self, key: str) -> float | None:
        """Take a slot for `key`: None when granted, else the seconds to wait before a retry can pass."""
        now = self._clock()
        with self._lock:
            b = self._buckets.get(key)
            if b is None:
                b = self._buckets[key] = _Bucket(self.per_minute, now)
            if self.per_minute > 0:
                b.tokens = min(self.per_minute, b.tokens + (now - b.updated_s) * self.per_minute / 60.0)
                b.updated_s = now
            if self.max_concurrent > 0 and b.in_flight >= self.max_concurrent:
                return 1.0  # a slot frees when a request ends: no better guess than soon
            if self.per_minute > 0:
                if b.tokens < 1.0:
                    return (1.0 - b.tokens) * 60.0 / self.per_minute
                b.tokens -= 1.0
            b.in_flight += 1
            return None

    def release(self, key: str) -> None:
        with self._lock:
            b = self._buckets.get(key)
            assert b is not None and b.in_flight > 0, f"{key} released a slot it did not hold"
            b.in_flight -= 1

    def in_flight(self, key: str) -> int:
        with self._lock:
            b = self._buckets.get(key)
            return b.in_flight if b is not None else 0


_SLOT = "key_slot"  # request.state attribute: the key id whose slot this request holds


class KeyGate:
    """The route dependency: authenticate, then take the key's slot (see the module docstring)."""

    def __init__(self, ring: KeyRing, limits: KeyLimits) -> None:
        self.ring = ring
        self.limits = limits

    async def check(self, request: Request) -> None:
        if not self.ring.enabled:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        key = self.ring.match(token.strip().encode())
        if scheme.lower() != "bearer" or key is None:
            raise AuthenticationError("invalid or missing API key: send 'Authorization: Bearer <key>'")
        if not self.limits.enabled:
            return
        kid = key_id(key)
        retry_after_s = self.limits.acquire(kid)
        if retry_after_s is not None:
            raise RateLimitedError(f"API key {kid} is over its limit ({self._describe()}); retry after "
                                   f"{math.ceil(retry_after_s)} s", retry_after_s)
        setattr(request.state, _SLOT, kid)

    def _describe(self) -> str:
        parts = []
        if self.limits.max_concurrent:
            parts.append(f"{self.limits.max_concurrent} in flight")
        if self.limits.per_minute:
            parts.append(f"{self.limits.per_minute:g} a minute")
        return ", ".join(parts)


class RateLimitedError(CapacityError):
    """429 with a Retry-After header (the error handler adds it)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ReleaseKeySlots:
    """Outermost ASGI middleware: a request's key slot goes back when its response is over (a stream's
    last byte, a client gone, an error), exactly once."""

    def __init__(self, app: ASGIApp, gate: KeyGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            state = scope.get("state")
            kid = state.pop(_SLOT, None) if isinstance(state, dict) else None
            if kid is not None:
                self.gate.limits.release(kid)
