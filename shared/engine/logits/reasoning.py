"""Where a reasoning model is in its output: before, inside or after its thinking section.

A pure state machine over output tokens, one state per prefix of the output, so
that stepping back (rejected drafts, a dropped step) is a truncation::

    BEFORE ──start[0]──► OPENING(1..) ──start done──► THINKING(count)
      │ (position 0 only;                                │ end sequence emitted
      │  any other token)                                │ or count reaches the budget:
      ▼                                                  ▼ CLOSING(0..) forces end[k]
    ANSWER ◄──────────────────────────────────────────── end done

- BEFORE: the prompt did not open the section; the first token may open it
  (start[0]) or begin the answer.
- OPENING(k) / CLOSING(k): the k-th token of the start / end sequence is forced.
- THINKING(count): free text; `count` thinking tokens so far. With a budget, the
  step that reaches it closes the section by force.
- ANSWER: the grammar, if the request has one, applies from here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.structured.spec import ReasoningSpec


class Phase(enum.Enum):
    BEFORE = "before"
    OPENING = "opening"
    THINKING = "thinking"
    CLOSING = "closing"
    ANSWER = "answer"


@dataclass(frozen=True)
class ReasoningState:
    """The phase after some prefix of the output; `k` is the forced token's index (OPENING/CLOSING),
    `count` the thinking tokens so far (THINKING), `tail` the last tokens (to spot the end sequence)."""

    phase: Phase
    k: int = 0
    count: int = 0
    tail: tuple[int, ...] = ()

    @property
    def is_answer(self) -> bool:
        return self.phase == Phase.ANSWER


def initial_state(spec: ReasoningSpec) -> ReasoningState:
    if not spec.thinking_at_start:
        return ReasoningState(Phase.BEFORE)
    return _thinking(spec, 0, ())


def _thinking(spec: ReasoningSpec, count: int, tail: tuple[int, ...]) -> ReasoningState:
    """THINKING with `count` tokens, or CLOSING when that exhausts the budget."""
    if spec.budget is not None and count >= spec.budget:
        return ReasoningState(Phase.CLOSING, k=0)
    return ReasoningState(Phase.THINKING, count=count, tail=tail)


def forced_token(spec: ReasoningSpec, state: ReasoningState) -> int | None:
    """The one token allowed next, when the state forces it."""
    if state.phase == Phase.OPENING:
        return spec.start_token_ids[state.k]
    if state.phase == Phase.CLOSING:
        return spec.end_token_ids[state.k]
    return None


def advance(spec: ReasoningSpec, state: ReasoningState, token_id: int) -> ReasoningState:
    """The state after `token_id` was emitted in `state`."""
    phase = state.phase
    if phase == Phase.BEFORE:
        if token_id != spec.start_token_ids[0]:
            return ReasoningState(Phase.ANSWER)
        if len(spec.start_token_ids) > 1:
            return ReasoningState(Phase.OPENING, k=1)
        return _thinking(spec, 0, ())
    if phase == Phase.OPENING:
        if state.k + 1 < len(spec.start_token_ids):
            return ReasoningState(Phase.OPENING, k=state.k + 1)
        return _thinking(spec, 0, ())
    if phase == Phase.THINKING:
        end = spec.end_token_ids
        tail = (state.tail + (token_id,))[-len(end):]
        if tail == end:
            return ReasoningState(Phase.ANSWER)
        return _thinking(spec, state.count + 1, tail)
    if phase == Phase.CLOSING:
        if state.k + 1 < len(spec.end_token_ids):
            return ReasoningState(Phase.CLOSING, k=state.k + 1)
        return ReasoningState(Phase.ANSWER)
    return state  # ANSWER stays
