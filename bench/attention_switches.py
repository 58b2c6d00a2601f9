"""Decode steps with one of the CPU decode attention's switches on and off, same engine, same run.

`--switch prefetch`: the wide path of `csrc/paged_decode_impl.h` prefetches the next chunk's keys and values
into L2 through the block table while it computes a chunk (measured a gain on Zen 4, whose L3 is 32 MB);
`torch.ops.baton_cpu.paged_decode_prefetch` turns it off and on. It moves no value: the tokens are the same.
`--switch bf16`: a bf16 or fp8 cache through the vdpbf16ps passes (avx512_bf16 and up) or the fp32 ones
(`torch.ops.baton_cpu.paged_decode_bf16`); the query and weights are rounded to bf16 in the first.
`--switch prefill_bf16`: the same for the prompt-chunk kernel (`prefill_attention_bf16`).

For each batch size, decode switches: `batch` random-token prompts are prefilled, then decode steps are
timed in alternating rounds, the switch on and off (bench/layer_loop.py's `alternate_decode_steps`); the
prefill switch: each round prefills `batch` fresh random-token prompts (one token out) each way in turn.
Reported: median ms per step (or per prefill of the batch) of each and their ratio.

    .venv/bin/python -m bench.attention_switches [--switch prefetch|bf16] [--batch 1 8 32] [--dtype bfloat16]
        [--quantization int8] [--kv-cache-dtype fp8] [--rounds 6] [--steps 8]
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

import torch

from bench.engine import log, machine
from bench.layer_loop import alternate_decode_steps, end_requests
from bench.results_file import write_results
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.ops import cpu_isa

# --switch: the op that turns it on and off
SWITCHES = {"prefetch": "paged_decode_prefetch", "bf16": "paged_decode_bf16",
            "prefill_bf16": "prefill_attention_bf16"}


def alternate_prefills(engine: LLMEngine, batch: int, rounds: int, prompt_len: int,
                       variants: dict[str, Callable[[], None]], restore: Callable[[], None]) -> dict[str, list[float]]:
    """Seconds to prefill `batch` fresh random-token prompts (one token out each) under each variant, in turn
    each round: fresh prompts every time, so the prefix cache holds none of them."""
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for r in range(rounds):
            for name, switch in variants.items():
                switch()
                ids = [f"p{r}-{name}-{i}" for i in range(batch)]
                for rid in ids:
                    engine.add_request(rid, [rng.randrange(100, engine.loaded.spec.vocab_size)
                                             for _ in range(prompt_len)], params)
                t0 = time.perf_counter()
                while engine.has_unfinished():
                    engine.step()
                times[name].append(time.perf_counter() - t0)
            log(f"batch {batch}: round {r + 1}/{rounds}")
    finally:
        restore()
        end_requests(engine, [])
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--switch", choices=sorted(SWITCHES), default="prefetch")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16", help="vLLM's --dtype")
    parser.add_argument("--quantization", default="none", help="vLLM's --quantization")
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype (auto: the dtype's)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round and setting")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    log(f"loading {args.model} ({args.dtype}, {args.quantization}, KV {args.kv_cache_dtype}) ...")
    engine = LLMEngine(EngineConfig(model=args.model, max_model_len=2048, kv_cache_bytes=512 << 20,
                                    dtype=args.dtype, quantization=args.quantization,
                                    kv_cache_dtype=args.kv_cache_dtype))
    op = SWITCHES[args.switch]

    def switch(on: bool):  # noqa: ANN202
        return lambda: getattr(torch.ops.baton_cpu, op)(on)

    rows = []
    for batch in args.batch:
        variants = {"on": switch(True), "off": switch(False)}
        times = alternate_prefills(engine, batch, args.rounds, args.prompt_len, variants, switch(True)) \
            if args.switch.startswith("prefill") else \
            alternate_decode_steps(engine, batch, args.rounds, args.steps, args.prompt_len, variants, switch(True))
        on, off = (statistics.median(times[k]) * 1e3 for k in ("on", "off"))
        rows.append({"batch": batch, "on_step_ms": round(on, 2), "off_step_ms": round(off, 2),
                     "speedup_on": round(off / on, 3), "steps_each": len(times["on"])})
        log(f"batch {batch}: {args.switch} on {on:.2f} ms/step, off {off:.2f}, x{off / on:.3f} on")
    result = {"bench": "attention_switches", "switch": args.switch, "model": args.model, "dtype": args.dtype,
              "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype, "threads": args.threads,
              "isa": cpu_isa.best_isa(), "machine": machine(), "prompt_len": args.prompt_len, "rows": rows}
    path = write_results(result, args.out, f"attention_switches-{args.switch}")
    log(f"wrote {path}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
