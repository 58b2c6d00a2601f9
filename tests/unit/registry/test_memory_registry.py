from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from shared.errors import ConfigError
from shared.registry import Heartbeater, InstanceInfo, Load, MemoryRegistry, make_registry
from tests.helpers.registry_factories import decode_load, make_instance


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_register_and_list_per_service_sorted() -> None:
    async def scenario() -> None:
        reg = MemoryRegistry(clock=FakeClock())
        await reg.register(make_instance("d2"), ttl_s=10)
        await reg.register(make_instance("d1"), ttl_s=10)
        await reg.register(make_instance("p1", "prefill"), ttl_s=10)
        assert [i.instance_id for i in await reg.list("decode")] == ["d1", "d2"]
        assert [i.instance_id for i in await reg.list("prefill")] == ["p1"]
        assert await reg.list("kv_transfer") == []

    run(scenario())


def test_heartbeat_updates_load_and_pushes_expiry_back() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        reg = MemoryRegistry(clock=clock)
        info = make_instance("d1", load=decode_load(free=100))
        await reg.register(info, ttl_s=3)
        clock.advance(2)
        await reg.heartbeat(dataclasses.replace(info, load=decode_load(free=7, running=2)))
        clock.advance(2)  # 4 s after register, 2 s after the heartbeat
        (listed,) = await reg.list("decode")
        assert listed.load == decode_load(free=7, running=2)
        clock.advance(1)  # exactly ttl after the heartbeat: lapsed
        assert await reg.list("decode") == []

    run(scenario())


def test_ttl_expiry_forgets_only_the_silent_instance() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        reg = MemoryRegistry(clock=clock)
        await reg.register(make_instance("short"), ttl_s=1)
        await reg.register(make_instance("long"), ttl_s=5)
        clock.advance(0.999)
        assert [i.instance_id for i in await reg.list("decode")] == ["long", "short"]
        clock.advance(0.002)
        assert [i.instance_id for i in await reg.list("decode")] == ["long"]

    run(scenario())


def test_heartbeat_after_lapse_brings_instance_back() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        reg = MemoryRegistry(clock=clock)
        info = make_instance("d1")
        await reg.register(info, ttl_s=1)
        clock.advance(5)
        assert await reg.list("decode") == []
        await reg.heartbeat(info)
        assert await reg.list("decode") == [info]

    run(scenario())


def test_deregister_removes_and_heartbeat_needs_register() -> None:
    async def scenario() -> None:
        reg = MemoryRegistry(clock=FakeClock())
        info = make_instance("d1")
        with pytest.raises(ValueError, match="before register"):
            await reg.heartbeat(info)
        await reg.register(info, ttl_s=10)
        await reg.deregister("decode", "d1")
        assert await reg.list("decode") == []
        await reg.deregister("decode", "d1")  # idempotent
        with pytest.raises(ValueError, match="before register"):
            await reg.heartbeat(info)

    run(scenario())


def test_validation_of_service_and_ttl() -> None:
    with pytest.raises(ConfigError, match="unknown service"):
        make_instance("x", service="tokenizer")

    async def scenario() -> None:
        reg = MemoryRegistry()
        with pytest.raises(ConfigError, match="ttl_s"):
            await reg.register(make_instance("d1"), ttl_s=0)
        with pytest.raises(ConfigError, match="unknown service"):
            await reg.list("decoder")

    run(scenario())


def test_instance_info_round_trips_json_and_ignores_unknown_keys() -> None:
    info = make_instance("d1", load=decode_load(free=3, total=9, running=1, waiting=2), draining=True)
    data = json.loads(json.dumps(info.to_dict()))
    assert InstanceInfo.from_dict(data) == info
    data["added_in_v2"] = "x"
    data["load"]["added_in_v2"] = 1
    assert InstanceInfo.from_dict(data) == info


def test_make_registry_without_url_is_in_memory() -> None:
    assert isinstance(make_registry(None, "ns"), MemoryRegistry)
    assert isinstance(make_registry("", "ns"), MemoryRegistry)


def test_heartbeater_refreshes_load_sets_draining_and_deregisters() -> None:
    async def scenario() -> None:
        reg = MemoryRegistry()  # real clock: the Heartbeater's own timing is under test
        loads = iter(Load(num_waiting=n) for n in range(1000))
        hb = Heartbeater(reg, make_instance("p1", "prefill"), lambda: next(loads), ttl_s=0.15)
        await hb.start()
        await asyncio.sleep(0.4)  # > 2 × ttl: alive only thanks to the beats
        (listed,) = await reg.list("prefill")
        assert listed.load.num_waiting >= 3  # one beat at start, then every 50 ms
        await hb.set_draining()
        assert (await reg.list("prefill"))[0].draining
        await hb.stop()
        assert await reg.list("prefill") == []
        assert not hb.running
        await hb.stop()  # idempotent

    run(scenario())


class FlakyRegistry(MemoryRegistry):
    """Fails every call while `down` is set, like a registry whose server went away."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    async def register(self, info: InstanceInfo, ttl_s: float) -> None:
        self._fail_if_down()
        await super().register(info, ttl_s)

    async def heartbeat(self, info: InstanceInfo) -> None:
        self._fail_if_down()
        await super().heartbeat(info)

    def _fail_if_down(self) -> None:
        from shared.errors import UnavailableError

        if self.down:
            raise UnavailableError("registry down")


def test_heartbeater_survives_outage_and_a_failing_load_fn() -> None:
    async def scenario() -> None:
        reg = FlakyRegistry()
        reg.down = True
        calls = 0

        def load_fn() -> Load:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise RuntimeError("metrics not ready")
            return Load(num_running=calls)

        hb = Heartbeater(reg, make_instance("d1"), load_fn, ttl_s=0.15)
        await hb.start()  # registry down: logged, not raised
        await asyncio.sleep(0.12)
        assert hb.running and hb.num_failures >= 2
        assert await reg.list("decode") == []
        reg.down = False
        await asyncio.sleep(0.12)
        assert hb.num_failures == 0
        assert [i.instance_id for i in await reg.list("decode")] == ["d1"]
        await hb.stop()

    run(scenario())
