"""run_on_fresh_thread: the call's result or error, and no OpenMP team left behind by the thread it ran on."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from shared.service.fresh_thread import run_on_fresh_thread


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled_threads(expected: int) -> int:
    """The thread count once exiting threads are gone (the OS reaps them a moment after Python lets go)."""
    deadline = time.monotonic() + 2.0
    while (n := _threads()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return n


def _steady_threads(steady_s: float = 0.3, timeout_s: float = 5.0) -> int:
    """The thread count once it has not changed for `steady_s` (a thread an earlier test ended may still be
    exiting: counted before and gone after, it would read as a team torn down)."""
    deadline = time.monotonic() + timeout_s
    n, since = _threads(), time.monotonic()
    while time.monotonic() - since < steady_s and time.monotonic() < deadline:
        time.sleep(0.01)
        if (m := _threads()) != n:
            n, since = m, time.monotonic()
    return n


def _parallel_work() -> float:
    # big enough that at::parallel_for forks a team (one worker per extra core)
    return float(torch.ones(1 << 22).mul(2.0).sum())


def test_result_and_error_come_back() -> None:
    assert asyncio.run(run_on_fresh_thread(lambda a, b: a + b, 2, 3)) == 5

    def boom() -> None:
        raise ValueError("no model here")

    with pytest.raises(ValueError, match="no model here"):
        asyncio.run(run_on_fresh_thread(boom))


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or torch.get_num_threads() < 2, reason="one core: no OpenMP team")
def test_the_threads_team_is_gone_afterwards() -> None:
    async def main() -> tuple[int, int, int]:
        before = _steady_threads()
        await run_on_fresh_thread(_parallel_work)
        after_fresh = _settled_threads(before)
        await asyncio.to_thread(_parallel_work)  # what the model load used to do: the executor thread stays
        return before, after_fresh, _threads()

    before, after_fresh, after_executor = asyncio.run(main())
    assert after_fresh == before
    # the control: a thread that lives on keeps its team's workers (and the executor thread itself)
    assert after_executor > before + 1
