"""Decode steps with the weight packs on 2 MiB pages against each pack in its own allocation, one engine.

shared/ops/huge_pages.py puts every pack a decode step streams (bf16, quantized and W8A8 packs, fp32 GEMV
copies, the LM head's) into one buffer of 2 MiB pages when a model loads. For each batch size, `batch`
random-token prompts are prefilled, then decode steps are timed in alternating rounds: the packs placed in
one huge-page buffer (the default), then each in an allocation of its own on 4 KiB pages (as loading left
them before), the C++ layer loop built again after each move, so that drift in this machine's speed reaches
both alike (bench/layer_loop.py's alternation). The same bytes are read either way, so the tokens are not
compared. Reported: median ms per step of each and their ratio (above 1: huge pages are faster).

    .venv/bin/python -m bench.huge_pages [--model smollm2-135m] [--precision int8-fp8-kv] [--batch 1 8 32]
        [--rounds 9] [--steps 8]

Writes bench/results/huge_pages-<stamp>.json and prints it as the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.engine import log, machine
from bench.layer_loop import alternate_decode_steps
from bench.results_file import write_results
from bench.serve_overhead import engine_config
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.models.cpu_layer_loop import CpuLayerLoop
from shared.ops import cpu_isa, huge_pages


def layouts(engine: LLMEngine) -> dict[str, Callable[[], None]]:
    """Setters that place the model's packs on huge pages or each in its own allocation, then rebuild its loop."""
    model = engine.loaded.model
    linears = [*(w for layer in model.layers for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down)),
               model.lm_head]

    def place(huge: bool) -> Callable[[], None]:
        def switch() -> None:
            huge_pages.place(huge_pages.packed_slots(linears), huge)
            model.cpu_layer_loop = CpuLayerLoop.build(model)
        return switch
    return {"huge": place(True), "separate": place(False)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--precision", default="int8-fp8-kv", help="a bench.serve_systems precision name")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, max_model_len=2048, kv_cache_bytes=1 << 30,
                                    **engine_config(args.precision)))
    variants = layouts(engine)
    slots = huge_pages.packed_slots([layer.w_qkv for layer in engine.loaded.model.layers])
    if not slots:
        raise SystemExit(f"{args.precision}: no packs to place (this precision runs oneDNN's own weights)")
    rows: list[dict[str, Any]] = []
    for batch in args.batch:
        times = alternate_decode_steps(engine, batch, args.rounds, args.steps, prompt_len=256, variants=variants,
                                       restore=variants["huge"])
        huge, separate = (statistics.median(times[k]) * 1e3 for k in ("huge", "separate"))
        rows.append({"batch": batch, "huge_ms": round(huge, 3), "separate_ms": round(separate, 3),
                     "separate_over_huge": round(separate / huge, 3),
                     "runs": {k: [round(t * 1e3, 3) for t in v] for k, v in times.items()}})
        log(f"batch {batch}: huge pages {huge:.2f} ms, separate {separate:.2f} ms, x{separate / huge:.3f}")
    result = {"bench": "huge_pages", "model": args.model, "precision": args.precision, "threads": args.threads,
              "isa": cpu_isa.active_isa(), "thp": huge_pages.thp_mode(), "machine": machine(),
              "rounds": args.rounds, "steps": args.steps, "rows": rows}
    path = write_results(result, args.out, "huge_pages")
    log(f"wrote {path}")
    print(json.dumps({**result, "rows": [{k: v for k, v in r.items() if k != "runs"} for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
