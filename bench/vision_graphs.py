"""Gemma 4's vision encoder per image, launched eagerly against replayed from its CUDA graphs.

The tower at the published size (Gemma4VisionConfig's defaults: 768 hidden, 16
layers, 12 heads, 16 px patches pooled 3 x 3) with random weights, and the
embedder into a 2560-wide text model (E4B's). For each soft-token budget the
image processors use (70 ... 1120; an image of that many cells, 9x as many
patches), one image at a time, the two ways taking turns:

    eager   Gemma4Encoders.encode_images: the tower and embedder, kernel by kernel
    graph   the same image through its bucket, replayed (shared/models/gemma4/vision_graphs.py)

Reported per budget: median ms per image each way and eager / graph; the graph's
soft tokens are checked against eager's first. JSON in bench/results/. Needs
CUDA for the graph side (on the CPU it times the bucketed pass run eagerly).

    python -m bench.vision_graphs [--dtype bfloat16] [--repeats 30] [--out-dir bench/results]
    python -m bench.vision_graphs --readme-from bench/results/vision_graphs-<stamp>.json [...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.results_file import write_results
from bench.serve_report import write_block
from shared.models.gemma4.encoder_common import TowerWeights
from shared.models.gemma4.multimodal import Embedder
from shared.models.gemma4.vision import PREFIX, VisionSpec, VisionTower
from shared.models.gemma4.vision_graphs import SOFT_TOKEN_BUDGETS, VisionGraphs

SPEC = VisionSpec(hidden_size=768, intermediate_size=3072, num_layers=16, num_heads=12, num_kv_heads=12, head_dim=64,
                  rms_eps=1e-6, patch_size=16, pooling_kernel_size=3, position_embedding_size=10240,
                  rope_theta=100.0, clipped=False, standardize=False)
TEXT_HIDDEN = 2560
GRIDS = {70: (7, 10), 140: (10, 14), 280: (14, 20), 560: (20, 28), 1120: (28, 40)}  # cells: rows x columns


def random_weights(spec: VisionSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor the tower and its embedder read, random at the published shapes."""
    g = torch.Generator().manual_seed(seed)
    h, f, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_out, kv_out = spec.num_heads * d, spec.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embedder.input_proj.weight": (h, 3 * spec.patch_size**2),
        "patch_embedder.position_embedding_table": (2, spec.position_embedding_size, h),
    }
    for i in range(spec.num_layers):
        p = f"encoder.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q_out, h), p + "self_attn.k_proj.weight": (kv_out, h),
                   p + "self_attn.v_proj.weight": (kv_out, h), p + "self_attn.o_proj.weight": (h, q_out),
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                   p + "mlp.down_proj.weight": (h, f)}
        shapes |= {p + n: (h,) for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                         "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")}
    out = {PREFIX + name: torch.randn(shape, generator=g) * (0.02 if len(shape) > 1 else 1.0)
           for name, shape in shapes.items()}
    out["model.embed_vision.embedding_projection.weight"] = torch.randn(TEXT_HIDDEN, h, generator=g) * 0.02
    return out


def image(cells: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Patches and (column, row) positions of an image of `cells` pooling cells."""
    rows, cols = (3 * n for n in GRIDS[cells])
    g = torch.Generator().manual_seed(seed)
    patches = torch.rand(rows * cols, 3 * SPEC.patch_size**2, generator=g)
    grid = torch.stack(torch.meshgrid(torch.arange(cols), torch.arange(rows), indexing="xy"), dim=-1)
    return patches, grid.reshape(-1, 2)


def timed(fn: Any, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def readme_table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """One row per run and budget: ms per image eager and replayed, and eager / graph."""
    lines = ["The vision encoder per image, eager against replayed from its CUDA graph (`bench/vision_graphs.py`; "
             "the published Gemma 4 tower with random weights; images up to 560 soft tokens replay, larger ones "
             "run eagerly, `GRAPHED_UP_TO`):", "",
             "| run | device | dtype | soft tokens | patches | eager ms | graph ms | eager / graph |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in runs:
        for row in r["rows"]:
            lines.append(f"| `{name}` | {r['device']} | {r['dtype']} | {row['soft_tokens']} | {row['patches']} | "
                         f"{row['eager_ms_p50']:.2f} | {row['graph_ms_p50']:.2f} | {row['eager_over_graph']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--budgets", type=int, nargs="+", default=list(SOFT_TOKEN_BUDGETS))
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--readme-from", type=Path, nargs="+", default=None,
                    help="write bench/README.md's table from these results files and exit")
    args = ap.parse_args(argv)
    if args.readme_from:
        write_block(Path(__file__).parent / "README.md", "vision_graphs",
                    readme_table([(p.name, json.loads(p.read_text())) for p in args.readme_from]))
        return 0
    dtype = getattr(torch, args.dtype)
    weights = random_weights(SPEC)
    tower = VisionTower(SPEC, weights, args.device, dtype)
    embed = Embedder(TowerWeights(weights, "model.embed_vision.", torch.device(args.device), dtype),
                     SPEC.hidden_size, TEXT_HIDDEN, SPEC.rms_eps)
    capture = args.device.startswith("cuda")
    t0 = time.perf_counter()
    graphs = VisionGraphs(tower, embed, args.budgets, dtype)
    if capture:
        graphs.capture()
    capture_s = time.perf_counter() - t0
    print(f"{'captured' if capture else 'built'} buckets {args.budgets} in {capture_s:.1f} s", file=sys.stderr)

    def eager(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return embed(tower.forward_many([(p, q)])[0].to(dtype))

    rows = []
    for cells in args.budgets:
        patches, positions = image(cells, seed=cells)
        want, got = eager(patches, positions), graphs.encode(patches, positions)
        tol = 5e-2 if dtype == torch.bfloat16 else 1e-3
        max_err = float((want.float() - got.float()).abs().max())
        scale = float(want.float().abs().max())
        assert max_err <= tol * max(scale, 1.0), f"{cells} cells: graph differs from eager by {max_err}"
        times: dict[str, list[float]] = {"eager": [], "graph": []}
        for i in range(args.repeats + 3):
            order = ("eager", "graph") if i % 2 == 0 else ("graph", "eager")
            for way in order:
                run = eager if way == "eager" else graphs.encode
                ms = timed(partial(run, patches, positions), args.device)
                if i >= 3:  # warm-up rounds dropped
                    times[way].append(ms)
        row = {"soft_tokens": cells, "patches": patches.shape[0], "max_abs_diff": max_err,
               **{f"{w}_ms_p50": statistics.median(t) for w, t in times.items()}}
        row["eager_over_graph"] = row["eager_ms_p50"] / row["graph_ms_p50"]
        rows.append(row)
        print(f"{cells:5d} soft tokens: eager {row['eager_ms_p50']:.2f} ms, graph {row['graph_ms_p50']:.2f} ms "
              f"({row['eager_over_graph']:.2f}x)", file=sys.stderr)
    device_name = torch.cuda.get_device_name() if capture else "cpu"
    result = {"bench": "vision_graphs", "device": device_name, "dtype": args.dtype, "captured": capture,
              "capture_s": capture_s, "repeats": args.repeats, "spec": SPEC.__dict__, "text_hidden": TEXT_HIDDEN,
              "rows": rows}
    path = write_results(result, args.out_dir, "vision_graphs", record_name=True)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
