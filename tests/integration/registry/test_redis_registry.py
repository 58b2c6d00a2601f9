from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import redis.asyncio as aioredis

from shared.errors import UnavailableError
from shared.registry import Heartbeater, Load, RedisRegistry, make_registry
from tests.helpers.redis_server import free_port, start_redis, stop_redis
from tests.helpers.registry_factories import decode_load, make_instance


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def ids(reg: RedisRegistry, service: str = "decode") -> list[str]:
    return [i.instance_id for i in await reg.list(service)]


async def wait_until(predicate, timeout_s: float, step_s: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(step_s)
    return False


def test_register_list_roundtrip(redis_url: str, namespace: str) -> None:
    async def scenario() -> None:
        reg = RedisRegistry.from_url(redis_url, namespace)
        d2 = make_instance("d2", load=decode_load(free=5, total=9, running=1, waiting=2), draining=True)
        await reg.register(d2, ttl_s=30)
        await reg.register(make_instance("d1"), ttl_s=30)
        await reg.register(make_instance("p1", "prefill"), ttl_s=30)
        listed = await reg.list("decode")
        assert [i.instance_id for i in listed] == ["d1", "d2"]
        assert listed[1] == d2  # every field survives the JSON round trip
        assert await ids(reg, "prefill") == ["p1"]
        assert await reg.list("router") == []
        await reg.close()

    run(scenario())


def test_heartbeat_updates_load_and_refreshes_ttl(redis_url: str, namespace: str) -> None:
    async def scenario() -> None:
        reg = RedisRegistry.from_url(redis_url, namespace)
        info = make_instance("d1", load=decode_load(free=100))
        await reg.register(info, ttl_s=1.0)
        await asyncio.sleep(0.6)
        await reg.heartbeat(dataclasses.replace(info, load=decode_load(free=3, running=7)))
        await asyncio.sleep(0.6)  # 1.2 s after register, 0.6 s after the heartbeat
        (listed,) = await reg.list("decode")
        assert listed.load == decode_load(free=3, running=7)
        pttl_ms = await reg._client.pttl(reg.instance_key("decode", "d1"))
        assert 0 < pttl_ms <= 1000
        await reg.close()

    run(scenario())


def test_ttl_expiry_forgets_instance_and_prunes_index(redis_url: str, namespace: str) -> None:
    async def scenario() -> None:
        reg = RedisRegistry.from_url(redis_url, namespace)
        await reg.register(make_instance("short"), ttl_s=0.5)
        await reg.register(make_instance("long"), ttl_s=30)
        assert await ids(reg) == ["long", "short"]
        await asyncio.sleep(0.7)
        assert await ids(reg) == ["long"]
        members = await reg._client.smembers(reg.index_key("decode"))
        assert members == {b"long"}  # the lapsed member was pruned from the index
        await reg.close()

    run(scenario())


def test_deregister(redis_url: str, namespace: str) -> None:
    async def scenario() -> None:
        reg = RedisRegistry.from_url(redis_url, namespace)
        info = make_instance("d1")
        await reg.register(info, ttl_s=30)
        await reg.deregister("decode", "d1")
        assert await reg.list("decode") == []
        assert not await reg._client.exists(reg.instance_key("decode", "d1"))
        await reg.deregister("decode", "d1")  # idempotent
        with pytest.raises(ValueError, match="before register"):
            await reg.heartbeat(info)
        await reg.close()

    run(scenario())


def test_namespaces_do_not_see_each_other(redis_url: str, namespace: str) -> None:
    async def scenario() -> None:
        blue = RedisRegistry.from_url(redis_url, f"{namespace}-blue")
        green = RedisRegistry.from_url(redis_url, f"{namespace}-green")
        await blue.register(make_instance("d-blue"), ttl_s=30)
        await green.register(make_instance("d-green"), ttl_s=30)
        assert await ids(blue) == ["d-blue"]
        assert await ids(green) == ["d-green"]
        await green.deregister("decode", "d-blue")  # another namespace's id: no effect here
        assert await ids(blue) == ["d-blue"]
        await blue.close()
        await green.close()

    run(scenario())


def test_unreadable_entry_is_skipped_not_fatal(redis_url: str, namespace: str) -> None:
    async def scenario() -> None:
        reg = RedisRegistry.from_url(redis_url, namespace)
        await reg.register(make_instance("good"), ttl_s=30)
        await reg._client.set(reg.instance_key("decode", "bad"), b"{not json", px=30_000)
        await reg._client.sadd(reg.index_key("decode"), "bad")
        assert await ids(reg) == ["good"]
        await reg.close()

    run(scenario())


def test_make_registry_with_url_uses_redis(redis_url: str, namespace: str) -> None:
    async def scenario() -> None:
        writer = make_registry(redis_url, namespace)
        reader = make_registry(redis_url, namespace)
        assert isinstance(writer, RedisRegistry)
        await writer.register(make_instance("k1", "kv_transfer"), ttl_s=30)
        assert [i.instance_id for i in await reader.list("kv_transfer")] == ["k1"]
        await writer.close()
        await reader.close()

    run(scenario())


def test_heartbeater_keeps_instance_alive_past_ttl_and_removes_it_on_stop(
    redis_url: str, namespace: str
) -> None:
    async def scenario() -> None:
        reg = RedisRegistry.from_url(redis_url, namespace)
        observer = RedisRegistry.from_url(redis_url, namespace)  # another process's view, e.g. the router
        num_beats = 0

        def load_fn() -> Load:
            nonlocal num_beats
            num_beats += 1
            return Load(num_waiting=num_beats)

        hb = Heartbeater(reg, make_instance("p1", "prefill"), load_fn, ttl_s=0.6)
        await hb.start()
        await asyncio.sleep(1.5)  # 2.5 × the TTL
        (listed,) = await observer.list("prefill")
        assert listed.load.num_waiting >= 5  # beats every 0.2 s carry fresh load
        await hb.stop()
        assert await observer.list("prefill") == []  # gone at once, not after the TTL
        await reg.close()
        await observer.close()

    run(scenario())


def test_unreachable_redis_raises_unavailable() -> None:
    async def scenario() -> None:
        reg = RedisRegistry.from_url(f"redis://127.0.0.1:{free_port()}/0", "nobody", timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(UnavailableError, match="redis at redis://127.0.0.1"):
            await reg.list("decode")
        with pytest.raises(UnavailableError):
            await reg.register(make_instance("d1"), ttl_s=1)
        assert time.monotonic() - t0 < 3
        await reg.close()

    run(scenario())


@pytest.mark.usefixtures("require_redis_server")
def test_redis_killed_then_restarted_heartbeater_survives_and_reregisters(namespace: str) -> None:
    proc, url = start_redis()  # our own server: this test kills it
    port = int(url.rsplit(":", 1)[1].split("/")[0])

    async def scenario() -> None:
        nonlocal proc
        reg = RedisRegistry.from_url(url, namespace, timeout_s=0.5)
        observer = RedisRegistry.from_url(url, namespace, timeout_s=0.5)
        hb = Heartbeater(reg, make_instance("d1"), lambda: decode_load(free=42), ttl_s=0.6)
        await hb.start()
        assert await ids(observer) == ["d1"]

        stop_redis(proc, kill=True)
        with pytest.raises(UnavailableError):
            await observer.list("decode")
        await asyncio.sleep(0.5)  # a couple of failed beats
        assert hb.running and hb.num_failures >= 1

        proc, _ = start_redis(port)  # back, and empty: no persistence
        assert await wait_until(lambda: _has(observer, "d1"), timeout_s=3.0)
        assert hb.num_failures == 0
        (listed,) = await observer.list("decode")
        assert listed.load.num_kv_blocks_free == 42

        await hb.stop()
        assert await observer.list("decode") == []
        await reg.close()
        await observer.close()

    try:
        run(scenario())
    finally:
        stop_redis(proc)


async def _has(reg: RedisRegistry, instance_id: str) -> bool:
    try:
        return instance_id in await ids(reg)
    except UnavailableError:
        return False


def test_close_releases_connections(redis_url: str, namespace: str) -> None:
    async def scenario() -> None:
        probe = aioredis.Redis.from_url(redis_url)
        num_clients_before = len(await probe.client_list())
        reg = RedisRegistry.from_url(redis_url, namespace)
        await reg.register(make_instance("d1"), ttl_s=30)
        assert len(await probe.client_list()) == num_clients_before + 1
        await reg.close()
        assert len(await probe.client_list()) == num_clients_before
        await probe.aclose()

    run(scenario())
