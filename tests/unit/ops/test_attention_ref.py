"""`paged_attention_ref` against a naive dense attention built from each sequence's own K/V."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
import torch

from shared.ops.attention import paged_attention_ref

if TYPE_CHECKING:
    from tests.unit.ops.conftest import AttentionBatch

# chunk with earlier context, fresh prefill, decodes (one of them the very first token)
MIXED = [(11, 7), (0, 12), (5, 1), (29, 1), (0, 1)]


def dense_attention(batch: AttentionBatch, sliding_window: int | None) -> torch.Tensor:
    """Explicit float-mask softmax attention per sequence: [num_tokens, num_heads, head_dim]."""
    outs = []
    num_heads = batch.query.shape[1]
    starts = batch.meta.query_start_loc.tolist()
    for i, (q_len, s_len) in enumerate(
        zip(batch.meta.query_lens_host, batch.meta.seq_lens_host, strict=True)
    ):
        q = batch.query[starts[i] : starts[i] + q_len].double()  # [q_len, H, D]
        group = num_heads // batch.dense_keys[i].shape[1]
        k = batch.dense_keys[i].double().repeat_interleave(group, dim=1)  # [s_len, H, D]
        v = batch.dense_values[i].double().repeat_interleave(group, dim=1)
        q_pos = torch.arange(s_len - q_len, s_len)[:, None]
        k_pos = torch.arange(s_len)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        bias = torch.zeros(q_len, s_len, dtype=torch.float64).masked_fill(~visible, float("-inf"))
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale + bias
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs).to(batch.query.dtype)


def run_ref(batch: AttentionBatch, sliding_window: int | None) -> torch.Tensor:
    return paged_attention_ref(
        batch.query,
        batch.key,
        batch.value,
        batch.k_cache,
        batch.v_cache,
        batch.meta,
        batch.scale,
        sliding_window,
    )


@pytest.mark.parametrize("sliding_window", [None, 1, 6, 100])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 1, 256, 8), (6, 6, 32, 8)],
)
def test_ref_matches_dense(
    make_batch: Callable[..., AttentionBatch],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    sliding_window: int | None,
) -> None:
    batch = make_batch(MIXED, num_heads, num_kv_heads, head_dim, block_size)
    torch.testing.assert_close(run_ref(batch, sliding_window), dense_attention(batch, sliding_window))


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_ref_decode_only_and_prefill_only(
    make_batch: Callable[..., AttentionBatch], sliding_window: int | None
) -> None:
    # decodes only; one prefill; verify-like chunks (k drafts + 1) batched with decodes and a prefill
    for seqs in ([(3, 1), (17, 1), (40, 1)], [(0, 9)], [(24, 3), (8, 2)], [(20, 4), (33, 4), (7, 2), (5, 1), (0, 6)]):
        batch = make_batch(seqs, 8, 2, 64, 8, seed=len(seqs))
        torch.testing.assert_close(run_ref(batch, sliding_window), dense_attention(batch, sliding_window))


def test_ref_reads_context_from_cache_not_dense(make_batch: Callable[..., AttentionBatch]) -> None:
    """A chunk with context must read the cache: corrupting context slots changes its output only."""
    batch = make_batch([(10, 4), (0, 5)], 4, 2, 32, 8)
    clean = run_ref(batch, None)
    first_block = int(batch.meta.block_tables[0, 0])
    batch.k_cache[first_block] += 1.0
    dirty = run_ref(batch, None)
    assert not torch.allclose(dirty[:4], clean[:4])
    torch.testing.assert_close(dirty[4:], clean[4:])
