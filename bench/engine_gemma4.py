"""bench/engine.py's Gemma 4 config: a random checkpoint sized like a published model, and its step bytes.

The published MoE (gemma-4-26B-A4B) is 30 layers of 128 experts; two of its
layers with a 32k vocabulary are 3.5 GB of bf16 weights, which baton and
transformers (fp32: twice that) can hold side by side in this machine's memory.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from shared.models.gemma4.tiny import write_published_like
from shared.models.loader import DEFAULT_CACHE_DIR, resolve_model
from shared.ops.linear import LinearWeight

logger = logging.getLogger(__name__)


def bench_checkpoint(name: str, num_layers: int, vocab_size: int) -> Path:
    """The checkpoint's directory, written on first use (bf16, seed 0) and reused after."""
    out = DEFAULT_CACHE_DIR / "bench-gemma4" / f"{name}-l{num_layers}-v{vocab_size}-bf16"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        write_published_like(out, name, num_layers, vocab_size, torch.bfloat16, resolve_model("gemma3-270m"))
    return out


def fold_prompts(prompts: list[list[int]], vocab_size: int) -> list[list[int]]:
    """Token ids of a bigger tokenizer folded into the model's vocabulary (both systems get the same ids)."""
    return [[t % vocab_size for t in p] for p in prompts]


def _nbytes(value: Any) -> int:
    if isinstance(value, LinearWeight):
        return value.nbytes
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return 0


def gemma4_step_bytes(model: Any) -> int:
    """Bytes one decode step of one token reads from a Gemma4TextLM: every layer's projections and norms, the
    router and the top-k experts of each MoE layer, the final norm and the LM head (embedding rows are
    gathered, not streamed)."""
    w = model.w
    total = w.lm_head.nbytes + _nbytes(w.norm_final) + _nbytes(w.ple_projection)
    for layer in w.layers:
        total += sum(_nbytes(v) for v in vars(layer).values())
        if layer.ple is not None:
            total += sum(_nbytes(v) for v in vars(layer.ple).values())
        if layer.moe is not None:
            moe = layer.moe
            total += sum(_nbytes(v) for v in (moe.router.scale, moe.router.proj, moe.norm_mlp_out,
                                                moe.norm_experts_in, moe.norm_experts_out))
            total += moe.router.top_k * moe.experts.expert_nbytes
    return total


def readme_table(results_dir: Path, name: str) -> str:
    """bench/README.md's table of every engine run on `name`'s config (each configuration tried is a row)."""
    import json

    runs = []
    for path in sorted(results_dir.glob("engine-*.json")):
        result = json.loads(path.read_text())
        if result.get("model") == name:
            runs.append((path.name, result))
    lines = [f"Engine against transformers on a random {name} cut to a few layers (`bench/engine.py --gemma4-like "
             f"{name}`: its hidden size, heads, head dims, 128 experts, top 8, expert width; same weights, same "
             "run, systems timed in turn; tok/s medians, speedup = median of each baton run over the "
             "transformers run after it). Greedy decoding of random weights sends every sequence of a batch "
             "down the same tokens, so a batch-16 step hits 8 experts a layer; sampled runs hit ~82, as a trained "
             "router spreads tokens:", "",
             "| run | layers, vocab | baton weights | transformers dtype (experts) | decoding | batch "
             "| new tokens x repeats | baton tok/s | transformers tok/s | speedup (pairs) | read GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for file, r in runs:
        for row in r["rows"]:
            pairs = " ".join(f"{x:.2f}" for x in row["speedup_runs"])
            weights = r["dtype"] if r.get("quantization", "none") == "none" else r.get("weights", r["quantization"])
            lines.append(f"| `{file}` | {r.get('gemma4_layers')}, {r.get('vocab_size')} | {weights} | "
                         f"{r.get('hf_dtype', 'float32')} ({r.get('hf_experts_implementation')}) | "
                         f"{r.get('decoding', 'greedy')} | {row['batch']} | "
                         f"{row['new_tokens']} x {row['repeats']} | {row['baton_tok_s']:.1f} | "
                         f"{row['transformers_tok_s']:.1f} | {row['speedup_median_of_pairs']:.2f}x ({pairs}) | "
                         f"{r['read_bandwidth_gbs']:.1f} |")
    return "\n".join(lines)
