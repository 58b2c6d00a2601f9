"""The cheapest fleet that meets an SLO, by simulation; and which stage cannot when none does.

```
 stage check (one instance, an idle fleet): the prompt at the attainment quantile alone, and a decode step
   of one request at that quantile's context; either past its SLO → InfeasibleSLO naming the stage
 disaggregated: N = fewest prefills meeting TTFT with decode to spare (binary search, N ≤ max),
                M = fewest decodes meeting TPOT with prefill to spare, then (N, M) grown one at a time
                (the stage whose own attainment is lower) until both SLOs hold together
 colocated:     fewest engines meeting both (binary search)
 the cheaper in engines wins (ties: the higher attainment); kv_transfer: one per `engines_per_kv` engines
```

Attainment grows with replicas in each stage alone, which is what makes the binary searches sound
(DistServe searches prefill and decode placements apart for the same reason).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shared.errors import BatonError, ConfigError
from shared.planner.metrics import SLO, percentile, summarize, tpot_s, ttft_s
from shared.planner.profile import EngineCurves, Profile
from shared.planner.simulator import Shape, SimOptions, simulate
from shared.planner.workload import TraceRequest


class InfeasibleSLO(BatonError):
    """No replica count meets the SLO; the message says which stage cannot."""


@dataclass(frozen=True)
class Candidate:
    shape: Shape
    summary: dict[str, float]
    ttft_attainment: float
    tpot_attainment: float

    @property
    def attainment(self) -> float:
        return self.summary["slo_attainment"]


@dataclass(frozen=True)
class SearchLimits:
    attainment: float = 0.9  # share of requests that must meet the SLO
    max_per_service: int = 64
    engines_per_kv: int = 8


def prefill_alone_s(curves: EngineCurves, profile: Profile, num_tokens: int) -> float:
    """One prompt on an idle prefill instance: its chunks, one step each."""
    budget = profile.max_num_batched_tokens
    full, rest = divmod(num_tokens, budget)
    return full * curves.prefill_step_s(budget) + (curves.prefill_step_s(rest) if rest else 0.0)


def check_stages(profile: Profile, trace: Sequence[TraceRequest], slo: SLO, options: SimOptions,
                 limits: SearchLimits) -> None:
    """Raise InfeasibleSLO when one request alone, on idle instances, misses the SLO at the quantile."""
    threads = options.threads_per_engine or max(profile.engines)
    curves = profile.curves(threads)
    q = limits.attainment * 100
    prompt = math.ceil(percentile([r.prompt_tokens - r.prefix_tokens for r in trace], q))
    alone_s = prefill_alone_s(curves, profile, prompt) + options.router_overhead_s
    if alone_s > slo.ttft_s:
        raise InfeasibleSLO(
            f"prefill alone takes {alone_s:.2f} s for p{q:g} prompts ({prompt} tokens to compute, "
            f"{threads} thread(s) per engine); TTFT {slo.ttft_s:g} s cannot be met at any replica count")
    context = math.ceil(percentile([r.prompt_tokens + r.output_tokens for r in trace], q))
    step_s = curves.decode_step_s(1, context)
    if step_s > slo.tpot_s:
        raise InfeasibleSLO(
            f"a decode step alone takes {step_s * 1e3:.1f} ms at p{q:g} context ({context} tokens, batch 1); "
            f"TPOT {slo.tpot_s * 1e3:g} ms cannot be met at any replica count")


class Searcher:
    """Simulates candidate shapes of one workload, each once."""

    def __init__(self, profile: Profile, trace: Sequence[TraceRequest], slo: SLO, options: SimOptions,
                 limits: SearchLimits) -> None:
        self.profile, self.trace, self.slo, self.options, self.limits = profile, trace, slo, options, limits
        self.tried: dict[Shape, Candidate] = {}

    def evaluate(self, shape: Shape) -> Candidate:
        if shape not in self.tried:
            requests = simulate(self.profile, shape, self.trace, self.options)
            ttft_ok = sum(ttft_s(r) <= self.slo.ttft_s for r in requests) / len(requests)
            tpot_ok = sum(tpot_s(r) <= self.slo.tpot_s for r in requests) / len(requests)
            self.tried[shape] = Candidate(shape, summarize(requests, self.slo), ttft_ok, tpot_ok)
        return self.tried[shape]

    def kv_for(self, num_engines: int) -> int:
        return max(1, math.ceil(num_engines / self.limits.engines_per_kv))

    def disagg(self, prefill: int, decode: int) -> Shape:
        return Shape(prefill, decode, self.kv_for(prefill + decode))

    def fewest(self, meets: Callable[[int], bool]) -> int | None:
        """Smallest n in 1..max_per_service with meets(n), assuming it is monotone; None if none."""
        top = self.limits.max_per_service
        if not meets(top):
            return None
        lo, hi = 1, top
        while lo < hi:
            mid = (lo + hi) // 2
            if meets(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def best_disagg(self) -> Candidate | None:
        top, target = self.limits.max_per_service, self.limits.attainment
        prefill = self.fewest(lambda n: self.evaluate(self.disagg(n, top)).ttft_attainment >= target)
        decode = self.fewest(lambda m: self.evaluate(self.disagg(top, m)).tpot_attainment >= target)
        if prefill is None or decode is None:
            return None
        while True:
            found = self.evaluate(self.disagg(prefill, decode))
            if found.attainment >= target:
                return found
            if prefill >= top and decode >= top:
                return None
            grow_prefill = (found.ttft_attainment <= found.tpot_attainment and prefill < top) or decode >= top
            prefill, decode = (prefill + 1, decode) if grow_prefill else (prefill, decode + 1)

    def best_colocated(self) -> Candidate | None:
        target = self.limits.attainment
        count = self.fewest(lambda m: self.evaluate(Shape(0, m, 0, colocated=True)).attainment >= target)
        return None if count is None else self.evaluate(Shape(0, count, 0, colocated=True))


def search(profile: Profile, trace: Sequence[TraceRequest], slo: SLO, options: SimOptions | None = None,
           limits: SearchLimits | None = None, modes: Sequence[str] = ("disagg", "colocated")) -> Candidate:
    """The cheapest shape meeting `slo` for `trace` (see the module docstring)."""
    options = options or SimOptions()
    limits = limits or SearchLimits()
    if not 0 < limits.attainment <= 1:
        raise ConfigError(f"attainment must be within (0, 1], got {limits.attainment}")
    check_stages(profile, trace, slo, options, limits)
    searcher = Searcher(profile, trace, slo, options, limits)
    found = [c for c in (searcher.best_disagg() if "disagg" in modes else None,
                         searcher.best_colocated() if "colocated" in modes else None) if c is not None]
    if not found:
        best = max(searcher.tried.values(), key=lambda c: c.attainment)
        stage = "prefill (TTFT)" if best.ttft_attainment < best.tpot_attainment else "decode (TPOT)"
        raise InfeasibleSLO(
            f"no fleet of up to {limits.max_per_service} instances per service meets the SLO for "
            f"{limits.attainment:.0%} of requests: the best, {best.shape.describe()}, reaches "
            f"{best.attainment:.1%} ({stage} is the stage short of it)")
    return min(found, key=lambda c: (c.shape.num_engines, -c.attainment))
