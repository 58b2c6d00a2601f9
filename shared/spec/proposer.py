"""The one seam every speculative proposer implements.

One decode step with speculation, for one request whose known tokens are
`t_0 .. t_{L-1}` (prompt + output; `t_{L-1}` was emitted by the last step and
has not been run through the target yet)::

    proposer.propose([ProposalInput(...), ...])   ->  drafts d_0 .. d_{m-1}, m <= k
    target runs [t_{L-1}, d_0, .., d_{m-1}]        ->  m + 1 next-token distributions
    rejection sampler                              ->  accepted prefix of d + 1 token
                                                       (recovered or bonus)

Contract of `Proposer.propose`:

- One call covers a batch; it returns one list per input, in input order.
- Entry i holds at most `requests[i].num_speculative_tokens` token ids, each in
  `[0, vocab_size)`. Fewer is always allowed, none included: an empty list means
  "decode this request plainly this step" (nothing found, or speculation is off
  for it: `num_speculative_tokens == 0` must give `[]`).
- Proposals are a guess, never a commitment: correctness comes from
  verification alone, so a proposer may be arbitrarily wrong, but it must be
  deterministic given its inputs and state if greedy output is to be
  reproducible run to run (verification makes the *output* exact either way).
- `propose` does not mutate the inputs. A stateful proposer (draft model or
  EAGLE head with its own KV) keys its state by `request_id` and learns about a
  request's end from its owner; the protocol itself carries no lifecycle hooks.
- Errors are raised, not encoded in the return value; the engine turns a
  failure into plain decoding for that request (and counts it).

Draft trees: a proposer with `drafts_trees = True` may be given
`ProposalInput.tree`; it then returns the tokens of the tree's nodes 1..n in
node order (or of its first m < n nodes: any prefix of the nodes is a tree),
node i being the `ranks[i]`-th best guess after its parent's branch, distinct
among siblings. `num_speculative_tokens` is then the tree's n.

Optional, looked up on the proposer object by the engine's `Speculator`:
`uses_hidden_states = True` asks for `ProposalInput.hidden_states`;
`drafts_trees = True` accepts `ProposalInput.tree`;
`remove_request(request_id)` drops per-request state when a request ends;
`check_no_leaks()` asserts that no per-request state is left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch

from shared.spec.tree import DraftTree

__all__ = ["ProposalInput", "Proposer"]


@dataclass(frozen=True)
class ProposalInput:
    """What a proposer may look at for one request in one step."""

    request_id: str
    # prompt + output so far, t_0 .. t_{L-1}; a 1-D int array saves the n-gram proposer a copy
    token_ids: Sequence[int] | npt.NDArray[np.integer]
    # most draft tokens wanted this step; 0 = speculation off for this request
    num_speculative_tokens: int
    # EAGLE only: the target's final-norm hidden states for the last m tokens it ran,
    # i.e. row r belongs to t_{L-1-m+r} (the last token t_{L-1} has none yet).
    hidden_states: torch.Tensor | None = None  # [m, hidden]
    # proposers with drafts_trees: draft this tree's nodes instead of a chain (see the module docstring)
    tree: DraftTree | None = None

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")


@runtime_checkable
class Proposer(Protocol):
    """Guesses the next few tokens of each request; see the module docstring for the contract."""

    def propose(self, requests: Sequence[ProposalInput]) -> list[list[int]]:
        """Draft token ids per request: `len(result[i]) <= requests[i].num_speculative_tokens`."""
        ...
