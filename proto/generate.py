"""Regenerate the Python stubs: `python proto/generate.py` (a test checks they are fresh)."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto" / "baton" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> None:
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *PROTOS]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
