"""The checked-in Python stubs are what `python proto/generate.py` makes of the .proto files now."""

from __future__ import annotations

from pathlib import Path

from proto.generate import ROOT, generate


def test_the_generated_stubs_are_fresh(tmp_path: Path) -> None:
    generate(tmp_path)
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert made, "protoc wrote nothing"
    stale = [str(rel) for rel in made if (ROOT / rel).read_bytes() != (tmp_path / rel).read_bytes()]
    assert not stale, f"regenerate with `python proto/generate.py`: {stale}"
