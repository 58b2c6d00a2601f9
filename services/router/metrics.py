"""Prometheus metrics of the router, in a registry owned by one app (tests build many apps).

Per request: time to first token (arrival to the first generated token reaching the
router), inter-token latency (gap between token arrivals, once per token), end-to-end
latency of requests that finished, and a count by final HTTP status (499: the client
went away; a stream that fails after its first byte counts under the error's status).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from services.router.routing import Router

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.time_to_first_token_s = Histogram(
            "baton_time_to_first_token_seconds", "Request arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS_S, registry=self.registry,
        )
        self.inter_token_latency_s = Histogram(
            "baton_inter_token_latency_seconds", "Gap between consecutive generated tokens of a request.",
            buckets=_ITL_BUCKETS_S, registry=self.registry,
        )
        self.e2e_request_latency_s = Histogram(
            "baton_e2e_request_latency_seconds", "Request arrival to its last token, for finished requests.",
            buckets=_E2E_BUCKETS_S, registry=self.registry,
        )
        self.requests = Counter(
            "baton_requests", "Generation requests by final HTTP status.", ["status"], registry=self.registry,
        )

    def watch_routing(self, router: Router) -> None:
        """Export the router's picks: calls per instance, calls open now, local prefills."""
        self.registry.register(_RoutingCollector(router))

    def record_status(self, status: int) -> None:
        self.requests.labels(status=str(status)).inc()

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type, for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _RoutingCollector(Collector):
    def __init__(self, router: Router) -> None:
        self._router = router

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        calls = CounterMetricFamily("baton_router_assignments", "Calls sent to each instance (prefill "
                                    "calls and decode streams; retries count again).", labels=["role", "instance"])
        for (role, instance_id), count in sorted(self._router.assignments.items()):
            calls.add_metric([role, instance_id], count)
        yield calls
        open_now = GaugeMetricFamily("baton_router_inflight", "Calls open on each instance now.",
                                     labels=["role", "instance"])
        for role, counts in self._router.inflight.items():
            for instance_id, count in sorted(counts.counts.items()):
                open_now.add_metric([role, instance_id], count)
        yield open_now
        yield CounterMetricFamily("baton_router_local_prefills", "Disaggregated mode: requests prefilled on "
                                  "their decode instance (short, or mostly cached there).",
                                  value=self._router.num_local_prefills)
        yield CounterMetricFamily("baton_router_migrations", "Requests moved on from a failed instance: a "
                                  "decode stream resumed elsewhere, or a prompt a decode computed when the "
                                  "prefill path failed.", value=self._router.num_migrations)
        yield CounterMetricFamily("baton_router_migrations_refused", "Broken decode streams that ended in "
                                  "an error because the request had used its migrations (--migration-limit).",
                                  value=self._router.num_migrations_refused)


class RequestTimer:
    """Latency bookkeeping for one request, started at its arrival."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics
        self.start_s = time.monotonic()
        self._last_token_s: float | None = None
        self._done = False

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self._last_token_s is None:
            self._metrics.time_to_first_token_s.observe(now - self.start_s)
            num_gaps = num_tokens - 1  # tokens arriving together: the rest came with no gap
            gap_s = 0.0
        else:
            num_gaps = num_tokens
            gap_s = (now - self._last_token_s) / num_tokens
        for _ in range(num_gaps):
            self._metrics.inter_token_latency_s.observe(gap_s)
        self._last_token_s = now

    def finished(self) -> None:
        if not self._done:
            self._done = True
            self._metrics.e2e_request_latency_s.observe(time.monotonic() - self.start_s)
