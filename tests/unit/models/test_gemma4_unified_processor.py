"""gemma4_unified's media preprocessing against transformers 5.24's Gemma4Unified processor.

The audio side is compared with transformers' Gemma4UnifiedAudioFeatureExtractor
itself, and the soft-token counts with Gemma4UnifiedProcessor's own methods (run
unbound, as for Gemma 4: the processor class needs torchvision for its video
processor). Gemma4UnifiedImageProcessor cannot run here: its module imports
torchvision, and PyPI's torchvision wheels for our torch (0.28) do not load
(a CUDA build). So its per-image steps are run from its own source: the module's
patch functions (`get_aspect_ratio_preserving_size`, `convert_image_to_patches`,
`patches_merge`, `pad_along_first_dim`) are compiled from transformers' file
without its imports, and its `_preprocess` loop is restated around them, with
torchvision's resize of a uint8 CPU tensor (`resize_image`: native uint8
antialiased bicubic `interpolate`). A hand-built image checks patch order and
positions directly.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from transformers.models.gemma4_unified.processing_gemma4_unified import Gemma4UnifiedProcessor

from tests.helpers.gemma4_mm import random_image, random_wave
from tests.helpers.gemma4_unified_mm import feature_extractor, padded_pixels, unified_processor

_PATCH_FUNCTIONS = ("get_aspect_ratio_preserving_size", "convert_image_to_patches", "pad_along_first_dim",
                    "patches_merge")


def _reference_functions() -> dict[str, Any]:
    """transformers' image patch functions, compiled from image_processing_gemma4_unified.py."""
    import transformers.models.gemma4_unified as package

    source = (Path(package.__file__).parent / "image_processing_gemma4_unified.py").read_text()
    tree = ast.parse(source)
    tree.body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in _PATCH_FUNCTIONS]
    assert sorted(node.name for node in tree.body) == sorted(_PATCH_FUNCTIONS)  # type: ignore[attr-defined]
    namespace: dict[str, Any] = {"math": math, "torch": torch}
    exec(compile(tree, "image_processing_gemma4_unified.py", "exec"), namespace)
    return namespace


REF = _reference_functions()


def _reference_image(img: Any, patch_size: int, pooling: int, max_soft_tokens: int) -> tuple[torch.Tensor, ...]:
    """Gemma4UnifiedImageProcessor._preprocess on one PIL image: (pixel_values, positions, num soft tokens)."""
    image = torch.from_numpy(np.array(img)).permute(2, 0, 1).contiguous()  # process_image: PIL -> uint8 CHW
    h, w = REF["get_aspect_ratio_preserving_size"](image.shape[1], image.shape[2], patch_size,
                                                   max_soft_tokens * pooling**2, pooling)
    if (h, w) != tuple(image.shape[1:]):  # torchvision's resize_image, uint8 on the CPU
        image = torch.nn.functional.interpolate(image[None], size=[h, w], mode="bicubic", align_corners=False,
                                                antialias=True)[0]
    image = image * (1 / 255)
    patch_height, patch_width = image.shape[-2] // patch_size, image.shape[-1] // patch_size
    teacher = REF["convert_image_to_patches"](image, patch_size)
    grid = torch.meshgrid(torch.arange(patch_width), torch.arange(patch_height), indexing="xy")
    positions = torch.stack(grid, dim=-1).reshape(teacher.shape[0], 2)
    merged, merged_positions = REF["patches_merge"](teacher[None], positions[None], teacher.shape[0] // pooling**2)
    num = merged.shape[1]
    pixels, pos = REF["pad_along_first_dim"](merged[0], merged_positions[0], max_soft_tokens)
    return pixels, pos, torch.tensor(num)


@pytest.mark.parametrize("size", [(37, 53), (64, 16), (200, 90), (1000, 13), (13, 1000), (64, 64), (80, 56),
                                  (8, 8), (560, 560)])
def test_image_patches_are_the_processors(size: tuple[int, int]) -> None:
    proc = unified_processor()
    img = random_image(*size, seed=size[0] + size[1])
    pixels, positions, num = _reference_image(img, proc.patch_size, proc.pooling_kernel_size, proc.max_soft_tokens)
    image = proc.image(img)
    assert image.num_soft_tokens == int(num) == proc.image_tokens(*size)
    assert 0 < image.num_soft_tokens <= proc.max_soft_tokens
    torch.testing.assert_close(image.patches, pixels[:int(num)], atol=0, rtol=0)
    assert torch.equal(image.positions, positions[:int(num)])
    assert bool((positions[int(num):] == -1).all())
    padded = padded_pixels([img])  # what the fidelity tests feed transformers: the processor's padded batch
    assert torch.equal(padded["pixel_values"][0], pixels) and torch.equal(padded["image_position_ids"][0], positions)


def test_patch_order_and_positions_by_hand() -> None:
    """An 80 x 56 image fills the 70-token budget exactly (no resize): 10 x 7 squares of 8 px, row by row, each
    square's pixels row by row with their three channels, positions (column, row)."""
    from PIL import Image

    proc = unified_processor()
    rows, cols, channels = np.meshgrid(np.arange(56), np.arange(80), np.arange(3), indexing="ij")
    values = (rows * 3 + cols * 5 + channels * 7) % 256
    image = proc.image(Image.fromarray(values.astype(np.uint8)))
    assert image.num_soft_tokens == 70 and image.patches.shape == (70, 8 * 8 * 3)
    for token, (square_row, square_col) in [(0, (0, 0)), (1, (0, 1)), (9, (0, 9)), (10, (1, 0)), (69, (6, 9))]:
        assert image.positions[token].tolist() == [square_col, square_row]
        square = values[square_row * 8:(square_row + 1) * 8, square_col * 8:(square_col + 1) * 8]  # [8, 8, 3]
        assert torch.equal(image.patches[token], torch.from_numpy(square.reshape(-1)).float() * (1 / 255))


@pytest.mark.parametrize("num_samples", [1, 639, 640, 641, 4800, 16_000 * 30])
def test_audio_frames_are_the_feature_extractors(num_samples: int) -> None:
    proc = unified_processor()
    wave = random_wave(num_samples / 16_000, seed=num_samples)
    assert len(wave) == num_samples
    theirs = feature_extractor()([wave], return_tensors="pt")
    clip = proc.audio(wave)
    assert torch.equal(clip.frames, theirs["input_features"][0])
    assert torch.equal(clip.frame_mask, theirs["input_features_mask"][0])
    fake = SimpleNamespace(feature_extractor=feature_extractor(), boa_token="<a>", eoa_token="</a>", audio_token="x")
    counted = Gemma4UnifiedProcessor._compute_audio_num_tokens(fake, np.zeros(num_samples), 16_000)
    replaced = Gemma4UnifiedProcessor.replace_audio_token(fake, theirs, 0)
    assert clip.num_soft_tokens == counted == replaced.count("x") == proc.audio_tokens(num_samples)


def test_processor_config_is_checked_against_the_model() -> None:
    from shared.errors import ConfigError
    from shared.models.gemma4.tiny_unified import unified_processor_config
    from shared.multimodal.unified_processor import Gemma4UnifiedMediaProcessor
    from tests.helpers.gemma4_unified_mm import tiny_unified_hf

    config = tiny_unified_hf().config
    unified_processor().check_against(config)
    for section, key, value, message in [("image_processor", "max_soft_tokens", 100, "not one of"),
                                         ("image_processor", "do_normalize", True, "as published"),
                                         ("feature_extractor", "sampling_rate", 8000, "16 kHz")]:
        settings = unified_processor_config()
        settings[section][key] = value
        with pytest.raises(ConfigError, match=message):
            Gemma4UnifiedMediaProcessor(settings)
    for section, key, value, message in [("image_processor", "max_soft_tokens", 140, "position table"),
                                         ("image_processor", "patch_size", 8, "do not fit"),
                                         ("feature_extractor", "audio_samples_per_token", 320, "audio_embed_dim")]:
        settings = unified_processor_config()
        settings[section][key] = value
        with pytest.raises(ConfigError, match=message):
            Gemma4UnifiedMediaProcessor(settings).check_against(config)
