"""In-process registry: the `Registry` semantics over a dict, for one process and for tests.

Expiry is checked against an injectable monotonic clock, so tests step time instead of sleeping.
Nothing here awaits, so one event loop needs no lock.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.registry.base import InstanceInfo, check_service, check_ttl


@dataclass
class _Entry:
    info: InstanceInfo
    expires_at: float  # in the registry's clock


class MemoryRegistry:
    """`Registry` kept in this process's memory."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._ttl_s: dict[tuple[str, str], float] = {}  # remembered at register, used by heartbeat

    async def register(self, info: InstanceInfo, ttl_s: float) -> None:
        check_ttl(ttl_s)
        key = (info.service, info.instance_id)
        self._ttl_s[key] = ttl_s
        self._entries[key] = _Entry(info=info, expires_at=self._clock() + ttl_s)

    async def heartbeat(self, info: InstanceInfo) -> None:
        key = (info.service, info.instance_id)
        ttl_s = self._ttl_s.get(key)
        if ttl_s is None:
            raise ValueError(f"heartbeat for {info.service}/{info.instance_id} before register")
        self._entries[key] = _Entry(info=info, expires_at=self._clock() + ttl_s)

    async def deregister(self, service: str, instance_id: str) -> None:
        check_service(service)
        self._ttl_s.pop((service, instance_id), None)
        self._entries.pop((service, instance_id), None)

    async def list(self, service: str) -> builtins.list[InstanceInfo]:
        check_service(service)
        now = self._clock()
        expired = [key for key, entry in self._entries.items() if entry.expires_at <= now]
        for key in expired:
            del self._entries[key]
        live = [entry.info for (svc, _), entry in self._entries.items() if svc == service]
        return sorted(live, key=lambda info: info.instance_id)

    async def close(self) -> None:
        self._entries.clear()
        self._ttl_s.clear()
