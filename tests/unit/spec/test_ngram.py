"""Prompt-lookup proposer: longest n first, most recent occurrence, periodic continuation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from shared.spec.ngram import NgramProposer, find_ngram_match
from shared.spec.proposer import ProposalInput, Proposer


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, spelled out: for n = max_n .. min_n, the latest earlier occurrence wins."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                period = tokens[end + 1 :]
                return [period[t % len(period)] for t in range(k)]
    return []


def propose(proposer: NgramProposer, tokens: list[int], k: int) -> list[int]:
    return proposer.propose([ProposalInput("r", tokens, k)])[0]


def test_is_a_proposer() -> None:
    assert isinstance(NgramProposer(), Proposer)


def test_longest_match_wins_over_more_recent_shorter_one() -> None:
    #         0  1  2  3  4  5  6  7  8  9  10
    tokens = [7, 8, 9, 1, 2, 5, 9, 4, 4, 8, 9]
    # "8 9" occurs at 1-2 (n = 2); "9" alone also at 6 (more recent, but shorter)
    assert find_ngram_match(np.array(tokens), 1, 4) == (2, 2)
    assert propose(NgramProposer(1, 4), tokens, 3) == [1, 2, 5]
    # with min_n = 3 nothing qualifies
    assert propose(NgramProposer(3, 4), tokens, 3) == []


def test_most_recent_occurrence_among_equals() -> None:
    tokens = [1, 2, 10, 1, 2, 20, 3, 1, 2]
    assert propose(NgramProposer(2, 2), tokens, 2) == [20, 3]


def test_periodic_continuation_and_limits() -> None:
    p = NgramProposer(1, 3)
    assert propose(p, [5, 6, 5, 6, 5, 6], 5) == [5, 6, 5, 6, 5]
    assert propose(p, [3, 3, 3], 4) == [3, 3, 3, 3]
    assert propose(p, [1, 2, 3, 4], 4) == []  # nothing recurs
    assert propose(p, [1, 2, 1, 2], 0) == []  # speculation off
    assert propose(p, [9], 3) == []
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


def test_batch_keeps_order_and_per_request_k() -> None:
    p = NgramProposer(1, 2)
    reqs = [
        ProposalInput("a", [1, 2, 3, 1, 2], 2),
        ProposalInput("b", [4, 5, 6], 3),
        ProposalInput("c", np.array([7, 8, 9, 7, 8, 9, 7]), 4),
    ]
    assert p.propose(reqs) == [[3, 1], [], [8, 9, 7, 8]]


@pytest.mark.parametrize("seed", range(3))
def test_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 6)
        assert propose(NgramProposer(min_n, max_n), tokens, k) == brute_force(tokens, min_n, max_n, k), (
            tokens, min_n, max_n, k,
        )  # fmt: skip


def test_long_context() -> None:
    """A 200k-token context with one planted repeat far back."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1000, 50_000, size=200_000).tolist()
    tokens[1000:1006] = [1, 2, 3, 4, 5, 6]
    tokens += [1, 2, 3]
    assert propose(NgramProposer(3, 3), tokens, 3) == [4, 5, 6]
