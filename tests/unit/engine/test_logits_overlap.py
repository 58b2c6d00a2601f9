"""The mask worker: builds run off the calling thread, in order, with their time and errors accounted."""

from __future__ import annotations

import threading
import time

import pytest

from shared.engine.logits.overlap import MaskOverlap


def test_builds_run_on_one_worker_thread_in_submission_order() -> None:
    overlap = MaskOverlap()
    seen: list[tuple[int, str]] = []
    pending = [overlap.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i) for i in range(5)]
    assert [p.result() for p in pending] == list(range(5))
    assert [i for i, _ in seen] == list(range(5))
    assert {name for _, name in seen} != {threading.current_thread().name}
    assert len({name for _, name in seen}) == 1
    assert overlap.num_builds == 5
    overlap.close()


def test_a_build_that_outlasts_the_caller_counts_as_waited() -> None:
    overlap = MaskOverlap()
    release = threading.Event()
    pending = overlap.submit(lambda: release.wait(5.0))
    threading.Timer(0.05, release.set).start()
    assert pending.result() is True
    assert overlap.wait_s >= 0.04 and overlap.build_s >= 0.04
    # a build done before it is asked for costs the caller nothing
    done = overlap.submit(lambda: 1)
    time.sleep(0.05)
    before = overlap.wait_s
    assert done.result() == 1 and overlap.wait_s - before < 0.04
    overlap.close()


def test_a_failed_build_raises_where_its_result_is_read_and_the_worker_goes_on() -> None:
    overlap = MaskOverlap()

    def fail() -> None:
        raise ValueError("grammar state broke")

    with pytest.raises(ValueError, match="grammar state broke"):
        overlap.submit(fail).result()
    assert overlap.submit(lambda: 2).result() == 2
    overlap.close()
    assert overlap.submit(lambda: 3).result() == 3  # a closed worker starts again when needed
    overlap.close()
