"""gemma4_unified's media side (the 12B model's layout): encoder-free, with no vision or audio tower.

    merged patches [n, (pool * patch)^2 * 3] (one per soft token, padding already dropped)
      ──LayerNorm──► dense (+bias) ──LayerNorm──► + pos[col, 0] + pos[row, 1] ──LayerNorm──► embedder
    waveform frames [n, audio_samples_per_token] (raw 16 kHz samples, one frame per soft token)
      ──► embedder
    embedder: x ──RMSNorm (no scale)──► linear (no bias) ──► [n, text hidden]

transformers' Gemma4UnifiedVisionEmbedder runs on the processor's batch padded
to `max_soft_tokens` and strips the padding rows after it; every step acts on
one patch alone, so running only the real patches gives the same rows.

Checkpoint tensors, as saved (transformers renames them as it loads, its
conversion_mapping.py; baton reads the saved names):
    model.vision_embedder.{patch_ln1,patch_dense,patch_ln2,pos_norm}.{weight,bias}, .pos_embedding
    model.embed_vision.embedding_projection.weight   (transformers: embed_vision.multimodal_embedder....)
    model.embed_audio.embedding_projection.weight

Attention over images: the unified model's forward builds Gemma 3's mask (an
image's soft tokens see each other on every layer, full and sliding, past the
sliding window), not Gemma 4's sliding-only one (`MultimodalConfig.bidirectional_every_layer`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from shared.errors import ConfigError
from shared.models.gemma4.encoder_common import TowerWeights
from shared.models.gemma4.multimodal import Embedder

LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which the embedder's three norms keep


class _LayerNorm:
    def __init__(self, weights: TowerWeights, name: str, size: int) -> None:
        self.size = size
        self.weight = weights.get(f"{name}.weight", (size,))
        self.bias = weights.get(f"{name}.bias", (size,))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, size]
        return F.layer_norm(x, (self.size,), self.weight, self.bias, LAYER_NORM_EPS)


class UnifiedVisionEmbedder:
    """transformers' Gemma4UnifiedVisionEmbedder: merged pixel patches straight into the text model's space."""

    def __init__(self, vision: Any, text_hidden: int, weights: TowerWeights,
                 projection: TowerWeights) -> None:  # a Gemma4UnifiedVisionConfig; the embedder's own weights
        patch_dim = (vision.patch_size * vision.pooling_kernel_size) ** 2 * 3
        embed_dim = vision.mm_embed_dim
        if vision.output_proj_dims != embed_dim:
            raise ConfigError(f"vision output_proj_dims {vision.output_proj_dims} must equal mm_embed_dim {embed_dim}:"
                              " the embedder projects the patch embeddings")
        self.patch_dim = patch_dim
        self.num_positions = vision.mm_posemb_size  # per axis, in merged patches
        self.patch_ln1 = _LayerNorm(weights, "patch_ln1", patch_dim)
        self.dense_weight = weights.get("patch_dense.weight", (embed_dim, patch_dim))
        self.dense_bias = weights.get("patch_dense.bias", (embed_dim,))
        self.patch_ln2 = _LayerNorm(weights, "patch_ln2", embed_dim)
        self.pos_embedding = weights.get("pos_embedding", (vision.mm_posemb_size, 2, embed_dim))
        self.pos_norm = _LayerNorm(weights, "pos_norm", embed_dim)
        self.embedder = Embedder(projection, embed_dim, text_hidden, vision.rms_norm_eps)

    def __call__(
        self,
        patches: torch.Tensor,  # [n, patch_dim]
        positions: torch.Tensor,  # [n, 2] int64 (column, row), each in [0, mm_posemb_size)
    ) -> torch.Tensor:  # [n, text hidden]
        assert patches.shape[-1] == self.patch_dim and int(positions.max()) < self.num_positions, \
            "checked by the processor: patch size and positions fit the checkpoint"
        w = self.dense_weight
        x = self.patch_ln2(F.linear(self.patch_ln1(patches.to(w.device, w.dtype)), w, self.dense_bias))
        positions = positions.to(self.pos_embedding.device)
        pos = self.pos_embedding[positions[:, 0], 0] + self.pos_embedding[positions[:, 1], 1]
        return self.embedder(self.pos_norm(x + pos))


class Gemma4UnifiedEncoders:
    """A `Gemma4UnifiedForConditionalGeneration` checkpoint's vision and audio embedders (either may be absent)."""

    def __init__(self, config: Any, weights: Mapping[str, torch.Tensor], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:  # a Gemma4UnifiedConfig
        device = torch.device(device)
        text_hidden = config.text_config.hidden_size
        self.vision: UnifiedVisionEmbedder | None = None
        self.audio: Embedder | None = None
        if config.vision_config is not None:
            self.vision = UnifiedVisionEmbedder(config.vision_config, text_hidden,
                                                TowerWeights(weights, "model.vision_embedder.", device, dtype),
                                                TowerWeights(weights, "model.embed_vision.", device, dtype))
        if config.audio_config is not None:
            audio = config.audio_config
            self.audio = Embedder(TowerWeights(weights, "model.embed_audio.", device, dtype), audio.audio_embed_dim,
                                  text_hidden, audio.rms_norm_eps)
        self.dtype, self.device = dtype, device

    @torch.inference_mode()
    def encode_image(
        self,
        patches: torch.Tensor,  # [num_soft_tokens, (pool * patch)^2 * 3]
        positions: torch.Tensor,  # [num_soft_tokens, 2]
    ) -> torch.Tensor:  # [num_soft_tokens, text hidden]
        assert self.vision is not None, "checked by the caller: the model reads images"
        return self.vision(patches, positions)

    @torch.inference_mode()
    def encode_images(
        self,
        images: Sequence[tuple[torch.Tensor, torch.Tensor]],  # (patches [n_i, patch_dim], positions [n_i, 2])
    ) -> list[torch.Tensor]:  # per image [n_i, text hidden]
        """Several images in one pass: every step acts on one patch alone, so their patches go through together."""
        soft = self.encode_image(torch.cat([p for p, _ in images]), torch.cat([pos for _, pos in images]))
        return list(soft.split([p.shape[0] for p, _ in images]))

    @torch.inference_mode()
    def encode_audio(
        self,
        frames: torch.Tensor,  # [num_frames, audio_samples_per_token]
        frame_mask: torch.Tensor,  # [num_frames] bool
    ) -> torch.Tensor:  # [num_soft_tokens, text hidden]
        assert self.audio is not None, "checked by the caller: the model reads audio"
        return self.audio(frames.to(self.device)[frame_mask.to(self.device)])
