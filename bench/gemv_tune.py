"""The few-row GEMV kernel (shared/ops/triton_gemv.py) over a grid of tilings, against cuBLAS, on a lent GPU.

At batch 1 on an H200 the kernel took 6.0 us a call with its default tiling against cuBLAS's 3.9 for the
projection alone (cuda_loop-20261127-034114-kernels-b1.txt), 120 calls a SmolLM2 decode step. This times each
of SmolLM2-135M's four projections as the decode step calls them (qkv with the norm, o and down with the
residual add, gate_up with the norm and the SiLU gate) at 1 and 8 rows, for every tiling of the grid (at one
row the products summed in registers, many narrow programs; at eight both forms), inside a
CUDA graph (triton's do_bench_cudagraph: launch gaps as a captured step sees them), beside cuBLAS's product
alone and the unfused sequence the kernel replaces (Triton norm / SiLU kernels + cuBLAS). Every configuration
tried is in the JSON; the summary line gives the fastest per shape, and its "best" is what
shared/ops/triton_gemv_tuned.json keeps per GPU model (bench/cuda_loop.py --gemv-tuned times a decode step with
it). Prepared to fit a lent GPU's minutes:

    python -m bench.gemv_tune [--rows 1 8] [--quick]        (--device cpu: a smoke run through the interpreter)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.results_file import write_results

# (name, N, K, what the kernel folds in); SmolLM2-135M: hidden 576, 9 + 2 x 3 heads of 64, MLP 1536
SHAPES = [("qkv", 960, 576, "norm"), ("o", 576, 576, "residual"), ("gate_up", 1536, 576, "norm+gated"),
          ("down", 576, 1536, "residual")]
# tensor-core tilings (rows padded to 16), and products summed in registers: many narrow programs, K in one or
# two tiles (a batch-1 projection is a few hundred KB: its time is round trips to memory, not bytes)
DOT_GRID = {"block_n": (16, 32), "block_k": (64, 128, 256), "num_warps": (4,), "num_stages": (3,), "dot": (True,)}
ROW_GRID = {"block_n": (2, 4, 8), "block_k": (512, 1024, 2048), "num_warps": (2, 4), "num_stages": (1,),
            "dot": (False,)}
ROW_GRID_MANY = {"block_n": (4, 8), "block_k": (256, 1024), "num_warps": (4,), "num_stages": (1,), "dot": (False,)}
QUICK_GRID = {"block_n": (4, 16), "block_k": (128, 1024), "num_warps": (4,), "num_stages": (1,), "dot": (True, False)}


def grid_configs(grid: dict[str, tuple[Any, ...]], k: int) -> list[Any]:
    """The tilings of a grid that a K this size can use (tensor-core tiles at least 16 columns wide; no K tile
    over K's power of two)."""
    from shared.ops.triton_gemv import GemvConfig

    configs = [GemvConfig(*values) for values in itertools.product(*grid.values())]
    return [c for c in configs if (c.block_n >= 16 or not c.dot) and c.block_k <= triton_pow2(k)]


def triton_pow2(k: int) -> int:
    return 1 << (k - 1).bit_length()


CONFIG_FIELDS = ("block_n", "block_k", "num_warps", "num_stages", "dot")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def timer(device: str) -> Callable[[Callable[[], Any]], float]:
    """Microseconds a call: in a CUDA graph on a GPU, wall clock through the interpreter elsewhere."""
    if device.startswith("cuda"):
        from triton.testing import do_bench_cudagraph

        return lambda fn: 1e3 * float(do_bench_cudagraph(fn, rep=20))

    def wall(fn: Callable[[], Any]) -> float:
        fn()
        t0 = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t0)

    return wall


def add_device_args(parser: argparse.ArgumentParser) -> None:
    """--device and --out, as the tuning benches share them."""
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")


def device_setup(args: argparse.Namespace, script: str) -> tuple[torch.dtype, Callable[[Callable[[], Any]], float]]:
    """The dtype a tuning bench times in (bf16 on a GPU; fp32 through the interpreter) and its timer."""
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"bench/{script} needs a CUDA device (or --device cpu for a smoke run)")
    return (torch.bfloat16 if args.device.startswith("cuda") else torch.float32), timer(args.device)


def tune_shape(name: str, n: int, k: int, fold: str, rows: int, configs: list[Any], dtype: torch.dtype,
               device: str, bench: Callable[[Callable[[], Any]], float], gen: torch.Generator) -> dict[str, Any]:
    """One projection at `rows` rows: cuBLAS alone, the unfused sequence, and the kernel in every tiling."""
    from shared.ops import triton_decoder_ops as tops
    from shared.ops.triton_gemv import DEFAULT_CONFIG, GemvConfig, gemv

    gated = "gated" in fold
    weight = (torch.randn(2 * n if gated else n, k, generator=gen) * k ** -0.5).to(device, dtype)
    x = torch.randn(rows, k, generator=gen).to(device, dtype)
    norm = torch.ones(k, device=device, dtype=dtype) if "norm" in fold else None
    residual = torch.randn(rows, n, generator=gen).to(device, dtype) if fold == "residual" else None

    def fused(config: GemvConfig) -> torch.Tensor:
        return gemv(x, weight, norm_weight=norm, residual=residual, gated=gated, config=config)

    def unfused() -> torch.Tensor:  # what the decode step runs without the kernel
        h = tops.rms_norm(x, norm, 1e-5) if norm is not None else x
        y = torch.nn.functional.linear(h, weight)
        y = tops.silu_mul(y) if gated else y
        return y + residual if residual is not None else y

    row: dict[str, Any] = {"shape": name, "n": n, "k": k, "gated": gated, "rows": rows, "folds": fold,
                           "cublas_us": round(bench(lambda: torch.nn.functional.linear(x, weight)), 2),
                           "unfused_us": round(bench(unfused), 2), "configs": []}
    want = unfused().float()
    for config in configs:
        try:
            got = fused(config).float()
            err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
            us = bench(partial(fused, config))
        except Exception as e:  # a tiling that does not compile (shared memory, registers): recorded
            row["configs"].append({**config.__dict__, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        row["configs"].append({**config.__dict__, "us": round(us, 2), "max_rel_err": round(err, 5)})
    timed = [c for c in row["configs"] if "us" in c]
    if timed:
        row["fastest"] = min(timed, key=lambda c: c["us"])
        default = next((c for c in timed if GemvConfig(**{f: c[f] for f in CONFIG_FIELDS}) == DEFAULT_CONFIG),
                       None)
        row["default_us"] = default["us"] if default else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--quick", action="store_true", help="an 8-point grid")
    add_device_args(parser)
    args = parser.parse_args()
    dtype, bench = device_setup(args, "gemv_tune.py")
    from shared.ops.triton_gemv import DEFAULT_CONFIG

    gen = torch.Generator().manual_seed(0)
    points: list[dict[str, Any]] = []
    best: dict[str, Any] = {}
    grids: dict[str, list[dict[str, tuple[Any, ...]]]] = {
        "quick": [QUICK_GRID], "one": [ROW_GRID], "many": [DOT_GRID, ROW_GRID_MANY]}
    t0 = time.perf_counter()
    for (name, n, k, fold), rows in itertools.product(SHAPES, args.rows):
        shape_grids = grids["quick" if args.quick else "one" if rows <= 2 else "many"]
        configs = [c for grid in shape_grids for c in grid_configs(grid, k)]
        if DEFAULT_CONFIG not in configs:
            configs.insert(0, DEFAULT_CONFIG)
        row = tune_shape(name, n, k, fold, rows, configs, dtype, args.device, bench, gen)
        if "fastest" in row:
            best[f"{name}@{rows}"] = {"n": n, "k": k, "gated": row["gated"], "fastest_us": row["fastest"]["us"],
                                      "default_us": row["default_us"], "cublas_us": row["cublas_us"],
                                      "unfused_us": row["unfused_us"],
                                      "config": {key: row["fastest"][key] for key in CONFIG_FIELDS}}
        log(f"[{time.perf_counter() - t0:.0f} s] {len(configs)} tilings: "
            + json.dumps({key: v for key, v in row.items() if key != "configs"}))
        points.append(row)
    result = {"bench": "gemv_tune", "device": torch.cuda.get_device_name() if args.device.startswith("cuda")
              else args.device, "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
              "timer": "triton do_bench_cudagraph (us a call)" if args.device.startswith("cuda") else "wall clock",
              "grids": {name: [{k: list(v) for k, v in g.items()} for g in gs] for name, gs in grids.items()},
              "best": best, "points": points}
    path = write_results(result, args.out, "gemv_tune", record_name=True)
    print(json.dumps({"file": path.name, "best": best}))


if __name__ == "__main__":
    main()
