"""Gemma 4's encoders as one piece: each tower, then its embedder into the text model's space.

    image patches ──VisionTower──► [n, vision hidden] ──embed_vision──► [n, text hidden]
    audio mel     ──AudioTower───► [n, audio out]     ──embed_audio───► [n, text hidden]
    embedder: x ──RMSNorm (no scale)──► linear (no bias)

The text model then takes these rows in place of the placeholder tokens' embeddings
(`Gemma4TextLM.forward(..., soft_tokens=...)`): the placeholders' per-layer inputs
use the pad token's identity (the PLE vocabulary may lack the placeholder ids).
Where the text config says `use_bidirectional_attention: "vision"`, each image's
soft tokens see each other on sliding layers (`MultimodalConfig.bidirectional_vision`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shared.models.gemma4.audio import AudioTower, audio_spec
from shared.models.gemma4.encoder_common import TowerWeights, rms
from shared.models.gemma4.vision import VisionTower, vision_spec
from shared.models.gemma4.vision_graphs import VisionGraphs


@dataclass(frozen=True)
class MultimodalConfig:
    """What the serving stack needs to know of a multimodal checkpoint, without its weights."""

    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    audio_token_id: int
    boa_token_id: int
    eoa_token_id: int
    pad_token_id: int
    has_vision: bool
    has_audio: bool
    bidirectional_vision: bool  # sliding layers let an image's soft tokens see each other
    # gemma4_unified: Gemma 3's mask instead, an image's soft tokens see each other on every layer, full and
    # sliding, past the sliding window (unified_media.py)
    bidirectional_every_layer: bool = False
    video_token_id: int | None = None

    @property
    def placeholder_token_ids(self) -> tuple[int, ...]:
        """Ids the multimodal model embeds as the pad token wherever they stand (soft tokens then replace those
        with media behind them): transformers' Gemma4Model does so for prompts and generated tokens alike."""
        ids = (self.image_token_id, self.audio_token_id, self.video_token_id)
        return tuple(i for i in ids if i is not None)


def multimodal_config(config: Any) -> MultimodalConfig | None:
    """The multimodal part of a `Gemma4Config` or `Gemma4UnifiedConfig` (None: a text-only config or checkpoint
    without towers)."""
    vision, audio = getattr(config, "vision_config", None), getattr(config, "audio_config", None)
    if vision is None and audio is None:
        return None
    text = config.text_config
    return MultimodalConfig(
        image_token_id=int(config.image_token_id), boi_token_id=int(config.boi_token_id),
        eoi_token_id=int(config.eoi_token_id), audio_token_id=int(config.audio_token_id),
        boa_token_id=int(config.boa_token_id), eoa_token_id=int(config.eoa_token_index),
        pad_token_id=int(text.pad_token_id or 0), has_vision=vision is not None, has_audio=audio is not None,
        bidirectional_vision=getattr(text, "use_bidirectional_attention", None) == "vision",
        bidirectional_every_layer=getattr(config, "model_type", None) == "gemma4_unified",
        video_token_id=None if getattr(config, "video_token_id", None) is None else int(config.video_token_id),
    )


class Embedder:
    """transformers' Gemma4MultimodalEmbedder: RMSNorm without scale, then a projection."""

    def __init__(self, weights: TowerWeights, in_size: int, out_size: int, eps: float) -> None:
        self.proj = weights.get("embedding_projection.weight", (out_size, in_size))
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        return F.linear(rms(x.to(self.proj.dtype), None, self.eps), self.proj)


class Gemma4Encoders:
    """The vision and audio towers of a checkpoint with their embedders (either may be absent)."""

    def __init__(self, config: Any, weights: Mapping[str, torch.Tensor], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        device = torch.device(device)
        text_hidden = config.text_config.hidden_size
        self.vision: VisionTower | None = None
        self.audio: AudioTower | None = None
        if config.vision_config is not None:
            spec = vision_spec(config.vision_config)
            self.vision = VisionTower(spec, weights, device, dtype)
            self.embed_vision = Embedder(TowerWeights(weights, "model.embed_vision.", device, dtype),
                                         spec.hidden_size, text_hidden, config.vision_config.rms_norm_eps)
        if config.audio_config is not None:
            aspec = audio_spec(config.audio_config)
            self.audio = AudioTower(aspec, weights, device, dtype)
            self.embed_audio = Embedder(TowerWeights(weights, "model.embed_audio.", device, dtype),
                                        aspec.output_size, text_hidden, config.audio_config.rms_norm_eps)
        self.dtype, self.device = dtype, device
        self.vision_graphs: VisionGraphs | None = None

    def use_vision_graphs(self, cells: Sequence[int], capture: bool) -> VisionGraphs:
        """Encode each image through a bucket of `cells` soft tokens (vision_graphs.py), replayed from a CUDA
        graph when `capture` (CUDA only), else the same padded pass eagerly."""
        assert self.vision is not None, "checked by the caller: the model reads images"
        self.vision_graphs = VisionGraphs(self.vision, self.embed_vision, cells, self.dtype)
        if capture:
            self.vision_graphs.capture()
        return self.vision_graphs

    @torch.inference_mode()
    def encode_image(
        self,
        patches: torch.Tensor,  # [num_patches, 3 * patch_size**2]
        positions: torch.Tensor,  # [num_patches, 2]
    ) -> torch.Tensor:  # [num_soft_tokens, text hidden]
        return self.encode_images([(patches, positions)])[0]

    @torch.inference_mode()
    def encode_images(
        self,
        images: Sequence[tuple[torch.Tensor, torch.Tensor]],  # (patches [n_i, 3 * p * p], positions [n_i, 2])
    ) -> list[torch.Tensor]:  # per image [num_soft_tokens_i, text hidden]
        """Several images in one tower pass (its projections over all their patches at once), or each through its
        bucket when the tower has its graphs (`use_vision_graphs`)."""
        assert self.vision is not None, "checked by the caller: the model reads images"
        graphs = self.vision_graphs
        if graphs is not None and all(graphs.fits(p.shape[0]) for p, _ in images):
            return [graphs.encode(p, q) for p, q in images]  # one bucket each
        pooled = self.vision.forward_many(images)
        soft = self.embed_vision(torch.cat(pooled).to(self.dtype))
        return list(soft.split([p.shape[0] for p in pooled]))

    @torch.inference_mode()
    def encode_audio(
        self,
        mel: torch.Tensor,  # [num_frames, num_mel_bins]
        frame_mask: torch.Tensor,  # [num_frames] bool
    ) -> torch.Tensor:  # [num_soft_tokens, text hidden]
        assert self.audio is not None, "checked by the caller: the model reads audio"
        return self.embed_audio(self.audio.forward(mel, frame_mask))
