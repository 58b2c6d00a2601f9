"""Penalties, logit bias, min_p and thinking budgets in the engine, on every path a token is sampled on.

Greedy output with penalties must equal transformers' forward passes run through the pipeline's
formulas one token at a time (tests/helpers/logits_reference.py), and stay identical with the
zero-bubble loop, speculation (drafts are counted as output at the positions after them) and a
prefill -> decode handoff.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.structured.spec import GrammarSpec, ReasoningSpec
from tests.helpers.logits_reference import reference_greedy
from tests.helpers.models import tiny_engine, tiny_loaded, tiny_loaded_with_tokenizer
from tests.helpers.tokenizers import byte_tokenizer
from tests.integration.engine.test_spec_decode import prompts

PENALIZED = [
    SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.8),
    SamplingParams(max_tokens=24, temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(max_tokens=24, temperature=0.0, presence_penalty=-2.0, logit_bias=((7, 3.0), (9, -100.0))),
    SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=0.7, frequency_penalty=-0.5,
                   logit_bias=((40, 1.5),)),
]


def test_greedy_with_penalties_matches_the_reference_on_every_path(engines: list[LLMEngine]) -> None:
    loaded, hf = tiny_loaded("llama")
    batch = prompts(4)
    expected = [reference_greedy(hf, p, params, eos_id=1) for p, params in zip(batch, PENALIZED, strict=True)]
    plain = [r.token_ids for r in tiny_engine(loaded).generate(batch, PENALIZED)]
    assert [r[:len(r)] for r in plain] == expected
    assert plain != [r.token_ids for r in tiny_engine(loaded).generate(batch, SamplingParams(max_tokens=24,
                                                                                              temperature=0.0))]
    for config in [dict(async_scheduling=True), dict(spec_method="ngram", num_speculative_tokens=4),
                   dict(spec_method="ngram", async_scheduling=True)]:
        engine = tiny_engine(loaded, **config)
        engines.append(engine)
        assert [r.token_ids for r in engine.generate(batch, PENALIZED)] == expected, config
        if engine.speculator is not None:
            assert engine.speculator.stats.num_accepted_tokens > 0, config


def test_penalties_cross_the_handoff(engines: list[LLMEngine]) -> None:
    loaded, _ = tiny_loaded("llama")
    batch = prompts(4)
    expected = [r.token_ids for r in tiny_engine(loaded).generate(batch, PENALIZED)]
    prefill, decode = tiny_engine(loaded, role="prefill"), tiny_engine(loaded, role="decode")
    engines.extend([prefill, decode])
    handoffs = prefill.generate(batch, PENALIZED)
    for i, (h, p) in enumerate(zip(handoffs, PENALIZED, strict=True)):
        assert h.handoff is not None and decode.add_handoff(f"d{i}", p, h.handoff) is None
    results = decode.run_to_completion()
    assert [[handoffs[i].handoff.first_token_id] + results[f"d{i}"].token_ids for i in range(4)] == expected


def test_min_p_of_one_leaves_only_the_top_token(engines: list[LLMEngine]) -> None:
    loaded, _ = tiny_loaded("llama")
    engine = tiny_engine(loaded)
    engines.append(engine)
    batch = prompts(3)
    greedy = [r.token_ids for r in engine.generate(batch, SamplingParams(max_tokens=16, temperature=0.0))]
    hot = SamplingParams(max_tokens=16, temperature=5.0, min_p=1.0, seed=1)
    assert [r.token_ids for r in engine.generate(batch, hot)] == greedy
    loose = SamplingParams(max_tokens=16, temperature=5.0, min_p=0.0, seed=1)
    assert [r.token_ids for r in engine.generate(batch, loose)] != greedy


START, END = 0, 2  # the byte tokenizer's <pad> and <bos> stand in for a model's thinking markers
SCHEMA = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["v"],
          "additionalProperties": False}


@pytest.mark.parametrize("budget", [0, 5])
def test_a_thinking_budget_closes_the_section_and_the_grammar_follows(engines: list[LLMEngine], budget: int) -> None:
    loaded, _ = tiny_loaded_with_tokenizer("llama")
    reasoning = ReasoningSpec((START,), (END,), thinking_at_start=True, budget=budget)
    params = SamplingParams(max_tokens=60, temperature=0.0, reasoning=reasoning, ignore_eos=False,
                            structured=GrammarSpec("json_schema", json.dumps(SCHEMA)))
    batch = [list(byte_tokenizer()(t, add_special_tokens=False).input_ids) for t in ("think!", "more", "a b c")]
    results: list[list[int]] = []
    for config in [dict(), dict(async_scheduling=True), dict(spec_method="ngram", async_scheduling=True)]:
        engine = tiny_engine(loaded, **config)
        engines.append(engine)
        got = [r.token_ids for r in engine.generate(batch, params)]
        results.append(got)
    assert results[1] == results[0] and results[2] == results[0]
    for tokens in results[0]:
        thinking, end, answer = tokens[:budget], tokens[budget], tokens[budget + 1:]
        assert END not in thinking and 1 not in thinking and end == END
        text = bytes(t - 3 for t in answer if t >= 3).decode()
        assert json.loads(text).keys() == {"v"} and answer[-1] == 1  # valid JSON, then eos


def test_logprobs_stay_raw_under_processing(engines: list[LLMEngine]) -> None:
    loaded, _ = tiny_loaded("llama")
    engine = tiny_engine(loaded)
    engines.append(engine)
    batch = prompts(2)
    plain = engine.generate(batch, SamplingParams(max_tokens=1, temperature=0.0, logprobs=3))
    biased = engine.generate(batch, [SamplingParams(max_tokens=1, temperature=0.0, logprobs=3,
                                                    logit_bias=((r.token_ids[0], -100.0),)) for r in plain])
    for p, b in zip(plain, biased, strict=True):
        assert b.token_ids != p.token_ids  # the bias moved the choice ...
        assert [t for t, _ in b.logprobs[0].top] == [t for t, _ in p.logprobs[0].top]  # ... not the logprobs
        assert [lp for _, lp in b.logprobs[0].top] == pytest.approx([lp for _, lp in p.logprobs[0].top], abs=1e-5)




def test_prompt_logprobs_match_transformers_across_chunks_and_a_warm_cache(engines: list[LLMEngine]) -> None:
    import torch

    loaded, hf = tiny_loaded("llama")
    prompt = prompts(1, lo=30, hi=31)[0]
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [P, vocab]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    for config in [dict(), dict(max_num_batched_tokens=7)]:  # one chunk, or five
        engine = tiny_engine(loaded, **config)
        engines.append(engine)
        for _ in range(2):  # the second time its blocks are cached: every position is still computed
            outputs: list[Any] = []
            engine.generate([prompt], params, on_output=outputs.append)
            got = outputs[0].prompt_logprobs
            assert [lp.token_id for lp in got] == prompt[1:]
            for pos, lp in enumerate(got):
                assert lp.logprob == pytest.approx(float(reference[pos, prompt[pos + 1]]), abs=1e-4)
                assert [t for t, _ in lp.top] == reference[pos].topk(2).indices.tolist()
            assert all(o.prompt_logprobs is None for o in outputs[1:])
