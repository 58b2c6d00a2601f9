"""A prefill's side of the encoder-output cache kv_transfer keeps for every prefill instance.

    Prefill(request with media) ──fetch──► digests this engine's cache lacks ─GetEncoderOutputs─► kv_transfer
                                           found: into the engine's cache (intake finds them: no encode)
         ... the engine encodes the rest at its step ...
    reply sent ──offer (in the background)──► outputs of the digests kv_transfer lacked ─PutEncoderOutputs─►

Neither call can fail a request: a cache that cannot be reached finds nothing
and keeps nothing. Outputs are checked against the item they claim to be (its
soft-token count, the model's hidden size) before the engine sees them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from shared.engine.async_engine import AsyncEngine
from shared.multimodal.items import MediaItem
from shared.service.kv_client import KVTransferClient
from shared.wire_encoder import encoder_outputs_key

logger = logging.getLogger(__name__)


class SharedEncoderOutputs:
    def __init__(self, aengine: AsyncEngine, kv: KVTransferClient) -> None:
        self.aengine = aengine
        self.kv = kv

    @property
    def model(self) -> str:
        """Whose outputs: the model's identity and the towers' dtype (outputs of another never match)."""
        loaded = self.aengine.engine.loaded
        assert loaded.media_encoder is not None
        return encoder_outputs_key(loaded.identity, loaded.media_encoder.dtype)

    async def fetch(self, address: str, media: Sequence[MediaItem], request_id: str) -> list[bytes]:
        """Fill the engine's encoder cache from kv_transfer for the items it lacks; returns the digests
        kv_transfer lacked too (to offer once this engine has encoded them)."""
        encoder = self.aengine.engine.loaded.media_encoder
        if encoder is None or not media:
            return []
        items = {m.content_hash: m for m in media if encoder.peek(m.content_hash) is None}
        if not items:
            return []
        found = await self.kv.get_encoder_outputs(address, self.model, list(items))
        hidden = self.aengine.engine.loaded.spec.hidden_size
        for digest, output in found.items():
            item = items.get(digest)
            if item is None or tuple(output.shape) != (item.num_tokens, hidden):
                logger.warning("request %s: kv_transfer's encoder output for a %s is %s, not [%s, %d]: ignored",
                               request_id, item.kind if item else "digest not asked for", list(output.shape),
                               item.num_tokens if item else "?", hidden)
                continue
            encoder.remember(digest, output)
        if found:
            logger.debug("request %s: %d of %d encoder outputs from kv_transfer", request_id, len(found), len(items))
        return [d for d in items if d not in found]

    def offer(self, address: str, digests: Sequence[bytes]) -> None:
        """Offer kv_transfer the outputs this engine now holds for these digests, without waiting."""
        encoder = self.aengine.engine.loaded.media_encoder
        if encoder is None or not digests:
            return
        outputs = {d: out for d in digests if (out := encoder.peek(d)) is not None}
        if not outputs:
            return
        self.kv.in_background(self.kv.put_encoder_outputs(address, self.model, outputs))
