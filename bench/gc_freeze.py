"""Whether freezing the start-up heap out of Python's collector (shared/service/gc_heap.py) speeds the engine.

One engine in this process (SmolLM2, `--quantization int8 --kv-cache-dtype bfloat16` by default); rounds
alternate the heap frozen (`freeze_startup_heap`: `gc.collect(); gc.freeze()`) and not (`gc.unfreeze()`),
the order flipped each round, so this machine's drift reaches both alike. Timed: a 256-token prefill (the
best of two a round), and the median step of a batch-8 decode after 256-token prompts. Reported: the median
over rounds of each state and the ratio not-frozen / frozen (above 1: freezing is faster), with every
round's pair.

    .venv/bin/python -m bench.gc_freeze [--rounds 8] [--quantization int8] [--kv-cache-dtype bfloat16]

Writes bench/results/gc_freeze-<stamp>.json and prints it as the last line.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from bench.engine import log, machine
from bench.prefill import time_baton
from bench.results_file import write_results
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.service.gc_heap import freeze_startup_heap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--quantization", default="int8")
    ap.add_argument("--kv-cache-dtype", default="bfloat16")
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model="smollm2-135m", max_model_len=2048, kv_cache_bytes=1 << 30,
                                    enable_prefix_caching=False, quantization=args.quantization,
                                    kv_cache_dtype=args.kv_cache_dtype, max_num_batched_tokens=2048))
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(256)]

    def prefill() -> float:
        return min(time_baton(engine, [prompt()], f"p{rng.random()}") for _ in range(2)) * 1e3

    def decode() -> float:
        params = SamplingParams(max_tokens=26, temperature=0.0, ignore_eos=True)
        for _ in range(args.decode_batch):
            engine.add_request(f"d{rng.random()}", prompt(), params)
        steps = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        # the first steps left out: the prompts' (one step at 2,048 batched tokens) and the first decodes'
        return statistics.median(steps[args.decode_batch:]) * 1e3

    result: dict = {"bench": "gc_freeze", "model": "smollm2-135m", "quantization": args.quantization,
                    "kv_cache_dtype": args.kv_cache_dtype, "machine": machine(), "rows": []}
    timers: dict[str, Callable[[], float]] = {"prefill_256_ms": prefill,
                                              f"decode_b{args.decode_batch}_step_ms": decode}
    for name, fn in timers.items():
        fn()  # warm
        runs: dict[str, list[float]] = {"frozen": [], "collected": []}
        for r in range(args.rounds):
            for state in ("collected", "frozen") if r % 2 == 0 else ("frozen", "collected"):
                if state == "frozen":
                    freeze_startup_heap()  # what the services run once up
                else:
                    gc.unfreeze()
                runs[state].append(round(fn(), 2))
            log(f"{name} round {r + 1}/{args.rounds}: collected {runs['collected'][-1]:.1f}, "
                f"frozen {runs['frozen'][-1]:.1f}")
        gc.unfreeze()
        frozen, collected = statistics.median(runs["frozen"]), statistics.median(runs["collected"])
        result["rows"].append({"timer": name, "frozen": frozen, "collected": collected,
                               "ratio": round(collected / frozen, 3), "runs": runs})
        log(f"{name}: collected {collected:.1f}, frozen {frozen:.1f}, x{collected / frozen:.3f}")
    path = write_results(result, args.out, "gc_freeze")
    log(f"wrote {path}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
