"""An engine's KV cache from its budget: the layout, the block pool(s) and the manager of block tables.

One layer group (Llama, Gemma 3): one pool, `KVCacheManager`. Several (Gemma 4's
full and sliding layers, KVLayout.groups): a pool per group, `HybridKVCacheManager`.
A sliding group needs at most, per running request, the blocks of its window
and of the chunk a step adds, so its pool is sized for that; the rest of the
budget goes to group 0, whose blocks hold every position::

    budget = n0 * bytes(group 0 block) + sum_g n_g * bytes(group g block)
    n_g    = min(n0, max_num_seqs * (cdiv(window, bs) + 2) + cdiv(max_num_batched_tokens, bs) + 1)
"""

from __future__ import annotations

import logging
from dataclasses import replace

from shared.engine.block_pool import BlockPool
from shared.engine.config import EngineConfig
from shared.engine.hybrid_kv import HybridKVCacheManager
from shared.engine.kv_manager import KVCacheManager
from shared.errors import ConfigError
from shared.kv.layout import KVGroup, KVLayout, LayerKV, cdiv, kv_groups

logger = logging.getLogger(__name__)


def _window_blocks(config: EngineConfig, group: KVGroup) -> int:
    """Blocks a sliding group's pool needs: every running request's window, one step's new chunk, margins."""
    assert group.sliding_window is not None
    per_request = cdiv(group.sliding_window, config.block_size) + 2 + cdiv(17, config.block_size)
    return config.max_num_seqs * per_request + cdiv(config.max_num_batched_tokens, config.block_size) + 1


def group_blocks(config: EngineConfig, layers: tuple[LayerKV, ...]) -> list[int]:
    """Blocks of each group's pool (NULL blocks not counted) for the config's KV budget."""
    groups = kv_groups(layers)
    one = KVLayout.of(layers, 1, config.block_size, config.precision.kv_cache)
    unit = [one.unit_nbytes(g) for g in range(len(groups))]
    wanted = [_window_blocks(config, g) for g in groups[1:]]
    if config.num_kv_blocks:
        n0 = config.num_kv_blocks
    else:
        n0 = (config.kv_cache_bytes - sum(n * u for n, u in zip(wanted, unit[1:], strict=True))) // unit[0]
        if n0 < max(wanted, default=0):  # a small budget: every group the same count
            n0 = config.kv_cache_bytes // sum(unit)
    return [n0, *(min(n0, n) for n in wanted)]


def build_kv_cache(config: EngineConfig, layers: tuple[LayerKV, ...], salt: str, max_model_len: int,
                   scratch_blocks: int = 0) -> tuple[KVLayout, BlockPool, KVCacheManager]:
    """(layout, group 0's pool, the manager). `scratch_blocks`: blocks past group 0's pool that no request
    owns (CUDA graphs' padding rows write there). `salt`: what prefix hashes name besides the tokens."""
    if not config.kv_layer_groups:
        layers = tuple(replace(g, sliding_window=None) for g in layers)
    groups = kv_groups(layers)
    if len(groups) == 1:
        n0 = config.num_kv_blocks or KVLayout.blocks_for_bytes_of(layers, config.kv_cache_bytes, config.block_size,
                                                                  config.precision.kv_cache)
        counts = [n0]
    else:
        counts = group_blocks(config, layers)
        n0 = counts[0]
    if n0 * config.block_size < max_model_len:
        raise ConfigError(f"KV cache holds {n0 * config.block_size} tokens, less than max_model_len "
                          f"{max_model_len}: raise kv_cache_bytes or lower max_model_len")
    pools = [BlockPool(n, config.enable_prefix_caching) for n in counts]
    if len(groups) == 1:
        layout = KVLayout.of(layers, n0 + scratch_blocks, config.block_size, config.precision.kv_cache)
        return layout, pools[0], KVCacheManager(pools[0], config.block_size, hash_salt=salt.encode())
    # each sliding pool has one more block: NULL, what a table names before the window
    layout = KVLayout.of(layers, [n0 + scratch_blocks, *(n + 1 for n in counts[1:])], config.block_size,
                         config.precision.kv_cache)
    logger.info("KV layer groups: %s", ", ".join(
        f"{len(g.layers)} layers {'keeping every block' if g.sliding_window is None else f'of window {g.sliding_window}'}"
        f" x {n} blocks" for g, n in zip(groups, counts, strict=True)))
    return layout, pools[0], HybridKVCacheManager(pools, groups, config.block_size, hash_salt=salt.encode())
