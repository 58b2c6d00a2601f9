"""Prometheus metrics of an engine service, read from the engine's load at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.engine.async_engine import AsyncEngine


class EngineCollector(Collector):
    """baton_kv_blocks_total/free and running/waiting request gauges (vLLM's names where they exist)."""

    def __init__(self, aengine: AsyncEngine, role: str) -> None:
        self.aengine = aengine
        self.role = role

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        load = self.aengine.load
        labels = ["role"]
        for name, doc, value in (
            ("baton_kv_blocks_total", "KV cache blocks in the pool", load.num_kv_blocks_total),
            ("baton_kv_blocks_free", "KV blocks held by no request (idle cached blocks count)",
             load.num_kv_blocks_free),
            ("baton_num_requests_running", "Requests in the running batch", load.num_running),
            ("baton_num_requests_waiting", "Requests waiting for admission", load.num_waiting),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.role], value)
            yield g
        steps = CounterMetricFamily("baton_engine_steps", "Engine steps executed", labels=labels)
        steps.add_metric([self.role], self.aengine.num_steps)
        yield steps
        preempt = CounterMetricFamily("baton_num_preemptions", "Requests preempted (KV recomputed)",
                                      labels=labels)
        preempt.add_metric([self.role], self.aengine.engine.scheduler.num_preemptions_total)
        yield preempt


def engine_registry(aengine: AsyncEngine, role: str) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(EngineCollector(aengine, role))
    return registry
