"""Spec-decode counters as the engine services export them, and the decode service's settings."""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest

from services.decode.settings import DecodeSettings
from shared.engine.async_engine import AsyncEngine
from shared.service.engine_metrics import engine_registry
from tests.integration.engine.test_spec_decode import greedy, prompts, spec_stats


def sample(text: str, name: str) -> float:
    line = next(row for row in text.splitlines() if row.startswith(name))
    return float(line.rsplit(" ", 1)[1])


def test_spec_counters_are_exported(make_tiny) -> None:
    engine, _ = make_tiny("llama", spec_method="ngram", num_speculative_tokens=3)
    engine.generate(prompts(4), greedy(24))
    stats = spec_stats(engine)
    text = generate_latest(engine_registry(AsyncEngine(engine), "colocated")).decode()
    assert sample(text, 'baton_spec_decode_draft_tokens_total{role="colocated"}') == stats.num_draft_tokens
    assert sample(text, 'baton_spec_decode_accepted_tokens_total{role="colocated"}') == stats.num_accepted_tokens
    assert sample(text, 'baton_spec_decode_num_drafts_total{role="colocated"}') == stats.num_verifications
    assert sample(text, 'baton_spec_decode_fallbacks_total{role="colocated"}') == 0
    per_pos = [sample(text, f'baton_spec_decode_accepted_tokens_per_pos_total{{position="{j}",role="colocated"}}')
               for j in range(3)]
    assert sum(per_pos) == stats.num_accepted_tokens > 0


def test_no_spec_counters_without_speculation(make_tiny) -> None:
    engine, _ = make_tiny("llama")
    text = generate_latest(engine_registry(AsyncEngine(engine), "decode")).decode()
    assert "baton_spec_decode" not in text


def test_decode_settings_choose_the_proposer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_DECODE_SPEC", "ngram")
    monkeypatch.setenv("BATON_DECODE_NUM_SPECULATIVE_TOKENS", "5")
    config = DecodeSettings().engine_config("decode")
    assert (config.spec_method, config.num_speculative_tokens) == ("ngram", 5)
    monkeypatch.setenv("BATON_DECODE_SPEC", "medusa")
    with pytest.raises(ValueError):
        DecodeSettings()


def test_idle_ratio_counts_gaps_only_while_work_is_queued(make_tiny) -> None:
    engine, _ = make_tiny("llama")
    engine.generate(prompts(2), greedy(8))
    clock = engine.runner.clock
    busy, idle = clock.busy_s, clock.idle_s
    assert busy > 0 and 0.0 <= clock.idle_ratio < 1.0
    time.sleep(0.3)  # no work: this wait must not count
    engine.generate(prompts(1), greedy(2))
    assert clock.idle_s - idle < 0.3
    text = generate_latest(engine_registry(AsyncEngine(engine), "colocated")).decode()
    assert 0.0 <= sample(text, 'baton_engine_idle_ratio{role="colocated"}') < 1.0


def test_mask_build_and_wait_times_are_exported(make_tiny) -> None:
    from shared.engine.request import SamplingParams

    engine, _ = make_tiny("llama")
    engine.generate(prompts(2), greedy(8))
    assert engine.runner.masks.num_builds == 0  # nothing to process: no worker, no time
    engine.generate(prompts(2), SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3))
    masks = engine.runner.masks
    assert masks.num_builds >= 8 and masks.build_s > 0
    text = generate_latest(engine_registry(AsyncEngine(engine), "colocated")).decode()
    assert sample(text, 'baton_logits_mask_build_seconds_total{role="colocated"}') == pytest.approx(masks.build_s)
    assert sample(text, 'baton_logits_mask_wait_seconds_total{role="colocated"}') == pytest.approx(masks.wait_s)
