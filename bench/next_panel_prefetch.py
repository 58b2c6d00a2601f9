"""Whether a decode batch's later passes over a weight panel should prefetch the next one, in one process.

A decode batch passes each panel of the W8A8 GEMM (six rows a pass, csrc/w8a8_impl.h) and of the bf16 GEMV
below the amx level (eight rows a pass, csrc/gemv_bf16_impl.h) several times. Only the first pass read the
panel from DRAM; the others computed from L1 while the memory bus idled. `w8a8_next_prefetch` and
`gemv_bf16_next_prefetch` (torch.ops.baton_cpu) turn on (and off) the later passes prefetching the thread's
next panel into L2. For each row count, one pass over all the model's projections as a decode step runs them
(qkv, o, gate_up with its SiLU gate, down of every layer: 106 MB for SmolLM2 in int8, 212 MB in bf16), with
the prefetch off and on in turn within each round, so that this machine's drift reaches both alike.
Reported: the median ms of a pass each way and the median over rounds of off / on (above 1: the prefetch is
faster). The bits do not depend on it (tests/unit/ops/test_w8a8.py, test_gemv_bf16.py). With --steps, whole
decode steps of an engine in that precision (bf16 KV cache, as served) at each --step-batch, off and on in
turn (bench/layer_loop.py's alternation).

    .venv/bin/python -m bench.next_panel_prefetch [--precision int8|bf16] [--rows 1 8 16 32 64 256] [--rounds 9]
        [--steps --step-batch 8 32]

Writes bench/results/next_panel_prefetch-<stamp>.json (w8a8_prefetch-* before it took bf16) and prints it
as the last line.
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

# per precision: linear_precisions' name for its weights, the toggle, the engine's flags
PRECISIONS = {
    "int8": ("int8-w8a8", "w8a8_next_prefetch", {"quantization": "int8", "kv_cache_dtype": "bfloat16"}),
    "bf16": ("bf16", "gemv_bf16_next_prefetch", {"dtype": "bfloat16"}),
}


def time_steps(model: str, precision: str, batches: list[int], rounds: int) -> list[dict[str, Any]]:
    """ms of an engine's decode steps (bf16 KV, 256-token prompts) with the prefetch off and on in turn."""
    from bench.layer_loop import alternate_decode_steps
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    _, toggle_name, flags = PRECISIONS[precision]
    engine = LLMEngine(EngineConfig(model=model, max_model_len=2048, kv_cache_bytes=1 << 30, **flags))
    toggle = getattr(torch.ops.baton_cpu, toggle_name)
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
    parser.add_argument("--precision", default="int8", choices=sorted(PRECISIONS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 256])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", action="store_true", help="also time whole decode steps of an engine")
    parser.add_argument("--step-batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = projections(resolve_model(args.model))
    kind, toggle_name, _ = PRECISIONS[args.precision]
    log(f"packing {len(weights)} projections as {kind} ...")
    lins = [build(kind, w) for w in weights]
    toggle = getattr(torch.ops.baton_cpu, toggle_name)
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
    steps = time_steps(args.model, args.precision, args.step_batch, args.rounds) if args.steps else []
    result = {"bench": "next_panel_prefetch", "model": args.model, "precision": args.precision,
              "threads": args.threads, "isa": cpu_isa.active_isa(),
              "machine": machine(), "rounds": args.rounds, "rows": rows, "steps": steps}
    path = write_results(result, args.out, "next_panel_prefetch")
    log(f"wrote {path}")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"} | {
        "rows": [{k: v for k, v in r.items() if k != "runs"} for r in rows],
        "steps": [{k: v for k, v in r.items() if k != "runs"} for r in steps]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
