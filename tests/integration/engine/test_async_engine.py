"""AsyncEngine: many asyncio callers, one engine thread, nothing leaked."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from shared.engine.async_engine import AsyncEngine
from shared.engine.request import SamplingParams
from shared.errors import ContextLengthExceededError
from tests.helpers.models import tiny_engine, tiny_loaded


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)


async def collect(aengine: AsyncEngine, request_id: str, prompt: list[int], n: int) -> list[int]:
    tokens: list[int] = []
    async for out in await aengine.generate(request_id, prompt, greedy(n)):
        tokens.extend(out.new_token_ids)
    return tokens


def test_concurrent_streams_equal_sync_generate() -> None:
    loaded, _ = tiny_loaded("llama")
    prompts = [[5 + i, 9, 17, 33 + i, 2 * i + 3] for i in range(8)]
    expected = [r.token_ids for r in tiny_engine(loaded).generate(prompts, greedy(12))]
    engine = tiny_engine(loaded)
    aengine = AsyncEngine(engine)
    aengine.start()

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(collect(aengine, f"r{i}", p, 12) for i, p in enumerate(prompts)))

    try:
        assert asyncio.run(main()) == expected
    finally:
        aengine.stop()
    engine.check_no_leaks()


def test_a_stream_interval_sends_the_first_token_alone_then_groups_of_the_interval_then_the_rest() -> None:
    """vLLM's stream_interval: the engine's and a request's own (the larger applies); the tokens are the same."""
    loaded, _ = tiny_loaded("llama")
    prompts = [[5, 9, 17, 33, 3], [6, 10, 18, 34, 5]]
    expected = [r.token_ids for r in tiny_engine(loaded).generate(prompts, greedy(12))]
    engine = tiny_engine(loaded, stream_interval=4)
    aengine = AsyncEngine(engine)
    aengine.start()

    async def sizes(request_id: str, prompt: list[int], interval: int | None) -> tuple[list[int], list[int]]:
        params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, stream_interval=interval)
        tokens, counts = [], []
        async for out in await aengine.generate(request_id, prompt, params):
            tokens.extend(out.new_token_ids)
            counts.append(len(out.new_token_ids))
        return tokens, counts

    async def main() -> list[tuple[list[int], list[int]]]:
        return await asyncio.gather(sizes("engine's", prompts[0], None), sizes("own", prompts[1], 5),
                                    sizes("below the engine's", prompts[0], 2))

    try:
        (tokens_a, counts_a), (tokens_b, counts_b), (tokens_c, counts_c) = asyncio.run(main())
    finally:
        aengine.stop()
    engine.check_no_leaks()
    assert (tokens_a, tokens_b, tokens_c) == (expected[0], expected[1], expected[0])
    assert counts_a == counts_c == [1, 4, 4, 3]  # the last output flushes what is held
    assert counts_b == [1, 5, 5, 1]


def test_a_stream_interval_holds_each_choice_apart() -> None:
    engine = tiny_engine(tiny_loaded("llama")[0], stream_interval=3)
    aengine = AsyncEngine(engine)
    aengine.start()

    async def main() -> dict[int, list[int]]:
        counts: dict[int, list[int]] = {}
        params = SamplingParams(max_tokens=7, min_tokens=7, temperature=1.0, seed=3, n=2)
        async for out in await aengine.generate("two", [4, 8, 15, 16], params):
            counts.setdefault(out.index, []).append(len(out.new_token_ids))
        return counts

    try:
        counts = asyncio.run(main())
    finally:
        aengine.stop()
    engine.check_no_leaks()
    assert counts == {0: [1, 3, 3], 1: [1, 3, 3]}


def test_leaving_a_stream_early_aborts_and_frees() -> None:
    engine = tiny_engine(tiny_loaded("llama")[0])
    aengine = AsyncEngine(engine)
    aengine.start()

    async def main() -> None:
        stream = await aengine.generate("early", [3, 4, 5, 6], greedy(200))
        async for _ in stream:
            break  # the client goes away after one token
        await stream.aclose()
        # the abort runs on the engine thread; wait for the pool to be whole again (before stop(), which
        # would free everything anyway)
        for _ in range(250):
            if engine.num_free_kv_blocks == engine.num_kv_blocks and not engine.has_unfinished():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"the abort freed nothing: {engine.num_free_kv_blocks} of {engine.num_kv_blocks} "
                             f"blocks free, requests unfinished: {engine.has_unfinished()}")

    try:
        asyncio.run(main())
    finally:
        aengine.stop()
    engine.check_no_leaks()


def test_a_consumer_that_stops_at_the_last_output_aborts_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """The decode service's caller (the router) closes its stream as soon as the finished output is in:
    that is not leaving early, and nothing is aborted."""
    engine = tiny_engine(tiny_loaded("llama")[0])
    aengine = AsyncEngine(engine)
    aengine.start()

    async def main() -> int:
        stream = await aengine.generate("whole", [3, 4, 5, 6], greedy(5))
        tokens = 0
        async for out in stream:
            tokens += len(out.new_token_ids)
            if out.finished:
                break  # stop at the last output, the generator still suspended at its yield
        await stream.aclose()
        return tokens

    try:
        with caplog.at_level("INFO", logger="shared.engine.async_engine"):
            assert asyncio.run(main()) == 5
    finally:
        aengine.stop()
    assert "left early" not in caplog.text
    engine.check_no_leaks()


def test_a_caller_cancelled_while_its_request_waits_to_be_added_leaves_nothing_and_kills_nothing() -> None:
    """Found by the chaos soak: a stream cancelled while its add command was queued (the router gave up on
    it) made the engine thread set a cancelled future's result, which killed the thread. Now the command
    still runs, its result is dropped, and the abort queued behind it frees the request."""
    engine = tiny_engine(tiny_loaded("llama")[0])
    aengine = AsyncEngine(engine)
    aengine.start()

    async def main() -> None:
        busy = asyncio.ensure_future(aengine._call(lambda: time.sleep(0.5)))  # the thread is busy: commands queue
        await asyncio.sleep(0.05)

        async def first_token() -> None:
            async for _ in await aengine.generate("late", [3, 4, 5, 6], greedy(200)):
                return

        task = asyncio.ensure_future(first_token())
        await asyncio.sleep(0.1)
        task.cancel()  # while its add waits behind the sleep
        with pytest.raises(asyncio.CancelledError):
            await task
        await busy
        assert await collect(aengine, "after", [7, 8, 9], 4)  # the engine thread lives
        for _ in range(250):
            if engine.num_free_kv_blocks == engine.num_kv_blocks and not engine.has_unfinished():
                return
            await asyncio.sleep(0.02)
        raise AssertionError("the cancelled request was not freed")

    try:
        asyncio.run(main())
        assert aengine.running
    finally:
        aengine.stop()
    engine.check_no_leaks()


def test_engine_errors_reach_the_caller() -> None:
    engine = tiny_engine(tiny_loaded("llama")[0], max_model_len=32)
    aengine = AsyncEngine(engine)
    aengine.start()

    async def main() -> None:
        with pytest.raises(ContextLengthExceededError):
            await collect(aengine, "long", list(range(2, 40)), 1)
        assert await collect(aengine, "ok", [3, 4], 3)  # the engine keeps serving

    try:
        asyncio.run(main())
    finally:
        aengine.stop()
    engine.check_no_leaks()


def test_the_engine_thread_steps_on_every_core_alone_and_on_its_share_beside_a_busy_engine(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A real engine with a core share (shared/engine/core_share.py): the same tokens either way, the step
    thread's count follows the other slot, and the engine's slot is idle again once its work is done."""
    from shared.engine.core_share import CoreShare

    loaded, _ = tiny_loaded("llama")
    expected = [r.token_ids for r in tiny_engine(loaded).generate([[5, 9, 17, 33]], greedy(8))]
    neighbour = CoreShare(tmp_path / "core_share", 1, share_threads=1, max_threads=2)  # another engine's slot
    engine = tiny_engine(loaded)
    cores = CoreShare(tmp_path / "core_share", 0, share_threads=1, max_threads=2)
    aengine = AsyncEngine(engine, cores)
    aengine.start()
    try:
        assert asyncio.run(collect(aengine, "alone", [5, 9, 17, 33], 8)) == expected[0]
        assert cores.threads == 2  # nobody else had work
        neighbour.set_busy(True)
        assert asyncio.run(collect(aengine, "beside", [5, 9, 17, 33], 8)) == expected[0]
        assert cores.threads == 1  # its share while the neighbour works
        for _ in range(250):
            if neighbour.others_busy() == 0:
                break
            time.sleep(0.02)
        assert neighbour.others_busy() == 0  # idle engines lend their cores
    finally:
        aengine.stop()
        neighbour.close()
    engine.check_no_leaks()


def test_the_zero_bubble_loops_executor_steps_on_the_share_too(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """torch keeps a thread count per thread, and the zero-bubble loop runs its steps on an executor thread:
    the share is fitted there before each step (LLMEngine.before_step), not only on the engine thread, so the
    executor's steps follow the neighbour's slot as the engine thread's would. Same tokens either way."""
    from shared.engine.core_share import CoreShare

    loaded, _ = tiny_loaded("llama")
    expected = [r.token_ids for r in tiny_engine(loaded).generate([[5, 9, 17, 33]], greedy(8))]
    neighbour = CoreShare(tmp_path / "core_share", 1, share_threads=1, max_threads=2)
    engine = tiny_engine(loaded, async_scheduling=True)
    assert engine.async_scheduling
    cores = CoreShare(tmp_path / "core_share", 0, share_threads=1, max_threads=2)
    aengine = AsyncEngine(engine, cores)
    execute = engine.runner.execute
    stepped_on: list[tuple[str, int]] = []  # (thread, its torch count) of each step

    def recording_execute(*args, **kwargs):  # type: ignore[no-untyped-def]
        stepped_on.append((threading.current_thread().name, torch.get_num_threads()))
        return execute(*args, **kwargs)
    engine.runner.execute = recording_execute  # type: ignore[method-assign]
    aengine.start()
    try:
        assert asyncio.run(collect(aengine, "alone", [5, 9, 17, 33], 8)) == expected[0]
        alone, stepped_on[:] = list(stepped_on), []
        neighbour.set_busy(True)
        assert asyncio.run(collect(aengine, "beside", [5, 9, 17, 33], 8)) == expected[0]
    finally:
        aengine.stop()
        neighbour.close()
    assert alone and all(name.startswith("executor") and n == 2 for name, n in alone)
    assert stepped_on and all(name.startswith("executor") and n == 1 for name, n in stepped_on)
    engine.check_no_leaks()


def test_a_long_step_gives_back_lent_cores_within_a_layer_of_a_neighbour_getting_work(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A prompt of 64+ tokens in one step on both cores: the neighbour gets work after the step's first layer,
    and the layers after it run on the engine's share (the count is read again between layers), with the same
    tokens. Decode steps (one row) call nothing between layers: their fast paths take no layer hook."""
    from shared.engine.core_share import CoreShare

    loaded, _ = tiny_loaded("llama")
    prompt = [5 + i % 50 for i in range(70)]
    expected = [r.token_ids for r in tiny_engine(loaded).generate([prompt], greedy(4))]
    neighbour = CoreShare(tmp_path / "core_share", 1, share_threads=1, max_threads=2)
    engine = tiny_engine(loaded)
    cores = CoreShare(tmp_path / "core_share", 0, share_threads=1, max_threads=2)
    aengine = AsyncEngine(engine, cores)
    refit = engine.between_layers
    assert refit is not None  # the core share's, set by AsyncEngine
    threads_after_layers: list[int] = []

    def between_layers() -> None:
        neighbour.set_busy(True)
        refit()
        threads_after_layers.append(torch.get_num_threads())
    engine.between_layers = between_layers
    aengine.start()
    try:
        assert asyncio.run(collect(aengine, "long", prompt, 4)) == expected[0]
    finally:
        aengine.stop()
        neighbour.close()
    # the prompt's one step, a call after each layer; none for the three decode steps
    assert threads_after_layers == [1] * loaded.spec.num_layers
    engine.check_no_leaks()
