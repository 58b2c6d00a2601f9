"""shared.engine.logits.request_state: a request's constraints follow its history exactly.

Every check compares against a fresh state synced to the same history from nothing, so rollback,
trial drafts and trees must leave no trace.
"""

from __future__ import annotations

import json

import pytest
import torch

from shared.engine.logits.processor import bitmask_words
from shared.engine.logits.request_state import FREE, Constraint, RequestLogits
from shared.engine.request import SamplingParams
from shared.spec.tree import DraftTree
from shared.structured.compiler import GrammarCompiler
from shared.structured.spec import GrammarSpec, ReasoningSpec
from tests.helpers.tokenizers import BYTE_VOCAB, byte_tokenizer

SCHEMA = GrammarSpec("json_schema", json.dumps({
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["xy", "xz"]}},
    "required": ["a", "b"], "additionalProperties": False,
}))
START, END = 0, 2  # <pad> and <bos> stand in for the thinking markers
WORDS = bitmask_words(BYTE_VOCAB)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(byte_tokenizer(), vocab_size=BYTE_VOCAB, stop_token_ids=[1])


def ids(text: str) -> list[int]:
    return list(byte_tokenizer()(text, add_special_tokens=False).input_ids)


def new_state(compiler: GrammarCompiler, params: SamplingParams) -> RequestLogits:
    assert params.structured is not None
    return RequestLogits("r", params, [5, 6], GrammarCompiler.new_matcher(compiler.compile(params.structured)))


def row(state: RequestLogits) -> tuple[Constraint, list[int]]:
    mask = torch.full((WORDS,), -1, dtype=torch.int32)
    c = state.constraint(mask)
    return c, mask.tolist() if c.grammar else []


def fresh_row(compiler: GrammarCompiler, params: SamplingParams, history: list[int]) -> tuple[Constraint, list[int]]:
    state = new_state(compiler, params)
    state.sync(history)
    return row(state)


def test_sync_rolls_back_a_dropped_tail_and_follows_the_new_one(compiler: GrammarCompiler) -> None:
    params = SamplingParams(structured=SCHEMA)
    state = new_state(compiler, params)
    state.sync(ids('{"a": 12'))
    state.sync(ids('{"a": 1234'))  # runs ahead
    truth = ids('{"a": 7, "b": "x')  # the last tokens it held were dropped
    state.sync(truth)
    assert row(state) == fresh_row(compiler, params, truth)
    assert state.history == truth and sum(state.counts.values()) == len(truth)


def test_chain_constraints_match_fresh_walks_and_leave_no_trace(compiler: GrammarCompiler) -> None:
    params = SamplingParams(structured=SCHEMA)
    state = new_state(compiler, params)
    history = ids('{"a": 3')
    state.sync(history)
    before = row(state)
    drafts = ids(', "b": "x')
    mask = torch.full((len(drafts) + 1, WORDS), -1, dtype=torch.int32)
    rows = state.chain_constraints(drafts, mask)
    for j, c in enumerate(rows):
        expected = fresh_row(compiler, params, history + drafts[:j])
        assert (c, mask[j].tolist()) == expected
    assert row(state) == before and state.history == history


def test_positions_after_a_refused_draft_are_unconstrained(compiler: GrammarCompiler) -> None:
    params = SamplingParams(structured=SCHEMA)
    state = new_state(compiler, params)
    state.sync(ids("{"))
    drafts = ids('"a"') + ids("!!")  # '"a"' is fine, '!' is not allowed after it
    mask = torch.full((len(drafts) + 1, WORDS), -1, dtype=torch.int32)
    rows = state.chain_constraints(drafts, mask)
    assert all(c.grammar for c in rows[:4]) and rows[4:] == [FREE, FREE]


def test_tree_constraints_follow_each_nodes_path(compiler: GrammarCompiler) -> None:
    params = SamplingParams(structured=SCHEMA)
    state = new_state(compiler, params)
    history = ids('{"a": 1, "b": "x')
    state.sync(history)
    tree = DraftTree.parse("0;1;0.0;1.0")  # node 1 'y', node 2 'z', node 3 '"' after y, node 4 'q' after z
    drafts = ids("yz") + ids('"') + ids("q")
    mask = torch.full((tree.num_drafts + 1, WORDS), -1, dtype=torch.int32)
    rows = state.tree_constraints(tree, drafts, mask)
    paths = {0: [], 1: ids("y"), 2: ids("z"), 3: ids('y"')}
    for node, path in paths.items():
        assert (rows[node], mask[node].tolist()) == fresh_row(compiler, params, history + path), node
    assert rows[4] == FREE  # 'q' is refused after "xz": its branch is rejected before its row matters
    assert state.history == history


def test_reasoning_keeps_the_grammar_for_the_answer_and_forces_the_end(compiler: GrammarCompiler) -> None:
    reasoning = ReasoningSpec((START,), (END,), budget=3)
    params = SamplingParams(structured=SCHEMA, reasoning=reasoning)
    state = new_state(compiler, params)
    first = row(state)[0]
    assert first.grammar and first.also_allowed == START  # may open the thinking section or answer
    state.sync([START, 70, 71])
    assert row(state)[0] == FREE  # thinking: anything goes
    state.sync([START, 70, 71, 72])
    assert row(state)[0] == Constraint(forced=END)  # budget spent
    history = [START, 70, 71, 72, END]
    state.sync(history)
    c, mask = row(state)
    assert c.grammar and c.also_allowed is None
    assert (c, mask) == fresh_row(compiler, SamplingParams(structured=SCHEMA), [])  # the answer starts the grammar
    state.sync(history + ids('{"a"'))
    assert row(state) == fresh_row(compiler, SamplingParams(structured=SCHEMA), ids('{"a"'))


def test_a_refused_history_token_suspends_constraints_until_rolled_back(compiler: GrammarCompiler) -> None:
    params = SamplingParams(structured=SCHEMA)
    state = new_state(compiler, params)
    state.sync(ids("{!"))  # a token of a dropped step that the grammar never allowed
    assert row(state)[0] == FREE
    state.sync(ids('{"'))
    assert row(state) == fresh_row(compiler, params, ids('{"'))


def test_penalty_counts_follow_the_history() -> None:
    params = SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5)
    state = RequestLogits("r", params, [9, 9, 4], None)
    state.sync([3, 3, 5])
    state.sync([3, 3, 6, 6])
    assert dict(state.counts) == {3: 2, 6: 2} and state.prompt_ids == [4, 9]
