"""CoreShare: engines of one host take every core while the others are idle and their share while not."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import shared.engine.core_share as core_share
from shared.engine.core_share import FILE_BYTES, SLOTS, CoreShare


def begin_step(share: CoreShare) -> None:
    """What an engine does at a step's start: marks itself busy (engine thread), then fits its count on the
    thread that runs the step (LLMEngine.before_step), published until the step is over."""
    share.set_busy(True)
    share.fit_threads()


def step(share: CoreShare) -> None:
    """A whole step: begun, then over (LLMEngine.after_step)."""
    begin_step(share)
    share.step_over()


@pytest.fixture(autouse=True)
def _restore_threads() -> object:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_an_engine_alone_takes_every_core_and_shrinks_while_another_has_work(tmp_path: Path) -> None:
    path = tmp_path / "core_share"
    torch.set_num_threads(1)  # engine_host starts an engine's thread on its share
    prefill = CoreShare(path, 0, share_threads=1, max_threads=2)  # `baton up`'s two engines on two cores
    decode = CoreShare(path, 1, share_threads=1, max_threads=2)
    step(decode)
    assert decode.threads == 2 and torch.get_num_threads() == 2  # prefill idle: both
    step(prefill)
    assert prefill.threads == 1  # decode busy: its share
    step(decode)
    assert decode.threads == 1  # the next step sees prefill
    prefill.set_busy(False)
    step(decode)
    assert decode.threads == 2 and torch.get_num_threads() == 2
    prefill.close()
    decode.close()


def test_a_busy_engine_refits_mid_step_when_another_gets_work_or_goes_idle(tmp_path: Path) -> None:
    """fit_threads (between a long step's layers) shrinks to the share once another engine is busy, and
    takes every core back once it is idle, without a set_busy in between."""
    path = tmp_path / "core_share"
    prefill = CoreShare(path, 0, share_threads=1, max_threads=2)
    decode = CoreShare(path, 1, share_threads=1, max_threads=2)
    begin_step(prefill)
    assert prefill.threads == 2
    decode.set_busy(True)  # decode gets work while prefill is mid-step
    prefill.fit_threads()
    assert prefill.threads == 1 and torch.get_num_threads() == 1
    decode.set_busy(False)
    prefill.fit_threads()
    assert prefill.threads == 2 and torch.get_num_threads() == 2
    prefill.close()
    decode.close()


def test_shares_split_the_cores_among_busy_engines_never_below_the_share(tmp_path: Path) -> None:
    path = tmp_path / "core_share"
    engines = [CoreShare(path, i, share_threads=2, max_threads=8) for i in range(4)]
    for e in engines[:2]:
        step(e)
    step(engines[0])
    assert engines[0].threads == 4  # two busy: half each
    for e in engines[2:]:
        step(e)
    step(engines[0])
    assert engines[0].threads == 2  # four busy on 8 cores: 2 each, which is also the share
    for e in engines:
        e.close()


def test_a_dead_engines_slot_counts_as_idle(tmp_path: Path) -> None:
    path = tmp_path / "core_share"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    me = CoreShare(path, 0, share_threads=1, max_threads=2)
    other = CoreShare(path, 1, share_threads=1, max_threads=2)
    other._slots[1] = int(dead.stdout)  # an engine killed in the middle of its work
    step(me)
    assert me.others_busy() == 0 and me.threads == 2
    me.close()
    other.close()


def test_the_count_is_set_on_the_thread_that_steps(tmp_path: Path) -> None:
    """torch's OpenMP build keeps the count per thread: the engine thread's steps see the share's value."""
    path = tmp_path / "core_share"
    seen: list[int] = []

    def engine_thread() -> None:
        share = CoreShare(path, 0, share_threads=1, max_threads=3)
        step(share)
        seen.append(torch.get_num_threads())
        share.close()

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    assert seen == [3]


def test_a_restarted_engine_clears_its_slot_and_close_leaves_it_idle(tmp_path: Path) -> None:
    path = tmp_path / "core_share"
    first = CoreShare(path, 3, share_threads=1, max_threads=2)
    step(first)
    watcher = CoreShare(path, 0, share_threads=1, max_threads=2)
    assert watcher.others_busy() == 1
    again = CoreShare(path, 3, share_threads=1, max_threads=2)  # the same slot, restarted
    assert watcher.others_busy() == 0
    step(again)
    again.close()
    assert watcher.others_busy() == 0
    first.close()
    watcher.close()
    assert path.stat().st_size == FILE_BYTES == SLOTS * 8 * 3


def test_bad_slots_and_shares_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="slot"):
        CoreShare(tmp_path / "f", SLOTS, share_threads=1)
    with pytest.raises(ValueError, match="share_threads"):
        CoreShare(tmp_path / "f", 0, share_threads=0)


def test_each_engine_publishes_the_count_its_step_runs_on_and_zero_between_steps(tmp_path: Path) -> None:
    path = tmp_path / "core_share"
    prefill = CoreShare(path, 0, share_threads=1, max_threads=2)
    decode = CoreShare(path, 1, share_threads=1, max_threads=2)
    begin_step(decode)
    assert prefill._counts[1] == 2 and prefill._shares[1] == 1  # what decode's step runs on, and its share
    decode.step_over()
    assert prefill._counts[1] == 0  # between steps it computes nothing to wait for
    begin_step(prefill)
    assert prefill.num_waits == 0 and prefill.threads == 1  # decode is busy: its share, at once
    begin_step(decode)
    decode.set_busy(False)
    assert prefill._counts[1] == 0
    prefill.close()
    decode.close()


def test_a_newcomer_waits_until_a_neighbour_running_more_than_its_share_shrinks(tmp_path: Path) -> None:
    """Decode steps on both cores alone; prefill gets a prompt. Prefill's first step waits until decode's next
    step has shrunk it to its share, instead of running beside decode's step in flight (oversubscribed)."""
    path = tmp_path / "core_share"
    prefill = CoreShare(path, 0, share_threads=1, max_threads=2)
    decode = CoreShare(path, 1, share_threads=1, max_threads=2)
    begin_step(decode)
    assert decode.threads == 2
    order: list[str] = []

    def decode_steps_on() -> None:  # decode's step in flight ends, and its next one reads prefill's slot
        while not prefill._busy:
            pass
        order.append("decode shrinks")
        begin_step(decode)

    neighbour = threading.Thread(target=decode_steps_on)
    neighbour.start()
    begin_step(prefill)
    order.append("prefill steps")
    neighbour.join()
    assert order == ["decode shrinks", "prefill steps"]
    assert prefill.num_waits == 1 and prefill.threads == 1 and decode.threads == 1
    begin_step(prefill)  # both on their shares: nobody waits
    begin_step(decode)
    assert prefill.num_waits == 1 and decode.num_waits == 0
    prefill.close()
    decode.close()


def test_the_wait_is_bounded_when_a_neighbour_keeps_its_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A neighbour that does not step again (stuck, or in a step with no layer hook) costs the newcomer at most
    ROOM_WAIT_S; then it steps beside it, as before the wait existed."""
    monkeypatch.setattr(core_share, "ROOM_WAIT_S", 0.05)
    path = tmp_path / "core_share"
    prefill = CoreShare(path, 0, share_threads=1, max_threads=2)
    decode = CoreShare(path, 1, share_threads=1, max_threads=2)
    begin_step(decode)
    begin_step(prefill)  # returns: decode never shrinks
    assert prefill.num_waits == 1 and prefill.threads == 1 and decode._counts[1] == 2
    prefill.close()
    decode.close()


def test_no_wait_where_every_neighbour_runs_its_share_even_past_the_cores(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """1P2D on two cores: three engines on a share of one each run three threads on two cores; none of them
    can shrink further, so none waits for another."""
    monkeypatch.setattr(core_share, "ROOM_WAIT_S", 0.01)  # the first round: the first engine took both cores
    path = tmp_path / "core_share"
    engines = [CoreShare(path, i, share_threads=1, max_threads=2) for i in range(3)]
    for e in engines:
        begin_step(e)
    waits = [e.num_waits for e in engines]
    for e in engines:
        begin_step(e)
    assert [e.threads for e in engines] == [1, 1, 1]
    assert [e.num_waits for e in engines] == waits
    for e in engines:
        e.close()
