"""The scheduler planning step N+1 before step N is read (the zero-bubble loop), with no model.

The runner's part (placeholder ids, corrected positions) is played here by hand:
each test says what step N emitted and checks the request's state after update.
"""

from __future__ import annotations

from collections.abc import Callable

from shared.engine.scheduler import PLACEHOLDER_TOKEN_ID, Scheduler, StepResult
from tests.unit.engine.factories import make_request

SchedulerFactory = Callable[..., Scheduler]


def emitted(**tokens: list[int]) -> StepResult:
    return StepResult(emitted=dict(tokens))


def test_plain_decode_plans_a_placeholder_then_reads_a_step_late(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory(block_size=4)
    r = make_request("r", 6, max_tokens=3)
    s.add_request(r)
    prefill = s.schedule()  # N: the whole prompt, samples the first token
    assert r.num_computed_tokens == 6 and [e.drafts for e in r.inflight] == [[]]
    decode = s.schedule()  # N+1, planned before N is read
    (chunk,) = decode.chunks
    assert chunk.continues and chunk.token_ids == [PLACEHOLDER_TOKEN_ID] and chunk.start_pos == 6
    assert r.num_computed_tokens == 7 and r.num_tokens_ahead == 8 and r.num_tokens == 6
    assert s.update(prefill, emitted(r=[40]))[0].new_token_ids == [40]
    assert r.all_token_ids[-1] == 40 and len(r.inflight) == 1
    third = s.schedule()  # N+2: r can still emit a third token
    assert third.chunks[0].continues and third.chunks[0].start_pos == 7
    s.update(decode, emitted(r=[41]))
    # N+2 is in flight and its token is r's third: certain to end it, so N+3 plans nothing for r
    assert s.schedule().is_empty
    out = s.update(third, emitted(r=[42]))
    assert out[0].finished and out[0].finish_reason == "length" and r.output_token_ids == [40, 41, 42]


def test_rejected_drafts_move_the_request_back_and_mark_later_guesses_stale(
    scheduler_factory: SchedulerFactory,
) -> None:
    s = scheduler_factory(block_size=4)
    r = make_request("r", 5, max_tokens=20)
    s.add_request(r)
    s.update(s.schedule(), emitted(r=[30]))  # synchronous so far: 6 tokens known, 5 computed
    r.spec_token_ids = [31, 32, 33]
    verify = s.schedule()  # N: [30, 31, 32, 33] at positions 5..8
    assert verify.chunks[0].num_draft_tokens == 3 and r.num_computed_tokens == 9
    # proposed ahead: N accepts its 3 drafts and emits 34, then 35 36 follow
    r.spec_token_ids, r.spec_guess, r.spec_assumed_accepted = [35, 36], 34, 3
    ahead = s.schedule()  # N+1: [?, 35, 36] at positions 9..11 if all of N's drafts are accepted
    (chunk,) = ahead.chunks
    assert chunk.continues and chunk.start_pos == 9 and chunk.token_ids[1:] == [35, 36]
    assert r.num_computed_tokens == 12 and r.num_tokens_ahead == 13
    s.update(verify, emitted(r=[31, 50]))  # one draft accepted, 50 recovered: two drafts rejected
    assert r.output_token_ids == [30, 31, 50]
    assert r.num_computed_tokens == 10, "N+1 really ran at positions 7..9"
    assert r.inflight[0].stale, "N+1's drafts assumed a history that did not happen"
    assert len(s.kv.block_ids("r")) == 3  # blocks for the 10 positions N+1 writes, the rest given back
    # planned ahead of N+1, assuming it accepts nothing (its drafts are stale) and emits 52
    r.spec_token_ids, r.spec_guess, r.spec_assumed_accepted = [53], 52, 0
    after = s.schedule()
    assert after.chunks[0].token_ids[1:] == [53] and r.num_computed_tokens == 12
    s.update(ahead, emitted(r=[52]))  # N+1's drafts rejected, as expected
    assert r.num_computed_tokens == 10 and r.num_tokens == 9, "N+2 really runs [52, 53] at positions 8, 9"
    assert not r.inflight[0].stale, "N+2 guessed N+1 right"
    s.update(after, emitted(r=[53, 54]))
    assert r.output_token_ids == [30, 31, 50, 52, 53, 54] and r.num_computed_tokens == 10
    s.abort("r")


def test_a_request_finished_in_flight_drops_the_step_planned_after(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory(block_size=4)
    r = make_request("r", 4, max_tokens=10, stop_token_ids=(99,))
    s.add_request(r)
    first = s.schedule()
    second = s.schedule()
    assert s.update(first, emitted(r=[99]))[0].finish_reason == "stop"
    assert s.update(second, emitted(r=[5])) == []  # its work for r is dropped
    assert not s.kv.block_tables and r.output_token_ids == [99]


def test_a_request_preempted_in_flight_ignores_that_steps_result(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory(block_size=4, num_blocks=4)
    a, b = make_request("a", 8, max_tokens=20), make_request("b", 8, max_tokens=20)
    s.add_request(a)
    s.add_request(b)
    first = s.schedule()  # both prompts: 4 blocks
    second = s.schedule()  # a needs a third block: b is preempted while `first` runs
    assert second.preempted_ids == ["b"] and b.num_computed_tokens == 0 and not b.inflight
    outputs = s.update(first, emitted(a=[1], b=[2]))
    assert [o.request_id for o in outputs] == ["a"] and b.output_token_ids == []
    s.abort("a")
    s.abort("b")


def test_a_block_shared_with_a_step_in_flight_is_waited_for(scheduler_factory: SchedulerFactory) -> None:
    """Planned ahead, a request still waits for the block a step in flight fills, then hits it."""
    s = scheduler_factory(block_size=4)
    a = make_request("a", 9, max_tokens=2)
    b = make_request("b", a.prompt_token_ids, max_tokens=1)
    s.add_request(a)
    s.add_request(b)
    first = s.schedule()  # N: a's prompt; b passes, a fills its blocks
    second = s.schedule()  # N + 1, planned before N is read: a's blocks are still in flight
    assert [c.request_id for c in first.chunks] == ["a"] and [c.request_id for c in second.chunks] == ["a"]
    s.update(first, emitted(a=[40]))
    third = s.schedule()  # N + 2: N's blocks are registered
    assert [(c.request_id, c.start_pos) for c in third.chunks] == [("b", 8)] and b.num_cached_tokens == 8
    s.update(second, emitted(a=[41]))
    assert s.update(third, emitted(b=[42]))[0].finished
