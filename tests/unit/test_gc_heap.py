"""freeze_startup_heap: what is alive when a service finishes starting is out of the collector's walks."""

from __future__ import annotations

import asyncio
import gc

import pytest

from shared.service.gc_heap import freeze_startup_heap, frozen_after


@pytest.fixture
def unfreeze_after():
    yield
    gc.unfreeze()  # the test process keeps collecting as before


def _tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())  # generations 0-2; the frozen ones are not listed


def test_alive_objects_leave_the_collected_generations(unfreeze_after):
    startup = {"model": [1, 2, 3]}
    assert _tracked(startup)
    freeze_startup_heap()
    assert gc.get_freeze_count() > 0
    assert not _tracked(startup)
    later = {"request": [4]}  # objects made after start-up are collected as usual
    assert _tracked(later)


def test_startup_garbage_is_collected_not_frozen(unfreeze_after):
    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle that only the collector frees
    ids = {id(a), id(b)}
    del a, b
    freeze_startup_heap()
    gc.unfreeze()
    assert not any(id(o) in ids and isinstance(o, Node) for o in gc.get_objects())


def test_frozen_after_freezes_once_the_start_returns(unfreeze_after):
    async def start() -> dict:
        return {"service": [1]}

    running = asyncio.run(frozen_after(start()))
    assert running == {"service": [1]} and not _tracked(running)
