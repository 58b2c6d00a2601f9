"""Decode steps with the C++ layer loop against the Python loop, same engine, same run.

`shared/models/cpu_layer_loop.py` runs a decode step's layers in one C++ call
instead of ~20 Python op calls a layer. For each batch size, `batch` random-token
prompts are prefilled, then decode steps are timed (wall clock per
`engine.step()`) in alternating rounds, the loop on and off, so drift in this
machine's speed reaches both alike. Reported: median ms per step of each and
their ratio. Both give the same bits (tests/unit/ops/test_cpu_layer_loop.py), so
the generated tokens are not compared here.

    .venv/bin/python -m bench.layer_loop [--model smollm2-135m] [--batch 1 8 16] [--rounds 8] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.engine import log, machine
from bench.results_file import write_results
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams


def random_prompts(vocab_size: int, batch: int, prompt_len: int) -> list[list[int]]:
    """`batch` random-token prompts of `prompt_len` ids, the same for a given batch size."""
    rng = random.Random(batch)
    return [[rng.randrange(100, vocab_size) for _ in range(prompt_len)] for _ in range(batch)]


def start_decoding(engine: LLMEngine, ids: list[str], prompts: list[list[int]], params: SamplingParams) -> None:
    """Add the requests and step until every prompt is prefilled: the engine's next steps are decode steps."""
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    produced = dict.fromkeys(ids, 0)
    while min(produced.values()) < 2:
        for out in engine.step():
            produced[out.request_id] += len(out.new_token_ids)


def timed_steps(engine: LLMEngine, steps: int) -> list[float]:
    """One step to settle (caches and weights back after another setting ran), then `steps` timed ones."""
    engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def end_requests(engine: LLMEngine, ids: list[str]) -> None:
    """Abort the requests and step until the engine holds nothing."""
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


def alternate_decode_steps(engine: LLMEngine, batch: int, rounds: int, steps: int, prompt_len: int,
                           variants: dict[str, Callable[[], None]], restore: Callable[[], None]) -> dict[str, list[float]]:
    """Seconds of each timed decode step under each variant: `batch` random-token prompts are prefilled, then
    each round runs every variant in turn (its setter called, one step to settle, `steps` timed), so drift in
    the machine's speed reaches them alike. `restore` puts the engine back; the requests are aborted."""
    params = SamplingParams(max_tokens=(len(variants) * (steps + 1)) * rounds + 16, temperature=0.0,
                            ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    start_decoding(engine, ids, random_prompts(engine.loaded.spec.vocab_size, batch, prompt_len), params)
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for r in range(rounds):
            for name, switch in variants.items():
                switch()
                times[name] += timed_steps(engine, steps)
            log(f"batch {batch}: round {r + 1}/{rounds}")
    finally:
        restore()
        end_requests(engine, ids)
    return times


def time_batch(engine: LLMEngine, batch: int, rounds: int, steps: int, prompt_len: int) -> dict[str, Any]:
    model = engine.loaded.model
    loop = model.cpu_layer_loop

    def use(on: bool) -> Callable[[], None]:
        return lambda: setattr(model, "cpu_layer_loop", loop if on else None)

    times = alternate_decode_steps(engine, batch, rounds, steps, prompt_len, {"cpp": use(True), "python": use(False)},
                                   use(True))
    cpp, python = (statistics.median(times[k]) * 1e3 for k in ("cpp", "python"))
    return {"batch": batch, "cpp_step_ms": round(cpp, 2), "python_step_ms": round(python, 2),
            "speedup": round(python / cpp, 3), "steps_each": len(times["cpp"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round and loop")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    log(f"loading {args.model} ...")
    engine = LLMEngine(EngineConfig(model=args.model, max_model_len=2048, kv_cache_bytes=512 << 20))
    if engine.loaded.model.cpu_layer_loop is None:
        log("the C++ layer loop does not run here (no CPU kernels, or BATON_CPU_LAYER_LOOP=0)")
        return 1
    rows = []
    for batch in args.batch:
        row = time_batch(engine, batch, args.rounds, args.steps, args.prompt_len)
        rows.append(row)
        log(f"batch {batch}: C++ loop {row['cpp_step_ms']:.2f} ms/step, Python loop {row['python_step_ms']:.2f}, "
            f"x{row['speedup']:.3f}")
    result = {"bench": "layer_loop", "model": args.model, "machine": machine(), "prompt_len": args.prompt_len,
              "rows": rows}
    path = write_results(result, args.out, "layer_loop")
    log(f"wrote {path}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
