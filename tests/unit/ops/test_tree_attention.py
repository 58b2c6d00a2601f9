"""Draft-tree verification chunks in paged attention: each node sees the context and its own branch.

The truth is dense attention of each node's branch written out as a sequence:
the context's keys, then the keys of the node's ancestors and its own, which
the chunk holds at slots context + node. Every backend the CPU serves with
(the reference and the C++ decode kernel's split) and the Triton entry point
(which hands tree steps to the reference) must agree with it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from shared.ops.attention import paged_attention_ref
from shared.ops.cpu_attention import paged_attention_cpu
from shared.spec.tree import DraftTree
from tests.unit.ops.conftest import AttentionBatch

TREE = DraftTree.parse("0;1;2;0.0;0.1;1.0;0.0.0;0.0.0.0")


def _tree_batch(make_batch: Callable[..., AttentionBatch], context: int) -> tuple[AttentionBatch, int]:
    """Decodes around one tree chunk (sequence 1); its queries' positions follow the tree's depths."""
    batch = make_batch([(13, 1), (context, TREE.num_drafts + 1), (40, 1)], 9, 3, 64, 8, seed=context)
    meta = batch.meta
    positions = [13, *(context + d for d in TREE.depths), 40]
    meta.positions = torch.tensor(positions)
    meta.tree_masks = {1: TREE.ancestor_mask()}
    return batch, 1


def _dense_branch(batch: AttentionBatch, seq: int, node: int, context: int, row: int,
                  sliding_window: int | None) -> torch.Tensor:  # [num_heads, head_dim]
    branch = TREE.ancestors(node)
    keep = [p for p in range(context) if sliding_window is None or p > context + TREE.depths[node] - sliding_window]
    idx = torch.tensor(keep + [context + j for j in branch])
    group = batch.query.shape[1] // batch.dense_keys[seq].shape[1]
    k = batch.dense_keys[seq][idx].double().repeat_interleave(group, dim=1)
    v = batch.dense_values[seq][idx].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,khd->hk", batch.query[row].double(), k) * batch.scale
    return torch.einsum("hk,khd->hd", scores.softmax(-1), v).float()


@pytest.mark.parametrize("attention", [paged_attention_ref, paged_attention_cpu])
@pytest.mark.parametrize("sliding_window", [None, 20])
@pytest.mark.parametrize("context", [5, 30])
def test_tree_nodes_see_their_branch(make_batch: Callable[..., AttentionBatch], attention, sliding_window, context) -> None:  # type: ignore[no-untyped-def]
    batch, seq = _tree_batch(make_batch, context)
    out = attention(batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                    sliding_window)
    for node in range(TREE.num_drafts + 1):
        row = 1 + node
        torch.testing.assert_close(out[row], _dense_branch(batch, seq, node, context, row, sliding_window))
    # the decodes beside it are untouched by the tree's mask
    plain = make_batch([(13, 1), (context, TREE.num_drafts + 1), (40, 1)], 9, 3, 64, 8, seed=context)
    expected = paged_attention_ref(plain.query, plain.key, plain.value, plain.k_cache, plain.v_cache, plain.meta,
                                   plain.scale, sliding_window)
    torch.testing.assert_close(out[[0, -1]], expected[[0, -1]])


def test_triton_entry_hands_tree_steps_to_the_reference(make_batch: Callable[..., AttentionBatch]) -> None:
    from shared.ops.triton_attention import paged_attention_triton

    batch, _ = _tree_batch(make_batch, 30)
    args = (batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta, batch.scale, None)
    torch.testing.assert_close(paged_attention_triton(*args), paged_attention_ref(*args))
