"""The one divergence greedy fidelity tests accept: a float-noise tie between the reference's top two."""

from __future__ import annotations

import torch

NEAR_TIE = 1e-3  # logits (or logprobs) this close are a tie that summation order may break either way


def assert_near_tie(reference_logits: torch.Tensor, ours: int, theirs: int, position: int) -> None:
    """At the first position two greedy runs differ: the reference (`theirs`) took its top choice, ours is
    its second, and the two were within NEAR_TIE. [vocab] logits or logprobs at that position."""
    values, ids = torch.topk(reference_logits.float(), 2)
    margin = (values[0] - values[1]).item()
    assert int(ids[0]) == theirs, f"token {position}: the reference's own top choice is {int(ids[0])}, not {theirs}"
    assert int(ids[1]) == ours, (f"token {position}: ours ({ours}) is not the reference's second choice "
                                 f"({int(ids[1])})")
    assert margin < NEAR_TIE, f"diverged at token {position} with a clear winner (margin {margin:.4g})"
