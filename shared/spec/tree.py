"""Draft trees: several guesses per draft position, verified in one forward pass.

A chain of k drafts stakes each position on one guess; a tree also tries the
proposer's second and third choices where the first is most often wrong, and
verification keeps the longest branch the target agrees with. A tree is written
as the rank paths of its nodes ("choices", as EAGLE and Medusa write them):
`0` is the proposer's best first draft, `1` its second best, `0.0` its best
guess after `0`, and so on; every prefix of a path must be a node too.

Nodes are numbered breadth first with the root as node 0: the root is the last
known token t_{L-1}, which every verification runs anyway. Parents come before
children in that order, so the first n drafts of a tree form a tree too
(`prefix`), and cutting drafts at a token budget stays valid::

    choices "0;1;0.0;0.1;0.0.0"
    node     0     1    2    3      4      5
    path     root  0    1    0.0    0.1    0.0.0
    parent   -     0    0    1      1      3
    depth    0     1    1    2      2      3

Verification runs nodes 0..n as one chunk of the request: node i's KV goes to
slot L-1+i, its RoPE position is L-1+depth(i), and it attends to the committed
context and to its own ancestors (`ancestor_mask`), so each node sees exactly
the sequence its branch spells. Greedy acceptance (shared/spec/verify.py) walks
from the root to the child holding the target's argmax at its parent; the
runner then moves the accepted branch's KV to slots L..L-1+a, where a plain
chain would have written it. A chain of k drafts is the tree `0;0.0;0.0.0;...`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from shared.errors import ConfigError

__all__ = ["DraftTree"]

MAX_TREE_DRAFTS = 16  # one verification chunk stays a short one (paged attention's batched path)


@dataclass(frozen=True)
class DraftTree:
    """A draft tree's shape: node 0 is the root, nodes 1..n the drafts in breadth-first order."""

    parents: tuple[int, ...]  # [n + 1]; parents[0] = -1
    ranks: tuple[int, ...]  # [n + 1]: which of its parent's guesses (0 = best) a node is; ranks[0] = 0

    def __post_init__(self) -> None:
        assert len(self.parents) == len(self.ranks) >= 1 and self.parents[0] == -1, self
        assert all(0 <= p < i for i, p in enumerate(self.parents) if i), f"parents must precede children: {self}"

    @classmethod
    def parse(cls, choices: str) -> DraftTree:
        """A tree from rank paths separated by ';' (see the module docstring)."""
        try:
            paths = sorted({tuple(int(r) for r in part.strip().split(".")) for part in choices.split(";")
                            if part.strip()}, key=lambda p: (len(p), p))
        except ValueError:
            raise ConfigError(f"draft tree {choices!r}: paths are dot-separated ranks like '0;1;0.0'") from None
        if not paths:
            raise ConfigError("draft tree is empty")
        if len(paths) > MAX_TREE_DRAFTS:
            raise ConfigError(f"draft tree has {len(paths)} drafts, at most {MAX_TREE_DRAFTS}")
        index: dict[tuple[int, ...], int] = {(): 0}
        parents, ranks = [-1], [0]
        for path in paths:
            if any(r < 0 for r in path):
                raise ConfigError(f"draft tree {choices!r}: ranks are >= 0, got {'.'.join(map(str, path))}")
            if path[:-1] not in index:
                raise ConfigError(f"draft tree {choices!r}: {'.'.join(map(str, path))} has no parent node")
            index[path] = len(parents)
            parents.append(index[path[:-1]])
            ranks.append(path[-1])
        return cls(tuple(parents), tuple(ranks))

    @classmethod
    def chain(cls, num_drafts: int) -> DraftTree:
        return cls(tuple(range(-1, num_drafts)), (0,) * (num_drafts + 1))

    @property
    def num_drafts(self) -> int:
        return len(self.parents) - 1

    @cached_property
    def depths(self) -> tuple[int, ...]:  # [n + 1]
        depths = [0]
        for p in self.parents[1:]:
            depths.append(depths[p] + 1)
        return tuple(depths)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents) if i)

    def prefix(self, num_drafts: int) -> DraftTree:
        """The tree of the first `num_drafts` drafts (parents precede children, so it is one). The whole tree
        is itself, so its masks and tables, built once, serve every step that drafts all of it."""
        if num_drafts == self.num_drafts:
            return self
        return DraftTree(self.parents[: num_drafts + 1], self.ranks[: num_drafts + 1])

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def ancestors(self, node: int) -> list[int]:
        """The node's branch from the root: [0, ..., node]."""
        branch = [node]
        while branch[-1] != 0:
            branch.append(self.parents[branch[-1]])
        return branch[::-1]

    def ancestor_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:  # [n + 1, n + 1] bool
        """mask[i, j]: node j is node i or one of its ancestors (what node i attends to in the tree)."""
        return self._ancestor_mask.to(device)

    @cached_property
    def _ancestor_mask(self) -> torch.Tensor:  # built once per tree: every verification step asks
        n = len(self.parents)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            mask[i, self.ancestors(i)] = True
        return mask

    @cached_property
    def branch_table(self) -> tuple[tuple[int, ...], ...]:  # [n + 1][max_depth + 1]
        """Row i: node i's branch, root first, padded with 0 past its depth (the root: never read there)."""
        width = self.max_depth + 1
        return tuple(tuple(b + [0] * (width - len(b))) for b in (self.ancestors(i) for i in range(len(self.parents))))
