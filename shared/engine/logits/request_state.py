"""One request's logits-processing state: what its output so far implies for the next token.

The state follows the request's output exactly, by `sync(history)` before each
step that samples for it::

    history (the output tokens before the position sampled now)
        │ common prefix with what the state holds → roll back the rest, apply the new tokens
        ▼
    token counts (penalties) · reasoning phase per prefix · grammar matcher
        │ positions(drafts): the constraint at the next position and after each draft
        ▼
    [Constraint] one per sampled row: a token bitmask, a forced token, or nothing

The runner owns it and calls it on the executor thread only. Syncing against the
history instead of feeding it each emitted token keeps it right however the
engine's loops reorder work: the zero-bubble loop reads results a step late and
may drop a step's tokens (a preempted request is recomputed), speculation proposes
drafts that verification rejects, and a decode engine starts from the token
prefill sampled. The matcher's state crosses a handoff the same way: decode
replays the tokens before the first position it samples.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from shared.engine.logits.reasoning import (
    Phase,
    ReasoningState,
    advance,
    forced_token,
    initial_state,
)
from shared.engine.request import SamplingParams
from shared.spec.tree import DraftTree
from shared.structured.utf8 import Utf8Guard

logger = logging.getLogger(__name__)

__all__ = ["Constraint", "RequestLogits"]


@dataclass(frozen=True)
class Constraint:
    """What one sampled position may emit. Either field may be set; neither means no constraint.

    grammar: the matcher's next-token bitmask was filled into the caller's row.
    forced: exactly this token (reasoning start/end sequences).
    also_allowed: a token allowed beside the grammar's (the first token may open the thinking section).
    """

    grammar: bool = False
    forced: int | None = None
    also_allowed: int | None = None


FREE = Constraint()
# more than one step's tokens (drafts + 1): the depth at which a held history can differ from the truth
_TAIL = 64


class RequestLogits:
    """Logits-processing state of one request (one choice of it)."""

    def __init__(self, request_id: str, params: SamplingParams, prompt_token_ids: Sequence[int],
                 matcher: xgr.GrammarMatcher | None, utf8_guard: Utf8Guard | None = None,
                 num_words: int = 0) -> None:
        """`num_words`: int32 words in a bitmask row of the model's vocabulary (grammar states)."""
        self.request_id = request_id
        self.params = params
        # repetition penalty: prompt ids, deduplicated once (the output's are counted as they come)
        self.prompt_ids = sorted(set(prompt_token_ids)) if params.repetition_penalty != 1.0 else []
        self.matcher = matcher
        self.utf8_guard = utf8_guard
        self.num_words = num_words
        self.history: list[int] = []  # the output tokens the state reflects
        self.counts: Counter[int] = Counter()  # of `history`
        reasoning = params.reasoning
        # phase after each prefix of history: phases[i] holds before history[i]
        self.phases: list[ReasoningState] = [initial_state(reasoning)] if reasoning is not None else []
        # tokens the matcher consumed after each prefix (it sees only the answer's tokens)
        self.num_matched: list[int] = [0]
        # where the matcher refused a token of the history (a token past the grammar's end, from a step
        # whose request had already stopped): no constraints until the history is rolled back before it
        self.broken_at: int | None = None

    # ---- following the output ------------------------------------------------------------
    def sync(self, history: Sequence[int]) -> None:
        """Make the state reflect exactly `history`, the output so far."""
        keep = self._common_prefix(history)
        self._truncate(keep)
        for token_id in history[keep:]:
            self._append(token_id)

    def _common_prefix(self, history: Sequence[int]) -> int:
        """How many leading tokens of `history` the state already holds.

        The state runs ahead of the true output by at most one step's tokens (a dropped step), so
        only the last `_TAIL` tokens are compared: comparing all would make every step O(length).
        """
        n = min(len(self.history), len(history))
        for i in range(max(0, n - _TAIL), n):
            if self.history[i] != history[i]:
                return i
        return n

    def _truncate(self, length: int) -> None:
        if length == len(self.history):
            return
        for token_id in self.history[length:]:
            self.counts[token_id] -= 1
            if not self.counts[token_id]:
                del self.counts[token_id]
        del self.history[length:]
        if self.phases:
            del self.phases[length + 1:]
        if self.matcher is not None and self.num_matched[-1] > self.num_matched[length]:
            self.matcher.rollback(self.num_matched[-1] - self.num_matched[length])
        del self.num_matched[length + 1:]
        if self.broken_at is not None and self.broken_at >= length:
            self.broken_at = None

    def _append(self, token_id: int) -> bool:
        """Take `token_id` as the next output token; False when the grammar does not allow it."""
        state = self.phases[-1] if self.phases else None
        to_grammar = state is None or state.is_answer or (
            state.phase == Phase.BEFORE and token_id != self._start_token)
        ok = True
        matched = self.num_matched[-1]
        if to_grammar and self.matcher is not None and self.broken_at is None:
            # refused: a token past the grammar's end, or one its mask did not allow (a step's token
            # whose request had already stopped, or a draft on trial)
            ok = not self.matcher.is_terminated() and self.matcher.accept_token(token_id)
            if ok:
                matched += 1
            else:
                self.broken_at = len(self.history)
        self.history.append(token_id)
        self.counts[token_id] += 1
        self.num_matched.append(matched)
        if state is not None:
            assert self.params.reasoning is not None
            self.phases.append(advance(self.params.reasoning, state, token_id))
        return ok

    @property
    def _start_token(self) -> int | None:
        reasoning = self.params.reasoning
        return reasoning.start_token_ids[0] if reasoning is not None else None

    # ---- constraints on the positions sampled now -----------------------------------------
    def constraint(self, bitmask_row: torch.Tensor) -> Constraint:
        """The constraint at the next position; fills `bitmask_row` ([words] int32) when it is the grammar's."""
        state = self.phases[-1] if self.phases else None
        if state is not None:
            assert self.params.reasoning is not None
            forced = forced_token(self.params.reasoning, state)
            if forced is not None:
                return Constraint(forced=forced)
            if state.phase == Phase.THINKING:
                return FREE
        if self.matcher is None or self.broken_at is not None:
            return FREE
        if self.matcher.is_terminated():
            return FREE  # the request stops on this token (eos); what it samples is dropped anyway
        self.matcher.fill_next_token_bitmask(bitmask_row.unsqueeze(0))
        if self.utf8_guard is not None:
            self.utf8_guard.restrict(self.history[-1] if self.history else None, bitmask_row)
        also = self._start_token if state is not None and state.phase == Phase.BEFORE else None
        return Constraint(grammar=True, also_allowed=also)

    def chain_constraints(self, drafts: Sequence[int], bitmask: torch.Tensor) -> list[Constraint]:
        """Constraints at the next position and after each draft (len(drafts) + 1 of them).

        `bitmask`: [len(drafts) + 1, words] int32, row j filled where constraint j is the grammar's.
        The drafts are taken on trial and rolled back. A draft the constraints refuse will be
        rejected by verification, so the positions after it are left unconstrained (never read).
        """
        base = len(self.history)
        out = [self.constraint(bitmask[0])]
        for j, token_id in enumerate(drafts):
            if not self._allows(out[-1], token_id, bitmask[j]) or not self._append(token_id):
                out.extend([FREE] * (len(drafts) - j))
                break
            out.append(self.constraint(bitmask[j + 1]))
        self._truncate(base)
        return out

    def tree_constraints(self, tree: DraftTree, drafts: Sequence[int], bitmask: torch.Tensor) -> list[Constraint]:
        """Per tree node (row): the constraint after the path from the root to that node.

        Node 0 is the last known token (its row samples the next position); node j > 0 holds
        drafts[j - 1]. Each node's path is taken on trial and rolled back.
        """
        base = len(self.history)
        out: list[Constraint] = []
        for node in range(tree.num_drafts + 1):
            path = _path(tree, node)
            valid = True
            for n in path:
                parent = tree.parents[n]
                if not self._allows(out[parent], drafts[n - 1], bitmask[parent]) or not self._append(drafts[n - 1]):
                    valid = False
                    break
            out.append(self.constraint(bitmask[node]) if valid else FREE)
            self._truncate(base)
        return out

    @property
    def in_grammar(self) -> bool:
        """The next position is the grammar's (past any thinking section)."""
        state = self.phases[-1] if self.phases else None
        return self.matcher is not None and (state is None or state.is_answer)

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the constraints allow in a row (taken on trial, rolled back)."""
        base = len(self.history)
        assert self.num_words > 0, "a grammar state knows its bitmask width"
        row = torch.empty(self.num_words, dtype=torch.int32)
        n = 0
        for token_id in tokens:
            row.fill_(-1)
            if not self._allows(self.constraint(row), token_id, row) or not self._append(token_id):
                break
            n += 1
        self._truncate(base)
        return n

    @staticmethod
    def _allows(constraint: Constraint, token_id: int, bitmask_row: torch.Tensor) -> bool:
        if constraint.forced is not None:
            return token_id == constraint.forced
        if constraint.grammar:
            return token_id == constraint.also_allowed or bool((int(bitmask_row[token_id // 32]) >> (token_id % 32)) & 1)
        return True


def _path(tree: DraftTree, node: int) -> list[int]:
    """Nodes from the root's first child down to `node` (empty for the root)."""
    path: list[int] = []
    while node > 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]
