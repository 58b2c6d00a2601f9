"""The multi-turn workload's pure parts: fixed-seed conversations and the per-turn summary."""

from __future__ import annotations

import dataclasses

import pytest

from bench.serve_multiturn import MultiTurnPlan, TurnRecord, conversations, summarize_turns
from bench.serve_stats import SLO, RequestRecord

PLAN = MultiTurnPlan(num_conversations=5, num_turns=3, num_templates=2, template_words=30, user_words=6,
                     output_tokens=4)


def turn(conversation: int, index: int, prompt: int, cached: int, ttft_s: float = 0.1) -> TurnRecord:
    record = RequestRecord(sent_s=1.0, token_times_s=[1.0 + ttft_s + 0.01 * i for i in range(4)], output_tokens=4,
                           prompt_tokens=prompt, cached_tokens=cached)
    return TurnRecord(conversation, index, record)


def test_conversations_are_fixed_by_the_seed_and_share_templates() -> None:
    convs = conversations(PLAN, seed=3)
    assert convs == conversations(PLAN, seed=3) and convs != conversations(PLAN, seed=4)
    assert len({c.system for c in convs}) == 2 and convs[0].system == convs[2].system == convs[4].system
    assert all(len(c.user_turns) == 3 for c in convs)
    assert len(convs[0].system.split()) == 4 + 30  # "You are assistant 0." and the template's words


def test_summary_counts_prefix_hits_and_goodput() -> None:
    turns = [turn(0, 0, 100, 0), turn(0, 1, 200, 150), turn(1, 0, 100, 50, ttft_s=5.0),
             TurnRecord(1, 1, RequestRecord(sent_s=0.0, error="not sent"))]
    out = summarize_turns(turns, duration_s=2.0, slo=SLO(ttft_s=1.0, tpot_s=0.1))
    assert out["prefix_hit_rate"] == pytest.approx(200 / 400)
    assert out["prefix_hit_rate_later_turns"] == pytest.approx(150 / 200)
    assert out["prefix_hit_rate_first_turns"] == pytest.approx(50 / 200)
    assert out["num_failed"] == 1 and out["slo_attainment"] == pytest.approx(2 / 4)
    assert out["good_req_s"] == pytest.approx(1.0)


def test_random_templates_draw_by_seed_and_leave_cycled_plans_as_they_were() -> None:
    drawn = dataclasses.replace(PLAN, num_conversations=40, num_templates=8, random_templates=True)
    convs = conversations(drawn, seed=3)
    assert convs == conversations(drawn, seed=3)
    systems = [c.system for c in convs]
    assert 1 < len(set(systems)) <= 8
    assert systems != [systems[c % 8] for c in range(40)]  # not the cycle
    assert conversations(PLAN, seed=3) == conversations(dataclasses.replace(PLAN, random_templates=False), seed=3)
