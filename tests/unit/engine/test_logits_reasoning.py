"""shared.engine.logits.reasoning: the thinking section's phases, its budget, multi-token markers."""

from __future__ import annotations

from shared.engine.logits.reasoning import Phase, ReasoningState, advance, forced_token, initial_state
from shared.structured.spec import ReasoningSpec

START, END = 50, 51


def walk(spec: ReasoningSpec, tokens: list[int]) -> list[ReasoningState]:
    states = [initial_state(spec)]
    for t in tokens:
        states.append(advance(spec, states[-1], t))
    return states


def test_a_first_token_other_than_start_begins_the_answer() -> None:
    spec = ReasoningSpec((START,), (END,))
    states = walk(spec, [7, 8])
    assert [s.phase for s in states] == [Phase.BEFORE, Phase.ANSWER, Phase.ANSWER]


def test_thinking_opened_by_the_model_ends_at_the_end_marker() -> None:
    spec = ReasoningSpec((START,), (END,))
    states = walk(spec, [START, 7, 8, END, 9])
    assert [s.phase for s in states] == [Phase.BEFORE, Phase.THINKING, Phase.THINKING, Phase.THINKING,
                                         Phase.ANSWER, Phase.ANSWER]
    assert states[3].count == 2


def test_budget_forces_a_multi_token_end_marker() -> None:
    spec = ReasoningSpec((START,), (END, 52, 53), thinking_at_start=True, budget=2)
    states = walk(spec, [7, 8])
    assert states[-1] == ReasoningState(Phase.CLOSING, k=0)
    forced = []
    state = states[-1]
    while (token := forced_token(spec, state)) is not None:
        forced.append(token)
        state = advance(spec, state, token)
    assert forced == [END, 52, 53] and state.phase == Phase.ANSWER


def test_zero_budget_closes_at_once_and_a_multi_token_start_is_forced() -> None:
    assert initial_state(ReasoningSpec((START,), (END,), thinking_at_start=True, budget=0)).phase == Phase.CLOSING
    spec = ReasoningSpec((START, 60), (END,))
    state = advance(spec, initial_state(spec), START)
    assert state.phase == Phase.OPENING and forced_token(spec, state) == 60
    assert advance(spec, state, 60).phase == Phase.THINKING


def test_a_multi_token_end_marker_written_naturally_ends_thinking() -> None:
    spec = ReasoningSpec((START,), (END, 52), thinking_at_start=True)
    states = walk(spec, [END, 7, END, 52, 9])  # END alone is thinking text; END 52 closes
    assert [s.phase for s in states][-3:] == [Phase.THINKING, Phase.ANSWER, Phase.ANSWER]
