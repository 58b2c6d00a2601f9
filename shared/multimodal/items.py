"""The media of one request as the engine carries it: where each item's soft tokens sit in the prompt.

    prompt:  t t t <boi> I I I I I I <eoi> t t <boa> A A A <eoa> t
                         └ item 0: offset 4, 6 tokens ┘     └ item 1 ┘

An item keeps its original bytes (what the router checked; any engine that must
compute its prompt positions, prefill or a decode recomputing after preemption,
encodes them) and a digest of them. The digest joins the prefix-cache key of
every block its tokens touch, so the same text with another image never hits
the cache; the chained hash carries it into every later block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.multimodal.processor import ProcessedAudio, ProcessedImage

IMAGE = "image"
AUDIO = "audio"
VIDEO = "video"  # one sampled frame of a video (video.py): a small image behind <video> placeholders
SEEN_BOTH_WAYS = (IMAGE, VIDEO)  # kinds whose soft tokens may attend to each other (never split by a chunk)


@dataclass(frozen=True)
class MediaItem:
    kind: str  # IMAGE | AUDIO | VIDEO
    offset: int  # prompt position of its first soft token
    num_tokens: int  # its soft tokens (placeholders in the prompt)
    content_hash: bytes  # media.content_hash(data)
    data: bytes  # the file as sent (png, jpeg, ...; wav or mp3); VIDEO: the frame, processed, as a PNG
    audio_format: str = ""  # AUDIO: "wav" | "mp3"

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass
class PreparedMedia:
    """An item decoded and cut for its tower, waiting for the step that encodes it."""

    item: MediaItem
    features: ProcessedImage | ProcessedAudio


@dataclass
class MediaInput:
    """An item and, once encoded, its soft tokens (shared by the chunks that read them); until then, what its
    intake prepared (None: nothing yet, e.g. a handoff's media, prepared if this engine must compute them)."""

    item: MediaItem
    embeds: torch.Tensor | None = None  # [num_tokens, hidden]
    prepared: PreparedMedia | None = None


def block_media_key(media: Sequence[MediaInput] | Sequence[MediaItem], block_index: int, block_size: int) -> bytes:
    """What joins a block's prefix hash (`hash_block`'s media_key): the digest of each item it overlaps."""
    if not media:
        return b""
    lo, hi = block_index * block_size, (block_index + 1) * block_size
    items = [m.item if isinstance(m, MediaInput) else m for m in media]
    return b"".join(item.content_hash for item in items if item.offset < hi and item.end > lo)


def fit_chunk_end(media: Sequence[MediaInput], start: int, end: int) -> int:
    """Where a prompt chunk [start, end) must end so that no image seen both ways is split: before the image
    the cut falls in, or after it when the chunk starts inside or at it (a chunk may then pass its budget)."""
    for m in media:
        if m.item.kind in SEEN_BOTH_WAYS and m.item.offset < end < m.item.end:
            return m.item.offset if m.item.offset > start else m.item.end
    return end


def check_placement(media: Sequence[MediaItem], prompt: Sequence[int], placeholder_ids: dict[str, int]) -> str | None:
    """What is wrong with the items' places in the prompt (None: each covers only its placeholder tokens, in
    order, without overlap)."""
    last = 0
    for i, item in enumerate(media):
        if item.offset < last or item.num_tokens <= 0 or item.end > len(prompt):
            return f"media item {i} ({item.kind}) lies outside the prompt or overlaps another"
        want = placeholder_ids.get(item.kind)
        if want is None or any(t != want for t in prompt[item.offset:item.end]):
            return f"media item {i} ({item.kind}) does not cover its placeholder tokens"
        last = item.end
    num_placeholders = sum(1 for t in prompt if t in placeholder_ids.values())
    if num_placeholders != sum(item.num_tokens for item in media):
        return (f"the prompt holds {num_placeholders} image/audio/video placeholder tokens, its media "
                f"{sum(item.num_tokens for item in media)} soft tokens")
    return None
