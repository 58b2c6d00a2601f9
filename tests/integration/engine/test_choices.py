"""n > 1 choices in one engine: the prompt computed once, each choice its own seed stream and state."""

from __future__ import annotations

from dataclasses import replace

from shared.engine.request import SamplingParams
from tests.integration.engine.test_spec_decode import prompts


def test_choices_equal_single_requests_with_consecutive_seeds(make_tiny) -> None:
    engine, _ = make_tiny("llama")
    batch = prompts(3, lo=20, hi=40)  # several full blocks of 4 tokens each
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=3, logprobs=1)
    got = engine.generate(batch, params)
    assert len(got) == 9
    reference, _ = make_tiny("llama", enable_prefix_caching=False)
    for p, prompt in enumerate(batch):
        for i in range(3):
            alone = reference.generate([prompt], replace(params, n=1, seed=7 + i))[0]
            assert got[3 * p + i].token_ids == alone.token_ids, (p, i)
            assert [lp.token_id for lp in got[3 * p + i].logprobs] == alone.token_ids
    # followers found the holder's full prompt blocks computed: only the last partial block is theirs
    for p, prompt in enumerate(batch):
        followers = got[3 * p + 1 : 3 * p + 3]
        assert all(r.num_cached_tokens == (len(prompt) - 1) // 4 * 4 for r in followers), p


def test_greedy_choices_agree_and_speculation_keeps_them(make_tiny) -> None:
    batch = prompts(2)
    plain, _ = make_tiny("llama")
    single = [r.token_ids for r in plain.generate(batch, SamplingParams(max_tokens=16, temperature=0.0))]
    spec, _ = make_tiny("llama", spec_method="ngram", async_scheduling=True)
    got = spec.generate(batch, SamplingParams(max_tokens=16, temperature=0.0, n=2))
    assert [r.token_ids for r in got] == [single[0], single[0], single[1], single[1]]


def test_aborting_one_choice_or_all(make_tiny) -> None:
    engine, _ = make_tiny("llama")
    prompt = prompts(1, lo=30, hi=31)[0]
    engine.add_request("r", prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=1, n=3))
    outs = engine.step()
    assert engine.abort("r#1")  # one choice
    seen: dict[int, list[int]] = {}
    finish: dict[int, str | None] = {}
    for _ in range(3):
        outs += engine.step()
    assert engine.abort("r")  # the rest
    assert not engine.abort("r") and not engine.has_unfinished()
    for out in outs:
        assert out.request_id == "r"
        seen.setdefault(out.index, []).extend(out.new_token_ids)
        if out.finished:
            finish[out.index] = out.finish_reason
    assert set(seen) <= {0, 1, 2} and not finish  # aborted choices end in the engine without an output
