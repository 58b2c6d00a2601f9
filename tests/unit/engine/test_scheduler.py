"""Unit tests for shared.engine.scheduler, driven by the fake runner (no model, no device).

Every scheduler comes from the `scheduler_factory` fixture, which checks for
leaked blocks after the test; every step goes through `fake_step`, which checks
the plan's invariants and that each chunk's blocks hold the request's history.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from shared.engine.request import Request, RequestStatus
from shared.engine.scheduler import Scheduler, SchedulerConfig, StepResult
from tests.unit.engine.factories import (
    EOS_TOKEN_ID,
    NextTokenFn,
    RunResult,
    expected_tokens,
    fake_execute,
    fake_step,
    history_token,
    inject_fake_kv,
    make_request,
    prompt_tokens,
    run_until_done,
)

SchedulerFactory = Callable[..., Scheduler]
STOP_TOKEN_ID = 7


def scripted(prompt_len: int, script: dict[int, int]) -> NextTokenFn:
    """Fake model that emits script[i] as output token i, history_token otherwise."""

    def next_token(request_id: str, all_token_ids: list[int]) -> int:
        return script.get(len(all_token_ids) - prompt_len, history_token(request_id, all_token_ids))

    return next_token


def chunk_shapes(scheduler: Scheduler) -> list[tuple[str, int]]:
    plan, _ = fake_step(scheduler)
    return [(c.request_id, c.num_tokens) for c in plan.chunks]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="role"):
        SchedulerConfig(role="mixed")
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


def test_single_request_prefills_then_decodes(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory()
    request = make_request("a", 6, max_tokens=3)
    s.add_request(request)
    with pytest.raises(AssertionError, match="duplicate request id"):
        s.add_request(make_request("a", 2))
    run = run_until_done(s)
    prefill, decode_1, decode_2 = (p.chunks[0] for p in run.plans)
    assert (prefill.start_pos, prefill.token_ids, prefill.sample) == (0, request.prompt_token_ids, True)
    want = expected_tokens(request.prompt_token_ids, 3)
    assert (decode_1.start_pos, decode_1.token_ids) == (6, want[:1])
    assert (decode_2.start_pos, decode_2.token_ids) == (7, want[1:2])
    assert run.token_ids == {"a": want}
    assert run.finish_reasons == {"a": "length"}
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_continuous_batching_joins_and_leaves(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory()
    a, b = make_request("a", 5, max_tokens=4), make_request("b", 7, max_tokens=2)
    s.add_request(a)
    assert chunk_shapes(s) == [("a", 5)]
    s.add_request(b)  # joins the very next step, next to a's decode
    assert chunk_shapes(s) == [("a", 1), ("b", 7)]
    plan, outputs = fake_step(s)
    assert [(o.request_id, o.finished) for o in outputs] == [("a", False), ("b", True)]
    assert s.running == [a]  # b left
    assert chunk_shapes(s) == [("a", 1)]
    assert not s.has_unfinished()
    assert a.output_token_ids == expected_tokens(a.prompt_token_ids, 4)
    assert b.output_token_ids == expected_tokens(b.prompt_token_ids, 2)


def test_chunked_prefill(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory(max_num_batched_tokens=8)
    request = make_request("a", 21, max_tokens=2)
    s.add_request(request)
    chunks, sampled = [], []
    for _ in range(3):
        plan, outputs = fake_step(s)
        chunks += plan.chunks
        sampled.append([t for o in outputs for t in o.new_token_ids])
    assert [c.num_tokens for c in chunks] == [8, 8, 5]
    assert [c.start_pos for c in chunks] == [0, 8, 16]
    assert [c.sample for c in chunks] == [False, False, True]
    assert [t for c in chunks for t in c.token_ids] == request.prompt_token_ids
    assert [len(c.block_ids) for c in chunks] == [2, 4, 6]
    assert chunks[1].block_ids[:2] == chunks[0].block_ids  # each chunk only appends to the table
    assert chunks[2].block_ids[:4] == chunks[1].block_ids
    want = expected_tokens(request.prompt_token_ids, 2)
    assert sampled == [[], [], want[:1]]
    run_until_done(s)
    assert request.output_token_ids == want


def test_running_prefill_comes_before_waiting_requests(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory(max_num_batched_tokens=8)
    s.add_request(make_request("a", 20, max_tokens=1))
    assert chunk_shapes(s) == [("a", 8)]
    s.add_request(make_request("b", 6, max_tokens=1))
    assert chunk_shapes(s) == [("a", 8)]  # no budget left for b
    assert chunk_shapes(s) == [("a", 4), ("b", 4)]
    assert chunk_shapes(s) == [("b", 2)]
    assert not s.has_unfinished()


def test_budget_is_shared_between_decodes_and_a_prefill_chunk(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory(max_num_batched_tokens=8)
    for rid in ("a", "b"):
        s.add_request(make_request(rid, 3, max_tokens=10))
    assert chunk_shapes(s) == [("a", 3), ("b", 3)]
    s.add_request(make_request("c", 20, max_tokens=1))
    assert chunk_shapes(s) == [("a", 1), ("b", 1), ("c", 6)]
    assert chunk_shapes(s) == [("a", 1), ("b", 1), ("c", 6)]
    assert chunk_shapes(s) == [("a", 1), ("b", 1), ("c", 6)]
    assert chunk_shapes(s) == [("a", 1), ("b", 1), ("c", 2)]
    run_until_done(s)


def test_max_num_seqs(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory(max_num_seqs=2)
    for rid, max_tokens in (("a", 2), ("b", 3), ("c", 2), ("d", 2)):
        s.add_request(make_request(rid, 4, max_tokens=max_tokens))
    run = run_until_done(s)
    assert [[c.request_id for c in p.chunks] for p in run.plans] == [
        ["a", "b"],
        ["a", "b"],
        ["b", "c"],
        ["c", "d"],
        ["d"],
    ]
    assert run.finish_reasons == dict.fromkeys("abcd", "length")


def _preemption_requests() -> list[tuple[str, int, int]]:
    return [("A", 7, 10), ("B", 7, 10), ("C", 7, 10), ("D", 3, 2)]  # id, prompt_len, max_tokens


def _run_preemption_workload(scheduler: Scheduler) -> dict[str, list[int]]:
    for rid, prompt_len, max_tokens in _preemption_requests():
        scheduler.add_request(make_request(rid, prompt_len, max_tokens=max_tokens))
    return run_until_done(scheduler).token_ids


def test_preemption_by_recompute(scheduler_factory: SchedulerFactory) -> None:
    # 6 blocks of 4: A, B, C (7-token prompts) fill the pool; D waits on max_num_seqs
    s = scheduler_factory(num_blocks=6, max_num_seqs=3, enable_prefix_caching=False)
    for rid, prompt_len, max_tokens in _preemption_requests():
        s.add_request(make_request(rid, prompt_len, max_tokens=max_tokens))
    requests = dict(s.requests)
    assert chunk_shapes(s) == [("A", 7), ("B", 7), ("C", 7)]
    assert chunk_shapes(s) == [("A", 1), ("B", 1), ("C", 1)]
    assert s.kv.num_free_blocks == 0
    c_tokens = list(requests["C"].all_token_ids)  # 7 prompt + 2 generated

    # position 8 needs a third block: the newest running request (C) gives its blocks up
    plan, _ = fake_step(s)
    assert plan.preempted_ids == ["C"]
    assert [(ch.request_id, ch.num_tokens) for ch in plan.chunks] == [("A", 1), ("B", 1)]
    c = requests["C"]
    assert c.status == RequestStatus.PREEMPTED
    assert (c.num_computed_tokens, c.num_preemptions, c.output_token_ids) == (0, 1, c_tokens[7:])
    assert s.kv.block_ids("C") == []
    assert list(s.waiting) == [c, requests["D"]]  # front of the queue
    assert s.kv.num_free_blocks == 0  # A and B took C's two blocks

    run = run_until_done(s)
    resumed = next(ch for p in run.plans for ch in p.chunks if ch.request_id == "C")
    assert (resumed.start_pos, resumed.token_ids, resumed.sample) == (0, c_tokens, True)
    tokens = {rid: requests[rid].output_token_ids for rid in requests}
    assert tokens == _run_preemption_workload(scheduler_factory(enable_prefix_caching=False))
    assert requests["B"].num_preemptions >= 1  # A, the oldest, is never the victim
    assert requests["A"].num_preemptions == 0


def test_preemption_with_prefix_caching_gives_the_same_tokens(scheduler_factory: SchedulerFactory) -> None:
    small = scheduler_factory(num_blocks=6, max_num_seqs=3)
    assert _run_preemption_workload(small) == _run_preemption_workload(scheduler_factory())


def test_request_that_cannot_grow_preempts_itself_when_newest(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory(num_blocks=5, enable_prefix_caching=False)
    s.add_request(make_request("A", 7, max_tokens=3))
    b = make_request("B", 7, max_tokens=3)
    s.add_request(b)
    fake_step(s)
    fake_step(s)
    b_tokens = list(b.all_token_ids)
    plan, outputs = fake_step(s)  # A takes the last free block; B is the newest, so B goes
    assert plan.preempted_ids == ["B"]
    assert [ch.request_id for ch in plan.chunks] == ["A"]
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("A", "length")]
    run = run_until_done(s)
    assert run.finish_reasons == {"B": "length"}
    assert run.plans[0].chunks[0].token_ids == b_tokens  # recomputed: 7 prompt + 2 generated


def test_resume_after_preemption_reuses_its_cached_prefix(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory(num_blocks=6)
    s.add_request(make_request("A", 8, max_tokens=6))
    b = make_request("B", 9, max_tokens=6)
    s.add_request(b)
    run = run_until_done(s)
    assert [p.preempted_ids for p in run.plans if p.preempted_ids] == [["B"]]
    assert b.num_preemptions == 1
    first, resumed = [ch for p in run.plans for ch in p.chunks if ch.request_id == "B" and ch.num_tokens > 1]
    # B's first two blocks outlived the preemption in the cache (A evicted only B's tail block)
    assert (resumed.start_pos, resumed.num_tokens) == (8, 13 - 8)
    assert resumed.block_ids[:2] == first.block_ids[:2]
    assert run.num_cached_tokens == {"A": 0, "B": 0}  # counted at first admission only
    assert run.token_ids["B"] == expected_tokens(b.prompt_token_ids, 6)


@pytest.mark.parametrize(
    ("params", "script", "want_len", "want_reason"),
    [
        ({}, {2: EOS_TOKEN_ID}, 3, "stop"),
        ({"stop_token_ids": (STOP_TOKEN_ID,)}, {1: STOP_TOKEN_ID}, 2, "stop"),
        ({"stop_token_ids": (STOP_TOKEN_ID,), "ignore_eos": True}, {1: STOP_TOKEN_ID}, 2, "stop"),
        ({}, {}, 5, "length"),
        ({"ignore_eos": True}, {1: EOS_TOKEN_ID}, 5, "length"),
        ({"max_tokens": 3}, {3: EOS_TOKEN_ID}, 3, "length"),
    ],
)
def test_stop_conditions(
    scheduler_factory: SchedulerFactory,
    params: dict[str, Any],
    script: dict[int, int],
    want_len: int,
    want_reason: str,
) -> None:
    s = scheduler_factory()
    s.add_request(make_request("a", 5, **{"max_tokens": 5, **params}))
    next_token = scripted(5, script)
    run = run_until_done(s, next_token)
    tokens = run.token_ids["a"]
    assert len(tokens) == want_len
    assert tokens == expected_tokens(prompt_tokens("a", 5), want_len, next_token)
    assert run.finish_reasons == {"a": want_reason}


def test_min_tokens_suppresses_eos_and_stop_ids(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory()
    s.add_request(make_request("a", 5, max_tokens=6, min_tokens=3, stop_token_ids=(STOP_TOKEN_ID,)))
    s.add_request(make_request("b", 5, max_tokens=6, min_tokens=2, ignore_eos=True, stop_token_ids=(9,)))
    run = run_until_done(s, lambda request_id, history: EOS_TOKEN_ID if request_id == "a" else 9)
    masks = {
        rid: [ch.suppress_token_ids for p in run.plans for ch in p.chunks if ch.request_id == rid]
        for rid in "ab"
    }
    assert masks["a"] == [frozenset({EOS_TOKEN_ID, STOP_TOKEN_ID})] * 3 + [frozenset()]
    assert masks["b"] == [frozenset({9})] * 2 + [frozenset()]
    # the fake sampler masks like the real one: the wanted token is replaced while suppressed
    assert run.token_ids == {"a": [2, 2, 2, EOS_TOKEN_ID], "b": [10, 10, 9]}
    assert run.finish_reasons == {"a": "stop", "b": "stop"}


def test_max_model_len_ends_with_length(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory(max_model_len=10)
    request = make_request("a", 6, max_tokens=100)
    s.add_request(request)
    run = run_until_done(s)
    assert run.finish_reasons == {"a": "length"}
    assert len(run.token_ids["a"]) == 4 and request.num_tokens == 10
    assert max(len(ch.block_ids) for p in run.plans for ch in p.chunks) == 3  # positions 0..8 only

    s.add_request(make_request("b", 6, max_tokens=100))  # eos on the last allowed token: "stop" wins
    run = run_until_done(s, scripted(6, {3: EOS_TOKEN_ID}))
    assert run.finish_reasons == {"b": "stop"}


# ---- abort ----------------------------------------------------------------------------------------


def test_abort_waiting(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory()
    a = make_request("a", 5)
    s.add_request(a)
    s.add_request(make_request("b", 5, max_tokens=2))
    assert s.abort("a")
    assert a.status == RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    run = run_until_done(s)
    assert set(run.token_ids) == {"b"}


def test_abort_mid_chunked_prefill(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory(num_blocks=8, max_num_batched_tokens=4)
    s.add_request(make_request("a", 12))
    plan, outputs = fake_step(s)
    assert not plan.chunks[0].sample and outputs == []
    assert len(s.kv.block_ids("a")) == 1
    assert s.abort("a")
    assert s.kv.num_free_blocks == 8 and not s.has_unfinished()


def test_abort_running_decode_keeps_shared_prefix_of_another(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory(num_blocks=8)
    prompt = prompt_tokens("shared", 9)
    s.add_request(make_request("a", prompt, max_tokens=10))
    fake_step(s)
    s.add_request(make_request("b", prompt[:8] + [5, 6], max_tokens=3))
    fake_step(s)
    shared = s.kv.block_ids("a")[:2]
    assert s.kv.block_ids("b")[:2] == shared
    assert s.abort("a")
    assert [s.kv.pool.blocks[b].ref_count for b in shared] == [1, 1]
    run = run_until_done(s)
    assert run.token_ids["b"] == expected_tokens(prompt[:8] + [5, 6], 3)[1:]


def test_abort_preempted(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory(num_blocks=5, enable_prefix_caching=False)
    s.add_request(make_request("A", 7, max_tokens=4))
    b = make_request("B", 7, max_tokens=3)
    s.add_request(b)
    for _ in range(3):
        plan, _ = fake_step(s)
    assert plan.preempted_ids == ["B"] and b.status == RequestStatus.PREEMPTED
    assert s.abort("B")
    assert b not in s.waiting and b.status == RequestStatus.FINISHED_ABORTED
    assert s.kv.num_free_blocks == 2  # A's 3 blocks only: B's were freed at preemption, not again
    run = run_until_done(s)
    assert run.finish_reasons == {"A": "length"}


@pytest.mark.parametrize("max_tokens", [1, 4])  # 1: the aborted request would have finished in update
def test_abort_between_schedule_and_update(scheduler_factory: SchedulerFactory, max_tokens: int) -> None:
    s = scheduler_factory(num_blocks=8)
    s.add_request(make_request("a", 6, max_tokens=max_tokens))
    s.add_request(make_request("b", 6, max_tokens=2))
    plan = s.schedule()
    result = fake_execute(s, plan)
    assert s.abort("a")
    assert s.kv.block_ids("a") == [] and s.kv.num_free_blocks == 6
    outputs = s.update(plan, result)
    assert [o.request_id for o in outputs] == ["b"]
    assert s.kv.num_free_blocks == 6  # update touched nothing of a's
    run_until_done(s)


def test_abort_after_finish_or_twice_returns_false(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory()
    s.add_request(make_request("a", 3, max_tokens=1))
    run_until_done(s)
    assert not s.abort("a")
    assert not s.abort("unknown")
    s.add_request(make_request("b", 3))
    assert s.abort("b")
    assert not s.abort("b")


# ---- prefix caching -------------------------------------------------------------------------------


def test_prefix_hit_computes_only_the_rest(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory()
    prompt = prompt_tokens("p", 10)
    s.add_request(make_request("a", prompt, max_tokens=1))
    run_until_done(s)
    follower = prompt[:8] + [5, 6, 7, 8, 9]
    b = make_request("b", follower, max_tokens=2)
    s.add_request(b)
    run = run_until_done(s)
    first = run.plans[0].chunks[0]
    assert (first.start_pos, first.token_ids) == (8, follower[8:])
    assert b.num_cached_tokens == 8 and run.num_cached_tokens == {"b": 8}
    assert run.token_ids["b"] == expected_tokens(follower, 2)


def test_fully_cached_prompt_recomputes_its_last_block(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory()
    prompt = prompt_tokens("p", 8)
    s.add_request(make_request("a", prompt, max_tokens=1))
    run_until_done(s)
    s.add_request(make_request("b", prompt, max_tokens=2))
    run = run_until_done(s)
    assert run.num_cached_tokens == {"b": 4}
    assert run.plans[0].chunks[0].token_ids == prompt[4:]
    assert run.token_ids["b"] == expected_tokens(prompt, 2)


def test_generated_tokens_are_cached_too(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory()
    a = make_request("a", 6, max_tokens=3)
    s.add_request(a)
    run_until_done(s)
    s.add_request(make_request("b", a.all_token_ids[:8] + [3], max_tokens=1))
    assert run_until_done(s).num_cached_tokens == {"b": 8}


def plan_shapes(run: RunResult) -> list[list[tuple[str, int, int]]]:
    """(request, start position, tokens) of every chunk, step by step."""
    return [[(c.request_id, c.start_pos, c.num_tokens) for c in plan.chunks] for plan in run.plans]


def test_a_prefix_shared_within_a_batch_is_computed_once(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory()
    prompt = prompt_tokens("p", 9)
    s.add_request(make_request("a", prompt, max_tokens=2))
    s.add_request(make_request("b", prompt, max_tokens=2))  # a's step fills the blocks b would compute
    s.add_request(make_request("c", prompt_tokens("c", 5), max_tokens=1))  # nothing shared: goes ahead of b
    run = run_until_done(s)
    assert plan_shapes(run)[:2] == [[("a", 0, 9), ("c", 0, 5)], [("a", 9, 1), ("b", 8, 1)]]
    assert run.num_cached_tokens == {"a": 0, "b": 8, "c": 0}
    assert run.token_ids["a"] == run.token_ids["b"] == expected_tokens(prompt, 2)


def test_sharing_within_a_batch_can_be_turned_off(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory(share_planned_prefixes=False)
    prompt = prompt_tokens("p", 9)
    s.add_request(make_request("a", prompt, max_tokens=2))
    s.add_request(make_request("b", prompt, max_tokens=2))  # a's blocks are not computed yet
    run = run_until_done(s)
    assert run.num_cached_tokens == {"a": 0, "b": 0}
    assert run.token_ids["a"] == run.token_ids["b"] == expected_tokens(prompt, 2)


def test_a_request_waits_for_each_shared_block_of_a_chunked_prefill(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory(max_num_batched_tokens=6)
    prompt = prompt_tokens("p", 13)
    s.add_request(make_request("a", prompt, max_tokens=1))
    s.add_request(make_request("b", prompt[:12] + [3, 4], max_tokens=1))
    run = run_until_done(s)
    # a's chunks fill blocks 0, 1 and 2 in turn; b waits while its next block is planned, then gets all three
    assert plan_shapes(run) == [[("a", 0, 6)], [("a", 6, 6)], [("a", 12, 1), ("b", 12, 2)]]
    assert run.num_cached_tokens == {"a": 0, "b": 12}
    assert run.token_ids["b"] == expected_tokens(prompt[:12] + [3, 4], 1)


def test_a_passed_over_request_runs_when_the_block_it_waits_for_is_dropped(
        scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory()
    prompt = prompt_tokens("p", 9)
    s.add_request(make_request("a", prompt, max_tokens=2))
    s.add_request(make_request("b", prompt, max_tokens=2))
    first = s.schedule()
    assert [c.request_id for c in first.chunks] == ["a"]
    assert s.abort("a")  # before its step is read: its blocks are never registered
    s.update(first, StepResult(emitted={"a": [1]}))
    run = run_until_done(s)
    assert plan_shapes(run)[0] == [("b", 0, 9)] and run.num_cached_tokens == {"b": 0}
    assert run.token_ids["b"] == expected_tokens(prompt, 2)


def test_prefix_caching_off(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory(enable_prefix_caching=False)
    prompt = prompt_tokens("p", 10)
    s.add_request(make_request("a", prompt, max_tokens=1))
    run_until_done(s)
    s.add_request(make_request("b", prompt[:8] + [5], max_tokens=1))
    run = run_until_done(s)
    assert run.num_cached_tokens == {"b": 0}
    assert run.plans[0].chunks[0].start_pos == 0
    assert s.kv.pool.num_cached_blocks == 0


# ---- roles ----------------------------------------------------------------------------------------


def test_prefill_role_hands_off_after_first_token(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory(num_blocks=8, role="prefill", max_num_batched_tokens=8)
    request = make_request("a", 10, max_tokens=5)
    s.add_request(request)
    run = run_until_done(s)
    assert [(ch.num_tokens, ch.sample, ch.return_hidden) for p in run.plans for ch in p.chunks] == [
        (8, False, True),
        (2, True, True),
    ]
    assert run.token_ids == {"a": expected_tokens(request.prompt_token_ids, 1)}
    assert run.finish_reasons == {"a": "handoff"}
    assert request.status == RequestStatus.FINISHED_HANDOFF
    # blocks stay with the request until the KV has been handed out
    assert s.handoff_pending == {"a": request}
    assert len(s.kv.block_ids("a")) == 3 and s.kv.num_free_blocks == 5
    s.release_handoff("a")
    assert s.kv.num_free_blocks == 8 and not s.requests


@pytest.mark.parametrize(
    ("max_tokens", "script", "reason"), [(5, {0: EOS_TOKEN_ID}, "stop"), (1, {}, "length")]
)
def test_prefill_role_request_done_at_first_token_frees_at_once(
    scheduler_factory: SchedulerFactory, max_tokens: int, script: dict[int, int], reason: str
) -> None:
    s = scheduler_factory(num_blocks=8, role="prefill")
    s.add_request(make_request("a", 6, max_tokens=max_tokens))
    run = run_until_done(s, scripted(6, script))
    assert run.finish_reasons == {"a": reason}
    assert not s.handoff_pending and s.kv.num_free_blocks == 8


def test_abort_handoff_pending(scheduler_factory: SchedulerFactory) -> None:
    s = scheduler_factory(num_blocks=8, role="prefill")
    s.add_request(make_request("a", 6))
    run_until_done(s)
    assert s.abort("a")
    assert not s.handoff_pending and s.kv.num_free_blocks == 8


def test_decode_role_continues_from_first_token(scheduler_factory: SchedulerFactory) -> None:
    prompt = prompt_tokens("a", 7)
    colocated = scheduler_factory()
    colocated.add_request(make_request("a", prompt, max_tokens=5))
    want = run_until_done(colocated).token_ids["a"]

    s = scheduler_factory(num_blocks=8, role="decode")
    request = make_request("a", prompt, output_token_ids=want[:1], max_tokens=5)
    assert s.kv.allocate_slots(request, len(prompt))
    request.num_computed_tokens = len(prompt)
    inject_fake_kv(s, request)  # what the engine's inject_kv does with the handed-off KV
    s.add_running(request)
    assert s.kv.pool.num_cached_blocks == 1  # the prompt's full block is registered on adoption
    run = run_until_done(s)
    first = run.plans[0].chunks[0]
    assert (first.start_pos, first.token_ids, first.sample) == (7, want[:1], True)
    assert run.token_ids == {"a": want[1:]}
    assert request.output_token_ids == want
    assert run.finish_reasons == {"a": "length"}


def test_second_tier_hooks_see_a_preempted_request_before_its_blocks_go_and_before_it_resumes(
        scheduler_factory: SchedulerFactory) -> None:
    """kv_spill.py's hooks: `on_preempt` with the victim's blocks still held (it parks them), `on_resume` before
    the resuming request's admission looks up the prefix cache (it reads them back), never for a new request."""
    s = scheduler_factory(num_blocks=6, max_num_seqs=3, enable_prefix_caching=False)
    events: list[tuple[str, str, int, int]] = []
    s.on_preempt = lambda r: events.append(("preempt", r.request_id, len(s.kv.block_ids(r.request_id)),
                                            r.num_preemptions))

    def on_resume(r: Request) -> bool:  # the first call per preemption asks to wait a step (blocks not free yet)
        events.append(("resume", r.request_id, len(s.kv.block_ids(r.request_id)), r.num_preemptions))
        return sum(1 for e in events if e[0] == "resume" and e[1] == r.request_id and e[3] == r.num_preemptions) == 1

    s.on_resume = on_resume
    for rid, prompt_len, max_tokens in _preemption_requests():
        s.add_request(make_request(rid, prompt_len, max_tokens=max_tokens))
    requests = dict(s.requests)
    run_until_done(s)
    assert events and events[0] == ("preempt", "C", 2, 0)  # C held its two blocks, not yet counted preempted
    preempted = [e for e in events if e[0] == "preempt"]
    resumed = [e for e in events if e[0] == "resume"]
    assert {e[1] for e in resumed} == {e[1] for e in preempted}
    assert all(sum(1 for r in resumed if r[1:] == e[1:]) >= 2 for e in resumed)  # waited, then was admitted
    assert all(blocks == 0 and n >= 1 for _, _, blocks, n in resumed)  # nothing held yet, after its preemption
    assert "D" not in {e[1] for e in events} or requests["D"].num_preemptions > 0
    assert {rid: r.output_token_ids for rid, r in requests.items()} == _run_preemption_workload(
        scheduler_factory(enable_prefix_caching=False))
