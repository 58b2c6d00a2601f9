"""Disaggregation goodput experiment: the same two cores, colocated against disaggregated.

    baton-pinned-colo    one engine doing prefill and decode, `taskset -c 0,1`, 2 torch threads
    baton-pinned-disagg  prefill `taskset -c 0`, decode `taskset -c 1`, 1 torch thread each
                         (router and kv_transfer float over both cores in either stack, as does the client)

Workload: a fixed-seed mix of long prompts with short answers and short
prompts with long generations, Poisson arrivals at a sweep of rates. In a
colocated engine every long prefill stalls the decodes running beside it
(their TPOT), and decodes delay prefills (TTFT); split, each phase has its own
core. Goodput (DistServe): the highest rate at which >= 90% of requests meet
both the TTFT and the TPOT SLO. Attainment is also recomputed at other SLO
scales (each SLO times the scale) from the per-request timings, so the ratio
can be read for tighter and looser objectives than the headline one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from bench.serve_load import mixed_set, warm_up
from bench.serve_point import run_point
from bench.serve_stats import SLO, RequestRecord, goodput
from bench.serve_systems import MODEL_NAME, Server, ServerConfig

logger = logging.getLogger("bench.serve")

SYSTEMS = ("baton-pinned-colo", "baton-pinned-disagg")
SHAPES = [(512, 16), (32, 160)]  # (input tokens, output tokens): long prompt, long generation
SLO_HEADLINE = SLO(ttft_s=5.0, tpot_s=0.150)
SLO_SCALES = (0.5, 1.0, 1.5, 2.0, 3.0)
SECONDS_PER_RATE = 40.0  # each rate sends about this many seconds of arrivals (at least MIN_REQUESTS)
MIN_REQUESTS = 10


def rates_plan(quick: bool) -> list[float]:
    return [0.3] if quick else [0.1, 0.15, 0.2, 0.3, 0.45, 0.6, 0.8]


def records_from_compact(rows: list[list[float]]) -> list[RequestRecord]:
    """Rebuild minimal records from [ttft_ms, tpot_ms, tokens] rows so attainment can be recomputed."""
    records = []
    for ttft_ms, tpot_ms, tokens in rows:
        if tokens <= 0:
            records.append(RequestRecord(sent_s=0.0, error="failed"))
            continue
        ttft_s, tpot_s = ttft_ms / 1e3, tpot_ms / 1e3
        last = ttft_s + tpot_s * (tokens - 1)
        records.append(RequestRecord(sent_s=0.0, token_times_s=[ttft_s, last], output_tokens=int(tokens)))
    return records


def by_slo_scale(systems: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Goodput of each system, and disaggregated / colocated, at each SLO scale."""
    from bench.serve_stats import attainment

    table: dict[str, dict[str, float]] = {}
    for scale in SLO_SCALES:
        slo = SLO(SLO_HEADLINE.ttft_s * scale, SLO_HEADLINE.tpot_s * scale)
        row: dict[str, float] = {}
        for name, data in systems.items():
            att = {pt["rate"]: attainment(records_from_compact(pt["requests"]), slo) for pt in data["rates"]}
            row[name] = goodput(att).interpolated_rate if att else 0.0
        colo, disagg = row.get(SYSTEMS[0], 0.0), row.get(SYSTEMS[1], 0.0)
        row["ratio"] = disagg / colo if colo > 0 else float("inf") if disagg > 0 else float("nan")
        table[f"{scale}x"] = row
    return table


def sweep(server: Server, ids: list[int], rates: list[float], seed: int) -> dict[str, Any]:

    asyncio.run(warm_up(server.base_url, MODEL_NAME, ids))
    points = []
    for i, rate in enumerate(rates):
        n = max(MIN_REQUESTS, round(rate * SECONDS_PER_RATE))
        specs = mixed_set(n, SHAPES, ids, seed=seed + 7919 * (i + 1))
        points.append(run_point(server, specs, f"mixed rate={rate}", rate=rate, seed=seed + i,
                                timeout_s=n / rate + 120.0, slo=SLO_HEADLINE))
        if points[-1]["slo_attainment"] < 0.5:  # far past the knee: higher rates only cost time
            logger.info("%s: attainment %.2f at %s req/s, sweep stops", server.system,
                        points[-1]["slo_attainment"], rate)
            break
    att = {pt["rate"]: pt["slo_attainment"] for pt in points}
    return {"ready_after_s": round(server.ready_after_s, 1), "rates": points, "goodput": vars(goodput(att))}


def run_experiment(config: ServerConfig, ids: list[int], quick: bool, seed: int) -> dict[str, Any]:
    """Both stacks over the same rate sweep and prompts; goodputs, their ratio, and the SLO-scale table."""
    systems: dict[str, Any] = {}
    for system in SYSTEMS:
        logger.info("starting %s ...", system)
        try:
            with Server(system, config) as server:
                systems[system] = sweep(server, ids, rates_plan(quick), seed)
        except (RuntimeError, TimeoutError) as exc:
            logger.error("%s failed: %s", system, exc)
            systems[system] = {"error": str(exc), "rates": [], "goodput": vars(goodput({1.0: 0.0}))}
    colo = systems[SYSTEMS[0]]["goodput"]["interpolated_rate"]
    disagg = systems[SYSTEMS[1]]["goodput"]["interpolated_rate"]
    return {
        "workload": " + ".join(f"{i} in / {o} out" for i, o in SHAPES) + " (equal odds, random tokens, ignore_eos)",
        "slo": {"ttft_ms": SLO_HEADLINE.ttft_s * 1e3, "tpot_ms": SLO_HEADLINE.tpot_s * 1e3, "attainment": 0.9},
        "systems": systems, "ratio": disagg / colo if colo > 0 else None, "by_slo_scale": by_slo_scale(systems),
    }
