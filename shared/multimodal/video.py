"""Video in a prompt, as transformers' Gemma4VideoProcessor reads it: sampled frames, each a small image.

    file bytes ──size limit──► PyAV (FFmpeg in its wheel): the first video stream, its frame count (its
      packets counted where the container keeps none: webm, mkv) and rate
      ──duration limit──► frame indices i * total // n, n = min(num_frames, total)  (default_sample_indices_fn)
      ──decode in order, keep those frames (RGB)──► each resized as torchvision's v2 `resize` does a uint8
        channels-first tensor on the CPU (torch's native uint8 bicubic antialias kernel: no float round trip)
        to the largest size of at most max_soft_tokens * k^2 patches whose sides are multiples of patch * k
        (the image rule)
      ──► frames [h, w, 3] uint8, each frame's time (index / fps) and soft tokens

The prompt then holds, per frame, "MM:SS <boi><video> x n<eoi>" joined by spaces
(Gemma4Processor.replace_video_token). Frames travel to the engines as lossless
PNGs at their processed size: an engine cuts them into patches without resizing
(processor.py), never decoding video itself. Where transformers would refuse a
video shorter than num_frames, all its frames are taken.

FFmpeg parses untrusted bytes here, so the file, its duration and its frame size
are bounded before anything is decoded, and every failure is an
`InvalidRequestError` naming the content part.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from shared.errors import InvalidRequestError
from shared.multimodal.media import MediaLimits

# the containers accepted (PyAV's format names list aliases: "mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm")
VIDEO_CONTAINERS = ("mp4", "mov", "webm", "matroska", "avi")


@dataclass(frozen=True)
class VideoRules:
    """Gemma4VideoProcessor's settings (its class defaults, or the checkpoint's `video_processor` section)."""

    num_frames: int = 32
    max_soft_tokens: int = 70
    patch_size: int = 16
    pooling_kernel_size: int = 3


@dataclass
class DecodedVideo:
    frames: list[np.ndarray]  # [h, w, 3] uint8 each, at the processed size
    seconds: list[float]  # each frame's time in the video
    tokens_per_frame: int  # soft tokens of each frame (all frames share a size)


def timestamp(seconds: float) -> str:
    """"MM:SS", as Gemma4Processor writes a frame's time."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def sample_indices(total: int, num_frames: int) -> list[int]:
    """transformers' default_sample_indices_fn: i * total // n for n frames (all of them when fewer)."""
    n = min(num_frames, total)
    return [i * total // n for i in range(n)]


def target_size(height: int, width: int, rules: VideoRules, param: str) -> tuple[int, int]:
    from transformers.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size

    try:
        return get_aspect_ratio_preserving_size(height, width, rules.patch_size,
                                                rules.max_soft_tokens * rules.pooling_kernel_size**2,
                                                rules.pooling_kernel_size)
    except ValueError as e:
        raise InvalidRequestError(f"video frames of {width}x{height} pixels cannot be resized: {e}",
                                  param=param) from None


def resize_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:  # [h, w, 3] uint8 -> [height, width, 3]
    """torchvision.transforms.v2.functional.resize(BICUBIC, antialias=True) as Gemma4VideoProcessor calls it: on
    a contiguous uint8 [frames, 3, h, w] CPU tensor torchvision hands the bytes to torch's own uint8 kernel
    (`_do_native_uint8_resize_on_cpu`), whose fixed-point passes round between the two axes: a float round
    trip differs from it by several levels."""
    if frame.shape[:2] == (height, width):
        return frame
    x = torch.from_numpy(np.array(frame)).permute(2, 0, 1).contiguous()[None]
    y = F.interpolate(x, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    return y[0].permute(1, 2, 0).contiguous().numpy()


def frame_png(frame: np.ndarray) -> bytes:
    """A processed frame as the PNG its MediaItem carries (lossless; fast compression: it is read once)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def decode_video(data: bytes, rules: VideoRules, limits: MediaLimits, param: str) -> DecodedVideo:
    """The video's sampled frames, resized for the vision tower, and their times."""
    import av

    if len(data) > limits.max_video_bytes:
        raise InvalidRequestError(f"video of {len(data)} bytes is over the limit of {limits.max_video_bytes}",
                                  param=param)
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            return _decode(container, rules, limits, param)
    except InvalidRequestError:
        raise
    except (av.FFmpegError, ValueError, OSError, IndexError, ZeroDivisionError) as e:
        raise InvalidRequestError(f"video could not be decoded: {e}", param=param) from None


def _decode(container: Any, rules: VideoRules, limits: MediaLimits, param: str) -> DecodedVideo:
    names = container.format.name.split(",")
    if not any(n in VIDEO_CONTAINERS for n in names):
        raise InvalidRequestError(f"video container {container.format.name!r} is not supported; supported: "
                                  f"{', '.join(VIDEO_CONTAINERS)}", param=param)
    if not container.streams.video:
        raise InvalidRequestError("the file holds no video stream", param=param)
    stream = container.streams.video[0]
    total, rate = int(stream.frames), stream.average_rate
    if not rate:
        raise InvalidRequestError("the video does not state its frame rate", param=param)
    fps = float(rate)
    if total <= 0:  # a container that keeps no count (webm, mkv): count the packets, without decoding them
        if stream.duration is not None and stream.time_base and \
                float(stream.duration * stream.time_base) > limits.max_video_seconds:
            raise InvalidRequestError(f"video of {float(stream.duration * stream.time_base):.1f} s is over the "
                                      f"limit of {limits.max_video_seconds:g} s", param=param)
        total = sum(1 for packet in container.demux(stream) if packet.size)
        container.seek(0)
        if total <= 0:
            raise InvalidRequestError("the video holds no frames", param=param)
    if total / fps > limits.max_video_seconds:
        raise InvalidRequestError(f"video of {total / fps:.1f} s is over the limit of {limits.max_video_seconds:g} s",
                                  param=param)
    width, height = int(stream.codec_context.width), int(stream.codec_context.height)
    if width * height > limits.max_image_pixels or width <= 0 or height <= 0:
        raise InvalidRequestError(f"video frames of {width}x{height} pixels are over the limit of "
                                  f"{limits.max_image_pixels} pixels", param=param)
    th, tw = target_size(height, width, rules, param)
    indices = sample_indices(total, rules.num_frames)
    wanted, frames = set(indices), []
    stream.thread_type = "AUTO"
    for i, frame in enumerate(container.decode(stream)):
        if i > indices[-1]:
            break
        if i in wanted:
            rgb = frame.to_ndarray(format="rgb24")
            if rgb.shape[:2] != (height, width):
                raise InvalidRequestError("the video's frames change size", param=param)
            frames.append(resize_frame(rgb, th, tw))
    if len(frames) != len(indices):
        raise InvalidRequestError(f"the video states {total} frames but {len(frames)} of the {len(indices)} "
                                  "sampled could be decoded", param=param)
    k = rules.pooling_kernel_size
    return DecodedVideo(frames, [i / fps for i in indices], (th // rules.patch_size) * (tw // rules.patch_size) // k**2)
