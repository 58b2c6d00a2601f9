"""Which spec builder handles which HF `model_type`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shared.errors import ConfigError
from shared.models.decoder import DecoderSpec
from shared.models.gemma3 import gemma3_spec
from shared.models.llama import llama_spec

SPEC_BUILDERS: dict[str, Callable[[Any, int], DecoderSpec]] = {
    "llama": llama_spec,
    "gemma3_text": gemma3_spec,
}


def spec_from_config(config: Any, max_positions: int | None = None) -> DecoderSpec:
    model_type = getattr(config, "model_type", None)
    builder = SPEC_BUILDERS.get(model_type or "")
    if builder is None:
        raise ConfigError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(SPEC_BUILDERS))}"
        )
    return builder(config, max_positions or config.max_position_embeddings)
