"""The two seams of a model's media path: its processor (media to tower inputs, and soft-token counts) and its
towers (tower inputs to soft tokens). Gemma 4 (processor.py, models/gemma4/multimodal.py) and gemma4_unified
(unified_processor.py, models/gemma4/unified_media.py) each fill both; `MediaEncoder` and the router's
placeholder expansion read only these."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from shared.multimodal.processor import ProcessedAudio, ProcessedImage
    from shared.multimodal.video import VideoRules


class MediaProcessor(Protocol):
    @property
    def video_rules(self) -> VideoRules | None:
        """How videos are sampled and cut (None: the model reads no video)."""
        ...

    def image_tokens(self, width: int, height: int) -> int:
        """Soft tokens of a `width` x `height` image, without processing it."""
        ...

    def audio_tokens(self, num_samples: int) -> int:
        """Soft tokens of a clip of `num_samples` at 16 kHz."""
        ...

    def image(self, img: Any) -> ProcessedImage:  # a PIL RGB image
        ...

    def audio(self, waveform: np.ndarray) -> ProcessedAudio:  # [samples] float32 at 16 kHz
        ...

    def video_frame(self, frame: np.ndarray) -> ProcessedImage:  # [h, w, 3] uint8, sampled and resized
        ...


class MediaTowers(Protocol):
    @property
    def vision(self) -> object | None:
        """Whatever encodes images (None: the model reads none)."""
        ...

    @property
    def audio(self) -> object | None:
        """Whatever encodes audio (None: the model reads none)."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """Of the soft tokens (and the cached ones: `MediaEncoder.remember`)."""
        ...

    @property
    def device(self) -> torch.device:
        ...

    def encode_images(
        self,
        images: Sequence[tuple[torch.Tensor, torch.Tensor]],  # (patches [n_i, patch features], positions [n_i, 2])
    ) -> list[torch.Tensor]:  # per image [num_soft_tokens_i, text hidden]
        """Several images in one pass."""
        ...

    def encode_audio(
        self,
        frames: torch.Tensor,  # [num_frames, frame features]
        frame_mask: torch.Tensor,  # [num_frames] bool
    ) -> torch.Tensor:  # [num_soft_tokens, text hidden]
        ...
