"""InstanceCache over the in-memory registry: a registry that restarts empty does not blind the router."""

from __future__ import annotations

import asyncio
import time

from services.router.instance_cache import InstanceCache
from shared.registry.base import InstanceInfo, Load
from shared.registry.memory_registry import MemoryRegistry


def _info(instance_id: str) -> InstanceInfo:
    return InstanceInfo("decode", instance_id, f"{instance_id}:1", "", "m", Load(), time.time())


def test_an_emptied_registry_keeps_the_last_instances_for_the_grace_then_drops_them() -> None:
    async def main() -> None:
        registry = MemoryRegistry()
        await registry.register(_info("d0"), 60)
        await registry.register(_info("d1"), 60)
        cache = InstanceCache(registry, empty_grace_s=0.3)
        await cache.refresh()
        await registry.deregister("decode", "d1")
        await cache.refresh()
        assert [i.instance_id for i in cache.get("decode")] == ["d0"]  # one leaving is seen at once
        await registry.deregister("decode", "d0")  # now none: as after a Redis restart
        await cache.refresh()
        assert [i.instance_id for i in cache.get("decode")] == ["d0"]
        await registry.register(_info("d0"), 60)  # re-registered within the grace
        await cache.refresh()
        await registry.deregister("decode", "d0")
        await cache.refresh()
        await asyncio.sleep(0.35)
        await cache.refresh()
        assert cache.get("decode") == []  # gone for real

    asyncio.run(main())
