"""Gemma 4's media preprocessing, as Gemma4Processor does it: images to patches, audio to log-mel frames.

transformers' own image processor (Pillow flavour) and feature extractor do the
work, configured from the checkpoint's `processor_config.json`, so resizing,
patch order and mel framing are the reference's; this module strips their batch
padding and says how many soft tokens each item becomes::

    RGB image ──aspect-preserving resize (a multiple of patch * pool, <= max_soft_tokens * pool^2 patches)
              ──► patches [n, 3 * p * p], (col, row) [n, 2]      soft tokens = n / pool^2
    16 kHz wave ──mel frames [T, 128] + frame mask ──► soft tokens = valid frames after two /2 subsamplings
    video frame (already sampled and resized by video.py) ──/255, cut into patches──► as an image's

The placeholder run Gemma4Processor writes for each item: <boi> <image>*n <eoi>
(or <boa> <audio>*n <eoa>; a video frame: "MM:SS <boi> <video>*n <eoi>").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.errors import ConfigError, InvalidRequestError
from shared.multimodal.video import VideoRules

MAX_AUDIO_SAMPLES = 480_000  # Gemma4AudioFeatureExtractor's max_length: 30 s at 16 kHz


@dataclass
class ProcessedImage:
    patches: torch.Tensor  # [num_patches, 3 * patch_size**2] float32 in [0, 1]
    positions: torch.Tensor  # [num_patches, 2] int64 (column, row)
    num_soft_tokens: int


@dataclass
class ProcessedAudio:
    # [num_frames, num_mel_bins] log-mel frames (Gemma 4), or [num_frames, samples_per_token] raw waveform frames
    # (gemma4_unified), float32
    frames: torch.Tensor
    frame_mask: torch.Tensor  # [num_frames] bool
    num_soft_tokens: int


def read_processor_config(hf_dir: Path) -> dict[str, Any]:
    """The checkpoint's processor settings; ConfigError when it ships none or they cannot be read."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = hf_dir / name
        if path.is_file():
            try:
                return json.loads(path.read_text())  # type: ignore[no-any-return]
            except (OSError, ValueError) as e:
                raise ConfigError(f"{path} is unreadable: {e}") from None
    raise ConfigError(f"{hf_dir} has no processor_config.json: its images and audio cannot be read")


class Gemma4MediaProcessor:
    """Gemma 4's image processor and audio feature extractor, from a checkpoint's processor config."""

    def __init__(self, config: dict[str, Any]) -> None:
        from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

        image = {k: v for k, v in config.get("image_processor", {}).items()
                 if k not in ("image_processor_type", "processor_class")}
        audio = {k: v for k, v in config.get("feature_extractor", {}).items()
                 if k not in ("feature_extractor_type", "processor_class")}
        self.images = Gemma4ImageProcessorPil(**image)
        self.audio_features = Gemma4AudioFeatureExtractor(**audio)
        video = config.get("video_processor", {})
        # a config without a video section: Gemma4VideoProcessor's defaults, cut for this tower's patches
        self.video_rules: VideoRules | None = VideoRules(
            num_frames=int(video.get("num_frames", VideoRules.num_frames)),
            max_soft_tokens=int(video.get("max_soft_tokens", VideoRules.max_soft_tokens)),
            patch_size=int(video.get("patch_size", self.images.patch_size)),
            pooling_kernel_size=int(video.get("pooling_kernel_size", self.images.pooling_kernel_size)))
        if (self.video_rules.patch_size, self.video_rules.pooling_kernel_size) != (
                self.images.patch_size, self.images.pooling_kernel_size):
            raise ConfigError("the video processor cuts patches other than the image processor's: one vision tower "
                              "reads both")

    @classmethod
    def from_dir(cls, hf_dir: Path) -> Gemma4MediaProcessor:
        return cls(read_processor_config(hf_dir))

    @property
    def max_vision_soft_tokens(self) -> int:
        """The most soft tokens one image or video frame gets (the vision tower's largest input)."""
        video = self.video_rules.max_soft_tokens if self.video_rules is not None else 0
        return max(int(self.images.max_soft_tokens), video)

    def image_tokens(self, width: int, height: int) -> int:
        """Soft tokens of a `width` x `height` image, without processing it (the processor's resize rule)."""
        from transformers.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size

        ip = self.images
        try:
            h, w = get_aspect_ratio_preserving_size(height, width, ip.patch_size,
                                                    ip.max_soft_tokens * ip.pooling_kernel_size**2,
                                                    ip.pooling_kernel_size)
        except ValueError as e:  # too thin to resize
            raise InvalidRequestError(f"image of {width}x{height} pixels cannot be resized: {e}") from None
        return (h // ip.patch_size) * (w // ip.patch_size) // ip.pooling_kernel_size**2

    def audio_tokens(self, num_samples: int) -> int:
        """Soft tokens of a clip of `num_samples` at 16 kHz: valid mel frames after two /2 subsamplings."""
        fe = self.audio_features
        num_samples = min(num_samples, MAX_AUDIO_SAMPLES)  # the feature extractor truncates there
        padded = -(-num_samples // 128) * 128  # it pads to a multiple of 128 samples
        num_frames = (padded + fe.frame_length // 2 - (fe.frame_length + 1)) // fe.hop_length + 1
        valid = [i * fe.hop_length + fe.frame_length < num_samples + fe.frame_length // 2
                 for i in range(max(num_frames, 0))]
        return sum(valid[::2][::2])

    def image(self, img: Any) -> ProcessedImage:  # a PIL RGB image
        out = self.images(images=[img], return_tensors="pt")
        positions = out["image_position_ids"][0]
        real = (positions != -1).all(dim=-1)
        return ProcessedImage(out["pixel_values"][0][real].float(), positions[real].long(),
                              int(out["num_soft_tokens_per_image"][0]))

    def audio(self, waveform: np.ndarray) -> ProcessedAudio:  # [samples] float32 at 16 kHz
        out = self.audio_features([waveform], return_tensors="pt")
        mask = out["input_features_mask"][0].bool()
        return ProcessedAudio(out["input_features"][0].float(), mask, int(mask[::2][::2].sum()))

    def video_frame(self, frame: np.ndarray) -> ProcessedImage:  # [h, w, 3] uint8, already at its processed size
        """A sampled, resized frame (video.py) cut as Gemma4VideoProcessor cuts it: x / 255, patches row-major,
        each patch's pixels (row, column, channel)."""
        assert self.video_rules is not None
        p, k = self.video_rules.patch_size, self.video_rules.pooling_kernel_size
        h, w = frame.shape[0] // p, frame.shape[1] // p
        if frame.shape[0] % (p * k) or frame.shape[1] % (p * k):
            raise InvalidRequestError(f"a video frame of {frame.shape[1]}x{frame.shape[0]} pixels is not cut in "
                                      f"{p * k}-pixel cells", param="messages")
        x = torch.from_numpy(np.array(frame)).permute(2, 0, 1).float() / 255.0
        patches = x.reshape(3, h, p, w, p).permute(1, 3, 2, 4, 0).reshape(h * w, p * p * 3)
        grid = torch.stack(torch.meshgrid(torch.arange(w), torch.arange(h), indexing="xy"), dim=-1)
        return ProcessedImage(patches, grid.reshape(h * w, 2).long(), h * w // k**2)
