"""Engine unit fixtures: every pool, KV manager and scheduler a test makes is checked for leaks.

Tests must leave what they made drained (requests finished, aborted or handed
off and released); the check then proves every block went back exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from shared.engine.block_pool import BlockPool
from shared.engine.kv_manager import KVCacheManager
from shared.engine.scheduler import Scheduler
from tests.unit.engine.factories import make_kv_manager, make_scheduler


@pytest.fixture
def pool_factory() -> Iterator[Callable[..., BlockPool]]:
    made: list[BlockPool] = []

    def make(num_blocks: int = 8, enable_prefix_caching: bool = True) -> BlockPool:
        pool = BlockPool(num_blocks, enable_prefix_caching)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.check_no_leaks()


@pytest.fixture
def kv_factory() -> Iterator[Callable[..., KVCacheManager]]:
    made: list[KVCacheManager] = []

    def make(**kwargs: Any) -> KVCacheManager:
        kv = make_kv_manager(**kwargs)
        made.append(kv)
        return kv

    yield make
    for kv in made:
        kv.check_no_leaks()


@pytest.fixture
def scheduler_factory() -> Iterator[Callable[..., Scheduler]]:
    made: list[Scheduler] = []

    def make(**kwargs: Any) -> Scheduler:
        scheduler = make_scheduler(**kwargs)
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        assert not scheduler.has_unfinished(), "test left requests waiting or running"
        assert not scheduler.handoff_pending, f"handoffs never released: {sorted(scheduler.handoff_pending)}"
        assert not scheduler.requests, f"scheduler still tracks {sorted(scheduler.requests)}"
        scheduler.kv.check_no_leaks()
