"""gemma4_unified's media preprocessing, as Gemma4UnifiedProcessor does it: images to merged pixel patches,
audio to raw waveform frames. No towers follow, so no mel spectrogram and no pooling::

    RGB image (uint8) ──aspect-preserving bicubic resize (antialiased; sides multiples of pool * patch,
                        <= max_soft_tokens * pool^2 patches of `patch_size`) ──► x / 255
              ──► merged patches [n, (pool * patch)^2 * 3]: each (pool * patch)-pixel square, rows of
                  (row, col, channel) pixels, squares in row-major order; (col, row) [n, 2]
              soft tokens n = (h / (pool * patch)) * (w / (pool * patch))
    16 kHz wave ──zero-padded to a multiple of audio_samples_per_token──► frames [n, samples_per_token]
              soft tokens n = ceil(num_samples / samples_per_token)

transformers' Gemma4UnifiedImageProcessor cuts `patch_size` patches and merges
each pool x pool group into one (`patches_merge`); the merged patch is the
(pool * patch)-pixel square laid out row by row, which is what is cut here in
one step. Its resize is torchvision's on the uint8 tensor, which on the CPU is
torch's native uint8 antialiased bicubic interpolation, called here directly
(torchvision itself does not load beside our torch). The placeholder run is
<boi> <image>*n <eoi> (or <boa> <audio>*n <eoa>), as for Gemma 4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from shared.errors import ConfigError, InvalidRequestError
from shared.multimodal.media import AUDIO_SAMPLE_RATE
from shared.multimodal.processor import ProcessedAudio, ProcessedImage, read_processor_config
from shared.multimodal.video import VideoRules

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)  # what Gemma4UnifiedImageProcessor accepts
_BICUBIC = 3  # PILImageResampling.BICUBIC, the processor's resample


class Gemma4UnifiedMediaProcessor:
    """Gemma4UnifiedProcessor's image and audio rules, from a checkpoint's `processor_config.json`."""

    def __init__(self, config: dict[str, Any]) -> None:
        image, audio = config.get("image_processor", {}), config.get("feature_extractor", {})
        self.patch_size = int(image.get("patch_size", 16))
        self.pooling_kernel_size = int(image.get("pooling_kernel_size", 3))
        self.max_soft_tokens = int(image.get("max_soft_tokens", 280))
        self.rescale_factor = float(image.get("rescale_factor", 1 / 255))
        self.samples_per_token = int(audio.get("audio_samples_per_token", 640))
        if self.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
            raise ConfigError(f"image max_soft_tokens {self.max_soft_tokens} is not one of {SUPPORTED_SOFT_TOKENS}")
        if int(image.get("resample", _BICUBIC)) != _BICUBIC or not image.get("do_resize", True) \
                or not image.get("do_rescale", True) or image.get("do_normalize", False):
            raise ConfigError("gemma4_unified's image processor is read only as published: bicubic resize, rescale, "
                              "no normalization")
        if int(audio.get("sampling_rate", AUDIO_SAMPLE_RATE)) != AUDIO_SAMPLE_RATE or self.samples_per_token <= 0:
            raise ConfigError(f"gemma4_unified's audio frames must be of 16 kHz samples, got {audio}")

    @classmethod
    def from_dir(cls, hf_dir: Path) -> Gemma4UnifiedMediaProcessor:
        return cls(read_processor_config(hf_dir))

    @property
    def model_patch_size(self) -> int:
        """Side of a merged patch (one soft token) in pixels."""
        return self.patch_size * self.pooling_kernel_size

    def check_against(self, config: Any) -> None:
        """Refuse a processor that does not fit the checkpoint's embedders (a Gemma4UnifiedConfig)."""
        vision, audio = config.vision_config, config.audio_config
        if vision is not None:
            if (vision.patch_size, vision.pooling_kernel_size) != (self.patch_size, self.pooling_kernel_size):
                raise ConfigError(f"processor patches ({self.patch_size} px pooled {self.pooling_kernel_size}) do not "
                                  f"fit the vision config's ({vision.patch_size}, {vision.pooling_kernel_size})")
            if self.max_soft_tokens > vision.mm_posemb_size:  # the longest side, in merged patches
                raise ConfigError(f"processor max_soft_tokens {self.max_soft_tokens} exceeds the vision position "
                                  f"table ({vision.mm_posemb_size})")
        if audio is not None and audio.audio_embed_dim != self.samples_per_token:
            raise ConfigError(f"processor audio_samples_per_token {self.samples_per_token} differs from the audio "
                              f"config's audio_embed_dim {audio.audio_embed_dim}")

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the processor resizes a `width` x `height` image to."""
        from transformers.models.gemma4_unified.processing_gemma4_unified import (
            get_aspect_ratio_preserving_size,
        )

        try:
            return get_aspect_ratio_preserving_size(height, width, self.patch_size,  # type: ignore[no-any-return]
                                                    self.max_soft_tokens * self.pooling_kernel_size**2,
                                                    self.pooling_kernel_size)
        except ValueError as e:  # too thin to resize
            raise InvalidRequestError(f"image of {width}x{height} pixels cannot be resized: {e}") from None

    video_rules: VideoRules | None = None  # gemma4_unified reads no video

    def video_frame(self, frame: np.ndarray) -> ProcessedImage:
        raise InvalidRequestError("this model does not read video", param="messages")

    def image_tokens(self, width: int, height: int) -> int:
        """Soft tokens of a `width` x `height` image, without processing it."""
        h, w = self.resized_size(width, height)
        return (h // self.model_patch_size) * (w // self.model_patch_size)

    def audio_tokens(self, num_samples: int) -> int:
        """Soft tokens of a clip of `num_samples` at 16 kHz: one per started frame."""
        return -(-num_samples // self.samples_per_token)

    def image(self, img: Any) -> ProcessedImage:  # a PIL RGB image
        pixels = torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1).contiguous()  # [3, H, W] uint8
        h, w = self.resized_size(pixels.shape[2], pixels.shape[1])
        if (h, w) != tuple(pixels.shape[1:]):  # torchvision's uint8 path on the CPU: no float round trip
            pixels = F.interpolate(pixels[None], size=[h, w], mode="bicubic", align_corners=False, antialias=True)[0]
        scaled = pixels * self.rescale_factor  # float32, as the processor's rescale
        side = self.model_patch_size
        rows, cols = h // side, w // side
        patches = scaled.reshape(3, rows, side, cols, side).permute(1, 3, 2, 4, 0).reshape(rows * cols, -1)
        col, row = torch.meshgrid(torch.arange(cols), torch.arange(rows), indexing="xy")
        positions = torch.stack([col, row], dim=-1).reshape(rows * cols, 2)
        return ProcessedImage(patches, positions, rows * cols)

    def audio(self, waveform: np.ndarray) -> ProcessedAudio:  # [samples] float32 at 16 kHz
        num_frames = self.audio_tokens(len(waveform))
        padded = np.pad(waveform, (0, num_frames * self.samples_per_token - len(waveform)))
        frames = torch.from_numpy(padded.reshape(num_frames, self.samples_per_token).astype(np.float32))
        return ProcessedAudio(frames, torch.ones(num_frames, dtype=torch.bool), num_frames)

