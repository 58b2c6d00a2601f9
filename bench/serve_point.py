"""One bounded load run against a started server, summarized (bench/serve.py and bench/serve_goodput.py)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

from bench.serve_load import RequestSpec, run_load
from bench.serve_stats import SLO, RequestRecord, summarize
from bench.serve_systems import MODEL_NAME, Server

logger = logging.getLogger("bench.serve")


def compact(records: Sequence[RequestRecord]) -> list[list[float]]:
    """Per request [ttft_ms, tpot_ms, output_tokens] (failed: [-1, -1, 0]), enough to recompute goodput."""
    return [[round(r.ttft_s * 1e3, 2), round(r.tpot_s * 1e3, 2), r.output_tokens] if r.ok else [-1, -1, 0]
            for r in records]


def run_point(server: Server, specs: list[RequestSpec], label: str, *, rate: float | None = None,
              concurrency: int | None = None, seed: int = 0, timeout_s: float = 300.0,
              slo: SLO | None = None) -> dict[str, Any]:
    """One bounded load run against a started server; its summary plus the compact per-request list."""
    records, duration_s = asyncio.run(run_load(server.base_url, MODEL_NAME, server.adapt(specs), rate=rate,
                                               concurrency=concurrency, seed=seed, timeout_s=timeout_s))
    point: dict[str, Any] = {"label": label, "rate": rate, "concurrency": concurrency,
                             **summarize(records, duration_s, slo), "loadavg_1m_after": os.getloadavg()[0],
                             "requests": compact(records)}
    errors = sorted({r.error for r in records if r.error})
    if errors:
        point["errors"] = errors[:3]
    logger.info("%s %s: %.1f out tok/s, %.2f req/s, p50/p99 TTFT %.0f/%.0f ms, p50/p99 TPOT %.1f/%.1f ms%s",
                server.system, label, point["output_tok_s"], point["req_s"], point["p50_ttft_ms"],
                point["p99_ttft_ms"], point["p50_tpot_ms"], point["p99_tpot_ms"],
                f", {point['num_failed']} failed" if point["num_failed"] else "")
    return point
