"""Live instances per service, as the router sees them: refreshed from the registry in the background, so a
request never waits on Redis (grpc_backend.py reads `get`)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from shared.errors import BatonError
from shared.registry.base import InstanceInfo, Registry
from shared.service.lifecycle import cancel, every

logger = logging.getLogger(__name__)


@dataclass
class InstanceCache:
    """Live instances per service, refreshed from the registry every `interval_s`."""

    registry: Registry
    interval_s: float = 0.5
    services: tuple[str, ...] = ("prefill", "decode", "kv_transfer", "colocated", "encoder")
    instances: dict[str, list[InstanceInfo]] = field(default_factory=dict)
    # a registry that answers "none" for a service that had instances a moment ago has most likely restarted
    # empty (the instances re-register within a heartbeat): the last list is kept this long meanwhile
    empty_grace_s: float = 10.0
    _task: asyncio.Task[None] | None = None
    _emptied_at: dict[str, float] = field(default_factory=dict)

    async def start(self) -> None:
        await self.refresh()
        self._task = every(self.interval_s, self.refresh, "registry-refresh")

    async def stop(self) -> None:
        await cancel(self._task)

    async def refresh(self) -> None:
        now = asyncio.get_running_loop().time()
        for service in self.services:
            try:
                listed = await self.registry.list(service)
            except BatonError as e:
                logger.warning("registry refresh of %s failed: %s", service, e)
                continue
            if listed or not self.instances.get(service):
                self._emptied_at.pop(service, None)
                self.instances[service] = listed
                continue
            emptied_at = self._emptied_at.setdefault(service, now)
            if now - emptied_at >= self.empty_grace_s:
                self.instances[service] = []  # gone for real

    def get(self, service: str) -> list[InstanceInfo]:
        return [i for i in self.instances.get(service, []) if not i.draining]

    def counts(self) -> dict[str, int]:
        """How many instances of each service the router can send work to now (its /health reports them)."""
        return {service: len(self.get(service)) for service in self.services}
