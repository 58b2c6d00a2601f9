"""Gemma 4: the text decoder (dense and MoE) here; images and audio are separate modules when they land."""

from shared.models.gemma4.spec import Gemma4Spec, gemma4_spec
from shared.models.gemma4.text import Gemma4TextLM

__all__ = ["Gemma4Spec", "Gemma4TextLM", "gemma4_spec"]
