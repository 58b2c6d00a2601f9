"""A kernel's on/off switch timed both ways in one process: the alternation behind bench/next_panel_prefetch.py
and bench/work_stealing.py.

A switch is one of torch.ops.baton_cpu's `(bool on) -> bool` setters (it returns the setting it replaced).
Each round runs the work off and then on, so that the machine's drift (this project's machines are shared
and noisy) reaches both alike; the figure is the median over rounds of off / on (above 1: on is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from bench.engine import log, machine
from bench.linear_precisions import build, projections
from bench.results_file import write_results
from bench.tile_prefetch import one_pass
from shared.models.loader import resolve_model
from shared.ops import cpu_isa


def switch(name: str) -> Any:
    """The setter torch.ops.baton_cpu.<name>."""
    return getattr(torch.ops.baton_cpu, name)


def time_passes(lins: list, rows: list[int], toggle: Any, rounds: int) -> list[dict[str, Any]]:
    """For each row count, ms of one pass over `lins` (a decode step's projections, bench/tile_prefetch.py's
    one_pass) with the switch off and on in turn."""
    default = toggle(True)
    out: list[dict[str, Any]] = []
    try:
        for n in rows:
            xs = {k: torch.randn(n, k) for k in {lin.in_features for lin in lins}}
            ms: dict[str, list[float]] = {"off": [], "on": []}
            for _ in range(2):  # warm-up, both ways
                for on in (False, True):
                    toggle(on)
                    one_pass(lins, xs)
            for _ in range(rounds):
                for key, on in (("off", False), ("on", True)):
                    toggle(on)
                    ms[key].append(one_pass(lins, xs))
            ratio = statistics.median(off / on for off, on in zip(ms["off"], ms["on"], strict=True))
            out.append({"rows": n, "off_ms": round(statistics.median(ms["off"]), 3),
                        "on_ms": round(statistics.median(ms["on"]), 3), "off_over_on": round(ratio, 3), "runs": ms})
            log(f"rows {n:4d}: off {out[-1]['off_ms']:.2f} ms, on {out[-1]['on_ms']:.2f} ms, x{ratio:.2f}")
    finally:
        toggle(default)
    return out


def engine_for(model: str, flags: dict[str, Any]) -> Any:
    """An in-process engine of `model` built with `flags` (the precision under test), prefix caching off so
    that every prefill computes its whole prompt."""
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, max_model_len=2048, kv_cache_bytes=1 << 30,
                                  enable_prefix_caching=False, max_num_batched_tokens=4096, **flags))


def _row(key: str, value: int, off_s: list[float], on_s: list[float]) -> dict[str, Any]:
    off, on = statistics.median(off_s) * 1e3, statistics.median(on_s) * 1e3
    return {key: value, "off_ms": round(off, 2), "on_ms": round(on, 2), "off_over_on": round(off / on, 3),
            "runs": {"off": [round(t * 1e3, 3) for t in off_s], "on": [round(t * 1e3, 3) for t in on_s]}}


def time_steps(engine: Any, toggle: Any, batches: list[int], rounds: int) -> list[dict[str, Any]]:
    """ms of the engine's decode steps (256-token prompts) with the switch off and on in turn
    (bench/layer_loop.py's alternation)."""
    from bench.layer_loop import alternate_decode_steps

    default = toggle(True)
    out = []
    for batch in batches:
        times = alternate_decode_steps(engine, batch, rounds, steps=8, prompt_len=256,
                                       variants={"off": lambda: toggle(False), "on": lambda: toggle(True)},
                                       restore=lambda: toggle(default))
        out.append(_row("batch", batch, times["off"], times["on"]))
        log(f"decode step, batch {batch}: off {out[-1]['off_ms']:.2f} ms, on {out[-1]['on_ms']:.2f} ms, "
            f"x{out[-1]['off_over_on']:.2f}")
    return out


def time_prefills(engine: Any, toggle: Any, batches: list[int], rounds: int, prompt_len: int = 256
                  ) -> list[dict[str, Any]]:
    """ms of the engine's prefill of `batch` random-token prompts in one step (bench/prefill.py's time_baton),
    the switch off and on in turn, new prompts each time; the first round warms up and is dropped."""
    import random

    from bench.prefill import time_baton

    rng = random.Random(0)
    vocab = engine.loaded.spec.vocab_size
    default = toggle(True)
    out = []
    try:
        for batch in batches:
            times: dict[bool, list[float]] = {False: [], True: []}
            for r in range(rounds + 1):
                for on in (False, True):
                    toggle(on)
                    prompts = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(batch)]
                    took = time_baton(engine, prompts, f"prefill-{batch}-{r}-{on}")
                    if r:
                        times[on].append(took)
            out.append(_row("batch", batch, times[False], times[True]))
            log(f"prefill, {batch} x {prompt_len}: off {out[-1]['off_ms']:.1f} ms, on {out[-1]['on_ms']:.1f} ms, "
                f"x{out[-1]['off_over_on']:.2f}")
    finally:
        toggle(default)
    return out


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The result without its per-round runs: the line a bench prints last."""
    keys = ("rows", "steps", "prefills")
    return {k: v for k, v in result.items() if k not in keys} | {
        key: [{k: v for k, v in r.items() if k != "runs"} for r in result.get(key, [])] for key in keys}


def run_cli(bench: str, doc: str | None, precisions: dict[str, tuple[str, str, dict[str, Any]]]) -> int:
    """A switch bench's command line: `precisions` maps --precision to (bench/linear_precisions.py's name for
    its weights, the switch, the engine's flags). Writes bench/results/<bench>-<stamp>.json and prints it
    (less the runs) as the last line. --steps and --prefill time a whole engine's decode steps and prefills
    the same way."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--precision", default=next(iter(precisions)), choices=sorted(precisions))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 256])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", action="store_true", help="also time whole decode steps of an engine")
    parser.add_argument("--step-batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--prefill", action="store_true", help="also time an engine's prefills of 256 tokens")
    parser.add_argument("--prefill-batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = projections(resolve_model(args.model))
    kind, name, flags = precisions[args.precision]
    log(f"packing {len(weights)} projections as {kind} ...")
    lins = [build(kind, w) for w in weights]
    rows = time_passes(lins, args.rows, switch(name), args.rounds)
    engine = engine_for(args.model, flags) if args.steps or args.prefill else None
    steps = time_steps(engine, switch(name), args.step_batch, args.rounds) if args.steps else []
    prefills = time_prefills(engine, switch(name), args.prefill_batch, args.rounds) if args.prefill else []
    result = {"bench": bench, "model": args.model, "precision": args.precision, "switch": name,
              "threads": args.threads, "isa": cpu_isa.active_isa(), "machine": machine(), "rounds": args.rounds,
              "rows": rows, "steps": steps, "prefills": prefills}
    log(f"wrote {write_results(result, args.out, bench)}")
    print(json.dumps(summary(result)))
    return 0
