"""The router's policies and its in-flight counts (pure: registry listings in, picks out)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

from services.router.routing import InflightCounts, Router
from shared.engine.block_pool import hash_prefix_blocks
from shared.errors import ConfigError
from shared.registry import Load
from shared.registry.cost_model import CostModel
from shared.registry.kv_picker import PromptBlocks
from shared.registry.kv_summary import KVSummary, summarize
from tests.helpers.registry_factories import decode_load, make_instance

PROMPT = list(range(40))  # 2 full blocks of 16 and a tail of 8


def test_inflight_counts_go_back_down_however_the_call_ends() -> None:
    counts = InflightCounts()
    with counts.hold("a"), counts.hold("a"), counts.hold("b"):
        assert counts.counts == {"a": 2, "b": 1}
    assert counts.counts == {}
    with pytest.raises(RuntimeError), counts.hold("a"):
        raise RuntimeError("the call failed")
    assert counts.counts == {}


def test_burst_between_load_reports_spreads_under_every_policy() -> None:
    """Ten requests before any report updates: what the router holds in flight spreads them evenly."""
    decodes = [make_instance("d0", load=decode_load(free=99)), make_instance("d1", load=decode_load(free=100))]
    for policy in ("kv", "least_loaded", "round_robin"):
        router = Router(policy)
        with contextlib.ExitStack() as held:
            for _ in range(10):
                held.enter_context(router.hold("decode", router.pick_decode(decodes, PromptBlocks(PROMPT)).instance_id))
            assert dict(router.inflight["decode"].counts) == {"d0": 5, "d1": 5}, policy
        assert router.inflight["decode"].counts == {}
        assert router.assignments == {("decode", "d0"): 5, ("decode", "d1"): 5}


def test_round_robin_skips_excluded_and_draining() -> None:
    router = Router("round_robin")
    prefills = [make_instance(f"p{i}", "prefill") for i in range(3)]
    prefills[1] = dataclasses.replace(prefills[1], draining=True)
    picks = [router.pick_prefill(prefills, PromptBlocks(PROMPT), KVSummary()).instance_id for _ in range(4)]
    assert picks == ["p0", "p2", "p0", "p2"]
    assert router.pick_prefill(prefills, PromptBlocks(PROMPT), KVSummary(), exclude={"p0"}).instance_id == "p2"


def test_local_prefill_threshold_off_fixed_and_from_the_cost_model() -> None:
    salt = "m"
    warm = dataclasses.replace(make_instance("d0", load=Load()), kv=summarize(
        hash_prefix_blocks(PROMPT, 16, salt.encode()), 16, salt))
    cold = dataclasses.replace(make_instance("d1", load=Load()), kv=KVSummary(block_size=16, hash_salt=salt))
    prompt = PromptBlocks(PROMPT)
    assert not Router(local_prefill_max_tokens=0).prefills_locally(warm, prompt)
    fixed = Router(local_prefill_max_tokens=8)
    assert fixed.prefills_locally(warm, prompt)  # 8 tokens past its 2 cached blocks
    assert not fixed.prefills_locally(cold, prompt)  # all 40
    auto = Router("kv", CostModel(), local_prefill_max_tokens=-1)
    assert auto.local_prefill_threshold_tokens(16) == CostModel().break_even_tokens(16)
    assert auto.prefills_locally(warm, prompt) and not auto.prefills_locally(cold, prompt)
    assert auto.prefills_locally(cold, PromptBlocks(PROMPT[:20]))  # a short prompt: under the break-even


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="routing policy"):
        Router("random")
    with pytest.raises(ConfigError, match="local_prefill_max_tokens"):
        Router(local_prefill_max_tokens=-2)
