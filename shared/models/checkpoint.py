"""A local HF checkpoint directory to a text config and the text model's tensors.

    config.json ── architectures[0] ──► ARCHITECTURES: which text model, where its tensors live
                                         (unsupported: ConfigError naming it)
    model.safetensors.index.json ──► shards ──► tensors under the text prefix, renamed to the
    (or every *.safetensors)                    *ForCausalLM names the models read; the rest
                                                (vision, audio towers) is never read

A multimodal checkpoint (`*ForConditionalGeneration`: the text config nested as
`text_config`, the text weights under `model.language_model.`) serves text-only.
Shapes are checked against the spec before any model is built (`check_shapes`),
so a checkpoint with a missing or misshapen tensor fails at load naming it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.errors import ConfigError

logger = logging.getLogger(__name__)

_TEXT = "model."
_NESTED_TEXT = "model.language_model."


@dataclass(frozen=True)
class Architecture:
    """How one HF architecture stores its text model."""

    text_model_types: tuple[str, ...]  # the text config's model_type must be one of these
    text_prefix: str  # where the text model's `model.*` tensors live in the checkpoint
    nested_config: bool  # the text config is config.text_config


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(("llama",), _TEXT, False),
    "Gemma3ForCausalLM": Architecture(("gemma3_text",), _TEXT, False),
    "Gemma3ForConditionalGeneration": Architecture(("gemma3_text",), _NESTED_TEXT, True),
    "Gemma4ForCausalLM": Architecture(("gemma4_text",), _TEXT, False),
    "Gemma4ForConditionalGeneration": Architecture(("gemma4_text",), _NESTED_TEXT, True),
    "Gemma4UnifiedForCausalLM": Architecture(("gemma4_unified_text",), _TEXT, False),
    "Gemma4UnifiedForConditionalGeneration": Architecture(("gemma4_unified_text",), _NESTED_TEXT, True),
}


def architecture_of(hf_dir: Path) -> tuple[str, Architecture]:
    """The checkpoint's architecture from config.json (`architectures[0]`, else its model_type)."""
    try:
        raw = json.loads((hf_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{hf_dir / 'config.json'} is unreadable: {e}") from None
    names = raw.get("architectures") or []
    if not names:  # older exports name no architecture: infer it from the model type
        by_type = {"llama": "LlamaForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "gemma4_text": "Gemma4ForCausalLM",
                   "gemma4": "Gemma4ForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration",
                   "gemma4_unified_text": "Gemma4UnifiedForCausalLM",
                   "gemma4_unified": "Gemma4UnifiedForConditionalGeneration"}
        names = [by_type.get(raw.get("model_type", ""), f"(model_type {raw.get('model_type')!r})")]
    name = names[0]
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise ConfigError(f"architecture {name} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    return name, arch


def text_config(config: Any, name: str, arch: Architecture) -> Any:
    """The text model's config inside an HF config of architecture `name`."""
    text = config.text_config if arch.nested_config else config
    if text is None or getattr(text, "model_type", None) not in arch.text_model_types:
        got = getattr(text, "model_type", None)
        raise ConfigError(f"{name} checkpoint whose text config is {got!r}, not {' or '.join(arch.text_model_types)}")
    return text


def _shard_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"{index} is unreadable: {e}") from None
        files = [hf_dir / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{hf_dir} lacks the shards its index names: {', '.join(missing)}")
        return files
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{hf_dir} holds no *.safetensors weights")
    return files


def _local_name(name: str, arch: Architecture) -> str | None:
    """A checkpoint tensor's name as the text model reads it (None: not the text model's)."""
    if name.startswith(arch.text_prefix):
        return _TEXT + name[len(arch.text_prefix):]
    if name == "lm_head.weight":
        return name
    return None


def read_text_weights(hf_dir: Path, arch: Architecture) -> dict[str, torch.Tensor]:
    """Every text-model tensor of the checkpoint, by its *ForCausalLM name."""
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    for f in _shard_files(hf_dir):
        logger.info("loading weights %s", f.name)
        with safe_open(str(f), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                local = _local_name(name, arch)
                if local is not None:
                    weights[local] = shard.get_tensor(name)
    return weights


def read_prefixed_weights(hf_dir: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Every tensor whose name starts with one of `prefixes`, by its checkpoint name (the media towers)."""
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    for f in _shard_files(hf_dir):
        with safe_open(str(f), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if name.startswith(prefixes):
                    weights[name] = shard.get_tensor(name)
    return weights


def read_text_shapes(hf_dir: Path, arch: Architecture) -> dict[str, tuple[int, ...]]:
    """Every text-model tensor's shape, from the shards' headers alone (no tensor is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in _shard_files(hf_dir):
        with safe_open(str(f), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                local = _local_name(name, arch)
                if local is not None:
                    shapes[local] = tuple(shard.get_slice(name).get_shape())
    return shapes


def check_shapes(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, Any]) -> None:
    """ConfigError naming the first tensor the model needs that is missing or has another shape. `found`: the
    checkpoint's tensors, or their shapes."""
    for name, shape in expected.items():
        tensor = found.get(name)
        if tensor is None:
            raise ConfigError(f"checkpoint lacks tensor {name!r}")
        got = tuple(tensor.shape if isinstance(tensor, torch.Tensor) else tensor)
        if got != shape:
            raise ConfigError(f"checkpoint tensor {name!r} has shape {got}, the config implies {shape}")
