"""Tiny `gemma4_unified` models with their encoder-free vision and audio embedders, for fidelity tests.

The text part is tests/helpers/gemma4.py's "unified" variant (the 12B model's
decoder, sliding window 6: shorter than the tiny images' soft-token runs) with
the 256-token vocabulary; the placeholder and delimiter ids are
`SMALL_VOCAB_TOKEN_IDS`, the embedders tiny_unified.py's.

transformers' Gemma4UnifiedImageProcessor cannot run here (it needs torchvision,
which does not load beside our torch), so transformers' model is fed the
patches of baton's processor, padded to `max_soft_tokens` with (-1, -1)
positions as that processor pads them; the processor itself is tested against
transformers' patch functions in tests/unit/models/test_gemma4_unified_processor.py.
The audio frames fed to transformers are its own feature extractor's.
"""

from __future__ import annotations

from typing import Any

import torch

from shared.models.gemma4.tiny import SMALL_VOCAB_TOKEN_IDS, randomize
from shared.models.gemma4.tiny_unified import unified_model_config, unified_processor_config
from tests.helpers.gemma4 import tiny_gemma4_config
from tests.helpers.gemma4_mm import mm_token_type_ids, text_weights


def tiny_unified_hf(seed: int = 0, vision: bool = True, audio: bool = True, **overrides: Any) -> Any:
    """A random transformers Gemma4UnifiedForConditionalGeneration with both embedders."""
    from transformers.models.gemma4_unified import Gemma4UnifiedForConditionalGeneration

    config = unified_model_config(tiny_gemma4_config("unified", **overrides), vision, audio, SMALL_VOCAB_TOKEN_IDS)
    return randomize(Gemma4UnifiedForConditionalGeneration(config).eval(), seed)


def saved_weights(hf: Any) -> dict[str, torch.Tensor]:
    """The model's tensors under the names `save_pretrained` writes (transformers renames the vision embedder's as
    it loads them; baton reads the saved names)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(hf, dict(hf.state_dict()))  # type: ignore[no-any-return]


def unified_processor() -> Any:
    """The tiny embedders' processor (what `baton make-tiny gemma4 --unified --vision --audio` writes)."""
    from shared.multimodal.unified_processor import Gemma4UnifiedMediaProcessor

    return Gemma4UnifiedMediaProcessor(unified_processor_config())


def feature_extractor() -> Any:
    """transformers' Gemma4UnifiedAudioFeatureExtractor with the tiny checkpoint's settings."""
    from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import (
        Gemma4UnifiedAudioFeatureExtractor,
    )

    settings = unified_processor_config()["feature_extractor"]
    return Gemma4UnifiedAudioFeatureExtractor(**{k: v for k, v in settings.items() if k != "feature_extractor_type"})


def padded_pixels(images: list[Any]) -> dict[str, torch.Tensor]:
    """`pixel_values` [B, max_soft_tokens, D] and `image_position_ids` [B, max_soft_tokens, 2] of PIL images, padded
    as Gemma4UnifiedImageProcessor pads them (zeros, positions -1)."""
    proc = unified_processor()
    pixels, positions = [], []
    for img in images:
        image = proc.image(img)
        pad = proc.max_soft_tokens - image.num_soft_tokens
        pixels.append(torch.nn.functional.pad(image.patches, (0, 0, 0, pad)))
        positions.append(torch.nn.functional.pad(image.positions, (0, 0, 0, pad), value=-1))
    return {"pixel_values": torch.stack(pixels), "image_position_ids": torch.stack(positions)}


def hf_inputs(hf: Any, ids: list[int], images: list[Any], waves: list[Any]) -> dict[str, Any]:
    """transformers' keyword inputs for a prompt with these PIL images and 16 kHz waves."""
    kwargs: dict[str, Any] = {"mm_token_type_ids": mm_token_type_ids(ids, hf.config.image_token_id,
                                                                      hf.config.audio_token_id)}
    if images:
        kwargs |= padded_pixels(images)
    if waves:
        feats = feature_extractor()(waves, return_tensors="pt")
        kwargs |= dict(input_features=feats["input_features"], input_features_mask=feats["input_features_mask"])
    return kwargs


def hf_unified_greedy(hf: Any, ids: list[int], images: list[Any], waves: list[Any],
                      num_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation and each chosen token's logprob (its `output_hidden_states` keeps the
    KV-shared layers on every position, tests/helpers/gemma4.py)."""
    out = hf.generate(torch.tensor([ids]), max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False,
                      output_hidden_states=True, output_logits=True, return_dict_in_generate=True,
                      **hf_inputs(hf, ids, images, waves))
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, tokens, strict=True)]


def tiny_unified_loaded(seed: int = 0, **overrides: Any) -> tuple[Any, Any]:
    """(baton's LoadedModel with its media encoder, transformers' model) on the same random weights."""
    from pathlib import Path

    from shared.engine.engine import pick_attention
    from shared.models.families import build_model, spec_from_config
    from shared.models.gemma4.multimodal import multimodal_config
    from shared.models.gemma4.unified_media import Gemma4UnifiedEncoders
    from shared.models.loader import LoadedModel
    from shared.multimodal.encoder import MediaEncoder

    hf = tiny_unified_hf(seed, **overrides)
    spec = spec_from_config(hf.config.text_config)
    model = build_model(spec, text_weights(hf), pick_attention("auto", "cpu"))
    encoder = MediaEncoder(unified_processor(), Gemma4UnifiedEncoders(hf.config, saved_weights(hf)))
    loaded = LoadedModel(name="tiny-gemma4-unified", hf_dir=Path("/nonexistent"), hf_config=hf.config.text_config,
                         spec=spec, model=model, tokenizer=None, eos_token_ids=frozenset({1}),
                         media_encoder=encoder, multimodal=multimodal_config(hf.config))
    return loaded, hf
