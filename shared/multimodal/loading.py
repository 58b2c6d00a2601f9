"""A checkpoint's media side: its multimodal config (router and engines) and its towers (engines only).

A `Gemma4ForConditionalGeneration` checkpoint with a `vision_config` or an
`audio_config` reads images or audio; its towers' tensors live under
`model.vision_tower.`, `model.audio_tower.`, `model.embed_vision.` and
`model.embed_audio.`, and its `processor_config.json` says how media is cut.
A `Gemma4UnifiedForConditionalGeneration` checkpoint (model type `gemma4_unified`)
has no towers, only embedders (`model.vision_embedder.`, `model.embed_vision.`,
`model.embed_audio.`), and its own processor rules (unified_processor.py).
Any other checkpoint is text-only: a media part sent to it is a 400.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from shared.models.checkpoint import read_prefixed_weights
from shared.models.gemma4.multimodal import Gemma4Encoders, MultimodalConfig, multimodal_config
from shared.models.gemma4.unified_media import Gemma4UnifiedEncoders
from shared.models.gemma4.vision_graphs import budgets_up_to
from shared.multimodal.encoder import MediaEncoder
from shared.multimodal.processor import Gemma4MediaProcessor
from shared.multimodal.seams import MediaProcessor, MediaTowers
from shared.multimodal.unified_processor import Gemma4UnifiedMediaProcessor

logger = logging.getLogger(__name__)

TOWER_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
                  "model.vision_embedder.")
MULTIMODAL_ARCHITECTURES = frozenset({"Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration"})


def _is_unified(config: Any) -> bool:
    return getattr(config, "model_type", None) == "gemma4_unified"


def read_multimodal(hf_dir: Path, arch_name: str) -> tuple[MultimodalConfig, MediaProcessor, Any] | None:
    """(its multimodal config, its processor, the full HF config) when the checkpoint reads media, else None."""
    if arch_name not in MULTIMODAL_ARCHITECTURES:
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    mm = multimodal_config(config)
    if mm is None:
        return None
    if _is_unified(config):
        unified = Gemma4UnifiedMediaProcessor.from_dir(hf_dir)
        unified.check_against(config)
        return mm, unified, config
    return mm, Gemma4MediaProcessor.from_dir(hf_dir), config


def load_media_encoder(hf_dir: Path, arch_name: str, device: str, dtype: torch.dtype, cache_items: int = 64,
                       cuda_graphs: bool = False) -> tuple[MediaEncoder, MultimodalConfig] | None:
    """The checkpoint's towers, ready to encode (None: a text-only checkpoint); on CUDA with `cuda_graphs`, its
    vision tower captured per image-size bucket (vision_graphs.py)."""
    found = read_multimodal(hf_dir, arch_name)
    if found is None:
        return None
    mm, processor, config = found
    t0 = time.monotonic()
    weights = read_prefixed_weights(hf_dir, TOWER_PREFIXES)
    towers: MediaTowers = (Gemma4UnifiedEncoders(config, weights, device, dtype) if _is_unified(config)
                           else Gemma4Encoders(config, weights, device, dtype))
    logger.info("loaded the media %s (%s) in %.2f s", "embedders" if _is_unified(config) else "towers",
                ", ".join(k for k, on in (("vision", mm.has_vision), ("audio", mm.has_audio)) if on),
                time.monotonic() - t0)
    if cuda_graphs and device.startswith("cuda") and isinstance(towers, Gemma4Encoders) and towers.vision is not None:
        assert isinstance(processor, Gemma4MediaProcessor)
        towers.use_vision_graphs(budgets_up_to(processor.max_vision_soft_tokens), capture=True)
    return MediaEncoder(processor, towers, cache_items=cache_items), mm
