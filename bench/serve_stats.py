"""Serving statistics: per-request timings in, the figures `bench/serve.py` reports out.

One request's timeline as the client sees it:

    sent ──── first token ── token ── token ── ... ── last token
     │◄─ TTFT ─►│◄─ ITL ─►│◄─ ITL ─►│                    │
     │◄──────────────────── e2e latency ────────────────►│
    TPOT = (e2e - TTFT) / (output_tokens - 1)

Goodput follows DistServe (Zhong et al., OSDI '24): the highest request rate at
which at least `attainment` (90%) of requests meet both the TTFT and the TPOT
SLO. A sweep tests a grid of rates; `goodput` returns the highest passing rate
below the first failing one and, between that and the first failing rate, the
rate where attainment crosses the target by linear interpolation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.planner.metrics import percentile


@dataclass
class RequestRecord:
    """What the client saw of one request; times in seconds on the client's monotonic clock."""

    sent_s: float
    token_times_s: list[float] = field(default_factory=list)  # arrival of each streamed chunk with text
    output_tokens: int = 0  # from the server's usage report; chunk count when it gives none
    error: str = ""
    prompt_tokens: int = 0  # from the usage report (0 when it gives none)
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (usage.prompt_tokens_details)
    text: str = ""  # the streamed output, for follow-up turns of a conversation

    @property
    def ok(self) -> bool:
        return not self.error and self.output_tokens > 0 and bool(self.token_times_s)

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.token_times_s[-1] - self.sent_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first; 0 for a one-token output."""
        if self.output_tokens < 2:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times_s, self.token_times_s[1:], strict=False)]


@dataclass(frozen=True)
class SLO:
    """Latency objectives one request must meet to count towards goodput."""

    ttft_s: float
    tpot_s: float

    def met_by(self, record: RequestRecord) -> bool:
        return record.ok and record.ttft_s <= self.ttft_s and record.tpot_s <= self.tpot_s


def attainment(records: Sequence[RequestRecord], slo: SLO) -> float:
    """Fraction of all requests (failed ones count as misses) that meet both SLOs."""
    if not records:
        return 0.0
    return sum(slo.met_by(r) for r in records) / len(records)


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO | None = None) -> dict[str, float]:
    """Throughput and latency percentiles of one run; latencies in milliseconds."""
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, float] = {
        "num_requests": len(records), "num_ok": len(ok), "num_failed": len(records) - len(ok),
        "duration_s": duration_s, "output_tokens": output_tokens,
        "output_tok_s": output_tokens / duration_s if duration_s > 0 else 0.0,
        "req_s": len(ok) / duration_s if duration_s > 0 else 0.0,
    }
    series = {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [r.tpot_s for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itls_s],
        "e2e": [r.e2e_s for r in ok],
    }
    for name, values in series.items():
        for q in (50, 99):
            summary[f"p{q}_{name}_ms"] = percentile(values, q) * 1e3
        summary[f"mean_{name}_ms"] = (sum(values) / len(values) * 1e3) if values else math.nan
    if slo is not None:
        summary["slo_attainment"] = attainment(records, slo)
    return summary


@dataclass(frozen=True)
class Goodput:
    """Result of a rate sweep against an SLO."""

    highest_passing_rate: float  # req/s; 0 when even the lowest rate fails
    interpolated_rate: float  # req/s where attainment crosses the target (= highest passing if none fails)
    first_failing_rate: float | None


def goodput(attainment_by_rate: dict[float, float], target: float = 0.9) -> Goodput:
    """Goodput of a sweep: the highest rate before the first one below `target` attainment.

    Rates above the first failing one do not count even if they pass (noise),
    as DistServe's "highest rate at which" is a threshold on a curve that
    should fall with load.
    """
    if not attainment_by_rate:
        raise ValueError("empty sweep")
    rates = sorted(attainment_by_rate)
    passing = 0.0
    passing_att = 1.0
    for rate in rates:
        att = attainment_by_rate[rate]
        if att < target:
            if passing == 0.0:
                return Goodput(0.0, 0.0, rate)
            # linear in attainment between the last passing and this failing rate
            frac = (passing_att - target) / (passing_att - att)
            return Goodput(passing, passing + frac * (rate - passing), rate)
        passing, passing_att = rate, att
    return Goodput(passing, passing, None)
