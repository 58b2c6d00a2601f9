"""The registry in Redis: what every deployment with more than one host uses.

Layout (all keys under one namespace, so deployments and test runs sharing a server never meet):

```
 baton:{namespace}:instance:{service}:{instance_id}  STRING  InstanceInfo as JSON, PX = the instance's TTL
 baton:{namespace}:index:{service}                   SET     instance_ids that may be live
```

`register`/`heartbeat` write the instance key (SET PX) and add the id to the index in one MULTI.
`list` reads the index (SMEMBERS), fetches every key at once (MGET), and prunes index members whose
key has expired. The prune runs as a Lua script that re-checks each key inside Redis, so it cannot
remove an instance that re-registered between our MGET and the prune. The index itself carries a
long TTL refreshed by every write, so a namespace that everybody left disappears on its own.

Every Redis failure (refused, timed out, reset, server error) surfaces as `UnavailableError`.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import re
from collections.abc import Iterator
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

from shared.errors import BatonError, ConfigError, UnavailableError
from shared.registry.base import InstanceInfo, check_service, check_ttl

logger = logging.getLogger(__name__)

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_MIN_INDEX_TTL_MS = 24 * 3600 * 1000  # index sets outlive any sane instance TTL by far

# KEYS[1] = index set, KEYS[2..n] = instance keys; ARGV[i] = instance id of KEYS[i + 1].
_PRUNE_LUA = """
local removed = 0
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    removed = removed + redis.call('SREM', KEYS[1], ARGV[i - 1])
  end
end
return removed
"""


def _redact(url: str) -> str:
    """The URL without credentials, fit for logs and error messages."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


class RedisRegistry:
    """`Registry` backed by a Redis server (redis.asyncio)."""

    def __init__(self, client: aioredis.Redis, namespace: str, *, where: str = "redis") -> None:
        if not _NAMESPACE_RE.match(namespace):
            raise ConfigError(f"registry namespace must match {_NAMESPACE_RE.pattern}, got {namespace!r}")
        self._client = client
        self._prefix = f"baton:{namespace}"
        self._where = where  # redacted URL for messages
        self._prune = client.register_script(_PRUNE_LUA)
        self._ttl_s: dict[tuple[str, str], float] = {}  # remembered at register, used by heartbeat

    @classmethod
    def from_url(cls, url: str, namespace: str, *, timeout_s: float = 2.0) -> RedisRegistry:
        """Client for `url` (redis://, rediss://, unix://). Connects lazily: a server that is down
        shows up as `UnavailableError` on the first call, after at most about 2 × `timeout_s`."""
        client = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            # One quick retry heals a pooled connection that a server restart left stale; more
            # would only delay the UnavailableError that callers act on.
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), retries=1),
        )
        return cls(client, namespace, where=_redact(url))

    def instance_key(self, service: str, instance_id: str) -> str:
        return f"{self._prefix}:instance:{service}:{instance_id}"

    def index_key(self, service: str) -> str:
        return f"{self._prefix}:index:{service}"

    @contextlib.contextmanager
    def _unavailable_on_error(self, op: str) -> Iterator[None]:
        try:
            yield
        except RedisError as exc:
            raise UnavailableError(
                f"registry {op} failed: redis at {self._where} unavailable ({type(exc).__name__}: {exc})"
            ) from exc

    async def ping(self) -> None:
        """Raise `UnavailableError` unless the server answers."""
        with self._unavailable_on_error("ping"):
            await self._client.ping()

    async def register(self, info: InstanceInfo, ttl_s: float) -> None:
        check_ttl(ttl_s)
        self._ttl_s[(info.service, info.instance_id)] = ttl_s
        await self._write(info, ttl_s, op="register")

    async def heartbeat(self, info: InstanceInfo) -> None:
        ttl_s = self._ttl_s.get((info.service, info.instance_id))
        if ttl_s is None:
            raise ValueError(f"heartbeat for {info.service}/{info.instance_id} before register")
        await self._write(info, ttl_s, op="heartbeat")

    async def _write(self, info: InstanceInfo, ttl_s: float, *, op: str) -> None:
        ttl_ms = max(1, round(ttl_s * 1000))
        index = self.index_key(info.service)
        payload = json.dumps(info.to_dict(), separators=(",", ":"))
        with self._unavailable_on_error(op):
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.set(self.instance_key(info.service, info.instance_id), payload, px=ttl_ms)
                pipe.sadd(index, info.instance_id)
                pipe.pexpire(index, max(_MIN_INDEX_TTL_MS, 3 * ttl_ms))
                await pipe.execute()

    async def deregister(self, service: str, instance_id: str) -> None:
        check_service(service)
        self._ttl_s.pop((service, instance_id), None)
        with self._unavailable_on_error("deregister"):
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(self.instance_key(service, instance_id))
                pipe.srem(self.index_key(service), instance_id)
                await pipe.execute()

    async def list(self, service: str) -> builtins.list[InstanceInfo]:
        check_service(service)
        index = self.index_key(service)
        with self._unavailable_on_error("list"):
            members = await self._client.smembers(index)
            instance_ids = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)
            if not instance_ids:
                return []
            keys = [self.instance_key(service, iid) for iid in instance_ids]
            values = await self._client.mget(keys)
            lapsed = [
                (key, iid) for key, iid, raw in zip(keys, instance_ids, values, strict=True) if raw is None
            ]
            if lapsed:
                removed = await self._prune(
                    keys=[index, *(k for k, _ in lapsed)], args=[i for _, i in lapsed]
                )
                logger.info(
                    "registry: forgot %d lapsed %s instance(s): %s", removed, service, [i for _, i in lapsed]
                )
        infos: builtins.list[InstanceInfo] = []
        for iid, raw in zip(instance_ids, values, strict=True):
            if raw is None:
                continue
            try:
                infos.append(InstanceInfo.from_dict(json.loads(raw)))
            except (ValueError, TypeError, BatonError) as exc:
                # A corrupt or foreign entry must not hide the healthy ones; it lapses on its own.
                logger.warning("registry: skipping unreadable entry %s/%s: %s", service, iid, exc)
        return infos

    async def close(self) -> None:
        self._ttl_s.clear()
        with contextlib.suppress(RedisError):
            await self._client.aclose()
