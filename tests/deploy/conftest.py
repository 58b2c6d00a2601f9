"""Fixtures of the deploy tests: the deploy files, checked with no container engine or cluster."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require_module(name: str, pip_name: str) -> ModuleType:
    """Import a validator the deploy tests need; skip without it, fail under CI (env var CI)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        message = f"{name} is not installed; pip install {pip_name}"
        if os.environ.get("CI"):
            pytest.fail(f"{message} (CI is set, so this is a failure, not a skip)", pytrace=False)
        pytest.skip(message)
