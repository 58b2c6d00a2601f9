"""Decode throughput of each precision against fp32, in alternating rounds of one process.

One engine per precision (same model, same prompts), each timed in turn `--rounds` times at each batch size
(greedy, `--new-tokens` each, prefix cache emptied before every run), so the machine's drift reaches all
alike. Reported per precision and batch: median tok/s with its range, the median of the per-round ratios to
fp32 and their range, and at batch 1 the fraction of the DRAM roofline for the bytes that precision's decode
step reads (weights as stored; read bandwidth measured before each round, median).

    .venv/bin/python -m bench.precisions [--model smollm2-135m] [--batch 1 16] [--rounds 5] [--new-tokens 64]
        [--precisions float32 bfloat16 int8 gguf] [--isa avx2] [--readme]

`--isa` runs the CPU kernels at a lower instruction-set level than the CPU's best (the AVX2 paths on an
AVX-512 machine). Writes JSON to bench/results/precisions-<stamp>.json and prints it as the last line;
`--readme` regenerates bench/README.md's precisions table from it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from bench.engine import QUESTIONS, log, machine, read_bandwidth_gbs, time_baton, weight_bytes
from bench.results_file import write_results
from bench.serve_report import write_block
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.ops.cpu_isa import active_isa, best_isa, use_isa
from shared.tokenizer import encode_prompt

# name -> EngineConfig fields
PRECISIONS: dict[str, dict[str, str]] = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "bfloat16-weights-fp32-kv": {"dtype": "bfloat16", "kv_cache_dtype": "float32"},
    "int8": {"quantization": "int8", "kv_cache_dtype": "float32"},
    "int8-bf16-kv": {"quantization": "int8", "kv_cache_dtype": "bfloat16"},
    "q4_1": {"quantization": "q4_1", "kv_cache_dtype": "float32"},
    "gguf": {"quantization": "gguf", "kv_cache_dtype": "float32"},
    "gguf-bf16-kv": {"quantization": "gguf", "kv_cache_dtype": "bfloat16"},
}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--precisions", nargs="+", default=["float32", "bfloat16", "int8", "gguf"],
                        choices=list(PRECISIONS))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--isa", default=None, help="run the kernels at this level (default: the CPU's best)")
    parser.add_argument("--readme", action="store_true", help="regenerate bench/README.md's precisions table")
    args = parser.parse_args()
    if args.isa is None:
        result = run(args)
    else:
        with use_isa(args.isa):
            result = run(args)
    path = write_results(result, args.out, "precisions", record_name=True)
    log(f"wrote {path}")
    if args.readme:
        write_block(Path(__file__).parent / "README.md", f"precisions:{result['isa']}", readme_table(result))
    print(json.dumps(result))


def readme_table(result: dict[str, Any]) -> str:
    """The README's decode-throughput table of one run."""
    lines = [f"Decode throughput by precision (`{result['file']}`: {result['model']}, {result['new_tokens']} new "
             f"tokens a request, {result['rounds']} alternating rounds, kernels at {result['isa']}, "
             f"{result['threads']} threads, read bandwidth {result['read_bandwidth_gbs']['median']:.1f} GB/s; "
             "bench/precisions.py):", "",
             "| batch | precision | weights | KV cache | tok/s (range) | vs fp32 (range) | of batch-1 roofline |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        roof = f"{r['fraction_of_roofline']:.0%}" if "fraction_of_roofline" in r else "-"
        lines.append(f"| {r['batch']} | {r['precision']} | {r['weights']} | {r['kv_cache_dtype']} | "
                     f"{r['tok_s']['median']:.1f} ({r['tok_s']['min']:.1f}-{r['tok_s']['max']:.1f}) | "
                     f"{r['vs_float32']['median']:.2f} ({r['vs_float32']['min']:.2f}-{r['vs_float32']['max']:.2f}) | "
                     f"{roof} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = ["float32", *[n for n in args.precisions if n != "float32"]]
    engines: dict[str, LLMEngine] = {}
    for name in names:
        log(f"loading {args.model} as {name} ...")
        engines[name] = LLMEngine(EngineConfig(model=args.model, max_model_len=2048, kv_cache_bytes=256 << 20,
                                               **PRECISIONS[name]))  # type: ignore[arg-type]
    tokenizer = engines["float32"].loaded.tokenizer
    chat = engines["float32"].loaded.chat_template is not None
    prompts = [encode_prompt(tokenizer, q, chat=chat) for q in QUESTIONS]
    wbytes = {n: weight_bytes(e) for n, e in engines.items()}
    runs: dict[int, dict[str, list[float]]] = {b: {n: [] for n in names} for b in args.batch}
    bandwidths: list[float] = []
    for r in range(args.rounds):
        bandwidths.append(read_bandwidth_gbs(repeats=3))
        for batch in args.batch:
            batch_prompts = (prompts * (batch // len(prompts) + 1))[:batch]
            order = names if r % 2 == 0 else names[::-1]  # alternate who goes first
            for name in order:
                seconds = time_baton(engines[name], batch_prompts, args.new_tokens)
                runs[batch][name].append(batch * args.new_tokens / seconds)
            log(f"round {r + 1}/{args.rounds}, batch {batch}: " + ", ".join(
                f"{n} {runs[batch][n][-1]:.1f}" for n in names) + " tok/s")
    bandwidth = statistics.median(bandwidths)
    rows: list[dict[str, Any]] = []
    for batch in args.batch:
        for name in names:
            tok = runs[batch][name]
            ratios = [t / f for t, f in zip(tok, runs[batch]["float32"], strict=True)]
            row = {"precision": name, "batch": batch, "tok_s": spread(tok), "runs_tok_s": tok,
                   "vs_float32": spread(ratios), "weight_bytes": wbytes[name],
                   "weights": engines[name].loaded.model.weight_format.describe(),
                   "kv_cache_dtype": str(engines[name].layout.dtype).removeprefix("torch.")}
            if batch == 1:
                roofline = bandwidth * 1e9 / wbytes[name]
                row["roofline_tok_s"] = roofline
                row["fraction_of_roofline"] = statistics.median(tok) / roofline
            rows.append(row)
            log(f"batch {batch} {name}: {row['tok_s']['median']:.1f} tok/s ({row['tok_s']['min']:.1f}-"
                f"{row['tok_s']['max']:.1f}), x{row['vs_float32']['median']:.2f} of fp32 "
                f"({row['vs_float32']['min']:.2f}-{row['vs_float32']['max']:.2f})"
                + (f", {row['fraction_of_roofline']:.0%} of its roofline" if batch == 1 else ""))
    return {"bench": "precisions", "model": args.model, "new_tokens": args.new_tokens, "rounds": args.rounds,
            "isa": active_isa(), "best_isa": best_isa(), "threads": torch.get_num_threads(), "machine": machine(),
            "read_bandwidth_gbs": spread(bandwidths), "rows": rows}


if __name__ == "__main__":
    main()
