"""The serving benchmark's pure statistics: percentiles, per-request timings, SLO attainment, goodput."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.serve_stats import SLO, RequestRecord, attainment, goodput, percentile, summarize


def make_record(ttft_s: float, tpot_s: float, tokens: int, sent_s: float = 10.0) -> RequestRecord:
    times = [sent_s + ttft_s + i * tpot_s for i in range(tokens)]
    return RequestRecord(sent_s=sent_s, token_times_s=times, output_tokens=tokens)


@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy(q: float) -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 7.5]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_record_timings() -> None:
    r = make_record(ttft_s=0.5, tpot_s=0.1, tokens=11)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.e2e_s == pytest.approx(1.5)
    assert r.tpot_s == pytest.approx(0.1)
    assert r.itls_s == pytest.approx([0.1] * 10)
    # usage says more tokens than chunks arrived (tokens merged into one chunk): TPOT uses the token count
    merged = RequestRecord(sent_s=0.0, token_times_s=[1.0, 2.0], output_tokens=11)
    assert merged.tpot_s == pytest.approx(0.1)
    assert make_record(0.5, 0.0, tokens=1).tpot_s == 0.0


def test_slo_counts_failed_requests_as_misses() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.2)
    records = [make_record(0.5, 0.1, 8), make_record(1.5, 0.1, 8), make_record(0.5, 0.3, 8),
               RequestRecord(sent_s=0.0, error="HTTP 500")]
    assert [slo.met_by(r) for r in records] == [True, False, False, False]
    assert attainment(records, slo) == 0.25
    assert attainment([], slo) == 0.0


def test_summarize() -> None:
    records = [make_record(0.2, 0.05, 10), make_record(0.4, 0.05, 10), RequestRecord(sent_s=0.0, error="x")]
    s = summarize(records, duration_s=2.0, slo=SLO(ttft_s=0.3, tpot_s=0.1))
    assert (s["num_ok"], s["num_failed"], s["output_tokens"]) == (2, 1, 20)
    assert s["output_tok_s"] == 10.0 and s["req_s"] == 1.0
    assert s["p50_ttft_ms"] == pytest.approx(300.0)
    assert s["p99_tpot_ms"] == pytest.approx(50.0)
    assert s["slo_attainment"] == pytest.approx(1 / 3)


def test_goodput_highest_passing_rate_and_interpolation() -> None:
    g = goodput({0.5: 1.0, 1.0: 0.95, 2.0: 0.85, 4.0: 0.2})
    assert g.highest_passing_rate == 1.0
    assert g.first_failing_rate == 2.0
    assert g.interpolated_rate == pytest.approx(1.5)  # 0.95 -> 0.85 crosses 0.9 halfway


def test_goodput_ignores_a_noisy_pass_after_the_first_failure() -> None:
    assert goodput({1.0: 0.95, 2.0: 0.5, 3.0: 0.92}).highest_passing_rate == 1.0


def test_goodput_all_pass_or_all_fail() -> None:
    assert goodput({1.0: 1.0, 2.0: 0.9}) == goodput({2.0: 0.9, 1.0: 1.0})
    assert goodput({1.0: 1.0, 2.0: 0.9}).interpolated_rate == 2.0
    failing = goodput({1.0: 0.5, 2.0: 0.1})
    assert (failing.highest_passing_rate, failing.interpolated_rate, failing.first_failing_rate) == (0.0, 0.0, 1.0)
    with pytest.raises(ValueError):
        goodput({})
