"""User requests the packaged SmolLM2 writes itself (train-draft's Magpie prompts)."""

from __future__ import annotations

import pytest

from shared.errors import ConfigError
from shared.spec.synth_prompts import MIN_WORDS, synthesize_requests, user_turn_prefix
from shared.tokenizer import encode_prompt
from tests.helpers.models import packaged, packaged_engine

pytestmark = pytest.mark.slow


def test_the_prefix_is_the_template_up_to_the_users_message() -> None:
    tokenizer = packaged("smollm2-135m").tokenizer
    prefix = user_turn_prefix(tokenizer)
    full = encode_prompt(tokenizer, "Hello there", chat=True)
    assert full[: len(prefix)] == prefix
    assert tokenizer.decode(full[len(prefix) :]).startswith("Hello there")


def test_synthesized_requests_are_distinct_and_whole(engines) -> None:
    engine = packaged_engine("smollm2-135m")
    engines.append(engine)
    requests = synthesize_requests(engine, 24, max_tokens=48, seed=1)
    assert 6 <= len(requests) <= 24, requests  # ~60% of samples end their turn within 48 tokens
    assert len({r.lower() for r in requests}) == len(requests)
    assert all(len(r.split()) >= MIN_WORDS and r == r.strip() for r in requests)
    # a held-out question is never a training prompt, whatever the model writes (compared without case)
    again = synthesize_requests(engine, 24, max_tokens=48, seed=1, exclude=[requests[0].upper()])
    assert again == requests[1:]


def test_a_base_model_has_no_user_turn_to_write() -> None:
    tokenizer = packaged("gemma3-270m").tokenizer
    with pytest.raises(ConfigError, match="chat template"):
        user_turn_prefix(tokenizer)
