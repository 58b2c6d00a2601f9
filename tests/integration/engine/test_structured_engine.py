"""Grammar-constrained generation in the engine: valid output, identical on every path.

A tiny random model over the byte-level tokenizer writes whatever its weights favour, so every
constrained output here is the grammar's doing. Greedy constrained output must be the same token
for token with the synchronous and the zero-bubble loop, with n-gram, draft-model and draft-tree
speculation, across a prefill -> decode handoff, and through preemption; each test checks that the
path it names really ran (drafts verified, requests preempted).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.errors import InvalidRequestError
from shared.spec.speculator import Speculator
from shared.structured.spec import GrammarSpec
from tests.helpers.models import tiny_engine, tiny_loaded_with_tokenizer
from tests.helpers.tokenizers import SPECIALS, byte_tokenizer
from tests.integration.engine.test_spec_tree import TREE, TreeOracle

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "tags", "n", "ok"],
    "additionalProperties": False,
}
SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))
TEXTS = ["hello world", "abc", "The quick brown fox jumps", "x", "{[", "0123456789" * 3]

SPECIALS_IDS = range(len(SPECIALS))

MakeEngine = Callable[..., LLMEngine]


@pytest.fixture
def make(engines: list[LLMEngine]) -> Callable[..., LLMEngine]:
    loaded = {family: tiny_loaded_with_tokenizer(family)[0] for family in ("llama", "gemma3")}

    def build(family: str = "llama", **config: Any) -> LLMEngine:
        engine = tiny_engine(loaded[family], **config)
        engines.append(engine)
        return engine

    return build


def prompts() -> list[list[int]]:
    return [list(byte_tokenizer()(t, add_special_tokens=False).input_ids) for t in TEXTS]


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=120, temperature=0.0, structured=SPEC, **kw)


def texts(results: list[Any]) -> list[str]:
    """The outputs as text. xgrammar's character classes take a UTF-8-encoded surrogate (ED A0..BF xx) for
    one character, as JSON's \\uD800 escapes do: a byte-level random model sampled hot writes some, so they
    decode as the one character the grammar counted."""
    specials = set(SPECIALS_IDS)
    raw = [bytes(t - 3 for t in r.token_ids if t not in specials) for r in results]
    # an output cut at max_tokens may end inside a character
    return [b.decode("utf-8", "surrogatepass" if r.finish_reason == "stop" else "replace")
            for b, r in zip(raw, results, strict=True)]


def check_valid(results: list[Any]) -> None:
    for r, text in zip(results, texts(results), strict=True):
        assert r.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_constrained_greedy_is_valid_and_identical_across_loops_and_speculation(make: MakeEngine, family: str) -> None:
    batch = prompts()
    expected = make(family, grammar_fast_forward=False).generate(batch, greedy())
    check_valid(expected)
    tokens = [r.token_ids for r in expected]
    for config in [dict(async_scheduling=True), dict(spec_method="ngram", num_speculative_tokens=4),
                   dict(spec_method="ngram", async_scheduling=True, max_num_batched_tokens=12),
                   dict(spec_method="draft", spec_draft_num_layers=1)]:
        engine = make(family, **config)
        assert [r.token_ids for r in engine.generate(batch, greedy())] == tokens, config
        if engine.config.spec_method != "none":
            assert engine.speculator is not None and engine.speculator.stats.num_draft_tokens > 0, config


def test_drafts_against_the_grammar_are_rejected_and_valid_ones_accepted(make: MakeEngine) -> None:
    """An oracle drafts the true constrained continuation as a tree, wrong guesses beside it: the
    grammar's masks at every node must accept exactly the true branch."""
    batch = prompts()[:3]
    plain = make()
    n = 40
    continuations = [p + r.token_ids for p, r in zip(batch, plain.generate(batch, greedy()), strict=True)]
    spec = make(spec_method="ngram")
    oracle = TreeOracle([c + [1] * 8 for c in continuations], spec.loaded.spec.vocab_size)
    spec.speculator = Speculator(oracle, 3, spec.max_model_len, spec.loaded.spec.vocab_size, tree=TREE)
    got = spec.generate(batch, SamplingParams(max_tokens=n, temperature=0.0, structured=SPEC))
    assert [r.token_ids for r in got] == [c[len(p) : len(p) + n] for p, c in zip(batch, continuations, strict=True)]
    assert spec.speculator.stats.num_accepted_tokens == sum(oracle.expected_accepted) > 0


def test_handoff_continues_the_grammar_where_prefill_stopped(make: MakeEngine) -> None:
    batch = prompts()
    params = [greedy(), SamplingParams(max_tokens=120, temperature=1.0, seed=3, structured=SPEC)] * 3
    expected = make().generate(batch, params)
    prefill, decode = make(role="prefill"), make(role="decode")
    handoffs = prefill.generate(batch, params)
    for i, (h, p) in enumerate(zip(handoffs, params, strict=True)):
        assert h.handoff is not None
        assert decode.add_handoff(f"d{i}", p, h.handoff) is None
    results = decode.run_to_completion()
    got = [[handoffs[i].handoff.first_token_id] + results[f"d{i}"].token_ids for i in range(len(batch))]
    assert got == [r.token_ids for r in expected]
    check_valid(expected)


def test_preempted_requests_resume_under_the_same_grammar(make: MakeEngine) -> None:
    batch = prompts()
    expected = [r.token_ids for r in make().generate(batch, greedy())]
    for config in [dict(), dict(async_scheduling=True), dict(spec_method="ngram", async_scheduling=True)]:
        tight = make(num_kv_blocks=40, max_model_len=160, **config)  # 160 slots for six requests of up to 150
        assert [r.token_ids for r in tight.generate(batch, greedy())] == expected, config
        assert tight.scheduler.num_preemptions_total > 0, config


def test_sampled_constrained_output_is_valid_and_seeded(make: MakeEngine) -> None:
    batch = prompts()
    params = [SamplingParams(max_tokens=120, temperature=1.5, top_p=0.95, seed=i, structured=SPEC)
              for i in range(len(batch))]
    check_valid(make().generate(batch, params))
    # speculation keeps the distribution, not the draws: a seeded run repeats on the same path
    spec = make(spec_method="ngram", async_scheduling=True)
    first = spec.generate(batch, params)
    check_valid(first)
    assert [r.token_ids for r in spec.generate(batch, params)] == [r.token_ids for r in first]


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        (GrammarSpec("regex", r"[a-c]{2,5}-\d\d"), lambda s: len(s.split("-")[1]) == 2),
        (GrammarSpec("choice", '["alpha", "beta gamma"]'), lambda s: s in ("alpha", "beta gamma")),
        (GrammarSpec("ebnf", 'root ::= "(" [0-9] [0-9]? ("," [0-9])? ")"'), lambda s: s[0] + s[-1] == "()"),
        (GrammarSpec("json_object"), lambda s: isinstance(json.loads(s), dict)),
    ],
)
def test_every_kind_constrains_the_output(make: MakeEngine, spec: GrammarSpec, check: Callable[[str], bool]) -> None:
    engine = make()
    results = engine.generate(prompts(), SamplingParams(max_tokens=60, temperature=0.0, structured=spec))
    for r, text in zip(results, texts(results), strict=True):
        matcher = engine.grammars.new_state("check", SamplingParams(structured=spec), []).matcher
        assert matcher is not None and all(matcher.accept_token(t) for t in r.token_ids), text  # in its language
        if r.finish_reason == "stop":  # finished: the whole of a sentence of it
            assert check(text), (spec.kind, text)
    assert any(r.finish_reason == "stop" for r in results)


def test_a_bad_grammar_is_refused_before_the_request_runs(make: MakeEngine) -> None:
    engine = make()
    with pytest.raises(InvalidRequestError, match="does not compile"):
        engine.add_request("bad", prompts()[0], SamplingParams(structured=GrammarSpec("regex", "(x")))
    assert not engine.has_unfinished()


def test_fast_forward_drafts_what_the_grammar_forces_and_changes_nothing(make: MakeEngine) -> None:
    batch = prompts()
    expected = [r.token_ids for r in make(grammar_fast_forward=False).generate(batch, greedy())]
    for config in [dict(), dict(spec_method="ngram"), dict(async_scheduling=True)]:
        engine = make(**config, grammar_fast_forward_max_batch=len(batch))
        assert [r.token_ids for r in engine.generate(batch, greedy())] == expected, config
        stats = engine.speculator.stats if engine.speculator is not None else None
        assert stats is not None
        if not config.get("async_scheduling"):  # its requests always have a step in flight: no fast-forward
            # every key of the schema is forced text: most of it came as drafts and was accepted
            assert stats.num_forced_drafts > 20 * len(batch), config
            assert stats.num_accepted_tokens >= stats.num_forced_drafts * 0.9, config


def test_fast_forward_waits_while_the_batch_is_over_its_limit(make: MakeEngine) -> None:
    """Over grammar_fast_forward_max_batch decoding requests a step drafts nothing (forced drafts would make it
    compute-bound); as requests finish and the batch shrinks, fast-forward resumes. Output unchanged."""
    batch = prompts()
    expected = [r.token_ids for r in make(grammar_fast_forward=False).generate(batch, greedy())]
    never = make(grammar_fast_forward_max_batch=0)
    assert [r.token_ids for r in never.generate(batch, greedy())] == expected
    assert never.speculator is not None and never.speculator.stats.num_forced_drafts == 0
    alone = make(grammar_fast_forward_max_batch=1)
    assert [r.token_ids for r in alone.generate(batch[:1], greedy())] == expected[:1]
    assert alone.speculator is not None and alone.speculator.stats.num_forced_drafts > 20


def test_a_seeded_sampled_request_is_not_fast_forwarded(make: MakeEngine) -> None:
    """A seeded request's tokens must not depend on whether a step fast-forwards (that depends on the batch
    of the moment, so on timing across a handoff): it decodes token by token and gives the tokens of an
    engine with fast-forward off. Unseeded sampled requests still fast-forward."""
    batch = prompts()[:2]
    seeded = [SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured=SPEC) for i in range(len(batch))]
    expected = [r.token_ids for r in make(grammar_fast_forward=False).generate(batch, seeded)]
    engine = make(grammar_fast_forward_max_batch=len(batch))
    assert [r.token_ids for r in engine.generate(batch, seeded)] == expected
    assert engine.speculator is not None and engine.speculator.stats.num_forced_drafts == 0
    engine.generate(batch, [SamplingParams(max_tokens=120, temperature=1.0, structured=SPEC) for _ in batch])
    assert engine.speculator.stats.num_forced_drafts > 0


@pytest.mark.parametrize("choice", ["\x94", "é-x", "€€"])
def test_fast_forward_inside_a_character_drafts_nothing_and_finishes(make: MakeEngine, choice: str) -> None:
    """The first token (sampled on prefill) can be the lead byte of a character: what the grammar
    forces next starts inside it, which xgrammar's jump-forward string cannot decode (found by the
    API fuzz test as a 500 on `choice: ["\\x94"]`). The rest comes token by token, still exact."""
    spec = GrammarSpec("choice", json.dumps([choice]))
    results = make().generate(prompts()[:2], SamplingParams(max_tokens=20, temperature=0.0, structured=spec))
    assert [(t, r.finish_reason) for t, r in zip(texts(results), results, strict=True)] == [(choice, "stop")] * 2


@pytest.mark.parametrize("cut", [1, 7, 30])
def test_a_resumed_request_continues_the_grammar_and_the_penalties(make: MakeEngine, cut: int) -> None:
    """Request migration: a request re-admitted with the tokens it had already streamed as its output
    ends exactly as the run that never stopped (grammar, penalties and max_tokens all count them)."""
    batch = prompts()
    params = greedy(frequency_penalty=0.5, presence_penalty=0.3)
    expected = [r.token_ids for r in make().generate(batch, params)]
    for config in [dict(), dict(async_scheduling=True, spec_method="ngram")]:
        engine = make(**config)
        for i, (prompt, tokens) in enumerate(zip(batch, expected, strict=True)):
            engine.add_request(f"r{i}", prompt, params, tokens[:cut])
        results = engine.run_to_completion()
        got = [expected[i][:cut] + results[f"r{i}"].token_ids for i in range(len(batch))]
        assert got == expected, config
        assert engine.num_free_kv_blocks == engine.num_kv_blocks


def test_a_resumed_request_is_refused_when_its_output_is_already_complete(make: MakeEngine) -> None:
    engine = make()
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0), [9, 9, 9])
    with pytest.raises(InvalidRequestError, match="n=1"):
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=8, n=2), [9])
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=8), [10**6])
