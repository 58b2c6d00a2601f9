"""The hybrid KV cache on tiny Gemma 4 models: sliding layers keep only their window's blocks, KV-shared layers
none; prefix hits, preemption and handoffs stay exact."""

from __future__ import annotations

from shared.engine.hybrid_kv import HybridKVCacheManager
from shared.engine.request import SamplingParams
from shared.kv.layout import cdiv
from tests.helpers.models import tiny_engine, tiny_loaded
from tests.integration.engine.test_engine_tiny import greedy, prompts

WINDOW, BLOCK = 6, 4  # tests/helpers/gemma4.py's window; tiny_engine's block size


def test_sliding_layers_free_blocks_as_the_sequence_grows(engines) -> None:
    loaded, _ = tiny_loaded("gemma4-dense")
    engine = tiny_engine(loaded, async_scheduling=False)
    engines.append(engine)
    kv = engine.kv
    assert isinstance(kv, HybridKVCacheManager) and len(kv.windows) == 1
    window = kv.windows[0]
    engine.add_request("r", prompts(1, lo=30, hi=31)[0], greedy(40))
    most = 0
    while engine.has_unfinished():
        engine.step()
        table = window.tables.get("r", [])
        live = [b for b in table if b != window.null]
        most = max(most, len(live))
        if table:  # every block before the window of the next query (with the rollback margin) is gone
            assert live == table[len(table) - len(live):]
    # 70 positions: 18 blocks in the full layers' table, at most window + margin + the step's in the sliding one
    assert most <= cdiv(WINDOW + 17, BLOCK) + 2
    assert len(engine.kv.block_tables) == 0


def test_results_equal_a_cache_that_keeps_every_block(engines) -> None:
    """Chunked prefill, prefix hits and sampling give the same tokens as one layer group keeping every block."""
    batch = prompts(6, seed=9, lo=10, hi=40)
    batch[3] = batch[0][:28] + [5, 6]  # a prefix hit on request 0's blocks
    params = [greedy(24), SamplingParams(max_tokens=20, temperature=0.9, seed=3)] * 3
    loaded, _ = tiny_loaded("gemma4-all")
    results = []
    for groups in (True, False):
        engine = tiny_engine(loaded, max_num_batched_tokens=12, kv_layer_groups=groups)
        engines.append(engine)
        assert isinstance(engine.kv, HybridKVCacheManager) is groups
        results.append([r.token_ids for r in engine.generate(batch, params)])
        results.append([r.token_ids for r in engine.generate(batch, params)])  # now from the prefix cache
    assert results[0] == results[1] == results[2] == results[3]


def test_preemption_recomputes_to_the_same_tokens(engines) -> None:
    batch = prompts(8, lo=10, hi=20)
    loaded, _ = tiny_loaded("gemma4-all")
    roomy = tiny_engine(loaded)
    engines.append(roomy)
    expected = [r.token_ids for r in roomy.generate(batch, greedy(30))]
    tight = tiny_engine(loaded, num_kv_blocks=32, max_model_len=128)
    engines.append(tight)
    got = [r.token_ids for r in tight.generate(batch, greedy(30))]
    assert tight.scheduler.num_preemptions_total > 0
    assert got == expected


def test_a_prefix_hit_needs_the_sliding_blocks_of_its_window(engines) -> None:
    loaded, _ = tiny_loaded("gemma4-dense")
    engine = tiny_engine(loaded, async_scheduling=False)
    engines.append(engine)
    shared = prompts(1, seed=5, lo=33, hi=34)[0]
    first = engine.generate([shared], greedy(4))[0]
    fresh = tiny_engine(loaded)
    engines.append(fresh)
    tail = [7, 8, 9]
    expected = fresh.generate([shared[:32] + tail], greedy(6))[0].token_ids
    # the sliding blocks freed when the first request moved on are still cached: a full-length hit
    hit = engine.generate([shared[:32] + tail], greedy(6))[0]
    assert hit.num_cached_tokens == 32 and hit.token_ids == expected
    assert first.num_cached_tokens == 0
    # with the sliding pool's cache dropped, only group 0 still holds the prefix: no usable hit
    engine.kv.windows[0].pool.reset_prefix_cache()
    miss = engine.generate([shared[:32] + [7, 8, 1]], greedy(6))[0]
    assert miss.num_cached_tokens == 0


def test_preempted_requests_swap_every_groups_blocks_back_in_from_the_host_tiers(engines) -> None:
    """With kv_offload_bytes, each layer group's pool spills what it evicts into its own host tier, and a
    resuming request gets its full-attention blocks and its window's sliding blocks back from them: the same
    tokens as a roomy cache, fewer computed than recomputing, restores in every group, nothing leaked."""
    batch = prompts(8, lo=10, hi=20)
    loaded, _ = tiny_loaded("gemma4-all")
    roomy = tiny_engine(loaded)
    engines.append(roomy)
    expected = [r.token_ids for r in roomy.generate(batch, greedy(30))]
    computed = {}
    for offload in (0, 1 << 20):
        tight = tiny_engine(loaded, num_kv_blocks=32, max_model_len=128, kv_offload_bytes=offload)
        engines.append(tight)
        assert [r.token_ids for r in tight.generate(batch, greedy(30))] == expected, offload
        assert tight.scheduler.num_preemptions_total > 0
        computed[offload] = tight.scheduler.num_scheduled_tokens_total
    kv = tight.kv
    assert isinstance(kv, HybridKVCacheManager) and len(kv.tiers) == 1 + len(kv.windows)
    for tier in kv.tiers:  # the full layers' group and every sliding group spilled and restored
        assert tier.stats.spilled_blocks > 0 and tier.stats.restored_blocks > 0, tier.stats
    assert kv.tiers[0].stats.swap_in.count > 0
    assert computed[1 << 20] < computed[0], computed
