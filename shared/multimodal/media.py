"""Decoding what a client sent: image files (Pillow) and audio clips (wav, mp3 through libsndfile).

Everything here runs on untrusted bytes, so each step is bounded and every
failure is an `InvalidRequestError` naming the content part (`param`):

    bytes ──size limit──► decode (format checked: png, jpeg, webp, gif, bmp; wav, mp3)
          ──pixel / duration limits──► RGB image | mono float32 waveform at 16 kHz

Pillow's own decompression-bomb guard is kept on, below our pixel limit.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.errors import InvalidRequestError

IMAGE_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP"})
AUDIO_FORMATS = frozenset({"wav", "mp3"})
AUDIO_SAMPLE_RATE = 16_000  # what Gemma 4's feature extractor reads


@dataclass(frozen=True)
class MediaLimits:
    """Bounds on one request's media (the router's settings)."""

    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    max_audio_bytes: int = 25 * 1024 * 1024
    max_audio_seconds: float = 30.0  # Gemma 4's feature extractor reads at most 30 s
    max_items: int = 8  # images, audio clips and videos in one request
    max_video_bytes: int = 64 * 1024 * 1024
    max_video_seconds: float = 600.0  # the router decodes every frame up to the last one sampled


def content_hash(data: bytes) -> bytes:
    """16-byte digest naming a media item's bytes: its prefix-cache and encoder-cache key."""
    return hashlib.blake2b(data, digest_size=16).digest()


def decode_image(data: bytes, limits: MediaLimits, param: str) -> Any:
    """The image as an RGB `PIL.Image`, fully decoded."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_image_bytes:
        raise InvalidRequestError(f"image of {len(data)} bytes is over the limit of {limits.max_image_bytes}",
                                  param=param)
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format not in IMAGE_FORMATS:
                raise InvalidRequestError(f"image format {img.format} is not supported; supported: "
                                          f"{', '.join(sorted(IMAGE_FORMATS)).lower()}", param=param)
            if img.width * img.height > limits.max_image_pixels:
                raise InvalidRequestError(f"image of {img.width}x{img.height} pixels is over the limit of "
                                          f"{limits.max_image_pixels} pixels", param=param)
            return img.convert("RGB")  # decodes it all here: a truncated file fails now, not later
    except InvalidRequestError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise InvalidRequestError(f"image could not be decoded: {e}", param=param) from None


def decode_audio(data: bytes, audio_format: str, limits: MediaLimits, param: str) -> np.ndarray:  # [samples]
    """The clip as mono float32 samples at 16 kHz (other rates resampled linearly)."""
    import soundfile

    if audio_format not in AUDIO_FORMATS:
        raise InvalidRequestError(f"audio format {audio_format!r} is not supported; supported: "
                                  f"{', '.join(sorted(AUDIO_FORMATS))}", param=param)
    if len(data) > limits.max_audio_bytes:
        raise InvalidRequestError(f"audio of {len(data)} bytes is over the limit of {limits.max_audio_bytes}",
                                  param=param)
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            if f.format.lower() != audio_format:
                raise InvalidRequestError(f"audio says format {audio_format!r} but holds {f.format.lower()!r}",
                                          param=param)
            seconds = f.frames / f.samplerate if f.frames >= 0 else float("inf")
            if seconds > limits.max_audio_seconds:
                raise InvalidRequestError(f"audio of {seconds:.1f} s is over the limit of "
                                          f"{limits.max_audio_seconds:g} s", param=param)
            samples = f.read(dtype="float32", always_2d=True)
            rate = f.samplerate
    except InvalidRequestError:
        raise
    except (RuntimeError, ValueError, TypeError, soundfile.LibsndfileError) as e:
        raise InvalidRequestError(f"audio could not be decoded: {e}", param=param) from None
    if samples.shape[0] == 0:
        raise InvalidRequestError("audio clip is empty", param=param)
    mono = samples.mean(axis=1)
    return resample(mono, rate) if rate != AUDIO_SAMPLE_RATE else mono


def resample(samples: np.ndarray, rate: int) -> np.ndarray:  # [n] -> [n * 16000 / rate] float32
    """Linear interpolation to 16 kHz (exact for 16 kHz input, which is what the fidelity tests send)."""
    num_out = max(1, round(len(samples) * AUDIO_SAMPLE_RATE / rate))
    t = np.arange(num_out, dtype=np.float64) * (rate / AUDIO_SAMPLE_RATE)
    return np.interp(t, np.arange(len(samples)), samples).astype(np.float32)
