"""Service registry: instances announce themselves with a heartbeat TTL and their load; the router
lists the live ones and picks with `pick_decode` / `pick_prefill`.

`make_registry(redis_url, namespace)` gives a `RedisRegistry` when a URL is configured (every
deployment with more than one host) and an in-process `MemoryRegistry` otherwise.
`connect_registry` is how a service starts with one: it waits a little for Redis and otherwise
exits with the reason, so that its orchestrator restarts it instead of it serving unregistered.
"""

from __future__ import annotations

import asyncio
import logging
import time

from shared.errors import UnavailableError
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


async def connect_registry(redis_url: str, namespace: str, wait_s: float = 10.0) -> Registry:
    """`make_registry`, then (Redis) wait up to `wait_s` for the server to answer a ping. Raises
    `UnavailableError` naming the redacted URL when it never does: a service's start-up fails with it
    (a non-zero exit) rather than load a model it could never announce."""
    registry = make_registry(redis_url, namespace)
    if not isinstance(registry, RedisRegistry):
        return registry
    deadline = time.monotonic() + wait_s
    while True:
        try:
            await registry.ping()
            return registry
        except UnavailableError as exc:
            if time.monotonic() >= deadline:
                await registry.close()
                raise UnavailableError(f"cannot reach the registry after {wait_s:.0f} s: {exc.message}") from exc
            logging.getLogger(__name__).warning("%s; retrying", exc.message)
            await asyncio.sleep(1.0)


__all__ = [
    "SERVICE_NAMES",
    "Heartbeater",
    "InstanceInfo",
    "Load",
    "MemoryRegistry",
    "connect_registry",
    "RedisRegistry",
    "Registry",
    "ServiceName",
    "make_registry",
    "pick_decode",
    "pick_prefill",
]
