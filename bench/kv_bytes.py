"""KV bytes per token: Gemma 4's hybrid cache against a naive cache that keeps K and V of every layer.

For each config (the tiny test configs, and the published Gemma 4 sizes from
shared/models/gemma4/published.py): the naive cache stores K and V of every
layer for every position; the hybrid cache (shared/kv/layout.py groups) stores
nothing for KV-shared layers, one tensor for K=V layers, and for sliding layers
only the blocks of the last window. Per token of a context of T tokens:

    naive(T)  = sum over layers of 2 * kv_heads * head_dim * itemsize
    hybrid(T) = (full-group bytes/token * T + sum over window groups of bytes/token * kept(T)) / T
    kept(T)   = positions the window group's blocks hold at T: min(T, window - 1 + block_size) rounded to blocks

Computed from the layouts the engine builds (KVLayout.of on the model's
kv_layers); for the tiny configs the engine is also built and its measured
layout bytes reported. Writes JSON to bench/results/ and prints it last.

    python -m bench.kv_bytes [--dtype bfloat16] [--contexts 4096 32768 131072]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from bench.results_file import write_results
from bench.serve_report import write_block
from shared.engine.precision import DTYPES
from shared.kv.layout import KVLayout, cdiv
from shared.models.families import spec_from_config
from shared.models.gemma4.published import PUBLISHED_TEXT_CONFIGS, published_text_config


def naive_bytes_per_token(config: Any, itemsize: int) -> int:
    """K and V of every layer (KV-shared ones too), each of its own head count and dim."""
    return sum(2 * lc.num_key_value_heads * lc.head_dim * itemsize
               for lc in (config.per_layer_config[i] for i in range(config.num_hidden_layers)))


def hybrid_bytes_per_token(layout: KVLayout, context: int) -> float:
    """Bytes the hybrid cache holds per token of a `context`-token sequence (KVLayout groups)."""
    bs = layout.block_size
    total = 0
    for g, group in enumerate(layout.groups):
        blocks = cdiv(context, bs) - group.first_kept_block(context, bs)
        total += blocks * layout.unit_nbytes(g)
    return total / context


def report(name: str, config: Any, dtype: torch.dtype, contexts: list[int], block_size: int) -> dict[str, Any]:
    spec = spec_from_config(config, 8192)
    layout = KVLayout.of(spec.kv_layers, 1, block_size, dtype)
    itemsize = layout.itemsize
    naive = naive_bytes_per_token(config, itemsize)
    per_context = {str(t): round(hybrid_bytes_per_token(layout, t), 1) for t in contexts}
    return {
        "config": name,
        "layers": config.num_hidden_layers,
        "stored_layers": len(layout.stored_layers),
        "groups": [{"window": g.sliding_window, "layers": len(g.layers),
                    "bytes_per_token": layout.unit_nbytes(i) // block_size} for i, g in enumerate(layout.groups)],
        "naive_bytes_per_token": naive,
        "hybrid_bytes_per_token": per_context,
        "ratio_naive_over_hybrid": {t: round(naive / b, 2) for t, b in per_context.items()},
    }


def tiny_configs() -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.helpers.gemma4 import VARIANTS, tiny_gemma4_config

    return {f"tiny-{v}": tiny_gemma4_config(v) for v in VARIANTS}


def measured_engine_bytes(config: Any, block_size: int) -> dict[str, int]:
    """The cache an engine allocates for a tiny config, with and without layer groups (same group-0 blocks)."""
    from shared.engine.config import EngineConfig
    from shared.engine.kv_setup import build_kv_cache

    spec = spec_from_config(config, 512)
    out = {}
    for groups in (True, False):
        engine_config = EngineConfig(model="tiny", block_size=block_size, num_kv_blocks=256, max_model_len=512,
                                     max_num_seqs=8, kv_layer_groups=groups)
        layout, _, _ = build_kv_cache(engine_config, spec.kv_layers, "tiny", 512)
        out["hybrid" if groups else "one_group"] = layout.total_nbytes
    return out


def readme_table(result: dict[str, Any]) -> str:
    """The markdown table of a run (bench/README.md, between the kv_bytes markers)."""
    contexts = list(result["rows"][-1]["hybrid_bytes_per_token"])
    lines = [f"KV bytes per token ({result['dtype']}, block {result['block_size']}; published sizes' configs from "
             f"`{result['sources']}`), naive = K and V of every layer:", "",
             "| config | layers (stored) | naive | " + " | ".join(f"hybrid @ {t}" for t in contexts) + " |",
             "|---|---|---|" + "---|" * len(contexts)]
    for row in result["rows"]:
        if row["config"].startswith("tiny"):
            continue
        cells = [f"{row['hybrid_bytes_per_token'][t]:.0f} ({row['ratio_naive_over_hybrid'][t]}x)" for t in contexts]
        lines.append(f"| {row['config']} | {row['layers']} ({row['stored_layers']}) | {row['naive_bytes_per_token']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def update_readme(result: dict[str, Any], readme: Path) -> None:
    if "<!-- kv_bytes:begin -->" not in readme.read_text():  # first run: the table gets its own section
        readme.write_text(readme.read_text().rstrip("\n") + "\n\n## KV bytes per token (Gemma 4)\n")
    write_block(readme, "kv_bytes", readme_table(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    rows = []
    for name, config in tiny_configs().items():
        row = report(name, config, dtype, [64, 256], 4)
        row["engine_bytes_256_blocks"] = measured_engine_bytes(config, 4)
        rows.append(row)
    for name in PUBLISHED_TEXT_CONFIGS:
        rows.append(report(name, published_text_config(name), dtype, args.contexts, args.block_size))
    result = {"bench": "kv_bytes", "dtype": args.dtype, "block_size": args.block_size, "rows": rows,
              "sources": "shared/models/gemma4/published.py"}
    write_results(result, Path(__file__).parent / "results", "kv_bytes", indent=1)
    update_readme(result, Path(__file__).parent / "README.md")
    for row in rows:
        print(f"{row['config']:>18}: naive {row['naive_bytes_per_token']:>7} B/token, hybrid "
              + ", ".join(f"{t}: {b} ({row['ratio_naive_over_hybrid'][t]}x)"
                          for t, b in row["hybrid_bytes_per_token"].items()), file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
