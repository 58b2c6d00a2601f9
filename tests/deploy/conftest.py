"""Fixtures of the deploy tests: the deploy files, checked with no container engine or cluster."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


def require_module(name: str, pip_name: str) -> ModuleType:
    """Import a validator the deploy tests need (a test dependency: its absence fails, never skips)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        pytest.fail(f"{name} is not installed; pip install {pip_name} (a test dependency)", pytrace=False)
