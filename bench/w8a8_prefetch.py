"""Whether the W8A8 GEMM's later passes over a panel should prefetch the next one, measured in one process.

A decode batch of 7 to 256 rows passes each int8 panel several times (six rows a pass, csrc/w8a8_impl.h).
Only the first pass read the panel from DRAM; the others computed from L1 while the memory bus idled.
`torch.ops.baton_cpu.w8a8_next_prefetch` turns on (and off) the later passes prefetching the thread's next
panel into L2. For each row count, one pass over all the model's projections as a decode step runs them
(qkv, o, gate_up, down of every layer, int8 per channel: 106 MB for SmolLM2), with the prefetch off and on
in turn within each round, so that this machine's drift reaches both alike. Reported: the median ms of a
pass each way and the median over rounds of off / on (above 1: the prefetch is faster). The bits do not
depend on it (tests/unit/ops/test_w8a8.py). With --steps, whole decode steps of an int8 engine (bf16 KV
cache, as served) at each --step-batch, off and on in turn (bench/layer_loop.py's alternation).

    .venv/bin/python -m bench.w8a8_prefetch [--rows 1 8 16 32 64 256] [--rounds 9] [--steps --step-batch 8 32]

Writes bench/results/w8a8_prefetch-<stamp>.json and prints it as the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from bench.engine import log, machine
from bench.linear_precisions import build, projections
from bench.results_file import write_results
from bench.tile_prefetch import one_pass
from shared.models.loader import resolve_model
from shared.ops import cpu_isa


def time_steps(model: str, batches: list[int], rounds: int) -> list[dict[str, Any]]:
    """ms of an int8 engine's decode steps (bf16 KV, 256-token prompts) with the prefetch off and on in turn."""
    from bench.layer_loop import alternate_decode_steps
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, max_model_len=2048, kv_cache_bytes=1 << 30, quantization="int8",
                                    kv_cache_dtype="bfloat16"))
    toggle = torch.ops.baton_cpu.w8a8_next_prefetch
    default = toggle(True)
    out = []
    for batch in batches:
        times = alternate_decode_steps(engine, batch, rounds, steps=8, prompt_len=256,
                                       variants={"off": lambda: toggle(False), "on": lambda: toggle(True)},
                                       restore=lambda: toggle(default))
        off, on = (statistics.median(times[k]) * 1e3 for k in ("off", "on"))
        out.append({"batch": batch, "off_ms": round(off, 2), "on_ms": round(on, 2), "off_over_on": round(off / on, 3),
                    "runs": {k: [round(t * 1e3, 3) for t in v] for k, v in times.items()}})
        log(f"decode step, batch {batch}: off {off:.2f} ms, on {on:.2f} ms, x{off / on:.2f}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 256])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", action="store_true", help="also time whole decode steps of an int8 engine")
    parser.add_argument("--step-batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = projections(resolve_model(args.model))
    log(f"packing {len(weights)} projections as int8 (W8A8) ...")
    lins = [build("int8-w8a8", w) for w in weights]
    toggle = torch.ops.baton_cpu.w8a8_next_prefetch
    default = toggle(True)
    rows: list[dict[str, Any]] = []
    try:
        for n in args.rows:
            xs = {k: torch.randn(n, k) for k in {lin.in_features for lin in lins}}
            ms: dict[str, list[float]] = {"off": [], "on": []}
            for _ in range(2):  # warm-up, both ways
                for on in (False, True):
                    toggle(on)
                    one_pass(lins, xs)
            for _ in range(args.rounds):
                for key, on in (("off", False), ("on", True)):
                    toggle(on)
                    ms[key].append(one_pass(lins, xs))
            ratio = statistics.median(off / on for off, on in zip(ms["off"], ms["on"], strict=True))
            rows.append({"rows": n, "off_ms": round(statistics.median(ms["off"]), 3),
                         "on_ms": round(statistics.median(ms["on"]), 3), "off_over_on": round(ratio, 3),
                         "runs": ms})
            log(f"rows {n:4d}: off {rows[-1]['off_ms']:.2f} ms, on {rows[-1]['on_ms']:.2f} ms, x{ratio:.2f}")
    finally:
        toggle(default)
    steps = time_steps(args.model, args.step_batch, args.rounds) if args.steps else []
    result = {"bench": "w8a8_prefetch", "model": args.model, "threads": args.threads, "isa": cpu_isa.active_isa(),
              "machine": machine(), "rounds": args.rounds, "rows": rows, "steps": steps}
    path = write_results(result, args.out, "w8a8_prefetch")
    log(f"wrote {path}")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"} | {
        "rows": [{k: v for k, v in r.items() if k != "runs"} for r in rows],
        "steps": [{k: v for k, v in r.items() if k != "runs"} for r in steps]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
