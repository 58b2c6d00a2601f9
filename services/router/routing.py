"""How the router chooses instances: a policy over registry listings plus its own in-flight counts.

```
 policy        prefill                         decode                          local prefill?
 kv            cost model: prefix hit + queue  cost model: load + KV + pulls   uncached tokens on the decode
 least_loaded  fewest requests                 fewest requests, then free KV     instance <= threshold
 round_robin   next in turn                    next in turn                    (every policy, when enabled)
```

`InflightCounts` is what this router sent to each instance and has not seen end: it goes up when a
call is made and down when the call ends, whichever way (stream end, error, client disconnect,
retry elsewhere), so a burst spreads before the instances' next load reports.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet

from shared.errors import ConfigError
from shared.registry.base import InstanceInfo
from shared.registry.cost_model import CostModel
from shared.registry.kv_picker import PromptBlocks, local_prefill_tokens, score_decode, score_prefill
from shared.registry.kv_summary import KVSummary
from shared.registry.picker import candidates, pick_decode, pick_encoder, pick_prefill
from shared.registry.routed_prefixes import DEFAULT_TTL_S, RoutedPrefixes

ROUTING_POLICIES: tuple[str, ...] = ("kv", "least_loaded", "round_robin")
LOCAL_PREFILL_AUTO = -1  # local_prefill_max_tokens: take the threshold from the cost model


class InflightCounts:
    """instance_id -> calls this router has open on it. One event loop; no lock needed."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    @property
    def counts(self) -> Mapping[str, int]:
        return self._counts

    @contextlib.contextmanager
    def hold(self, instance_id: str) -> Iterator[None]:
        """Count one call on `instance_id` for as long as the block runs, however it leaves."""
        self._counts[instance_id] = self._counts.get(instance_id, 0) + 1
        try:
            yield
        finally:
            left = self._counts[instance_id] - 1
            if left:
                self._counts[instance_id] = left
            else:
                del self._counts[instance_id]


class Router:
    """Picks instances for one request at a time under a policy (see the module docstring)."""

    def __init__(self, policy: str = "kv", cost_model: CostModel | None = None,
                 local_prefill_max_tokens: int = 0, routed_prefix_ttl_s: float = DEFAULT_TTL_S) -> None:
        if policy not in ROUTING_POLICIES:
            raise ConfigError(f"routing policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        if local_prefill_max_tokens < LOCAL_PREFILL_AUTO:
            raise ConfigError(f"local_prefill_max_tokens must be >= -1, got {local_prefill_max_tokens}")
        self.policy = policy
        self.cost_model = cost_model or CostModel()
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.routed = RoutedPrefixes(routed_prefix_ttl_s)  # kv policy: prefixes sent since the last reports
        self.inflight = {"prefill": InflightCounts(), "decode": InflightCounts(), "encoder": InflightCounts()}
        self.assignments: collections.Counter[tuple[str, str]] = collections.Counter()  # (role, instance_id)
        self.num_local_prefills = 0  # requests whose decode instance computed the prompt (no handoff)
        self.num_migrations = 0  # requests moved on from a failed instance (grpc_backend.py, migration.py)
        self.num_migrations_refused = 0  # broken streams that had used their migrations
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}

    @contextlib.contextmanager
    def hold(self, role: str, instance_id: str) -> Iterator[None]:
        """Count a call to a "prefill", "decode" (colocated included) or "encoder" instance while the block
        runs."""
        self.assignments[(role, instance_id)] += 1
        with self.inflight[role].hold(instance_id):
            yield

    @property
    def local_prefill_enabled(self) -> bool:
        return self.local_prefill_max_tokens != 0

    def pick_prefill(self, instances: Sequence[InstanceInfo], prompt: PromptBlocks, pool: KVSummary,
                     exclude: AbstractSet[str] = frozenset()) -> InstanceInfo:
        if self.policy == "kv":
            return score_prefill(instances, prompt, pool, self.cost_model, exclude,
                                 self.inflight["prefill"].counts, self.routed).info
        if self.policy == "least_loaded":
            return pick_prefill(instances, exclude, self.inflight["prefill"].counts)
        return self._next_in_turn("prefill", instances, exclude)

    def pick_decode(self, instances: Sequence[InstanceInfo], prompt: PromptBlocks,
                    exclude: AbstractSet[str] = frozenset(), *, pulls: bool = True) -> InstanceInfo:
        """`pulls`: the request's KV comes by handoff (False: the decode instance prefills it)."""
        if self.policy == "kv":
            return score_decode(instances, prompt, self.cost_model, exclude, self.inflight["decode"].counts,
                                pulls=pulls, routed=self.routed).info
        if self.policy == "least_loaded":
            return pick_decode(instances, exclude, self.inflight["decode"].counts)
        return self._next_in_turn("decode", instances, exclude)

    def sent(self, instance: InstanceInfo, prompt: PromptBlocks) -> None:
        """The prompt goes to `instance`, which will hold its blocks (computing or pulling them): under the
        kv policy, counted as its own until its KV report can show them (routed_prefixes.py)."""
        if self.policy == "kv" and instance.kv.block_size > 0:
            self.routed.remember(instance.instance_id, prompt.keys(instance.kv.block_size, instance.kv.hash_salt))

    def pick_encoder(self, instances: Sequence[InstanceInfo], exclude: AbstractSet[str] = frozenset()
                     ) -> InstanceInfo:
        """Least loaded under every policy: an encoder holds no prefix state to route by."""
        return pick_encoder(instances, exclude, self.inflight["encoder"].counts)

    def local_prefill_threshold_tokens(self, block_size: int) -> int:
        if self.local_prefill_max_tokens == LOCAL_PREFILL_AUTO:
            return self.cost_model.break_even_tokens(block_size)
        return self.local_prefill_max_tokens

    def prefills_locally(self, decode: InstanceInfo, prompt: PromptBlocks) -> bool:
        """Whether `decode` should compute the prompt itself: what its prefix cache lacks is short enough."""
        if not self.local_prefill_enabled:
            return False
        # self.routed is empty under the other policies (`sent` records under kv only)
        return local_prefill_tokens(decode, prompt, self.routed) <= self.local_prefill_threshold_tokens(
            decode.kv.block_size)

    def _next_in_turn(self, service: str, instances: Sequence[InstanceInfo],
                      exclude: AbstractSet[str]) -> InstanceInfo:
        live = sorted(candidates(instances, exclude, service), key=lambda i: i.instance_id)
        return live[next(self._turns[service]) % len(live)]
