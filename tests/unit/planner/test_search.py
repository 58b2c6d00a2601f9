"""The search: the fewest engines meeting the SLO, and which stage cannot when nothing does."""

from __future__ import annotations

import pytest

from shared.planner.metrics import SLO
from shared.planner.search import InfeasibleSLO, SearchLimits, search
from shared.planner.simulator import Shape
from shared.planner.workload import TraceRequest, synthetic
from tests.unit.planner.factories import make_profile


def test_light_load_needs_one_engine() -> None:
    profile = make_profile()
    trace = [TraceRequest(float(i * 10), 100, 10) for i in range(5)]  # each alone: TTFT 0.11 s, TPOT 25 ms
    found = search(profile, trace, SLO(1.0, 0.1))
    assert found.shape == Shape(0, 1, 0, colocated=True)
    assert found.attainment == 1.0


def test_more_load_needs_more_prefill() -> None:
    """Prefill-bound: 100-token prompts at 0.1 s each, 25/s. One engine serves at most 10/s."""
    profile = make_profile(prefill=(0.0, 0.001, 0.0), decode=(0.001, 0.0, 0.0), budget=100, max_num_seqs=4)
    trace = synthetic("chat", 25.0, 400, seed=1)
    trace = [TraceRequest(r.arrival_s, 100, 2) for r in trace]
    found = search(profile, trace, SLO(0.5, 1.0), modes=("disagg",), limits=SearchLimits(max_per_service=16))
    assert found.shape.num_prefill >= 3  # 25/s over 10/s each, with queueing
    assert found.attainment >= 0.9
    fewer = search(profile, [TraceRequest(r.arrival_s * 5, 100, 2) for r in trace], SLO(0.5, 1.0),
                   modes=("disagg",), limits=SearchLimits(max_per_service=16))
    assert fewer.shape.num_prefill < found.shape.num_prefill


def test_infeasible_ttft_names_prefill() -> None:
    profile = make_profile(prefill=(0.1, 0.001, 0.0))
    trace = [TraceRequest(float(i), 1900, 10) for i in range(20)]
    with pytest.raises(InfeasibleSLO, match=r"prefill alone takes 2\.00 s for p90 prompts \(1900 tokens.*"
                                            r"TTFT 1 s cannot be met at any replica count"):
        search(profile, trace, SLO(1.0, 0.1))


def test_infeasible_tpot_names_decode() -> None:
    profile = make_profile(decode=(0.2, 0.0, 0.0))
    trace = [TraceRequest(float(i), 100, 10) for i in range(20)]
    with pytest.raises(InfeasibleSLO, match=r"a decode step alone takes 200\.0 ms .* TPOT 100 ms cannot be met"):
        search(profile, trace, SLO(1.0, 0.1))


def test_out_of_replicas_says_which_stage() -> None:
    profile = make_profile(prefill=(0.0, 0.001, 0.0), budget=100)
    trace = [TraceRequest(i * 0.01, 100, 1) for i in range(300)]  # 100/s of 0.1-s prompts
    with pytest.raises(InfeasibleSLO, match=r"no fleet of up to 2 instances.*prefill \(TTFT\) is the stage"):
        search(profile, trace, SLO(0.3, 1.0), limits=SearchLimits(max_per_service=2))
