"""Every projection of a model in each weight precision the CPU serves, from one row to a prompt chunk.

A decode step of a batch of 32, or a prefill chunk of 2048 tokens, runs out of multiply-adds before it runs
out of bandwidth, so what a precision's kernel computes per instruction decides it there; at one row the
bytes decide. For each row count, each precision passes over all the model's projections (qkv, o, gate_up,
down of every layer; the LM head apart, as a step runs it on the sampled rows only):

    fp32        oneDNN (blocked weight), or the fp32 GEMV copy where it takes the rows (bench/linear.py)
    bf16        csrc/gemv_bf16_cpu.cpp at the best level (AMX tiles where the CPU has them, else vdpbf16ps)
    bf16-vdpbf16ps  the same weights at the avx512_bf16 level, on a CPU with AMX (how much the tiles gain)
    int8-qgemv  int8 per channel through the generic block-format kernel (csrc/qgemv_cpu.cpp), as it
                served int8 before
    int8-w8a8   the same codes and rows through csrc/w8a8_cpu.cpp (vpdpbusd), as int8 is served now

Reported: ms per pass, GMAC/s, and each precision's speed relative to bf16 in the same run. The weights are
the checkpoint's own (a Llama-family safetensors: q, k, v, o, gate, up, down of each layer).

    .venv/bin/python -m bench.linear_precisions [--model smollm2-135m] [--rows 1 8 32 256 2048] [--threads 2]

Writes JSON to bench/results/linear_precisions-<stamp>.json and prints it as the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from bench.engine import log, machine
from bench.linear import median_ms
from bench.results_file import write_results
from shared.models.loader import resolve_model
from shared.ops import cpu_isa
from shared.ops.linear import LinearWeight
from shared.ops.quant import int8_per_channel

PRECISIONS = ("fp32", "bf16", "int8-qgemv", "int8-w8a8")
# a precision run at a lower level than the best, and that level
AT_LEVEL = {"bf16-vdpbf16ps": "avx512_bf16"}


def precisions() -> list[str]:
    """What this CPU times: the lower-level runs only where the best level is above theirs."""
    best = cpu_isa.ISA_LEVELS.index(cpu_isa.best_isa())
    return [*PRECISIONS, *(p for p, level in AT_LEVEL.items() if cpu_isa.ISA_LEVELS.index(level) < best)]


def projections(model_dir: Path) -> list[torch.Tensor]:
    """Each layer's fused qkv, o, gate_up and down weights (fp32), as the engine fuses them."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    out = []
    i = 0
    while f"model.layers.{i}.self_attn.q_proj.weight" in tensors:
        p = f"model.layers.{i}."
        w = {k[len(p):]: v.float() for k, v in tensors.items() if k.startswith(p)}
        out += [torch.cat([w["self_attn.q_proj.weight"], w["self_attn.k_proj.weight"], w["self_attn.v_proj.weight"]]),
                w["self_attn.o_proj.weight"],
                torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]),
                w["mlp.down_proj.weight"]]
        i += 1
    if not out:
        raise SystemExit(f"{model_dir}: no Llama-family projections (model.layers.N.self_attn.q_proj.weight)")
    return out


def build(precision: str, weight: torch.Tensor) -> LinearWeight:
    if precision == "fp32":
        return LinearWeight(weight)
    if precision.startswith("bf16"):
        return LinearWeight(weight, weight_dtype=torch.bfloat16)
    codes = int8_per_channel(weight)
    if precision == "int8-w8a8":
        return LinearWeight.quantized(codes)
    lin = LinearWeight.quantized(codes)  # then swapped to the generic block-format kernel
    lin.backend, lin.weight = "qgemv", codes.pack()
    return lin


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256, 2048])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = projections(resolve_model(args.model))
    macs_per_row = sum(w.numel() for w in weights)
    lins: dict[str, list[LinearWeight]] = {}
    for precision in precisions():
        log(f"packing {len(weights)} projections as {precision} ...")
        lins[precision] = [build(precision, w) for w in weights]
    rows = []
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=torch.Generator().manual_seed(m)) for k in {w.shape[1] for w in weights}}
        times = {}
        for precision, ls in lins.items():  # in turn at each row count, so drift reaches every precision alike
            with cpu_isa.use_isa(AT_LEVEL.get(precision, cpu_isa.best_isa())):
                times[precision] = median_ms(lambda: [lin(xs[lin.in_features]) for lin in ls], args.repeats)  # noqa: B023
        row: dict[str, Any] = {"rows": m}
        for precision, ms in times.items():
            row[precision] = {"ms": round(ms, 3), "gmacs": round(m * macs_per_row / ms / 1e6, 1),
                              "vs_bf16": round(times["bf16"] / ms, 2)}
        log(f"rows {m:5d}: " + ", ".join(f"{p} {v['ms']:.2f} ms ({v['gmacs']:.0f} GMAC/s, x{v['vs_bf16']:.2f})"
                                         for p, v in row.items() if p != "rows"))
        rows.append(row)
    result = {"bench": "linear_precisions", "model": args.model, "threads": args.threads, "machine": machine(),
              "isa": cpu_isa.best_isa(),
              "macs_per_row": macs_per_row, "rows": rows}
    write_results(result, args.out, "linear_precisions", indent=1, record_name=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
