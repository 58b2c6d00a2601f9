"""Soft-token counts of images and audio clips as Gemma4Processor computes them (transformers 5.24).

Gemma4Processor itself needs torchvision for its video processor, so its count
methods run here unbound, on the same image processor and feature extractor
settings baton reads from the checkpoint.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor, get_aspect_ratio_preserving_size

from tests.helpers.gemma4_mm import media_processor, random_image, random_wave


@pytest.mark.parametrize("size", [(37, 53), (64, 16), (200, 90), (1000, 13), (13, 1000), (560, 560)])
def test_image_soft_tokens_are_the_processors(size: tuple[int, int]) -> None:
    proc = media_processor()
    width, height = size
    image = proc.image(random_image(width, height))
    ip = proc.images
    h, w = get_aspect_ratio_preserving_size(height, width, ip.patch_size, ip.max_soft_tokens * ip.pooling_kernel_size**2,
                                            ip.pooling_kernel_size)
    expected = (h // ip.patch_size) * (w // ip.patch_size) // ip.pooling_kernel_size**2
    assert image.num_soft_tokens == expected == proc.image_tokens(width, height)
    assert image.patches.shape[0] == expected * ip.pooling_kernel_size**2
    assert 0 < expected <= ip.max_soft_tokens


@pytest.mark.parametrize("seconds", [0.05, 0.37, 1.0, 2.5])
def test_audio_soft_tokens_are_the_processors(seconds: float) -> None:
    proc = media_processor()
    wave = random_wave(seconds)
    clip = proc.audio(wave)
    fake = SimpleNamespace(feature_extractor=proc.audio_features, audio_seq_length=750, boa_token="<a>",
                           eoa_token="</a>", audio_token="x")
    counted = Gemma4Processor._compute_audio_num_tokens(fake, np.zeros(len(wave)), 16_000)
    feats = proc.audio_features([wave], return_tensors="np")
    replaced = Gemma4Processor.replace_audio_token(fake, feats, 0)
    assert clip.num_soft_tokens == counted == replaced.count("x") == proc.audio_tokens(len(wave))
