"""The SLA autoscaling signal: desired replicas per service, re-planned from the router's observed rate.

```
 every interval_s:  GET each router's /metrics ─► baton_requests_total (all statuses, summed) ─► RateMeter
                    rate ─► search(profile, workload shape at that rate, SLO)   (cached per rate step)
                    ─► gauges on this process's /metrics:
                         baton_planner_desired_replicas{service="prefill"|"decode"|"kv_transfer"}
                         baton_planner_request_rate, baton_planner_predicted_attainment, baton_planner_infeasible
 an HPA per Deployment reads its service's gauge as an External metric with target averageValue 1, so
 that its replica count follows the plan (deploy/k8s/overlays/planner-autoscaling)
```

The workload's shape (length distributions, prefix sharing) is the one named at start; only the rate is
observed. Rates are rounded up to a step (`rate_step`) so the search runs once per step, not per scrape.
An SLO no fleet meets at the observed rate keeps the last plan and raises baton_planner_infeasible.
"""

from __future__ import annotations

import logging
import math
import socket
import time
import urllib.parse
import urllib.request
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from shared.errors import ConfigError
from shared.planner.metrics import SLO
from shared.planner.profile import Profile
from shared.planner.search import Candidate, InfeasibleSLO, SearchLimits, search
from shared.planner.simulator import Shape, SimOptions
from shared.planner.workload import synthetic

logger = logging.getLogger(__name__)
SERVICES = ("prefill", "decode", "kv_transfer")


def requests_total(metrics_text: str) -> float:
    """The router's finished requests, all statuses summed (baton_requests_total)."""
    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "baton_requests":
            total += sum(s.value for s in family.samples if s.name == "baton_requests_total")
    return total


def scrape(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return str(response.read().decode())


def router_urls(spec: str) -> list[str]:
    """The /metrics URLs to sum: comma-separated URLs; `dns+http://NAME:PORT/PATH` stands for every address
    NAME resolves to (a headless Service lists each router pod), resolved again at every scrape."""
    urls: list[str] = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        if not item.startswith("dns+"):
            urls.append(item)
            continue
        parsed = urllib.parse.urlsplit(item.removeprefix("dns+"))
        if parsed.hostname is None or parsed.port is None:
            raise ConfigError(f"{item}: a dns+ URL needs a host name and a port")
        infos = socket.getaddrinfo(parsed.hostname, parsed.port, type=socket.SOCK_STREAM)
        for address in sorted({str(info[4][0]) for info in infos}):
            host = f"[{address}]" if ":" in address else address
            urls.append(urllib.parse.urlunsplit((parsed.scheme, f"{host}:{parsed.port}", parsed.path, "", "")))
    if not urls:
        raise ConfigError(f"no router metrics URL in {spec!r}")
    return urls


def fleet_requests_total(spec: str) -> float:
    """baton_requests_total summed over every router `spec` names (router_urls)."""
    return sum(requests_total(scrape(url)) for url in router_urls(spec))


class RateMeter:
    """Requests per second over the last `window_s`, from samples of a counter."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ConfigError(f"the rate window must be > 0 s, got {window_s}")
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, now_s: float, count: float) -> None:
        if self._samples and count < self._samples[-1][1]:  # the router restarted: its counter began again
            self._samples.clear()
        self._samples.append((now_s, count))
        while len(self._samples) > 2 and now_s - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def rate(self) -> float | None:
        """None until two samples span some time."""
        if len(self._samples) < 2 or self._samples[-1][0] <= self._samples[0][0]:
            return None
        (t0, c0), (t1, c1) = self._samples[0], self._samples[-1]
        return (c1 - c0) / (t1 - t0)


@dataclass(frozen=True)
class PlannerConfig:
    workload: str
    slo: SLO
    rate_step: float = 0.5  # req/s: rates are rounded up to a multiple of this
    num_requests: int = 500
    options: SimOptions = field(default_factory=SimOptions)
    limits: SearchLimits = field(default_factory=SearchLimits)


class Autoscaler:
    """Plans per observed rate and exports the result as gauges (see the module docstring)."""

    def __init__(self, profile: Profile, config: PlannerConfig) -> None:
        if config.rate_step <= 0:
            raise ConfigError(f"the rate step must be > 0 req/s, got {config.rate_step}")
        self.profile, self.config = profile, config
        self.registry = CollectorRegistry()
        self.desired = Gauge("baton_planner_desired_replicas", "Replicas the plan wants per service.",
                             ["service"], registry=self.registry)
        self.rate = Gauge("baton_planner_request_rate", "Requests/s the router served over the window.",
                          registry=self.registry)
        self.attainment = Gauge("baton_planner_predicted_attainment", "SLO attainment the plan predicts.",
                                registry=self.registry)
        self.infeasible = Gauge("baton_planner_infeasible", "1 while no fleet meets the SLO at the rate.",
                                registry=self.registry)
        self._plans: dict[float, Candidate] = {}
        self.shape = Shape(1, 1, 1)
        for service in SERVICES:
            self.desired.labels(service=service).set(1)

    def plan_for(self, rate: float) -> Candidate:
        step = self.config.rate_step
        bucket = max(step, math.ceil(rate / step - 1e-9) * step)
        if bucket not in self._plans:
            trace = synthetic(self.config.workload, bucket, self.config.num_requests)
            self._plans[bucket] = search(self.profile, trace, self.config.slo, self.config.options,
                                         self.config.limits, modes=("disagg",))
        return self._plans[bucket]

    def update(self, rate: float) -> Shape:
        """Re-plan for `rate` and set the gauges; returns the shape now wanted."""
        self.rate.set(rate)
        try:
            found = self.plan_for(rate)
        except InfeasibleSLO as exc:
            logger.warning("planner: at %.3g req/s: %s; keeping %s", rate, exc.message, self.shape.describe())
            self.infeasible.set(1)
            return self.shape
        self.infeasible.set(0)
        self.attainment.set(found.attainment)
        if found.shape != self.shape:
            logger.info("planner: %.3g req/s -> %s (predicted attainment %.1f%%)", rate, found.shape.describe(),
                        found.attainment * 100)
        self.shape = found.shape
        counts = {"prefill": found.shape.num_prefill, "decode": found.shape.num_decode,
                  "kv_transfer": found.shape.num_kv}
        for service, count in counts.items():
            self.desired.labels(service=service).set(count)
        return found.shape


def run_loop(autoscaler: Autoscaler, metrics_urls: str, meter: RateMeter, interval_s: float,
             iterations: int | None = None) -> None:
    """Scrape, measure, re-plan every `interval_s` (forever, or `iterations` times)."""
    done = 0
    while iterations is None or done < iterations:
        try:
            now = time.monotonic()
            meter.add(now, fleet_requests_total(metrics_urls))
        except OSError as exc:  # a router restarting: keep the last plan, try again next interval
            logger.warning("planner: cannot scrape %s: %s", metrics_urls, exc)
        rate = meter.rate()
        if rate is not None:
            autoscaler.update(rate)
        done += 1
        if iterations is None or done < iterations:
            time.sleep(interval_s)
