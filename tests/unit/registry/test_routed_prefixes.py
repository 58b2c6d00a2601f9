"""The router's memory of the prefixes it sent where (routed_prefixes.py), alone and in the kv policy's picks."""

from __future__ import annotations

import pytest

from services.router.routing import Router
from shared.registry import Load
from shared.registry.cost_model import CostModel
from shared.registry.kv_picker import PromptBlocks, local_prefill_tokens
from shared.registry.kv_summary import KVSummary, prompt_block_keys
from shared.registry.routed_prefixes import RoutedPrefixes
from tests.helpers.registry_factories import make_instance
from tests.unit.registry.test_kv_routing import BS, SALT, holding, with_kv

PREFIX = list(range(200, 264))  # 16 blocks of 4 that a burst of prompts shares
KEYS = prompt_block_keys(PREFIX, BS, SALT)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_remembered_blocks_count_as_leading_hits_until_they_expire() -> None:
    clock = _Clock()
    routed = RoutedPrefixes(ttl_s=10.0, clock=clock)
    routed.remember("p0", KEYS[:8])
    assert routed.hit_blocks("p0", KEYS) == 8 and routed.hit_blocks("p1", KEYS) == 0
    shifted = prompt_block_keys([1, 2, 3, 4, *PREFIX], BS, SALT)  # the same blocks after another first one
    assert routed.hit_blocks("p0", shifted) == 0  # chained keys name whole prefixes
    clock.now += 6
    routed.remember("p0", KEYS[:4])  # sent again: those four live on
    clock.now += 6
    assert routed.hit_blocks("p0", KEYS) == 4
    clock.now += 5
    assert routed.hit_blocks("p0", KEYS) == 0


def test_memory_is_bounded_per_instance_and_drops_idle_instances() -> None:
    clock = _Clock()
    routed = RoutedPrefixes(ttl_s=10.0, max_blocks=10, clock=clock)
    routed.remember("p0", KEYS)
    assert routed.num_blocks("p0") == 10 and routed.hit_blocks("p0", KEYS) == 0  # the oldest six went
    assert routed.hit_blocks("p0", KEYS[6:]) == 10
    clock.now += 11
    routed.remember("p1", KEYS[:2])  # a new instance: p0's keys have all expired, p0 goes
    assert routed.num_blocks("p0") == 0 and routed.num_blocks("p1") == 2
    off = RoutedPrefixes(ttl_s=0)
    off.remember("p0", KEYS)
    assert off.hit_blocks("p0", KEYS) == 0
    with pytest.raises(ValueError):
        RoutedPrefixes(ttl_s=-1)


def test_a_burst_sharing_a_new_prefix_follows_the_first_before_any_report() -> None:
    """Two idle prefill instances, neither reporting the prefix yet: the first prompt's instance has one
    request in flight; without the memory the second prompt goes to the other instance and computes the
    whole prefix again, with it the second waits behind the first and computes only its own tail."""
    model = CostModel(prefill_s_per_token=1e-3, queued_tokens_per_request=8)
    p0 = with_kv(make_instance("p0", "prefill"), holding(PREFIX, 0))
    p1 = with_kv(make_instance("p1", "prefill"), holding(PREFIX, 0))
    first, second = PromptBlocks(PREFIX + [1, 2, 3, 4]), PromptBlocks(PREFIX + [5, 6, 7, 8])
    for ttl_s, expect_same in ((10.0, True), (0.0, False)):
        router = Router("kv", model, routed_prefix_ttl_s=ttl_s)
        chosen = router.pick_prefill([p0, p1], first, KVSummary())
        router.sent(chosen, first)
        with router.hold("prefill", chosen.instance_id):
            again = router.pick_prefill([p0, p1], second, KVSummary())
        assert (again.instance_id == chosen.instance_id) is expect_same, ttl_s


def test_the_memory_never_outweighs_a_long_queue_or_a_longer_report() -> None:
    model = CostModel(prefill_s_per_token=1e-3, queued_tokens_per_request=8)
    busy = with_kv(make_instance("p0", "prefill", load=Load(num_running=20)), holding(PREFIX, 0))
    idle = with_kv(make_instance("p1", "prefill"), holding(PREFIX, 0))
    router = Router("kv", model)
    router.sent(busy, PromptBlocks(PREFIX))
    assert router.pick_prefill([busy, idle], PromptBlocks(PREFIX), KVSummary()).instance_id == "p1"
    # an instance reporting more than the router remembers is read by its report
    reporting = with_kv(make_instance("d0"), holding(PREFIX, 16))
    router.sent(reporting, PromptBlocks(PREFIX[:16]))
    assert local_prefill_tokens(reporting, PromptBlocks(PREFIX), router.routed) == 1  # the last token is computed
    assert local_prefill_tokens(with_kv(reporting, holding(PREFIX, 0)), PromptBlocks(PREFIX), router.routed) == 48


def test_only_the_kv_policy_remembers() -> None:
    p0 = with_kv(make_instance("p0", "prefill"), holding(PREFIX, 0))
    router = Router("least_loaded")
    router.sent(p0, PromptBlocks(PREFIX))
    assert router.routed.num_blocks("p0") == 0
