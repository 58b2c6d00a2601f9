"""The prefix summaries instances publish, the cost model, and the KV-aware picks over them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shared.engine.block_pool import BlockPool, hash_prefix_blocks
from shared.errors import UnavailableError
from shared.registry import InstanceInfo, Load
from shared.registry.cost_model import CostModel, uncached_tokens
from shared.registry.kv_picker import PromptBlocks, local_prefill_tokens, score_decode, score_prefill
from shared.registry.kv_summary import KVSummary, leading_hits, prompt_block_keys, summarize
from tests.helpers.registry_factories import decode_load, make_instance

BS = 4
SALT = "model-x:float32:fp32"
PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks of 4 and a tail of 2


def holding(prompt: list[int], num_blocks: int, salt: str = SALT, block_size: int = BS) -> KVSummary:
    """The summary of an engine whose cache holds the first `num_blocks` blocks of `prompt`."""
    return summarize(reversed(hash_prefix_blocks(prompt, block_size, salt.encode())[:num_blocks]), block_size, salt)


def with_kv(info: InstanceInfo, kv: KVSummary) -> InstanceInfo:
    return dataclasses.replace(info, kv=kv)


def test_prompt_keys_match_what_an_engine_pool_caches() -> None:
    pool = BlockPool(8)
    hashes = hash_prefix_blocks(PROMPT, BS, SALT.encode())
    for block_id, block_hash in enumerate(hashes[:3]):
        pool.cache_block(block_id, block_hash, PROMPT[block_id * BS:(block_id + 1) * BS])
    published = summarize(pool.recent_cached_hashes(10), BS, SALT)
    assert published.block_hashes[0] == prompt_block_keys(PROMPT, BS, SALT)[2]  # most recently cached first
    assert leading_hits(prompt_block_keys(PROMPT, BS, SALT), published.held()) == 3
    assert leading_hits(prompt_block_keys(PROMPT, BS, "other-model"), published.held()) == 0  # salt matters


def test_leading_hits_stop_at_the_first_missing_block() -> None:
    keys = prompt_block_keys(PROMPT, BS, SALT)
    assert leading_hits(keys, {keys[0], keys[1], keys[3]}) == 2
    assert leading_hits(keys, {keys[1]}) == 0
    assert leading_hits([], set(keys)) == 0


def test_summary_is_bounded_and_round_trips_through_the_registry_json() -> None:
    many = hash_prefix_blocks(list(range(400)), 1)
    summary = summarize(many, 1, SALT, max_blocks=50)
    assert len(summary.block_hashes) == 50 and summary.block_hashes[0] == many[0][:8].hex()
    info = with_kv(make_instance("d0"), summary)
    assert InstanceInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info
    older_writer = {k: v for k, v in info.to_dict().items() if k != "kv"}  # a service from before summaries
    assert InstanceInfo.from_dict(older_writer).kv == KVSummary()


def test_cost_model_units_and_break_even() -> None:
    model = CostModel(prefill_s_per_token=1e-3, queued_tokens_per_request=100, decode_s_per_request=0.02,
                      transfer_s_per_block=1e-3, handoff_overhead_s=0.03, local_prefill_slowdown=2.0)
    assert model.prefill_s(50, Load(num_running=1, num_waiting=1), num_inflight=1) == pytest.approx(0.35)
    assert model.decode_s(Load(num_running=2), num_inflight=1, num_pull_blocks=10) == pytest.approx(0.07)
    # n* = 0.03 / (1e-3 * (2 - 1) - 1e-3 / 16) = 32.0
    assert model.break_even_tokens(16) == 32
    assert CostModel(local_prefill_slowdown=1.0).break_even_tokens(16) == 1 << 30
    assert uncached_tokens(18, 4, BS) == 2 and uncached_tokens(16, 4, BS) == 1  # one token always computed


def test_cost_model_kv_pressure_only_below_the_watermark() -> None:
    model = CostModel(kv_low_watermark=0.1, kv_pressure_s=1.0)
    assert model.kv_pressure(decode_load(free=50)) == 0.0
    assert model.kv_pressure(decode_load(free=5)) == pytest.approx(0.5)
    assert model.kv_pressure(decode_load(free=0)) == pytest.approx(1.0)
    assert model.kv_pressure(Load()) == 0.0  # no KV reported: no pressure claimed


def test_score_prefill_weighs_prefix_hits_against_queues() -> None:
    model = CostModel(prefill_s_per_token=1e-3, queued_tokens_per_request=8)
    warm = with_kv(make_instance("p0", "prefill", load=Load(num_running=1)), holding(PROMPT, 4))
    cold = with_kv(make_instance("p1", "prefill"), holding(PROMPT, 0))
    prompt = PromptBlocks(PROMPT)
    # warm: 2 uncached + 8 queued tokens = 10 < cold: 18 uncached
    best = score_prefill([cold, warm], prompt, KVSummary(), model)
    assert best.info.instance_id == "p0" and best.num_hit_blocks == 4
    assert score_prefill([cold, warm], prompt, KVSummary(), model, inflight={"p0": 2}).info.instance_id == "p1"
    # the kv_transfer pool's prefix counts for every prefill (they import it): queues decide then
    pool = summarize(hash_prefix_blocks(PROMPT, BS, SALT.encode()), 0, "")
    assert score_prefill([cold, warm], prompt, pool, model).info.instance_id == "p1"
    assert score_prefill([cold, warm], prompt, pool, model).num_hit_blocks == 4
    with pytest.raises(UnavailableError):
        score_prefill([cold, warm], prompt, pool, model, exclude={"p0", "p1"})


def test_score_decode_spreads_by_load_and_counts_blocks_to_pull() -> None:
    model = CostModel(decode_s_per_request=0.02, transfer_s_per_block=0.015)
    d0 = with_kv(make_instance("d0", load=decode_load(free=100)), holding(PROMPT, 0))
    d1 = with_kv(make_instance("d1", load=decode_load(free=100)), holding(PROMPT, 4))
    prompt = PromptBlocks(PROMPT)
    assert score_decode([d0, d1], prompt, model).info.instance_id == "d1"  # pulls 0 of 4 blocks, not 4
    assert score_decode([d0, d1], prompt, model, inflight={"d1": 4}).info.instance_id == "d0"  # 0.08 s > 0.06 s
    assert score_decode([d0, d1], PromptBlocks([1, 2, 3]), model).info.instance_id == "d0"  # nothing to pull: id
    full = with_kv(make_instance("d2", load=decode_load(free=1)), holding(PROMPT, 4))
    assert score_decode([d0, full], prompt, model).info.instance_id == "d0"  # KV pressure outweighs 4 blocks


def test_score_decode_for_a_local_prefill_prefers_the_cache_holding_the_prompt() -> None:
    model = CostModel(prefill_s_per_token=1e-3, local_prefill_slowdown=2.0, decode_s_per_request=0.02)
    cold = with_kv(make_instance("d0", load=decode_load(free=100)), holding(PROMPT, 0))
    warm = with_kv(make_instance("d1", load=decode_load(free=100)), holding(PROMPT, 4))
    prompt = PromptBlocks(PROMPT)
    best = score_decode([cold, warm], prompt, model, pulls=False)
    assert best.info.instance_id == "d1" and best.num_hit_blocks == 4  # 2 tokens to compute, not 18
    # 2 * 1e-3 * 2 + 0.02 * 2 = 0.044 > 2 * 1e-3 * 18 = 0.036: its load outweighs the hit
    assert score_decode([cold, warm], prompt, model, {"d1": 2}, pulls=False).info.instance_id == "d0"


def test_local_prefill_tokens_count_what_the_decode_cache_lacks() -> None:
    prompt = PromptBlocks(PROMPT)
    assert local_prefill_tokens(with_kv(make_instance("d0"), holding(PROMPT, 3)), prompt) == 6
    assert local_prefill_tokens(with_kv(make_instance("d0"), holding(PROMPT, 4)), prompt) == 2
    assert local_prefill_tokens(make_instance("d0"), prompt) == 18  # published nothing: all of it


def test_score_prefill_charges_a_pool_import_so_the_own_cache_wins_a_tie() -> None:
    model = CostModel(prefill_s_per_token=1e-3, transfer_s_per_block=5e-4)
    cold = with_kv(make_instance("p0", "prefill"), holding(PROMPT, 0))
    warm = with_kv(make_instance("p1", "prefill"), holding(PROMPT, 4))
    pool = summarize(hash_prefix_blocks(PROMPT, BS, SALT.encode()), 0, "")
    prompt = PromptBlocks(PROMPT)
    best = score_prefill([cold, warm], prompt, pool, model)
    assert best.info.instance_id == "p1"  # 2 tokens computed either way; p0 would first import 4 blocks
    assert best.cost_s == pytest.approx(2e-3)
    imported = score_prefill([cold], prompt, pool, model)
    assert imported.num_hit_blocks == 4 and imported.cost_s == pytest.approx(2e-3 + 4 * 5e-4)


def test_equal_costs_go_by_rendezvous_on_the_prompt_opening() -> None:
    model = CostModel()
    fleet = [with_kv(make_instance(f"p{i}", "prefill"), KVSummary(BS, SALT)) for i in range(3)]
    # distinct openings on an idle fleet that caches none of them: spread over every instance
    picks = [score_prefill(fleet, PromptBlocks([1000 * n + t for t in range(40)]), KVSummary(), model).info
             for n in range(60)]
    counts = {i.instance_id: sum(p.instance_id == i.instance_id for p in picks) for i in fleet}
    assert min(counts.values()) >= 10, counts  # smallest-id ties sent all 60 to p0
    # a shared opening (the first AFFINITY_BLOCKS blocks) with different tails: one instance, the same
    # for decode picks of the same prompts, whatever order the listing comes in
    opening = list(range(500, 500 + BS * 4))
    same = {score_prefill(fleet[::step], PromptBlocks(opening + [n, n + 1, n + 2]), KVSummary(), model)
            .info.instance_id for n in range(10) for step in (1, -1)}
    assert len(same) == 1
    decodes = [with_kv(make_instance(f"d{i}", load=decode_load(free=100)), KVSummary(BS, SALT)) for i in range(3)]
    assert len({score_decode(decodes, PromptBlocks(opening + [n]), model).info.instance_id for n in range(10)}) == 1
    # the weight only breaks ties: a loaded instance still loses
    chosen = next(iter(same))
    busy = [dataclasses.replace(i, load=Load(num_running=1)) if i.instance_id == chosen else i for i in fleet]
    assert score_prefill(busy, PromptBlocks(opening), KVSummary(), model).info.instance_id != chosen
