"""Tiny random `gemma4_unified` checkpoints (`baton make-tiny gemma4 --unified [--vision] [--audio]`).

The 12B model's layout: the `gemma4_unified_text` decoder (no PLE, no MoE) in a
Gemma4UnifiedForConditionalGeneration, with the encoder-free media side
(unified_media.py) sized small: 4 px patches merged 2 x 2 (8 px model patches,
192 pixel values each) into a 48-wide patch embedding, at most 70 soft tokens
an image; audio at the published 640 samples (40 ms) a soft token. Its text
config keeps the published `use_bidirectional_attention: "vision"`.
"""

from __future__ import annotations

from typing import Any

# the tiny embedders' image processor: 8 px model patches, at most 70 soft tokens (the smallest budget
# Gemma4UnifiedImageProcessor accepts), so the longest side is 70 model patches: the position table's size
TINY_UNIFIED_IMAGE_PROCESSOR: dict[str, Any] = dict(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
AUDIO_SAMPLES_PER_TOKEN = 640  # the published value: 40 ms at 16 kHz


def unified_text_config(kw: dict[str, Any]) -> Any:
    """A `Gemma4UnifiedTextConfig` from Gemma4TextConfig-style arguments (those it lacks dropped)."""
    from transformers.models.gemma4_unified import Gemma4UnifiedTextConfig

    dropped = ("hidden_size_per_layer_input", "vocab_size_per_layer_input")
    return Gemma4UnifiedTextConfig(**{k: v for k, v in kw.items() if k not in dropped})


def unified_vision_config() -> Any:
    from transformers.models.gemma4_unified import Gemma4UnifiedVisionConfig

    p = TINY_UNIFIED_IMAGE_PROCESSOR
    return Gemma4UnifiedVisionConfig(patch_size=p["patch_size"], pooling_kernel_size=p["pooling_kernel_size"],
                                     mm_embed_dim=48, output_proj_dims=48, mm_posemb_size=p["max_soft_tokens"])


def unified_audio_config() -> Any:
    from transformers.models.gemma4_unified import Gemma4UnifiedAudioConfig

    return Gemma4UnifiedAudioConfig(audio_embed_dim=AUDIO_SAMPLES_PER_TOKEN)


def unified_model_config(text: Any, vision: bool, audio: bool, token_ids: dict[str, int] | None = None) -> Any:
    """A `Gemma4UnifiedConfig` around `text` (a Gemma4UnifiedTextConfig) with the embedders asked for."""
    from transformers.models.gemma4_unified import Gemma4UnifiedConfig

    extra: dict[str, Any] = dict(token_ids or {})  # the media token ids, where a test picks its own
    return Gemma4UnifiedConfig(text_config=text.to_dict(),
                               vision_config=unified_vision_config().to_dict() if vision else None,
                               audio_config=unified_audio_config().to_dict() if audio else None, **extra)


def unified_processor_config() -> dict[str, Any]:
    """The tiny embedders' processor settings, shaped as Gemma4UnifiedProcessor's `processor_config.json`
    (its image processor's settings are written out: the class itself needs torchvision)."""
    from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import (
        Gemma4UnifiedAudioFeatureExtractor,
    )

    image = dict(TINY_UNIFIED_IMAGE_PROCESSOR, image_processor_type="Gemma4UnifiedImageProcessor", resample=3,
                 do_resize=True, do_rescale=True, rescale_factor=1 / 255, do_normalize=False,
                 image_mean=[0.0, 0.0, 0.0], image_std=[1.0, 1.0, 1.0], do_convert_rgb=True)
    audio = Gemma4UnifiedAudioFeatureExtractor(feature_size=AUDIO_SAMPLES_PER_TOKEN,
                                               audio_samples_per_token=AUDIO_SAMPLES_PER_TOKEN).to_dict()
    return {"processor_class": "Gemma4UnifiedProcessor", "image_processor": image, "feature_extractor": audio,
            "image_seq_length": TINY_UNIFIED_IMAGE_PROCESSOR["max_soft_tokens"], "audio_seq_length": 750,
            "audio_ms_per_token": 40}
