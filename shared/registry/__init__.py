"""Service registry: instances announce themselves with a heartbeat TTL and their load; the router
lists the live ones and picks with `pick_decode` / `pick_prefill`.

`make_registry(redis_url, namespace)` gives a `RedisRegistry` when a URL is configured (every
deployment with more than one host) and an in-process `MemoryRegistry` otherwise.
"""

from __future__ import annotations

from shared.registry.base import SERVICE_NAMES, InstanceInfo, Load, Registry, ServiceName
from shared.registry.heartbeat import Heartbeater
from shared.registry.memory_registry import MemoryRegistry
from shared.registry.picker import pick_decode, pick_prefill
from shared.registry.redis_registry import RedisRegistry


def make_registry(redis_url: str | None, namespace: str) -> Registry:
    """`RedisRegistry` for `redis_url` (lazy: nothing connects until the first call), or a fresh
    `MemoryRegistry` when `redis_url` is None or empty, in which case `namespace` has no effect
    (a memory registry is private to its process already)."""
    if redis_url:
        return RedisRegistry.from_url(redis_url, namespace)
    return MemoryRegistry()


__all__ = [
    "SERVICE_NAMES",
    "Heartbeater",
    "InstanceInfo",
    "Load",
    "MemoryRegistry",
    "RedisRegistry",
    "Registry",
    "ServiceName",
    "make_registry",
    "pick_decode",
    "pick_prefill",
]
