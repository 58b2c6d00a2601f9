"""Speculative decoding in the engine: exactness against plain decoding, stops, sampling, fallbacks.

Tiny random models repeat themselves soon enough that the n-gram proposer
finds matches; each test checks that drafts were really verified, so a test
cannot pass by never speculating.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from shared.engine.request import SamplingParams
from shared.spec.ngram import NgramProposer
from shared.spec.proposer import ProposalInput
from tests.helpers.models import tiny_engine, tiny_loaded

FAMILIES = ["llama", "gemma3"]


def prompts(n: int, seed: int = 1, lo: int = 3, hi: int = 40) -> list[list[int]]:
    """Random prompts, every other one with a repeated phrase (n-gram food)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    out = []
    for i, n_ in enumerate(lens):
        p = torch.randint(2, 256, (n_,), generator=g).tolist()
        out.append(p + p[:8] if i % 2 else p)
    return out


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, **kw)  # type: ignore[arg-type]


def spec_stats(engine):  # type: ignore[no-untyped-def]
    assert engine.speculator is not None
    return engine.speculator.stats


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_ngram_equals_plain_with_chunked_prefill_and_prefix_hits(make_tiny, family: str) -> None:
    batch = prompts(8)
    plain, _ = make_tiny(family)
    expected = [r.token_ids for r in plain.generate(batch, greedy(40))]
    spec, _ = make_tiny(family, spec_method="ngram", num_speculative_tokens=4, max_num_batched_tokens=10)
    assert [r.token_ids for r in spec.generate(batch, greedy(40))] == expected
    again = spec.generate(batch, greedy(40))  # full prompt blocks now come from the prefix cache
    assert [r.token_ids for r in again] == expected
    assert sum(r.num_cached_tokens for r in again) > 0
    stats = spec_stats(spec)
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[-1]


def test_stop_ids_eos_and_max_tokens_apply_to_accepted_tokens_in_order(make_tiny) -> None:
    batch = prompts(6)
    plain, _ = make_tiny("llama")
    spec, _ = make_tiny("llama", spec_method="ngram", num_speculative_tokens=5)
    free_run = [r.token_ids for r in plain.generate(batch, greedy(48))]
    # stop on a token that appears mid-way; odd max_tokens; eos allowed (min_tokens 0)
    cases = [
        SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=(toks[20],)) for toks in free_run
    ] + [SamplingParams(max_tokens=n, temperature=0.0) for n in (1, 2, 7)]
    all_prompts = batch + batch[:3]
    expected = plain.generate(all_prompts, cases)
    got = spec.generate(all_prompts, cases)
    assert [(r.token_ids, r.finish_reason) for r in got] == [(r.token_ids, r.finish_reason) for r in expected]
    assert spec_stats(spec).num_accepted_tokens > 0


def test_logprobs_of_verified_tokens_match_plain(make_tiny) -> None:
    batch = prompts(4)
    params = greedy(24, logprobs=3)
    plain, _ = make_tiny("llama")
    spec, _ = make_tiny("llama", spec_method="ngram")
    expected = plain.generate(batch, params)
    got = spec.generate(batch, params)
    for e, g in zip(expected, got, strict=True):
        assert g.token_ids == e.token_ids
        assert [lp.token_id for lp in g.logprobs] == g.token_ids
        torch.testing.assert_close([lp.logprob for lp in g.logprobs], [lp.logprob for lp in e.logprobs],
                                   atol=1e-4, rtol=1e-4)
        assert [[t for t, _ in lp.top] for lp in g.logprobs] == [[t for t, _ in lp.top] for lp in e.logprobs]
    assert spec_stats(spec).num_accepted_tokens > 0


def test_seeded_sampling_is_reproducible_and_batch_invariant(make_tiny) -> None:
    batch = prompts(6)
    params = [SamplingParams(max_tokens=32, temperature=0.8, top_k=20, top_p=0.9, seed=100 + i) for i in range(6)]
    engine, _ = make_tiny("llama", spec_method="ngram", num_speculative_tokens=4)
    first = [r.token_ids for r in engine.generate(batch, params)]
    again = [r.token_ids for r in engine.generate(batch, params)]
    alone = [engine.generate([p], [sp])[0].token_ids for p, sp in zip(batch, params, strict=True)]
    assert first == again == alone
    assert all(0 <= t < 256 for toks in first for t in toks)
    assert spec_stats(engine).num_verifications > 0


def test_low_temperature_sampling_accepts_drafts(make_tiny) -> None:
    engine, _ = make_tiny("llama", spec_method="ngram")
    engine.generate(prompts(4), SamplingParams(max_tokens=32, temperature=0.05, seed=3))
    assert spec_stats(engine).num_accepted_tokens > 0


def test_per_request_switch_off_and_cap(make_tiny) -> None:
    batch = prompts(4)
    engine, _ = make_tiny("llama", spec_method="ngram", num_speculative_tokens=4)
    engine.generate(batch, greedy(24, num_speculative_tokens=0))
    assert spec_stats(engine).num_verifications == 0
    engine.generate(batch, greedy(24, num_speculative_tokens=1))
    stats = spec_stats(engine)
    assert stats.num_verifications > 0 and stats.num_draft_tokens == stats.num_verifications
    assert stats.accepted_per_position[1:] == [0, 0, 0]


class FailingFor(NgramProposer):
    """The n-gram proposer, except that it raises whenever one given request is in the batch."""

    def __init__(self, bad_request_id: str) -> None:
        super().__init__()
        self.bad_request_id = bad_request_id

    def propose(self, requests: Sequence[ProposalInput]) -> list[list[int]]:
        if any(r.request_id == self.bad_request_id for r in requests):
            raise RuntimeError("proposer broke")
        return super().propose(requests)


def test_proposer_failure_falls_back_to_plain_decoding_for_that_request(make_tiny) -> None:
    batch = prompts(4)
    plain, _ = make_tiny("llama")
    expected = [r.token_ids for r in plain.generate(batch, greedy(32))]
    engine, _ = make_tiny("llama", spec_method="ngram")
    assert engine.speculator is not None
    engine.speculator.proposer = FailingFor(bad_request_id=f"gen-{engine._arrivals + 1}")
    results = engine.generate(batch, greedy(32))
    assert [r.token_ids for r in results] == expected
    stats = spec_stats(engine)
    assert stats.num_fallbacks == 1
    assert stats.num_accepted_tokens > 0  # the other requests kept speculating


def test_preemption_with_speculation_recomputes_to_the_same_tokens(make_tiny) -> None:
    batch = prompts(8, lo=10, hi=20)
    roomy, _ = make_tiny("llama")
    expected = [r.token_ids for r in roomy.generate(batch, greedy(30))]
    tight, _ = make_tiny("llama", num_kv_blocks=40, max_model_len=128, spec_method="ngram", num_speculative_tokens=4)
    got = [r.token_ids for r in tight.generate(batch, greedy(30))]
    assert got == expected
    assert spec_stats(tight).num_accepted_tokens > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_handoff_to_speculating_decode_equals_colocated(make_tiny, engines, family: str) -> None:
    batch = prompts(4)
    colocated, _ = make_tiny(family)
    expected = [r.token_ids for r in colocated.generate(batch, greedy(24))]
    loaded, _ = tiny_loaded(family)
    prefill = tiny_engine(loaded, role="prefill")
    decode = tiny_engine(loaded, role="decode", spec_method="ngram", num_speculative_tokens=4)
    engines.extend([prefill, decode])
    handoffs = prefill.generate(batch, greedy(24))
    for i, res in enumerate(handoffs):
        assert res.handoff is not None
        assert decode.add_handoff(f"d{i}", greedy(24), res.handoff) is None
    results = decode.run_to_completion()
    got = [[handoffs[i].token_ids[0]] + results[f"d{i}"].token_ids for i in range(len(batch))]
    assert got == expected
    assert spec_stats(decode).num_accepted_tokens > 0


def test_large_batches_decode_without_drafts_until_the_batch_shrinks(make_tiny) -> None:
    """spec_disable_batch_size 2: with 6 requests decoding no step verifies drafts; as requests finish (short
    max_tokens first) the rest speculate again. Output equals plain decoding either way."""
    batch = prompts(6)
    params = [greedy(n) for n in (4, 6, 8, 10, 40, 40)]
    plain, _ = make_tiny("llama")
    expected = [r.token_ids for r in plain.generate(batch, params)]
    spec, _ = make_tiny("llama", spec_method="ngram", num_speculative_tokens=4, spec_disable_batch_size=2)
    assert [r.token_ids for r in spec.generate(batch, params)] == expected
    stats = spec_stats(spec)
    assert stats.num_steps_over_batch_limit >= 8  # at least until the 10-token request is done
    assert stats.num_verifications > 0 and stats.num_accepted_tokens > 0  # the last two speculated
    # the limit counts requests decoding, not requests wanting drafts: a batch at the limit speculates
    at_limit, _ = make_tiny("llama", spec_method="ngram", num_speculative_tokens=4, spec_disable_batch_size=6)
    assert [r.token_ids for r in at_limit.generate(batch, params)] == expected
    assert spec_stats(at_limit).num_steps_over_batch_limit == 0 and spec_stats(at_limit).num_verifications > 0


def test_spec_disable_batch_size_must_be_positive() -> None:
    from shared.engine.config import EngineConfig

    with pytest.raises(ValueError, match="spec_disable_batch_size"):
        EngineConfig(model="x", spec_method="ngram", spec_disable_batch_size=0)
