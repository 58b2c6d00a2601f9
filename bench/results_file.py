"""One place for the stamped results file every benchmark writes: `<out_dir>/<name>-<YYYYmmdd-HHMMSS>.json`.

Readers find runs by that pattern (engine_gemma4.readme_table globs `engine-*.json`; README tables cite the
file name), so the name and each bench's JSON layout (indent, or one compact line for big sweeps) are kept
exactly. Logging "wrote ..." and printing the summary line stay with the caller: they differ per bench.
Imports nothing from bench/, so any bench can use it without an import cycle.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STAMP_FORMAT = "%Y%m%d-%H%M%S"  # sorts in time order as text; one run a second per bench is enough


def write_results(result: dict[str, Any], out_dir: Path, name: str, *, indent: int | None = 2,
                  record_name: bool = False, default: Callable[[Any], Any] | None = None) -> Path:
    """Write `result` as JSON to `<out_dir>/<name>-<stamp>.json`, creating out_dir, and return that path.

    indent=None writes one line with no spaces after separators (the serving sweeps' large files).
    record_name=True first stores the file's own name in result["file"], so the JSON (and README tables
    built from it) can cite the run. default is json.dumps' hook for values JSON lacks (e.g. sets).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}-{time.strftime(STAMP_FORMAT)}.json"
    if record_name:
        result["file"] = path.name
    separators = (",", ":") if indent is None else None
    path.write_text(json.dumps(result, indent=indent, separators=separators, default=default))
    return path
