"""Prompt throughput of one prefill step: N prompts of L tokens (one chunk), baton's engine against transformers.

Serving at 8 and 32 clients is bounded by the prefill (TTFT), not the decode: at 32 clients baton's TTFT was
3x vLLM's on Sapphire Rapids (bench/results/serve-20261127-134348.json). This times the engine's part of it
in-process: random-token prompts (no prefix is shared, prefix caching is off), one new token each, so what
is timed is the prompt chunk's projections, attention, norms and the first token's sampling. The baseline is
transformers' forward over the same prompts as one [N, L] batch, in the dtype it is given (bf16 runs torch's
oneDNN GEMMs, AMX tiles where the CPU has them, and its SDPA), timed in turn with baton so that drift in the
machine's speed reaches both alike.

    .venv/bin/python -m bench.prefill [--prompts 8] [--prompt-len 256] [--dtype bfloat16] [--repeats 7] [--quick]
        [--quantization int8] [--kv-cache-dtype bfloat16] [--profile]

Writes JSON to bench/results/prefill-<stamp>.json and prints it as the last line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.engine import log, machine
from bench.results_file import write_results
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.ops import cpu_isa


def time_baton(engine: LLMEngine, prompts: list[list[int]], tag: str) -> float:
    """Seconds from the prompts' arrival to their first tokens (every prompt in one step when they fit)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started


def time_transformers(hf: Any, prompts: list[list[int]]) -> float:
    ids = torch.tensor(prompts)
    started = time.perf_counter()
    with torch.inference_mode():
        hf(input_ids=ids, use_cache=True)
    return time.perf_counter() - started


def profile_ops(engine: LLMEngine, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """One baton round under the torch profiler: each op's self time (ms) and share of the round's wall time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall_s = time_baton(engine, prompts, "profiled")
    ops = sorted(((e.key, e.self_cpu_time_total) for e in prof.key_averages()), key=lambda kv: -kv[1])
    return [{"op": name, "ms": round(us / 1e3, 2), "share": round(us / 1e6 / wall_s, 3)} for name, us in ops[:16]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                        help="baton's weights and KV, and transformers' dtype")
    parser.add_argument("--quantization", default="none", help="baton's weights: none | int8 | gguf")
    parser.add_argument("--kv-cache-dtype", default="auto", help="baton's KV cache: auto | float32 | bfloat16")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed rounds, one more baton round under the torch profiler: time by op")
    parser.add_argument("--repeats", type=int, default=7, help="timings of each system, in turn (first one dropped)")
    parser.add_argument("--quick", action="store_true", help="2 prompts of 64 tokens, one timing each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.prompt_len, args.repeats = 2, 64, 1
    tokens = args.prompts * args.prompt_len

    from transformers import AutoModelForCausalLM

    log(f"loading {args.model} ({args.dtype}) ...")
    engine = LLMEngine(EngineConfig(model=args.model, max_model_len=max(2048, args.prompt_len + 16),
                                    kv_cache_bytes=1 << 30, dtype=args.dtype, enable_prefix_caching=False,
                                    quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                                    max_num_batched_tokens=max(2048, tokens)))
    hf = AutoModelForCausalLM.from_pretrained(engine.loaded.hf_dir, dtype=getattr(torch, args.dtype)).eval()
    rng = random.Random(args.seed)
    vocab = engine.loaded.spec.vocab_size
    runs: dict[str, list[float]] = {"baton": [], "transformers": []}
    for i in range(args.repeats + 1):  # the first round warms both up and is not kept
        prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        baton_s = time_baton(engine, prompts, f"r{i}")
        hf_s = time_transformers(hf, prompts)
        if i == 0:
            continue
        runs["baton"].append(tokens / baton_s)
        runs["transformers"].append(tokens / hf_s)
        log(f"round {i}/{args.repeats}: baton {tokens / baton_s:.0f} prompt tok/s ({baton_s * 1e3:.0f} ms), "
            f"transformers {tokens / hf_s:.0f} ({hf_s * 1e3:.0f} ms)")
    pairs = [b / t for b, t in zip(runs["baton"], runs["transformers"], strict=True)]
    ops = profile_ops(engine, [[rng.randrange(100, vocab) for _ in range(args.prompt_len)]
                               for _ in range(args.prompts)]) if args.profile else []
    result = {
        "bench": "prefill", "model": args.model, "dtype": args.dtype, "prompts": args.prompts,
        "prompt_len": args.prompt_len, "repeats": args.repeats, "isa": cpu_isa.active_isa(),
        "precision": engine.precision.describe(), "machine": machine(),
        "baton_prompt_tok_s": statistics.median(runs["baton"]),
        "transformers_prompt_tok_s": statistics.median(runs["transformers"]),
        "baton_runs": runs["baton"], "transformers_runs": runs["transformers"],
        "speedup_runs": pairs, "speedup_median_of_pairs": statistics.median(pairs), "profile_ops": ops,
    }
    path = write_results(result, args.out, "prefill")
    log(f"baton {result['baton_prompt_tok_s']:.0f} prompt tok/s, transformers "
        f"{result['transformers_prompt_tok_s']:.0f}: x{result['speedup_median_of_pairs']:.2f} (median of pairs)")
    for op in ops[:10]:
        log(f"  {op['op']}: {op['ms']:.1f} ms ({op['share']:.0%})")
    log(f"wrote {path}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
