"""Where finished responses wait for a `previous_response_id`: Redis, or this process without it.

    POST /v1/responses (store: true) ─► put(response id, the conversation so far)   TTL: responses_ttl_s
    POST /v1/responses {previous_response_id} ─► get ─► that conversation + the new input
                                                      (gone or never stored: a clear 400)

Redis (`BATON_ROUTER_REDIS_URL`) lets any router of a deployment continue any response;
without it (`baton up` on one host) a bounded in-process store keeps the newest
`responses_max_stored`. A write still in flight is awaited by a read of the same id, so
a client that continues a response at once finds it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from typing import Any, Protocol

from shared.errors import InvalidRequestError

logger = logging.getLogger(__name__)

Conversation = list[dict[str, Any]]


class ResponseStore(Protocol):
    def put(self, response_id: str, conversation: Conversation) -> None: ...

    async def get(self, response_id: str) -> Conversation | None: ...

    async def close(self) -> None: ...


class MemoryResponseStore:
    """The newest `max_entries` conversations, each for `ttl_s`."""

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[float, Conversation]] = OrderedDict()

    def put(self, response_id: str, conversation: Conversation) -> None:
        self._entries[response_id] = (time.monotonic() + self.ttl_s, conversation)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    async def get(self, response_id: str) -> Conversation | None:
        entry = self._entries.get(response_id)
        if entry is None or entry[0] < time.monotonic():
            self._entries.pop(response_id, None)
            return None
        return entry[1]

    async def close(self) -> None:
        self._entries.clear()


class RedisResponseStore:
    """Conversations as JSON under `<namespace>:response:<id>`, expiring after `ttl_s`."""

    def __init__(self, url: str, namespace: str, ttl_s: float) -> None:
        import redis.asyncio as aioredis

        self._client = aioredis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self._namespace = namespace
        self.ttl_s = ttl_s
        self._writes: dict[str, asyncio.Task[None]] = {}

    def _key(self, response_id: str) -> str:
        return f"{self._namespace}:response:{response_id}"

    def put(self, response_id: str, conversation: Conversation) -> None:
        task = asyncio.get_running_loop().create_task(self._write(response_id, json.dumps(conversation)))
        self._writes[response_id] = task
        task.add_done_callback(lambda _: self._writes.pop(response_id, None))

    async def _write(self, response_id: str, payload: str) -> None:
        try:
            await self._client.set(self._key(response_id), payload, ex=max(1, int(self.ttl_s)))
        except Exception as e:  # the answer went out; only a later continuation will miss it
            logger.warning("response %s: storing it in Redis failed: %s", response_id, e)

    async def get(self, response_id: str) -> Conversation | None:
        pending = self._writes.get(response_id)
        if pending is not None:
            await asyncio.shield(pending)
        try:
            raw = await self._client.get(self._key(response_id))
        except Exception as e:
            raise InvalidRequestError(f"previous_response_id cannot be read now ({e})",
                                      param="previous_response_id") from None
        return None if raw is None else list(json.loads(raw))

    async def close(self) -> None:
        if self._writes:
            await asyncio.gather(*self._writes.values(), return_exceptions=True)
        await self._client.aclose()
