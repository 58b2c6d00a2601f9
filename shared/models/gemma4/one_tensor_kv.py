"""Attention over a K=V layer's one-tensor cache: the keys are derived from the stored values.

A K=V layer (`attention_k_eq_v`, Gemma 4's full layers) has no v_proj:

    raw = k_proj(h);   v = rms(raw)  (no scale);   k = rope(rms(raw) * w_k)  =  rope(v * w_k)

so the cache stores v alone and the keys a step attends to are rebuilt from it
at their positions. (In fp32 `rms(raw) * w_k` is bitwise the scaled norm the
projection path computes, so attention sees exactly the keys it would have
stored.) Only the blocks the step's sequences read are rebuilt, into a compact
scratch cache whose block tables are remapped; then the usual attention op
runs on it (the C++ decode kernel included)::

    tables [S, B] ──unique──► used blocks U ──gather──► v[U]  ──rope(v * w_k, block pos)──► k[U]
                  ──remap───► tables' into 0..U-1, slot mapping likewise ──► attention(q, k[U], v[U])

A physical block has one position wherever it is used (prefix blocks are shared
at the same logical index), so one rotation serves every sequence reading it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from shared.kv.cache_dtype import to_cache_dtype
from shared.models.common import AttentionFn
from shared.ops.attention import AttentionMetadata

# keys from values: derive(values [n, heads, dim], positions [n]) -> keys [n, heads, dim]
DeriveKeys = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _compact(meta: AttentionMetadata, num_blocks: int,
             block_size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(used block ids [U], their first positions [U], the metadata remapped onto them), once per step."""
    key = ("one-tensor-kv", meta.block_tables.data_ptr())
    cached = meta.step_cache.get(key)
    if cached is not None:
        return cached  # type: ignore[return-value]
    tables = meta.block_tables.long()  # [S, W]
    device = tables.device
    width = tables.shape[1]
    counts = torch.tensor([min(-(-n // block_size), width) for n in meta.seq_lens_host], device=device)
    logical = torch.arange(width, device=device).expand_as(tables)
    used = logical < counts[:, None]
    used_ids, inverse = torch.unique(tables[used], return_inverse=True)
    first_pos = torch.zeros(len(used_ids), dtype=torch.int64, device=device)
    first_pos.scatter_(0, inverse, logical[used] * block_size)
    remap = torch.zeros(num_blocks, dtype=torch.int64, device=device)
    remap[used_ids] = torch.arange(len(used_ids), device=device)
    slots = meta.slot_mapping
    compact = replace(meta, block_tables=remap[tables].to(meta.block_tables.dtype),
                      slot_mapping=remap[slots // block_size] * block_size + slots % block_size,
                      step_cache={}, group_tables=[])
    meta.step_cache[key] = (used_ids, first_pos, compact)
    return used_ids, first_pos, compact


def attend_one_tensor(
    attention: AttentionFn,
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: this step's keys (rotated)
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: this step's values, already in the cache
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]: the stored values
    meta: AttentionMetadata,
    window: int | None,
    derive: DeriveKeys,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    used_ids, first_pos, compact = _compact(meta, num_blocks, block_size)
    values = cache[used_ids]  # [U, block_size, heads, dim]
    positions = (first_pos[:, None] + torch.arange(block_size, device=first_pos.device)).reshape(-1)
    # rebuilt in the compute dtype, stored as the cache stores (a bf16 cache's keys are bf16 keys)
    keys = to_cache_dtype(derive(values.reshape(-1, *values.shape[2:]), positions).reshape(values.shape),
                          values.dtype)
    return attention(query, key, value, keys, values, compact, 1.0, window)
