"""Choosing an instance from a registry listing: pure functions, no I/O.

- decode: the fewest requests (running + waiting + the router's own in-flight assignments), then the
  most free KV cache (as a fraction, so instances of different sizes compare). Free KV went first
  once, and a burst then landed 9:1 on two idle decodes: a fraction that differs by one block decided
  every pick while reports lagged. KV only steers through the cost model's pressure term now
  (kv_picker.py), or as a tie-break here.
- prefill: the shortest queue (waiting + running + in flight), skipping the instances this request
  already tried, which is how the router retries a prefill that failed before its first token elsewhere.

- kv_transfer: rendezvous hashing on the prompt's first tokens, so the turns of one chat (and one
  template's requests) meet the same prefix pool, unless that instance is much busier.

All skip draining instances, break ties by instance_id (the same listing always gives the same
answer), and raise `UnavailableError` when nothing is left. The load is as of each instance's last
heartbeat; `inflight` (instance_id -> requests this router has sent there and not seen end) is added
to it, so a burst spreads before the next report.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet

from shared.errors import UnavailableError
from shared.registry.base import InstanceInfo


def candidates(
    instances: Sequence[InstanceInfo], exclude: AbstractSet[str], role: str
) -> list[InstanceInfo]:
    live = [i for i in instances if not i.draining and i.instance_id not in exclude]
    if not live:
        num_draining = sum(1 for i in instances if i.draining)
        num_excluded = sum(1 for i in instances if i.instance_id in exclude and not i.draining)
        raise UnavailableError(
            f"no {role} instance available ({len(instances)} live, {num_draining} draining, "
            f"{num_excluded} already tried)"
        )
    return live


NO_INFLIGHT: Mapping[str, int] = {}


def num_requests(info: InstanceInfo, inflight: Mapping[str, int] = NO_INFLIGHT) -> int:
    """Running + waiting as last reported, plus this router's in-flight assignments to it."""
    return info.load.num_running + info.load.num_waiting + inflight.get(info.instance_id, 0)


def pick_decode(instances: Sequence[InstanceInfo], exclude: AbstractSet[str] = frozenset(),
                inflight: Mapping[str, int] = NO_INFLIGHT) -> InstanceInfo:
    """The decode instance with the fewest requests (reported + in flight), then the largest free KV
    fraction, then the smallest instance_id. Draining instances and ids in `exclude` are skipped."""
    return min(candidates(instances, exclude, "decode"),
               key=lambda i: (num_requests(i, inflight), -i.load.kv_free_fraction, i.instance_id))


def pick_prefill(instances: Sequence[InstanceInfo], exclude: AbstractSet[str] = frozenset(),
                 inflight: Mapping[str, int] = NO_INFLIGHT) -> InstanceInfo:
    """The prefill instance with the fewest waiting + running + in-flight requests, then smallest
    instance_id. `exclude` holds the instance_ids this request already tried; draining ones are skipped."""
    return min(candidates(instances, exclude, "prefill"), key=lambda i: (num_requests(i, inflight), i.instance_id))


def pick_encoder(instances: Sequence[InstanceInfo], exclude: AbstractSet[str] = frozenset(),
                 inflight: Mapping[str, int] = NO_INFLIGHT) -> InstanceInfo:
    """The encoder instance with the fewest items queued (reported) plus this router's calls in flight."""
    return min(candidates(instances, exclude, "encoder"), key=lambda i: (num_requests(i, inflight), i.instance_id))


# Prompts that share their first tokens (later turns of one chat, one template's requests) go to the
# same kv_transfer, whose prefix pool then holds their common prefix; unless it is this much busier.
_AFFINITY_TOKENS = 32
_AFFINITY_MAX_EXTRA_LEASES = 8


def pick_kv_transfer(instances: Sequence[InstanceInfo], prompt_token_ids: Sequence[int]) -> InstanceInfo:
    """Rendezvous hashing on the prompt's first tokens, with a load guard (least leases otherwise)."""
    instances = candidates(instances, frozenset(), "kv_transfer")
    key = array("q", prompt_token_ids[:_AFFINITY_TOKENS]).tobytes()

    def weight(info: InstanceInfo) -> bytes:
        return hashlib.blake2b(key + info.instance_id.encode(), digest_size=8).digest()

    preferred = max(instances, key=weight)
    least = min(instances, key=lambda i: (i.load.num_running, i.instance_id))
    if preferred.load.num_running - least.load.num_running > _AFFINITY_MAX_EXTRA_LEASES:
        return least
    return preferred
