"""Decode steps with the CPU decode attention's software prefetch on and off, same engine, same run.

The wide path of `csrc/paged_decode_impl.h` prefetches the next chunk's keys and
values into L2 through the block table while it computes a chunk (measured a gain
on Zen 4, whose L3 is 32 MB); `torch.ops.baton_cpu.paged_decode_prefetch` turns it
off and on. For each batch size, `batch` random-token prompts are prefilled, then
decode steps are timed in alternating rounds, prefetch on and off (bench/layer_loop.py's
`alternate_decode_steps`). Reported: median ms per step of each and their ratio. The
prefetch moves no value, so the tokens are the same.

    .venv/bin/python -m bench.attention_prefetch [--batch 1 8 32] [--dtype bfloat16] [--rounds 6] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from bench.engine import log, machine
from bench.layer_loop import alternate_decode_steps
from bench.results_file import write_results
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.ops import cpu_isa


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16", help="vLLM's --dtype (the KV cache follows it)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round and setting")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    log(f"loading {args.model} ({args.dtype}) ...")
    engine = LLMEngine(EngineConfig(model=args.model, max_model_len=2048, kv_cache_bytes=512 << 20,
                                    dtype=args.dtype))

    def prefetch(on: bool):  # noqa: ANN202
        return lambda: torch.ops.baton_cpu.paged_decode_prefetch(on)

    rows = []
    for batch in args.batch:
        times = alternate_decode_steps(engine, batch, args.rounds, args.steps, args.prompt_len,
                                       {"on": prefetch(True), "off": prefetch(False)}, prefetch(True))
        on, off = (statistics.median(times[k]) * 1e3 for k in ("on", "off"))
        rows.append({"batch": batch, "prefetch_step_ms": round(on, 2), "no_prefetch_step_ms": round(off, 2),
                     "speedup_without": round(on / off, 3), "steps_each": len(times["on"])})
        log(f"batch {batch}: prefetch {on:.2f} ms/step, none {off:.2f}, x{on / off:.3f} without")
    result = {"bench": "attention_prefetch", "model": args.model, "dtype": args.dtype, "threads": args.threads,
              "isa": cpu_isa.best_isa(), "machine": machine(), "prompt_len": args.prompt_len, "rows": rows}
    path = write_results(result, args.out, "attention_prefetch")
    log(f"wrote {path}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
