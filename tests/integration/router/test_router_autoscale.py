"""The autoscaling loop against a real router: it reads the router's /metrics, measures the request rate and
exports the desired replicas the plan gives for it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import generate_latest

from services.router.app import create_app
from services.router.settings import RouterSettings
from shared.planner.autoscaler import Autoscaler, PlannerConfig, RateMeter, run_loop
from shared.planner.metrics import SLO
from shared.planner.search import SearchLimits
from tests.integration.router.helpers import EngineUnderTest, serve
from tests.unit.planner.factories import make_profile


def test_loop_follows_the_router_rate(tiny: EngineUnderTest, smol_tokenizer: Any) -> None:
    app = create_app(RouterSettings(max_model_len=tiny.engine.max_model_len), tiny.spy, smol_tokenizer, "tiny")
    profile = make_profile(prefill=(0.0, 1e-4, 0.0), decode=(0.005, 5e-4, 0.0))
    autoscaler = Autoscaler(profile, PlannerConfig(workload="chat", slo=SLO(1.0, 0.1), rate_step=0.5,
                                                   num_requests=200, limits=SearchLimits(max_per_service=32)))
    meter = RateMeter(window_s=60)
    with serve(app) as base_url:
        run_loop(autoscaler, f"{base_url}/metrics", meter, interval_s=0.0, iterations=1)
        assert meter.rate() is None  # one sample: no rate yet
        started = time.monotonic()
        with httpx.Client(base_url=base_url, timeout=60) as client:
            for _ in range(10):
                reply = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2})
                assert reply.status_code == 200
        host_port = base_url.removeprefix("http://")  # the same router twice would count double: once, by DNS
        run_loop(autoscaler, f"dns+http://{host_port}/metrics", meter, interval_s=0.0, iterations=1)
        elapsed = time.monotonic() - started
    tiny.wait_idle()
    rate = meter.rate()
    assert rate is not None and rate >= 10 / elapsed  # 10 requests between the scrapes, within elapsed
    expected = autoscaler.plan_for(rate).shape
    text = generate_latest(autoscaler.registry).decode()
    assert f'baton_planner_desired_replicas{{service="decode"}} {float(expected.num_decode)}' in text
    assert f'baton_planner_desired_replicas{{service="prefill"}} {float(expected.num_prefill)}' in text
    assert "baton_planner_infeasible 0.0" in text


def test_autoscale_command_bad_input(tmp_path: Path) -> None:
    def autoscale(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "shared.cli.main", "autoscale", *args], capture_output=True,
                              text=True, timeout=60)

    missing = autoscale("--profile", str(tmp_path / "none.json"), "--slo", "ttft=1,tpot=1",
                        "--router-metrics", "http://127.0.0.1:9/metrics")
    assert missing.returncode == 2 and "cannot read profile" in missing.stderr
    make_profile().save(tmp_path / "p.json")
    bad_slo = autoscale("--profile", str(tmp_path / "p.json"), "--slo", "ttft=1", "--router-metrics", "http://x")
    assert bad_slo.returncode == 2 and "--slo needs both ttft and tpot" in bad_slo.stderr
