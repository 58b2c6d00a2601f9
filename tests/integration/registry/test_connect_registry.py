"""A service starting against its registry: Redis answers, or the start fails naming where it looked."""

from __future__ import annotations

import asyncio
import socket

import pytest

from shared.errors import UnavailableError
from shared.registry import MemoryRegistry, RedisRegistry, connect_registry


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_reachable_redis_is_connected(redis_url: str, namespace: str) -> None:
    async def go() -> None:
        registry = await connect_registry(redis_url, namespace, wait_s=5.0)
        assert isinstance(registry, RedisRegistry)
        await registry.close()

    asyncio.run(go())


def test_an_unreachable_redis_fails_the_start_naming_it() -> None:
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    with pytest.raises(UnavailableError, match=r"cannot reach the registry after 1 s: .*redis://127\.0\.0\.1:\d+/0"):
        asyncio.run(connect_registry(url, "baton", wait_s=1.0))


def test_credentials_stay_out_of_the_reason() -> None:
    url = f"redis://user:secret@127.0.0.1:{_closed_port()}/0"
    with pytest.raises(UnavailableError) as caught:
        asyncio.run(connect_registry(url, "baton", wait_s=0.0))
    assert "secret" not in caught.value.message


def test_no_url_is_the_in_process_registry() -> None:
    assert isinstance(asyncio.run(connect_registry("", "baton")), MemoryRegistry)
