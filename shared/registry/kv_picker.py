"""KV-aware picks: score every candidate with the cost model (cost_model.py) and take the cheapest.

```
 request ─► PromptBlocks (its block keys, hashed once per (block size, salt) the fleet uses)
   ├─ prefill: min over p of CostModel.prefill_s(uncached tokens given p's cache and the pool, queue(p),
   │                                             pool blocks p would import beyond its own)
   ├─ decode:  min over d of CostModel.decode_s(load(d) + in flight, blocks d would still pull)
   └─ local?   min over d of CostModel.local_prefill_s(what d's cache lacks, load(d) + in flight);
               its uncached tokens <= threshold  →  prefill there, no handoff
```

Pure functions over registry listings, like picker.py: draining and excluded instances are skipped, and
nothing left raises `UnavailableError`. Equal costs (typically a prefix no instance holds yet, on an idle
fleet) go to the instance with the highest rendezvous weight for the prompt's first `AFFINITY_BLOCKS`
blocks, then the smallest instance_id. Ties to the smallest id alone sent every new prefix to one
instance, which then cached all of them while its peers cached none; by rendezvous, prompts that share
their opening share an instance, and distinct openings spread evenly, so bounded caches each hold a
part of the working set instead of churning through all of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from shared.registry.base import InstanceInfo
from shared.registry.cost_model import CostModel, uncached_tokens
from shared.registry.kv_summary import KVSummary, leading_hits, prompt_block_keys
from shared.registry.picker import NO_INFLIGHT, candidates
from shared.registry.routed_prefixes import RoutedPrefixes

AFFINITY_BLOCKS = 4  # the opening a tie is broken by: long enough to get past a chat template's fixed header


def rendezvous_weight(opening: str, instance_id: str) -> int:
    """Highest-random-weight hashing: every router (and the planner's simulator) ranks the instances for
    one opening the same way, and removing an instance moves only the openings it ranked first."""
    digest = hashlib.blake2b(f"{opening}/{instance_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass
class PromptBlocks:
    """One prompt's block keys, hashed lazily for each (block size, salt) an instance publishes."""

    token_ids: Sequence[int]
    _keys: dict[tuple[int, str], list[str]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def keys(self, block_size: int, hash_salt: str) -> list[str]:
        cache_key = (block_size, hash_salt)
        keys = self._keys.get(cache_key)
        if keys is None:
            keys = self._keys[cache_key] = prompt_block_keys(self.token_ids, block_size, hash_salt)
        return keys

    def hit_blocks(self, summary: KVSummary, hashed_like: KVSummary | None = None) -> int:
        """Leading prompt blocks `summary` holds. A summary without its own block size (kv_transfer's pool)
        is read with the block size and salt of `hashed_like`, the engine whose blocks it holds."""
        shape = summary if summary.block_size > 0 else hashed_like
        if shape is None or shape.block_size <= 0 or not summary.block_hashes:
            return 0
        return leading_hits(self.keys(shape.block_size, shape.hash_salt), summary.held())

    def num_blocks(self, block_size: int) -> int:
        return self.num_tokens // block_size if block_size > 0 else 0

    def own_hit_blocks(self, info: InstanceInfo, routed: RoutedPrefixes | None) -> int:
        """Leading prompt blocks `info`'s own cache holds: what it reported, or what this router sent it
        since (routed_prefixes.py), whichever is longer."""
        reported = self.hit_blocks(info.kv)
        if routed is None or info.kv.block_size <= 0:
            return reported
        return max(reported, routed.hit_blocks(info.instance_id, self.keys(info.kv.block_size, info.kv.hash_salt)))

    def affinity(self, info: InstanceInfo) -> int:
        """`info`'s rendezvous weight for this prompt: a hash of the prompt's opening (the chained key of
        its block AFFINITY_BLOCKS, or its last full block if it has fewer) with the instance id. 0 for a
        prompt without a full block or an instance that hashes no prompts."""
        keys = self.keys(info.kv.block_size, info.kv.hash_salt) if info.kv.block_size > 0 else []
        if not keys:
            return 0
        return rendezvous_weight(keys[min(len(keys), AFFINITY_BLOCKS) - 1], info.instance_id)


@dataclass(frozen=True)
class Scored:
    """A candidate, what the cost model charges it (seconds), and the prompt blocks it already holds."""

    info: InstanceInfo
    cost_s: float
    num_hit_blocks: int
    affinity: int = 0  # PromptBlocks.affinity: breaks equal costs

    def order(self) -> tuple[float, int, str]:
        return self.cost_s, -self.affinity, self.info.instance_id


def _cheapest(scored: Sequence[Scored]) -> Scored:
    assert scored  # candidates() raised if there were none
    return min(scored, key=Scored.order)


def score_prefill(instances: Sequence[InstanceInfo], prompt: PromptBlocks, pool: KVSummary,
                  model: CostModel, exclude: AbstractSet[str] = frozenset(),
                  inflight: Mapping[str, int] = NO_INFLIGHT, routed: RoutedPrefixes | None = None) -> Scored:
    """The cheapest prefill instance, counting the prefix its own cache (as reported, or as `routed`
    remembers sending it) or the kv_transfer pool holds (the pool's at the cost of importing what its
    own cache lacks)."""
    scored = []
    for info in candidates(instances, exclude, "prefill"):
        own = prompt.own_hit_blocks(info, routed)
        pooled = prompt.hit_blocks(pool, hashed_like=info.kv)
        hits = max(own, pooled)
        todo = uncached_tokens(prompt.num_tokens, hits, info.kv.block_size)
        cost_s = model.prefill_s(todo, info.load, inflight.get(info.instance_id, 0), max(0, pooled - own))
        scored.append(Scored(info, cost_s, hits, prompt.affinity(info)))
    return _cheapest(scored)


def score_decode(instances: Sequence[InstanceInfo], prompt: PromptBlocks, model: CostModel,
                 exclude: AbstractSet[str] = frozenset(), inflight: Mapping[str, int] = NO_INFLIGHT,
                 *, pulls: bool = True, routed: RoutedPrefixes | None = None) -> Scored:
    """The cheapest decode instance: its load (in flight included) and KV pressure, plus either the prompt
    blocks its own prefix cache lacks and it would pull (`pulls`: the KV comes by handoff) or, for a prompt
    it computes itself, the prefill of what its cache lacks."""
    scored = []
    for info in candidates(instances, exclude, "decode"):
        hits = prompt.own_hit_blocks(info, routed)
        num_inflight = inflight.get(info.instance_id, 0)
        if pulls:
            num_pull = max(0, prompt.num_blocks(info.kv.block_size) - hits)
            cost_s = model.decode_s(info.load, num_inflight, num_pull)
        else:
            todo = uncached_tokens(prompt.num_tokens, hits, info.kv.block_size)
            cost_s = model.local_prefill_s(todo, info.load, num_inflight)
        scored.append(Scored(info, cost_s, hits, prompt.affinity(info)))
    return _cheapest(scored)


def local_prefill_tokens(decode: InstanceInfo, prompt: PromptBlocks, routed: RoutedPrefixes | None = None) -> int:
    """Prompt tokens a decode instance would compute itself (what its own prefix cache does not hold)."""
    return uncached_tokens(prompt.num_tokens, prompt.own_hit_blocks(decode, routed), decode.kv.block_size)
