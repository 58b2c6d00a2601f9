"""Choosing an instance from a registry listing: pure functions, no I/O.

- decode: the most free KV cache (as a fraction, so instances of different sizes compare), then the
  fewest running, then the fewest waiting requests.
- prefill: the shortest queue (waiting + running), skipping the instances this request already
  tried, which is how the router retries a prefill that failed before its first token elsewhere.

- kv_transfer: rendezvous hashing on the prompt's first tokens, so the turns of one chat (and one
  template's requests) meet the same prefix pool, unless that instance is much busier.

All skip draining instances, break ties by instance_id (the same listing always gives the same
answer), and raise `UnavailableError` when nothing is left. The load is as of each instance's last
heartbeat; a router that sends many requests between beats should add its own in-flight counts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from shared.errors import UnavailableError
from shared.registry.base import InstanceInfo


def _candidates(
    instances: Sequence[InstanceInfo], exclude: AbstractSet[str], role: str
) -> list[InstanceInfo]:
    candidates = [i for i in instances if not i.draining and i.instance_id not in exclude]
    if not candidates:
        num_draining = sum(1 for i in instances if i.draining)
        num_excluded = sum(1 for i in instances if i.instance_id in exclude and not i.draining)
        raise UnavailableError(
            f"no {role} instance available ({len(instances)} live, {num_draining} draining, "
            f"{num_excluded} already tried)"
        )
    return candidates


def pick_decode(instances: Sequence[InstanceInfo], exclude: AbstractSet[str] = frozenset()) -> InstanceInfo:
    """The decode instance with the largest free KV fraction, then fewest running, then fewest
    waiting, then smallest instance_id. Draining instances and ids in `exclude` are skipped."""
    candidates = _candidates(instances, exclude, "decode")
    return min(
        candidates,
        key=lambda i: (-i.load.kv_free_fraction, i.load.num_running, i.load.num_waiting, i.instance_id),
    )


def pick_prefill(instances: Sequence[InstanceInfo], exclude: AbstractSet[str] = frozenset()) -> InstanceInfo:
    """The prefill instance with the fewest waiting + running requests, then smallest instance_id.
    `exclude` holds the instance_ids this request already tried; draining instances are skipped."""
    candidates = _candidates(instances, exclude, "prefill")
    return min(candidates, key=lambda i: (i.load.num_waiting + i.load.num_running, i.instance_id))


# Prompts that share their first tokens (later turns of one chat, one template's requests) go to the
# same kv_transfer, whose prefix pool then holds their common prefix; unless it is this much busier.
_AFFINITY_TOKENS = 32
_AFFINITY_MAX_EXTRA_LEASES = 8


def pick_kv_transfer(instances: Sequence[InstanceInfo], prompt_token_ids: Sequence[int]) -> InstanceInfo:
    """Rendezvous hashing on the prompt's first tokens, with a load guard (least leases otherwise)."""
    instances = _candidates(instances, frozenset(), "kv_transfer")
    key = array("q", prompt_token_ids[:_AFFINITY_TOKENS]).tobytes()

    def weight(info: InstanceInfo) -> bytes:
        return hashlib.blake2b(key + info.instance_id.encode(), digest_size=8).digest()

    preferred = max(instances, key=weight)
    least = min(instances, key=lambda i: (i.load.num_running, i.instance_id))
    if preferred.load.num_running - least.load.num_running > _AFFINITY_MAX_EXTRA_LEASES:
        return least
    return preferred
