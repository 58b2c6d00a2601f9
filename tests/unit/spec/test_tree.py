"""Draft trees: their shape, and greedy verification over them against a walk written out by hand."""

from __future__ import annotations

import random

import pytest
import torch

from shared.engine.request import SamplingParams
from shared.engine.sampler import Sampler
from shared.errors import ConfigError
from shared.spec.tree import DraftTree
from shared.spec.verify import VerifyInput, greedy_chains, greedy_trees, verify_drafts

TREE = "0;1;2;0.0;0.1;1.0;0.0.0;0.0.0.0"


def test_parse_numbers_nodes_breadth_first() -> None:
    tree = DraftTree.parse("0.0.0;1;0;0.1;0.0")  # any order in, breadth first out
    assert tree.parents == (-1, 0, 0, 1, 1, 3)
    assert tree.ranks == (0, 0, 1, 0, 1, 0)
    assert tree.depths == (0, 1, 1, 2, 2, 3)
    assert tree.num_drafts == 5 and tree.max_depth == 3
    assert tree.ancestors(5) == [0, 1, 3, 5]
    assert tree.branch_table[4] == (0, 1, 4, 0)
    mask = tree.ancestor_mask()
    assert mask[5].nonzero().flatten().tolist() == [0, 1, 3, 5]
    assert mask[2].nonzero().flatten().tolist() == [0, 2]


def test_prefixes_are_trees_and_chains_are_trees() -> None:
    tree = DraftTree.parse(TREE)
    for n in range(tree.num_drafts + 1):
        prefix = tree.prefix(n)
        assert prefix.num_drafts == n and prefix.parents == tree.parents[: n + 1]
    assert DraftTree.parse("0;0.0;0.0.0") == DraftTree.chain(3)
    assert DraftTree.chain(3).is_chain and not tree.is_chain
    assert tree.prefix(1).is_chain


@pytest.mark.parametrize(("choices", "message"), [
    ("0;0.0.0", "no parent"),
    ("0;x", "dot-separated"),
    ("", "empty"),
    ("0;-1", ">= 0"),
    (";".join(str(r) for r in range(17)), "at most 16"),
])
def test_bad_trees_are_config_errors(choices: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DraftTree.parse(choices)


def _walk(tree: DraftTree, drafts: list[int], best: list[int]) -> list[int]:
    """Greedy acceptance written out: from the root, step to the child holding the target's pick."""
    node, emitted = 0, []
    while True:
        nxt = [c for c in tree.children(node) if drafts[c - 1] == best[node]]
        if not nxt:
            return emitted + [best[node]]
        node = nxt[0]
        emitted.append(drafts[node - 1])


def test_greedy_trees_follow_the_branch_the_target_picks() -> None:
    rng = random.Random(0)
    trees = [DraftTree.parse(TREE), DraftTree.parse("0;1;0.0;1.0;1.1"), DraftTree.chain(3), DraftTree.parse("0;1")]
    vocab = 4  # small, so that branches past the first match often
    for _ in range(300):
        chosen = [rng.choice(trees) for _ in range(3)]
        drafts, bests = [], []
        for tree in chosen:  # siblings hold distinct guesses, as a proposer's top-k does
            d = [0] * tree.num_drafts
            for parent in range(len(tree.parents)):
                kids = tree.children(parent)
                for c, t in zip(kids, rng.sample(range(vocab), len(kids)), strict=True):
                    d[c - 1] = t
            drafts.append(d)
            bests.append([rng.randrange(vocab) for _ in range(tree.num_drafts + 1)])
        width = max(t.num_drafts for t in chosen) + 1
        draft_ids = torch.tensor([d + [-1] * (width - len(d)) for d in drafts])
        best = torch.tensor([b + [-1] * (width - len(b)) for b in bests])
        out = greedy_trees(draft_ids, chosen, best)
        expected = [_walk(t, d, b) for t, d, b in zip(chosen, drafts, bests, strict=True)]
        assert out.emitted() == expected
        for i, tree in enumerate(chosen):  # the branch names the rows that scored the emitted tokens
            branch = out.branch[i, : len(expected[i])].tolist()
            assert [bests[i][node] for node in branch][-1] == expected[i][-1]
            assert branch == tree.ancestors(branch[-1])


def test_chains_verified_as_trees_equal_greedy_chains() -> None:
    torch.manual_seed(0)
    draft_ids = torch.randint(0, 3, (64, 5))
    num_draft = torch.randint(0, 5, (64,))
    draft_ids[torch.arange(5)[None, :] >= num_draft[:, None]] = -1
    best = torch.randint(0, 3, (64, 5))
    chains = [DraftTree.chain(int(n)) for n in num_draft]
    as_trees = greedy_trees(draft_ids, chains, best)
    assert as_trees.emitted() == greedy_chains(draft_ids, num_draft, best).emitted()


def test_verify_drafts_mixes_greedy_trees_with_sampled_chains() -> None:
    """A batch holding a tree and a sampled chain verifies each as it would alone, and the tree's logprobs
    come from its accepted branch's rows."""
    torch.manual_seed(1)
    tree = DraftTree.parse("0;1;1.0")
    greedy, sampled = SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=0.9, seed=3)
    tree_logits = torch.randn(4, 6)
    best = tree_logits.argmax(dim=-1).tolist()
    # node 2 (rank 1) holds the root's pick, node 3 the pick after node 2: the second branch is accepted
    drafts = [(best[0] + 1) % 6, best[0], best[2]]
    tree_input = VerifyInput(drafts, greedy, None, frozenset(), 0, tree)
    chain_logits = torch.randn(3, 6)

    def chain_input() -> VerifyInput:
        return VerifyInput([1, 2], sampled, torch.Generator().manual_seed(3), frozenset(), 0)

    alone_tree = verify_drafts(tree_logits, [tree_input], Sampler(seed=7))
    alone_chain = verify_drafts(chain_logits, [chain_input()], Sampler(seed=7))
    both = verify_drafts(torch.cat([tree_logits, chain_logits]), [tree_input, chain_input()], Sampler(seed=7))
    assert alone_tree.emitted() == [[best[0], best[2], best[3]]]
    assert both.emitted() == alone_tree.emitted() + alone_chain.emitted()
    lps = both.logprobs[0]
    rows = torch.log_softmax(tree_logits, dim=-1)
    expected = [rows[node, token].item() for node, token in zip([0, 2, 3], both.emitted()[0], strict=True)]
    assert [lp.logprob for lp in lps] == pytest.approx(expected, abs=1e-5)
