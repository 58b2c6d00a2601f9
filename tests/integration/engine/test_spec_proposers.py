"""Draft-model and EAGLE proposers inside the engine, on tiny random models."""

from __future__ import annotations

import pytest

from shared.engine.request import SamplingParams
from tests.helpers.models import tiny_engine, tiny_loaded
from tests.integration.engine.test_spec_decode import greedy, prompts, spec_stats


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_draft_equal_to_the_target_accepts_every_draft(make_tiny, family: str) -> None:
    """A draft with all the target's layers is the target: every draft must pass (its KV is right)."""
    batch = prompts(5)
    plain, _ = make_tiny(family)
    expected = [r.token_ids for r in plain.generate(batch, greedy(30))]
    num_layers = plain.loaded.spec.num_layers
    spec, _ = make_tiny(family, spec_method="draft", spec_draft_num_layers=num_layers, num_speculative_tokens=3,
                        max_num_batched_tokens=12)
    assert [r.token_ids for r in spec.generate(batch, greedy(30))] == expected
    stats = spec_stats(spec)
    assert stats.num_verifications > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_truncated_draft_greedy_equals_plain_and_sampling_runs(make_tiny) -> None:
    batch = prompts(6)
    plain, _ = make_tiny("llama")
    expected = [r.token_ids for r in plain.generate(batch, greedy(32))]
    spec, _ = make_tiny("llama", spec_method="draft", spec_draft_num_layers=1, num_speculative_tokens=4)
    assert [r.token_ids for r in spec.generate(batch, greedy(32))] == expected
    sampled = spec.generate(batch, SamplingParams(max_tokens=24, temperature=0.7, seed=5))
    assert all(len(r.token_ids) >= 1 for r in sampled)
    assert spec_stats(spec).num_verifications > 0


def test_draft_in_decode_role_after_handoff(make_tiny, engines) -> None:
    batch = prompts(4)
    colocated, _ = make_tiny("llama")
    expected = [r.token_ids for r in colocated.generate(batch, greedy(20))]
    loaded, _ = tiny_loaded("llama")
    prefill = tiny_engine(loaded, role="prefill")
    decode = tiny_engine(loaded, role="decode", spec_method="draft", spec_draft_num_layers=2)
    engines.extend([prefill, decode])
    handoffs = prefill.generate(batch, greedy(20))
    for i, res in enumerate(handoffs):
        assert res.handoff is not None
        decode.add_handoff(f"d{i}", greedy(20), res.handoff)
    results = decode.run_to_completion()
    assert [[handoffs[i].token_ids[0]] + results[f"d{i}"].token_ids for i in range(4)] == expected
    stats = spec_stats(decode)
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def _random_head(engine, path, draft_vocab: int | None = None):  # type: ignore[no-untyped-def]
    import torch

    from shared.spec.eagle_head import EagleHead, EagleHeadConfig

    model = engine.loaded.model
    ids = torch.arange(draft_vocab) if draft_vocab is not None else None
    head = EagleHead(EagleHeadConfig.from_decoder_spec(model.spec), model.embed, model.embed,
                     generator=torch.Generator().manual_seed(0), draft_token_ids=ids)
    head.save(path)
    return path


@pytest.mark.parametrize(("draft_vocab", "tree"), [(None, None), (64, None), (None, "0;1;2;0.0;1.0;0.0.0"),
                                                   (64, "0;1;0.0;0.1")])
def test_eagle_greedy_equals_plain_colocated_and_after_handoff(make_tiny, engines, tmp_path, draft_vocab,
                                                               tree) -> None:
    """An untrained head proposes poorly, yet output is exact and hidden states line up in both roles, with
    chains and with trees (a token budget of 16 cuts some trees short)."""
    batch = prompts(4)
    plain, _ = make_tiny("llama")
    expected = [r.token_ids for r in plain.generate(batch, greedy(24))]
    head_path = _random_head(plain, tmp_path / "head.safetensors", draft_vocab)
    colocated, _ = make_tiny("llama", spec_method="eagle", spec_eagle_head=head_path, max_num_batched_tokens=16,
                             spec_tree=tree)
    assert [r.token_ids for r in colocated.generate(batch, greedy(24))] == expected
    assert spec_stats(colocated).num_verifications > 0

    loaded, _ = tiny_loaded("llama")
    prefill = tiny_engine(loaded, role="prefill")
    decode = tiny_engine(loaded, role="decode", spec_method="eagle", spec_eagle_head=head_path, spec_tree=tree)
    engines.extend([prefill, decode])
    handoffs = prefill.generate(batch, greedy(24))
    for i, res in enumerate(handoffs):
        assert res.handoff is not None
        decode.add_handoff(f"d{i}", greedy(24), res.handoff)
    first = {out.request_id: out.new_token_ids for out in decode.step()}
    # the very first decode step drafts from the handoff's prompt hidden states
    assert spec_stats(decode).num_verifications == 4
    results = decode.run_to_completion()
    got = [[handoffs[i].token_ids[0]] + first[f"d{i}"] + results[f"d{i}"].token_ids for i in range(4)]
    assert got == expected
