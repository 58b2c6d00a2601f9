"""Engine throughput against transformers `generate`, same weights, same run.

For each batch size: output tokens/s of baton's engine and of transformers
(greedy, exactly N new tokens each, prompts of the chat set), their ratio, and
for batch 1 the DRAM roofline: weight bytes a decode step must read divided by
the read bandwidth, measured right before each timed batch-1 run (this machine's
bandwidth moves: 29-49 GB/s within minutes, so one measurement at the start can
sit far from what the runs got). The two systems are timed in turn `--repeats`
times and each reported figure is the median of its runs: on this shared
machine one timing of transformers moved ~20% between runs, which a ratio of
single timings inherits. `speedup` is the ratio of the medians;
`speedup_median_of_pairs`, the median of each baton run over the transformers
run right after it, is less exposed to the machine drifting between repeats.
Writes JSON to bench/results/ and prints it as the last line.

    python -m bench.engine [--model smollm2-135m] [--batch 1 16] [--new-tokens 128] [--repeats 5] [--quick]
                           [--dtype float32|bfloat16] [--kv-cache-dtype auto|float32|bfloat16]
                           [--quantization none|int8|q4_1|gguf] [--hf-dtype float32|bfloat16]
                           [--gemma4-like gemma-4-26B-A4B [--gemma4-layers 2] [--gemma4-vocab 32768]] [--sample]

`--gemma4-like NAME` benchmarks a random Gemma 4 checkpoint sized like the published NAME (hidden size, heads,
head dims, experts, top-k and expert width from shared/models/gemma4/published.py) but only `--gemma4-layers`
deep (one sliding layer per extra layer, the last full) with a `--gemma4-vocab` vocabulary, so that it and
transformers' copy fit in memory together; it is written once (bf16, as published checkpoints are) under
~/.cache/baton/bench-gemma4. Its tokenizer is Gemma 3's (262k ids): prompt ids are folded into the smaller
vocabulary (id % vocab), the same ids for both systems.

`--sample` decodes at temperature 1 (baton: a seed per request; transformers: its own generator) instead of
greedy. A random-weight MoE needs it: greedy decoding collapses every sequence of a batch onto the same token
from the first step on, so every token of a decode step routes to the same 8 experts (8 of 128 hit at batch
16, measured), a compute-bound workload no trained MoE serves; sampled tokens differ and hit ~82 experts a
layer at batch 16, as tokens spread over a trained model's experts.

The roofline counts the bytes baton's decode step reads in the precision run (bf16 weights: half of fp32's;
quantized: the packed blocks; MoE layers: the router and top-k experts a token runs); transformers runs in
`--hf-dtype` (fp32 unless asked), with the experts implementation it picks itself (recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.engine_gemma4 import bench_checkpoint, fold_prompts, gemma4_step_bytes, readme_table
from bench.results_file import write_results
from bench.serve_report import write_block
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.precision import KV_CACHE_DTYPE_CHOICES
from shared.engine.request import SamplingParams
from shared.models.weight_format import QUANTIZATIONS
from shared.ops.linear import LinearWeight
from shared.service.gc_heap import freeze_startup_heap
from shared.tokenizer import encode_prompt

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain why the sky is blue.",
    "Name three famous painters.", "How do airplanes fly?", "Give me a recipe for pancakes.",
    "What is machine learning?", "Describe a cat to someone who has never seen one.",
    "Why do we have seasons?", "What are prime numbers?", "Tell me a short story about a robot.",
    "How does a computer store numbers?", "What is the tallest mountain?", "Summarize the water cycle.",
    "What makes a good friend?", "How do bees make honey?",
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def read_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best-of-N streaming read bandwidth (sum over a buffer much larger than cache)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes one decode step reads: every layer's weights plus the LM head (embedding rows are gathered)."""
    m = engine.loaded.model
    if hasattr(m, "spec") and hasattr(m, "w"):  # Gemma 4: MoE layers read only the experts a token runs
        return gemma4_step_bytes(m)
    total = m.lm_head.nbytes + m.norm_final.numel() * m.norm_final.element_size()
    for layer in m.layers:
        for w in vars(layer).values():
            if isinstance(w, LinearWeight):
                total += w.nbytes
            elif isinstance(w, torch.Tensor):
                total += w.numel() * w.element_size()
    return total


def time_baton(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, sample: bool = False) -> float:
    params: SamplingParams | list[SamplingParams] = SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                                   ignore_eos=True)
    if sample:  # a seed per request: one seed would draw the same tokens from near-identical distributions
        params = [SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=i, ignore_eos=True)
                  for i in range(len(prompts))]
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    # Every timed run starts with an empty prefix cache: blocks left by the warm-up or an earlier repeat of
    # the same prompts would skip most of the prefill, which transformers always does in full. Within the run
    # the prompts' common first block (the chat template's system prompt) is prefilled once: the scheduler
    # holds the others back a step to hit it (shared/engine/scheduler.py), as a server would.
    engine.pool.reset_prefix_cache()
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    assert all(len(r.token_ids) == new_tokens for r in results)
    return elapsed


def time_transformers(hf: Any, tokenizer: Any, prompts: list[list[int]], new_tokens: int,
                      sample: bool = False) -> float:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding for generation
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        hf.generate(ids[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=4, do_sample=False)  # warm-up
        torch.manual_seed(0)
        # sampled as baton samples: temperature 1 over the whole vocabulary (top_k 0 turns off generate's 50)
        how = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          pad_token_id=pad, **how)
        elapsed = time.perf_counter() - t0
    assert out.shape[1] == width + new_tokens
    return elapsed


def machine() -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    # a run of uncommitted code says so: the commit alone would name code it did not run
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "shared", "services",
                              "bench", ":(exclude)bench/README.md"], capture_output=True, text=True).stdout.strip()
    commit += "-dirty" if changed else ""
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "commit": commit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timings of each system per batch, alternating")
    parser.add_argument("--quick", action="store_true", help="32 new tokens, one timing each")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES)
    parser.add_argument("--quantization", default="none", choices=QUANTIZATIONS)
    parser.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="transformers' dtype (its weights as loaded, and its arithmetic)")
    parser.add_argument("--sample", action="store_true",
                        help="decode sampled (temperature 1, a seed per request) instead of greedy (see the docstring)")
    parser.add_argument("--gemma4-like", default=None, help="a published Gemma 4 size (see the docstring)")
    parser.add_argument("--gemma4-layers", type=int, default=2)
    parser.add_argument("--gemma4-vocab", type=int, default=32_768)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.gemma4_like is not None:
        args.model = str(bench_checkpoint(args.gemma4_like, args.gemma4_layers, args.gemma4_vocab))
    new_tokens = 32 if args.quick else args.new_tokens
    repeats = 1 if args.quick else max(1, args.repeats)

    from transformers import AutoModelForCausalLM

    log(f"loading {args.model} ...")
    engine = LLMEngine(EngineConfig(model=args.model, max_model_len=2048, kv_cache_bytes=512 << 20,
                                    dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                                    quantization=args.quantization))
    tokenizer = engine.loaded.tokenizer
    log("loading transformers' copy ...")
    hf = AutoModelForCausalLM.from_pretrained(engine.loaded.hf_dir, dtype=getattr(torch, args.hf_dtype)).eval()
    chat = engine.loaded.chat_template is not None
    all_prompts = fold_prompts([encode_prompt(tokenizer, q, chat=chat) for q in QUESTIONS], hf.config.vocab_size)
    freeze_startup_heap()  # as a serving process does once started; transformers' copy gains alike

    bandwidths: list[float] = []  # one before each batch-1 run of baton
    wbytes = weight_bytes(engine)
    rows = []
    for batch in args.batch:
        prompts = (all_prompts * (batch // len(all_prompts) + 1))[:batch]
        runs: dict[str, list[float]] = {"baton": [], "transformers": []}
        for i in range(repeats):  # in turn, so drift in the machine's speed reaches both alike
            if batch == 1:
                log("measuring read bandwidth ...")
                bandwidths.append(read_bandwidth_gbs(repeats=3))
            log(f"batch {batch}: baton ({i + 1}/{repeats}) ...")
            runs["baton"].append(batch * new_tokens / time_baton(engine, prompts, new_tokens, args.sample))
            log(f"batch {batch}: transformers ({i + 1}/{repeats}) ...")
            runs["transformers"].append(
                batch * new_tokens / time_transformers(hf, tokenizer, prompts, new_tokens, args.sample))
        row = {
            "batch": batch, "new_tokens": new_tokens, "repeats": repeats,
            "baton_tok_s": statistics.median(runs["baton"]),
            "transformers_tok_s": statistics.median(runs["transformers"]),
            "baton_runs_tok_s": runs["baton"], "transformers_runs_tok_s": runs["transformers"],
        }
        row["speedup"] = row["baton_tok_s"] / row["transformers_tok_s"]
        # each run of baton over the transformers run timed right after it: drift between repeats cancels
        row["speedup_runs"] = [b / t for b, t in zip(runs["baton"], runs["transformers"], strict=True)]
        row["speedup_median_of_pairs"] = statistics.median(row["speedup_runs"])
        rows.append(row)
        log(f"batch {batch}: baton {row['baton_tok_s']:.1f} tok/s, transformers "
            f"{row['transformers_tok_s']:.1f} tok/s, x{row['speedup']:.2f} (pairs: "
            + " ".join(f"{x:.2f}" for x in row["speedup_runs"]) + ")")
    bandwidth = statistics.median(bandwidths) if bandwidths else read_bandwidth_gbs()
    roofline = bandwidth * 1e9 / wbytes
    result = {
        "bench": "engine", "model": args.gemma4_like or args.model, "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype, "hf_dtype": args.hf_dtype,
        "decoding": "sampled" if args.sample else "greedy",
        "hf_experts_implementation": getattr(hf.config, "_experts_implementation", None),
        "gemma4_layers": args.gemma4_layers if args.gemma4_like else None,
        "vocab_size": hf.config.vocab_size,
        "quantization": args.quantization, "precision": engine.precision.describe(),
        "weights": engine.loaded.model.weight_format.describe(), "machine": machine(),
        "read_bandwidth_gbs": bandwidth, "read_bandwidth_runs_gbs": bandwidths, "weight_bytes": wbytes,
        "roofline_batch1_tok_s": roofline,
        "rows": rows,
    }
    b1 = next((r for r in rows if r["batch"] == 1), None)
    if b1 is not None:
        # each run against the bandwidth measured right before it, then the median
        fractions = [tok * wbytes / (bw * 1e9) for tok, bw in zip(b1["baton_runs_tok_s"], bandwidths, strict=True)]
        result["batch1_fraction_of_roofline_runs"] = fractions
        result["batch1_fraction_of_roofline"] = statistics.median(fractions)
    path = write_results(result, args.out, "engine")
    log(f"wrote {path}")
    if args.gemma4_like is not None:
        write_block(Path(__file__).parent / "README.md", "engine_gemma4_moe", readme_table(args.out, args.gemma4_like))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
