"""One MoE layer's experts alone: baton's CPU op against transformers' experts, same weights, alternating rounds.

gemma-4-26B-A4B's expert bank (128 experts, hidden 2816, width 704, top 8),
random bf16 weights. Timed per call, in turn, `--rounds` times per token count:

    transformers   Gemma4TextExperts with the implementation transformers picks (grouped_mm), in `--hf-dtype`
    baton          PackedExperts (csrc/moe_cpu.cpp) on the bf16 weights
    torch loop     TorchExperts (one F.linear pair per expert hit) on the same bf16 weights upcast to fp32

Reports the median ms per call of each, the ratio of medians, and each round's
ratio (baton over the transformers call right before it). Writes JSON to
bench/results/ and prints it as the last line.

    python -m bench.moe_experts [--tokens 1 16 128] [--rounds 5] [--hf-dtype bfloat16|float32] [--readme-from JSON]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.results_file import write_results
from bench.serve_report import write_block
from shared.models.gemma4.moe import TorchExperts
from shared.models.gemma4.moe_cpu import PackedExperts

NUM_EXPERTS, HIDDEN, WIDTH, TOP_K = 128, 2816, 704, 8


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def time_ms(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def hf_experts(gate_up: torch.Tensor, down: torch.Tensor, dtype: torch.dtype) -> Any:
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    config = Gemma4TextConfig(hidden_size=HIDDEN, num_experts=NUM_EXPERTS, top_k_experts=TOP_K,
                              moe_intermediate_size=WIDTH, enable_moe_block=True, num_hidden_layers=2,
                              layer_types=["sliding_attention", "full_attention"], vocab_size=256,
                              hidden_size_per_layer_input=0)
    config._experts_implementation = "grouped_mm"  # what from_pretrained picks for this model on this torch
    module = Gemma4TextExperts(config).to(dtype)
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up)
        module.down_proj.copy_(down)
    return module


def readme_table(result: dict[str, Any], file: str) -> str:
    """bench/README.md's table of one run (between the moe_experts markers)."""
    lines = [f"One layer of gemma-4-26B-A4B's experts (`bench/moe_experts.py`, `{file}`): bf16 weights; transformers "
             f"in {result['hf_dtype']} ({result['hf_experts_implementation']}); median ms per call over alternating "
             "rounds:", "",
             "| tokens | experts hit | transformers ms | baton ms | torch loop ms | baton speedup (rounds) |",
             "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        med = row["median_ms"]
        rounds = " ".join(f"{x:.2f}" for x in row["speedup_rounds"])
        lines.append(f"| {row['tokens']} | {row['experts_hit']} | {med['transformers']:.1f} | {med['baton']:.1f} | "
                     f"{med['torch_loop']:.1f} | {row['speedup_vs_transformers']:.2f}x ({rounds}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hf-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--readme-from", type=Path, default=None, help="only rewrite the README table from this JSON")
    args = parser.parse_args()
    readme = Path(__file__).parent / "README.md"
    if args.readme_from is not None:
        write_block(readme, "moe_experts", readme_table(json.loads(args.readme_from.read_text()), args.readme_from.name))
        return
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(NUM_EXPERTS, 2 * WIDTH, HIDDEN, generator=gen) * 0.02).bfloat16()
    down = (torch.randn(NUM_EXPERTS, HIDDEN, WIDTH, generator=gen) * 0.02).bfloat16()
    hf_dtype = getattr(torch, args.hf_dtype)
    hf = hf_experts(gate_up, down, hf_dtype)
    ours = PackedExperts(gate_up, down)
    loop = TorchExperts(gate_up.float(), down.float())
    del gate_up, down
    rows = []
    for n in args.tokens:
        h = torch.randn(n, HIDDEN, generator=gen)
        index = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(n)])
        weights = torch.rand(n, TOP_K, generator=gen)
        h_hf, w_hf = h.to(hf_dtype), weights.to(hf_dtype)
        calls: dict[str, Callable[[], Any]] = {
            "transformers": lambda h_hf=h_hf, w_hf=w_hf, index=index: hf(h_hf, index, w_hf),
            "baton": lambda h=h, weights=weights, index=index: ours(h, weights, index),
            "torch_loop": lambda h=h, weights=weights, index=index: loop(h, weights, index),
        }
        with torch.no_grad():
            for fn in calls.values():
                fn()  # warm-up
            runs: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(args.rounds):
                for name, fn in calls.items():
                    runs[name].append(time_ms(fn))
        row = {"tokens": n, "runs_ms": runs, "median_ms": {k: statistics.median(v) for k, v in runs.items()},
               "experts_hit": int(index.unique().numel())}
        row["speedup_vs_transformers"] = row["median_ms"]["transformers"] / row["median_ms"]["baton"]
        row["speedup_rounds"] = [t / b for t, b in zip(runs["transformers"], runs["baton"], strict=True)]
        rows.append(row)
        log(f"{n} tokens ({row['experts_hit']} experts hit): " + ", ".join(
            f"{k} {v:.1f} ms" for k, v in row["median_ms"].items())
            + f"; baton x{row['speedup_vs_transformers']:.2f} (rounds: "
            + " ".join(f"{x:.2f}" for x in row["speedup_rounds"]) + ")")
    result = {"bench": "moe_experts", "model": "gemma-4-26B-A4B", "weights": "bfloat16", "hf_dtype": args.hf_dtype,
              "hf_experts_implementation": "grouped_mm", "torch_threads": torch.get_num_threads(), "rows": rows}
    out = write_results(result, Path(__file__).parent / "results", "moe_experts", indent=1)
    log(f"wrote {out}")
    write_block(readme, "moe_experts", readme_table(result, out.name))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
