"""The GEMV kernel against oneDNN on a model's own projections, at decode batch sizes.

For each projection shape of the model (qkv, o, gate_up, down over all layers,
and the LM head) and each row count, both paths run over every layer's weight
in turn, so the weights come from DRAM as they do in a decode step. Reported:
ms per pass over the model, effective weight bandwidth (GB/s) and GFLOP/s, the
ratio oneDNN / GEMV, and whether both gave the same bits (they must).

    .venv/bin/python -m bench.linear [--model smollm2-135m] [--rows 1 2 4 8 16 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.results_file import write_results
from shared.models.loader import load_model
from shared.ops.attention import paged_attention_ref
from shared.ops.linear import LinearWeight


def median_ms(fn: Any, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def onednn(lin: LinearWeight, x: torch.Tensor) -> torch.Tensor:
    return lin._onednn(x)


def gemv(lin: LinearWeight, x: torch.Tensor) -> torch.Tensor:
    assert lin.gemv is not None
    return torch.ops.baton_cpu.gemv(x, lin.gemv, lin.out_features, lin.gemv_k_block)


def bench_group(name: str, weights: list[LinearWeight], rows: list[int], repeats: int) -> list[dict[str, Any]]:
    out = []
    nbytes = sum(w.nbytes for w in weights)
    for m in rows:
        x = torch.randn(m, weights[0].in_features)
        same = all(torch.equal(onednn(w, x), gemv(w, x)) for w in weights)
        t_onednn = median_ms(lambda: [onednn(w, x) for w in weights], repeats)  # noqa: B023
        t_gemv = median_ms(lambda: [gemv(w, x) for w in weights], repeats)  # noqa: B023
        flop = 2 * m * nbytes / 4
        row = {"weights": name, "rows": m, "onednn_ms": round(t_onednn, 3), "gemv_ms": round(t_gemv, 3),
               "onednn_gbs": round(nbytes / t_onednn / 1e6, 1), "gemv_gbs": round(nbytes / t_gemv / 1e6, 1),
               "onednn_gflops": round(flop / t_onednn / 1e6, 1), "gemv_gflops": round(flop / t_gemv / 1e6, 1),
               "speedup": round(t_onednn / t_gemv, 2), "same_bits": same}
        print(f"{name:8s} rows {m:3d}: oneDNN {t_onednn:7.2f} ms ({row['onednn_gbs']:5.1f} GB/s), GEMV "
              f"{t_gemv:7.2f} ms ({row['gemv_gbs']:5.1f} GB/s), x{row['speedup']:.2f}, same bits: {same}",
              file=sys.stderr, flush=True)
        out.append(row)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, paged_attention_ref).model  # attention unused: projections only
    if model.lm_head.gemv is None:
        print("the GEMV kernel is not in use here (BATON_CPU_GEMV=0, no oneDNN, or it did not build)",
              file=sys.stderr)
        return 1
    groups = {name: [getattr(layer, name) for layer in model.layers]
              for name in ("w_qkv", "w_o", "w_gate_up", "w_down")}
    groups["lm_head"] = [model.lm_head]
    rows = [r for name, ws in groups.items() for r in bench_group(name, ws, args.rows, args.repeats)]
    totals = []
    for m in args.rows:
        at = [r for r in rows if r["rows"] == m]
        t_o, t_g = sum(r["onednn_ms"] for r in at), sum(r["gemv_ms"] for r in at)
        totals.append({"rows": m, "onednn_ms": round(t_o, 2), "gemv_ms": round(t_g, 2), "speedup": round(t_o / t_g, 2)})
        print(f"all projections, rows {m:3d}: oneDNN {t_o:.1f} ms, GEMV {t_g:.1f} ms, x{t_o / t_g:.2f}",
              file=sys.stderr)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {"bench": "linear", "model": args.model, "threads": args.threads, "commit": commit,
              "torch": torch.__version__, "rows": rows, "totals": totals}
    path = write_results(result, args.out, "linear", indent=1)
    print(f"wrote {path}", file=sys.stderr)
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
