"""Prompt-lookup ("ngram") proposer: copy what followed the last n tokens the previous time.

No model. For each request the last n tokens (the suffix) are searched for in
the earlier context, n from `max_n` down to `min_n`; the longest n that occurs
wins and, among its occurrences, the most recent one. The k tokens that
followed it are the proposal::

    tokens:  ... a b c X Y Z ... a b c | (end)       suffix "a b c" (n = 3)
                       ^^^^^^^ proposed: X Y Z ...

When the occurrence is so recent that fewer than k tokens follow it before the
end, the text is periodic with period d = (distance between the two
occurrences), and the proposal continues that period (`a b a b a b` proposes
`a b a b ...`), which is what repetitive output does next.

Cost per request and call: one vectorised comparison over the context (O(L))
to find the ends of 1-gram matches, then O(matches) per longer n; no state is
kept between calls, so nothing leaks when a request ends.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from shared.spec.proposer import ProposalInput

__all__ = ["NgramProposer", "find_ngram_match"]


def find_ngram_match(
    tokens: np.ndarray,  # [L] int64
    min_n: int,
    max_n: int,
) -> tuple[int, int] | None:
    """(n, end) of the longest suffix n-gram (min_n <= n <= max_n) seen before, most recent first.

    `end` is the index of the occurrence's last token, `end < L - 1`, so at least
    one token follows it. None when no n-gram of length >= min_n recurs.
    """
    length = tokens.shape[0]
    max_n = min(max_n, length - 1)
    if length < 2 or max_n < min_n:
        return None
    # ends e (< L-1) whose token equals the last token: 1-gram matches
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    best: tuple[int, int] | None = (1, int(ends[-1])) if ends.size else None
    for n in range(2, max_n + 1):
        # keep ends whose match extends one token further back
        ends = ends[ends >= n - 1]
        ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
        if ends.size == 0:
            break
        best = (n, int(ends[-1]))
    if best is None or best[0] < min_n:
        return None
    return best


class NgramProposer:
    """Prompt lookup over each request's own tokens (vLLM's `ngram` method)."""

    proposes_ahead = True  # stateless, token ids only: it can guess past a token not read yet

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: Sequence[ProposalInput]) -> list[list[int]]:
        return [self.propose_one(r.token_ids, r.num_speculative_tokens) for r in requests]

    def propose_one(self, token_ids: Sequence[int] | npt.NDArray[np.integer], num_tokens: int) -> list[int]:
        """Up to `num_tokens` ids continuing `token_ids`; [] when no n-gram recurs."""
        if num_tokens <= 0 or len(token_ids) < 2:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        match = find_ngram_match(tokens, self.min_n, self.max_n)
        if match is None:
            return []
        _, end = match
        # tokens[end + 1 :] is one full period when the continuation reaches the end; repeat it
        follow = tokens[end + 1 : end + 1 + num_tokens]
        if follow.shape[0] < num_tokens:
            follow = np.resize(follow, num_tokens)
        return [int(t) for t in follow]
