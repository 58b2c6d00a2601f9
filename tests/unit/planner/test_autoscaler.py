"""The autoscaling signal's parts: the rate meter, the plan per rate and its gauges, the metrics parser."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from shared.errors import ConfigError
from shared.planner.autoscaler import Autoscaler, PlannerConfig, RateMeter, requests_total
from shared.planner.metrics import SLO
from shared.planner.search import SearchLimits
from tests.unit.planner.factories import make_profile


def test_rate_meter_window_and_restart() -> None:
    meter = RateMeter(window_s=10)
    assert meter.rate() is None
    meter.add(0.0, 0)
    assert meter.rate() is None
    for t in range(1, 31):
        meter.add(float(t), 2.0 * t)  # 2 req/s
    assert meter.rate() == pytest.approx(2.0)
    meter.add(31.0, 5.0)  # the counter went back: a restarted router
    assert meter.rate() is None
    meter.add(33.0, 11.0)
    assert meter.rate() == pytest.approx(3.0)
    with pytest.raises(ConfigError, match="window"):
        RateMeter(0)


def test_requests_total_sums_statuses() -> None:
    text = ('# TYPE baton_requests_total counter\nbaton_requests_total{status="200"} 7.0\n'
            'baton_requests_total{status="429"} 3.0\nbaton_requests_created{status="200"} 1.7e9\n')
    assert requests_total(text) == 10.0


def test_desired_replicas_follow_the_rate() -> None:
    profile = make_profile(prefill=(0.0, 0.001, 0.0), decode=(0.01, 0.001, 0.0))
    config = PlannerConfig(workload="chat", slo=SLO(1.0, 0.1), rate_step=1.0, num_requests=300,
                           limits=SearchLimits(max_per_service=16))
    autoscaler = Autoscaler(profile, config)
    low = autoscaler.update(0.3)
    high = autoscaler.update(20.0)
    assert high.num_prefill + high.num_decode > low.num_prefill + low.num_decode
    text = generate_latest(autoscaler.registry).decode()
    assert f'baton_planner_desired_replicas{{service="prefill"}} {float(high.num_prefill)}' in text
    assert f'baton_planner_desired_replicas{{service="decode"}} {float(high.num_decode)}' in text
    assert "baton_planner_request_rate 20.0" in text
    assert "baton_planner_infeasible 0.0" in text


def test_infeasible_rate_keeps_the_last_plan() -> None:
    profile = make_profile(prefill=(0.0, 0.001, 0.0), budget=100)
    config = PlannerConfig(workload="chat", slo=SLO(2.0, 0.5), rate_step=1.0, num_requests=200,
                           limits=SearchLimits(max_per_service=2))
    autoscaler = Autoscaler(profile, config)
    kept = autoscaler.update(0.5)
    assert autoscaler.update(500.0) == kept
    assert "baton_planner_infeasible 1.0" in generate_latest(autoscaler.registry).decode()


def test_router_urls() -> None:
    from shared.planner.autoscaler import router_urls

    assert router_urls("http://a:1/metrics, http://b:2/metrics") == ["http://a:1/metrics", "http://b:2/metrics"]
    assert router_urls("dns+http://127.0.0.1:8000/metrics") == ["http://127.0.0.1:8000/metrics"]
    with pytest.raises(ConfigError, match="needs a host name and a port"):
        router_urls("dns+http://router/metrics")
    with pytest.raises(ConfigError, match="no router metrics URL"):
        router_urls(" , ")
