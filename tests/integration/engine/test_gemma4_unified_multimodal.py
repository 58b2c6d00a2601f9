"""gemma4_unified's encoder-free media side against transformers 5.24's Gemma4UnifiedForConditionalGeneration.

The same random weights in both: the vision embedder's and the audio embedder's
soft tokens equal transformers' `get_image_features` / `get_audio_features`
(transformers runs on the batch padded to `max_soft_tokens` and strips the
padding after; baton runs the real patches only); the whole prompt's logits
(an image's tokens seeing each other on every layer and past the sliding window,
as the unified forward's mask has it) and greedy tokens identical to `generate`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shared.engine.engine import pick_attention
from shared.models.families import build_model, spec_from_config
from shared.models.gemma4.multimodal import multimodal_config
from shared.models.gemma4.unified_media import Gemma4UnifiedEncoders
from tests.helpers.gemma4_mm import (
    AUDIO_ID,
    EOA,
    IMAGE_ID,
    random_image,
    random_wave,
    text_weights,
    whole_mm_prompt,
    whole_prompt_logits,
)
from tests.helpers.gemma4_unified_mm import (
    feature_extractor,
    hf_inputs,
    padded_pixels,
    saved_weights,
    tiny_unified_hf,
    unified_processor,
)


@pytest.fixture(scope="module")
def hf() -> Any:
    return tiny_unified_hf()


@pytest.fixture(scope="module")
def ours(hf: Any) -> tuple[Any, Gemma4UnifiedEncoders]:
    spec = spec_from_config(hf.config.text_config)
    model = build_model(spec, text_weights(hf), pick_attention("auto", "cpu"))
    return model, Gemma4UnifiedEncoders(hf.config, saved_weights(hf))


def test_config_asks_for_images_seen_both_ways_on_every_layer(hf: Any) -> None:
    mm = multimodal_config(hf.config)
    assert mm is not None and mm.has_vision and mm.has_audio
    assert mm.bidirectional_vision and mm.bidirectional_every_layer
    assert (mm.image_token_id, mm.audio_token_id, mm.eoa_token_id) == (IMAGE_ID, AUDIO_ID, EOA)


def test_image_soft_tokens_match_transformers(hf: Any, ours: tuple[Any, Gemma4UnifiedEncoders]) -> None:
    proc = unified_processor()
    images = [random_image(*size, seed=size[0]) for size in [(37, 53), (64, 16), (200, 90), (8, 8)]]
    batch = padded_pixels(images)  # one padded batch, as the processor returns several images
    with torch.no_grad():
        theirs = hf.model.get_image_features(batch["pixel_values"], batch["image_position_ids"]).pooler_output
    for img, expected in zip(images, theirs, strict=True):
        image = proc.image(img)
        mine = ours[1].encode_image(image.patches, image.positions)
        assert mine.shape == expected.shape == (image.num_soft_tokens, hf.config.text_config.hidden_size)
        torch.testing.assert_close(mine, expected, atol=1e-5, rtol=1e-5)


def test_audio_soft_tokens_match_transformers(hf: Any, ours: tuple[Any, Gemma4UnifiedEncoders]) -> None:
    proc = unified_processor()
    waves = [random_wave(seconds, seed=i) for i, seconds in enumerate((0.37, 1.0, 0.04))]
    feats = feature_extractor()(waves, return_tensors="pt")  # padded to the longest, with its mask
    with torch.no_grad():
        res = hf.model.get_audio_features(feats["input_features"], feats["input_features_mask"])
    for i, wave in enumerate(waves):
        clip = proc.audio(wave)
        theirs = res.pooler_output[i][res.attention_mask[i]]
        mine = ours[1].encode_audio(clip.frames, clip.frame_mask)
        assert mine.shape == theirs.shape and mine.shape[0] == clip.num_soft_tokens
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_image_and_audio_prompt_logits_and_greedy_match_transformers(
        hf: Any, ours: tuple[Any, Gemma4UnifiedEncoders]) -> None:
    model, encoders = ours
    proc = unified_processor()
    img, wave = random_image(40, 28, seed=3), random_wave(0.3, seed=2)
    image, clip = proc.image(img), proc.audio(wave)
    assert image.num_soft_tokens > hf.config.text_config.sliding_window  # the span reaches past the window
    soft = torch.cat([encoders.encode_image(image.patches, image.positions),
                      encoders.encode_audio(clip.frames, clip.frame_mask)])
    ids = whole_mm_prompt(image.num_soft_tokens, clip.num_soft_tokens)
    kwargs = hf_inputs(hf, ids, [img], [wave])
    with torch.no_grad():
        theirs = hf(torch.tensor([ids]), output_hidden_states=True, **kwargs).logits[0]
    mine = whole_prompt_logits(model, ids, soft, "every_layer")
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    for other in ("sliding", "causal"):  # Gemma 4's sliding-only mask, or none, changes what follows the image
        assert not torch.allclose(whole_prompt_logits(model, ids, soft, other)[-1], theirs[-1], atol=1e-3)
    # greedy: 8 tokens, each step one full forward (the engine's paged decode path is tested through it)
    out = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                      output_hidden_states=True, return_dict_in_generate=True, **kwargs)
    expected = out.sequences[0, len(ids):].tolist()
    seq = list(ids)
    for _ in range(8):
        seq.append(int(whole_prompt_logits(model, seq, soft, "every_layer")[-1].argmax()))
    assert seq[len(ids):] == expected
