"""Where baton keeps what it makes once per machine: converted models, compiled CPU kernels, tiny checkpoints.

Its own module, below both the model loader and the kernels it builds, so neither imports the other for it.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "baton"
