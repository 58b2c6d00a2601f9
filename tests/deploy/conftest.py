"""Fixtures of the deploy tests, and the size of every image they built in the run's summary."""

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


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The images the container tests built, with their sizes (deploy/README.md quotes them)."""
    from tests.deploy.images import BUILDS

    for build in BUILDS:
        terminalreporter.write_line(f"image {build.image}: {build.size_bytes / 1e6:.0f} MB "
                                    f"(podman build {build.seconds:.0f} s)")
