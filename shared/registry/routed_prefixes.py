"""What this router sent where, until the instances' own KV reports can show it.

An instance publishes the prefix blocks it holds with its load report, every few seconds (kv_summary.py).
A prompt routed to it shows up there only after its prefill and the next report; until then the prompts
that share its prefix are scored as misses on every instance and spread by load, each computing the
prefix again (or, once it is committed, importing it from kv_transfer's pool). Sent to the instance that
is computing it, a follower instead waits for those blocks (the scheduler's share_planned_prefixes) and
computes only its own tail. SGLang's cache-aware router keeps, per worker, an approximate tree of the
prompts it sent there and never hears back from the workers; baton hears back, so its memory only has to
bridge the gap:

```
 t0  prompt P (blocks k0..k9) ─► prefill A        remember(A, k0..k9) until t0 + ttl_s
 t1  prompt P' (k0..k9, more) scored: A's hits = max(reported, remembered) = 10 blocks ─► A
 t0 + report interval: A's report lists k0..k9 itself (or not, if A evicted them: then, after
     ttl_s, the report alone decides again)
```

Bounded: at most `max_blocks` keys per instance, the oldest forgotten first. One event loop; no lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from shared.registry.kv_summary import leading_hits

DEFAULT_TTL_S = 10.0  # a few of the registry's report intervals: long enough for a prefill and its report
DEFAULT_MAX_BLOCKS = 16384  # per instance (a few MB): 8x the summary an instance publishes


class _Unexpired:
    """The remembered keys of one instance that have not expired, as a set `leading_hits` can test."""

    def __init__(self, expiry: OrderedDict[str, float], now: float) -> None:
        self._expiry, self._now = expiry, now

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._expiry.get(key, 0.0) > self._now


class RoutedPrefixes:
    """instance_id -> prompt block keys this router sent there in the last `ttl_s` seconds."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_blocks: int = DEFAULT_MAX_BLOCKS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s < 0 or max_blocks < 0:
            raise ValueError(f"ttl_s and max_blocks must be >= 0, got {ttl_s} and {max_blocks}")
        self.ttl_s, self.max_blocks, self._clock = ttl_s, max_blocks, clock
        self._by_instance: dict[str, OrderedDict[str, float]] = {}

    def remember(self, instance_id: str, keys: Sequence[str]) -> None:
        """`instance_id` will hold these blocks (a prompt's full blocks, in order) once it has the prompt."""
        if not keys or self.ttl_s == 0 or self.max_blocks == 0:
            return
        now = self._clock()
        expiry = self._by_instance.get(instance_id)
        if expiry is None:  # a new instance: drop the ones whose every key has expired (gone, or idle)
            for gone in [i for i, e in self._by_instance.items() if not e or next(reversed(e.values())) <= now]:
                del self._by_instance[gone]
            expiry = self._by_instance[instance_id] = OrderedDict()
        until = now + self.ttl_s
        for key in keys:
            expiry[key] = until
            expiry.move_to_end(key)
        while len(expiry) > self.max_blocks:
            expiry.popitem(last=False)

    def hit_blocks(self, instance_id: str, keys: Sequence[str]) -> int:
        """Leading blocks of a prompt (its keys) this router sent to `instance_id` within `ttl_s`."""
        expiry = self._by_instance.get(instance_id)
        if not expiry or not keys:
            return 0
        return leading_hits(keys, _Unexpired(expiry, self._clock()))

    def num_blocks(self, instance_id: str) -> int:
        return len(self._by_instance.get(instance_id, ()))
