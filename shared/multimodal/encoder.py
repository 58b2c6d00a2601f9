"""Media items to soft tokens in an engine: decode and preprocess at intake, encode in batches at the step.

    MediaItem(bytes) ──prepare (intake: media.decode_*, MediaProcessor; a video frame: its PNG)──► PreparedMedia
                     (undecodable, or a count that differs from its placeholders: the caller's 400)
    [PreparedMedia of every request in a step] ──encode_batch (MediaTowers)──► [num_tokens, hidden] each
                     images and video frames: one tower pass over all of them; each distinct content once

(seams.py: Gemma 4's processor and towers, or gemma4_unified's encoder-free ones.)

Encoding waits for the step that first reads an item, so the images of requests
that arrive together go through the tower together (larger projections, one
pass), and the same image in several of them is encoded once. The cache is a
small LRU of encoder outputs keyed by the item's digest: the same image sent
again (a later turn, n > 1, a retried request) is not encoded twice in this
process; an item found there at intake needs no preparing. A prefill service
also fills it from kv_transfer's shared cache and offers what it encoded there
(`peek` / `remember`, called from the service's event loop: the cache has a lock).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from shared.errors import InvalidRequestError
from shared.multimodal.items import AUDIO, IMAGE, VIDEO, MediaInput, MediaItem, PreparedMedia
from shared.multimodal.media import MediaLimits, decode_audio, decode_image
from shared.multimodal.processor import ProcessedAudio, ProcessedImage
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
        self._lock = threading.Lock()  # the engine thread and a service's event loop both use the cache
        self.num_encoded = 0  # items run through a tower (cache misses)
        self.num_cache_hits = 0
        self.num_batches = 0  # tower passes (encode_batch calls that encoded anything)

    @property
    def reads(self) -> frozenset[str]:
        vision = {IMAGE, VIDEO} if self.processor.video_rules is not None else {IMAGE}
        return frozenset(vision if self.encoders.vision else set()) | (
            frozenset({AUDIO}) if self.encoders.audio else frozenset())

    @property
    def dtype(self) -> torch.dtype:
        return self.encoders.dtype

    def cached(self, item: MediaItem) -> torch.Tensor | None:  # [num_tokens, hidden]
        with self._lock:
            out = self._cache.get(item.content_hash)
            if out is None or out.shape[0] != item.num_tokens:
                return None
            self._cache.move_to_end(item.content_hash)
            self.num_cache_hits += 1
            return out

    def peek(self, content_hash: bytes) -> torch.Tensor | None:
        """The cached output for a digest, if any (not counted as a hit, not made the newest)."""
        with self._lock:
            return self._cache.get(content_hash)

    def remember(self, content_hash: bytes, output: torch.Tensor) -> None:
        """Cache an output encoded elsewhere ([num_tokens, hidden], moved to the towers' device and dtype)."""
        self._remember(content_hash, output.to(self.encoders.device, self.encoders.dtype))

    def prepare(self, item: MediaItem) -> torch.Tensor | PreparedMedia:
        """The item's soft tokens if the cache holds them, else the item decoded and cut for its tower. Raises
        InvalidRequestError for media that cannot be read or whose soft tokens differ from its placeholders."""
        out = self.cached(item)
        if out is not None:
            return out
        if item.kind not in self.reads:
            raise InvalidRequestError(f"this model does not read {item.kind} input", param="messages")
        features: ProcessedImage | ProcessedAudio
        if item.kind == IMAGE:
            features = self.processor.image(decode_image(item.data, self.limits, "messages"))
        elif item.kind == VIDEO:  # a frame the router sampled and resized
            features = self.processor.video_frame(np.asarray(decode_image(item.data, self.limits, "messages")))
        else:
            features = self.processor.audio(decode_audio(item.data, item.audio_format, self.limits, "messages"))
        if features.num_soft_tokens != item.num_tokens:
            raise InvalidRequestError(f"{item.kind} yields {features.num_soft_tokens} soft tokens, the prompt holds "
                                      f"{item.num_tokens} placeholders for it", param="messages")
        return PreparedMedia(item, features)

    def prepare_input(self, media: MediaInput) -> None:
        """Give a request's item its soft tokens from the cache, or else what its tower pass needs."""
        ready = self.prepare(media.item)
        if isinstance(ready, torch.Tensor):
            media.embeds = ready
        else:
            media.prepared = ready

    def encode_batch(self, prepared: Sequence[PreparedMedia], request_id: str = "") -> list[torch.Tensor]:
        """Soft tokens of each item, in order: images in one tower pass, each distinct content encoded once."""
        outs: dict[bytes, torch.Tensor] = {}
        todo: dict[bytes, PreparedMedia] = {}
        for p in prepared:
            hit = self.cached(p.item)
            if hit is not None:
                outs[p.item.content_hash] = hit
            else:
                todo.setdefault(p.item.content_hash, p)
        if todo:
            t0 = time.perf_counter()
            images = [(key, p.features) for key, p in todo.items() if isinstance(p.features, ProcessedImage)]
            if images:
                encoded = self.encoders.encode_images([(f.patches, f.positions) for _, f in images])
                outs.update((key, e) for (key, _), e in zip(images, encoded, strict=True))
            for key, p in todo.items():
                if isinstance(p.features, ProcessedAudio):  # one clip a pass (its tower masks padded frames)
                    outs[key] = self.encoders.encode_audio(p.features.frames, p.features.frame_mask)
            self.num_encoded += len(todo)
            self.num_batches += 1
            logger.debug("request %s: encoded %d media items (%d images) in %.1f ms", request_id, len(todo),
                         len(images), 1e3 * (time.perf_counter() - t0))
            for key in todo:
                self._remember(key, outs[key])
        return [outs[p.item.content_hash] for p in prepared]

    def encode(self, item: MediaItem, request_id: str = "") -> torch.Tensor:  # [num_tokens, hidden]
        """One item now (prepared and encoded)."""
        ready = self.prepare(item)
        return ready if isinstance(ready, torch.Tensor) else self.encode_batch([ready], request_id)[0]

    def _remember(self, key: bytes, out: torch.Tensor) -> None:
        if self.cache_items <= 0:
            return
        with self._lock:
            self._cache[key] = out
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_items:
                self._cache.popitem(last=False)
