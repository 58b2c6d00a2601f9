"""Images and audio through the engine: greedy tokens equal transformers' `generate` for the same inputs.

The engine decodes and cuts each prompt's media at intake (bad media is the
caller's error there), encodes them at the step that reads them (the media of
requests in one step in one tower pass), merges the soft tokens at the
placeholders chunk by chunk (a small token budget splits prompts, never an image
whose tokens see each other), and keys prefix-cache blocks by the media's digest:
the same text with another image misses the cache, the same image hits it.
"""

from __future__ import annotations

import pytest

from shared.engine.request import SamplingParams
from shared.errors import InvalidRequestError
from tests.helpers.gemma4_mm import (
    hf_mm_greedy,
    image_bytes,
    media_processor,
    mm_prompt,
    random_image,
    random_wave,
    tiny_mm_loaded,
    wav_bytes,
)
from tests.helpers.models import tiny_engine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models() -> tuple:
    return tiny_mm_loaded("all", bidirectional=True)


def _image_prompt(size: tuple[int, int], seed: int, text: list[int]) -> tuple[list[int], list, object]:
    proc = media_processor()
    n = proc.image_tokens(*size)
    ids, items = mm_prompt([2, 17, 99], [("image", image_bytes(*size, seed=seed), n)], text)
    return ids, items, random_image(*size, seed=seed)


@pytest.mark.parametrize("budget", [16, 512], ids=["chunked", "whole"])
def test_image_and_audio_prompts_match_transformers(engines, models, budget: int) -> None:
    loaded, hf = models
    engine = tiny_engine(loaded, max_num_batched_tokens=budget)
    engines.append(engine)
    proc = media_processor()
    img_ids, img_items, img = _image_prompt((40, 28), 3, [61, 7, 33])
    wave = random_wave(0.5, seed=2)
    aud_ids, aud_items = mm_prompt([2, 40], [("audio", wav_bytes(wave), proc.audio_tokens(len(wave)))], [5, 6])
    text_only = [2, 9, 8, 7, 6, 5, 4, 3]
    results = engine.generate([img_ids, aud_ids, text_only], GREEDY, media=[img_items, aud_items, []])
    assert results[0].token_ids == hf_mm_greedy(hf, img_ids, [img], [], 8)
    assert results[1].token_ids == hf_mm_greedy(hf, aud_ids, [], [wave], 8)
    assert results[2].token_ids == hf_mm_greedy(hf, text_only, [], [], 8)


def test_media_of_requests_arriving_together_encode_in_one_pass(engines, models) -> None:
    """Images are decoded at intake and encoded at the step that reads them: requests admitted together go
    through the tower in one batch, an image two of them send is encoded once, and each greedy output still
    equals transformers'."""
    loaded, hf = models
    engine = tiny_engine(loaded, max_num_batched_tokens=512)
    engines.append(engine)
    encoder = loaded.media_encoder
    proc = media_processor()
    prompts = []  # no two share a first block: the scheduler would hold one back to reuse the other's
    for first, (size, seed) in enumerate((((40, 28), 11), ((64, 16), 12), ((40, 28), 11), ((28, 40), 13))):
        ids, items = mm_prompt([2, 20 + first, 99], [("image", image_bytes(*size, seed=seed),
                                                     proc.image_tokens(*size))], [61, 7, 33])
        prompts.append((ids, items, random_image(*size, seed=seed)))
    batches, encoded = encoder.num_batches, encoder.num_encoded
    results = engine.generate([ids for ids, _, _ in prompts], GREEDY, media=[items for _, items, _ in prompts])
    assert encoder.num_batches - batches == 1
    assert encoder.num_encoded - encoded == 3  # the repeated image once
    for (ids, _, img), result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_mm_greedy(hf, ids, [img], [], 8)


def test_a_generated_placeholder_id_is_embedded_as_the_pad_token(engines, models) -> None:
    """The tiny model generates the video placeholder (249) after this prompt; transformers embeds every
    placeholder id as the pad token, generated ones too, and so does baton's multimodal text model."""
    loaded, hf = models
    engine = tiny_engine(loaded)
    engines.append(engine)
    proc = media_processor()
    ids, items = mm_prompt([2, 20, 99], [("image", image_bytes(40, 28, seed=11), proc.image_tokens(40, 28))],
                           [61, 7])
    got = engine.generate([ids], GREEDY, media=[items])[0].token_ids
    assert hf.config.video_token_id in got[:-1]  # the case is exercised: a placeholder id was fed back
    assert got == hf_mm_greedy(hf, ids, [random_image(40, 28, seed=11)], [], 8)


def test_prefix_cache_keys_blocks_by_the_image(engines, models) -> None:
    loaded, hf = models
    engine = tiny_engine(loaded)
    engines.append(engine)
    ids_a, items_a, img_a = _image_prompt((40, 28), 3, [61, 7, 33] * 4)
    ids_b, items_b, img_b = _image_prompt((40, 28), 4, [61, 7, 33] * 4)
    assert ids_a == ids_b  # the same tokens: only the image differs
    first = engine.generate([ids_a], GREEDY, media=[items_a])[0]
    other = engine.generate([ids_b], GREEDY, media=[items_b])[0]
    again = engine.generate([ids_a], GREEDY, media=[items_a])[0]
    assert other.num_cached_tokens == 4  # only the block before the image is shared
    assert again.num_cached_tokens >= len(ids_a) - 4
    assert first.token_ids == again.token_ids == hf_mm_greedy(hf, ids_a, [img_a], [], 8)
    assert other.token_ids == hf_mm_greedy(hf, ids_b, [img_b], [], 8)
    assert loaded.media_encoder.num_cache_hits >= 1  # the repeated image was not encoded again


def test_bad_media_is_refused_at_intake(engines, models) -> None:
    loaded, _ = models
    engine = tiny_engine(loaded)
    engines.append(engine)
    ids, items = mm_prompt([2], [("image", b"not an image", 4)], [3])
    with pytest.raises(InvalidRequestError, match="could not be decoded"):
        engine.add_request("bad-1", ids, GREEDY, media=items)
    good_ids, good_items, _ = _image_prompt((40, 28), 3, [5])
    with pytest.raises(InvalidRequestError, match="placeholder"):
        engine.add_request("bad-2", good_ids[:-3], GREEDY, media=[good_items[0].__class__(
            "image", 1, good_items[0].num_tokens, good_items[0].content_hash, good_items[0].data)])
    with pytest.raises(InvalidRequestError, match="placeholder tokens"):  # placeholders with no media behind them
        engine.add_request("bad-3", good_ids, GREEDY)
    assert not engine.has_unfinished()


def test_in_process_handoff_carries_the_media(engines, models) -> None:
    loaded, hf = models
    prefill = tiny_engine(loaded, role="prefill")
    decode = tiny_engine(loaded, role="decode")
    engines.extend([prefill, decode])
    ids, items, img = _image_prompt((40, 28), 3, [61, 7, 33])
    handoff = prefill.generate([ids], GREEDY, media=[items])[0].handoff
    assert handoff is not None and handoff.media == tuple(items)
    assert decode.add_handoff("d", GREEDY, handoff) is None
    results = decode.run_to_completion()
    assert [handoff.first_token_id, *results["d"].token_ids] == hf_mm_greedy(hf, ids, [img], [], 8)
