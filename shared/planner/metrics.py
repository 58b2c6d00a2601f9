"""What a simulated run predicts: TTFT and TPOT percentiles, SLO attainment and goodput.

The same definitions as the benchmarks' (bench/serve_stats.py): TPOT is a request's mean time per output
token after the first; a request meets the SLO when both its TTFT and its TPOT are within it; goodput is
the requests meeting it per second of the run (first arrival to last token).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shared.errors import ConfigError
from shared.planner.sim_engine import SimRequest


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    @classmethod
    def parse(cls, text: str) -> SLO:
        """`ttft=1.5,tpot=0.1` (seconds; a value may end in `ms` or `s`)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            if not sep or key.strip() not in ("ttft", "tpot"):
                raise ConfigError(f"--slo takes ttft=SECONDS,tpot=SECONDS, got {part!r}")
            raw = raw.strip()
            scale = 1e-3 if raw.endswith("ms") else 1.0
            try:
                value = float(raw.removesuffix("ms").removesuffix("s")) * scale
            except ValueError as exc:
                raise ConfigError(f"--slo: {key.strip()} is not a number of seconds: {raw!r}") from exc
            if not value > 0 or math.isinf(value):
                raise ConfigError(f"--slo: {key.strip()} must be a positive time, got {raw!r}")
            values[key.strip()] = value
        if set(values) != {"ttft", "tpot"}:
            raise ConfigError(f"--slo needs both ttft and tpot, got {text!r}")
        return cls(values["ttft"], values["tpot"])


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default); NaN if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def ttft_s(request: SimRequest) -> float:
    return request.first_token_s - request.arrival_s


def tpot_s(request: SimRequest) -> float:
    if request.output_tokens < 2:
        return 0.0
    return (request.token_times_s[-1] - request.first_token_s) / (request.output_tokens - 1)


def summarize(requests: Sequence[SimRequest], slo: SLO) -> dict[str, float]:
    """p50/p99 TTFT and TPOT (ms), attainment (fraction meeting the SLO) and goodput (requests/s)."""
    ttfts = [ttft_s(r) for r in requests]
    tpots = [tpot_s(r) for r in requests if r.output_tokens > 1]
    met = sum(1 for r in requests if ttft_s(r) <= slo.ttft_s and tpot_s(r) <= slo.tpot_s)
    start = min(r.arrival_s for r in requests)
    end = max(r.token_times_s[-1] for r in requests)
    duration = max(end - start, 1e-9)
    return {
        "num_requests": len(requests), "duration_s": duration,
        "p50_ttft_ms": percentile(ttfts, 50) * 1e3, "p99_ttft_ms": percentile(ttfts, 99) * 1e3,
        "p50_tpot_ms": percentile(tpots, 50) * 1e3, "p99_tpot_ms": percentile(tpots, 99) * 1e3,
        "slo_attainment": met / len(requests), "goodput_req_s": met / duration,
    }
