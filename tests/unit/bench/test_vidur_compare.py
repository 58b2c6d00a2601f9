"""The Vidur comparison's pure parts: the step time its driver books equals the profile's, and Vidur's
per-request timings summarize as the simulator's do."""

from __future__ import annotations

import pytest

from bench.vidur_compare import as_sim_requests
from bench.vidur_driver import step_s
from shared.planner.metrics import SLO, summarize, tpot_s, ttft_s
from shared.planner.profile import EngineCurves
from shared.planner.workload import TraceRequest


def test_the_driver_books_the_profile_step_time() -> None:
    curves = EngineCurves(prefill_fit=[0.007, 0.0013, 2e-7], decode_fit=[0.019, 0.0006, 6e-6])
    fits = {"prefill": curves.prefill_fit, "decode": curves.decode_fit}
    for prefill in (0, 1, 64, 2048):
        for batch in (0, 1, 7, 64):
            for context in (0, 300, 40_000):
                assert step_s(fits, prefill, batch, context) == pytest.approx(
                    curves.mixed_step_s(prefill, batch, context)), (prefill, batch, context)


def test_the_driver_books_the_profile_decode_step_between_measured_batches() -> None:
    """Decode points off any one plane (batch 1 costs nearly what batch 4 does): the driver's restated
    interpolation books what EngineCurves.decode_step_s gives, below, between and past the batch sizes."""
    curves = EngineCurves(prefill_fit=[0.007, 0.0013, 2e-7], decode_fit=[0.019, 0.0006, 6e-6])
    curves.decode_points = [[b, c, 0.019 + 0.0004 * b ** 1.3 + 6e-6 * b * c]
                            for b in (1, 4, 16) for c in (64, 512)]
    fits = {"prefill": curves.prefill_fit, "decode": curves.decode_fit, "decode_lines": curves.decode_lines()}
    for batch in (1, 2, 4, 9, 16, 40):
        for context in (64 * batch, 300 * batch):
            got = step_s(fits, 0, batch, context)
            assert got == pytest.approx(curves.decode_step_s(batch, context)), (batch, context)
            if batch in (1, 4, 16):  # a measured batch size: its own points, not the plane's
                assert got == pytest.approx(0.019 + 0.0004 * batch ** 1.3 + 6e-6 * context)


def test_vidur_timings_become_requests_the_simulator_summary_reads() -> None:
    trace = [TraceRequest(1.0, 100, 5), TraceRequest(2.0, 50, 1)]
    requests = as_sim_requests(trace, [[0.2, 0.03], [0.1, 0.0]])
    assert [ttft_s(r) for r in requests] == pytest.approx([0.2, 0.1])
    assert tpot_s(requests[0]) == pytest.approx(0.03)
    summary = summarize(requests, SLO(1.0, 1.0))
    assert summary["p50_tpot_ms"] == pytest.approx(30.0) and summary["slo_attainment"] == 1.0
