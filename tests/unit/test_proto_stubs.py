"""The checked-in Python stubs are what `python proto/generate.py` makes of the .proto files now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_generated_stubs_are_fresh(tmp_path: Path) -> None:
    # in a process of its own: grpc_tools' protoc imported beside the rest of the suite crashes the interpreter
    subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), str(tmp_path)], check=True, cwd=ROOT)
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert made, "protoc wrote nothing"
    stale = [str(rel) for rel in made if (ROOT / rel).read_bytes() != (tmp_path / rel).read_bytes()]
    assert not stale, f"regenerate with `python proto/generate.py`: {stale}"
