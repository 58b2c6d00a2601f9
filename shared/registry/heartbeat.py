"""`Heartbeater`: keeps one instance's registry entry alive while its service runs.

```
 start() ──register──► every ttl_s/3: heartbeat(info + load_fn()) ──► stop(): cancel, deregister
              │                       │
              └── registry down? ─────┴── log, try again next tick (register until one succeeds)
```

A registry outage never kills the service: the entry lapses while Redis is away, and the first
beat after it returns re-creates the entry (a heartbeat writes the whole entry, not just its TTL).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable

from shared.errors import BatonError
from shared.registry.base import InstanceInfo, Load, Registry, check_ttl
from shared.registry.kv_summary import KVSummary

logger = logging.getLogger(__name__)


class Heartbeater:
    """Registers `info`, refreshes it with `load_fn()` (and `kv_fn()`, the prefix blocks it holds) every
    `interval_s` (default `ttl_s / 3`), and deregisters on `stop()`. Use from one event loop;
    `start`/`stop` are idempotent."""

    def __init__(
        self,
        registry: Registry,
        info: InstanceInfo,
        load_fn: Callable[[], Load],
        ttl_s: float,
        *,
        interval_s: float | None = None,
        kv_fn: Callable[[], KVSummary] | None = None,
    ) -> None:
        check_ttl(ttl_s)
        self._registry = registry
        self._info = info
        self._load_fn = load_fn
        self._kv_fn = kv_fn  # the prefix blocks it holds, sent with every beat when given
        self._ttl_s = ttl_s
        self._interval_s = ttl_s / 3 if interval_s is None else interval_s
        check_ttl(self._interval_s)
        self._registered = False  # whether a register() has succeeded; until then we retry it
        self._task: asyncio.Task[None] | None = None
        self.num_failures = 0  # consecutive failed beats, for health checks and tests

    @property
    def info(self) -> InstanceInfo:
        """The info as last sent (or about to be sent)."""
        return self._info

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        """Register now (a failure is logged, not raised: the loop keeps trying) and start beating."""
        if self._task is not None:
            return
        await self._beat()
        self._task = asyncio.create_task(self._run(), name=f"heartbeat-{self._info.service}")

    async def set_draining(self, draining: bool = True) -> None:
        """Mark the instance (not) draining and tell the registry at once, not at the next tick."""
        self._info = dataclasses.replace(self._info, draining=draining)
        await self._beat()

    async def stop(self) -> None:
        """Stop beating and remove the entry. Never raises for a registry outage: the entry then
        simply lapses after its TTL."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if not self._registered:
            return
        self._registered = False
        try:
            async with asyncio.timeout(self._interval_s):
                await self._registry.deregister(self._info.service, self._info.instance_id)
        except (BatonError, TimeoutError) as exc:
            logger.warning(
                "registry: could not deregister %s/%s (it lapses in %.1fs): %s",
                self._info.service,
                self._info.instance_id,
                self._ttl_s,
                exc,
            )

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time() + self._interval_s
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            # Fixed cadence from the schedule, not from when the last beat finished, so a slow
            # Redis round trip does not stretch the interval towards the TTL.
            next_at = max(next_at + self._interval_s, loop.time())
            await self._beat()

    async def _beat(self) -> None:
        try:
            self._info = dataclasses.replace(self._info, load=self._load_fn())
            if self._kv_fn is not None:
                self._info = dataclasses.replace(self._info, kv=self._kv_fn())
        except Exception:
            logger.exception(
                "registry: load_fn failed for %s/%s; sending the last load",
                self._info.service,
                self._info.instance_id,
            )
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the cancel that stop() sends.
            async with asyncio.timeout(self._interval_s):
                if self._registered:
                    await self._registry.heartbeat(self._info)
                else:
                    await self._registry.register(self._info, self._ttl_s)
                    self._registered = True
        except (BatonError, TimeoutError, OSError) as exc:
            self.num_failures += 1
            logger.warning(
                "registry: heartbeat %d failed for %s/%s, retrying in %.2fs: %s",
                self.num_failures,
                self._info.service,
                self._info.instance_id,
                self._interval_s,
                exc,
            )
            return
        except Exception:
            # Not an outage but a bug; still keep beating, a dead loop would silently drop the instance.
            self.num_failures += 1
            logger.exception(
                "registry: heartbeat %d failed for %s/%s",
                self.num_failures,
                self._info.service,
                self._info.instance_id,
            )
            return
        if self.num_failures:
            logger.info(
                "registry: %s/%s back in the registry after %d failed beat(s)",
                self._info.service,
                self._info.instance_id,
                self.num_failures,
            )
        self.num_failures = 0
