"""Decode steps over a bf16 KV cache against an 8-bit one (`--kv-cache-dtype fp8`), one process, same run.

One engine per KV cache dtype (same model, same weights' precision). For each
batch size, each engine prefills the same `batch` random-token prompts, then
decode steps are timed (wall clock per `engine.step()`) in alternating rounds,
engine by engine, the order flipped each round, so drift in this machine's speed
reaches all alike. The contexts grow alike too (every engine runs the same
number of steps). Reported: median ms per step of each and the ratio to the
first. What the fp8 cache costs in fidelity is bench/fidelity.py's to measure.

`--kernel` times the decode attention kernel alone instead (`paged_decode`, SmolLM2's heads, 32 rows of
300-token contexts in blocks scattered over the pool): over 30 layers' caches (from DRAM) and over one
layer's 30 times (from L3), which tells the kernel's arithmetic from its reads.

    .venv/bin/python -m bench.kv_cache_dtype [--quantization int8] [--kv-cache-dtypes bfloat16 fp8]
        [--batch 8 32] [--rounds 6] [--steps 8] [--prompt-len 256] [--kernel]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.engine import log, machine
from bench.layer_loop import end_requests, random_prompts, start_decoding, timed_steps
from bench.results_file import write_results
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.precision import KV_CACHE_DTYPE_CHOICES
from shared.engine.request import SamplingParams
from shared.ops import cpu_isa


def time_steps(engines: dict[str, LLMEngine], batch: int, rounds: int, steps: int,
               prompt_len: int) -> dict[str, list[float]]:
    """Seconds of each timed decode step of each engine (see the module docstring)."""
    prompts = random_prompts(next(iter(engines.values())).loaded.spec.vocab_size, batch, prompt_len)
    params = SamplingParams(max_tokens=(steps + 1) * rounds + 16, temperature=0.0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for engine in engines.values():
        start_decoding(engine, ids, prompts, params)
    times: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for r in range(rounds):
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                times[name] += timed_steps(engines[name], steps)
            log(f"batch {batch}: round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {statistics.median(times[n][-steps:]) * 1e3:.2f} ms" for n in engines))
    finally:
        for engine in engines.values():
            end_requests(engine, ids)
    return times


def time_kernel(dtypes: dict[str, torch.dtype], rounds: int, rows: int = 32, context: int = 300,
                layers: int = 30) -> dict[str, dict[str, float]]:
    """ms per 30 layers of `paged_decode` for each cache dtype, from DRAM and from L3, medians of `rounds`
    alternating rounds."""
    from shared.transport.memory import host_buffer

    bs, heads, kv_heads, dim = 16, 9, 3, 64
    per_row = -(-context // bs)
    blocks = rows * per_row + 8
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(blocks, generator=g)[: rows * per_row].view(rows, -1).int()
    index = torch.arange(rows)
    pos = torch.full((rows,), context - 1)
    q, out = torch.randn(rows, heads, dim, generator=g), torch.empty(rows, heads, dim)
    caches = {}
    for name, dtype in dtypes.items():
        kv = host_buffer((layers, blocks, 2, bs, kv_heads, dim), dtype)  # huge pages, as the engine's
        kv.view(torch.uint8).copy_(torch.randint(0, 0x70, kv.view(torch.uint8).shape, dtype=torch.uint8,
                                                 generator=g))  # finite values in every format
        caches[name] = kv

    def run(kv: torch.Tensor, which: list[int]) -> float:
        t0 = time.perf_counter()
        for layer in which:
            torch.ops.baton_cpu.paged_decode(out, q, kv[layer, :, 0], kv[layer, :, 1], tables, index, index, pos,
                                             dim**-0.5, 0)
        return (time.perf_counter() - t0) * 1e3 * layers / len(which)

    times: dict[str, dict[str, list[float]]] = {n: {"dram": [], "l3": []} for n in dtypes}
    for r in range(rounds):
        for name in (list(dtypes) if r % 2 == 0 else list(dtypes)[::-1]):
            run(caches[name], list(range(layers)))  # warm
            times[name]["dram"].append(run(caches[name], list(range(layers))))
            run(caches[name], [0] * layers)
            times[name]["l3"].append(run(caches[name], [0] * layers))
        log(f"kernel round {r + 1}/{rounds}: " + ", ".join(
            f"{n} {t['dram'][-1]:.2f} / {t['l3'][-1]:.2f} ms" for n, t in times.items()))
    return {n: {k: round(statistics.median(v), 3) for k, v in t.items()} for n, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto", help="vLLM's --dtype")
    parser.add_argument("--quantization", default="int8", help="vLLM's --quantization: none | int8 | q4_1 | gguf")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["bfloat16", "fp8"],
                        choices=KV_CACHE_DTYPE_CHOICES, help="the first is the baseline")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round and engine")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--kernel", action="store_true", help="time the decode attention kernel alone")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.kernel:
        from shared.engine.precision import resolve_precision

        dtypes = {kv: resolve_precision("float32", kv, "cpu").kv_cache for kv in args.kv_cache_dtypes}
        from shared.ops.cpu_kernels import cpu_kernels_available

        if not cpu_kernels_available():
            log("the CPU kernels did not build")
            return 1
        ms = time_kernel(dtypes, args.rounds)
        base = args.kv_cache_dtypes[0]
        for name, t in ms.items():
            log(f"{name}: 30 layers from DRAM {t['dram']:.2f} ms (x{ms[base]['dram'] / t['dram']:.3f}), "
                f"from L3 {t['l3']:.2f} ms (x{ms[base]['l3'] / t['l3']:.3f})")
        return _write({"bench": "kv_cache_dtype", "mode": "kernel", "kv_cache_dtypes": args.kv_cache_dtypes,
                       "threads": torch.get_num_threads(), "isa": cpu_isa.best_isa(), "machine": machine(),
                       "rows": 32, "context": 300, "rounds": args.rounds, "ms_per_30_layers": ms}, args.out)
    engines: dict[str, LLMEngine] = {}
    for kv in args.kv_cache_dtypes:
        log(f"loading {args.model} ({args.dtype}, {args.quantization}, KV {kv}) ...")
        engines[kv] = LLMEngine(EngineConfig(model=args.model, max_model_len=2048, kv_cache_bytes=512 << 20,
                                             dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=kv))
    base = args.kv_cache_dtypes[0]
    rows = []
    for batch in args.batch:
        times = time_steps(engines, batch, args.rounds, args.steps, args.prompt_len)
        ms = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        row = {"batch": batch, "step_ms": {n: round(v, 2) for n, v in ms.items()},
               "speedup_over_" + base: {n: round(ms[base] / v, 3) for n, v in ms.items()},
               "steps_each": len(times[base])}
        rows.append(row)
        log(f"batch {batch}: " + ", ".join(f"{n} {v:.2f} ms/step (x{ms[base] / v:.3f})" for n, v in ms.items()))
    return _write({"bench": "kv_cache_dtype", "model": args.model, "dtype": args.dtype,
                   "quantization": args.quantization, "kv_cache_dtypes": args.kv_cache_dtypes,
                   "threads": torch.get_num_threads(), "isa": cpu_isa.best_isa(), "machine": machine(),
                   "prompt_len": args.prompt_len, "rounds": args.rounds, "rows": rows}, args.out)


def _write(result: dict[str, Any], out: Path) -> int:
    """The results file, and the JSON line last on stdout."""
    log(f"wrote {write_results(result, out, 'kv_cache_dtype')}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
