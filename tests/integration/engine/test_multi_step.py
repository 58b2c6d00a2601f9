"""Multi-step decode (num_scheduler_steps): bursts of greedy decode steps give the tokens single steps give.

A burst runs several decode steps with no host work between them (Scheduler._plan_burst, ModelRunner.
_execute_burst): KV slots reserved ahead, each step fed the previous one's argmax on the device, stops and
max_tokens applied when the burst is read. Greedy output must not change by a token, in either loop, and
whatever a burst reserved past a stop or an abort must come back (the `engines` fixture checks for leaks).
"""

from __future__ import annotations

from typing import Any

import pytest

from shared.engine.request import SamplingParams
from tests.helpers.models import tiny_engine, tiny_loaded
from tests.integration.engine.test_engine_tiny import prompts
from tests.integration.engine.test_zero_bubble import assert_same, mixed_params, stops_mid_output


def greedy_params(stops: list[int]) -> list[SamplingParams]:
    """Greedy only, so every step may burst: stops part way, max_tokens off the burst grid, EOS honoured."""
    return [SamplingParams(max_tokens=m, temperature=0.0, stop_token_ids=s, ignore_eos=i)
            for m, s, i in [(21, (), True), (17, (stops[0],), False), (1, (), True), (30, (), True),
                            (13, (stops[1],), True), (6, (), False), (19, (stops[2], stops[1]), True),
                            (26, (), True)]]


def run(engines: list[Any], batch: list[list[int]], params: Any, **config: Any) -> tuple[Any, Any]:
    loaded, _ = tiny_loaded("llama")
    engine = tiny_engine(loaded, **config)
    engines.append(engine)
    return engine.generate(batch, params), engine


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "zero-bubble"])
@pytest.mark.parametrize("steps", [2, 4, 7])
def test_bursts_give_single_steps_tokens(engines: list[Any], async_scheduling: bool, steps: int) -> None:
    batch = prompts(8, seed=5, lo=5, hi=40)
    stops = stops_mid_output("llama", batch, max_num_batched_tokens=32)
    params = greedy_params(stops)
    single, _ = run(engines, batch, params, async_scheduling=False, max_num_batched_tokens=32)
    burst, engine = run(engines, batch, params, async_scheduling=async_scheduling, max_num_batched_tokens=32,
                        num_scheduler_steps=steps)
    assert_same(single, burst)
    assert "stop" in {single[i].finish_reason for i in (1, 4, 6)}, [r.token_ids for r in single]
    assert engine.scheduler.num_bursts_total > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "zero-bubble"])
def test_sampling_logprobs_and_min_tokens_keep_single_steps(engines: list[Any], async_scheduling: bool) -> None:
    """Requests the host must see each step of (sampled, logprobs, min_tokens) never burst; once they end,
    the greedy rest does, and every token is the single-step loop's."""
    batch = prompts(9, seed=3, lo=5, hi=45)
    stops = stops_mid_output("llama", batch, max_num_batched_tokens=24)
    params = [*mixed_params(stops), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)]
    single, _ = run(engines, batch, params, async_scheduling=False, max_num_batched_tokens=24)
    burst, engine = run(engines, batch, params, async_scheduling=async_scheduling, max_num_batched_tokens=24,
                        num_scheduler_steps=4)
    assert_same(single, burst)
    assert engine.scheduler.num_bursts_total > 0  # the last request decodes alone at last


def test_a_waiting_request_ends_bursts_and_an_abort_frees_a_burst(engines: list[Any]) -> None:
    loaded, _ = tiny_loaded("llama")
    engine = tiny_engine(loaded, num_scheduler_steps=8, async_scheduling=True)
    engines.append(engine)
    plans: list[Any] = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]  # type: ignore[method-assign]
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    engine.add_request("a", prompts(1, seed=7)[0], long)
    engine.add_request("b", prompts(1, seed=8)[0], long)
    for _ in range(6):
        engine.step()
    assert any(c.burst == 8 for p in plans for c in p.chunks)
    engine.add_request("c", prompts(1, seed=9)[0], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    engine.step()
    admitted = plans[-1]  # the newcomer's prompt runs in a plain step beside the others' decodes
    assert "c" in {c.request_id for c in admitted.chunks} and {c.burst for c in admitted.chunks} == {1}
    engine.step()
    assert engine.abort("a")  # a burst of "a" may be in flight: what it reserved comes back once it is read
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert {o.request_id for o in outputs if o.finished} >= {"b", "c"}  # the fixture checks no block leaked


def test_a_speculating_engine_keeps_single_steps(engines: list[Any]) -> None:
    loaded, _ = tiny_loaded("llama")
    engine = tiny_engine(loaded, spec_method="ngram", num_scheduler_steps=4)
    engines.append(engine)
    assert engine.scheduler.config.num_scheduler_steps == 1
