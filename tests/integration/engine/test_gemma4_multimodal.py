"""Gemma 4's vision and audio towers against transformers 5.24's Gemma4ForConditionalGeneration.

The same random weights in both: each encoder's soft tokens within fp32
tolerance of transformers' `get_image_features` / `get_audio_features`; the
whole prompt's logits (soft tokens merged at the placeholders, the placeholders'
per-layer inputs the pad token's, an image's tokens seeing each other on sliding
layers where the config asks) and greedy tokens identical to `generate`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shared.engine.engine import pick_attention
from shared.models.families import build_model, spec_from_config
from shared.models.gemma4.multimodal import Gemma4Encoders, multimodal_config
from tests.helpers.gemma4_mm import (
    media_processor,
    mm_token_type_ids,
    random_image,
    random_wave,
    text_weights,
    tiny_mm_hf,
    whole_mm_prompt,
    whole_prompt_logits,
)


@pytest.fixture(scope="module")
def hf() -> Any:
    return tiny_mm_hf("all", bidirectional=True)


@pytest.fixture(scope="module")
def ours(hf: Any) -> tuple[Any, Gemma4Encoders]:
    spec = spec_from_config(hf.config.text_config)
    model = build_model(spec, text_weights(hf), pick_attention("auto", "cpu"))
    return model, Gemma4Encoders(hf.config, hf.state_dict())


def test_image_soft_tokens_match_transformers(hf: Any, ours: tuple[Any, Gemma4Encoders]) -> None:
    proc = media_processor()
    for size in [(37, 53), (64, 16), (200, 90)]:
        image = proc.image(random_image(*size, seed=size[0]))
        out = proc.images(images=[random_image(*size, seed=size[0])], return_tensors="pt")
        with torch.no_grad():
            theirs = hf.model.get_image_features(out["pixel_values"], out["image_position_ids"]).pooler_output[0]
        mine = ours[1].encode_image(image.patches, image.positions)
        assert mine.shape == theirs.shape == (image.num_soft_tokens, hf.config.text_config.hidden_size)
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_images_encoded_together_match_transformers_and_one_at_a_time(
        hf: Any, ours: tuple[Any, Gemma4Encoders]) -> None:
    """One tower pass over images of different sizes (the engine's batch across requests): each image's soft
    tokens are its own, as transformers' padded, masked batch gives them and as one image alone gives them."""
    proc = media_processor()
    sizes = [(37, 53), (64, 16), (200, 90), (37, 53)]
    pictures = [random_image(*size, seed=i) for i, size in enumerate(sizes)]
    images = [proc.image(p) for p in pictures]
    together = ours[1].encode_images([(im.patches, im.positions) for im in images])
    out = proc.images(images=pictures, return_tensors="pt")
    with torch.no_grad():
        theirs = hf.model.get_image_features(out["pixel_values"], out["image_position_ids"]).pooler_output
    assert len(together) == len(theirs) == len(images)
    for mine, their, im in zip(together, theirs, images, strict=True):
        assert mine.shape == (im.num_soft_tokens, hf.config.text_config.hidden_size)
        torch.testing.assert_close(mine, their, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine, ours[1].encode_image(im.patches, im.positions), atol=1e-5, rtol=1e-5)


def test_audio_soft_tokens_match_transformers(hf: Any, ours: tuple[Any, Gemma4Encoders]) -> None:
    proc = media_processor()
    for seconds in (0.37, 1.0):
        clip = proc.audio(random_wave(seconds))
        out = proc.audio_features([random_wave(seconds)], return_tensors="pt")
        with torch.no_grad():
            res = hf.model.get_audio_features(out["input_features"], out["input_features_mask"])
        theirs = res.pooler_output[res.attention_mask]
        mine = ours[1].encode_audio(clip.frames, clip.frame_mask)
        assert mine.shape == theirs.shape and mine.shape[0] == clip.num_soft_tokens
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "causal"])
def test_image_and_audio_prompt_logits_and_greedy_match_transformers(bidirectional: bool) -> None:
    hf = tiny_mm_hf("all", bidirectional=bidirectional)
    spec = spec_from_config(hf.config.text_config)
    model = build_model(spec, text_weights(hf), pick_attention("auto", "cpu"))
    encoders = Gemma4Encoders(hf.config, hf.state_dict())
    assert multimodal_config(hf.config).bidirectional_vision == bidirectional
    proc = media_processor()
    img, wave = random_image(40, 28, seed=3), random_wave(0.5, seed=2)
    image, clip = proc.image(img), proc.audio(wave)
    soft = torch.cat([encoders.encode_image(image.patches, image.positions),
                      encoders.encode_audio(clip.frames, clip.frame_mask)])
    ids = whole_mm_prompt(image.num_soft_tokens, clip.num_soft_tokens)
    image_mask = "sliding" if bidirectional else "causal"
    pix = proc.images(images=[img], return_tensors="pt")
    feats = proc.audio_features([wave], return_tensors="pt")
    kwargs = dict(pixel_values=pix["pixel_values"], image_position_ids=pix["image_position_ids"],
                  input_features=feats["input_features"], input_features_mask=feats["input_features_mask"],
                  mm_token_type_ids=mm_token_type_ids(ids))
    with torch.no_grad():
        theirs = hf(torch.tensor([ids]), output_hidden_states=True, **kwargs).logits[0]
    mine = whole_prompt_logits(model, ids, soft, image_mask)
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    if bidirectional:  # the image's tokens seeing each other changes what follows them
        assert not torch.allclose(whole_prompt_logits(model, ids, soft, "causal")[-1], theirs[-1], atol=1e-3)
    # greedy: 8 tokens, each step one full forward (the engine's paged decode path is tested through it)
    out = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                      output_hidden_states=True, return_dict_in_generate=True, **kwargs)
    expected = out.sequences[0, len(ids):].tolist()
    seq = list(ids)
    for _ in range(8):
        seq.append(int(whole_prompt_logits(model, seq, soft, image_mask)[-1].argmax()))
    assert seq[len(ids):] == expected
