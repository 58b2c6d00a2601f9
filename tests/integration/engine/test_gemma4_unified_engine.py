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
from shared.multimodal.items import MediaItem
from shared.multimodal.media import content_hash
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


def test_make_tiny_unified_checkpoint_serves_media(engines, tmp_path) -> None:
    """`baton make-tiny gemma4 --unified --vision --audio`, loaded as a user would: the loader picks the unified
    processor and embedders by the config's model type, with the published token ids and vocabulary."""
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.models.gemma4.unified_media import Gemma4UnifiedEncoders
    from shared.multimodal.unified_processor import Gemma4UnifiedMediaProcessor
    from tests.helpers.gemma4 import hf_from_checkpoint, tiny_gemma4_checkpoint

    path = tiny_gemma4_checkpoint(tmp_path / "tiny", unified=True, vision=True, audio=True, moe=False, ple_size=0,
                                  num_layers=4)
    engine = LLMEngine(EngineConfig(model=str(path), max_model_len=512, kv_cache_bytes=16 << 20,
                                    max_num_batched_tokens=32))
    engines.append(engine)
    encoder, mm = engine.loaded.media_encoder, engine.loaded.multimodal
    assert isinstance(encoder.encoders, Gemma4UnifiedEncoders)
    assert isinstance(encoder.processor, Gemma4UnifiedMediaProcessor)
    assert mm.bidirectional_every_layer and engine.runner.bidirectional_every_layer
    hf = hf_from_checkpoint(path)
    assert mm.image_token_id == hf.config.image_token_id > 256_000  # the published ids
    proc = encoder.processor
    wave = random_wave(0.2, seed=6)
    ids, items = [2, 1000, 2000], []
    for kind, data, n in [("image", image_bytes(20, 52, seed=5), proc.image_tokens(20, 52)),
                          ("audio", wav_bytes(wave), proc.audio_tokens(len(wave)))]:
        begin, token, end = ((mm.boi_token_id, mm.image_token_id, mm.eoi_token_id) if kind == "image"
                             else (mm.boa_token_id, mm.audio_token_id, mm.eoa_token_id))
        ids.append(begin)
        items.append(MediaItem(kind, len(ids), n, content_hash(data), data, "wav" if kind == "audio" else ""))
        ids += [token] * n + [end]
    ids += [3000, 4000]
    result = engine.generate([ids], GREEDY, media=[items])[0]
    _check(result, hf_unified_greedy(hf, ids, [random_image(20, 52, seed=5)], [wave], 8))


def test_in_process_handoff_carries_the_media(engines, models) -> None:
    """Prefill encodes and computes the prompt (the image seen both ways on every layer); decode continues from
    the handed-off KV without encoding anything."""
    loaded, hf = models
    prefill = tiny_engine(loaded, role="prefill")
    decode = tiny_engine(loaded, role="decode")
    engines.extend([prefill, decode])
    proc = unified_processor()
    wave = random_wave(0.2, seed=7)
    ids, items = mm_prompt([2, 17], [("image", image_bytes(30, 30, seed=4), proc.image_tokens(30, 30)),
                                     ("audio", wav_bytes(wave), proc.audio_tokens(len(wave)))], [61, 7])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    handoff = prefill.generate([ids], params, media=[items])[0].handoff
    assert handoff is not None and handoff.media == tuple(items)
    encoded = loaded.media_encoder.num_encoded
    assert decode.add_handoff("d", params, handoff) is None
    results = decode.run_to_completion()
    assert loaded.media_encoder.num_encoded == encoded  # decode read the KV, not the media
    tokens, _ = hf_unified_greedy(hf, ids, [random_image(30, 30, seed=4)], [wave], 8)
    assert [handoff.first_token_id, *results["d"].token_ids] == tokens
