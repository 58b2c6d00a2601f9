"""Prometheus metrics of an engine service, read from the engine's load at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from shared.engine.async_engine import AsyncEngine
from shared.engine.kv_stats import BUCKETS_S
from shared.grpc_auth import AuthCollector


class EngineCollector(Collector):
    """baton_kv_blocks_total/free, running/waiting gauges and spec-decode counters (vLLM's names where they exist)."""

    def __init__(self, aengine: AsyncEngine, role: str) -> None:
        self.aengine = aengine
        self.role = role

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
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
        clock = self.aengine.engine.runner.clock
        idle = GaugeMetricFamily("baton_engine_idle_ratio", "Gaps between consecutive executor steps over "
                                 "gaps plus step time, while work was queued", labels=labels)
        idle.add_metric([self.role], clock.idle_ratio)
        yield idle
        masks = self.aengine.engine.runner.masks
        for name, doc, seconds in (
            ("baton_logits_mask_build_seconds", "Time building grammar bitmasks and penalty inputs (a worker "
             "thread, beside the forward)", masks.build_s),
            ("baton_logits_mask_wait_seconds", "Executor time blocked on masks after the forward (their cost "
             "the forward did not hide)", masks.wait_s),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self.role], seconds)
            yield c
        yield from self._thread_metrics()
        yield from self._spec_metrics()
        yield from self._kv_transfer_metrics()
        yield from self._offload_metrics()

    def _offload_metrics(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        """The second tiers of evicted and preempted KV: the host tiers (kv_offload.py, one per layer group):
        spills, restores (blocks of every group); kv_transfer's pool (kv_spill.py): preempted contexts parked
        and read back. Swap-in time per admission of either."""
        engine = self.aengine.engine
        tiers, spill = engine.kv.tiers, engine.spill
        if not tiers and spill is None:
            return
        seconds = HistogramMetricFamily("baton_kv_swap_in_seconds", "Time restoring one admission's blocks from "
                                        "a second tier (a preempted request resuming, or an evicted prefix)",
                                        labels=["role", "tier"])
        if tiers:
            for name, doc, value in (
                ("baton_kv_offload_spilled_blocks", "Evicted prefix blocks copied to host memory (every layer group)",
                 sum(t.stats.spilled_blocks for t in tiers)),
                ("baton_kv_offload_restored_blocks", "Blocks copied back from host memory instead of recomputed",
                 sum(t.stats.restored_blocks for t in tiers)),
                ("baton_kv_offload_dropped_blocks", "Spilled blocks dropped from host memory unused (it was full)",
                 sum(t.stats.dropped_blocks for t in tiers)),
            ):
                c = CounterMetricFamily(name, doc, labels=["role"])
                c.add_metric([self.role], value)
                yield c
            st = tiers[0].stats.swap_in  # group 0's tier times each admission's restores, every group's together
            seconds.add_metric([self.role, "host"], _buckets(st.bucket_counts), st.sum_s)
        if spill is not None and engine.remote is not None:
            for name, doc, value in (
                ("baton_kv_spill_parked_blocks", "Blocks of preempted requests written to kv_transfer's pool (every "
                 "layer group; those it held already are not written)", spill.spilled_units),
                ("baton_kv_spill_restored_blocks", "Blocks of resuming requests read back from kv_transfer's pool "
                 "instead of recomputed", spill.swapped_in_blocks),
            ):
                c = CounterMetricFamily(name, doc, labels=["role"])
                c.add_metric([self.role], value)
                yield c
            st = engine.remote.stats.by_direction["swap_in"]
            seconds.add_metric([self.role, "kv_transfer"], _buckets(st.bucket_counts), st.sum_s)
        yield seconds

    def _kv_transfer_metrics(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        """Transfers to and from kv_transfer's slots: time per request, bytes, failures, prefix imports."""
        remote = self.aengine.engine.remote
        if remote is None:
            return
        seconds = HistogramMetricFamily("baton_kv_transfer_seconds", "Time to move one request's KV",
                                        labels=["role", "direction"])
        nbytes = CounterMetricFamily("baton_kv_transfer_bytes", "KV and hidden-state bytes moved",
                                     labels=["role", "direction"])
        failures = CounterMetricFamily("baton_kv_transfer_failures", "Requests whose KV transfer failed",
                                       labels=["role", "direction"])
        for direction, st in remote.stats.by_direction.items():
            seconds.add_metric([self.role, direction], _buckets(st.bucket_counts), st.sum_s)
            nbytes.add_metric([self.role, direction], st.nbytes)
            failures.add_metric([self.role, direction], st.failures)
        imported = CounterMetricFamily("baton_prefix_pool_imported_tokens",
                                       "Prompt tokens read from kv_transfer's prefix pool instead of computed",
                                       labels=["role"])
        imported.add_metric([self.role], remote.stats.imported_tokens)
        yield from (seconds, nbytes, failures, imported)

    def _spec_metrics(self) -> Iterator[CounterMetricFamily]:
        """vLLM's spec-decode counters (mean acceptance length = 1 + accepted / drafts), plus fallbacks."""
        speculator = self.aengine.engine.speculator
        if speculator is None:
            return
        stats = speculator.stats
        labels = ["role"]
        for name, doc, value in (
            ("baton_spec_decode_num_drafts", "Request-steps that verified at least one draft token",
             stats.num_verifications),
            ("baton_spec_decode_draft_tokens", "Draft tokens proposed and verified", stats.num_draft_tokens),
            ("baton_spec_decode_accepted_tokens", "Draft tokens accepted by verification",
             stats.num_accepted_tokens),
            ("baton_spec_decode_fallbacks", "Requests whose proposer failed; they decoded without speculation",
             stats.num_fallbacks),
            ("baton_spec_decode_steps_over_batch_limit", "Steps run without drafts: more requests decoding than "
             "spec_disable_batch_size", stats.num_steps_over_batch_limit),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self.role], value)
            yield c
        per_pos = CounterMetricFamily("baton_spec_decode_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position (0 = first)",
                                      labels=["role", "position"])
        for position, value in enumerate(list(stats.accepted_per_position)):
            per_pos.add_metric([self.role, str(position)], value)
        yield per_pos

    def _thread_metrics(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        cores = self.aengine.cores  # engines of one host lending each other cores (shared/engine/core_share.py)
        threads = GaugeMetricFamily("baton_engine_torch_threads", "Torch threads the engine's steps run with "
                                    "now (with a core share: all cores while the host's other engines are "
                                    "idle, its share while they have work)", labels=["role"])
        threads.add_metric([self.role], cores.threads if cores is not None else torch.get_num_threads())
        yield threads
        if cores is not None:
            changes = CounterMetricFamily("baton_engine_core_share_changes", "Times the core share changed "
                                          "the engine's thread count", labels=["role"])
            changes.add_metric([self.role], cores.num_changes)
            yield changes


def _buckets(bucket_counts: list[int]) -> list[tuple[str, int]]:
    """Prometheus' cumulative buckets from per-bucket counts over BUCKETS_S (the last one: +Inf)."""
    counts = list(bucket_counts)
    cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
    return [(str(b), c) for b, c in zip(BUCKETS_S, cumulative, strict=False)] + [("+Inf", cumulative[-1])]


def engine_registry(aengine: AsyncEngine, role: str) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(EngineCollector(aengine, role))
    registry.register(AuthCollector())
    return registry
