"""gemma4_unified's images and audio through the engine: greedy tokens equal transformers' `generate`.

The engine encodes each prompt's media at intake with the unified processor and
embedders (shared/multimodal/loading.py picks them by the config's model type),
merges the soft tokens chunk by chunk (a small token budget splits the prompt,
never an image) and lets an image's tokens see each other on every layer. The
tiny model's greedy winners are wide apart, so each token's logprob is compared
too: Gemma 4's sliding-only mask moves them by ~3e-3, past the tolerance.
"""

from __future__ import annotations

import pytest

from shared.engine.engine import GenerationResult
from shared.engine.request import SamplingParams
from tests.helpers.gemma4_mm import image_bytes, mm_prompt, random_image, random_wave, wav_bytes
from tests.helpers.gemma4_unified_mm import hf_unified_greedy, tiny_unified_loaded, unified_processor
from tests.helpers.models import tiny_engine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def models() -> tuple:
    return tiny_unified_loaded()


def _check(result: GenerationResult, expected: tuple[list[int], list[float]]) -> None:
    tokens, logprobs = expected
    assert result.token_ids == tokens
    assert [lp.logprob for lp in result.logprobs] == pytest.approx(logprobs, abs=1e-4)


@pytest.mark.parametrize("budget", [16, 512], ids=["chunked", "whole"])
def test_image_and_audio_prompts_match_transformers(engines, models, budget: int) -> None:
    loaded, hf = models
    engine = tiny_engine(loaded, max_num_batched_tokens=budget)
    engines.append(engine)
    assert engine.runner.bidirectional_every_layer
    proc = unified_processor()
    img_ids, img_items = mm_prompt([2, 17, 99], [("image", image_bytes(40, 28, seed=3), proc.image_tokens(40, 28))],
                                   [61, 7, 33])
    wave = random_wave(0.3, seed=2)
    aud_ids, aud_items = mm_prompt([2, 40], [("audio", wav_bytes(wave), proc.audio_tokens(len(wave)))], [5, 6])
    both_ids, both_items = mm_prompt([2], [("image", image_bytes(30, 30, seed=4), proc.image_tokens(30, 30)),
                                           ("audio", wav_bytes(wave), proc.audio_tokens(len(wave)))], [8, 9])
    results = engine.generate([img_ids, aud_ids, both_ids], GREEDY, media=[img_items, aud_items, both_items])
    _check(results[0], hf_unified_greedy(hf, img_ids, [random_image(40, 28, seed=3)], [], 8))
    _check(results[1], hf_unified_greedy(hf, aud_ids, [], [wave], 8))
    _check(results[2], hf_unified_greedy(hf, both_ids, [random_image(30, 30, seed=4)], [wave], 8))
    assert loaded.media_encoder.num_encoded >= 3
