"""run_until_signal: a service that fails on its own is stopped and its process exits 1. run: the event loop."""

from __future__ import annotations

import asyncio

import pytest

from shared.service.lifecycle import run, run_until_signal


class _Service:
    """A service whose engine dies after `dies_after_s` (a test double of RunningEngineService)."""

    def __init__(self, dies_after_s: float | None) -> None:
        self.dies_at = None if dies_after_s is None else asyncio.get_running_loop().time() + dies_after_s
        self.stopped = 0

    def failure(self) -> str | None:
        dead = self.dies_at is not None and asyncio.get_running_loop().time() >= self.dies_at
        return "engine thread stopped" if dead else None

    async def stop(self) -> None:
        self.stopped += 1


def test_a_failed_service_is_stopped_and_exits_1() -> None:
    async def main() -> _Service:
        service = _Service(dies_after_s=0.2)

        async def start() -> _Service:
            return service

        with pytest.raises(SystemExit) as exit_info:
            await run_until_signal(start)
        assert exit_info.value.code == 1
        return service

    assert asyncio.run(main()).stopped == 1


def test_a_healthy_service_runs_until_told_to_stop() -> None:
    async def main() -> _Service:
        service = _Service(dies_after_s=None)
        stop = asyncio.Event()

        async def start() -> _Service:
            return service

        asyncio.get_running_loop().call_later(1.5, stop.set)
        await asyncio.wait_for(run_until_signal(start, stop), timeout=5)
        return service

    assert asyncio.run(main()).stopped == 1


@pytest.mark.parametrize("choice, loop_module", [(None, "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")])
def test_a_service_runs_on_uvloop_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch, choice: str | None,
                                                        loop_module: str) -> None:
    if choice is None:
        monkeypatch.delenv("BATON_EVENT_LOOP", raising=False)
    else:
        monkeypatch.setenv("BATON_EVENT_LOOP", choice)
    seen: list[str] = []

    async def main() -> None:
        seen.append(type(asyncio.get_running_loop()).__module__.split(".")[0])
    run(main())
    assert seen == [loop_module]


def test_an_unknown_event_loop_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_EVENT_LOOP", "trio")
    coroutine = asyncio.sleep(0)
    with pytest.raises(ValueError, match="BATON_EVENT_LOOP must be one of"):
        run(coroutine)
    coroutine.close()
