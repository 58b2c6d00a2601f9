"""Where a decode step's time goes: baton's engine in-process, torch profiler over steady decode steps.

For each batch size: `batch` random-token prompts are prefilled, then K decode
steps are timed (wall clock per `engine.step()`) and profiled. Reported: ms per
step, the share of the step spent in torch ops (by op, self time) against the
rest (Python: scheduler, sampling bookkeeping, KV slot updates), and the DRAM
floor: weight bytes one step must read over the read bandwidth measured now.

    .venv/bin/python -m bench.decode_profile [--batch 1 8 32] [--steps 16] [--threads 2] [--dtype bfloat16] [--quantization int8]
        [--kv-cache-dtype bfloat16] [--python-layers]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.results_file import write_results
from bench.serve_machine import copy_bandwidth_gbs
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes of every parameter tensor reachable from the model (what a decode step streams once)."""
    from bench.engine import weight_bytes as engine_weight_bytes

    return engine_weight_bytes(engine)


def profile_batch(engine: LLMEngine, batch: int, steps: int, prompt_len: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    vocab = engine.loaded.spec.vocab_size
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    ids = [f"p{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(100, vocab) for _ in range(prompt_len)], params)
    produced: dict[str, int] = dict.fromkeys(ids, 0)
    while min(produced.values()) < 2:  # every prompt prefilled and one decode step behind it
        for out in engine.step():
            produced[out.request_id] += len(out.new_token_ids)
    times: list[float] = []
    for _ in range(3):  # settle
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    step_ms = sorted(times)[len(times) // 2] * 1e3
    total_us = sum(times) * 1e6
    ops = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    ops.sort(key=lambda kv: -kv[1])
    torch_us = sum(us for _, us in ops)
    return {
        "batch": batch, "median_step_ms": round(step_ms, 2), "tok_s": round(batch / step_ms * 1e3, 1),
        "torch_ops_share": round(torch_us / total_us, 3),
        "top_ops": [{"op": name, "share": round(us / total_us, 3), "ms_per_step": round(us / steps / 1e3, 2)}
                    for name, us in ops[:8]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", help="vLLM's --dtype: auto | float32 | bfloat16")
    parser.add_argument("--quantization", default="none", help="vLLM's --quantization: none | int8 | q4_1 | gguf")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="vLLM's --kv-cache-dtype: auto | float32 | bfloat16 | fp8 | fp8_e5m2")
    parser.add_argument("--python-layers", action="store_true",
                        help="run the layers from Python (BATON_CPU_LAYER_LOOP=0), so the profile names each kernel")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.python_layers:
        os.environ["BATON_CPU_LAYER_LOOP"] = "0"
    engine = LLMEngine(EngineConfig(model=args.model, max_model_len=2048, kv_cache_bytes=512 << 20,
                                    dtype=args.dtype, quantization=args.quantization,
                                    kv_cache_dtype=args.kv_cache_dtype))
    bandwidth = copy_bandwidth_gbs()
    wbytes = weight_bytes(engine)
    rows = [profile_batch(engine, b, args.steps, args.prompt_len, seed=b) for b in args.batch]
    floor_ms = wbytes / (bandwidth["read_gbs"] * 1e9) * 1e3
    result = {"bench": "decode_profile", "model": args.model, "threads": args.threads,
              "dtype": args.dtype, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
              "python_layers": args.python_layers,
              "weight_bytes": wbytes, "bandwidth": bandwidth, "dram_floor_step_ms": round(floor_ms, 2),
              "rows": rows}
    for row in rows:
        ops = ", ".join(f"{o['op']} {o['share']:.0%} ({o['ms_per_step']:.1f} ms)" for o in row["top_ops"][:5])
        print(f"batch {row['batch']}: {row['median_step_ms']:.1f} ms/step (floor {floor_ms:.1f}), "
              f"torch ops {row['torch_ops_share']:.0%}: {ops}", file=sys.stderr)
    write_results(result, args.out, "serve-decode-profile", indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
