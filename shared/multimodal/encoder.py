"""Media items to soft tokens in an engine: decode, preprocess, encode; the result cached by content hash.

    MediaItem(bytes) ──media.decode_*──► image | wave ──MediaProcessor──► patches | audio frames
                     ──MediaTowers──► [num_tokens, hidden]   (checked against the item's count)

(seams.py: Gemma 4's processor and towers, or gemma4_unified's encoder-free ones.)

The cache is a small LRU of encoder outputs keyed by the item's digest: the
same image sent again (a later turn, n > 1, a retried request) is not encoded
twice in this process.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch

from shared.errors import InvalidRequestError
from shared.multimodal.items import AUDIO, IMAGE, MediaItem
from shared.multimodal.media import MediaLimits, decode_audio, decode_image
from shared.multimodal.seams import MediaProcessor, MediaTowers

logger = logging.getLogger(__name__)


class MediaEncoder:
    """A model's media path: processor, towers and the encoder-output cache."""

    def __init__(self, processor: MediaProcessor, encoders: MediaTowers,
                 limits: MediaLimits | None = None, cache_items: int = 64) -> None:
        self.processor = processor
        self.encoders = encoders
        self.limits = limits or MediaLimits()
        self.cache_items = cache_items
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.num_encoded = 0  # items run through a tower (cache misses)
        self.num_cache_hits = 0

    @property
    def reads(self) -> frozenset[str]:
        return frozenset({IMAGE} if self.encoders.vision else set()) | (
            frozenset({AUDIO}) if self.encoders.audio else frozenset())

    def encode(self, item: MediaItem, request_id: str = "") -> torch.Tensor:  # [num_tokens, hidden]
        cached = self._cache.get(item.content_hash)
        if cached is not None and cached.shape[0] == item.num_tokens:
            self._cache.move_to_end(item.content_hash)
            self.num_cache_hits += 1
            return cached
        t0 = time.perf_counter()
        out = self._encode(item)
        if out.shape[0] != item.num_tokens:
            raise InvalidRequestError(f"{item.kind} yields {out.shape[0]} soft tokens, the prompt holds "
                                      f"{item.num_tokens} placeholders for it", param="messages")
        self.num_encoded += 1
        logger.debug("request %s: encoded %s (%d tokens) in %.1f ms", request_id, item.kind, item.num_tokens,
                     1e3 * (time.perf_counter() - t0))
        if self.cache_items > 0:
            self._cache[item.content_hash] = out
            while len(self._cache) > self.cache_items:
                self._cache.popitem(last=False)
        return out

    def _encode(self, item: MediaItem) -> torch.Tensor:
        if item.kind not in self.reads:
            raise InvalidRequestError(f"this model does not read {item.kind} input", param="messages")
        if item.kind == IMAGE:
            image = self.processor.image(decode_image(item.data, self.limits, "messages"))
            return self.encoders.encode_image(image.patches, image.positions)
        clip = self.processor.audio(decode_audio(item.data, item.audio_format, self.limits, "messages"))
        return self.encoders.encode_audio(clip.features, clip.frame_mask)
