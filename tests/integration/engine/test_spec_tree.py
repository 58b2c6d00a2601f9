"""Draft trees in the engine: output exact, and the accepted branch's KV where later steps read it.

An oracle proposer (a test double of the proposer seam) knows the plain greedy
continuation and puts the true token at a chosen rank per depth, so every step
accepts a known branch, often not the first: if the runner left that branch's
KV at its nodes' slots instead of moving it, every later token would be wrong.
The real EAGLE head drafts trees in test_spec_proposers.py and test_spec_train.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from shared.spec.proposer import ProposalInput
from shared.spec.speculator import Speculator
from shared.spec.tree import DraftTree
from tests.helpers.models import tiny_engine, tiny_loaded
from tests.integration.engine.test_spec_decode import greedy, prompts, spec_stats

TREE = DraftTree.parse("0;1;2;0.0;0.1;1.0;0.0.0;0.0.0.0")
# the true token's rank at depths 1, 2, ... per step, in turn: through the second guess, down the first
# branch to the bottom, the third guess, and a miss at depth 1 (rank 3 is not in the tree)
PATTERNS = [(1, 0), (0, 0, 0, 0), (2,), (3,), (0, 1)]


class TreeOracle:
    """Drafts from the known greedy continuation; records how many drafts each step should accept."""

    drafts_trees = True

    def __init__(self, continuations: Sequence[Sequence[int]], vocab: int) -> None:
        self.continuations = [list(c) for c in continuations]
        self.vocab = vocab
        self.expected_accepted: list[int] = []
        self.num_tree_steps = 0

    def _truth(self, token_ids: Sequence[int]) -> list[int]:
        known = list(token_ids)
        (full,) = [c for c in self.continuations if c[: len(known)] == known]
        return full[len(known) :]

    def propose(self, requests: Sequence[ProposalInput]) -> list[list[int]]:
        out = []
        for r in requests:
            truth = self._truth(r.token_ids)
            if r.tree is None:  # near the end: a chain, all true
                out.append(truth[: r.num_speculative_tokens])
                self.expected_accepted.append(len(out[-1]))
                continue
            tree, pattern = r.tree, PATTERNS[self.num_tree_steps % len(PATTERNS)]
            self.num_tree_steps += 1
            on_truth = [True] + [False] * tree.num_drafts
            tokens = []
            for i in range(1, tree.num_drafts + 1):
                d, rank = tree.depths[i], tree.ranks[i]
                on_truth[i] = on_truth[tree.parents[i]] and d <= len(pattern) and rank == pattern[d - 1]
                # a wrong guess differs from the truth and from its siblings (ranks differ)
                tokens.append(truth[d - 1] if on_truth[i] else (truth[d - 1] + 1 + rank) % self.vocab)
            self.expected_accepted.append(max(tree.depths[i] for i in range(len(on_truth)) if on_truth[i]))
            out.append(tokens)
        return out


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tree_greedy_equals_plain_and_accepts_the_branch_it_should(make_tiny, family: str) -> None:
    batch = prompts(4)
    plain, _ = make_tiny(family)
    n = 30
    # the truth a little past the end, so that the last steps' drafts are known too
    continuations = [p + r.token_ids for p, r in zip(batch, plain.generate(batch, greedy(n + 8)), strict=True)]
    expected = [c[len(p) : len(p) + n] for p, c in zip(batch, continuations, strict=True)]

    spec, _ = make_tiny(family, spec_method="ngram")
    oracle = TreeOracle(continuations, spec.loaded.spec.vocab_size)
    spec.speculator = Speculator(oracle, 3, spec.max_model_len, spec.loaded.spec.vocab_size, tree=TREE)
    assert [r.token_ids for r in spec.generate(batch, greedy(n))] == expected
    stats = spec_stats(spec)
    assert oracle.num_tree_steps > 10
    assert stats.num_accepted_tokens == sum(oracle.expected_accepted)
    assert stats.accepted_per_position[3] > 0  # the deepest branch was accepted whole


def test_sampled_and_explicit_requests_keep_chains(make_tiny) -> None:
    """Trees are for greedy requests that leave the number of drafts to the engine."""
    from shared.engine.request import SamplingParams

    spec, _ = make_tiny("llama", spec_method="ngram")
    seen: list[DraftTree | None] = []

    class Recorder:
        drafts_trees = True

        def propose(self, requests: Sequence[ProposalInput]) -> list[list[int]]:
            seen.extend(r.tree for r in requests)
            return [[] for _ in requests]

    spec.speculator = Speculator(Recorder(), 3, spec.max_model_len, spec.loaded.spec.vocab_size, tree=TREE)
    batch = prompts(1)
    spec.generate(batch, SamplingParams(max_tokens=4, temperature=0.8, seed=1))
    spec.generate(batch, greedy(4, num_speculative_tokens=2))
    assert seen and all(t is None for t in seen)
    spec.generate(batch, greedy(8))
    assert any(t == TREE for t in seen)


def test_trees_need_a_proposer_that_drafts_them(make_tiny) -> None:
    from shared.errors import ConfigError
    from shared.spec.ngram import NgramProposer

    with pytest.raises(ConfigError, match="drafts chains only"):
        Speculator(NgramProposer(), 3, 128, 256, tree=TREE)
    loaded, _ = tiny_loaded("llama")
    with pytest.raises(ValueError, match="spec_tree"):
        tiny_engine(loaded, spec_method="ngram", spec_tree="0;1")
