"""Counters of an engine's KV transfers (written on the engine thread, read at scrape time)."""

from __future__ import annotations

from dataclasses import dataclass, field

# seconds: a 16 KiB block takes tens of microseconds, a 2,000-token prompt's KV tens of milliseconds
BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class DirectionStats:
    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))  # last: +Inf
    sum_s: float = 0.0
    count: int = 0
    nbytes: int = 0
    failures: int = 0

    def observe(self, seconds: float, nbytes: int) -> None:
        index = next((i for i, bound in enumerate(BUCKETS_S) if seconds <= bound), len(BUCKETS_S))
        self.bucket_counts[index] += 1
        self.sum_s += seconds
        self.count += 1
        self.nbytes += nbytes


class KVTransferStats:
    """Per direction ("push": prefill's writes, "pull": decode's reads, "import": prefill's pool reads, "spill" and
    "swap_in": a decode's preempted contexts parked in the pool and read back, kv_spill.py)."""

    def __init__(self) -> None:
        self.by_direction: dict[str, DirectionStats] = {
            d: DirectionStats() for d in ("push", "pull", "import", "spill", "swap_in")}
        self.imported_tokens = 0

    def observe(self, direction: str, seconds: float, nbytes: int, failed: bool) -> None:
        stats = self.by_direction[direction]
        if failed:
            stats.failures += 1
            return
        stats.observe(seconds, nbytes)
