"""shared.engine.logits.processor: the batch pipeline against a per-row reference written out plainly."""

from __future__ import annotations

import json

import torch

from shared.engine.logits.processor import LogitsRows, RowGroup
from shared.engine.logits.request_state import RequestLogits
from shared.engine.request import SamplingParams
from shared.engine.sampler import processed_probs
from shared.structured.compiler import GrammarCompiler
from shared.structured.spec import GrammarSpec
from tests.helpers.logits_reference import reference_row
from tests.helpers.tokenizers import BYTE_VOCAB, byte_tokenizer

VOCAB = BYTE_VOCAB


def test_bias_and_penalties_match_the_reference_on_every_row_of_a_chain() -> None:
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(logit_bias=((7, 5.0), (300, 1.0)), presence_penalty=0.5, frequency_penalty=0.25,
                            repetition_penalty=1.3)
    prompt, output, drafts = [4, 9, 9, 12], [12, 12, 40, 7], [40, 41, 40]
    state = RequestLogits("a", params, prompt, None)
    state.sync(output)
    bias_only = SamplingParams(logit_bias=((3, -100.0),))
    groups = [RowGroup(state, drafts), RowGroup(None), RowGroup(RequestLogits("b", bias_only, [1], None))]
    rows = LogitsRows.build(groups, VOCAB)
    assert rows is not None and rows.num_rows == 6
    logits = torch.randn(6, VOCAB, generator=g) * 3
    got = rows.apply(logits)
    for j in range(4):
        torch.testing.assert_close(got[j], reference_row(logits[j], params, prompt, output + drafts[:j]))
    torch.testing.assert_close(got[4], logits[4])  # a request without processing passes through
    torch.testing.assert_close(got[5], reference_row(logits[5], bias_only, [1], []))
    before = logits.clone()
    rows.apply(logits)
    assert torch.equal(logits, before)  # the raw logits stay for logprobs


def test_nothing_to_do_builds_nothing() -> None:
    assert LogitsRows.build([RowGroup(None), RowGroup(None, [3, 4])], VOCAB) is None


def test_grammar_and_forced_rows_leave_only_their_tokens() -> None:
    compiler = GrammarCompiler(byte_tokenizer(), vocab_size=VOCAB, stop_token_ids=[1])
    spec = GrammarSpec("json_schema", json.dumps({"enum": ["ab", "ac"]}))
    params = SamplingParams(structured=spec)
    state = RequestLogits("g", params, [5], GrammarCompiler.new_matcher(compiler.compile(spec)))
    state.sync(byte_tokenizer()('"a', add_special_tokens=False).input_ids)
    rows = LogitsRows.build([RowGroup(state)], VOCAB)
    assert rows is not None and rows.is_constrained == [True]
    out = rows.apply(torch.zeros(1, VOCAB))
    allowed = torch.isfinite(out[0]).nonzero().flatten().tolist()
    assert allowed == [3 + ord("b"), 3 + ord("c")]


def test_min_p_keeps_tokens_at_least_min_p_times_the_best() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = processed_probs(logits, [SamplingParams(temperature=1.0, min_p=0.35)])
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.3, 0.0, 0.0]]) / 0.8)
    hot = processed_probs(logits, [SamplingParams(temperature=2.0, min_p=0.5)])  # after temperature: p ~ sqrt
    kept = (hot[0] > 0).tolist()
    assert kept == [True, True, True, False]  # relative to the best: 1, 0.77, 0.55, 0.32
