"""The planner's engine curves of SmolLM2-135M's shapes on a CUDA GPU, measured through the engine.

`baton profile` loads the packaged model, which a lent GPU machine cannot install (it reaches no package
index, and the weights are too big to carry there). This builds the same engine on random weights of the
model's shapes (bench/cuda_loop.py's `random_loaded`; speed does not depend on the values) and runs the
profiler's own sweeps on it (shared/planner/profiler.py `measure_engine`): prefill steps of 1 and 4 prompts of
16 ... 2048 tokens, decode steps of 1 ... 64 requests at 64 ... 1024 tokens of context, bf16, decode from CUDA
graphs, the synchronous loop (the zero-bubble loop hides the host's share of each step: these are upper
bounds). Writes JSON for `bench/plan_gpu.py --engine-curves`.

    python -m bench.gpu_profile [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

from bench.cuda_loop import random_loaded
from bench.results_file import write_results
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.planner.profiler import SweepPlan, measure_engine

PLAN = SweepPlan(threads=(1,), prefill_lengths=(16, 64, 256, 512, 1024, 2048), prefill_batches=(1, 4),
                 decode_batches=(1, 4, 16, 32, 64), decode_contexts=(64, 256, 1024), decode_steps=20, repeats=5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    t0 = time.perf_counter()
    loaded = random_loaded(getattr(torch, args.dtype), 30, args.device)
    engine = LLMEngine(EngineConfig(model=loaded.name, device=args.device, dtype=args.dtype, max_model_len=4096,
                                    kv_cache_bytes=4 << 30, async_scheduling=False, cuda_graphs=True,
                                    max_num_seqs=64, max_num_batched_tokens=8192), loaded=loaded)
    curves = measure_engine(engine, PLAN)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = {"bench": "gpu_profile", "device": device, "dtype": args.dtype, "model_shapes": "smollm2-135m",
              "loop": "synchronous", "cuda_graphs": True, "seconds": time.perf_counter() - t0,
              "prefill_points": curves.prefill_points, "decode_points": curves.decode_points,
              "prefill_fit": curves.prefill_fit, "decode_fit": curves.decode_fit}
    path = write_results(result, args.out_dir, "gpu_profile", record_name=True)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
