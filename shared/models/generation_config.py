"""A model's own sampling defaults (temperature, top_p, ...), as vLLM's `--generation-config auto`.

    source "auto":  <hf dir>/generation_config.json ──► the sampling fields it sets
                    none set and the model is a packaged alias ──► its model card's recommendation
    source "vllm":  nothing (the API's own defaults: temperature 1, top_p 1, ...)
    source <dir>:   <dir>/generation_config.json

A request's own values always win over these. The packaged GGUF files carry no
generation config (GGUF has no place for one that these files use), so each alias names
the values its model card recommends; without them SmolLM2 samples at temperature 1,
which makes a 135M model's first reply gibberish.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from shared.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling values a request gets for the fields it leaves out (None: the API's default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    source: str = "none"  # where they came from, for the startup log

    def as_dict(self) -> dict[str, float | int]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "source" and getattr(self, f.name) is not None}


# the model cards' recommended sampling (HuggingFaceTB/SmolLM2-135M-Instruct's usage example;
# google/gemma-3-270m's generation_config.json)
ALIAS_DEFAULTS = {
    "smollm2-135m": GenerationDefaults(temperature=0.2, top_p=0.9, source="SmolLM2-135M-Instruct's model card"),
    "gemma3-270m": GenerationDefaults(top_k=64, top_p=0.95, source="gemma-3-270m's generation_config.json"),
}


def _from_file(path: Path) -> GenerationDefaults | None:
    if not path.is_file():
        return None
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    values = {f.name: raw[f.name] for f in fields(GenerationDefaults) if f.name != "source" and f.name in raw}
    if not values:
        return None
    return GenerationDefaults(**values, source=str(path))


def load_generation_defaults(source: str, model_spec: str, hf_dir: Path) -> GenerationDefaults:
    """The defaults `source` ("auto", "vllm" or a directory) gives the model `model_spec` at `hf_dir`."""
    if source == "vllm":
        return GenerationDefaults(source="vllm (none)")
    if source != "auto":
        folder = Path(source).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"generation config {source!r}: expected auto, vllm or a directory")
        return _from_file(folder / "generation_config.json") or GenerationDefaults(source=f"{folder} (none)")
    found = _from_file(hf_dir / "generation_config.json")
    if found is not None:
        return found
    return ALIAS_DEFAULTS.get(model_spec, GenerationDefaults(source="the model sets none"))
