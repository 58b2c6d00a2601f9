"""Tool-call parsers, one module per format, registered by name (see base.py)."""

from __future__ import annotations

import importlib

MODULES = ("hermes", "llama3_json", "pythonic", "gemma4")


def load_all() -> None:
    for module in MODULES:
        importlib.import_module(f"services.router.tool_parsers.{module}")
