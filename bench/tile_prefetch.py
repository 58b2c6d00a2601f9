"""How far ahead the AMX bf16 GEMV should prefetch the weight it streams, measured in one process.

The tile loads of `csrc/gemv_bf16_impl.h` wait for DRAM with nothing else in flight, so the amx level
prefetches the weight into L2 some bytes ahead of them (`torch.ops.baton_cpu.gemv_bf16_prefetch` sets how
far; 0 turns it off). For each row count, every distance makes one pass over all the model's projections
as a decode step runs them (qkv, o, gate_up with its SiLU gate, down; 135 MB of bf16 for SmolLM2, more
than any cache holds), the distances in turn within each round, so this machine's drift reaches them
alike. Reported: the median ms of a pass for each distance and the median over rounds of its ratio to no
prefetch (above 1: faster). The bits do not depend on the distance (tested).

    .venv/bin/python -m bench.tile_prefetch [--rows 1 16 32 64 256] [--distances 0 4096 8192 16384 32768]

Needs AMX (Sapphire Rapids or later); writes bench/results/tile_prefetch-<stamp>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.engine import log, machine
from bench.linear_precisions import build, projections
from bench.results_file import write_results
from shared.models.loader import resolve_model
from shared.ops import cpu_isa


def one_pass(lins: list, xs: dict[int, torch.Tensor]) -> float:
    """ms for one decode step's projections, layer by layer (every third weight, gate_up, with its gate)."""
    t0 = time.perf_counter()
    for j, lin in enumerate(lins):
        x = xs[lin.in_features]
        lin.silu_mul(x) if j % 4 == 2 else lin(x)
    return (time.perf_counter() - t0) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64, 256])
    parser.add_argument("--distances", type=int, nargs="+", default=[0, 4096, 8192, 16384, 32768])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if cpu_isa.best_isa() != "amx":
        raise SystemExit(f"this CPU's best level is {cpu_isa.best_isa()}: the prefetch is the amx level's")
    torch.set_num_threads(args.threads)
    weights = projections(resolve_model(args.model))
    log(f"packing {len(weights)} projections as bf16 ...")
    lins = [build("bf16", w) for w in weights]
    default = torch.ops.baton_cpu.gemv_bf16_prefetch(0)
    rows: list[dict[str, Any]] = []
    try:
        for m in args.rows:
            xs = {k: torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                  for k in {w.shape[1] for w in weights}}
            times: dict[int, list[float]] = {d: [] for d in args.distances}
            for _ in range(args.rounds + 1):  # the first round warms up and is dropped
                for d in args.distances:
                    torch.ops.baton_cpu.gemv_bf16_prefetch(d)
                    times[d].append(one_pass(lins, xs))
            base = times[args.distances[0]][1:]
            row: dict[str, Any] = {"rows": m}
            for d, ts in times.items():
                ts = ts[1:]
                row[str(d)] = {"ms": round(statistics.median(ts), 3),
                               "vs_first": round(statistics.median(b / t for b, t in zip(base, ts, strict=True)), 3),
                               "runs_ms": [round(t, 3) for t in ts]}
            log(f"rows {m:4d}: " + ", ".join(f"{d} B {row[str(d)]['ms']:.2f} ms (x{row[str(d)]['vs_first']:.2f})"
                                             for d in args.distances))
            rows.append(row)
    finally:
        torch.ops.baton_cpu.gemv_bf16_prefetch(default)
    result = {"bench": "tile_prefetch", "model": args.model, "threads": args.threads, "machine": machine(),
              "default_bytes": default, "distances": args.distances, "rounds": args.rounds,
              "weight_bytes": sum(lin.nbytes for lin in lins), "rows": rows}
    write_results(result, args.out, "tile_prefetch", indent=1, record_name=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
